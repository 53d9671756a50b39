"""Reference parity: the same tensors through trl_flow and through the released code's formulas, written out here
from the cited file and line (never imported or copied: the formulas are re-typed, the sources named). The
snapshots read: yifan123/flow_grpo@ac4c86e, NVlabs/DiffusionNFT@24af555, Tencent-Hunyuan/UniRL@1a7b501.

tests/test_kernels.py and tests/test_flow_dppo.py check our own formulas; these check them against theirs."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from trl_flow.advantages import group_advantages
from trl_flow.kernels import flow_sde_std, kernel_mean_std, sde_step
from trl_flow.trainers.diffusion_nft_trainer import DiffusionNFTTrainer
from trl_flow.trust_region import kl_masked_policy_loss, old_policy_kl

SHAPE = (3, 4, 8, 8)  # (B, C, h, w)
A = 0.7  # flow_sde's noise level (published)


def shift3_sigmas(steps: int = 10) -> torch.Tensor:
    """SD3.5's sampling sigmas at shift 3 (steps + 1 values, the last 0), as the pipelines set them."""
    sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(steps)
    return sched.sigmas.float()


# ------------------------------------------------------------------------------ c. the flow_sde step (flow_grpo)
def flow_grpo_sde_step(v, x, sigmas, i, noise_level, prev_sample=None, noise=None):
    """yifan123/flow_grpo@ac4c86e flow_grpo/diffusers_patch/sd3_sde_with_logprob.py, sde_step_with_logprob,
    lines 35-68: float32; sigma_max = sigmas[1] (l. 44); std_dev_t = sqrt(sigma / (1 - where(sigma == 1, sigma_max,
    sigma))) * noise_level (l. 47); the mean (l. 50); prev_sample = mean + std_dev_t sqrt(-dt) noise (l. 59); the
    Gaussian log-density with std std_dev_t sqrt(-dt), mean over all but the batch dim (l. 61-68)."""
    v, x = v.float(), x.float()
    sigma, sigma_prev, sigma_max = sigmas[i], sigmas[i + 1], sigmas[1].item()
    dt = sigma_prev - sigma
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * noise_level
    mean = x * (1 + std_dev_t**2 / (2 * sigma) * dt) + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    if prev_sample is None:
        prev_sample = mean + std_dev_t * torch.sqrt(-1 * dt) * noise
    log_prob = (-((prev_sample.detach() - mean) ** 2) / (2 * ((std_dev_t * torch.sqrt(-1 * dt)) ** 2))
                - torch.log(std_dev_t * torch.sqrt(-1 * dt)) - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi))))
    return prev_sample, log_prob.mean(dim=tuple(range(1, log_prob.ndim))), mean, std_dev_t * torch.sqrt(-dt)


def unirl_static_sigmas(steps: int = 10, shift: float = 3.0) -> torch.Tensor:
    """UniRL@1a7b501 unirl/sde/runtime.py lines 94-96, its SD3 schedule (static shift): linspace(1, 0, steps + 1),
    then shift t / (1 + (shift - 1) t)."""
    t = torch.linspace(1.0, 0.0, steps + 1)
    return (shift * t) / (1 + (shift - 1) * t)


def test_the_shift3_schedules():
    """The diffusers pipeline's schedule (Flow-GRPO's and ours) and UniRL's own differ after step 0: sigma_1 0.9601
    vs 0.9643, sigma_9 0.0089 vs 0.25 (diffusers shifts its timestep grid twice: UniRL's runtime.py line 84)."""
    sig, uni = shift3_sigmas(), unirl_static_sigmas()
    assert len(sig) == len(uni) == 11 and float(sig[0]) == float(uni[0]) == 1.0 and float(sig[-1]) == 0.0
    assert abs(float(sig[1]) - 0.9601) < 1e-4 and abs(float(uni[1]) - 0.9643) < 1e-4
    assert abs(float(sig[9]) - 0.0089) < 1e-4 and abs(float(uni[9]) - 0.25) < 1e-6


@pytest.mark.parametrize("i", range(10))
def test_flow_sde_step_and_log_prob_match_flow_grpo_at_every_step(i):
    """Every step of the shift-3, 10-step schedule, the last (sigma' = 0) included: sampled state (same noise),
    mean, std and log-prob, both when sampling and when re-scoring a stored transition. Measured max abs diff over
    the 10 steps (float32): sample 4.8e-7, mean 2.4e-7, std 6.0e-8, log-prob 7.2e-7 (re-scored: 4.6e-5 on log-probs
    of magnitude ~1e4 at the last steps, relative ~1e-9)."""
    sig = shift3_sigmas()
    g = torch.Generator().manual_seed(i)
    x, v = torch.randn(SHAPE, generator=g), torch.randn(SHAPE, generator=g)
    gen = torch.Generator().manual_seed(100 + i)
    ours, lp, mean, std = sde_step("flow_sde", x, v, sig[i], sig[i + 1], A, generator=gen)
    noise = torch.randn(SHAPE, generator=torch.Generator().manual_seed(100 + i))  # the draw sde_step made
    theirs, lp_ref, mean_ref, std_ref = flow_grpo_sde_step(v, x, sig, i, A, noise=noise)
    for a, b in ((ours, theirs), (lp, lp_ref), (mean, mean_ref), (std.expand_as(std_ref), std_ref)):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6), float((a - b).abs().max())
    # re-scoring a stored transition (the update's path), from a state the reference sampled
    other = theirs + 0.1 * torch.randn(SHAPE, generator=g)
    _, lp2, _, _ = sde_step("flow_sde", x, v, sig[i], sig[i + 1], A, prev_sample=other)
    _, lp2_ref, _, _ = flow_grpo_sde_step(v, x, sig, i, A, prev_sample=other)
    assert torch.allclose(lp2, lp2_ref, rtol=1e-6, atol=1e-5), float((lp2 - lp2_ref).abs().max())
    assert not torch.allclose(lp2, lp)  # the re-scored transition is another one: the comparison can fail


# ------------------------------------------------------------------------------- a. Flow-DPPO's loss (UniRL)
def unirl_sigma_t(sigmas, steps, eta):
    """Tencent-Hunyuan/UniRL@1a7b501 unirl/algorithms/flowdppo.py, FlowDPPO._compute_sigma_t, lines 358-368:
    std_dev_t = sqrt(s / (1 - clamp(s, max=0.99))) * eta, sigma_t = std_dev_t sqrt(-dt), shape [1, S', 1, 1, 1]."""
    idx = torch.tensor(steps)
    s, s_next = sigmas[idx], sigmas[idx + 1]
    dt = s_next - s
    std_dev_t = torch.sqrt(s / (1.0 - torch.clamp(s, max=0.99))) * eta
    return (std_dev_t * torch.sqrt(-dt)).reshape(1, -1, 1, 1, 1)


def unirl_flowdppo_kl_adv_loss(new_logp, old_logp, new_means, old_means, advantages, sigma_t, threshold):
    """UniRL@1a7b501 unirl/algorithms/flowdppo.py, _flowdppo_kl_adv_loss, lines 86-111 (with _gaussian_kl_div,
    line 51): per element [B, S'], the KL mean-reduced over the latent dims, kept iff KL < threshold or the ratio
    does not move in the advantage's direction; loss -A rho where kept, else 0."""
    ratio = torch.exp(new_logp - old_logp)
    adv = advantages.detach()
    unclipped = -adv * ratio
    kl = ((new_means - old_means) ** 2 / (2 * sigma_t**2)).mean(dim=tuple(range(2, new_means.ndim)))
    kl_mask = kl < threshold
    rm = ((~kl_mask) & (ratio > 1.0) & (adv > 0)) | ((~kl_mask) & (ratio < 1.0) & (adv < 0))
    return torch.where(~rm, unclipped, torch.zeros(())), kl, rm


def test_step0_std_rules_match_flow_grpo_and_unirl():
    """``next_sigma`` is the rollout kernel's std (flow_grpo's, line 47 above), ``clamp`` UniRL's sigma_t at every
    step; they differ only at step 0 (sigma = 1): by 2.00x on the diffusers schedule, 1.89x on UniRL's own.
    Measured max abs diff of ``clamp`` against UniRL's sigma_t: 6.0e-8."""
    sig = shift3_sigmas()
    steps = list(range(10))
    clamp = flow_sde_std(sig[:-1], sig[1:], A, "clamp")[1]
    nxt = flow_sde_std(sig[:-1], sig[1:], A, "next_sigma")[1]
    assert torch.allclose(clamp, unirl_sigma_t(sig, steps, A).reshape(-1), rtol=1e-6, atol=0)
    ref = torch.stack([flow_grpo_sde_step(torch.zeros(1, 1), torch.zeros(1, 1), sig, i, A, noise=torch.zeros(1, 1))[3]
                       for i in steps]).reshape(-1)
    assert torch.allclose(nxt, ref, rtol=1e-6, atol=0)
    assert torch.equal(clamp[1:], nxt[1:]) and abs(float(clamp[0] / nxt[0]) - 2.00) < 0.01
    uni = unirl_static_sigmas()
    ratio = flow_sde_std(uni[0], uni[1], A, "clamp")[1] / flow_sde_std(uni[0], uni[1], A, "next_sigma")[1]
    assert abs(float(ratio) - 1.89) < 0.01
    # the kernel's std is the `next_sigma` rule (the log-probs never change with the option)
    assert torch.equal(kernel_mean_std("flow_sde", torch.zeros(1, 1), torch.zeros(1, 1), sig[0], sig[1], A)[1], nxt[0])


@pytest.mark.parametrize("rule", ["clamp", "next_sigma"])
def test_flow_dppo_loss_and_mask_match_unirl(rule):
    """The same old / new log-probs and means through trust_region.kl_masked_policy_loss (with old_policy_kl and the
    std of the ``kl_mask_first_step`` rule) and through UniRL's loss, at steps 0, 2 and 4 of the schedule (steps its
    recipe trains). ``clamp`` (UniRL's sigma_t) matches everywhere; ``next_sigma`` differs only in step 0's KL.
    Measured with ``clamp``: per-element loss max abs diff 0, KL max relative diff 2.5e-7, mask identical on all
    192 elements (32 masked)."""
    sig = shift3_sigmas()
    steps = [0, 2, 4]
    g = torch.Generator().manual_seed(0)
    B, S = 64, len(steps)
    old_means = torch.randn(B, S, 4, 8, 8, generator=g)
    sigma_t = unirl_sigma_t(sig, steps, A)
    # mean moves spanning the threshold at every step (KL from ~1e-7 to ~1e-4 against delta 1e-5)
    scale = sigma_t * torch.logspace(-3.5, -1.8, B)[:, None, None, None, None]
    new_means = old_means + scale * torch.randn(B, S, 4, 8, 8, generator=g)
    old_logp = torch.randn(B, S, generator=g)
    new_logp = old_logp + 1e-3 * torch.randn(B, S, generator=g)  # |log ratio| far above float32's 1 + eps
    adv = torch.randn(B, generator=g)
    delta = 1e-5
    loss_ref, kl_ref, rm_ref = unirl_flowdppo_kl_adv_loss(new_logp, old_logp, new_means, old_means,
                                                          adv[:, None].expand(B, S), sigma_t, delta)
    assert 0 < int(rm_ref.sum()) < rm_ref.numel()  # some masked, some kept: the comparison can fail
    for j, k in enumerate(steps):
        std = flow_sde_std(sig[k], sig[k + 1], A, rule)[1]
        kl = old_policy_kl(old_means[:, j], new_means[:, j], std)
        loss, stats = kl_masked_policy_loss(new_logp[:, j], old_logp[:, j], adv, kl, delta)
        if rule == "clamp" or k > 0:
            assert torch.allclose(kl, kl_ref[:, j], rtol=1e-5, atol=0), float((kl - kl_ref[:, j]).abs().max())
            assert torch.equal(stats["mask_frac"].bool(), rm_ref[:, j])
            assert torch.allclose(loss, loss_ref[:, j], rtol=1e-6, atol=1e-7)
        else:  # step 0 with the kernel's std: KL 2.0^2 = 4x UniRL's, so more is masked
            assert torch.allclose(kl, kl_ref[:, j] * float(sigma_t[0, 0] / std) ** 2, rtol=1e-5)
            assert int(stats["mask_frac"].sum()) > int(rm_ref[:, j].sum())


def test_flow_dppo_ratio_rounding_edge_is_stated():
    """The one place where the forms part: UniRL compares ``exp(log_ratio)`` with 1 in float32, we compare
    ``log_ratio`` with 0. For log_ratio in about (-3e-8, 6e-8) (float32's half-ulps at 1) its ratio rounds to 1 and
    such a sample is never masked there, while here it is (when its KL is above delta). Both are the paper's rule
    up to that rounding; this test pins where the difference sits."""
    lr = torch.tensor([5e-8, -2e-8, 1e-6, -1e-6])
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    kl = torch.full((4,), 1.0)  # above delta: masked iff moving away in A's direction
    _, stats = kl_masked_policy_loss(lr, torch.zeros(4), adv, kl, 1e-5)
    assert stats["mask_frac"].tolist() == [1.0, 1.0, 1.0, 1.0]
    ratio = torch.exp(lr)
    unirl_rm = ((ratio > 1.0) & (adv > 0)) | ((ratio < 1.0) & (adv < 0))
    assert unirl_rm.tolist() == [False, False, True, True]


# ---------------------------------------------------------------- b. DiffusionNFT: advantages and timesteps
def nvlabs_global_std_advantages(prompts, rewards):
    """NVlabs/DiffusionNFT@24af555 flow_grpo/stat_tracking.py, PerPromptStatTracker.update with global_std=True,
    lines 13-31 (one iteration; the trainer clears the tracker after each, scripts/train_nft_sd3.py line 769):
    (r - mean over the prompt's rewards) / (np.std of ALL rewards + 1e-4), float64."""
    prompts, rewards = np.array(prompts), np.array(rewards, dtype=np.float64)
    adv = np.empty_like(rewards) * 0.0
    for p in np.unique(prompts):
        mean = np.mean(rewards[prompts == p], axis=0, keepdims=True)
        std = np.std(rewards, axis=0, keepdims=True) + 1e-4
        adv[prompts == p] = (rewards[prompts == p] - mean) / std
    return adv


def test_diffusion_nft_advantages_match_nvlabs_global_std():
    """DiffusionNFTTrainer.compute_advantages (its default scale_rewards="batch") on 6 groups of 4 against the
    tracker; the clip to +-adv_clip_max is NVlabs' clamp in the loss (train_nft_sd3.py lines 910-914), applied to
    the reference here. Measured max abs diff: 8.4e-8 (float32 vs float64)."""
    g = torch.Generator().manual_seed(0)
    P, G = 6, 4
    group_ids = torch.arange(P).repeat_interleave(G)
    rewards = torch.rand(P * G, generator=g) * torch.linspace(0.1, 1, P).repeat_interleave(G)
    rewards[0] = 5.0  # an outlier, so that a clip at 2 binds
    prompts = [f"prompt {int(i)}" for i in group_ids]
    ref = np.clip(nvlabs_global_std_advantages(prompts, rewards.tolist()), -2.0, 2.0)
    trainer = SimpleNamespace(config=SimpleNamespace(scale_rewards="batch", adv_clip_max=2.0), gather=lambda t: t,
                              _local_slice=lambda n: slice(0, n), device="cpu")
    rollout = SimpleNamespace(rewards=rewards, group_ids=group_ids)
    DiffusionNFTTrainer.compute_advantages(trainer, rollout)
    assert np.abs(ref).max() == 2.0 and (np.abs(ref) < 2.0).sum() > 20  # the clip binds, on some samples
    ours = rollout.advantages.numpy()
    assert np.allclose(ours, ref, rtol=1e-5, atol=1e-6), np.abs(ours - ref).max()
    # the group std (the paper's formula) is another quantity: the check can tell the two apart
    assert not np.allclose(group_advantages(rewards, group_ids, "group").numpy(), ref, atol=1e-3)


def unirl_resolve_timesteps_all(sigmas, fraction=0.99):
    """Tencent-Hunyuan/UniRL@1a7b501 unirl/algorithms/diffusionnft.py, DiffusionNFT._resolve_timesteps with
    train_timestep_mode="all", lines 409-436 (the shuffle of lines 446-448 left out: only the set is compared):
    the rollout's sigmas without the terminal 0, then the slice [int(n * 0), int(n * fraction))."""
    ts = sigmas.flatten()
    if ts.numel() > 1 and torch.isclose(ts[-1], torch.zeros(()), atol=1e-8):
        ts = ts[:-1]
    n = ts.numel()
    return ts[int(n * 0.0):min(int(n * fraction), n)]


def test_diffusion_nft_shared_timesteps_match_unirl(tmp_path):
    """``timestep_sampling="shared"``: every sample of a microbatch pass sees the same noise levels (UniRL broadcasts
    one scalar t to the batch, lines 266-268 and 319-320), and over its T passes exactly UniRL's set of sigmas.
    Measured max abs diff of the sorted sigmas: 0."""
    from conftest import PROMPTS, brightness, tiny_config
    from trl_flow import DiffusionNFTConfig
    from trl_flow.testing import tiny_sd3_pipeline

    cfg = tiny_config(tmp_path, DiffusionNFTConfig, num_inference_steps=10, max_steps=1, timestep_sampling="shared")
    tr = DiffusionNFTTrainer(cfg, tiny_sd3_pipeline(), [brightness], train_dataset=list(PROMPTS))
    ro = tr.make_rollout(0)
    order, _ = tr.training_points(ro, torch.arange(4), 0, 0, 0)
    assert all(torch.equal(row, order[0]) for row in order)
    ours = torch.sort(ro.schedule.sigmas[order[0]].float().cpu()).values
    theirs = torch.sort(unirl_resolve_timesteps_all(ro.schedule.sigmas.float().cpu())).values
    assert torch.equal(ours, theirs) and len(ours) == 9
    assert float(theirs.max()) == float(ro.schedule.sigmas[0])  # the highest noise level in, the lowest (k = 9) out
