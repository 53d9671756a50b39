"""Fidelity to the papers and the released code (the kernel measurement): where OP-GRPO's importance weight enters the
clipped objective, Flow-DPPO's defaults from its released code, and defaults resolved where they are used (never
stored in
``__post_init__``, so ``dataclasses.replace`` and recipe overrides keep meaning "the default")."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from trl_flow import FlowDPPOConfig, FlowGRPOConfig, OPGRPOConfig, StepwiseFlowGRPOConfig
from trl_flow.losses import clipped_policy_loss
from trl_flow.trust_region import DEFAULT_KL_MASK_DELTA, PAPER_KL_MASK_DELTAS

EPS = 0.1


def _grad(log_ratio, adv, w, placement):
    """Loss and d loss / d log_prob of one sample at ``rho = exp(log_ratio)``."""
    lp = torch.tensor([log_ratio], dtype=torch.float64, requires_grad=True)
    loss, stats = clipped_policy_loss(lp, torch.zeros(1, dtype=torch.float64),
                                      torch.tensor([adv], dtype=torch.float64),
                                      EPS, weights=torch.tensor([w], dtype=torch.float64), weight_placement=placement)
    loss.sum().backward()
    return float(loss.detach()), float(lp.grad), stats


# ------------------------------------------------------------------------------- 1. OP-GRPO's weight placement
@pytest.mark.parametrize("adv", [1.0, -1.0])
@pytest.mark.parametrize("w", [0.5, 2.0, 1.0 + 3 * EPS])
@pytest.mark.parametrize("log_ratio", [0.0, 0.5 * EPS, -0.5 * EPS])
def test_weight_multiplies_the_objective_inside_the_trust_region(adv, w, log_ratio):
    """Inside the trust region the gradient w.r.t. rho is -A w for BOTH signs of A (d/dlogp = -A w rho), whatever w.
    The earlier form max(-A w rho, -A clip(rho)) fails this: at rho = 1 with A > 0 and w > 1 the clipped branch
    wins and the gradient is 0 (a good replayed trajectory is never up-weighted); with A < 0 and w < 1 likewise."""
    rho = torch.exp(torch.tensor(log_ratio, dtype=torch.float64)).item()
    loss, grad, stats = _grad(log_ratio, adv, w, "objective")
    assert loss == pytest.approx(-adv * w * rho, rel=1e-12)
    assert grad == pytest.approx(-adv * w * rho, rel=1e-12)
    assert float(stats["clip_active"]) == 0.0


@pytest.mark.parametrize("adv,log_ratio", [(1.0, 3 * EPS), (-1.0, -3 * EPS)])
@pytest.mark.parametrize("w", [0.5, 2.0])
def test_weight_leaves_a_clipped_sample_without_gradient(adv, log_ratio, w):
    """Outside the trust region in the advantage's direction the clipped branch wins: no gradient, with or without
    w, and the weighted term is reported clipped."""
    loss, grad, stats = _grad(log_ratio, adv, w, "objective")
    assert grad == 0.0 and float(stats["clip_active"]) == 1.0
    assert loss == pytest.approx(-adv * w * (1 + EPS if adv > 0 else 1 - EPS), rel=1e-12)
    # moving back from outside is not clipped (PPO's max keeps the unclipped, larger term)
    _, grad_back, stats_back = _grad(-log_ratio, adv, w, "objective")
    assert grad_back != 0.0 and float(stats_back["clip_active"]) == 0.0


def test_unclipped_term_ablation_is_the_earlier_form_and_differs():
    """`unclipped_term` is max(-A w rho, -A clip(rho)) to the letter, and it is a different objective: at rho = 1 it
    acts like min(w, 1) for A > 0 and max(w, 1) for A < 0, and for |log w| > eps its clip boundary moves."""
    for adv in (1.0, -1.0):
        for w in (0.5, 2.0):
            for log_ratio in (0.0, 0.05, -0.05, 0.3, -0.3):
                rho = torch.exp(torch.tensor(log_ratio, dtype=torch.float64)).item()
                loss, _, stats = _grad(log_ratio, adv, w, "unclipped_term")
                expect = max(-adv * w * rho, -adv * min(max(rho, 1 - EPS), 1 + EPS))
                assert loss == pytest.approx(expect, rel=1e-12)
                assert float(stats["clip_active"]) == float(-adv * min(max(rho, 1 - EPS), 1 + EPS) > -adv * w * rho)
    # at rho = 1: the good replayed trajectory (A > 0, w = 2) gets weight min(w, 1) = 1 here, w = 2 with `objective`
    assert _grad(0.0, 1.0, 2.0, "unclipped_term")[1] == pytest.approx(-1.0)
    assert _grad(0.0, 1.0, 2.0, "objective")[1] == pytest.approx(-2.0)
    # |log w| > eps: the ablation's boundary for A > 0 moves to (1 + eps) / w = 0.55 for w = 2, so at rho = 0.7
    # (inside it, far below 1 - eps) the step up is blocked; `objective` pushes it up with weight w
    assert _grad(float(torch.log(torch.tensor(0.7))), 1.0, 2.0, "unclipped_term")[1] == 0.0
    assert _grad(float(torch.log(torch.tensor(0.7))), 1.0, 2.0, "objective")[1] == pytest.approx(-2.0 * 0.7, rel=1e-6)
    # a bad replayed trajectory with w = 0.5 (A < 0) is pushed down with weight max(w, 1) = 1 instead of 0.5
    assert _grad(0.0, -1.0, 0.5, "unclipped_term")[1] == pytest.approx(1.0)
    assert _grad(0.0, -1.0, 0.5, "objective")[1] == pytest.approx(0.5)


def test_no_weights_and_unit_weights_are_the_plain_objective():
    g = torch.Generator().manual_seed(0)
    lp, old, adv = torch.randn(64, generator=g) * 0.2, torch.randn(64, generator=g) * 0.2, torch.randn(64, generator=g)
    plain, _ = clipped_policy_loss(lp, old, adv, EPS)
    for placement in ("objective", "unclipped_term"):
        ones, _ = clipped_policy_loss(lp, old, adv, EPS, weights=torch.ones(64), weight_placement=placement)
        assert torch.equal(plain, ones)
    with pytest.raises(ValueError, match="weight_placement"):
        clipped_policy_loss(lp, old, adv, EPS, weight_placement="inside")


def test_op_grpo_config_placement_field():
    assert OPGRPOConfig().importance_weight_placement == "objective"
    assert OPGRPOConfig(importance_weight_placement="unclipped_term").importance_weight_placement == "unclipped_term"
    with pytest.raises(ValueError, match=r"OPGRPOConfig\.importance_weight_placement="):
        OPGRPOConfig(importance_weight_placement="unclipped")
    help_text = {f.name: f.metadata["help"] for f in dataclasses.fields(OPGRPOConfig)}["importance_weight_placement"]
    assert "ABLATION" in help_text and "w * max(-A rho, -A clip(rho))" in help_text


# --------------------------------------------------------------------------------------- 2. Flow-DPPO defaults
def test_flow_dppo_defaults_follow_the_released_code():
    c = FlowDPPOConfig()
    assert c.kl_form == "exact" and FlowGRPOConfig().kl_form == "reference"
    assert c.kl_mask_delta is None
    for sampler in ("flow_sde", "cps"):
        assert FlowDPPOConfig(sampler=sampler).resolved_kl_mask_delta == DEFAULT_KL_MASK_DELTA
        # the write-up's values stay available as explicit numbers
        assert FlowDPPOConfig(sampler=sampler, kl_mask_delta=PAPER_KL_MASK_DELTAS[sampler]).resolved_kl_mask_delta \
            == PAPER_KL_MASK_DELTAS[sampler]
    helps = {f.name: f.metadata["help"] for f in dataclasses.fields(FlowDPPOConfig)}
    for value in (DEFAULT_KL_MASK_DELTA, *PAPER_KL_MASK_DELTAS.values()):
        # the help gives both the code's and the paper's
        assert f"{value:.0e}".replace("e-0", "e-") in helps["kl_mask_delta"], value
    assert "released" in helps["kl_mask_delta"] and "released" in helps["kl_form"]


# ------------------------------------------------------------------------------ 3. defaults that do not go stale
def test_replace_keeps_default_meaning_default():
    c = dataclasses.replace(FlowDPPOConfig(), sampler="cps", noise_level=0.5)
    assert c.kl_mask_delta is None and c.resolved_kl_mask_delta == DEFAULT_KL_MASK_DELTA
    explicit = dataclasses.replace(FlowDPPOConfig(kl_mask_delta=3e-6), sampler="cps")
    assert explicit.resolved_kl_mask_delta == 3e-6
    # truncation_fraction 0.1 (the replay-share change; was K // 2): the last ceil(0.1 (K - 1)) of the K - 1 trained
    # steps regenerated
    o = OPGRPOConfig(num_inference_steps=10)
    assert o.truncation_step is None and o.resolved_truncation_step == 8
    o6 = dataclasses.replace(o, num_inference_steps=6)
    assert o6.resolved_truncation_step == 4
    assert dataclasses.replace(OPGRPOConfig(num_inference_steps=10, truncation_step=4),
                               num_inference_steps=6).resolved_truncation_step == 4
    with pytest.raises(ValueError, match=r"OPGRPOConfig\.truncation_step="):  # explicit value checked again
        dataclasses.replace(OPGRPOConfig(num_inference_steps=10, truncation_step=8), num_inference_steps=6)
    # the flat config (checkpoints, trackers, cards) holds what the defaults stand for
    from trl_flow.engine.checkpoints import flat_config

    flat = flat_config(o6)
    assert flat["truncation_step"] == 4 and flat["kl_mask_delta"] == DEFAULT_KL_MASK_DELTA


def test_recipe_that_overrides_sampler_and_steps_resolves_defaults():
    from trl_flow import cli

    _, c, _ = cli.parse_args("dppo", ["--config", "shapes_dppo", "--sampler", "cps", "--noise_level", "0.5"])
    assert c.sampler == "cps" and c.kl_mask_delta is None and c.resolved_kl_mask_delta == DEFAULT_KL_MASK_DELTA
    _, o, _ = cli.parse_args("op-grpo", ["--config", "shapes_op_grpo", "--num_inference_steps", "8",
                                         "--truncation_step", "5"])
    # an explicit truncation_step stays what it says
    assert o.resolved_truncation_step == o.truncation_step == 5
    for recipe in ("shapes_op_grpo", "sd35m_op_grpo_geneval"):  # the recipes leave it to truncation_fraction
        _, o, _ = cli.parse_args("op-grpo", ["--config", recipe, "--num_inference_steps", "8"])
        assert o.truncation_step is None and o.resolved_truncation_step == 6, recipe


def test_stepwise_preset_still_valid_under_replace():
    s = dataclasses.replace(StepwiseFlowGRPOConfig(), sampler="flow_sde")
    assert s.resolved_kl_mask_delta == DEFAULT_KL_MASK_DELTA
