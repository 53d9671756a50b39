"""DiffusionNFT: online diffusion RL on the forward process, with implicit positive / negative policies.

Read top to bottom: (1) the optimality probability from the clipped advantages, (2) the loss of one training point,
(3) the old-policy decay schedule, then the trainer: the old policy's weights and the rollout that uses them, the
forward-process sampling of training timesteps, the update loop, the old-policy update, and its checkpoint state.
Rollout sampling, rewards, group advantages, the optimizer step, logging and checkpoints are the base's.
"""

from __future__ import annotations

import contextlib
import json
import os

import torch

from ..advantages import group_advantages
from ..losses import masked_mean
from ..models import index_embeds
from ..engine import checkpoints, distributed
from ..storage import follow_umask
from .base_trainer import FlowRLTrainer
from .diffusion_nft_config import DECAY_SCHEDULES, DiffusionNFTConfig

OLD_POLICY_NAME = "nft_old_policy.safetensors"
NFT_STATE_NAME = "nft_state.json"


# ---------------------------------------------------------------------------- 1. optimality probability
def optimality_probability(advantages: torch.Tensor, adv_clip_max: float, adv_mode: str = "all") -> torch.Tensor:
    """``r = clamp(A_clip / adv_clip_max / 2 + 0.5, 0, 1)`` (B,), with ``A_clip`` the advantages clipped to
    ``+-adv_clip_max`` and shaped by ``adv_mode`` (see :class:`DiffusionNFTConfig`). ``A = 0`` gives ``r = 0.5``."""
    a = advantages.float().clamp(-adv_clip_max, adv_clip_max)
    if adv_mode == "positive_only":
        a = a.clamp(0, adv_clip_max)
    elif adv_mode == "negative_only":
        a = a.clamp(-adv_clip_max, 0)
    elif adv_mode == "one_only":
        a = (a > 0).float()
    elif adv_mode == "binary":
        a = torch.sign(a)
    return (a / adv_clip_max / 2.0 + 0.5).clamp(0.0, 1.0)


# ---------------------------------------------------------------------------------------- 2. the loss
def nft_loss(v: torch.Tensor, v_old: torch.Tensor, x0: torch.Tensor, xt: torch.Tensor, t: torch.Tensor,
             r: torch.Tensor, nft_beta: float, adv_clip_max: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DiffusionNFT's policy loss per sample (B,) at the training points ``xt = (1 - t) x0 + t eps``.

    Args:
        v: (B, *L) current velocity (with grad). v_old: (B, *L) the old policy's (detached here).
        x0: (B, *L) the clean samples. xt: (B, *L). t: (B,) noise levels (sigmas). r: (B,) optimality
            probabilities.

    ``v+ = b v + (1 - b) v_old``, ``v- = (1 + b) v_old - b v`` (``b = nft_beta``); each gives an x0-prediction
    ``xt - t v+-``, scored by its squared error to ``x0`` divided by the detached mean absolute error (the adaptive
    weight, float64 in the reference, floored at 1e-5), averaged over the latent dims:
    ``(r L+ + (1 - r) L-) / b * adv_clip_max``.
    """
    t = t.to(x0.dtype).view(-1, *([1] * (x0.ndim - 1)))
    dims = tuple(range(1, x0.ndim))
    v_old = v_old.detach()
    positive = nft_beta * v + (1.0 - nft_beta) * v_old
    negative = (1.0 + nft_beta) * v_old - nft_beta * v
    x0_pos, x0_neg = xt - t * positive, xt - t * negative
    with torch.no_grad():
        w_pos = (x0_pos.double() - x0.double()).abs().mean(dim=dims, keepdim=True).clamp(min=1e-5).to(v.dtype)
        w_neg = (x0_neg.double() - x0.double()).abs().mean(dim=dims, keepdim=True).clamp(min=1e-5).to(v.dtype)
    loss_pos = ((x0_pos - x0) ** 2 / w_pos).mean(dim=dims)
    loss_neg = ((x0_neg - x0) ** 2 / w_neg).mean(dim=dims)
    loss = (r * loss_pos + (1.0 - r) * loss_neg) / nft_beta * adv_clip_max
    stats = {"nft/loss_pos": loss_pos.detach(), "nft/loss_neg": loss_neg.detach(),
             "nft/old_deviation": ((v - v_old) ** 2).mean(dim=dims).detach()}
    return loss, stats


# ------------------------------------------------------------------------------- 3. old-policy decay
def old_policy_decay(optimizer_steps: int, decay_type: int) -> float:
    """The reference code's ``return_decay``: 0 for ``n < flat``, then ``min(rate (n - flat), cap)``."""
    flat, rate, cap = DECAY_SCHEDULES[decay_type]
    return 0.0 if optimizer_steps < flat else min((optimizer_steps - flat) * rate, cap)


class DiffusionNFTTrainer(FlowRLTrainer):
    """DiffusionNFT, from "DiffusionNFT: Online Diffusion Reinforcement with Forward Process" (arXiv 2509.16117).

    ```python
    from trl_flow import DiffusionNFTConfig, DiffusionNFTTrainer
    from trl_flow.rewards import jpeg_incompressibility
    from trl_flow.testing import tiny_sd3_pipeline

    # or StableDiffusion3Pipeline.from_pretrained("stabilityai/stable-diffusion-3.5-medium")
    pipe = tiny_sd3_pipeline()
    config = DiffusionNFTConfig(output_dir="out", max_steps=2, num_generations=4, prompts_per_step=2,
                                height=32, width=32, num_inference_steps=4, per_device_train_batch_size=4,
                                max_sequence_length=16)
    trainer = DiffusionNFTTrainer(config, pipe, [jpeg_incompressibility], train_dataset=["a cat", "a dog"])
    trainer.train()
    trainer.save_model("out/final")  # pipe.load_lora_weights("out/final")
    ```

    Per iteration, with N samples, K rollout steps and latents of shape L:

    1. Rollout with the **old policy** (its weights swapped in): any kernel, by default the deterministic ``ode``
       without CFG. Only the final latents ``x0`` (N, *L) are kept (``rollout_store = "final"``), with the prompt
       embeddings and the schedule.
    2. Rewards and group advantages ``A`` as Flow-GRPO's (group mean, batch std by default), clipped to
       ``+-adv_clip_max``; the optimality probability ``r = A / adv_clip_max / 2 + 0.5``
       (:func:`optimality_probability`).
    3. Update on the **forward process**: each sample trains at T = int(K timestep_fraction) of the schedule's
       timesteps (a random permutation per sample, or UniRL's one t per microbatch pass: ``timestep_sampling``),
       at ``xt = (1 - t) x0 + t eps`` with fresh noise. At each point the old (no grad), current and (``beta > 0``)
       reference velocities give :func:`nft_loss` ``+ beta mean((v - v_ref)^2)``. Gradients accumulate over the
       microbatches of an accumulation group and all their T points, one optimizer step per group.
    4. **Old-policy update** after the iteration's optimizer steps: ``old <- d old + (1 - d) theta`` with
       ``d = old_policy_decay(optimizer steps so far, decay_type)`` (an iteration without an optimizer step, e.g.
       with no reward, leaves it untouched). The old weights start equal to the current ones.

    The old policy is a copy of the trained parameters (the LoRA, or every weight with ``finetune="full"``),
    swapped in for its forward passes, so the model, its LoRA file and the distributed wrapping are the same as
    the other trainers'. Checkpoints hold it (``nft_old_policy.safetensors``) and the optimizer-step count
    (``nft_state.json``): a resumed run repeats an uninterrupted one exactly. Logged: ``policy_loss``, ``kl``
    (``beta > 0``), ``nft/r_mean``, ``nft/loss_pos``, ``nft/loss_neg``, ``nft/old_deviation`` (mean
    ``(v - v_old)^2``), ``nft/decay`` and ``nft/optimizer_steps``.
    """

    config_class = DiffusionNFTConfig
    _method_name = "diffusion_nft"
    summary = ("DiffusionNFT: forward-process RL with implicit positive / negative policies, "
               "any sampler, CFG-free (arXiv 2509.16117)")
    paper = "DiffusionNFT, arXiv 2509.16117"
    rollout_store = "final"  # the loss needs the final latents only
    batched_term_hooks = ("term_loss", "nft_point")

    def __init__(self, config=None, pipe=None, reward_funcs=None, train_dataset=None, eval_dataset=None, **kwargs):
        if distributed.requested() is not None:  # before any set-up
            raise distributed.DistributedSetupError(
                f"DiffusionNFTTrainer under {distributed.requested()}: not supported (its old policy is swapped into "
                "the parameters for its forward passes, which has not been checked with sharded parameters). Fix: "
                "--accelerate_config multi_gpu (DDP), or one process")
        super().__init__(config, pipe, reward_funcs, train_dataset=train_dataset, eval_dataset=eval_dataset, **kwargs)
        self.old_params = [p.detach().clone() for p in self.trainable_params]  # old policy = current at start
        self.nft_optimizer_steps = 0
        self.old_decay = 0.0

    # ------------------------------------------------------------------------------- the old policy
    @contextlib.contextmanager
    def old_policy(self):
        """The model with the old policy's weights swapped in (restored on exit); yields the unwrapped model."""
        with torch.no_grad():
            current = [p.detach().clone() for p in self.trainable_params]
            for p, old in zip(self.trainable_params, self.old_params):
                p.copy_(old)
        try:
            yield self.accelerator.unwrap_model(self.model)
        finally:
            with torch.no_grad():
                for p, cur in zip(self.trainable_params, current):
                    p.copy_(cur)

    def make_rollout(self, step):
        with self.old_policy():
            rollout = super().make_rollout(step)
        valid = ~torch.isnan(rollout.rewards).to(rollout.train_mask.device)
        # (N, K): sample i is trained (at timesteps drawn from the schedule's K) iff a reward scored it
        rollout.train_mask = valid[:, None].expand_as(rollout.train_mask).clone()
        return rollout

    def compute_advantages(self, rollout):
        cfg = self.config
        adv = group_advantages(self.gather(rollout.rewards), self.gather(rollout.group_ids), cfg.scale_rewards,
                               clip=cfg.adv_clip_max)
        rollout.advantages = adv[self._local_slice(len(adv))].to(self.device)

    # ------------------------------------------------------------ forward-process training timesteps
    def timestep_candidates(self, schedule) -> torch.Tensor:
        """The schedule steps a training point may use: all K, or those whose velocity depends on the trained
        weights (``adapter.trainable_steps``: Wan2.2 with one expert trained)."""
        trainable = getattr(self.adapter, "trainable_steps", lambda s: None)(schedule)
        return (torch.arange(schedule.num_steps) if trainable is None
                else trainable.cpu().nonzero().squeeze(1)).to(self.device)

    def num_train_timesteps(self, schedule) -> int:
        """T = int(candidates * timestep_fraction), at least 1: the same on every process."""
        return max(1, int(len(self.timestep_candidates(schedule)) * self.config.timestep_fraction))

    def training_points(self, rollout, idx: torch.Tensor, step: int, epoch: int, batch: int):
        """Schedule indices (B, T) of the microbatch ``idx``'s training timesteps, and one generator per sample for
        its noise. Seeded by (seed, iteration, pass, global sample index): the same on any number of processes."""
        cfg = self.config
        cand = self.timestep_candidates(rollout.schedule)
        T = self.num_train_timesteps(rollout.schedule)
        offset = self.accelerator.process_index * len(rollout)
        gens = [self._generator(step, f"nft/{epoch}/{int(i) + offset}", device=self.device) for i in idx.tolist()]
        if cfg.timestep_sampling == "per_sample":  # the reference: a permutation of the K timesteps per sample
            order = torch.stack([cand[torch.randperm(len(cand), generator=g, device=self.device)[:T]] for g in gens])
        else:  # UniRL: the first T of the schedule, shuffled once per microbatch, shared by its samples
            g = self._generator(step, f"nft_shared/{epoch}/{batch}", device=self.device)
            order = cand[:T][torch.randperm(T, generator=g, device=self.device)][None].expand(len(idx), T)
        return order, gens

    # ------------------------------------------------------------------------------------ the update
    def nft_point(self, rollout, idx, k_idx: torch.Tensor, gens, r: torch.Tensor):
        """Loss (B,) and stats at one training point of the microbatch ``idx``: schedule steps ``k_idx`` (B,)."""
        return self.nft_points(rollout, idx, [k_idx], gens, r)[0]

    def nft_points(self, rollout, idx, k_idxs: list[torch.Tensor], gens, r: torch.Tensor) -> list[tuple]:
        """:meth:`nft_point` of each training point ``k_idxs`` (T of them), with one forward of each policy: the
        T points' B rows concatenated point-major (``batch_replay_steps``; T = 1: the per-point forward). The noise
        is drawn point by point, as the per-point path draws it."""
        cfg = self.config
        B, T = len(idx), len(k_idxs)
        x0 = rollout.states[idx, -1].float()
        view = (-1, *([1] * (x0.ndim - 1)))
        ts, xts = [], []
        for k_idx in k_idxs:
            t = rollout.schedule.sigmas[k_idx].float()
            eps = torch.stack([torch.randn(x0.shape[1:], generator=g, device=self.device) for g in gens])
            ts.append(t)
            xts.append((1 - t.view(view)) * x0 + t.view(view) * eps)
        xt = torch.cat(xts)
        timestep = torch.cat([rollout.schedule.timesteps[k_idx] for k_idx in k_idxs])
        emb = index_embeds(rollout.embeds, idx.repeat(T))
        with torch.no_grad(), self.old_policy() as old, self._autocast():
            v_old = self.adapter.velocity(old, xt, timestep, emb, cfg.guidance_scale).split(B)
        with self._autocast():
            v = self.adapter.velocity(self.model, xt, timestep, emb, cfg.guidance_scale,
                                      detach_uncond=cfg.guidance_grad == "cond_only").split(B)
        v_ref = None
        if cfg.beta > 0:
            with torch.no_grad(), self.reference_policy() as ref, self._autocast():
                v_ref = self.adapter.velocity(ref, xt, timestep, emb, cfg.guidance_scale).split(B)
        results = []
        for j in range(T):
            loss, stats = nft_loss(v[j].float(), v_old[j].float(), x0, xts[j], ts[j], r, cfg.nft_beta,
                                   cfg.adv_clip_max)
            stats["policy_loss"] = loss.detach()
            if v_ref is not None:
                kl = ((v[j].float() - v_ref[j].float()) ** 2).mean(dim=tuple(range(1, x0.ndim)))
                loss = loss + cfg.beta * kl
                stats["kl"] = kl.detach()
            results.append((loss, stats))
        return results

    def optimize(self, rollout, step):
        """The run layer's loop over this method's terms: per microbatch, T backward passes (one per training
        point; one in all with ``batch_replay_steps``), one optimizer step per accumulation group; then the
        old-policy update."""
        cfg = self.config
        self._r_all = optimality_probability(rollout.advantages, cfg.adv_clip_max, cfg.adv_mode)
        steps_before = self.nft_optimizer_steps
        metrics = super().optimize(rollout, step)
        if self.nft_optimizer_steps > steps_before:
            self.update_old_policy()
        metrics.update({"nft/decay": self.old_decay, "nft/optimizer_steps": self.nft_optimizer_steps})
        return metrics

    def loss_terms(self, rollout, idx, step, epoch, batch):
        k_order, gens = self.training_points(rollout, idx, step, epoch, batch)
        return [(k_order[:, j], gens) for j in range(k_order.shape[1])]

    def term_loss(self, rollout, idx, term):
        k_idx, gens = term
        mask = rollout.train_mask[idx, 0]
        per_sample, stats = self.nft_point(rollout, idx, k_idx, gens, self._r_all[idx])
        return masked_mean(per_sample, mask), stats, mask

    def term_batches(self, terms):
        """``batch_replay_steps``: all training points of a microbatch in one forward and one backward."""
        return [list(terms)] if self.config.batch_replay_steps and terms else super().term_batches(terms)

    def term_losses(self, rollout, idx, terms):
        if len(terms) == 1:
            return [self.term_loss(rollout, idx, terms[0])]
        mask = rollout.train_mask[idx, 0]
        points = self.nft_points(rollout, idx, [k_idx for k_idx, _ in terms], terms[0][1], self._r_all[idx])
        return [(masked_mean(per_sample, mask), stats, mask) for per_sample, stats in points]

    def after_microbatch(self, rollout, idx, log):
        mask = rollout.train_mask[idx, 0]
        log.add("nft/r_mean", float(self._r_all[idx][mask].sum()), int(mask.sum()))

    def after_optimizer_step(self):
        self.nft_optimizer_steps += 1

    @torch.no_grad()
    def update_old_policy(self) -> float:
        """``old <- d old + (1 - d) theta`` with ``d = old_policy_decay(optimizer steps so far)`` (the reference's
        expression, after each iteration that stepped). Returns ``d``."""
        self.old_decay = old_policy_decay(self.nft_optimizer_steps, self.config.decay_type)
        for old, p in zip(self.old_params, self.trainable_params):
            old.copy_(old * self.old_decay + p.detach() * (1.0 - self.old_decay))
        return self.old_decay

    def kl_to_reference(self, prompts, seed=0, sampler=None, noise_level=None, columns=None):
        if (sampler or self.config.sampler) == "ode":  # the default kernel here: no density, the KL would read 0
            raise ValueError("kl_to_reference: the `ode` kernel has no density; pass a stochastic kernel to measure "
                             "with, e.g. sampler='flow_sde', noise_level=0.7 (as benchmarks/shapes.py does)")
        return super().kl_to_reference(prompts, seed=seed, sampler=sampler, noise_level=noise_level, columns=columns)

    # ------------------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self) -> str:
        self._old_full = distributed.full_tensors(self.old_params)  # every process: a collective when sharded
        try:
            return super().save_checkpoint()
        finally:
            self._old_full = None

    def save_extra_state(self, path: str) -> None:
        from safetensors.torch import save_file

        names = checkpoints.trainable_names(self)
        if len(names) != len(self._old_full):
            raise RuntimeError(f"{len(names)} trainable parameter names for {len(self._old_full)} old-policy tensors")
        save_file(dict(zip(names, self._old_full)), os.path.join(path, OLD_POLICY_NAME))
        follow_umask(os.path.join(path, OLD_POLICY_NAME))
        with open(os.path.join(path, NFT_STATE_NAME), "w", encoding="utf-8") as f:
            json.dump({"optimizer_steps": self.nft_optimizer_steps, "decay": self.old_decay}, f)

    def load_extra_state(self, path: str) -> None:
        from safetensors.torch import load_file

        for name in (OLD_POLICY_NAME, NFT_STATE_NAME):
            if not os.path.isfile(os.path.join(path, name)):
                raise ValueError(f"checkpoint {path}: {name} (DiffusionNFT's old policy) is missing; resume from "
                                 "another checkpoint")
        tensors = load_file(os.path.join(path, OLD_POLICY_NAME))
        names = checkpoints.trainable_names(self)
        missing = [n for n in names if n not in tensors]
        if missing or len(names) != len(self.old_params):
            raise ValueError(f"checkpoint {path}: {OLD_POLICY_NAME} lacks {missing[:3]} (saved with other "
                             "lora_target_modules?)")
        with torch.no_grad():
            for n, old in zip(names, self.old_params):
                old.copy_(distributed.like(tensors[n], old))
        with open(os.path.join(path, NFT_STATE_NAME), encoding="utf-8") as f:
            state = json.load(f)
        self.nft_optimizer_steps, self.old_decay = int(state["optimizer_steps"]), float(state["decay"])
