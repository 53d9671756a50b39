"""Configuration of :class:`~trl_flow.FlowGRPOTrainer`."""

from __future__ import annotations

from dataclasses import dataclass

from .policy_gradient_config import PolicyGradientConfig


@dataclass
class FlowGRPOConfig(PolicyGradientConfig):
    """Flow-GRPO (arXiv 2505.05470). Defaults are the published SD3.5-M recipe (10 steps, cfg 4.5, a = 0.7,
    ratio clip (``trust_region="clip"``) 1e-4, beta 0.04, LoRA r 32 / alpha 64), except the group size (published
    24; default 8 here). ``trust_region="kl_mask"`` swaps in Flow-DPPO's divergence trust region."""
