"""The policy-gradient layer: every method that trains on the rollout kernel's log-probabilities (Flow-GRPO and
those built on it). A microbatch's backward passes are its trained steps; each re-scores the stored transition
``x_k -> x_{k+1}`` under the current policy (:meth:`forward_step`) and hands it to the method's
:meth:`compute_loss`. The layer also keeps what only a ratio has: the first ratio's deviation from 1 (exactly 0 before
any update), the ratio's extremes and the old-vs-new kernel KL of Flow-DPPO's trust region."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..kernels import kernel_mean_std, reference_kl, sde_step
from ..models import index_embeds
from ..rollout import Rollout
from .base_trainer import FlowRLTrainer, UpdateLog
from .policy_gradient_config import PolicyGradientConfig


@dataclass
class StepOutput:
    """The current policy at one trained step of a microbatch (B samples): everything (B,) or (B, *L)."""

    log_prob: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    ref_mean: torch.Tensor | None = None


class PolicyGradientTrainer(FlowRLTrainer):
    """Base of the trainers whose loss is a function of the rollout kernel's log-probabilities. A method implements
    :meth:`compute_advantages` and :meth:`compute_loss`."""

    config_class = PolicyGradientConfig
    batched_term_hooks = ("term_loss", "forward_step")

    @property
    def logprob_reduction(self) -> str:
        return self.config.logprob_reduction

    @property
    def rollout_store(self) -> str:
        return "trained" if self.config.trajectory_storage == "trained" else "trajectory"

    @property
    def offload_rollout(self) -> bool:
        return self.config.offload_rollout_to_cpu

    def stored_steps(self, step_kinds):
        """The stochastic steps below ``num_train_timesteps``: every step :meth:`loss_terms` can train."""
        return [k for k, kind in enumerate(step_kinds) if kind != "ode" and k < self.config.num_train_timesteps]

    # ------------------------------------------------------------------------------------ method interface
    def compute_loss(self, rollout: Rollout, idx: torch.Tensor, k: int, out: StepOutput):
        """Loss (scalar) of trained step ``k`` for the microbatch ``idx`` and per-sample stats {name: (B,)}."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------------------- update
    def loss_terms(self, rollout, idx, step, epoch, batch):
        """The rollout's trained steps below ``num_train_timesteps`` (``timestep_fraction``; all at 1): a function of
        the schedule and config alone, so identical on every process (DDP needs equal backward calls)."""
        limit = self.config.num_train_timesteps
        return [k for k in rollout.trained_steps() if k < limit]

    def term_loss(self, rollout, idx, k):
        out = self.forward_step(rollout, idx, k, need_ref=self.config.beta > 0)
        loss, stats = self.compute_loss(rollout, idx, k, out)
        return loss, stats, rollout.train_mask[idx, k]

    def term_batches(self, terms):
        """``batch_replay_steps``: all trained steps of a microbatch in one forward and one backward."""
        return [list(terms)] if self.config.batch_replay_steps and terms else super().term_batches(terms)

    def term_losses(self, rollout, idx, ks):
        if len(ks) == 1:
            return [self.term_loss(rollout, idx, ks[0])]
        outs = self.forward_steps(rollout, idx, ks, need_ref=self.config.beta > 0)
        results = []
        for k, out in zip(ks, outs):  # the method's loss of each step, unchanged
            loss, stats = self.compute_loss(rollout, idx, k, out)
            results.append((loss, stats, rollout.train_mask[idx, k]))
        return results

    def forward_steps(self, rollout: Rollout, idx: torch.Tensor, ks: list[int], need_ref: bool) -> list[StepOutput]:
        """:meth:`forward_step` of each step of ``ks`` with one transformer forward (``batch_replay_steps``): the B
        samples' states at the S steps as B*S rows, step-major, with per-row timesteps and the embeddings repeated
        S times (and likewise one forward of the reference policy); the velocities are split back per step and each
        goes through the step's own kernel."""
        S, B = len(ks), len(idx)
        xs = [rollout.state(idx, k) for k in ks]
        t = torch.stack([rollout.schedule.timesteps[k] for k in ks]).repeat_interleave(B)
        v, v_ref = self._velocities(torch.cat(xs), t, index_embeds(rollout.embeds, idx.repeat(S)), need_ref)
        v_ref = [None] * S if v_ref is None else v_ref.split(B)
        return [self._step_output(rollout, idx, k, xs[j], v_j, v_ref[j])
                for j, (k, v_j) in enumerate(zip(ks, v.split(B)))]

    def forward_step(self, rollout: Rollout, idx: torch.Tensor, k: int, need_ref: bool) -> StepOutput:
        """Re-score the stored transition ``x_k -> x_{k+1}`` of samples ``idx`` under the current policy."""
        x = rollout.state(idx, k)
        v, v_ref = self._velocities(x, rollout.schedule.timesteps[k], index_embeds(rollout.embeds, idx), need_ref)
        return self._step_output(rollout, idx, k, x, v, v_ref)

    def _velocities(self, x: torch.Tensor, t: torch.Tensor, emb, need_ref: bool):
        """The current policy's velocity at ``x`` (with gradient, the unconditional branch detached under
        ``guidance_grad="cond_only"``) and, with ``need_ref``, the reference policy's (else None)."""
        cfg = self.config
        with self._autocast():
            v = self.adapter.velocity(self.model, x, t, emb, cfg.guidance_scale,
                                      detach_uncond=cfg.guidance_grad == "cond_only")
        v_ref = None
        if need_ref:
            with torch.no_grad(), self.reference_policy() as ref, self._autocast():
                v_ref = self.adapter.velocity(ref, x, t, emb, cfg.guidance_scale)
        return v, v_ref

    def _step_output(self, rollout: Rollout, idx: torch.Tensor, k: int, x: torch.Tensor, v: torch.Tensor,
                     v_ref: torch.Tensor | None) -> StepOutput:
        """Step ``k``'s kernel at the velocities: the stored ``x_{k+1}``'s log-prob, the mean and std, and the
        reference mean where ``v_ref`` is given."""
        cfg = self.config
        kind = rollout.extras["step_kinds"][k]
        sig = rollout.schedule.sigmas
        _, log_prob, mean, std = sde_step(kind, x, v, sig[k], sig[k + 1], cfg.noise_level,
                                          prev_sample=rollout.state(idx, k + 1),
                                          logprob_reduction=cfg.logprob_reduction)
        ref_mean = None
        if v_ref is not None:
            ref_mean, _ = kernel_mean_std(kind, x, v_ref, sig[k], sig[k + 1], cfg.noise_level)
        return StepOutput(log_prob=log_prob, mean=mean, std=std, ref_mean=ref_mean)

    def kl_penalty(self, rollout: Rollout, k: int, out: StepOutput) -> torch.Tensor:
        """(B,) KL of step ``k`` between the current and the reference kernel, in the configured ``kl_form``."""
        sig = rollout.schedule.sigmas
        return reference_kl(rollout.extras["step_kinds"][k], out.mean, out.ref_mean, out.std, sig[k], sig[k + 1],
                            self.config.kl_form, self.config.logprob_reduction)

    def record_extremes(self, log: UpdateLog, name: str, values: torch.Tensor, first: bool) -> None:
        if not values.numel():
            return
        if name == "ratio":
            log.keep("ratio_max", float(values.max()), max, start=-math.inf)
            log.keep("ratio_min", float(values.min()), min, start=math.inf)
            if first:
                log.keep("ratio_first_max_dev", float((values - 1).abs().max()), max, start=0.0)
        if name == "kl_old":  # old-vs-new kernel KL (trust_region.py)
            log.keep("kl_old_max", float(values.max()), max, start=0.0)
            if first:
                log.keep("kl_old_first_max", float(values.max()), max, start=0.0)

    def update_metrics(self, log: UpdateLog) -> dict[str, float]:
        metrics = log.means()
        if "mask_frac" not in metrics:  # the kl_mask trust region logs its own fractions instead
            metrics["clip_frac"] = metrics.pop("clipped", 0.0)
        for name in ("ratio_max", "ratio_min", "kl_old_max"):
            if name in log.extremes:
                metrics[name] = log.extremes[name]
        metrics["ratio_first_max_dev"] = log.extremes.get("ratio_first_max_dev", 0.0)
        if "kl_old" in log.counts:
            metrics["kl_old_first_max"] = log.extremes.get("kl_old_first_max", 0.0)
        return metrics
