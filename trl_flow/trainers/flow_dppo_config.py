"""Configuration of :class:`~trl_flow.FlowDPPOTrainer`."""

from __future__ import annotations

from dataclasses import dataclass, field

from .flow_grpo_config import FlowGRPOConfig


@dataclass
class FlowDPPOConfig(FlowGRPOConfig):
    """Flow-DPPO (arXiv 2606.11025): Flow-GRPO with the divergence trust region (``trust_region="kl_mask"``) in
    place of the ratio clip, two update passes per rollout and ``beta = 1e-3``. ``kl_mask_delta`` defaults per
    kernel to the paper's 1e-7 (``flow_sde``) / 1e-6 (``cps``); the authors' released recipe uses 1e-5. Works with
    ``sampler="flow_sde"`` (default) and ``"cps"`` (the paper's best: Flow-DPPO + CPS)."""

    trust_region: str = field(default="kl_mask", metadata={"help": "Flow-DPPO's divergence trust region `kl_mask` (the only value this preset accepts; for the ratio clip with several inner epochs use FlowGRPOConfig(num_inner_epochs=2))."})
    num_inner_epochs: int = field(default=2, metadata={"help": "Passes of updates over each rollout (Flow-DPPO: 2; stable reuse of a rollout is the point of its trust region). The first pass keeps the rollout's batch composition so the first ratio is exactly 1; later passes shuffle."})
    beta: float = field(default=1e-3, metadata={"help": "Weight of the KL to the reference policy, in `kl_form` (Flow-DPPO: 1e-3 best). Unrelated to the old-vs-new KL of the trust region (`kl_mask_delta`). 0 skips the reference forward pass."})

    def __post_init__(self):
        super().__post_init__()
        if self.trust_region != "kl_mask":
            raise ValueError(f"{type(self).__name__}.trust_region={self.trust_region!r}: Flow-DPPO is defined by "
                             "`kl_mask`; for the ratio clip use FlowGRPOConfig (num_inner_epochs=2 for the same reuse)")
