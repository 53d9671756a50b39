"""Rollout: sample trajectories with a transition kernel and keep what the update needs.

For each sample the rollout stores every state ``x_0 .. x_K``, the per-step behaviour log-probs and kernel means
(frozen as ``logp_old`` / ``mu_old``), and which steps are trainable. ``N`` is the number of samples on this
process, ``K`` the number of sampling steps, ``L`` the latent shape (e.g. C, h, w; video: C, F', h, w).
A trainer that needs only the samples (DiffusionNFT trains on the final latents) asks for ``store="final"``:
``states`` is then (N, 1, *L), the final state alone, and no kernel means are kept (``N prod(L) 4`` bytes instead
of ``N (2K + 1) prod(L) 4``).

Memory: states and means take ``N (K + 1) prod(L) 4 + N K prod(L) 4`` bytes (float32), plus ``5 N K`` for the
log-probs and train mask and ``N prod(O) 4`` for the decoded samples of shape O; the exact count is
:meth:`trl_flow.models.FlowAdapter.rollout_bytes` (prompt embeddings come on top, and ``N K prod(L) 4`` more for
``velocities`` when a trainer keeps them).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from .kernels import kernel_mean_std, sde_step
from .models import FlowAdapter, PromptEmbeds, Schedule, cat_embeds, index_embeds

#: What a rollout keeps (:func:`sample_trajectories`' ``store``).
ROLLOUT_STORES = ("trajectory", "final")


@dataclass
class Rollout:
    """A batch of trajectories on one process.

    Attributes:
        prompts: N prompts. columns: the prompts' other dataset columns, each a list of N values.
        group_ids: (N,) long, the global group (prompt slot) of each sample.
        embeds: prompt conditioning, each tensor (N, ...).
        schedule: sigmas (K + 1,) and timesteps (K,).
        states: (N, K + 1, *L) float32, ``x_0`` (noise) .. ``x_K`` (the sample); (N, 1, *L), ``x_K`` alone, when
            sampled with ``store="final"`` (``states[:, -1]`` is the sample either way).
        log_probs: (N, K) float32 behaviour log-probs (0 where the step is deterministic).
        means: (N, K, *L) float32 behaviour kernel means, or None (``store="final"``).
        stds: (K,) float32 kernel std per step (0 = deterministic step).
        train_mask: (N, K) bool, the steps that are trained.
        images: (N, 3, H, W) (video: (N, F, 3, H, W)) float32 in [0, 1], the decoded samples.
        rewards: (N,) float32 combined reward (NaN where no reward function gave a value).
        rewards_per_func: name -> (N,) float32 (NaN where that function skipped the sample).
        advantages: (N,) or (N, K) float32, set by the trainer.
        velocities: (N, K, *L) float32 guided velocities of the behaviour policy at each state, or None (kept
            only when the trainer asks for them: ``FlowRLTrainer.keep_velocities``).
    """

    prompts: list[str]
    columns: dict[str, list]
    group_ids: torch.Tensor
    embeds: PromptEmbeds
    schedule: Schedule
    states: torch.Tensor
    log_probs: torch.Tensor
    means: torch.Tensor | None
    stds: torch.Tensor
    train_mask: torch.Tensor
    images: torch.Tensor | None = None
    rewards: torch.Tensor | None = None
    rewards_per_func: dict[str, torch.Tensor] = field(default_factory=dict)
    advantages: torch.Tensor | None = None
    extras: dict = field(default_factory=dict)
    velocities: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.prompts)

    def trained_steps(self) -> list[int]:
        """The steps with a density (stochastic kernel, std > 0). A function of the schedule and kernels alone, so
        every process gets the same list whatever its samples' rewards."""
        kinds = self.extras["step_kinds"]
        return [k for k in range(self.schedule.num_steps) if kinds[k] != "ode" and float(self.stds[k]) > 0]


def step_samplers(sampler: str, num_steps: int, sde_steps: torch.Tensor | None) -> list[str]:
    """The kernel of each step: ``sampler`` on the SDE steps, ``ode`` elsewhere and always on the last step."""
    kinds = []
    for k in range(num_steps):
        stochastic = k < num_steps - 1 and (sde_steps is None or bool(sde_steps[k]))
        kinds.append(sampler if stochastic else "ode")
    return kinds


def branch_step(step_kinds: list[str]) -> int:
    """The first step with a stochastic kernel (``K`` if none): the steps before it are deterministic (ODE), so
    trajectories that start from the same noise with the same conditioning agree up to it (``shared_prefix``)."""
    return next((k for k, kind in enumerate(step_kinds) if kind != "ode"), len(step_kinds))


def group_representatives(group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(first, inverse)``: the first row of each distinct group in ``group_ids`` (N,), in order of first
    appearance, and for each row the index of its group in ``first`` (so ``first[inverse]`` is a row of the same
    group). Works for any layout (``mixed`` scatters a group's rows)."""
    ids = group_ids.tolist()
    pos: dict[int, int] = {}
    first, inverse = [], []
    for i, g in enumerate(ids):
        if g not in pos:
            pos[g] = len(first)
            first.append(i)
        inverse.append(pos[g])
    return torch.tensor(first, dtype=torch.long), torch.tensor(inverse, dtype=torch.long)


@torch.no_grad()
def sample_shared_prefix(adapter, model, embeds: PromptEmbeds, noise: torch.Tensor, group_ids: torch.Tensor,
                         schedule: Schedule, step_kinds: list[str], batch_size: int, **kwargs) -> dict | None:
    """The deterministic steps before :func:`branch_step`, run once per group (its first row's noise and
    conditioning) instead of once per sample. Returns None when there is no such step, else ``{"step": s,
    "inverse": (N,), "states": (P', K + 1, *L), "means", "log_probs", "velocities"?}`` of the P' groups' prefixes
    (zeros after ``s``): :func:`sample_trajectories` continues each row from ``states[inverse, s]`` with
    ``start_step=s`` and :func:`fill_prefix` copies the prefix into the rows. ``kwargs``: ``sample_trajectories``'
    ``noise_level``, ``guidance_scale``, ``logprob_reduction``, ``autocast``, ``keep_velocities``.

    The rows of a group must share their initial noise (``same_noise_per_group``): checked, a ValueError otherwise.
    The conditioning of a group's rows (prompt embeddings, and an editing adapter's source image) is the group's, so
    its first row's stands for all."""
    s = branch_step(step_kinds)
    if s == 0:
        return None
    first, inverse = group_representatives(group_ids.cpu())
    first, inverse = first.to(noise.device), inverse.to(noise.device)
    if not torch.equal(noise[first][inverse], noise):
        raise ValueError("shared_prefix: the samples of a group do not share their initial noise; set "
                         "same_noise_per_group=True (or shared_prefix=False)")
    pre = sample_trajectories(adapter, model, index_embeds(embeds, first), noise[first], schedule, step_kinds,
                              batch_size=batch_size, stop_step=s, store="trajectory", **kwargs)
    return {"step": s, "inverse": inverse, **pre}


def fill_prefix(traj: dict, prefix: dict) -> None:
    """Copy a shared prefix (:func:`sample_shared_prefix`) into the rows of ``traj`` (sampled from
    ``start_step=prefix["step"]``): states ``0 .. s - 1``, means, log-probs (zeros: deterministic steps) and
    velocities of steps ``0 .. s - 1``, each row its group's. A ``store="final"`` trajectory keeps none of them."""
    s, inv = prefix["step"], prefix["inverse"]
    if traj["means"] is not None:
        traj["states"][:, :s] = prefix["states"][inv, :s]
        traj["means"][:, :s] = prefix["means"][inv, :s]
    traj["log_probs"][:, :s] = prefix["log_probs"][inv, :s]
    if traj.get("velocities") is not None:
        traj["velocities"][:, :s] = prefix["velocities"][inv, :s]


@torch.no_grad()
def sample_trajectories(
    adapter: FlowAdapter,
    model: torch.nn.Module,
    embeds: PromptEmbeds,
    noise: torch.Tensor,
    schedule: Schedule,
    step_kinds: list[str],
    noise_level: float,
    guidance_scale: float,
    batch_size: int,
    generator: torch.Generator | list[torch.Generator] | None = None,
    logprob_reduction: str = "mean",
    start_states: torch.Tensor | None = None,
    start_step: int = 0,
    stop_step: int | None = None,
    autocast=None,
    keep_velocities: bool = False,
    on_chunk=None,
    store: str = "trajectory",
) -> dict[str, torch.Tensor]:
    """Run the sampler over a batch in chunks of ``batch_size``.

    Args:
        noise: (N, *L) initial states ``x_0`` (used when ``start_states`` is None).
        generator: one generator for all samples, or a list of N (sample i's SDE noise from generator i: then
            a trajectory does not depend on ``batch_size`` or on the other samples).
        step_kinds: K kernel names, one per step (see :func:`step_samplers`).
        start_states: optional (N, *L) states at step ``start_step``: sampling resumes there (used to regenerate
            the tail of a stored trajectory, or to branch a shared prefix: :func:`branch_step`); the returned tensors
            still cover all K steps, with the steps before ``start_step`` left as zeros for the caller to fill in.
        stop_step: run the steps ``start_step .. stop_step - 1`` only (default K): the states after ``stop_step``
            stay zeros (a prefix that later calls continue from ``states[:, stop_step]``).
        keep_velocities: also return the guided velocity of every step.
        on_chunk: optional ``on_chunk(rows: slice, final_states (b, *L))``, called as each chunk finishes.
        store: ``"trajectory"`` (every state and kernel mean) or ``"final"`` (the final state alone: ``states`` is
            (N, 1, *L) and ``means`` None; log-probs and stds are kept, N K + K floats). ``"final"`` cannot keep
            velocities; resumed at ``start_step`` it leaves nothing to fill in but zero log-probs before it.

    Returns:
        ``states`` (N, K + 1, *L), ``log_probs`` (N, K), ``means`` (N, K, *L), ``stds`` (K,), and with
        ``keep_velocities`` ``velocities`` (N, K, *L).
    """
    if store not in ROLLOUT_STORES:
        raise ValueError(f"store={store!r}: must be one of {ROLLOUT_STORES}")
    final_only = store == "final"
    if final_only and keep_velocities:
        raise ValueError("store='final' keeps no intermediate state: it cannot keep velocities")
    autocast = autocast or contextlib.nullcontext
    x_all = noise if start_states is None else start_states
    if x_all is None:
        raise ValueError("sample_trajectories: pass noise or start_states")
    n, K = x_all.shape[0], schedule.num_steps
    stop = K if stop_step is None else stop_step
    if not 0 <= start_step <= stop <= K:
        raise ValueError(f"sample_trajectories: need 0 <= start_step={start_step} <= stop_step={stop} <= K={K}")
    sig = schedule.sigmas
    states = torch.zeros((n, 1 if final_only else K + 1, *x_all.shape[1:]), dtype=torch.float32, device=x_all.device)
    means = None if final_only else torch.zeros((n, K, *x_all.shape[1:]), dtype=torch.float32, device=x_all.device)
    log_probs = torch.zeros((n, K), dtype=torch.float32, device=x_all.device)
    velocities = torch.zeros_like(means) if keep_velocities else None
    # The std of a step depends only on the schedule and the kernel, not on the state.
    probe = torch.zeros(1, 1, device=x_all.device)
    stds = torch.stack([
        kernel_mean_std(step_kinds[k], probe, probe, sig[k], sig[k + 1], noise_level)[1].reshape(-1)[0]
        for k in range(K)
    ]).float()
    for lo in range(0, n, batch_size):
        idx = slice(lo, min(lo + batch_size, n))
        x = x_all[idx].float()
        emb = index_embeds(embeds, idx)
        if not final_only:
            states[idx, start_step] = x
        for k in range(start_step, stop):
            with autocast():
                v = adapter.velocity(model, x, schedule.timesteps[k], emb, guidance_scale)
            x, lp, mean, std = sde_step(
                step_kinds[k], x, v, sig[k], sig[k + 1], noise_level,
                generator=generator[idx] if isinstance(generator, list) else generator,
                logprob_reduction=logprob_reduction,
            )
            if not final_only:
                states[idx, k + 1] = x
                means[idx, k] = mean
            log_probs[idx, k] = lp
            if keep_velocities:
                velocities[idx, k] = v
        if final_only:
            states[idx, 0] = x
        if on_chunk is not None:
            on_chunk(idx, states[idx, -1])
    out = {"states": states, "log_probs": log_probs, "means": means, "stds": stds}
    if keep_velocities:
        out["velocities"] = velocities
    return out


def concat_rollouts(parts: list[Rollout]) -> Rollout:
    """Concatenate rollouts of the same schedule and step kinds along the sample dimension."""
    parts = [p for p in parts if len(p)]
    first = parts[0]
    if len(parts) == 1:
        return first
    for p in parts[1:]:
        if (not torch.equal(p.schedule.sigmas, first.schedule.sigmas) or not torch.equal(p.stds, first.stds)
                or p.extras.get("step_kinds") != first.extras.get("step_kinds")):
            raise ValueError("concat_rollouts: rollouts must share the schedule and step kinds")

    # scoring started during sampling (reward_num_workers) carries over, in order, when every part has it
    pending = [p.extras.get("pending_scores") for p in parts]
    pending = {"pending_scores": [x for p in pending for x in p]} if all(p is not None for p in pending) else {}

    def cat(name):
        vals = [getattr(p, name) for p in parts]
        return None if any(v is None for v in vals) else torch.cat(vals)

    return Rollout(
        prompts=[q for p in parts for q in p.prompts],
        columns={k: [v for p in parts for v in p.columns[k]] for k in first.columns},
        group_ids=cat("group_ids"),
        embeds=cat_embeds([p.embeds for p in parts]),
        schedule=first.schedule,
        states=cat("states"),
        log_probs=cat("log_probs"),
        means=cat("means"),
        stds=first.stds,
        train_mask=cat("train_mask"),
        velocities=cat("velocities"),
        extras={"step_kinds": first.extras.get("step_kinds"), **pending},
    )
