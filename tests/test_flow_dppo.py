"""FlowDPPOTrainer (Flow-DPPO, arXiv 2606.11025) and the KL-mask trust region composed with the other trainers:
each combination trains on the tiny offline SD3 pipeline and keeps its invariants (first ratio exactly 1, first
old-vs-new KL exactly 0, finite weights), and the objective is the documented one."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from conftest import PROMPTS, brightness, tiny_config

from trl_flow import FlowDPPOConfig, FlowDPPOTrainer, FlowGRPOConfig, FlowGRPOTrainer, OPGRPOConfig, OPGRPOTrainer
from trl_flow.models import Schedule
from trl_flow.testing import tiny_sd3_pipeline
from trl_flow.trainers.policy_gradient_trainer import StepOutput
from trl_flow.trainers.flow_dppo_config import PAPER_ABLATION_BETA, RELEASED_CODE

MASK_KEYS = ("mask_frac", "mask_frac_pos_adv", "mask_frac_neg_adv", "kl_old", "kl_old_max", "kl_old_first_max",
             "ratio", "ratio_max", "ratio_min", "ratio_first_max_dev")


def lora(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def check_invariants(logs, steps):
    assert [e["step"] for e in logs] == list(range(1, steps + 1))
    for e in logs:
        for key in MASK_KEYS:
            assert key in e and math.isfinite(e[key]), (key, e)
        assert e["ratio_first_max_dev"] == 0.0 and e["kl_old_first_max"] == 0.0, e  # nothing moved yet
        assert 0 <= e["mask_frac"] <= 1 and 0 <= e["mask_frac_pos_adv"] <= 1 and 0 <= e["mask_frac_neg_adv"] <= 1
        assert e["kl_old_max"] >= e["kl_old"] >= 0 and e["nonfinite_skipped"] == 0
        assert "clip_frac" not in e  # no clip in this objective


def test_defaults_are_the_released_codes_with_the_papers_forms_as_options():
    """Pins FlowDPPOConfig's defaults to the values we transcribed from the cited sources (this cannot read UniRL
    itself; the file:line citations are in docs/methods.md): the released code (UniRL 1a7b501) does one pass
    (`num_updates_per_batch: 2` = 2 optimizer steps over disjoint halves, stack.py), has no reference-KL term
    (beta 0) and masks at kl_mask_threshold 1e-5; the paper's ablation beta 1e-3 and two passes are named options.
    Each help text must name both sources."""
    c = FlowDPPOConfig()
    assert (c.num_inner_epochs, c.beta, c.resolved_kl_mask_delta, c.kl_form) == (1, 0.0, 1e-5, "exact")
    assert PAPER_ABLATION_BETA == 1e-3 and RELEASED_CODE.startswith("Tencent-Hunyuan/UniRL@")
    fields = FlowDPPOConfig.__dataclass_fields__
    for name, option in (("num_inner_epochs", "Named option: 2"), ("beta", "Named option: 1e-3")):
        text = fields[name].metadata["help"]
        assert "released code (UniRL" in text and option in text and "paper" in text, (name, text)
    assert "released code" in FlowDPPOConfig.__doc__ and "arXiv 2606.11025" in FlowDPPOConfig.__doc__


def test_default_run_uses_each_sample_once_in_the_flow_grpo_schedule(tmp_path, monkeypatch):
    """The released code's schedule: one pass, optimizer steps over disjoint minibatches, every trajectory used once
    per trained step, all against one frozen anchor (first ratio exactly 1). With the shared batch settings a
    default Flow-DPPO iteration takes the same optimizer steps as a default Flow-GRPO one (here 8 trajectories in
    microbatches of 4: 2 steps, like the code's 2); the 2-pass option doubles them and uses every sample twice."""
    def run(config_class, trainer_class, name, **kw):
        config = tiny_config(tmp_path, config_class, max_steps=1, output_dir=str(tmp_path / name), **kw)
        trainer = trainer_class(config, tiny_sd3_pipeline(), [brightness], train_dataset=list(PROMPTS))
        seen, steps = [], []
        forward, opt_step = trainer.forward_step, trainer._optimizer_step
        monkeypatch.setattr(trainer, "forward_step",
                            lambda r, idx, k, **a: seen.append((k, tuple(idx.tolist()))) or forward(r, idx, k, **a))
        monkeypatch.setattr(trainer, "_optimizer_step", lambda: steps.append(len(seen)) or opt_step())
        trainer.train()
        return trainer, seen, steps

    dppo, seen, steps = run(FlowDPPOConfig, FlowDPPOTrainer, "dppo")
    grpo, _, grpo_steps = run(FlowGRPOConfig, FlowGRPOTrainer, "grpo")
    n = dppo.config.train_batch_size
    assert (dppo.optimizer_steps_per_iteration == grpo.optimizer_steps_per_iteration == len(steps) == len(grpo_steps)
            == 2)
    for k in {k for k, _ in seen}:  # every trained step sees every trajectory exactly once, in disjoint minibatches
        used = [i for kk, idx in seen if kk == k for i in idx]
        assert sorted(used) == list(range(n)), (k, used)
    assert dppo.state.log_history[-1]["ratio_first_max_dev"] == 0.0
    two, seen2, steps2 = run(FlowDPPOConfig, FlowDPPOTrainer, "dppo2", num_inner_epochs=2)
    assert two.optimizer_steps_per_iteration == len(steps2) == 4 and len(seen2) == 2 * len(seen)


@pytest.mark.parametrize("sampler", ["flow_sde", "cps"])
def test_flow_dppo_trains_and_keeps_invariants(tmp_path, sampler):
    """The preset with its defaults (one pass in 2 optimizer steps, beta 0, the default delta): the second step's
    minibatch is already off-policy, so the mask acts in one pass."""
    # lr 1e-2: the one update before the second minibatch must leave the default (released-code) region for the
    # mask to act (flow_sde at 3e-3 stays below 1e-5)
    config = tiny_config(tmp_path, FlowDPPOConfig, sampler=sampler, learning_rate=1e-2)
    assert (config.num_inner_epochs, config.beta) == (1, 0.0)
    delta = config.resolved_kl_mask_delta
    trainer = FlowDPPOTrainer(config, tiny_sd3_pipeline(), [brightness], train_dataset=list(PROMPTS))
    before = lora(trainer)
    trainer.train()
    logs = trainer.state.log_history
    check_invariants(logs, 2)
    assert all(e["kl_old_max"] > delta for e in logs)  # the second minibatch is past the region ...
    assert any(e["mask_frac"] > 0 for e in logs)  # ... and the mask acts
    after = lora(trainer)
    assert any(not torch.equal(before[n], after[n]) for n in before)
    assert all(torch.isfinite(p).all() for p in after.values())


def test_flow_dppo_papers_options_train(tmp_path):
    """The paper's forms as options: two passes and beta 1e-3 on the exact kernel KL to the reference."""
    config = tiny_config(tmp_path, FlowDPPOConfig, num_inner_epochs=2, beta=PAPER_ABLATION_BETA, learning_rate=3e-3)
    trainer = FlowDPPOTrainer(config, tiny_sd3_pipeline(), [brightness], train_dataset=list(PROMPTS))
    trainer.train()
    logs = trainer.state.log_history
    check_invariants(logs, 2)
    assert all(e["kl"] > 0 for e in logs)  # the beta-KL to the reference (after the first update it is > 0)
    assert all(torch.isfinite(p).all() for p in lora(trainer).values())


def test_unmasked_objective_is_the_unclipped_one_and_the_mask_changes_the_update(tmp_path):
    """With a threshold nothing reaches, Flow-DPPO's update is -mean(rho A): the same weights as Flow-GRPO with a
    clip range nothing reaches (ratios stay within 1 +- 0.99); with the default threshold it differs."""
    def run(config_class, trainer_class, **kw):
        out = tmp_path / f"run{len(list(tmp_path.glob('run*')))}"  # a new run needs a folder of its own
        config = tiny_config(tmp_path, config_class, max_steps=1, num_inner_epochs=2, output_dir=str(out), **kw)
        trainer = trainer_class(config, tiny_sd3_pipeline(), [brightness], train_dataset=list(PROMPTS))
        trainer.train()
        return lora(trainer), trainer.state.log_history[-1]

    free, m_free = run(FlowDPPOConfig, FlowDPPOTrainer, kl_mask_delta=1e9, beta=0.0)
    clip, m_clip = run(FlowGRPOConfig, FlowGRPOTrainer, clip_range=0.99)
    masked, m_masked = run(FlowDPPOConfig, FlowDPPOTrainer, kl_mask_delta=1e-9, beta=0.0)
    assert m_free["mask_frac"] == 0.0 and m_clip["clip_frac"] == 0.0 and m_masked["mask_frac"] > 0
    for n in free:
        torch.testing.assert_close(free[n], clip[n], rtol=0, atol=1e-7)
    assert max(float((free[n] - masked[n]).abs().max()) for n in free) > 1e-5
    # the old-vs-new KL is logged for the clip objective too, and equals the unmasked run's (same updates)
    assert m_clip["kl_old_max"] == pytest.approx(m_free["kl_old_max"], rel=1e-4)


def test_compute_loss_matches_the_masked_objective(tmp_path):
    """compute_loss with trust_region='kl_mask' against a by-hand computation: D from mu_old and mu_theta with the
    kernel std, the mask, -M rho A, plus beta times the reference KL in its kl_form."""
    trainer = FlowGRPOTrainer(tiny_config(tmp_path, trust_region="kl_mask", kl_mask_delta=0.01, beta=0.5,
                                          kl_form="exact"),
                              tiny_sd3_pipeline(), [brightness], train_dataset=list(PROMPTS))
    B, K = 5, 3
    old = torch.tensor([[0.0, -1.0, 0.0], [0.0, 0.5, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    adv = torch.tensor([1.0, -2.0, 0.5, 3.0, -1.0])
    mask = torch.tensor([[True] * K] * 4 + [[False] * K])  # sample 4 has no reward
    means = torch.zeros(B, K, 2, 2)
    means[:, 1] = torch.tensor([0.0, 0.1, 0.3, 0.05, 0.2])[:, None, None]  # mu_old at step 1
    schedule = Schedule(sigmas=torch.tensor([1.0, 0.8, 0.5, 0.0]), timesteps=torch.tensor([1000.0, 800.0, 500.0]))
    rollout = SimpleNamespace(log_probs=old, advantages=adv, train_mask=mask, schedule=schedule, means=means,
                              mean=lambda idx, k: means[idx, k],  # Rollout.mean
                              extras={"step_kinds": ["flow_sde", "flow_sde", "ode"]})
    new_lp = torch.tensor([-0.8, 0.3, 2.05, -0.1, 1.0], requires_grad=True)
    ref_mean = torch.stack([torch.full((2, 2), 0.1 * i) for i in range(B)])
    out = StepOutput(log_prob=new_lp, mean=torch.zeros(B, 2, 2), std=torch.tensor(0.5), ref_mean=ref_mean)
    loss, stats = trainer.compute_loss(rollout, torch.arange(B), 1, out)
    expected, blocked = [], []
    for i in range(4):  # by hand, per valid sample
        rho = math.exp(float(new_lp[i].detach()) - float(old[i, 1]))
        a = float(adv[i])
        d = float(means[i, 1, 0, 0]) ** 2 / (2 * 0.25)
        away = (a > 0 and rho > 1) or (a < 0 and rho < 1)
        blocked.append(d > 0.01 and away)
        expected.append((0.0 if blocked[-1] else -a * rho) + 0.5 * (0.1 * i) ** 2 / (2 * 0.25))
    # sample 0: rho > 1, A > 0, D = 0 (inside); 1: rho < 1, A < 0, D = 0.02 (blocked); 2: rho > 1, A > 0,
    # D = 0.18 (blocked); 3: rho < 1, A > 0, D = 0.005 (moving back: kept)
    assert blocked == [False, True, True, False]
    assert float(loss.detach()) == pytest.approx(sum(expected) / 4, rel=1e-5)
    assert stats["mask_frac"].tolist()[:4] == [0.0, 1.0, 1.0, 0.0]
    torch.testing.assert_close(stats["kl_old"][:4], torch.tensor([0.0, 0.02, 0.18, 0.005]), rtol=1e-5, atol=0)
    loss.backward()
    assert new_lp.grad[1] == 0 and new_lp.grad[2] == 0 and new_lp.grad[4] == 0
    assert new_lp.grad[0] != 0 and new_lp.grad[3] != 0


def test_flow_grpo_with_kl_mask(tmp_path):
    """Flow-GRPO's trainer with the KL mask, one inner epoch in 4 optimizer steps: the later microbatches see a
    moved policy; with delta = 0 every step away from the old policy is blocked, every step back is not."""
    config = tiny_config(tmp_path, trust_region="kl_mask", kl_mask_delta=0.0, per_device_train_batch_size=2)
    trainer = FlowGRPOTrainer(config, tiny_sd3_pipeline(), [brightness], train_dataset=list(PROMPTS))
    before = lora(trainer)
    trainer.train()
    logs = trainer.state.log_history
    check_invariants(logs, 2)
    assert all(0 < e["mask_frac"] < 1 and e["kl_old_max"] > 0 for e in logs)
    assert any(not torch.equal(before[n], p) for n, p in lora(trainer).items())


def test_op_grpo_with_kl_mask(tmp_path):
    """OP-GRPO with the KL mask: the first ratio is 1 and the first KL 0 for fresh and replayed samples alike, the
    replayed samples carry importance weights != 1, which multiply the kept term, and the buffer fills."""
    torch.manual_seed(0)
    config = OPGRPOConfig(
        output_dir=str(tmp_path), max_steps=3, num_generations=2, prompts_per_step=4, off_policy_fraction=0.5,
        height=32, width=32, num_inference_steps=4, truncation_step=2, per_device_train_batch_size=1,
        max_sequence_length=16, guidance_scale=1.0, beta=0.0, lora_r=4, lora_alpha=8, learning_rate=1e-2,
        num_inner_epochs=2, trust_region="kl_mask", disable_tqdm=True)
    trainer = OPGRPOTrainer(config, tiny_sd3_pipeline(), [brightness], train_dataset=[f"p{i}" for i in range(8)])
    trainer.train()
    logs = trainer.state.log_history
    check_invariants(logs, 3)
    assert len(trainer.replay_buffer) > 0 and logs[-1]["buffer/size"] > 0
    assert all(e["off_policy_share"] > 0 for e in logs[1:])
    assert any(abs(e["is_weight/mean"] - 1.0) > 1e-6 for e in logs[1:])
    for e in logs[1:]:
        assert 0 <= e["mask_frac_off_policy"] <= 1 and 0 <= e["mask_frac_on_policy"] <= 1
        assert "clip_frac_off_policy" not in e
    assert any(e["mask_frac_off_policy"] > 0 for e in logs[1:])
    # the importance weight multiplies the kept term: compute_loss on a reused step == -mean(M w rho A)
    r = trainer.last_rollout
    rep = torch.nonzero(r.extras["reused"][:, 0]).flatten()
    w = r.extras["is_weights"][rep, 0]
    assert len(rep) and (w != 1).all()
    out = trainer.forward_step(r, rep, 0, need_ref=False)
    loss, stats = trainer.compute_loss(r, rep, 0, out)
    rho = torch.exp(out.log_prob.detach() - r.log_probs[rep, 0])
    keep = stats["mask_frac"] == 0
    expected = torch.where(keep, -w * rho * r.advantages[rep], torch.zeros_like(rho)).mean()
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-6, atol=0)


def test_docstring_example_runs(tmp_path, monkeypatch):
    import re
    import textwrap

    code = textwrap.dedent(re.search(r"```python\n(.*?)```", FlowDPPOTrainer.__doc__, re.S).group(1))
    monkeypatch.chdir(tmp_path)
    scope = {}
    exec(compile(code, "FlowDPPOTrainer.__doc__", "exec"), scope)
    trainer = scope["trainer"]
    assert trainer.config.sampler == "cps" and trainer.state.global_step == 2
    assert (tmp_path / "out" / "final" / "pytorch_lora_weights.safetensors").exists()
    check_invariants(trainer.state.log_history, 2)


# ------------------------------------------------------- the released code's trained steps and step-0 std (UniRL)
def _released_form(tmp_path, name, **kw):
    """Flow-DPPO as UniRL's recipe trains it (3 random SDE steps among the first half of 10, ODE elsewhere, CFG 1,
    no weight decay, its step-0 std in the KL), on the tiny pipeline."""
    kw = {"num_inference_steps": 10, "sde_steps_mode": "random", "sde_window_size": 3, "sde_window_range": 5,
          "kl_mask_first_step": "clamp", "guidance_scale": 1.0, "weight_decay": 0.0, "learning_rate": 1e-2, **kw}
    return tiny_config(tmp_path, FlowDPPOConfig, output_dir=str(tmp_path / name), **kw)


def test_random_sde_steps_are_k_distinct_steps_in_the_range_and_seeded(tmp_path):
    """`sde_steps_mode="random"`: exactly sde_window_size SDE steps, distinct, all in [0, sde_window_range), drawn
    from (seed, step) (the same trainer, a second trainer and a resumed run draw the same), not always consecutive,
    and moving between iterations; `window` keeps its consecutive block."""
    tr = FlowDPPOTrainer(_released_form(tmp_path, "a"), tiny_sd3_pipeline(), [brightness],
                         train_dataset=list(PROMPTS))
    again = FlowDPPOTrainer(_released_form(tmp_path, "b"), tiny_sd3_pipeline(), [brightness],
                            train_dataset=list(PROMPTS))
    other = FlowDPPOTrainer(_released_form(tmp_path, "c", seed=7), tiny_sd3_pipeline(), [brightness],
                            train_dataset=list(PROMPTS))
    draws = []
    for step in range(20):
        kinds = tr._step_kinds(step)
        sde = [k for k, kind in enumerate(kinds) if kind != "ode"]
        assert len(sde) == 3 and all(k < 5 for k in sde) and set(kinds) == {"flow_sde", "ode"}, (step, kinds)
        assert kinds == tr._step_kinds(step) == again._step_kinds(step)
        draws.append(tuple(sde))
    assert len(set(draws)) > 3  # they move between iterations
    assert any(d[-1] - d[0] > 2 for d in draws)  # not a consecutive window
    assert any(other._step_kinds(s) != tr._step_kinds(s) for s in range(20))  # the seed matters
    window = FlowDPPOConfig(**{**_released_form(tmp_path, "d").to_dict(), "sde_steps_mode": "window"})
    tw = FlowDPPOTrainer(window, tiny_sd3_pipeline(), [brightness], train_dataset=list(PROMPTS))
    for step in range(5):
        sde = [k for k, kind in enumerate(tw._step_kinds(step)) if kind != "ode"]
        assert sde == list(range(sde[0], sde[0] + 3)) and sde[0] < 5


def test_random_sde_steps_config_checks(tmp_path):
    for bad in ({"sde_window_range": 2}, {"sde_window_range": 10}, {"sde_steps_mode": "some"}):
        with pytest.raises(ValueError, match="sde_window_range|sde_steps_mode"):
            _released_form(tmp_path, "x", **bad)
    with pytest.raises(ValueError, match="kl_mask_first_step"):
        _released_form(tmp_path, "x", sampler="cps", noise_level=0.5)
    with pytest.raises(ValueError, match="sde_window_size"):  # OP-GRPO replays fixed prefixes: refused as before
        tiny_config(tmp_path, OPGRPOConfig, num_inference_steps=10, sde_window_size=3, sde_steps_mode="random")
    assert _released_form(tmp_path, "x", sde_window_range=9).sde_window_range == 9  # any range before the last step


def test_released_form_trains_only_the_drawn_steps_with_first_ratio_one(tmp_path, monkeypatch):
    """Two iterations: each trains exactly its 3 drawn steps (the rest are ODE: no log-prob, never trained), the
    first ratio of every iteration is exactly 1 and nothing has moved before the first update."""
    tr = FlowDPPOTrainer(_released_form(tmp_path, "a", max_steps=2), tiny_sd3_pipeline(), [brightness],
                         train_dataset=list(PROMPTS))
    seen, rollouts = [], []
    forward, make = tr.forward_step, tr.make_rollout
    monkeypatch.setattr(tr, "forward_step", lambda r, idx, k, **a: seen[-1].add(k) or forward(r, idx, k, **a))
    monkeypatch.setattr(tr, "make_rollout", lambda step: seen.append(set()) or rollouts.append(make(step))
                        or rollouts[-1])
    tr.train()
    for step, (ks, ro) in enumerate(zip(seen, rollouts)):
        drawn = {k for k, kind in enumerate(tr._step_kinds(step)) if kind != "ode"}
        assert ks == drawn and len(drawn) == 3
        assert ro.train_mask.any(0).nonzero().flatten().tolist() == sorted(drawn)
        assert bool((ro.log_probs[:, sorted(set(range(10)) - drawn)] == 0).all())
    check_invariants(tr.state.log_history, 2)


def test_step0_std_rule_of_the_kl(tmp_path):
    """`kl_mask_first_step="clamp"`: the old-vs-new KL at step 0 uses a sqrt(s / (1 - min(s, 0.99))) sqrt(s - s')
    (UniRL's flowdppo.py), elsewhere the kernel's own std; `next_sigma` uses the kernel's std everywhere. The
    rollout's std (and log-probs) do not change."""
    tr = FlowDPPOTrainer(_released_form(tmp_path, "a"), tiny_sd3_pipeline(), [brightness],
                         train_dataset=list(PROMPTS))
    sig = tr.adapter.schedule(10, 32, 32).sigmas.cpu()
    assert float(sig[0]) == 1.0
    kernel_std = [0.7 * math.sqrt(float(sig[k]) / (1 - float(sig[k + 1] if k == 0 else sig[k])))
                  * math.sqrt(float(sig[k] - sig[k + 1])) for k in range(9)]
    rollout = SimpleNamespace(schedule=SimpleNamespace(sigmas=sig),
                              extras={"step_kinds": ["flow_sde"] * 9 + ["ode"]})
    for k in range(9):
        out = SimpleNamespace(std=torch.tensor(kernel_std[k]), mean=torch.zeros(2, 4, 4, 4))
        got = float(tr.kl_old_std(rollout, k, out).flatten()[0])
        want = 0.7 * math.sqrt(1 / (1 - 0.99)) * math.sqrt(1 - float(sig[1])) if k == 0 else kernel_std[k]
        assert math.isclose(got, want, rel_tol=1e-5), (k, got, want)
    assert float(tr.kl_old_std(rollout, 0, out).flatten()[0]) > 1.5 * kernel_std[0]  # step 0 differs: can fail
    tr.config.kl_mask_first_step = "next_sigma"
    assert tr.kl_old_std(rollout, 0, out) is out.std  # the kernel's own


def test_released_form_resumes_to_the_uninterrupted_run(tmp_path):
    """The random steps come from (seed, step): a run stopped at step 2 and resumed draws the same steps and ends
    bit for bit where an uninterrupted run does."""
    def make(name, **kw):
        return FlowDPPOTrainer(_released_form(tmp_path, name, **kw), tiny_sd3_pipeline(), [brightness],
                               train_dataset=list(PROMPTS))

    full = make("a", max_steps=4)
    full.train()
    part = make("b", max_steps=2, save_steps=2)
    part.train()
    del part
    torch.manual_seed(1234)  # everything must come from the checkpoint and the seed
    resumed = make("b", max_steps=4, save_steps=2)
    resumed.train(resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-2"))
    wa, wb = lora(full), lora(resumed)
    assert wa and all(torch.equal(wa[n], wb[n]) for n in wa)
    for a, b in zip(full.state.log_history[2:], resumed.state.log_history[2:]):
        assert a["step"] == b["step"] and a["loss"] == b["loss"] and a["kl_old_max"] == b["kl_old_max"]
