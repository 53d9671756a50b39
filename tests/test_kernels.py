"""Transition kernels (trl_flow.kernels) against independent implementations of the METHODS.md formulas, and the
ODE kernel against the diffusers pipeline itself."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import HEIGHT, MAX_SEQ, PROMPTS, WIDTH

from trl_flow.kernels import gaussian_kl, gaussian_log_prob, kernel_mean_std, sde_step

SHAPE = (3, 4, 5, 6)  # (B, C, h, w)
STOCHASTIC = ("flow_sde", "cps", "ddim")


def _xv(seed=0, shape=SHAPE):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


# ------------------------------------------------------------------ independent float64 implementation of the table
def ref_mean_std(sampler, x, v, s, s_next, a):
    """METHODS.md table, scalar noise levels in python floats, tensors in float64."""
    x = x.double()
    v = v.double()
    dt = s_next - s
    if sampler == "ode":
        return x + v * dt, 0.0
    if sampler == "flow_sde":
        ratio = s / (1 - (s_next if s == 1 else s))  # s / (1 - s), with s' in the denominator at s = 1
        std = a * math.sqrt(ratio) * math.sqrt(-dt)
        mean = x * (1 + a**2 * ratio * dt / (2 * s)) + v * (1 + a**2 * ratio * (1 - s) / (2 * s)) * dt
        return mean, std
    if sampler == "cps":
        std = s_next * math.sin(a * math.pi / 2)
    elif sampler == "ddim":
        std = a * s_next * math.sqrt(1 - s)
    else:
        raise ValueError(sampler)
    x0hat = x - s * v
    x1hat = x + (1 - s) * v
    mean = (1 - s_next) * x0hat + math.sqrt(max(s_next**2 - std**2, 0.0)) * x1hat
    return mean, std


def ref_log_prob(sample, mean, std, reduction):
    lp = torch.distributions.Normal(mean.double(), torch.as_tensor(std, dtype=torch.float64)).log_prob(sample.double())
    dims = tuple(range(1, lp.ndim))
    return lp.mean(dims) if reduction == "mean" else lp.sum(dims)


# (sigma, sigma_next) pairs incl. sigma = 1 (the flow_sde special case) and a last step to 0
LEVELS = [(1.0, 0.85), (0.85, 0.6), (0.6, 0.3), (0.3, 0.05)]


@pytest.mark.parametrize("sampler", STOCHASTIC)
@pytest.mark.parametrize("s,s_next", LEVELS)
def test_mean_std_match_methods_table(sampler, s, s_next):
    x, v = _xv(1)
    a = 0.7 if sampler != "ddim" else 0.5
    mean, std = kernel_mean_std(sampler, x, v, s, s_next, a)
    ref_mean, ref_std = ref_mean_std(sampler, x, v, s, s_next, a)
    assert mean.dtype == torch.float32
    torch.testing.assert_close(mean.double(), ref_mean, rtol=1e-5, atol=1e-5)
    assert float(std) == pytest.approx(ref_std, rel=1e-6, abs=1e-7)


def test_flow_sde_sigma_one_uses_next_sigma_in_denominator():
    # at s = 1: std = a sqrt(1 / (1 - s')) sqrt(1 - s'), i.e. exactly a (finite, no division by zero)
    x, v = _xv(2)
    _, std = kernel_mean_std("flow_sde", x, v, 1.0, 0.8, 0.7)
    assert float(std) == pytest.approx(0.7 * math.sqrt(1 / 0.2) * math.sqrt(0.2), rel=1e-6)
    assert math.isfinite(float(std))
    # and the x-coefficient is 1 + a^2 (1/(1-s')) dt / 2, the v-coefficient just dt (1 - s = 0)
    mean, _ = kernel_mean_std("flow_sde", x, v, 1.0, 0.8, 0.7)
    coef_x = 1 + 0.49 * (1 / 0.2) * (-0.2) / 2
    torch.testing.assert_close(mean.double(), x.double() * coef_x + v.double() * (-0.2), rtol=1e-5, atol=1e-6)


def test_cps_and_ddim_specific_values():
    x, v = _xv(3)
    # cps: std = s' sin(a pi / 2); a = 1 -> std = s' and the x1hat coefficient vanishes
    mean, std = kernel_mean_std("cps", x, v, 0.6, 0.4, 1.0)
    assert float(std) == pytest.approx(0.4, rel=1e-6)
    torch.testing.assert_close(mean, 0.6 * (x - 0.6 * v), rtol=1e-5, atol=1e-6)
    # ddim: std = eta s' sqrt(1 - s)
    _, std = kernel_mean_std("ddim", x, v, 0.64, 0.5, 0.5)
    assert float(std) == pytest.approx(0.5 * 0.5 * 0.6, rel=1e-6)


@pytest.mark.parametrize("sampler", STOCHASTIC)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("s,s_next", [(1.0, 0.85), (0.6, 0.3)])
def test_sde_step_log_prob_is_gaussian_density(sampler, reduction, s, s_next):
    if sampler == "ddim" and s == 1.0:
        s = 0.9  # the first ddim step is deterministic (tested below)
    x, v = _xv(4)
    a = 0.7
    gen = torch.Generator().manual_seed(123)
    prev, lp, mean, std = sde_step(sampler, x, v, s, s_next, a, generator=gen, logprob_reduction=reduction)
    assert lp.shape == (SHAPE[0],) and lp.dtype == torch.float32
    ref_mean, ref_std = ref_mean_std(sampler, x, v, s, s_next, a)
    assert ref_std > 0
    expected = ref_log_prob(prev, ref_mean, ref_std, reduction)
    tol = 1e-4 if reduction == "mean" else 1e-4 * x[0].numel()
    torch.testing.assert_close(lp.double(), expected, rtol=1e-5, atol=tol)
    # the sample really is mean + std * noise: standardised residual ~ N(0, 1)
    z = (prev.double() - ref_mean) / ref_std
    assert abs(float(z.mean())) < 0.2 and abs(float(z.std()) - 1) < 0.15
    # scoring mode returns the same log-prob (bit for bit) as sampling mode
    prev2, lp2, mean2, std2 = sde_step(sampler, x, v, s, s_next, a, prev_sample=prev, logprob_reduction=reduction)
    assert torch.equal(lp2, lp) and torch.equal(prev2, prev) and torch.equal(mean2, mean)
    # scoring another sample gives its own (lower, further from the mean) density
    far = prev + 3 * ref_std
    _, lp_far, _, _ = sde_step(sampler, x, v, s, s_next, a, prev_sample=far, logprob_reduction=reduction)
    torch.testing.assert_close(lp_far.double(), ref_log_prob(far, ref_mean, ref_std, reduction), rtol=1e-5, atol=tol)
    assert bool((lp_far < lp).all())


def test_sum_equals_mean_times_dims():
    x, v = _xv(5)
    gen = torch.Generator().manual_seed(0)
    prev, lp_mean, _, _ = sde_step("flow_sde", x, v, 0.7, 0.5, 0.7, generator=gen)
    _, lp_sum, _, _ = sde_step("flow_sde", x, v, 0.7, 0.5, 0.7, prev_sample=prev, logprob_reduction="sum")
    torch.testing.assert_close(lp_sum, lp_mean * x[0].numel(), rtol=1e-5, atol=1e-3)


def test_per_sample_sigmas_match_scalar_calls():
    x, v = _xv(6)
    s = torch.tensor([1.0, 0.7, 0.4])
    s_next = torch.tensor([0.8, 0.5, 0.1])
    gen = torch.Generator().manual_seed(0)
    prev, lp, mean, std = sde_step("flow_sde", x, v, s, s_next, 0.7, generator=gen)
    for i in range(3):
        _, lp_i, mean_i, std_i = sde_step("flow_sde", x[i : i + 1], v[i : i + 1], float(s[i]), float(s_next[i]), 0.7,
                                          prev_sample=prev[i : i + 1])
        torch.testing.assert_close(lp[i : i + 1], lp_i, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(mean[i : i + 1], mean_i, rtol=1e-6, atol=1e-6)
        assert float(std.reshape(-1)[i]) == pytest.approx(float(std_i), rel=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_gaussian_kl_matches_monte_carlo(reduction):
    g = torch.Generator().manual_seed(7)
    B, D = 2, 6
    std = torch.tensor([0.5, 0.2]).view(B, 1)
    mean_a = torch.randn(B, D, generator=g)
    mean_b = mean_a + 0.4 * std * torch.randn(B, D, generator=g)  # ~ d = 1 in units of std
    kl = gaussian_kl(mean_a, mean_b, std, reduction)
    # exact closed form, independently
    closed = ((mean_a.double() - mean_b.double()) ** 2 / (2 * std.double() ** 2))
    closed = closed.mean(1) if reduction == "mean" else closed.sum(1)
    torch.testing.assert_close(kl.double(), closed, rtol=1e-5, atol=1e-8)
    # Monte Carlo: E_{x ~ N(mean_a, std)} [log p_a(x) - log p_b(x)], 200k samples
    n = 200_000
    mc = []
    for i in range(B):
        xs = mean_a[i] + std[i] * torch.randn(n, D, generator=g)
        la = gaussian_log_prob(xs, mean_a[i].expand(n, D), std[i], reduction)
        lb = gaussian_log_prob(xs, mean_b[i].expand(n, D), std[i], reduction)
        mc.append(float((la.double() - lb.double()).mean()))
    for i in range(B):
        assert mc[i] == pytest.approx(float(kl[i]), rel=0.02), (mc, kl)
    assert float(kl.min()) > 0.01  # a non-trivial KL was tested


def test_gaussian_kl_is_zero_for_equal_means_and_symmetric():
    a, b = _xv(8)
    std = torch.tensor(0.3)
    assert torch.equal(gaussian_kl(a, a, std), torch.zeros(SHAPE[0]))
    torch.testing.assert_close(gaussian_kl(a, b, std), gaussian_kl(b, a, std))


@pytest.mark.parametrize("sampler,s,s_next", [("ddim", 1.0, 0.8), ("cps", 0.3, 0.0), ("ddim", 0.3, 0.0),
                                              ("ode", 0.6, 0.3)])
def test_zero_std_steps_have_zero_log_prob_and_kl(sampler, s, s_next):
    x, v = _xv(9)
    gen = torch.Generator().manual_seed(0)
    prev, lp, mean, std = sde_step(sampler, x, v, s, s_next, 0.7, generator=gen)
    assert float(std) == 0.0
    assert torch.equal(prev, mean)  # deterministic
    assert torch.equal(lp, torch.zeros(SHAPE[0]))
    # scoring any other sample there still gives 0 (no density; such steps are never trained), never NaN/inf
    _, lp2, _, _ = sde_step(sampler, x, v, s, s_next, 0.7, prev_sample=prev + 1.0, logprob_reduction="sum")
    assert torch.equal(lp2, torch.zeros(SHAPE[0]))
    assert torch.equal(gaussian_kl(mean, mean + 1.0, std), torch.zeros(SHAPE[0]))


def test_flow_sde_with_zero_noise_is_the_ode_step():
    x, v = _xv(10)
    for s, s_next in LEVELS:
        ode = sde_step("ode", x, v, s, s_next, 0.0)
        sde = sde_step("flow_sde", x, v, s, s_next, 0.0, generator=torch.Generator().manual_seed(0))
        assert torch.equal(sde[0], ode[0]), (s, s_next)
        assert torch.equal(sde[2], ode[2])
        torch.testing.assert_close(ode[0].double(), x.double() + v.double() * (s_next - s))


@pytest.mark.parametrize("sampler", STOCHASTIC)
def test_sampling_is_reproducible_with_a_seed(sampler):
    x, v = _xv(11)
    out1 = sde_step(sampler, x, v, 0.6, 0.3, 0.7, generator=torch.Generator().manual_seed(5))
    out2 = sde_step(sampler, x, v, 0.6, 0.3, 0.7, generator=torch.Generator().manual_seed(5))
    out3 = sde_step(sampler, x, v, 0.6, 0.3, 0.7, generator=torch.Generator().manual_seed(6))
    assert torch.equal(out1[0], out2[0]) and torch.equal(out1[1], out2[1])
    assert not torch.equal(out1[0], out3[0])


def test_bf16_inputs_are_computed_in_float32():
    x, v = _xv(12)
    _, lp, mean, _ = sde_step("flow_sde", x.bfloat16(), v.bfloat16(), 0.6, 0.3, 0.7,
                              generator=torch.Generator().manual_seed(0))
    assert lp.dtype == torch.float32 and mean.dtype == torch.float32
    ref_mean, _ = ref_mean_std("flow_sde", x.bfloat16().float(), v.bfloat16().float(), 0.6, 0.3, 0.7)
    torch.testing.assert_close(mean.double(), ref_mean, rtol=1e-5, atol=1e-5)


def test_unknown_sampler_and_reduction_raise():
    x, v = _xv(13)
    with pytest.raises(ValueError, match="sampler"):
        kernel_mean_std("foo", x, v, 0.5, 0.3, 0.7)
    with pytest.raises(ValueError, match="logprob_reduction"):
        sde_step("flow_sde", x, v, 0.5, 0.3, 0.7, logprob_reduction="max")


# ------------------------------------------------------------------------- ODE kernel == the diffusers pipeline
@pytest.mark.parametrize("guidance_scale", [1.0, 4.5])
def test_ode_rollout_reproduces_pipeline_exactly(base_pipe, guidance_scale):
    from trl_flow.models import get_adapter
    from trl_flow.rollout import sample_trajectories

    pipe = base_pipe
    prompts = PROMPTS[:3]
    K = 5
    expected = pipe(prompts, height=HEIGHT, width=WIDTH, num_inference_steps=K, guidance_scale=guidance_scale,
                    generator=torch.Generator().manual_seed(3), output_type="latent",
                    max_sequence_length=MAX_SEQ).images
    adapter = get_adapter(pipe)
    noise = adapter.initial_noise(len(prompts), HEIGHT, WIDTH, torch.Generator().manual_seed(3))
    embeds = adapter.encode_prompts(prompts, guidance_scale > 1, MAX_SEQ)
    schedule = adapter.schedule(K, HEIGHT, WIDTH)
    assert schedule.num_steps == K and float(schedule.sigmas[0]) == 1.0 and float(schedule.sigmas[-1]) == 0.0
    traj = sample_trajectories(adapter, pipe.transformer, embeds, noise, schedule, ["ode"] * K, 0.0,
                               guidance_scale, batch_size=len(prompts))
    assert traj["states"].shape == (len(prompts), K + 1, *expected.shape[1:])
    assert torch.equal(traj["states"][:, 0], noise)
    assert torch.equal(traj["states"][:, -1], expected)
    assert torch.equal(traj["log_probs"], torch.zeros(len(prompts), K))
    assert torch.equal(traj["stds"], torch.zeros(K))


def test_sde_rollout_stores_consistent_transitions(base_pipe):
    """Every stored transition re-scores (scoring mode) to exactly the stored log-prob and mean."""
    from trl_flow.models import get_adapter
    from trl_flow.rollout import sample_trajectories, step_samplers

    adapter = get_adapter(base_pipe)
    K = 4
    prompts = PROMPTS[:2]
    noise = adapter.initial_noise(2, HEIGHT, WIDTH, torch.Generator().manual_seed(0))
    embeds = adapter.encode_prompts(prompts, False, MAX_SEQ)
    schedule = adapter.schedule(K, HEIGHT, WIDTH)
    kinds = step_samplers("flow_sde", K, None)
    assert kinds == ["flow_sde"] * (K - 1) + ["ode"]
    run = lambda seed: sample_trajectories(adapter, base_pipe.transformer, embeds, noise, schedule, kinds, 0.7, 1.0,
                                           batch_size=2, generator=torch.Generator().manual_seed(seed))
    traj = run(1)
    assert torch.equal(traj["states"], run(1)["states"])  # reproducible
    assert not torch.equal(traj["states"][:, 1:], run(2)["states"][:, 1:])
    assert bool((traj["stds"][:-1] > 0).all()) and float(traj["stds"][-1]) == 0.0
    with torch.no_grad():
        for k in range(K):
            x = traj["states"][:, k]
            v = adapter.velocity(base_pipe.transformer, x, schedule.timesteps[k], embeds, 1.0)
            _, lp, mean, _ = sde_step(kinds[k], x, v, schedule.sigmas[k], schedule.sigmas[k + 1], 0.7,
                                      prev_sample=traj["states"][:, k + 1])
            assert torch.equal(lp, traj["log_probs"][:, k]) and torch.equal(mean, traj["means"][:, k])
