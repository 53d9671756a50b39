"""Configuration of :class:`~trl_flow.FlowGRPOTrainer`."""

from __future__ import annotations

from dataclasses import dataclass, field

from .base_config import FlowRLConfig


@dataclass
class FlowGRPOConfig(FlowRLConfig):
    """Flow-GRPO (arXiv 2505.05470). Defaults are the published SD3.5-M recipe (10 steps, cfg 4.5, a = 0.7,
    clip 1e-4, beta 0.04, LoRA r 32 / alpha 64), except the group size (published 24; default 8 here)."""

    clip_range: float = field(default=1e-4, metadata={"help": "PPO clip range eps on the per-step ratio (published: 1e-4 with mean-reduced log-probs)."})

    def __post_init__(self):
        super().__post_init__()
        if not (0 < self.clip_range < 1):
            raise ValueError(f"FlowGRPOConfig.clip_range={self.clip_range!r}: must be in (0, 1)")
