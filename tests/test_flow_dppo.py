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
from trl_flow.trainers.base_trainer import StepOutput

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


@pytest.mark.parametrize("sampler", ["flow_sde", "cps"])
def test_flow_dppo_trains_and_keeps_invariants(tmp_path, sampler):
    """The preset as released (2 inner epochs, beta 1e-3 on the exact KL to the reference, the default delta)."""
    # lr 3e-3: one update of the tiny model must leave the default (released-code) region for the mask to act
    config = tiny_config(tmp_path, FlowDPPOConfig, sampler=sampler, beta=1e-3, learning_rate=3e-3)
    assert (config.num_inner_epochs, config.kl_form) == (2, "exact")
    delta = config.resolved_kl_mask_delta
    trainer = FlowDPPOTrainer(config, tiny_sd3_pipeline(), [brightness], train_dataset=list(PROMPTS))
    before = lora(trainer)
    trainer.train()
    logs = trainer.state.log_history
    check_invariants(logs, 2)
    assert all(e["kl"] > 0 for e in logs)  # the beta-KL to the reference (after the first update it is > 0)
    assert all(e["kl_old_max"] > delta for e in logs)  # the second epoch leaves the region ...
    assert any(e["mask_frac"] > 0 for e in logs)  # ... and the mask acts
    after = lora(trainer)
    assert any(not torch.equal(before[n], after[n]) for n in before)
    assert all(torch.isfinite(p).all() for p in after.values())


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
