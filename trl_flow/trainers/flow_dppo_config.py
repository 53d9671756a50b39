"""Configuration of :class:`~trl_flow.FlowDPPOTrainer`."""

from __future__ import annotations

from dataclasses import dataclass, field

from .flow_grpo_config import FlowGRPOConfig


@dataclass
class FlowDPPOConfig(FlowGRPOConfig):
    """Flow-DPPO (arXiv 2606.11025): Flow-GRPO with the divergence trust region (``trust_region="kl_mask"``) in
    place of the ratio clip, two update passes per rollout, ``beta = 1e-3`` on the exact kernel KL
    (``kl_form="exact"``). Defaults follow the authors' released code where it differs from the write-up:
    ``kl_mask_delta`` 1e-5 for every kernel (the write-up: 1e-7 ``flow_sde`` / 1e-6 ``cps``) and the exact KL for
    the beta term (Flow-GRPO's reference form is 6-28x weaker per step for ``flow_sde``). Works with
    ``sampler="flow_sde"`` (default) and ``"cps"`` (the paper's best: Flow-DPPO + CPS)."""

    trust_region: str = field(default="kl_mask", metadata={"help": "Flow-DPPO's divergence trust region `kl_mask` (the only value this preset accepts; for the ratio clip with several inner epochs use FlowGRPOConfig(num_inner_epochs=2))."})
    num_inner_epochs: int = field(default=2, metadata={"help": "Passes of updates over each rollout (Flow-DPPO: 2; stable reuse of a rollout is the point of its trust region). The first pass keeps the rollout's batch composition so the first ratio is exactly 1; later passes shuffle."})
    beta: float = field(default=1e-3, metadata={"help": "Weight of the KL to the reference policy, in `kl_form` (Flow-DPPO: 1e-3 best). Unrelated to the old-vs-new KL of the trust region (`kl_mask_delta`). 0 skips the reference forward pass."})
    kl_form: str = field(default="exact", metadata={"help": "Form of the beta-KL to the reference policy. `exact` (default here: the authors' released Flow-DPPO code uses the exact kernel KL ||mu - mu_ref||^2 / (2 std^2), with which beta = 1e-3 was tuned); `reference`: Flow-GRPO's reference-code form, the exact KL times |dt| for flow_sde (6-28x weaker per step; equal for cps)."})

    def __post_init__(self):
        super().__post_init__()
        if self.trust_region != "kl_mask":
            raise ValueError(f"{type(self).__name__}.trust_region={self.trust_region!r}: Flow-DPPO is defined by "
                             "`kl_mask`; for the ratio clip use FlowGRPOConfig (num_inner_epochs=2 for the same reuse)")
