"""Flow-GRPO: group-relative policy optimisation of a flow-matching model through its SDE sampler."""

from __future__ import annotations

from ..advantages import group_advantages
from ..kernels import flow_sde_std
from ..losses import clipped_policy_loss, masked_mean
from ..trust_region import kl_masked_policy_loss, old_policy_kl
from .policy_gradient_trainer import PolicyGradientTrainer
from .flow_grpo_config import FlowGRPOConfig


class FlowGRPOTrainer(PolicyGradientTrainer):
    """Flow-GRPO, from "Flow-GRPO: Training Flow Matching Models via Online RL" (arXiv 2505.05470).

    ```python
    from datasets import Dataset
    from trl_flow import FlowGRPOConfig, FlowGRPOTrainer
    from trl_flow.rewards import jpeg_incompressibility
    from trl_flow.testing import tiny_sd3_pipeline

    # or StableDiffusion3Pipeline.from_pretrained("stabilityai/stable-diffusion-3.5-medium")
    pipe = tiny_sd3_pipeline()
    config = FlowGRPOConfig(output_dir="out", max_steps=2, num_generations=4, prompts_per_step=2,
                            height=32, width=32, num_inference_steps=4, per_device_train_batch_size=4)
    trainer = FlowGRPOTrainer(config, pipe, [jpeg_incompressibility],
                              train_dataset=Dataset.from_dict({"prompt": ["a cat", "a dog"]}))
    trainer.train()
    trainer.save_model("out/final")  # pipe.load_lora_weights("out/final")
    ```

    Per iteration: sample G trajectories per prompt with the SDE kernel, score the final images,
    ``A_i = (r_i - mean_group) / (std + 1e-4)`` (std over the batch by default, ``scale_rewards``) clipped to
    ``+-adv_clip_max``, then per trained step minimise ``max(-A rho, -A clip(rho, 1 - eps, 1 + eps)) + beta KL``
    with the KL in ``kl_form`` (default: the reference code's, see the config). The defaults reproduce the
    reference code: KL form, detached unconditional branch (``guidance_grad``), batch std.

    ``trust_region="kl_mask"`` replaces the clip by Flow-DPPO's divergence mask (:mod:`trl_flow.trust_region`);
    every subclass (OP-GRPO, per-step advantages) inherits the choice. Logged either way: ``kl_old`` (mean), and
    by the base ``kl_old_max`` and ``kl_old_first_max`` (0 before the first update).
    """

    config_class = FlowGRPOConfig
    _method_name = "flow_grpo"
    summary = "Flow-GRPO (arXiv 2505.05470)"
    paper = "Flow-GRPO, arXiv 2505.05470"

    def compute_advantages(self, rollout):
        cfg = self.config
        adv = group_advantages(self.gather(rollout.rewards), self.gather(rollout.group_ids),
                               cfg.scale_rewards, clip=cfg.adv_clip_max, baseline=self.advantage_baseline(rollout))
        rollout.advantages = adv[self._local_slice(len(adv))].to(self.device)

    def advantage_baseline(self, rollout):
        """(N,) bool over the gathered batch: the samples whose rewards make the group statistics; None: all."""
        return None

    def compute_loss(self, rollout, idx, k, out):
        cfg = self.config
        # per step or not
        adv = rollout.advantages[idx, k] if rollout.advantages.ndim == 2 else rollout.advantages[idx]
        weights = self.importance_weights(rollout, idx, k)
        kl_old = old_policy_kl(rollout.mean(idx, k), out.mean, self.kl_old_std(rollout, k, out))  # mu_old vs theta
        if cfg.trust_region == "kl_mask":
            loss, stats = kl_masked_policy_loss(out.log_prob, rollout.log_probs[idx, k], adv, kl_old,
                                                cfg.resolved_kl_mask_delta, weights=weights, mode=cfg.kl_mask_mode)
        else:
            loss, stats = clipped_policy_loss(out.log_prob, rollout.log_probs[idx, k], adv, cfg.clip_range,
                                              weights=weights, weight_placement=self.weight_placement)
            stats["kl_old"] = kl_old
        if cfg.beta > 0:
            kl = self.kl_penalty(rollout, k, out)
            loss = loss + cfg.beta * kl
            stats["kl"] = kl.detach()
        return masked_mean(loss, rollout.train_mask[idx, k]), stats

    def kl_old_std(self, rollout, k, out):
        """The std of step ``k``'s old-vs-new KL: the kernel's, or with ``kl_mask_first_step="clamp"`` flow_sde's
        with ``1 - min(sigma, 0.99)`` in the denominator (UniRL's Flow-DPPO loss)."""
        cfg = self.config
        if cfg.kl_mask_first_step == "next_sigma" or rollout.extras["step_kinds"][k] != "flow_sde":
            return out.std
        sig = rollout.schedule.sigmas
        return flow_sde_std(sig[k], sig[k + 1], cfg.noise_level, "clamp", ref=out.mean)[1]

    #: Where ``importance_weights`` enter the clipped objective (:data:`trl_flow.losses.WEIGHT_PLACEMENTS`).
    weight_placement = "objective"

    def importance_weights(self, rollout, idx, k):
        """(B,) detached weights multiplying the sample's objective (clip: ``w * max(...)``; kl_mask: the kept term),
        or None (on-policy). OP-GRPO overrides this."""
        return None
