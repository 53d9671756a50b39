"""DiffusionNFT (arXiv 2509.16117): the loss against its closed-form gradient and the reference formula, the
limits where the update vanishes, the old-policy decay, the final-latents-only rollout, training, NaN / failing
rewards, resume, the CLI and the config's input checks."""

from __future__ import annotations

import json
import math

import pytest
import torch

import trl_flow

from conftest import PROMPTS, brightness, tiny_config
from trl_flow import DiffusionNFTConfig, DiffusionNFTTrainer, FlowGRPOConfig
from trl_flow.rewards import RewardError
from trl_flow.trainers.diffusion_nft_trainer import nft_loss, old_policy_decay, optimality_probability

NAN = float("nan")


def make_nft(tmp_path, fresh_pipe, rewards=None, **overrides):
    overrides.setdefault("output_dir", str(tmp_path / "out"))
    config = tiny_config(tmp_path, DiffusionNFTConfig, **{"beta": 0.0, **overrides})
    return DiffusionNFTTrainer(config, fresh_pipe(), rewards or [brightness], train_dataset=list(PROMPTS))


def params(trainer):
    return [p.detach().clone() for p in trainer.trainable_params]


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def fixed_case(B=3, L=(2, 3, 4), seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x0, eps, v_old, v, v_ref = (torch.randn(B, *L, generator=g, dtype=dtype) for _ in range(5))
    t = torch.tensor([0.9, 0.5, 0.2], dtype=dtype)[:B]
    xt = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * eps
    r = torch.tensor([0.9, 0.3, 0.5], dtype=dtype)[:B]
    return x0, xt, t, v_old, v, v_ref, r


# --------------------------------------------------------------------------------------------- the loss
@pytest.mark.parametrize("nft_beta", [1.0, 0.1])
def test_loss_gradient_equals_the_closed_form(nft_beta):
    """For fixed v_old, xt, x0, t, r and detached adaptive weights, with e = xt - t v_old - x0 and d = v - v_old:
    x0+ - x0 = e - t b d, x0- - x0 = e + t b d, w+- = mean|x0+- - x0|, and the loss
    (1/B) sum_b [C/b (r L+ + (1 - r) L-) + kappa mean((v - v_ref)^2)] has the gradient
    dLoss/dv = 2 t C / (B D) [-r (e - t b d) / w+ + (1 - r) (e + t b d) / w-] + 2 kappa (v - v_ref) / (B D)."""
    x0, xt, t, v_old, v, v_ref, r = fixed_case()
    C, kappa = 5.0, 1e-2
    v = v.clone().requires_grad_(True)
    per_sample, _ = nft_loss(v, v_old, x0, xt, t, r, nft_beta, C)
    kl = ((v - v_ref) ** 2).mean(dim=(1, 2, 3))
    (per_sample + kappa * kl).mean().backward()

    B, D = x0.shape[0], x0[0].numel()
    tt, rr = t.view(-1, 1, 1, 1), r.view(-1, 1, 1, 1)
    e, d = xt - tt * v_old - x0, v.detach() - v_old
    pos, neg = e - tt * nft_beta * d, e + tt * nft_beta * d
    w_pos, w_neg = pos.abs().mean(dim=(1, 2, 3), keepdim=True), neg.abs().mean(dim=(1, 2, 3), keepdim=True)
    closed = (2 * tt * C / (B * D) * (-rr * pos / w_pos + (1 - rr) * neg / w_neg)
              + 2 * kappa * (v.detach() - v_ref) / (B * D))
    assert v.grad.abs().max() > 1e-3
    torch.testing.assert_close(v.grad, closed, rtol=1e-12, atol=1e-14)


def test_r_one_half_everywhere_gives_no_policy_gradient_at_the_old_policy():
    """At v = v_old the two implicit policies' errors are e -+ 0 with equal weights, so the gradient is
    2 t C (1 - 2 r) e / (B D mean|e|): zero for r = 0.5, not for other r."""
    x0, xt, t, v_old, _, _, _ = fixed_case()
    for r_value, vanishes in ((0.5, True), (0.8, False)):
        v = v_old.clone().requires_grad_(True)
        loss, _ = nft_loss(v, v_old, x0, xt, t, torch.full((3,), r_value, dtype=x0.dtype), 1.0, 5.0)
        loss.mean().backward()
        assert (float(v.grad.abs().max()) < 1e-15) == vanishes, (r_value, float(v.grad.abs().max()))


@pytest.mark.parametrize("r_value", [0.5, 0.9, 0.1])
def test_the_beta_to_zero_limit(r_value):
    """nft_beta -> 0 at v = v_old. The reference code divides the policy loss by beta, so its gradient does not
    vanish: it is the same for every beta, 2 t C (1 - 2 r) e / (B D mean|e|) (0 only for r = 0.5). The paper's
    form (without 1 / beta) is beta times it: that update vanishes linearly in beta."""
    x0, xt, t, v_old, _, _, _ = fixed_case()
    r = torch.full((3,), r_value, dtype=x0.dtype)
    B, D = x0.shape[0], x0[0].numel()
    tt = t.view(-1, 1, 1, 1)
    e = xt - tt * v_old - x0
    limit = 2 * tt * 5.0 * (1 - 2 * r_value) * e / (B * D * e.abs().mean(dim=(1, 2, 3), keepdim=True))
    for beta in (1.0, 1e-1, 1e-3, 1e-6):
        v = v_old.clone().requires_grad_(True)
        nft_loss(v, v_old, x0, xt, t, r, beta, 5.0)[0].mean().backward()
        torch.testing.assert_close(v.grad, limit, rtol=1e-9, atol=1e-15)
        v2 = v_old.clone().requires_grad_(True)
        (beta * nft_loss(v2, v_old, x0, xt, t, r, beta, 5.0)[0]).mean().backward()  # the paper's scaling
        assert float(v2.grad.abs().max()) <= beta * float(limit.abs().max()) * (1 + 1e-9) + 1e-15


def reference_nvlabs_loss(forward_prediction, old_prediction, ref_forward_prediction, x0, xt, timesteps, advantages,
                          beta, train_beta, adv_clip_max):
    """scripts/train_nft_sd3.py (NVlabs/DiffusionNFT@24af555), the loss of one (microbatch, j), re-typed: t is
    timesteps / 1000 of the sampled schedule timesteps, advantages (B,)."""
    t = timesteps / 1000.0
    t_expanded = t.view(-1, *([1] * (len(x0.shape) - 1)))
    advantages_clip = torch.clamp(advantages, -adv_clip_max, adv_clip_max)
    normalized_advantages_clip = (advantages_clip / adv_clip_max) / 2.0 + 0.5
    r = torch.clamp(normalized_advantages_clip, 0, 1)
    positive_prediction = beta * forward_prediction + (1 - beta) * old_prediction.detach()
    implicit_negative_prediction = (1.0 + beta) * old_prediction.detach() - beta * forward_prediction
    x0_prediction = xt - t_expanded * positive_prediction
    with torch.no_grad():
        weight_factor = (torch.abs(x0_prediction.double() - x0.double())
                         .mean(dim=tuple(range(1, x0.ndim)), keepdim=True).clip(min=0.00001))
    positive_loss = ((x0_prediction - x0) ** 2 / weight_factor).mean(dim=tuple(range(1, x0.ndim)))
    negative_x0_prediction = xt - t_expanded * implicit_negative_prediction
    with torch.no_grad():
        negative_weight_factor = (torch.abs(negative_x0_prediction.double() - x0.double())
                                  .mean(dim=tuple(range(1, x0.ndim)), keepdim=True).clip(min=0.00001))
    negative_loss = ((negative_x0_prediction - x0) ** 2 / negative_weight_factor).mean(dim=tuple(range(1, x0.ndim)))
    ori_policy_loss = r * positive_loss / beta + (1.0 - r) * negative_loss / beta
    policy_loss = (ori_policy_loss * adv_clip_max).mean()
    kl_div_loss = ((forward_prediction - ref_forward_prediction) ** 2).mean(dim=tuple(range(1, x0.ndim)))
    return policy_loss + train_beta * torch.mean(kl_div_loss)


@pytest.mark.parametrize("beta", [1.0, 0.1])
def test_one_loss_evaluation_matches_the_reference_formula(beta):
    """float32 tensors as in training; the reference divides by float64 weights (its loss is float64), ours by
    float32 ones: equal to float32 rounding. r comes from advantages beyond the clip too."""
    from trl_flow.losses import masked_mean

    x0, xt, _, v_old, v, v_ref, _ = fixed_case(B=3, L=(4, 8, 8), dtype=torch.float32)
    timesteps = torch.tensor([1000.0, 750.0, 97.0])
    xt = (1 - timesteps.view(-1, 1, 1, 1) / 1000) * x0 + timesteps.view(-1, 1, 1, 1) / 1000 * xt
    adv = torch.tensor([7.0, -1.5, 0.25])
    want = reference_nvlabs_loss(v, v_old, v_ref, x0, xt, timesteps, adv, beta, 1e-4, 5.0)
    r = optimality_probability(adv, 5.0)
    per_sample, _ = nft_loss(v, v_old, x0, xt, timesteps / 1000, r, beta, 5.0)
    got = masked_mean(per_sample + 1e-4 * ((v - v_ref) ** 2).mean(dim=(1, 2, 3)), torch.ones(3, dtype=torch.bool))
    assert want.dtype == torch.float64 and abs(float(want)) > 1
    assert math.isclose(float(got), float(want), rel_tol=5e-7)  # measured 8e-8 (beta 1), 3e-8 (beta 0.1)


def test_optimality_probability_and_its_advantage_modes():
    adv = torch.tensor([-7.0, -2.5, 0.0, 1.0, 5.0, 9.0])
    for mode, want in [("all", [0.0, 0.25, 0.5, 0.6, 1.0, 1.0]), ("positive_only", [0.5, 0.5, 0.5, 0.6, 1.0, 1.0]),
                       ("negative_only", [0.0, 0.25, 0.5, 0.5, 0.5, 0.5]),
                       ("one_only", [0.5, 0.5, 0.5, 0.6, 0.6, 0.6]),
                       ("binary", [0.4, 0.4, 0.5, 0.6, 0.6, 0.6])]:
        torch.testing.assert_close(optimality_probability(adv, 5.0, mode), torch.tensor(want), msg=mode)


# ------------------------------------------------------------------------------------------ old policy
def reference_return_decay(step, decay_type):
    """scripts/train_nft_sd3.py's return_decay, re-typed."""
    flat, uprate, uphold = {0: (0, 0.0, 0.0), 1: (0, 0.001, 0.5), 2: (75, 0.0075, 0.999)}[decay_type]
    return 0.0 if step < flat else min((step - flat) * uprate, uphold)


def test_old_policy_decay_schedule_is_the_references():
    for decay_type in (0, 1, 2):
        assert [old_policy_decay(n, decay_type) for n in range(1200)] == [
            reference_return_decay(n, decay_type) for n in range(1200)]
    assert (old_policy_decay(100, 1), old_policy_decay(600, 1), old_policy_decay(74, 2), old_policy_decay(76, 2),
            old_policy_decay(1000, 2)) == (0.1, 0.5, 0.0, 0.0075, 0.999)


@pytest.mark.parametrize("decay_type", [1, 0])
def test_old_policy_update_after_an_iteration(tmp_path, fresh_pipe, decay_type):
    """The old weights start equal to the current ones, the rollout samples with them, and after the iteration's 2
    optimizer steps old <- d old + (1 - d) theta with d = decay(2) (0.002; type 0: old = theta)."""
    tr = make_nft(tmp_path, fresh_pipe, decay_type=decay_type, max_steps=1)
    assert same(tr.old_params, tr.trainable_params)
    old_before = [o.clone() for o in tr.old_params]
    sampled_with = {}
    sample = tr.sample

    def recording_sample(*args, **kwargs):
        sampled_with["weights"] = params(tr)
        return sample(*args, **kwargs)

    tr.sample = recording_sample
    tr.train()
    assert same(sampled_with["weights"], old_before)
    assert tr.nft_optimizer_steps == 2
    d = old_policy_decay(2, decay_type)
    assert d == (0.002 if decay_type == 1 else 0.0) and tr.state.log_history[-1]["nft/decay"] == d
    current = params(tr)
    assert not same(current, old_before)
    for o, b, p in zip(tr.old_params, old_before, current):
        assert torch.equal(o, b * d + p * (1.0 - d))
    assert same(tr.old_params, current) == (decay_type == 0)


# ------------------------------------------------------------------------------------- rollout, training
def test_final_only_rollout_keeps_the_final_latents_bit_for_bit(base_pipe):
    from trl_flow.models import get_adapter
    from trl_flow.rollout import sample_trajectories

    adapter = get_adapter(base_pipe)
    embeds = adapter.encode_prompts(PROMPTS[:3], False, 16)
    schedule = adapter.schedule(4, 32, 32)
    noise = adapter.initial_noise(3, 32, 32, torch.Generator().manual_seed(0))
    for sampler in ("ode", "flow_sde"):
        kinds = [sampler] * 3 + ["ode"]
        run = lambda store: sample_trajectories(  # noqa: E731
            adapter, base_pipe.transformer, embeds, noise, schedule, kinds, 0.7, 1.0,
            2, generator=[torch.Generator().manual_seed(i) for i in range(3)], store=store)
        full, final = run("trajectory"), run("final")
        assert final["states"].shape == (3, 1, *noise.shape[1:]) and final["means"] is None
        assert torch.equal(final["states"][:, 0], full["states"][:, -1])
        assert torch.equal(final["log_probs"], full["log_probs"])
    with pytest.raises(ValueError, match="store="):
        sample_trajectories(adapter, base_pipe.transformer, embeds, noise, schedule, kinds, 0.7, 1.0, 2, store="all")


@pytest.mark.parametrize("sampler,sampling", [("ode", "per_sample"), ("flow_sde", "shared")])
def test_two_iterations_train_and_keep_weights_finite(tmp_path, fresh_pipe, sampler, sampling):
    tr = make_nft(tmp_path, fresh_pipe, sampler=sampler, timestep_sampling=sampling, beta=1e-4)
    before = params(tr)
    state = tr.train()
    after = params(tr)
    assert not same(before, after) and all(bool(torch.isfinite(p).all()) for p in after)
    assert all(bool(torch.isfinite(o).all()) for o in tr.old_params)
    ro = tr.last_rollout
    assert ro.states.shape[1] == 1 and ro.means is None  # final latents only
    for entry in state.log_history:
        assert math.isfinite(entry["loss"]) and entry["nonfinite_skipped"] == 0 and entry["kl"] >= 0
        assert 0.0 <= entry["nft/r_mean"] <= 1.0
    assert state.log_history[-1]["nft/optimizer_steps"] == 4
    if sampler == "ode":  # the KL to the base is measured with a stochastic kernel, never silently as 0
        with pytest.raises(ValueError, match="no density"):
            tr.kl_to_reference(PROMPTS[:2])
        assert float(tr.kl_to_reference(PROMPTS[:2], sampler="flow_sde", noise_level=0.7).min()) > 0


def test_training_points_are_the_schedules_timesteps_seeded_per_sample(tmp_path, fresh_pipe):
    tr = make_nft(tmp_path, fresh_pipe, num_inference_steps=10, max_steps=1)
    ro = tr.make_rollout(0)
    assert tr.config.num_train_timesteps == tr.num_train_timesteps(ro.schedule) == 9
    idx = torch.arange(4)
    order, _ = tr.training_points(ro, idx, 0, 0, 0)
    assert order.shape == (4, 9) and all(len(set(row.tolist())) == 9 for row in order)
    assert len({tuple(row.tolist()) for row in order}) > 1  # a permutation per sample
    again, _ = tr.training_points(ro, idx[2:], 0, 0, 0)
    assert torch.equal(again, order[2:])  # a sample's draw does not depend on its microbatch
    tr.config.timestep_sampling = "shared"
    shared, _ = tr.training_points(ro, idx, 0, 0, 0)
    assert all(torch.equal(row, shared[0]) for row in shared) and sorted(shared[0].tolist()) == list(range(9))
    # a frozen part of the schedule (Wan2.2 with one expert trained) is never a training point
    tr.adapter.trainable_steps = lambda schedule: torch.arange(10) >= 4
    tr.config.timestep_sampling = "per_sample"
    order, _ = tr.training_points(ro, idx, 0, 0, 0)
    assert tr.num_train_timesteps(ro.schedule) == 5 and order.shape == (4, 5) and bool((order >= 4).all())


def test_equal_rewards_everywhere_leave_the_weights_unchanged(tmp_path, fresh_pipe):
    """Equal rewards: every advantage is 0, so r = 0.5 and, with old = current, the policy gradient is exactly 0
    (no KL term, no weight decay): two iterations leave every weight as it was."""
    tr = make_nft(tmp_path, fresh_pipe, rewards=[lambda images, prompts, **c: [0.3] * len(prompts)], weight_decay=0.0)
    before = params(tr)
    state = tr.train()
    assert [e["nft/r_mean"] for e in state.log_history] == [0.5, 0.5]
    assert [e["grad_norm"] for e in state.log_history] == [0.0, 0.0]
    assert same(before, params(tr))
    for b, o in zip(before, tr.old_params):  # old = d old + (1 - d) theta with old == theta: theta up to rounding
        torch.testing.assert_close(o, b, rtol=1e-6, atol=1e-9)


# ------------------------------------------------------------------------------------------ reward faults
def test_nan_rewards_leave_weights_and_old_policy_untouched(tmp_path, fresh_pipe):
    state = {"nan": False}

    def maybe_nan(images, prompts, **kwargs):
        return [NAN] * len(prompts) if state["nan"] else images.mean(dim=(1, 2, 3)).tolist()

    tr = make_nft(tmp_path, fresh_pipe, rewards=[maybe_nan], max_steps=1, weight_decay=0.0)
    tr.train()  # one normal iteration: Adam has momentum, old != current
    state["nan"] = True
    tr.config.max_steps = 2
    before, old, steps = params(tr), [o.clone() for o in tr.old_params], tr.nft_optimizer_steps
    tr.train()
    assert tr.state.log_history[-1]["no_reward_frac"] == 1.0
    assert same(before, params(tr)) and same(old, tr.old_params) and tr.nft_optimizer_steps == steps


def test_partial_nan_rewards_train_only_the_scored_samples(tmp_path, fresh_pipe):
    def half_nan(images, prompts, **kwargs):
        return [NAN if i % 2 else float(x) for i, x in enumerate(images.mean(dim=(1, 2, 3)))]

    tr = make_nft(tmp_path, fresh_pipe, rewards=[half_nan], max_steps=1)
    before = params(tr)
    tr.train()
    ro = tr.last_rollout
    nan = torch.isnan(ro.rewards)
    assert nan.tolist() == [bool(i % 2) for i in range(len(ro))]
    assert not bool(ro.train_mask[nan].any()) and bool(ro.train_mask[~nan].all())
    assert not same(before, params(tr)) and all(bool(torch.isfinite(p).all()) for p in params(tr))


def test_a_failing_reward_stops_before_any_update(tmp_path, fresh_pipe):
    state = {"fail": False}

    def flaky(images, prompts, **kwargs):
        if state["fail"]:
            raise RuntimeError("reward server down")
        return images.mean(dim=(1, 2, 3)).tolist()

    tr = make_nft(tmp_path, fresh_pipe, rewards=[flaky], max_steps=1)
    tr.train()
    state["fail"] = True
    tr.config.max_steps = 2
    before, old = params(tr), [o.clone() for o in tr.old_params]
    with pytest.raises(RewardError, match="reward server down"):
        tr.train()
    assert same(before, params(tr)) and same(old, tr.old_params)


# ------------------------------------------------------------------------------------------------ resume
def test_resume_repeats_an_uninterrupted_run_exactly(tmp_path, fresh_pipe):
    full = make_nft(tmp_path, fresh_pipe, max_steps=3, save_steps=1, output_dir=str(tmp_path / "full"))
    full.train()
    ckpt = tmp_path / "full" / "checkpoint-1"
    assert json.loads((ckpt / "nft_state.json").read_text())["optimizer_steps"] == 2
    resumed = make_nft(tmp_path, fresh_pipe, max_steps=3, output_dir=str(tmp_path / "resumed"))
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert same(params(full), params(resumed)) and same(full.old_params, resumed.old_params)
    assert (resumed.nft_optimizer_steps, resumed.old_decay) == (full.nft_optimizer_steps, full.old_decay) == (6, 0.006)
    assert [e["loss"] for e in resumed.state.log_history] == [e["loss"] for e in full.state.log_history]


def test_a_checkpoint_without_the_old_policy_is_refused(tmp_path, fresh_pipe):
    tr = make_nft(tmp_path, fresh_pipe, max_steps=1, save_steps=1)
    tr.train()
    ckpt = tmp_path / "out" / "checkpoint-1"
    with pytest.raises(ValueError, match="nft_old_policy.safetensors"):
        tr.load_extra_state(str(tmp_path))  # a folder without it
    assert (ckpt / "nft_old_policy.safetensors").exists()


# ------------------------------------------------------------------------------------------ config, CLI
def test_config_defaults_and_input_checks(tmp_path):
    cfg = DiffusionNFTConfig(output_dir=str(tmp_path))
    assert (cfg.sampler, cfg.guidance_scale, cfg.beta, cfg.nft_beta, cfg.decay_type, cfg.timestep_fraction,
            cfg.num_train_timesteps, cfg.adv_clip_max, cfg.scale_rewards) == (
        "ode", 1.0, 1e-4, 1.0, 1, 0.99, 9, 5.0, "batch")
    with pytest.raises(ValueError, match="FlowGRPOConfig.sampler='ode'"):
        FlowGRPOConfig(output_dir=str(tmp_path), sampler="ode")  # the SDE trainers still need a density
    for bad, match in [({"nft_beta": 0.0}, "nft_beta=0.0"), ({"decay_type": 3}, "decay_type=3"),
                       ({"timestep_fraction": 1.5}, "timestep_fraction=1.5"),
                       ({"timestep_fraction": 0.1, "num_inference_steps": 4}, "trains no timestep"),
                       ({"timestep_sampling": "random"}, "timestep_sampling='random'"),
                       ({"adv_mode": "sign"}, "adv_mode='sign'"),
                       ({"same_noise_per_group": True}, "the same image")]:
        with pytest.raises(ValueError, match=match):
            DiffusionNFTConfig(output_dir=str(tmp_path), **bad)
    # DiffusionNFT sits on the run layer: the policy-gradient fields (no ratio to clip or mask) are not its fields
    import dataclasses

    from trl_flow.trainers.policy_gradient_config import PolicyGradientConfig

    own = {f.name for f in dataclasses.fields(DiffusionNFTConfig)}
    pg_only = {f.name for f in dataclasses.fields(PolicyGradientConfig)} - {f.name for f in dataclasses.fields(
        trl_flow.FlowRLConfig)}
    assert pg_only >= {"clip_range", "trust_region", "kl_form", "logprob_reduction", "kl_mask_delta"}
    assert not own & pg_only
    with pytest.raises(TypeError, match="trust_region"):
        DiffusionNFTConfig(output_dir=str(tmp_path), trust_region="kl_mask")


def test_fsdp_is_refused_before_any_set_up(tmp_path, fresh_pipe, monkeypatch):
    from trl_flow.engine.distributed import DistributedSetupError

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(DistributedSetupError, match="multi_gpu"):
        make_nft(tmp_path, fresh_pipe)


def test_cli_trains_one_iteration(tmp_path):
    from trl_flow import cli

    trainer = cli.run("nft", ["--model_name_or_path", "shapes", "--dataset_name", "shapes", "--reward_funcs",
                              "shapes_partial", "--output_dir", str(tmp_path), "--height", "32", "--width", "32",
                              "--max_steps", "1", "--prompts_per_step", "2", "--num_generations", "4",
                              "--per_device_train_batch_size", "8", "--num_inference_steps", "4",
                              "--max_sequence_length", "1", "--disable_tqdm", "true"])
    assert isinstance(trainer, DiffusionNFTTrainer) and trainer.state.global_step == 1
    assert (tmp_path / "pytorch_lora_weights.safetensors").exists()
