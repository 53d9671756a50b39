"""Configuration of :class:`~trl_flow.FlowDPPOTrainer`."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config_fields import meta

from .flow_grpo_config import FlowGRPOConfig

#: Where the defaults come from: the authors' released code, Tencent-Hunyuan/UniRL at commit 1a7b501 (2026-06-13),
#: recipe ``examples/diffusion/sd3_flowdppo.yaml``, loss ``unirl/algorithms/flowdppo.py``, schedule
#: ``unirl/train/stack.py``.
RELEASED_CODE = "Tencent-Hunyuan/UniRL@1a7b501"
#: The paper's ablation value of ``beta`` (best of those it reports); a named option, not the default.
PAPER_ABLATION_BETA = 1e-3


@dataclass
class FlowDPPOConfig(FlowGRPOConfig):
    """Flow-DPPO ("Flow-DPPO: Divergence Proximal Policy Optimization for Flow Matching Models", arXiv 2606.11025):
    Flow-GRPO with the divergence trust region (``trust_region="kl_mask"``) in place of the ratio clip.

    Defaults follow the authors' released code (UniRL, ``examples/diffusion/sd3_flowdppo.yaml``) where it and the
    paper differ; each field's help names its source:

    - ``num_inner_epochs=1``: one pass over the rollout, each sample used once. The code's
      ``num_updates_per_batch: 2`` is two optimizer steps over disjoint halves of the rollout against one frozen
      anchor (``unirl/train/stack.py``), the same schedule as its Flow-GRPO recipe; here the optimizer steps of a
      pass come from the shared batch settings, so a default Flow-DPPO run and a default Flow-GRPO run take the same
      steps. ``num_inner_epochs=2`` (two passes, the multi-epoch reuse the paper argues the mask makes stable) is
      the named option.
    - ``beta=0.0``: the released loss has no KL to the reference policy. ``beta=1e-3`` (``PAPER_ABLATION_BETA``)
      is the paper's ablation, on the exact kernel KL (``kl_form="exact"``).
    - ``kl_mask_delta`` (shared field) 1e-5 for every kernel, the code's ``kl_mask_threshold``.

    Works with ``sampler="flow_sde"`` (default) and ``"cps"`` (the paper's best: Flow-DPPO + CPS)."""

    trust_region: str = field(default="kl_mask", metadata=meta("notice",
        "Flow-DPPO's divergence trust region `kl_mask` (the only value this preset accepts; for the ratio clip use "
        "FlowGRPOConfig)."))
    num_inner_epochs: int = field(default=1, metadata=meta("notice",
        "Passes of updates over each rollout. Default 1, the authors' released code (UniRL): its recipe's "
        "`num_updates_per_batch: 2` is 2 optimizer steps over disjoint halves of the rollout, each sample used once, "
        "all against one frozen old policy (unirl/train/stack.py), the same schedule as its Flow-GRPO recipe. Here "
        "the optimizer steps of a pass are `rollout / (processes * per_device_train_batch_size * "
        "gradient_accumulation_steps)`, as for Flow-GRPO, so default Flow-DPPO and Flow-GRPO runs take the same "
        "steps (choose gradient_accumulation_steps for the code's 2). Named option: 2, two passes (each sample used "
        "twice), the multi-epoch reuse that the paper argues its trust region keeps stable. The first pass keeps the "
        "rollout's batch composition so the first ratio is exactly 1; later passes shuffle."))
    beta: float = field(default=0.0, metadata=meta("notice",
        "Weight of the KL to the reference policy, in `kl_form`. Default 0, the authors' released code (UniRL's "
        "Flow-DPPO loss has no reference term); 0 also skips the reference forward pass. Named option: 1e-3, the "
        "paper's ablation (its best beta). Unrelated to the old-vs-new KL of the trust region (`kl_mask_delta`)."))
    kl_form: str = field(default="exact", metadata=meta("notice",
        "Form of the beta-KL to the reference policy (used only when beta > 0; the released code has no such term). "
        "`exact` (default): the exact kernel KL ||mu - mu_ref||^2 / (2 std^2), the same form as the trust region's "
        "old-vs-new KL, so beta and `kl_mask_delta` are on one scale; the form the paper's beta 1e-3 was tuned with "
        "is not stated. `reference`: Flow-GRPO's reference-code form, the exact KL times |dt| for flow_sde (6-28x "
        "weaker per step; equal for cps)."))

    def __post_init__(self):
        super().__post_init__()
        if self.trust_region != "kl_mask":
            raise ValueError(f"{type(self).__name__}.trust_region={self.trust_region!r}: Flow-DPPO is defined by "
                             "`kl_mask`; for the ratio clip use FlowGRPOConfig (same num_inner_epochs for the same "
                             "reuse)")
