"""StepwiseFlowGRPOTrainer on the tiny SD3 pipeline (fp32, CPU): intermediate rewards, gains, per-step
advantages, what is trained, config errors, and a short training run on a dense reward."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from conftest import PROMPTS, brightness, tiny_config

from trl_flow import StepwiseFlowGRPOConfig, StepwiseFlowGRPOTrainer
from trl_flow.kernels import kernel_mean_std, sde_step
from trl_flow.models import index_embeds
from trl_flow.trainers.stepwise_flow_grpo_trainer import step_advantages, substep_sigmas


def make(tmp_path, fresh_pipe, rewards=(brightness,), **overrides):
    overrides.setdefault("num_substeps", 3)
    config = tiny_config(tmp_path, StepwiseFlowGRPOConfig, **overrides)
    return StepwiseFlowGRPOTrainer(config, fresh_pipe(), list(rewards), train_dataset=list(PROMPTS))


def log_at(trainer, step, key):
    vals = [e[key] for e in trainer.state.log_history if e["step"] == step and key in e]
    assert len(vals) == 1, (step, key)
    return vals[0]


class TransformerCalls:
    """Counts forward calls of a transformer (a forward hook)."""

    def __init__(self, model):
        self.n = 0
        self.handle = model.register_forward_hook(self._hook)

    def _hook(self, *args):
        self.n += 1


# ------------------------------------------------------------------------------------------------ config
def test_config_defaults_and_bad_values(tmp_path):
    import trl

    cfg = StepwiseFlowGRPOConfig(output_dir=str(tmp_path))
    assert ((cfg.sampler, cfg.same_noise_per_group, cfg.num_substeps, cfg.gain_normalization)
            == ("flow_sde", True, 2, "joint"))
    for field in dataclasses.fields(StepwiseFlowGRPOConfig):
        assert len(field.metadata.get("help", "")) > 10, field.name
    for bad, name in (({"num_substeps": 0}, "num_substeps"), ({"num_substeps": 2.5}, "num_substeps"),
                      ({"gain_normalization": "batch"}, "gain_normalization"),
                      ({"scale_rewards": "group"}, "scale_rewards"), ({"clip_range": 0.0}, "clip_range")):
        with pytest.raises(ValueError, match=name):
            StepwiseFlowGRPOConfig(output_dir=str(tmp_path), **bad)
    (parsed,) = trl.TrlParser((StepwiseFlowGRPOConfig,)).parse_args_into_dataclasses(
        ["--output_dir", "x", "--num_substeps", "1", "--gain_normalization", "per_step", "--sampler", "cps"])
    assert (parsed.num_substeps, parsed.gain_normalization, parsed.sampler) == (1, "per_step", "cps")
    assert parsed.same_noise_per_group is True


# ---------------------------------------------------------------------------------------------- advantages
def test_step_advantages_joint_and_per_step_normalisation():
    gen = torch.Generator().manual_seed(0)
    gains = torch.randn(8, 5, generator=gen) * 3 + 1
    gains[:, 0] = float("nan")  # an untrained step
    gains[2, 3] = float("nan")  # a missing intermediate reward
    group_ids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    valid = ~torch.isnan(gains)
    joint = step_advantages(gains, group_ids, "joint", clip=None)
    assert bool((joint[~valid] == 0).all())
    for g in (0, 1):
        sel = gains[valid & (group_ids == g)[:, None]]
        a = joint[valid & (group_ids == g)[:, None]]
        expected = (sel - sel.mean()) / (sel.std(unbiased=False) + 1e-4)
        torch.testing.assert_close(a, expected)
        assert abs(float(a.mean())) < 1e-6 and float(a.std(unbiased=False)) == pytest.approx(1.0, abs=1e-3)
    per_step = step_advantages(gains, group_ids, "per_step", clip=None)
    for g in (0, 1):
        for k in range(1, 5):
            m = valid[:, k] & (group_ids == g)
            a = per_step[m, k]
            assert abs(float(a.mean())) < 1e-6 and float(a.std(unbiased=False)) == pytest.approx(1.0, abs=1e-3)
    assert not torch.allclose(joint, per_step)
    assert float(step_advantages(gains * 100, group_ids, "joint", clip=2.0).abs().max()) <= 2.0
    grid = substep_sigmas(torch.tensor([1.0, 0.3]), 4)
    torch.testing.assert_close(grid, torch.tensor([[1.0, 0.75, 0.5, 0.25, 0.0], [0.3, 0.225, 0.15, 0.075, 0.0]]))


# ------------------------------------------------------------------------------- the clean-image estimate
@pytest.mark.parametrize("num_substeps", [1, 3])
def test_substeps_equal_an_independent_ode_integration(tmp_path, fresh_pipe, num_substeps):
    trainer = make(tmp_path, fresh_pipe, guidance_scale=4.5, num_substeps=num_substeps)
    prompts, columns, group_ids = trainer.sample_prompts(0)
    rollout = trainer.sample(prompts, columns, group_ids, 0)
    sig, K = rollout.schedule.sigmas, rollout.schedule.num_steps
    # the stored velocities are the rollout's own: each step's kernel mean recomputed from them is bit-identical
    for k in range(K):
        mean, _ = kernel_mean_std(rollout.extras["step_kinds"][k], rollout.states[:, k], rollout.velocities[:, k],
                                  sig[k], sig[k + 1], trainer.config.noise_level)
        assert torch.equal(mean, rollout.means[:, k]), k
    samples, steps = torch.tensor([0, 5, 3, 7]), torch.tensor([0, 1, 2, 3])  # mixed levels in one batch
    calls = TransformerCalls(trainer.model)
    est = trainer.clean_estimate(rollout, samples, steps)
    assert calls.n == num_substeps - 1  # the first substep reuses the stored velocity
    for b, (i, k) in enumerate(zip(samples.tolist(), steps.tolist())):
        x = rollout.states[i : i + 1, k]
        emb = index_embeds(rollout.embeds, slice(i, i + 1))
        levels = [float(sig[k]) * (1 - j / num_substeps) for j in range(num_substeps + 1)]
        for s, s_next in zip(levels[:-1], levels[1:]):
            with torch.no_grad():
                v = trainer.adapter.velocity(trainer.pipe.transformer, x, torch.tensor(s * 1000.0), emb, 4.5)
            x, _, _, _ = sde_step("ode", x, v, s, s_next, 0.0)
        torch.testing.assert_close(est[b : b + 1], x, rtol=1e-4, atol=1e-5)
        if num_substeps == 1:  # Tweedie: x_k - s_k v_k with the stored velocity, exactly
            tweedie = rollout.states[i, k] - sig[k] * rollout.velocities[i, k]
            torch.testing.assert_close(est[b], tweedie, rtol=0, atol=1e-6)


# ------------------------------------------------------------------------ gains, advantages, what is trained
def brightness_x1000(images, prompts, **kwargs):
    """Brightness on a scale where the 1e-4 of the advantage's std guard is negligible."""
    return 1000 * images.mean(dim=(1, 2, 3))


def test_gains_telescope_and_joint_normalisation(tmp_path, fresh_pipe):
    trainer = make(tmp_path, fresh_pipe, rewards=[brightness_x1000], sampler="cps", max_steps=1,
                   per_device_eval_batch_size=5)
    trainer.train()
    ro = trainer.last_rollout
    K = ro.schedule.num_steps
    assert trainer.estimated_steps(ro) == list(range(K))  # cps trains steps 0..K-2: every state is estimated
    r, g = ro.extras["step_rewards"], ro.extras["gains"]
    assert bool(torch.isfinite(r).all()) and torch.equal(r[:, K], ro.rewards.cpu())
    torch.testing.assert_close(g.sum(dim=1), r[:, K] - r[:, 0], rtol=0, atol=1e-4)
    torch.testing.assert_close(g, r[:, 1:] - r[:, :-1])
    adv = ro.advantages.cpu()
    for gid in ro.group_ids.unique():
        a = adv[ro.group_ids.cpu() == gid][:, : K - 1]  # every trained (trajectory, step) pair of the group
        assert abs(float(a.mean())) < 1e-5 and float(a.std(unbiased=False)) == pytest.approx(1.0, abs=1e-3)
    assert bool((adv[:, K - 1] == 0).all()) and not bool(ro.train_mask[:, K - 1].any())
    m = trainer.state.log_history[-1]
    for k in range(K - 1):
        assert m[f"stepwise/gain_mean/step_{k}"] == pytest.approx(float(g[:, k].mean()), abs=1e-5)
    assert m["stepwise/neg_gain_frac"] == pytest.approx(float((g[:, : K - 1] < 0).float().mean()))
    corr = torch.corrcoef(torch.stack([r[:, 1], r[:, K]]).double())[0, 1]
    assert m["stepwise/reward_corr/step_1"] == pytest.approx(float(corr))
    # cost: T' - 1 = 2 guided evaluations per estimated state, 8 x 4 states in chunks of 5, less x_0 of the 3 later
    # members of each group of 4 (shared initial noise: one x_0, one r_0 per group)
    pairs = 8 * K - 2 * 3
    assert m["stepwise/shared_estimates"] == 6
    assert m["stepwise/extra_velocity_evals"] == pairs * 2 and m["stepwise/extra_decodes"] == pairs
    assert m["stepwise/extra_transformer_calls"] == math.ceil(pairs / 5) * 2
    assert m["stepwise/extra_s"] > 0 and m["ratio_first_max_dev"] == 0.0


@pytest.mark.parametrize("same_noise", [True, False])
def test_r0_is_estimated_once_per_group_with_shared_noise(tmp_path, fresh_pipe, same_noise):
    """Shared initial noise makes x_0 one state per group: r_0 is computed for the group's first member and
    equals what each member's own estimate scores (to float tolerance: the batch differs); independent noise
    shares nothing."""
    trainer = make(tmp_path, fresh_pipe, rewards=[brightness_x1000], max_steps=1, same_noise_per_group=same_noise)
    ro = trainer.make_rollout(0)  # the policy that estimated r_0, not updated yet
    r0 = ro.extras["step_rewards"][:, 0]
    n = len(ro)
    own = trainer.clean_estimate(ro, torch.arange(n), torch.zeros(n, dtype=torch.long))
    expected = brightness_x1000(trainer.decode(own), ro.prompts).float()
    torch.testing.assert_close(r0, expected, rtol=1e-6, atol=0)
    shared = ro.extras["metrics"]["stepwise/shared_estimates"]
    if same_noise:
        for gid in ro.group_ids.unique():
            assert torch.equal(r0[ro.group_ids.cpu() == gid], r0[ro.group_ids.cpu() == gid][:1].expand(4))
        assert shared == n - len(ro.group_ids.unique())
    else:
        assert shared == 0 and len(set(r0.tolist())) == n


def test_ddim_first_step_is_deterministic_and_untrained(tmp_path, fresh_pipe):
    trainer = make(tmp_path, fresh_pipe, sampler="ddim", max_steps=2, beta=0.04, guidance_scale=4.5)
    trained_ks = set()
    forward_step = trainer.forward_step

    def spy(rollout, idx, k, need_ref):
        trained_ks.add(k)
        return forward_step(rollout, idx, k, need_ref)

    trainer.forward_step = spy
    trainer.train()
    ro = trainer.last_rollout
    K = ro.schedule.num_steps
    assert float(ro.stds[0]) == 0.0 and bool((ro.log_probs[:, 0] == 0).all())
    assert trained_ks == set(range(1, K - 1))
    for gid in ro.group_ids.unique():  # shared noise, deterministic first step: the group shares x_0 and x_1
        rows = ro.states[ro.group_ids == gid]
        assert torch.equal(rows[:, 0], rows[:1, 0].expand_as(rows[:, 0]))
        assert torch.equal(rows[:, 1], rows[:1, 1].expand_as(rows[:, 1]))
    assert torch.equal(ro.states[:, 1], ro.means[:, 0])
    assert not bool(ro.train_mask[:, [0, K - 1]].any()) and bool(ro.train_mask[:, 1 : K - 1].all())
    assert bool((ro.advantages[:, [0, K - 1]] == 0).all())
    assert trainer.estimated_steps(ro) == list(range(1, K))  # state 0 is not needed: its gain is never trained
    g, r = ro.extras["gains"], ro.extras["step_rewards"]
    torch.testing.assert_close(g[:, 1:].sum(dim=1), r[:, K] - r[:, 1], rtol=0, atol=1e-6)
    for step in (1, 2):  # unchanged policy at the first inner step: the ratio is exactly 1
        assert log_at(trainer, step, "ratio_first_max_dev") == 0.0
        assert log_at(trainer, step, "kl") >= 0 and math.isfinite(log_at(trainer, step, "loss"))
    assert log_at(trainer, 2, "kl") > 0


def test_none_for_an_intermediate_estimate_is_left_out(tmp_path, fresh_pipe):
    """Chunks of 8 = one state per reward call; the reward skips sample 0 at state 2 and sample 5 at state 3."""
    calls = []

    def flaky(images, prompts, **kwargs):
        calls.append(len(prompts))
        vals = images.mean(dim=(1, 2, 3)).tolist()
        call = len(calls) - 1  # call 0: the trainer's check; per iteration: final, then states 1, 2, 3
        if call >= 1 and (call - 1) % 4 == 2:
            vals[0] = None
        if call >= 1 and (call - 1) % 4 == 3:
            vals[5] = float("nan")
        return vals

    # ddim: its first step has no density, so the states an iteration scores are 1, 2, 3 (the call count above);
    # independent noise: no state is shared within a group, so every call scores 8 states
    trainer = make(tmp_path, fresh_pipe, rewards=[flaky], sampler="ddim", max_steps=2, per_device_eval_batch_size=8,
                   beta=0.04, learning_rate=3e-3, same_noise_per_group=False)
    before = [p.detach().clone() for p in trainer.trainable_params]
    trainer.train()
    ro = trainer.last_rollout
    r, g, adv, mask = ro.extras["step_rewards"], ro.extras["gains"], ro.advantages.cpu(), ro.train_mask.cpu()
    assert math.isnan(r[0, 2]) and math.isnan(r[5, 3]) and int(torch.isnan(r[:, 1:]).sum()) == 2
    assert not bool(mask[0, 1]) and not bool(mask[0, 2]) and not bool(mask[5, 2])  # the gains touching them
    assert int(mask.sum()) == 8 * 2 - 3 and float(adv[0, 1]) == 0 and float(adv[0, 2]) == 0
    assert bool(torch.isfinite(adv).all())
    for gid in (0, 1):  # the others are normalised over the group's remaining pairs only
        m = mask & (ro.group_ids.cpu() == gid)[:, None]
        sel = g[m]
        torch.testing.assert_close(adv[m], ((sel - sel.mean()) / (sel.std(unbiased=False) + 1e-4)).clamp(-5, 5))
    assert log_at(trainer, 2, "stepwise/valid_gain_frac") == pytest.approx(13 / 16)
    assert all(bool(torch.isfinite(p).all()) for p in trainer.trainable_params)
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.trainable_params))
    assert math.isfinite(log_at(trainer, 2, "loss")) and log_at(trainer, 2, "nonfinite_skipped") == 0


def test_per_step_normalisation_in_the_trainer(tmp_path, fresh_pipe):
    trainer = make(tmp_path, fresh_pipe, rewards=[brightness_x1000], gain_normalization="per_step", num_substeps=1,
                   max_steps=1)
    trainer.train()
    ro = trainer.last_rollout
    g = ro.extras["gains"]
    for gid in ro.group_ids.unique():
        for k in (1, 2):
            rows = ro.group_ids.cpu() == gid
            sel = g[rows, k]
            expected = (sel - sel.mean()) / (sel.std(unbiased=False) + 1e-4)
            torch.testing.assert_close(ro.advantages[rows, k].cpu(), expected)
    assert log_at(trainer, 1, "stepwise/extra_velocity_evals") == 0  # T' = 1 reuses the rollout's velocities


@pytest.mark.parametrize("clip", [0.5, 1e6])
def test_advantage_clip_fraction_is_logged(tmp_path, fresh_pipe, clip):
    """``stepwise/adv_clip_frac``: the share of trained pairs whose jointly normalised advantage exceeds
    ``adv_clip_max`` (the advantages used are clipped there)."""
    trainer = make(tmp_path, fresh_pipe, rewards=[brightness_x1000], num_substeps=1, max_steps=1, adv_clip_max=clip)
    trainer.train()
    ro = trainer.last_rollout
    g = ro.extras["gains"].masked_fill(~ro.train_mask.cpu(), float("nan"))
    raw = step_advantages(g, ro.group_ids.cpu(), "joint", clip=None)
    valid = ~torch.isnan(g)
    expected = float((raw[valid].abs() > clip).float().mean())
    assert log_at(trainer, 1, "stepwise/adv_clip_frac") == pytest.approx(expected)
    assert (expected > 0) == (clip < 1) and float(ro.advantages.abs().max()) <= clip + 1e-6
    torch.testing.assert_close(ro.advantages.cpu(), raw.clamp(-clip, clip))


# ---------------------------------------------------------------------------------------------- training
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_brightness_reward_moves_the_policy(tmp_path, fresh_pipe, sign):
    def signed_brightness(images, prompts, **kwargs):
        return sign * images.mean(dim=(1, 2, 3))

    # the default kernel (flow_sde); on this tiny model the global brightness is set in the first, noisiest step,
    # which the paper's `ddim` keeps deterministic (untrained): with ddim it does not move (measured |change| < 2e-4)
    assert StepwiseFlowGRPOConfig.__dataclass_fields__["sampler"].default == "flow_sde"
    trainer = make(tmp_path, fresh_pipe, rewards=[signed_brightness], max_steps=15,
                   learning_rate=5e-3, clip_range=0.1, beta=0.0, lora_alpha=32, num_substeps=2)
    before = trainer.generate(PROMPTS, seed=123)[0].mean().item()
    trainer.train()
    after = trainer.generate(PROMPTS, seed=123)[0].mean().item()
    print(f"brightness {sign:+}: {before:.5f} -> {after:.5f}")
    assert sign * (after - before) > 2e-3, (before, after)
    rewards = [e["reward"] for e in trainer.state.log_history]
    assert sum(rewards[-5:]) > sum(rewards[:5])  # the training reward rose too


def test_kl_mask_trust_region_with_per_step_advantages(tmp_path, fresh_pipe):
    """Flow-DPPO's KL mask (shared FlowGRPO loss) takes the per-step advantages too."""
    trainer = make(tmp_path, fresh_pipe, trust_region="kl_mask", num_inner_epochs=2, num_substeps=1, max_steps=2,
                   learning_rate=3e-3, beta=0.04)
    before = [p.detach().clone() for p in trainer.trainable_params]
    trainer.train()
    assert trainer.last_rollout.advantages.ndim == 2
    for step in (1, 2):
        assert log_at(trainer, step, "ratio_first_max_dev") == 0.0 and log_at(trainer, step, "kl_old_first_max") == 0.0
        assert 0.0 <= log_at(trainer, step, "mask_frac") <= 1.0 and math.isfinite(log_at(trainer, step, "loss"))
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.trainable_params))


def test_docstring_example_runs(tmp_path, monkeypatch):
    import re
    import textwrap

    code = textwrap.dedent(re.search(r"```python\n(.*?)```", StepwiseFlowGRPOTrainer.__doc__, re.S).group(1))
    monkeypatch.chdir(tmp_path)
    scope = {}
    exec(compile(code, "StepwiseFlowGRPOTrainer.__doc__", "exec"), scope)
    trainer = scope["trainer"]
    assert trainer.config.sampler == "flow_sde" and trainer.state.global_step == 2
    assert (tmp_path / "out" / "final" / "pytorch_lora_weights.safetensors").exists()
    assert all(e["ratio_first_max_dev"] == 0.0 for e in trainer.state.log_history)
