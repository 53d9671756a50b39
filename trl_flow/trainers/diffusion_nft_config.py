"""Configuration of :class:`~trl_flow.DiffusionNFTTrainer`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..config_fields import meta

from .base_config import FlowRLConfig

#: Where the defaults come from: NVlabs/DiffusionNFT at commit 24af555 (``config/base.py``, ``config/nft.py``,
#: ``scripts/train_nft_sd3.py``).
REFERENCE_CODE = "NVlabs/DiffusionNFT@24af555"
#: ``decay_type`` -> (flat steps, rate per optimizer step, cap) of the old policy's decay (``return_decay``).
DECAY_SCHEDULES = {0: (0, 0.0, 0.0), 1: (0, 0.001, 0.5), 2: (75, 0.0075, 0.999)}
TIMESTEP_SAMPLINGS = ("per_sample", "shared")
ADV_MODES = ("all", "positive_only", "negative_only", "one_only", "binary")


@dataclass
class DiffusionNFTConfig(FlowRLConfig):
    """DiffusionNFT ("DiffusionNFT: Online Diffusion Reinforcement with Forward Process", arXiv 2509.16117).

    Defaults are NVlabs' released code (``config/nft.py``'s ``_get_config``, ``config/base.py``) where it and the
    paper differ; each field's help names both. Differences from the shared defaults: the rollout kernel is the
    deterministic ``ode`` (any kernel works), no classifier-free guidance (``guidance_scale=1``), ``beta`` is the
    weight of the velocity KL to the reference (``train.beta`` 1e-4); the method's own beta is ``nft_beta``.
    It sits on the run layer (:class:`FlowRLConfig`), not the policy-gradient one: no ratio, trust region, KL form
    or log-density reduction; the loss is on the forward process, so any kernel works, `ode` included."""

    sampler: str = field(default="ode", metadata=meta("refuse",
        "Kernel of the rollout (which only produces the final samples: nothing of the trajectory is trained). "
        "Default `ode`, the deterministic Euler sampler of the pipeline's own scheduler (the reference code samples "
        "deterministically too, `sample.deterministic=True`, but with its second-order `dpm2` solver, which trl_flow "
        "does not ship; the paper: any black-box solver). `flow_sde`, `cps` and `ddim` work as well."))
    guidance_scale: float = field(default=1.0, metadata=meta("notice",
        "Classifier-free guidance of the rollout and the update. Default 1.0: CFG-free, the reference code "
        "(`_get_config` sets `sample.guidance_scale = 1.0`, also for its evaluation) and the paper (CFG-free "
        "training and sampling). > 1: two-branch guidance in both the rollout and every velocity of the loss "
        "(`guidance_grad` says which branch is trained)."))
    beta: float = field(default=1e-4, metadata=meta("notice",
        "Weight of the KL term to the reference policy (adapters disabled / frozen copy): loss += beta * "
        "mean((v_theta - v_ref)^2) at the training point x_t. Default 1e-4, the reference code's `train.beta` "
        "(config/base.py and _get_config); the paper trains without it. 0 skips the reference forward pass. Not "
        "DiffusionNFT's beta: that is `nft_beta`."))
    nft_beta: float = field(default=1.0, metadata=meta("notice",
        "DiffusionNFT's beta, the step of the implicit policies around the old velocity: v+ = beta v_theta + (1 - "
        "beta) v_old, v- = (1 + beta) v_old - beta v_theta; the policy loss is divided by it. Default 1.0, the "
        "reference code's `config.beta` (_get_config); its sd3_ocr and sd3_multi_reward configs use 0.1 (the OCR "
        "recipe does). > 0."))
    decay_type: int = field(default=1, metadata=meta("notice",
        "Schedule of the old policy's decay after each iteration, old <- decay old + (1 - decay) theta, with `decay` "
        "a function of the optimizer steps n taken so far (the reference code's `return_decay`): 1 (default, "
        "_get_config): min(0.001 n, 0.5); 2 (the reference's sd3_ocr): 0 for n < 75, then min(0.0075 (n - 75), "
        "0.999); 0: always 0 (old = current: on-policy). The paper describes the same soft update with an increasing "
        "decay, without numbers."))
    timestep_fraction: float = field(default=0.99, metadata=meta("notice",
        "Share of the rollout schedule's K timesteps trained per sample and iteration: T = int(K * fraction) (0.99 "
        "with K = 10: 9 of 10), the reference code's `train.timestep_fraction` (also UniRL's). In (0, 1]; T must be "
        ">= 1."))
    timestep_sampling: str = field(default="per_sample", metadata=meta("notice",
        "Which training timesteps a microbatch sees at each of its T backward passes. `per_sample` (default, the "
        "reference code): every sample draws its own random permutation of the schedule's K timesteps and uses the "
        "first T, one per pass. `shared` (Tencent-Hunyuan/UniRL's diffusionnft.py): the schedule's first T timesteps "
        "(highest noise first; the terminal 0 is never one), in a random order drawn per microbatch and shared by "
        "its samples, one t per pass."))
    adv_mode: str = field(default="all", metadata=meta("notice",
        "How the clipped advantages enter the optimality probability r (the reference code's `train.adv_mode`): "
        "`all` (default: as they are), `positive_only` / `negative_only` (the other sign set to 0, i.e. r = 0.5), "
        "`one_only` (1 where A > 0, else 0), `binary` (sign(A))."))

    def __post_init__(self):
        super().__post_init__()
        name = type(self).__name__

        def need(cond, field_name, msg):
            if not cond:
                raise ValueError(f"{name}.{field_name}={getattr(self, field_name)!r}: {msg}")

        need(isinstance(self.nft_beta, (int, float)) and not isinstance(self.nft_beta, bool)
             and math.isfinite(self.nft_beta) and self.nft_beta > 0, "nft_beta",
             "must be a finite number > 0 (the policy loss is divided by it; the reference uses 1.0, 0.1 for OCR)")
        need(self.decay_type in DECAY_SCHEDULES and not isinstance(self.decay_type, bool), "decay_type",
             f"must be one of {sorted(DECAY_SCHEDULES)} (the reference code's return_decay schedules)")
        need(self.timestep_sampling in TIMESTEP_SAMPLINGS, "timestep_sampling", f"must be one of {TIMESTEP_SAMPLINGS}")
        need(self.adv_mode in ADV_MODES, "adv_mode", f"must be one of {ADV_MODES}")
        need(not (self.same_noise_per_group and self.sampler == "ode"), "same_noise_per_group",
             "with the deterministic `ode` sampler every trajectory of a group would be the same image (one reward, "
             "no advantage); set it False or use a stochastic sampler")
