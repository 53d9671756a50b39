"""Fields of the policy-gradient trainers: the log-probability ratio of the rollout's kernel, its trust region (PPO
clip or Flow-DPPO's KL mask), the form of the KL to the reference and the log-density reduction. Flow-GRPO and every
method built on it (OP-GRPO, Stepwise-Flow-GRPO, Flow-DPPO) use them; DiffusionNFT, whose loss is on the forward
process, does not."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..config_fields import meta
from ..kernels import FIRST_STEP_STDS, KL_FORMS, REDUCTIONS
from ..trust_region import DEFAULT_KL_MASK_DELTA, KL_MASK_MODES, TRUST_REGIONS
from .base_config import FlowRLConfig

#: ``trajectory_storage``: every state and mean, or those of the steps the update can train.
TRAJECTORY_STORAGES = ("all", "trained")


@dataclass
class PolicyGradientConfig(FlowRLConfig):
    logprob_reduction: str = field(default="mean", metadata=meta("refuse",
        "Reduce the per-dimension log-density by `mean` (reference code; clip ranges ~1e-4) or `sum`."))
    kl_form: str = field(default="reference", metadata=meta("notice",
        "Form of the KL penalty. `reference` (default, the Flow-GRPO reference code, with which the published betas "
        "were tuned): ||mu - mu_ref||^2 / (2 a^2 s/(1-s)), i.e. the exact KL times |dt| for flow_sde (3.7x-25x "
        "weaker per step at 10 steps, shift 3); `exact`: the exact kernel KL ||mu - mu_ref||^2 / (2 std^2) of the "
        "paper's formula. cps: both forms agree; ddim: always exact."))
    trust_region: str = field(default="clip", metadata=meta("notice",
        "How each update is kept near the rollout's policy: `clip` (PPO ratio clip, Flow-GRPO; `clip_range`) or "
        "`kl_mask` (Flow-DPPO's divergence trust region: a sample's term is dropped when the exact old-vs-new kernel "
        "KL of its step exceeds `kl_mask_delta` and the update moves away from the old policy in its advantage's "
        "direction; no clip)."))
    clip_range: float = field(default=1e-4, metadata=meta("notice",
        "trust_region=`clip`: PPO clip range eps on the per-step ratio (published Flow-GRPO: 1e-4 with mean-reduced "
        "log-probs)."))
    kl_mask_delta: float | None = field(default=None, metadata=meta("notice",
        "trust_region=`kl_mask`: threshold on the exact KL between the frozen old kernel and the current one, "
        "||mu_old - mu_theta||^2 / (2 std^2) with the kernel's full std (flow_sde: including sqrt(-dt)), "
        "mean-reduced over latent dims whatever logprob_reduction. This is NOT the `kl_form` scaling of the beta-KL "
        "to the reference policy. Default (None): 1e-5 for every kernel, the authors' released Flow-DPPO code "
        "(resolved where it is used, `resolved_kl_mask_delta`); 1e-7 for flow_sde and 1e-6 for cps are attributed to "
        "the paper's write-up but unverified (the write-up we have gives no delta; pass them explicitly to try "
        "them)."))
    kl_mask_mode: str = field(default="asymmetric", metadata=meta("notice",
        "trust_region=`kl_mask`: `asymmetric` (Flow-DPPO: a step back toward the old policy is never masked) or "
        "`symmetric` (ABLATION only: mask every sample whose KL exceeds the threshold; the paper reports training "
        "collapses)."))
    kl_mask_first_step: str = field(default="next_sigma", metadata=meta("notice",
        "trust_region=`kl_mask`, flow_sde: the std of the old-vs-new KL, which differs only where sigma > 0.99 (step "
        "0). `next_sigma` (default): the kernel's own (1 - sigma_next in the denominator at sigma = 1, Flow-GRPO's "
        "and UniRL's rollout kernel); `clamp`: 1 - min(sigma, 0.99), UniRL's Flow-DPPO loss (flowdppo.py): 2.0x the "
        "step-0 std on SD3.5's 10-step schedule. Log-probs are unchanged."))

    trajectory_storage: str = field(default="all", metadata=meta("harmless",
        "Steps the rollout keeps. `all`: every state x_0..x_K and kernel mean; `trained`: the "
        "states x_k and x_k+1 and the mean of each step the update can train, plus x_K: with a window of W of K "
        "steps, (2W + 1) / (K + 1) of the states at most), as Flow-Factory's `trajectory_indices` "
        "(X-GenGroup/Flow-Factory src/flow_factory/trainers/rl/grpo.py at b30dc00: compute_trajectory_indices of the "
        "train steps). The update reads the same values: results are bit for bit those of `all`. OP-GRPO refuses it "
        "(its buffer stores whole trajectory prefixes)."))
    offload_rollout_to_cpu: bool = field(default=False, metadata=meta("harmless",
        "Stored rollout in CPU memory. Its states, means and velocities stay there after sampling; the update "
        "moves each microbatch's to the device (Flow-Factory's `offload_samples_to_cpu`, "
        "src/flow_factory/hparams/training_args/_base.py at b30dc00). Saves their device memory during the update; "
        "results unchanged. OP-GRPO refuses it (it writes corrected means into the stored rollout)."))

    def __post_init__(self):
        super().__post_init__()
        need = self._need
        need(self.trajectory_storage in TRAJECTORY_STORAGES, "trajectory_storage",
             f"must be one of {TRAJECTORY_STORAGES}")
        need(isinstance(self.offload_rollout_to_cpu, bool), "offload_rollout_to_cpu", "must be True or False")
        need(self.sampler != "ode", "sampler",
             "`ode` has no log-prob and cannot be trained; use flow_sde, cps or ddim")
        need(self.timestep_fraction == 1 or not self.sde_window_size, "timestep_fraction",
             f"with sde_window_size={self.sde_window_size} the window already picks the trained steps; use one of the "
             "two (flow_grpo's Fast script uses the window alone)")
        need(self.logprob_reduction in REDUCTIONS, "logprob_reduction", f"must be one of {REDUCTIONS}")
        need(self.kl_form in KL_FORMS, "kl_form", f"must be one of {KL_FORMS}")
        need(self.trust_region in TRUST_REGIONS, "trust_region", f"must be one of {TRUST_REGIONS}")
        need(isinstance(self.clip_range, (int, float)) and 0 < self.clip_range < 1, "clip_range", "must be in (0, 1)")
        need(self.kl_mask_mode in KL_MASK_MODES, "kl_mask_mode", f"must be one of {KL_MASK_MODES}")
        need(self.kl_mask_first_step in FIRST_STEP_STDS, "kl_mask_first_step", f"must be one of {FIRST_STEP_STDS}")
        need(self.kl_mask_first_step == "next_sigma" or self.sampler == "flow_sde", "kl_mask_first_step",
             "`clamp` is a rule of the flow_sde kernel's std; leave `next_sigma` for other samplers")
        need(self.kl_mask_delta is None or isinstance(self.kl_mask_delta, (int, float))
             and not isinstance(self.kl_mask_delta, bool) and math.isfinite(self.kl_mask_delta)
             and self.kl_mask_delta >= 0, "kl_mask_delta", "must be a finite number >= 0, or None for the default")

    @property
    def resolved_kl_mask_delta(self) -> float:
        """``kl_mask_delta``, or its default when None (read at use, never stored in the field, so
        ``dataclasses.replace`` of another field keeps meaning "the default")."""
        return DEFAULT_KL_MASK_DELTA if self.kl_mask_delta is None else float(self.kl_mask_delta)

    def resolved_defaults(self) -> dict:
        return {**super().resolved_defaults(), "kl_mask_delta": self.resolved_kl_mask_delta}
