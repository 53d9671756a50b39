"""The Flow-DPPO divergence trust region (trl_flow/trust_region.py): the mask's truth table, its gradients, overflow
safety, the old-vs-new kernel KL against closed forms and Monte Carlo, and the config fields that select it."""

from __future__ import annotations

import math

import pytest
import torch

from trl_flow import FlowDPPOConfig, FlowGRPOConfig, OPGRPOConfig
from trl_flow.kernels import gaussian_log_prob, kernel_mean_std
from trl_flow.trust_region import DEFAULT_KL_MASK_DELTA, kl_mask, kl_masked_policy_loss, old_policy_kl

DELTA = 1e-6
# every (advantage sign, ratio side, KL side) case: A in {+, -, 0}; rho > 1, < 1, == 1; D above, at, below delta
ADVS = {"+": 1.5, "-": -0.5, "0": 0.0}
LOG_RATIOS = {"up": 0.25, "down": -0.25, "one": 0.0}
KLS = {"above": 2 * DELTA, "at": DELTA, "below": 0.5 * DELTA}
CASES = [(a, r, d) for a in ADVS for r in LOG_RATIOS for d in KLS]
# Written out, not derived: the only blocked cases are "KL above delta AND moving away in the advantage's direction".
BLOCKED_ASYMMETRIC = {("+", "up", "above"), ("-", "down", "above")}
BLOCKED_SYMMETRIC = {(a, r, "above") for a in ADVS for r in LOG_RATIOS}


def _batch(cases=CASES):
    adv = torch.tensor([ADVS[a] for a, _, _ in cases])
    log_ratio = torch.tensor([LOG_RATIOS[r] for _, r, _ in cases])
    kl = torch.tensor([KLS[d] for _, _, d in cases], dtype=torch.float32)
    old = torch.linspace(-3.0, 2.0, len(cases))
    log_prob = (old + log_ratio).requires_grad_(True)
    return adv, log_ratio, kl, old, log_prob


@pytest.mark.parametrize("mode,blocked", [("asymmetric", BLOCKED_ASYMMETRIC), ("symmetric", BLOCKED_SYMMETRIC)])
def test_mask_truth_table_loss_and_gradient(mode, blocked):
    adv, log_ratio, kl, old, log_prob = _batch()
    # kl is float32, so "at" is exactly delta in float32: compare against that value (KL == delta is not blocked)
    delta = float(kl[[d == "at" for _, _, d in CASES].index(True)])
    keep = kl_mask(kl, log_ratio, adv, delta, mode)
    assert {c for c, m in zip(CASES, keep.tolist()) if not m} == blocked
    loss, stats = kl_masked_policy_loss(log_prob, old, adv, kl, delta, mode=mode)
    loss.sum().backward()
    for i, case in enumerate(CASES):
        rho = math.exp(LOG_RATIOS[case[1]])
        if case in blocked:
            assert (float(loss[i].detach()) == 0.0 and float(log_prob.grad[i]) == 0.0
                    and stats["mask_frac"][i] == 1.0), case
        else:
            assert float(loss[i].detach()) == pytest.approx(-ADVS[case[0]] * rho, rel=1e-6), case
            assert float(log_prob.grad[i]) == pytest.approx(-ADVS[case[0]] * rho, rel=1e-6), case  # d/dlogp of -A rho
            assert stats["mask_frac"][i] == 0.0, case
    # per-sign fractions: NaN outside their sign ("not part of this statistic")
    pos, neg = stats["mask_frac_pos_adv"], stats["mask_frac_neg_adv"]
    assert torch.isnan(pos[adv <= 0]).all() and torch.isnan(neg[adv >= 0]).all()
    assert torch.equal(pos[adv > 0], stats["mask_frac"][adv > 0]) and torch.equal(neg[adv < 0],
        stats["mask_frac"][adv < 0])
    torch.testing.assert_close(stats["ratio"], torch.exp(log_ratio), rtol=1e-6, atol=0)
    assert torch.equal(stats["kl_old"], kl)


def test_update_back_toward_old_policy_is_never_masked():
    """Far outside the trust region (D = 1e6 delta), every sample whose gradient step moves rho back toward 1 keeps
    its gradient, and gradient descent moves its log-ratio toward 0; only the 'away' samples lose theirs."""
    g = torch.Generator().manual_seed(0)
    adv = torch.randn(512, generator=g)
    log_ratio = 0.1 * torch.randn(512, generator=g)
    old = torch.zeros(512)
    log_prob = log_ratio.clone().requires_grad_(True)
    kl = torch.full((512,), 1e6 * DELTA)
    loss, _ = kl_masked_policy_loss(log_prob, old, adv, kl, DELTA)
    loss.sum().backward()
    toward = ((adv > 0) & (log_ratio < 0)) | ((adv < 0) & (log_ratio > 0))
    away = ((adv > 0) & (log_ratio > 0)) | ((adv < 0) & (log_ratio < 0))
    assert toward.sum() > 100 and away.sum() > 100
    step = -log_prob.grad  # the descent direction of each sample's log-ratio
    assert (step[toward] != 0).all()
    assert (torch.sign(step[toward]) == -torch.sign(log_ratio[toward])).all()  # toward rho = 1
    assert (step[away] == 0).all()


def test_trust_region_holds_on_a_gaussian_policy():
    """Gradient descent on the objective of a Gaussian policy N(theta, I) with fixed samples and advantages: without
    a trust region the KL to the old policy keeps growing; the asymmetric mask holds it at delta (the samples whose
    step leads back keep their gradient); the symmetric ablation freezes the policy as soon as it crosses delta (no
    gradient at all)."""
    g = torch.Generator().manual_seed(0)
    B, D, delta = 64, 16, 1e-3
    x = torch.randn(B, D, generator=g)
    adv = torch.randn(B, generator=g)
    adv = (adv - adv.mean()) / adv.std()
    old_lp = gaussian_log_prob(x, torch.zeros(B, D), torch.tensor(1.0))
    runs = {}
    for mode in ("asymmetric", "symmetric", None):
        theta = torch.zeros(D, requires_grad=True)
        opt = torch.optim.SGD([theta], lr=0.05)
        kls, objective = [], []
        for _ in range(300):
            mean = theta.expand(B, D)
            lp = gaussian_log_prob(x, mean, torch.tensor(1.0))
            kl = old_policy_kl(torch.zeros(B, D), mean, torch.tensor(1.0))
            if mode is None:
                loss = -(torch.exp(lp - old_lp) * adv)
            else:
                loss, _ = kl_masked_policy_loss(lp, old_lp, adv, kl, delta, mode=mode)
            objective.append(float((torch.exp(lp - old_lp) * adv).mean().detach()))
            opt.zero_grad()
            loss.mean().backward()
            opt.step()
            kls.append(float(kl[0]))
        runs[mode] = (kls, objective, theta.detach())
    assert max(runs[None][0]) > 5 * delta
    kls, objective, _ = runs["asymmetric"]
    assert max(kls) < 1.1 * delta and kls[-1] > 0.9 * delta
    assert objective[-1] > 0.9 * max(objective) > 0  # it stays on the boundary, near the best surrogate value
    kls, objective, theta = runs["symmetric"]
    crossed = next(i for i, v in enumerate(kls) if v > delta)
    assert kls[crossed:] == [kls[crossed]] * (len(kls) - crossed)  # frozen from the first crossing on


def test_overflowing_ratio_gives_finite_loss_and_gradient():
    # log-ratio +-1000: exp overflows to inf (or underflows to 0); such samples are outside the region and moving away
    old = torch.zeros(4)
    log_prob = torch.tensor([1000.0, -1000.0, 0.01, -0.02], requires_grad=True)
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0])
    kl = torch.tensor([1.0, 1.0, 0.0, 0.0])
    weights = torch.tensor([3.0, 0.5, 2.0, 1.0])
    loss, stats = kl_masked_policy_loss(log_prob, old, adv, kl, DELTA, weights=weights)
    total = loss.mean()
    total.backward()
    assert torch.isfinite(total) and torch.isfinite(log_prob.grad).all()
    assert stats["mask_frac"].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert log_prob.grad[:2].tolist() == [0.0, 0.0]
    # the kept samples are untouched by their overflowing neighbours, and w multiplies the kept term: -w rho A
    for i in (2, 3):
        rho = math.exp(float(log_prob[i].detach()))
        assert float(loss[i].detach()) == pytest.approx(-float(weights[i]) * rho * float(adv[i]), rel=1e-6)
        assert float(log_prob.grad[i]) == pytest.approx(-float(weights[i]) * rho * float(adv[i]) / 4, rel=1e-6)
    assert math.isinf(float(stats["ratio"][0]))  # the logged ratio is the true one


# ---------------------------------------------------------------------------------- the old-vs-new kernel KL
def _closed_form_kl(sampler, sigma, sigma_next, a, dv):
    """Per-dimension KL between two kernels whose velocities differ by ``dv``, derived by hand from METHODS.md."""
    dt = sigma_next - sigma
    if sampler == "flow_sde":
        denom = 1 - (sigma_next if sigma == 1 else sigma)
        var = a**2 * sigma / denom * (-dt)  # the full std^2, including -dt
        coef = (1 + a**2 * sigma / denom * (1 - sigma) / (2 * sigma)) * dt
    else:  # cps: std = s' sin(a pi / 2); the mean's v-coefficient is -(1 - s') s + s' cos(a pi / 2) (1 - s)
        var = (sigma_next * math.sin(a * math.pi / 2)) ** 2
        coef = -(1 - sigma_next) * sigma + sigma_next * math.cos(a * math.pi / 2) * (1 - sigma)
    return coef**2 * dv**2 / (2 * var)


@pytest.mark.parametrize("sampler,sigma,sigma_next", [("flow_sde", 0.8, 0.6), ("flow_sde", 1.0, 0.9),
                                                      ("cps", 0.8, 0.6), ("cps", 0.3, 0.1)])
def test_kl_equals_closed_form_and_monte_carlo(sampler, sigma, sigma_next):
    a = 0.7
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 4, 8, 8, generator=g)
    v = torch.randn(3, 4, 8, 8, generator=g)
    dv = 0.05 * torch.randn(3, 4, 8, 8, generator=g, dtype=torch.float64)
    mu_old, std = kernel_mean_std(sampler, x, v, sigma, sigma_next, a)
    mu_new, std_new = kernel_mean_std(sampler, x, v + dv.float(), sigma, sigma_next, a)
    assert torch.equal(std, std_new)
    kl = old_policy_kl(mu_old, mu_new, std)
    expected = _closed_form_kl(sampler, sigma, sigma_next, a, dv).mean(dim=(1, 2, 3))
    torch.testing.assert_close(kl.double(), expected, rtol=1e-4, atol=0)
    # torch.distributions agrees (a third, independent implementation of the Gaussian KL)
    ref = torch.distributions.kl_divergence(torch.distributions.Normal(mu_old.double(), std.double()),
                                            torch.distributions.Normal(mu_new.double(), std.double()))
    torch.testing.assert_close(kl.double(), ref.mean(dim=(1, 2, 3)), rtol=1e-4, atol=0)
    # Monte Carlo on a 4-dim slice: E_{x' ~ old}[mean_d(log p_old(x') - log p_new(x'))], 200k draws
    # (the mean difference rescaled so that the KL is 1: the estimate's relative error is then ~0.2%)
    s = std.reshape(())
    m_old, m_new = mu_old[0, :, 0, 0], mu_new[0, :, 0, 0]
    m_new = m_old + (m_new - m_old) / old_policy_kl(m_old[None], m_new[None], s)[0].sqrt()
    exact = float(old_policy_kl(m_old[None], m_new[None], s))
    assert exact == pytest.approx(1.0, rel=1e-5)
    samples = m_old + s * torch.randn(200_000, 4, generator=g)
    mc = (gaussian_log_prob(samples, m_old.expand_as(samples), s)
          - gaussian_log_prob(samples, m_new.expand_as(samples), s)).mean()
    assert abs(float(mc) - exact) < 0.02 * exact


def test_kl_uses_the_full_flow_sde_std():
    """The mask's KL includes sqrt(-dt) in the std: it is the reference-code beta-KL form divided by |dt|."""
    from trl_flow.kernels import reference_kl

    g = torch.Generator().manual_seed(2)
    x, v = torch.randn(2, 4, 4, 4, generator=g), torch.randn(2, 4, 4, 4, generator=g)
    mu_a, std = kernel_mean_std("flow_sde", x, v, 0.7, 0.5, 0.7)
    mu_b, _ = kernel_mean_std("flow_sde", x, v + 0.1, 0.7, 0.5, 0.7)
    beta_form = reference_kl("flow_sde", mu_b, mu_a, std, 0.7, 0.5, form="reference")
    torch.testing.assert_close(old_policy_kl(mu_a, mu_b, std), beta_form / 0.2, rtol=1e-5, atol=0)


# ------------------------------------------------------------------------------------------------ config
def test_defaults_per_preset_and_kernel():
    c = FlowDPPOConfig()
    assert (c.trust_region, c.num_inner_epochs, c.beta, c.kl_mask_mode) == ("kl_mask", 1, 0.0, "asymmetric")
    assert c.kl_mask_delta is None and c.resolved_kl_mask_delta == DEFAULT_KL_MASK_DELTA  # the released code's
    assert FlowDPPOConfig(sampler="cps").resolved_kl_mask_delta == DEFAULT_KL_MASK_DELTA
    assert FlowDPPOConfig(kl_mask_delta=1e-7).resolved_kl_mask_delta == 1e-7  # the write-up's flow_sde value
    g = FlowGRPOConfig()
    assert (g.trust_region, g.clip_range, g.num_inner_epochs) == ("clip", 1e-4, 1)
    o = OPGRPOConfig(trust_region="kl_mask", sampler="cps")
    assert (o.trust_region, o.resolved_kl_mask_delta, o.clip_range) == ("kl_mask", DEFAULT_KL_MASK_DELTA, 1e-4)


@pytest.mark.parametrize("cls,kwargs,field", [
    (FlowGRPOConfig, {"trust_region": "kl"}, "trust_region"),
    (OPGRPOConfig, {"trust_region": "ratio_clip"}, "trust_region"),
    (FlowGRPOConfig, {"kl_mask_mode": "both"}, "kl_mask_mode"),
    (FlowDPPOConfig, {"kl_mask_delta": -1e-7}, "kl_mask_delta"),
    (FlowDPPOConfig, {"kl_mask_delta": float("nan")}, "kl_mask_delta"),
    (FlowDPPOConfig, {"kl_mask_delta": "1e-7"}, "kl_mask_delta"),
    (FlowDPPOConfig, {"clip_range": 0.0}, "clip_range"),
    (FlowDPPOConfig, {"trust_region": "clip"}, "trust_region"),
    (FlowDPPOConfig, {"num_inner_epochs": 0}, "num_inner_epochs"),
])
def test_bad_values_name_the_field(cls, kwargs, field):
    with pytest.raises(ValueError, match=rf"{cls.__name__}\.{field}="):
        cls(**kwargs)


def test_trl_parser_and_help_texts():
    import dataclasses

    import trl

    (c,) = trl.TrlParser((FlowDPPOConfig,)).parse_args_into_dataclasses(
        ["--output_dir", "x", "--kl_mask_delta", "1e-5", "--sampler", "cps", "--kl_mask_mode", "symmetric"])
    assert (c.kl_mask_delta, c.sampler, c.kl_mask_mode, c.trust_region) == (1e-5, "cps", "symmetric", "kl_mask")
    (c,) = trl.TrlParser((OPGRPOConfig,)).parse_args_into_dataclasses(["--trust_region", "kl_mask"])
    assert c.trust_region == "kl_mask" and c.resolved_kl_mask_delta == DEFAULT_KL_MASK_DELTA
    fields = {f.name: f.metadata.get("help", "") for f in dataclasses.fields(FlowDPPOConfig)}
    assert all(len(h) > 10 for h in fields.values()), [n for n, h in fields.items() if len(h) <= 10]
    assert "ABLATION" in fields["kl_mask_mode"] and "NOT the `kl_form`" in fields["kl_mask_delta"]
