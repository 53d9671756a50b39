"""Rollout: sample trajectories with a transition kernel and keep what the update needs.

For each sample the rollout stores every state ``x_0 .. x_K``, the per-step behaviour log-probs and kernel means
(frozen as ``logp_old`` / ``mu_old``), and which steps are trainable. ``N`` is the number of samples on this
process, ``K`` the number of sampling steps, ``L`` the latent shape (e.g. C, h, w; video: C, F', h, w).
A trainer that needs only the samples (DiffusionNFT trains on the final latents) asks for ``store="final"``:
``states`` is then (N, 1, *L), the final state alone, and no kernel means are kept (``N prod(L) 4`` bytes instead
of ``N (2K + 1) prod(L) 4``). ``store="trained"`` keeps the transitions the update can train: for W trained steps,
at most ``N (3W + 1) prod(L) 4`` bytes of states and means (:meth:`Rollout.stored_bytes` counts them).

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
ROLLOUT_STORES = ("trajectory", "final", "trained")


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
        state_steps, mean_steps: the schedule indices of the stored states / means when sampled with
            ``store="trained"`` (``trajectory_storage="trained"``): then ``states`` is (N, len(state_steps), *L),
            ``means`` (N, len(mean_steps), *L) and ``velocities`` holds the state steps below K; None: all. Read
            them with :meth:`state`, :meth:`mean` and :meth:`velocity`, which take schedule indices.
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
    state_steps: list[int] | None = None
    mean_steps: list[int] | None = None

    def __len__(self) -> int:
        return len(self.prompts)

    # The accessors map schedule indices to stored positions (state_steps / mean_steps), so no consumer holds an
    # index map, and return rows on the index's device (the stored tensors may sit on the CPU).
    def _at(self, t: torch.Tensor, steps: list[int] | None, idx, k, what: str) -> torch.Tensor:
        if steps is not None:
            pos = torch.full((max(steps) + 1,), -1, dtype=torch.long)
            pos[torch.tensor(steps)] = torch.arange(len(steps))
            kk = torch.as_tensor(k).cpu()
            if bool((kk > max(steps)).any()) or bool((pos[kk.clamp(max=max(steps))] < 0).any()):
                raise KeyError(f"Rollout.{what}: step(s) {kk.tolist()} not stored (stored: {steps}; the rollout "
                               "keeps only the trained steps: trajectory_storage='trained')")
            k = pos[kk] if kk.ndim else int(pos[kk])
        device = idx.device if torch.is_tensor(idx) else t.device
        if torch.is_tensor(idx):
            idx = idx.to(t.device)
        if torch.is_tensor(k):
            k = k.to(t.device)
        return t[idx, k].to(device, non_blocking=True)

    def state(self, idx, k) -> torch.Tensor:
        """States ``x_k`` of samples ``idx`` (k: a schedule index, or a tensor of one per sample), on ``idx``'s
        device (the rollout may be stored on the CPU: ``offload_rollout_to_cpu``)."""
        return self._at(self.states, self.state_steps, idx, k, "state")

    def mean(self, idx, k) -> torch.Tensor:
        """Behaviour kernel means of step ``k`` of samples ``idx``, on ``idx``'s device."""
        return self._at(self.means, self.mean_steps, idx, k, "mean")

    def velocity(self, idx, k) -> torch.Tensor:
        """Guided behaviour velocities at ``x_k`` of samples ``idx`` (``keep_velocities``), on ``idx``'s device."""
        steps = None if self.state_steps is None else [j for j in self.state_steps if j < self.schedule.num_steps]
        return self._at(self.velocities, steps, idx, k, "velocity")

    def stored_bytes(self) -> int:
        """Bytes of the stored trajectory tensors: states, means, velocities, log-probs."""
        return sum(t.numel() * t.element_size() for t in (self.states, self.means, self.velocities, self.log_probs)
                   if t is not None)

    def to_storage(self, device) -> None:
        """Move the stored trajectory tensors (states, means, velocities) to ``device`` (the CPU: offload)."""
        for name in ("states", "means", "velocities"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.to(device))

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
    ``start_step=prefix["step"]``): the stored states ``0 .. s - 1``, means, log-probs (zeros: deterministic steps)
    and velocities of steps ``0 .. s - 1``, each row its group's. A ``store="final"`` trajectory keeps none of them,
    a ``store="trained"`` one those of its kept steps (``state_steps``, ``mean_steps``)."""
    s, inv = prefix["step"], prefix["inverse"]
    traj["log_probs"][:, :s] = prefix["log_probs"][inv, :s]
    if traj["means"] is None:
        return
    K = prefix["log_probs"].shape[1]
    state_steps = traj.get("state_steps", range(K + 1))
    mean_steps = traj.get("mean_steps", range(K))
    for i, j in enumerate(state_steps):
        if j < s:
            traj["states"][:, i] = prefix["states"][inv, j]
    for i, j in enumerate(mean_steps):
        if j < s:
            traj["means"][:, i] = prefix["means"][inv, j]
    if traj.get("velocities") is not None:
        for i, j in enumerate(j for j in state_steps if j < K):
            if j < s:
                traj["velocities"][:, i] = prefix["velocities"][inv, j]


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
    keep_steps: list[int] | None = None,
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
            ``"trained"``: the transitions of ``keep_steps`` alone (Flow-Factory's ``trajectory_indices``): states
            (N, S, *L) at ``state_steps`` = the sorted {k, k + 1 for k in keep_steps} and K, means (N, M, *L) at
            ``mean_steps`` = keep_steps, velocities at the state steps below K (read with :meth:`Rollout.state`,
            :meth:`Rollout.mean`, :meth:`Rollout.velocity`).

    Returns:
        ``states`` (N, K + 1, *L), ``log_probs`` (N, K), ``means`` (N, K, *L), ``stds`` (K,), and with
        ``keep_velocities`` ``velocities`` (N, K, *L); with ``store="trained"`` the kept steps' tensors and
        ``state_steps``, ``mean_steps``.
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
    if store == "trained":
        if keep_steps is None:
            raise ValueError("store='trained' needs keep_steps, the steps whose transition is kept")
        mean_steps = sorted(set(keep_steps))
        state_steps = sorted({j for k in mean_steps for j in (k, k + 1)} | {K})
    else:
        mean_steps = [] if final_only else list(range(K))
        state_steps = [K] if final_only else list(range(K + 1))
    spos = {j: i for i, j in enumerate(state_steps)}
    mpos = {j: i for i, j in enumerate(mean_steps)}
    vpos = {j: i for i, j in enumerate(j for j in state_steps if j < K)}
    lat, dev = x_all.shape[1:], x_all.device
    states = torch.zeros((n, len(state_steps), *lat), dtype=torch.float32, device=dev)
    means = None if final_only else torch.zeros((n, len(mean_steps), *lat), dtype=torch.float32, device=dev)
    log_probs = torch.zeros((n, K), dtype=torch.float32, device=dev)
    velocities = torch.zeros((n, len(vpos), *lat), dtype=torch.float32, device=dev) if keep_velocities else None
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
        if start_step in spos:
            states[idx, spos[start_step]] = x
        for k in range(start_step, stop):
            with autocast():
                v = adapter.velocity(model, x, schedule.timesteps[k], emb, guidance_scale)
            x, lp, mean, std = sde_step(
                step_kinds[k], x, v, sig[k], sig[k + 1], noise_level,
                generator=generator[idx] if isinstance(generator, list) else generator,
                logprob_reduction=logprob_reduction,
            )
            if k + 1 in spos:
                states[idx, spos[k + 1]] = x
            if k in mpos:
                means[idx, mpos[k]] = mean
            log_probs[idx, k] = lp
            if keep_velocities and k in vpos:
                velocities[idx, vpos[k]] = v
        if on_chunk is not None:
            on_chunk(idx, states[idx, -1])
    out = {"states": states, "log_probs": log_probs, "means": means, "stds": stds}
    if store == "trained":
        out.update(state_steps=state_steps, mean_steps=mean_steps)
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
                or p.extras.get("step_kinds") != first.extras.get("step_kinds")
                or (p.state_steps, p.mean_steps) != (first.state_steps, first.mean_steps)):
            raise ValueError("concat_rollouts: rollouts must share the schedule, step kinds and stored steps")

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
        state_steps=first.state_steps,
        mean_steps=first.mean_steps,
        extras={"step_kinds": first.extras.get("step_kinds"), **pending},
    )
