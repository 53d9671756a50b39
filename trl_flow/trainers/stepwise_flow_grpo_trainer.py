"""Stepwise-Flow-GRPO: per-step credit from the gains of an intermediate reward along each trajectory.

Read top to bottom: (1) the clean-image estimate of a state by a few deterministic Euler steps, (2) the
intermediate reward of every state it is needed at, (3) gains and their group normalisation into per-step
advantages, (4) what is logged. Rollout, loss (clipped objective + beta KL, shared with Flow-GRPO), logging and
checkpoints are the base's.
"""

from __future__ import annotations

import time

import torch

from ..advantages import normalize_jointly
from ..kernels import kernel_mean_std
from ..models import index_embeds
from .flow_grpo_trainer import FlowGRPOTrainer
from .stepwise_flow_grpo_config import StepwiseFlowGRPOConfig


def substep_sigmas(sigma: torch.Tensor, num_substeps: int) -> torch.Tensor:
    """The grid of the clean-image estimate: (B,) start levels -> (B, T' + 1), linear in sigma from ``sigma`` to
    exactly 0.

    The paper says only "T' Euler steps". Linear in sigma is independent of the pipeline's scheduler (shift,
    dynamic shift) and spends the few steps evenly over the remaining noise; with T' = 1 it is the one-step
    (Tweedie) estimate ``x - sigma v``.
    """
    frac = torch.linspace(1.0, 0.0, num_substeps + 1, device=sigma.device, dtype=torch.float32)
    grid = sigma.float()[:, None] * frac[None, :]
    grid[:, -1] = 0.0
    return grid


def step_advantages(gains: torch.Tensor, group_ids: torch.Tensor, normalization: str = "joint",
                    clip: float | None = 5.0) -> torch.Tensor:
    """Per-(sample, step) advantages from gains.

    Args:
        gains: (N, K) ``g_k = r_{k+1} - r_k`` of the whole gathered batch; NaN marks a pair that is not trained
            (deterministic step, or a reward missing at either end): it is left out of every statistic.
        group_ids: (N,) group of each sample.
        normalization: ``"joint"``: ``(g - mean) / (std + 1e-4)`` over all valid (sample, step) pairs of the
            group; ``"per_step"``: the same over the group's valid samples at each step separately.
    Returns:
        (N, K) float32, 0 where the gain is NaN, clipped to ``+-clip``.
    """
    valid = ~torch.isnan(gains)
    g = torch.where(valid, gains, torch.zeros_like(gains)).float()
    if normalization == "joint":
        adv = normalize_jointly(g, valid, group_ids)
    elif normalization == "per_step":
        adv = torch.cat([normalize_jointly(g[:, k : k + 1], valid[:, k : k + 1], group_ids)
                         for k in range(g.shape[1])], dim=1)
    else:
        raise ValueError(f"gain_normalization must be `joint` or `per_step`, got {normalization!r}")
    return adv.clamp(-clip, clip) if clip is not None else adv


class StepwiseFlowGRPOTrainer(FlowGRPOTrainer):
    """Stepwise-Flow-GRPO, from "Stepwise-Flow-GRPO" (arXiv 2603.28718).

    ```python
    from trl_flow import StepwiseFlowGRPOConfig, StepwiseFlowGRPOTrainer
    from trl_flow.testing import tiny_sd3_pipeline

    def brightness(images, prompts, **columns):  # images (B, 3, H, W) in [0, 1]
        return images.mean(dim=(1, 2, 3))

    config = StepwiseFlowGRPOConfig(output_dir="out", max_steps=2, num_generations=4, prompts_per_step=2,
                                    height=32, width=32, num_inference_steps=4, per_device_train_batch_size=4,
                                    max_sequence_length=16, num_substeps=2)
    trainer = StepwiseFlowGRPOTrainer(config, tiny_sd3_pipeline(), [brightness], train_dataset=["a cat", "a dog"])
    trainer.train()
    trainer.save_model("out/final")  # pipe.load_lora_weights("out/final")
    ```

    Per iteration, on top of Flow-GRPO's rollout (``flow_sde`` kernel and shared initial noise per group by
    default; the paper's ``ddim`` kernel with ``sampler="ddim"``), with N samples, K steps and latents of shape L:

    1. Intermediate rewards ``r_k`` (N, K + 1): at every state ``x_k`` a trained step needs, the clean-image
       estimate by ``num_substeps`` (T') deterministic Euler steps of the rollout's policy from ``s_k`` to 0
       (:func:`substep_sigmas`; the first substep reuses the rollout's velocity), decoded and scored by the same
       reward functions (None / NaN: no score). ``r_K`` is the final reward. All estimates of an iteration are
       batched in chunks of ``per_device_eval_batch_size``.
    2. Gains ``g_k = r_{k+1} - r_k`` (N, K), which telescope to ``r_K - r_0``.
    3. Advantages ``A_{i,k}`` (N, K): gains normalised jointly over all (trajectory, trained step) pairs of the
       group (``gain_normalization``), gathered over processes first, clipped to ``+-adv_clip_max``.
    4. Loss: Flow-GRPO's, per trained step k with ``A_{i,k}`` (``trust_region`` clip or Flow-DPPO's kl_mask,
       plus ``beta`` KL in ``kl_form``). A (sample, step) pair is trained iff the step has
       a density (std > 0: never ``ddim``'s first or the last step) and its gain is defined; a missing final
       reward therefore leaves the earlier steps' gains trained.
    """

    config_class = StepwiseFlowGRPOConfig
    _method_name = "stepwise_flow_grpo"
    summary = "Stepwise-Flow-GRPO: per-step credit from intermediate rewards (arXiv 2603.28718)"
    paper = "Stepwise-Flow-GRPO, arXiv 2603.28718"
    keep_velocities = True  # the first Euler substep of every estimate reuses the rollout's velocity

    def __init__(self, config=None, pipe=None, reward_funcs=None, train_dataset=None, eval_dataset=None, **kwargs):
        super().__init__(config, pipe, reward_funcs, train_dataset=train_dataset, eval_dataset=eval_dataset, **kwargs)
        config, pipe = self.config, self.pipe  # as resolved (TRL's call form, peft_config, the model's own settings)
        # Substeps evaluate the model at sigmas off the rollout's schedule: timestep = sigma * scale, as the
        # flow-matching schedulers build their timesteps. Checked on the real schedule, before any model compute.
        schedule = self.adapter.schedule(config.num_inference_steps, config.height, config.width)
        self.timestep_scale = float(schedule.timesteps[0] / schedule.sigmas[0])
        if not torch.allclose(schedule.timesteps.float(), schedule.sigmas[:-1].float() * self.timestep_scale,
                              rtol=1e-5, atol=1e-3):
            raise ValueError(f"{type(self.pipe.scheduler).__name__}: its timesteps are not proportional to its "
                             "sigmas; the intermediate estimate needs a flow-matching scheduler (timestep = sigma * "
                             "scale)")

    # ------------------------------------------------------------------ 1. clean-image estimate of a state
    @torch.no_grad()
    def clean_estimate(self, rollout, samples: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        """(B, *L) estimate of the clean latent from states ``x_k`` of ``rollout``: sample ``samples[b]`` (B,) at
        step ``steps[b]`` (B,), by T' ODE steps of the current policy on :func:`substep_sigmas`. The first step
        uses the stored velocity; each later one is one guided transformer evaluation."""
        cfg = self.config
        if rollout.velocities is None:
            raise ValueError("clean_estimate: the rollout has no velocities; sample it with a trainer whose "
                             "keep_velocities is True (StepwiseFlowGRPOTrainer.sample does)")
        x = rollout.state(samples, steps).float()
        v = rollout.velocity(samples, steps)
        grid = substep_sigmas(rollout.schedule.sigmas[steps], cfg.num_substeps)
        emb = index_embeds(rollout.embeds, samples)
        self.model.eval()
        for j in range(cfg.num_substeps):
            if j:
                with self._autocast():
                    v = self.adapter.velocity(self.model, x, grid[:, j] * self.timestep_scale, emb,
                                              cfg.guidance_scale)
            x, _ = kernel_mean_std("ode", x, v, grid[:, j], grid[:, j + 1], 0.0)
        return x

    # ----------------------------------------------------------------------- 2. intermediate rewards
    def stored_steps(self, step_kinds):
        """Every stochastic step (not only those below num_train_timesteps): :meth:`estimated_steps` scores the
        states around each of them."""
        return [k for k, kind in enumerate(step_kinds) if kind != "ode"]

    def estimated_steps(self, rollout) -> list[int]:
        """The states whose intermediate reward a trained step's gain needs: ``k`` and ``k + 1`` for every
        trained step ``k``, without ``K`` (its reward is the final one)."""
        K = rollout.schedule.num_steps
        return sorted({j for k in rollout.trained_steps() for j in (k, k + 1) if j < K})

    def make_rollout(self, step):
        rollout = super().make_rollout(step)
        self.score_intermediate(rollout)
        return rollout

    @torch.no_grad()
    def score_intermediate(self, rollout) -> None:
        """Set ``extras["step_rewards"]`` (N, K + 1; NaN where not estimated or not scored), ``extras["gains"]``
        (N, K; NaN where a reward at either end is missing) and the train mask: steps with a density (std > 0)
        whose gain is defined."""
        cfg = self.config
        t0 = time.perf_counter()
        n, K = len(rollout), rollout.schedule.num_steps
        steps = self.estimated_steps(rollout)
        rewards = torch.full((n, K + 1), float("nan"))
        rewards[:, K] = rollout.rewards.float().cpu()
        shared = self.shared_estimates(rollout, steps)
        pairs = [(i, k) for k in steps for i in range(n) if (i, k) not in shared]
        bs = cfg.per_device_eval_batch_size
        calls = 0
        reward_s = 0.0
        for lo in range(0, len(pairs), bs):
            chunk = pairs[lo : lo + bs]
            samples = torch.tensor([i for i, _ in chunk], device=self.device)
            ks = torch.tensor([k for _, k in chunk], device=self.device)
            latents = self.clean_estimate(rollout, samples, ks)
            calls += cfg.num_substeps - 1
            images = self.decode(latents, bs)
            t_r = time.perf_counter()
            rows = samples.tolist()
            r, _ = self.reward(images, [rollout.prompts[i] for i in rows],
                               {c: [vals[i] for i in rows] for c, vals in rollout.columns.items()})
            reward_s += time.perf_counter() - t_r
            rewards[samples.cpu(), ks.cpu()] = r.float()
        for (i, k), j in shared.items():
            rewards[i, k] = rewards[j, k]
        gains = rewards[:, 1:] - rewards[:, :-1]
        trained = torch.zeros(K, dtype=torch.bool)
        trained[rollout.trained_steps()] = True
        rollout.extras["step_rewards"] = rewards
        rollout.extras["gains"] = gains
        rollout.train_mask = (trained[None, :] & ~torch.isnan(gains)).to(rollout.train_mask.device)
        rollout.extras["reward_s"] = rollout.extras.get("reward_s", 0.0) + reward_s
        evals = self.gather(torch.tensor([float(len(pairs) * (cfg.num_substeps - 1))], device=self.device))
        rollout.extras.setdefault("metrics", {}).update({
            "stepwise/extra_transformer_calls": calls,
            "stepwise/extra_velocity_evals": float(evals.sum()),
            "stepwise/extra_velocity_evals_per_rollout_eval": float(evals.sum()) / (cfg.train_batch_size * K),
            "stepwise/extra_decodes": float(self.gather(torch.tensor([float(len(pairs))], device=self.device)).sum()),
            "stepwise/extra_s": time.perf_counter() - t0,
            "stepwise/shared_estimates": float(
                self.gather(torch.tensor([float(len(shared))], device=self.device)).sum()),
        })

    @staticmethod
    def shared_estimates(rollout, steps: list[int]) -> dict[tuple[int, int], int]:
        """``{(i, k): j}`` for each pair whose state ``x_k`` and velocity equal (bitwise) those of the group's first
        sample ``j`` with the same prompt and columns: its estimate and reward are ``j``'s, computed once. With
        shared initial noise (``same_noise_per_group``) ``x_0`` is one state per group, so ``r_0`` is one value
        per group (with ``ddim``, whose first step is deterministic, ``x_1`` too). A reward that scores one image
        differently on each call then gives the whole group the same ``r_0``, as the paper's definition does."""
        shared = {}
        gids = rollout.group_ids.tolist()
        first: dict[int, int] = {}
        for i, g in enumerate(gids):
            first.setdefault(g, i)
        for k in steps:
            for i, g in enumerate(gids):
                j = first[g]
                if (j != i and rollout.prompts[i] == rollout.prompts[j]
                        and all(vals[i] == vals[j] for vals in rollout.columns.values())
                        and torch.equal(rollout.state(i, k), rollout.state(j, k))
                        and torch.equal(rollout.velocity(i, k), rollout.velocity(j, k))):
                    shared[(i, k)] = j
        return shared

    # ------------------------------------------------------------------------------ 3. per-step advantages
    def compute_advantages(self, rollout):
        cfg = self.config
        # trained pairs only: deterministic steps and missing rewards are left out of every statistic
        gains = self.gather(rollout.extras["gains"].masked_fill(~rollout.train_mask.cpu(), float("nan")))
        group_ids = self.gather(rollout.group_ids)
        raw = step_advantages(gains, group_ids, cfg.gain_normalization, clip=None)
        adv = raw.clamp(-cfg.adv_clip_max, cfg.adv_clip_max) if cfg.adv_clip_max is not None else raw
        rollout.advantages = adv[self._local_slice(len(adv))].to(self.device)
        metrics = rollout.extras.setdefault("metrics", {})
        metrics.update(
            self.stepwise_metrics(self.gather(rollout.extras["step_rewards"]), gains, rollout.trained_steps()))
        # share of trained (trajectory, step) pairs whose advantage the +-adv_clip_max clip cut: joint normalisation
        # can give a few large early gains far more than 5 std
        valid = ~torch.isnan(gains)
        if cfg.adv_clip_max is not None and valid.any():
            metrics["stepwise/adv_clip_frac"] = float((raw[valid].abs() > cfg.adv_clip_max).float().mean())

    # ------------------------------------------------------------------------------------------- 4. logs
    @staticmethod
    def stepwise_metrics(step_rewards: torch.Tensor, gains: torch.Tensor, trained_steps: list[int]) -> dict:
        """Mean gain per trained step, share of negative gains, and the Pearson correlation of each estimated
        state's reward with the final reward (over samples where both are defined)."""
        m = {}
        valid = ~torch.isnan(gains)
        if valid.any():
            m["stepwise/neg_gain_frac"] = float((gains[valid] < 0).float().mean())
        m["stepwise/valid_gain_frac"] = float(valid[:, trained_steps].float().mean()) if trained_steps else 0.0
        for k in trained_steps:
            if valid[:, k].any():
                m[f"stepwise/gain_mean/step_{k}"] = float(gains[valid[:, k], k].mean())
        final = step_rewards[:, -1]
        for k in range(step_rewards.shape[1] - 1):
            ok = ~torch.isnan(step_rewards[:, k]) & ~torch.isnan(final)
            if ok.sum() >= 2 and step_rewards[ok, k].std() > 0 and final[ok].std() > 0:
                pair = torch.stack([step_rewards[ok, k], final[ok]]).double()
                m[f"stepwise/reward_corr/step_{k}"] = float(torch.corrcoef(pair)[0, 1])
        return m
