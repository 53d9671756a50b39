"""High-quality replay buffer for OP-GRPO (arXiv 2604.04142), persisted with `datasets`.

From every group of G trajectories sampled for one prompt, the trainer offers its highest-reward trajectories
(`ReplayEntry`; one under ``replay_unit="group"``, the best ``per_prompt`` under ``"sample"``) to the buffer.
The buffer keeps what is needed to re-train a trajectory off-policy: the states `x_0 .. x_{k_off}`, the behaviour
log-probs of steps `0 .. k_off-1`, the sigma of every stored state, the reward, the prompt (plus its other dataset
columns) and the iteration that produced it.

The paper does not publish its decay constant, capacity or replacement rule. This module uses the following
documented rules.

Priority
    ``priority = reward - decay * age * scale``, with ``age = max(0, now - entry.step)`` in training iterations
    and ``scale`` a running estimate of the spread of the rewards offered so far: the sample standard deviation
    (Welford) of every finite reward ever offered, including rejected candidates; ``1.0`` until there are two
    offers or while that std is 0. The reward scale statistics (count, mean, M2) are persisted with the buffer.

    * Sign-correct: the penalty is subtractive, so an old entry always loses priority, whether its reward is
      positive or negative (a multiplicative decay ``reward * (1 - decay) ** age`` would instead RAISE the
      priority of a negative-reward entry).
    * Scale-free: multiplying every reward by ``c > 0`` multiplies ``scale`` and every priority by ``c``, so
      all decisions are unchanged (a constant penalty ``decay * age`` would not be).
    * Meaning of ``decay``: an entry loses one reward-std of priority every ``1 / decay`` iterations
      (20 with the default 0.05), i.e. after 20 iterations a fresh trajectory one std worse replaces it.

offer(entry, now)
    1. Validate (raises ``TypeError``/``ValueError`` on a malformed entry; see `ReplayBuffer.offer`). A
       non-finite reward, state, log-prob or sigma is rejected with a warning and never stored (nor does it
       enter the reward statistics): a NaN cannot corrupt the buffer.
    2. Update the reward statistics with the candidate's reward, then compare priorities at ``now`` (so both
       sides of a comparison use the same scale):

       * the same trajectory (equal states and log-probs) already stored for the prompt -> reject (no duplicates);
       * prompt already holds ``per_prompt`` entries -> replace its lowest-priority one iff
         ``priority(new) >= priority(lowest)`` (ties go to the newer one);
       * otherwise, buffer not full -> insert;
       * otherwise, buffer full -> evict the lowest-priority entry iff ``priority(new)`` is STRICTLY higher,
         else reject (ties among the lowest are broken by evicting the oldest, then by prompt).

    At most ``per_prompt`` distinct entries per prompt (default 1: the one-entry-per-prompt buffer). All entries of
    one buffer share the same ``states`` shape (fixed by the first stored entry and persisted); a mismatch raises
    ``ValueError``.

sample_groups(sizes, now, generator, exclude)
    ``len(sizes)`` distinct prompts (not in ``exclude``), and for the j-th up to ``sizes[j]`` distinct entries of
    that prompt. ``"uniform"`` (default): the prompts are drawn uniformly with ``torch.randperm`` on the given CPU
    generator over the non-excluded prompts sorted by name (so the draw is deterministic given the generator and
    the buffer's contents, independently of insertion order or a save/load round trip), then, where a prompt holds
    more entries than asked, its entries likewise (no draw when it holds at most that many).
    ``"priority"``: the prompts whose best entry has the highest priority, and their highest-priority entries
    (ties: newer first, then by prompt). Returns fewer prompts or entries when fewer are available.
    ``sample(n, ...)`` is ``sample_groups([1] * n, ...)`` flattened. The returned entries are the stored objects
    (CPU tensors): do not modify them in place.

Defaults
    * ``capacity=512`` entries: a few iterations' worth of trajectories at typical batch sizes, so with ~25%
      off-policy samples per batch the buffer is neither exhausted nor stale.
      Memory is ``capacity * (k_off + 1) * latent_numel * 4`` bytes (in CPU RAM).
    * ``decay=0.05``: one reward-std of priority lost per 20 iterations; keeps the buffer near the current
      policy without discarding a clearly better old trajectory after a few iterations.
    * ``sampling="uniform"``: unbiased over the (already high-quality) stored entries; ``"priority"`` is the
      greedy alternative.
    * ``per_prompt=1``: the one-entry-per-prompt buffer; OP-GRPO's trainer passes ``num_generations // 2`` under
      ``replay_unit="sample"`` (docs/op_grpo.md).

Persistence
    `to_dataset` builds a `datasets.Dataset` with explicit features: ``prompt`` and ``columns`` (JSON-encoded)
    as ``Value("string")``, ``states`` as ``Array2D..Array5D`` by ndim (a flat ``List(Value("float32"))`` for
    other ndims, the shape being kept in the metadata), ``log_probs``/``sigmas`` as fixed-length
    ``List(Value("float32"))``, ``reward`` as ``Value("float64")`` and ``step`` as ``Value("int64")``.
    Reload is bit-exact. The buffer's own config (capacity, decay, sampling, per_prompt, reward statistics, states
    shape, counters) is stored as JSON in ``info.description`` (format version 2; version 1, written before
    ``per_prompt`` existed, is a one-entry-per-prompt buffer: it loads as ``per_prompt=1``, or, when a larger
    ``per_prompt`` is passed, is converted explicitly with a warning); `save_to_disk`/`load_from_disk` keep it.
    The Hub drops ``info.description``: `from_dataset` of a dataset without that metadata takes the config from
    its keyword arguments and seeds the reward statistics from the stored rewards (with a warning).
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import numpy as np
import torch

__all__ = ["ReplayEntry", "ReplayBuffer"]

_FORMAT = "trl_flow.ReplayBuffer"
_FORMAT_VERSION = 2  # 2: several entries per prompt (per_prompt); 1: one entry per prompt
_SAMPLING = ("uniform", "priority")
_COUNTERS = ("offered", "inserted", "replaced", "evicted", "rejected", "rejected_nonfinite", "rejected_duplicate")
_LOAD_CHUNK = 64  # rows converted to tensors at a time on load (bounds peak memory for large latents)


@dataclass
class ReplayEntry:
    """One buffered trajectory prefix.

    Attributes:
        prompt: the prompt (the buffer's key: at most ``per_prompt`` distinct entries per prompt).
        columns: the prompt's other dataset columns; values must be JSON-serialisable (stored JSON-normalised,
            e.g. tuples become lists).
        states: ``(k_off + 1, *latent_shape)`` float32, the states ``x_0 .. x_{k_off}``.
        log_probs: ``(k_off,)`` float32, behaviour log-probs of the transitions ``x_k -> x_{k+1}``, k < k_off.
        sigmas: ``(k_off + 1,)`` float32, the sigma of each stored state (to validate reuse).
        reward: the trajectory's reward (any sign, any scale; must be finite).
        step: training iteration that produced the entry (``age = now - step``).
    """

    prompt: str
    columns: dict
    states: torch.Tensor
    log_probs: torch.Tensor
    sigmas: torch.Tensor
    reward: float
    step: int

    @property
    def k_off(self) -> int:
        """Number of stored transitions (``log_probs.shape[0]``)."""
        return int(self.log_probs.shape[0])


def _states_feature(shape: tuple[int, ...] | None):
    import datasets

    arrays = {2: datasets.Array2D, 3: datasets.Array3D, 4: datasets.Array4D, 5: datasets.Array5D}
    if shape is not None and len(shape) in arrays:
        return arrays[len(shape)](shape=tuple(shape), dtype="float32")
    return datasets.List(datasets.Value("float32"))  # flat; the shape lives in the metadata


def _same_trajectory(a: ReplayEntry, b: ReplayEntry) -> bool:
    """Whether two entries store the same trajectory (same prompt, states and behaviour log-probs)."""
    return (a.prompt == b.prompt and a.states.shape == b.states.shape and torch.equal(a.states, b.states)
            and torch.equal(a.log_probs, b.log_probs))


def _as_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"`{name}` must be an int, got {type(value).__name__}")
    return int(value)


class ReplayBuffer:
    """Bounded, age-decayed replay buffer of at most ``per_prompt`` distinct entries per prompt (rules in the
    module docstring).

    Args:
        capacity: maximum number of entries, > 0.
        decay: priority lost per iteration of age, in units of the running reward std, >= 0.
        sampling: ``"uniform"`` or ``"priority"`` (see `sample_groups`).
        per_prompt: maximum number of distinct entries (trajectories) per prompt, > 0.
    """

    def __init__(self, capacity: int = 512, decay: float = 0.05, sampling: str = "uniform", per_prompt: int = 1):
        if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity <= 0:
            raise ValueError(f"`capacity` must be a positive int (>= 1), got {capacity!r}")
        try:
            decay_f = float(decay)
        except (TypeError, ValueError):
            raise ValueError(f"`decay` must be a finite float >= 0, got {decay!r}") from None
        if not math.isfinite(decay_f) or decay_f < 0:
            raise ValueError(f"`decay` must be a finite float >= 0, got {decay!r}")
        if sampling not in _SAMPLING:
            raise ValueError(f"`sampling` must be one of {list(_SAMPLING)}, got {sampling!r}")
        if isinstance(per_prompt, bool) or not isinstance(per_prompt, (int, np.integer)) or per_prompt <= 0:
            raise ValueError(f"`per_prompt` must be a positive int (>= 1), got {per_prompt!r}")
        self.capacity = int(capacity)
        self.decay = decay_f
        self.sampling = sampling
        self.per_prompt = int(per_prompt)
        self._entries: dict[str, list[ReplayEntry]] = {}  # prompt -> its entries (insertion order kept)
        self._states_shape: tuple[int, ...] | None = None
        # Welford statistics of every finite reward offered.
        self._n = 0
        self._mean = 0.0
        self._m2 = 0.0
        self.counters: dict[str, int] = {k: 0 for k in _COUNTERS}

    # ------------------------------------------------------------------ container protocol
    def __len__(self) -> int:
        return sum(len(v) for v in self._entries.values())

    def __contains__(self, prompt: object) -> bool:
        return prompt in self._entries

    def __iter__(self) -> Iterator[ReplayEntry]:
        return iter([e for v in self._entries.values() for e in v])

    def get(self, prompt: str) -> ReplayEntry | None:
        """The stored entry for ``prompt`` (the highest-reward one, the first among equals, when it holds several),
        or None."""
        entries = self._entries.get(prompt)
        return max(entries, key=lambda e: e.reward) if entries else None

    def entries_of(self, prompt: str) -> list[ReplayEntry]:
        """All stored entries of ``prompt`` (insertion order), possibly empty."""
        return list(self._entries.get(prompt, ()))

    @property
    def prompts(self) -> list[str]:
        return list(self._entries)

    @property
    def states_shape(self) -> tuple[int, ...] | None:
        """``(k_off + 1, *latent_shape)`` shared by all entries; None until the first entry is stored."""
        return self._states_shape

    def __repr__(self) -> str:
        return (
            f"ReplayBuffer(size={len(self)}, capacity={self.capacity}, decay={self.decay}, "
            f"sampling={self.sampling!r}, per_prompt={self.per_prompt}, states_shape={self._states_shape})"
        )

    # ------------------------------------------------------------------ priority
    @property
    def reward_scale(self) -> float:
        """Sample std of every finite reward offered so far; 1.0 with fewer than 2 offers or a zero std."""
        if self._n < 2:
            return 1.0
        std = math.sqrt(max(self._m2, 0.0) / (self._n - 1))
        return std if std > 0 and math.isfinite(std) else 1.0

    def priority(self, entry: ReplayEntry, now: int) -> float:
        """``reward - decay * max(0, now - step) * reward_scale``."""
        age = max(0, int(now) - int(entry.step))
        return float(entry.reward) - self.decay * age * self.reward_scale

    def _update_stats(self, reward: float) -> None:
        self._n += 1
        delta = reward - self._mean
        self._mean += delta / self._n
        self._m2 += delta * (reward - self._mean)

    def _lowest(self, now: int, entries: Iterable[ReplayEntry] | None = None) -> ReplayEntry:
        # lowest priority; ties: oldest first, then prompt, then the earlier stored (deterministic)
        entries = list(self) if entries is None else list(entries)
        return min(enumerate(entries), key=lambda ie: (self.priority(ie[1], now), ie[1].step, ie[1].prompt, ie[0]))[1]

    def _remove(self, entry: ReplayEntry) -> None:
        lst = self._entries[entry.prompt]
        lst.pop(next(i for i, e in enumerate(lst) if e is entry))
        if not lst:
            del self._entries[entry.prompt]

    # ------------------------------------------------------------------ offer
    def _validate(self, entry: ReplayEntry, now: int) -> tuple[ReplayEntry, bool]:
        """Return a CPU, detached, JSON-normalised copy of ``entry`` and whether all its values are finite."""
        if not isinstance(entry, ReplayEntry):
            raise TypeError(f"expected a ReplayEntry, got {type(entry).__name__}")
        if not isinstance(entry.prompt, str):
            raise TypeError(f"`prompt` must be a str, got {type(entry.prompt).__name__}")
        if not isinstance(entry.columns, dict):
            raise TypeError(f"`columns` must be a dict, got {type(entry.columns).__name__}")
        try:
            columns = json.loads(json.dumps(entry.columns))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"`columns` of prompt {entry.prompt!r} must be JSON-serialisable: {exc}") from None
        for name in ("states", "log_probs", "sigmas"):
            t = getattr(entry, name)
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"`{name}` must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype != torch.float32:
                raise ValueError(f"`{name}` must be float32, got {t.dtype}")
        states, log_probs, sigmas = entry.states, entry.log_probs, entry.sigmas
        if states.ndim < 1:
            raise ValueError(f"`states` must have shape (k_off + 1, *latent_shape), got {tuple(states.shape)}")
        if log_probs.ndim != 1:
            raise ValueError(f"`log_probs` must have shape (k_off,), got {tuple(log_probs.shape)}")
        if sigmas.ndim != 1:
            raise ValueError(f"`sigmas` must have shape (k_off + 1,), got {tuple(sigmas.shape)}")
        k_off = log_probs.shape[0]
        if k_off < 1:
            raise ValueError("`log_probs` must hold at least one step (k_off >= 1), got shape (0,)")
        if states.shape[0] != k_off + 1:
            raise ValueError(
                f"`states` must have k_off + 1 = {k_off + 1} rows (log_probs has {k_off}), "
                f"got shape {tuple(states.shape)}"
            )
        if sigmas.shape[0] != k_off + 1:
            raise ValueError(f"`sigmas` must have shape ({k_off + 1},) (k_off + 1), got {tuple(sigmas.shape)}")
        if self._states_shape is not None and tuple(states.shape) != self._states_shape:
            raise ValueError(
                f"`states` has shape {tuple(states.shape)}, expected {self._states_shape} "
                "(all entries of a buffer share one states shape)"
            )
        try:
            reward = float(entry.reward)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(f"`reward` must be a real number, got {type(entry.reward).__name__}") from None
        step = _as_int("step", entry.step)
        if step > now:
            raise ValueError(f"`step` ({step}) is in the future of `now` ({now})")
        copy = ReplayEntry(
            prompt=entry.prompt,
            columns=columns,
            states=states.detach().to("cpu", copy=True).contiguous(),
            log_probs=log_probs.detach().to("cpu", copy=True).contiguous(),
            sigmas=sigmas.detach().to("cpu", copy=True).contiguous(),
            reward=reward,
            step=step,
        )
        finite = (
            math.isfinite(reward)
            and bool(torch.isfinite(copy.states).all())
            and bool(torch.isfinite(copy.log_probs).all())
            and bool(torch.isfinite(copy.sigmas).all())
        )
        return copy, finite

    def offer(self, entry: ReplayEntry, now: int) -> bool:
        """Offer a candidate (normally the best trajectory of a group, produced at ``step == now``).

        Inserts, replaces the same prompt's lowest entry, evicts the lowest-priority entry, or rejects (also a
        duplicate of a stored trajectory), per the module docstring. The stored entry is a detached CPU copy.
        Returns whether the candidate was stored.

        Raises:
            TypeError / ValueError: malformed entry (wrong types, dtype other than float32, inconsistent
                ``states``/``log_probs``/``sigmas`` lengths, ``states`` shape differing from the buffer's,
                non-JSON ``columns``, ``step > now``). Non-finite values do NOT raise: they are rejected with a
                warning and the buffer is left unchanged.
        """
        now = _as_int("now", now)
        cand, finite = self._validate(entry, now)
        if not finite:
            self.counters["rejected_nonfinite"] += 1
            warnings.warn(
                f"ReplayBuffer: rejected the entry for prompt {cand.prompt!r}: non-finite reward, states, "
                "log_probs or sigmas",
                RuntimeWarning,
                stacklevel=2,
            )
            return False
        same = self._entries.get(cand.prompt, [])
        if any(_same_trajectory(cand, e) for e in same):
            self.counters["rejected_duplicate"] += 1
            return False
        self.counters["offered"] += 1
        self._update_stats(cand.reward)
        p_new = self.priority(cand, now)

        if len(same) >= self.per_prompt:
            old = self._lowest(now, same)
            if p_new >= self.priority(old, now):
                same[next(i for i, e in enumerate(same) if e is old)] = cand
                self.counters["replaced"] += 1
                return True
            self.counters["rejected"] += 1
            return False
        if len(self) >= self.capacity:
            lowest = self._lowest(now)
            if not p_new > self.priority(lowest, now):
                self.counters["rejected"] += 1
                return False
            self._remove(lowest)
            self.counters["evicted"] += 1
        self._entries.setdefault(cand.prompt, []).append(cand)
        self._states_shape = tuple(cand.states.shape)
        self.counters["inserted"] += 1
        return True

    # ------------------------------------------------------------------ sample / stats
    def sample(
        self,
        n: int,
        now: int,
        generator: torch.Generator | None = None,
        exclude: Iterable[str] = (),
    ) -> list[ReplayEntry]:
        """Up to ``n`` entries of ``n`` distinct prompts not in ``exclude``: ``sample_groups([1] * n)`` flattened."""
        n = _as_int("n", n)
        if n < 0:
            raise ValueError(f"`n` must be >= 0, got {n}")
        return [g[0] for g in self.sample_groups([1] * n, now, generator=generator, exclude=exclude)]

    def sample_groups(
        self,
        sizes: list[int],
        now: int,
        generator: torch.Generator | None = None,
        exclude: Iterable[str] = (),
    ) -> list[list[ReplayEntry]]:
        """Up to ``len(sizes)`` distinct prompts not in ``exclude``, each with up to ``sizes[j]`` distinct entries
        of that prompt (see the module docstring). Never returns an entry twice.

        ``generator`` is a CPU `torch.Generator` used by ``"uniform"`` sampling (the global RNG if None);
        ``now`` is used by ``"priority"`` sampling.
        """
        sizes = [_as_int("sizes[j]", k) for k in sizes]
        if any(k < 1 for k in sizes):
            raise ValueError(f"`sizes` must hold ints >= 1, got {sizes}")
        now = _as_int("now", now)
        excl = {exclude} if isinstance(exclude, str) else set(exclude)
        prompts = sorted(p for p in self._entries if p not in excl)
        if not sizes or not prompts:
            return []

        def rank(e):
            return (-self.priority(e, now), -e.step, e.prompt)

        if self.sampling == "priority":
            prompts.sort(key=lambda p: min(rank(e) for e in self._entries[p]))
            chosen = prompts[: len(sizes)]
        else:
            perm = torch.randperm(len(prompts), generator=generator)[: min(len(sizes), len(prompts))]
            chosen = [prompts[i] for i in perm.tolist()]
        out = []
        for p, k in zip(chosen, sizes):
            entries = self._entries[p]
            if len(entries) <= k:
                out.append(list(entries))
            elif self.sampling == "priority":
                out.append(sorted(entries, key=rank)[:k])
            else:
                out.append([entries[i] for i in torch.randperm(len(entries), generator=generator)[:k].tolist()])
        return out

    def stats(self, now: int) -> dict[str, float]:
        """Logging summary. Means/max are NaN for an empty buffer; counters are cumulative."""
        entries = list(self)
        nan = float("nan")
        out: dict[str, float] = {
            "size": float(len(entries)),
            "capacity": float(self.capacity),
            "reward_scale": self.reward_scale,
            "mean_reward": nan,
            "mean_age": nan,
            "max_age": nan,
            "mean_priority": nan,
        }
        if entries:
            ages = [max(0, now - e.step) for e in entries]
            out["mean_reward"] = sum(e.reward for e in entries) / len(entries)
            out["mean_age"] = sum(ages) / len(ages)
            out["max_age"] = float(max(ages))
            out["mean_priority"] = sum(self.priority(e, now) for e in entries) / len(entries)
        out.update({k: float(v) for k, v in self.counters.items()})
        return out

    # ------------------------------------------------------------------ persistence
    def _metadata(self) -> dict:
        return {
            "format": _FORMAT,
            "version": _FORMAT_VERSION,
            "capacity": self.capacity,
            "decay": self.decay,
            "sampling": self.sampling,
            "per_prompt": self.per_prompt,
            "reward_stats": {"count": self._n, "mean": self._mean, "m2": self._m2},
            "states_shape": list(self._states_shape) if self._states_shape is not None else None,
            "counters": dict(self.counters),
        }

    def features(self):
        """The explicit `datasets.Features` used by `to_dataset`."""
        import datasets

        k_off = self._states_shape[0] - 1 if self._states_shape is not None else -1
        return datasets.Features(
            {
                "prompt": datasets.Value("string"),
                "columns": datasets.Value("string"),
                "states": _states_feature(self._states_shape),
                "log_probs": datasets.List(datasets.Value("float32"), length=k_off),
                "sigmas": datasets.List(datasets.Value("float32"), length=k_off + 1 if k_off >= 0 else -1),
                "reward": datasets.Value("float64"),
                "step": datasets.Value("int64"),
            }
        )

    def to_dataset(self):
        """The buffer as a `datasets.Dataset` (one row per entry, insertion order; config in info.description)."""
        import datasets

        features = self.features()
        entries = list(self)
        shape = self._states_shape
        flat = shape is None or not (2 <= len(shape) <= 5)
        if entries:
            states = np.stack([e.states.numpy() for e in entries])
            if flat:
                states = states.reshape(len(entries), -1)
            log_probs = np.stack([e.log_probs.numpy() for e in entries])
            sigmas = np.stack([e.sigmas.numpy() for e in entries])
        else:
            states, log_probs, sigmas = [], [], []
        data = {
            "prompt": [e.prompt for e in entries],
            "columns": [json.dumps(e.columns) for e in entries],
            "states": states,
            "log_probs": log_probs,
            "sigmas": sigmas,
            "reward": [float(e.reward) for e in entries],
            "step": [int(e.step) for e in entries],
        }
        info = datasets.DatasetInfo(description=json.dumps(self._metadata()), features=features)
        return datasets.Dataset.from_dict(data, features=features, info=info)

    @classmethod
    def from_dataset(cls, ds, **kwargs) -> "ReplayBuffer":
        """Rebuild a buffer from `to_dataset`'s output.

        The config comes from ``ds.info.description`` (see module docstring); ``kwargs`` (capacity, decay,
        sampling, per_prompt) override it. If the dataset holds more rows than the capacity, the lowest-priority
        rows (at ``now`` = the newest step) are dropped with a warning. A format-1 buffer (one entry per prompt,
        written before ``per_prompt`` existed) loads as ``per_prompt=1``; asking for more converts it, with a
        warning. More rows of one prompt than ``per_prompt``, or the same trajectory twice, raise ``ValueError``.
        """
        meta = None
        desc = getattr(getattr(ds, "info", None), "description", None) or ""
        try:
            parsed = json.loads(desc)
            if isinstance(parsed, dict) and parsed.get("format") == _FORMAT:
                meta = parsed
        except (TypeError, ValueError):
            pass
        config = {}
        if meta is not None:
            if meta.get("version", 0) > _FORMAT_VERSION:
                raise ValueError(f"replay buffer format version {meta['version']} is newer than {_FORMAT_VERSION}")
            config = {k: meta[k] for k in ("capacity", "decay", "sampling", "per_prompt") if k in meta}
        version = meta.get("version", 1) if meta is not None else None
        if version == 1 and kwargs.get("per_prompt", 1) != 1:
            warnings.warn(
                f"ReplayBuffer.from_dataset: converting a format-1 replay buffer (one entry per prompt, written "
                f"before several entries per prompt existed) to per_prompt={kwargs['per_prompt']}: its entries are "
                "kept, and each prompt may now hold up to that many distinct trajectories",
                UserWarning,
                stacklevel=2,
            )
        config.update(kwargs)
        buf = cls(**config)

        n_rows = len(ds)
        shape = tuple(meta["states_shape"]) if meta is not None and meta.get("states_shape") is not None else None
        if shape is None and n_rows:
            feat = ds.features["states"]
            if hasattr(feat, "shape"):
                shape = tuple(feat.shape)
            else:
                raise ValueError("cannot infer the `states` shape: flat states column and no buffer metadata")

        entries: list[ReplayEntry] = []
        seen: dict[str, list[ReplayEntry]] = {}
        nds = ds.with_format("numpy", columns=["states", "log_probs", "sigmas"])
        scalars = ds.select_columns(["prompt", "columns", "reward", "step"])[:]
        prompts, columns, rewards, steps = scalars["prompt"], scalars["columns"], scalars["reward"], scalars["step"]
        for start in range(0, n_rows, _LOAD_CHUNK):
            batch = nds[start : start + _LOAD_CHUNK]
            st = np.asarray(batch["states"], dtype=np.float32)
            lp = np.asarray(batch["log_probs"], dtype=np.float32)
            sg = np.asarray(batch["sigmas"], dtype=np.float32)
            for j in range(st.shape[0]):
                i = start + j
                prompt = prompts[i]
                entry = ReplayEntry(
                    prompt=prompt,
                    columns=json.loads(columns[i]),
                    states=torch.from_numpy(np.array(st[j], copy=True).reshape(shape)),
                    log_probs=torch.from_numpy(np.array(lp[j], copy=True)),
                    sigmas=torch.from_numpy(np.array(sg[j], copy=True)),
                    reward=float(rewards[i]),
                    step=int(steps[i]),
                )
                same = seen.setdefault(prompt, [])
                if any(_same_trajectory(entry, e) for e in same):
                    raise ValueError(f"dataset row {i} repeats a stored trajectory of prompt {prompt!r}; a replay "
                                     "buffer holds no duplicates")
                if len(same) >= buf.per_prompt:
                    raise ValueError(f"dataset holds more than per_prompt={buf.per_prompt} rows of prompt {prompt!r} "
                                     f"(row {i}); load it with per_prompt >= the rows per prompt")
                same.append(entry)
                entries.append(entry)

        if meta is not None:
            rs = meta.get("reward_stats", {})
            buf._n, buf._mean, buf._m2 = int(rs.get("count", 0)), float(rs.get("mean", 0.0)), float(rs.get("m2", 0.0))
            buf.counters.update({k: int(v) for k, v in meta.get("counters", {}).items() if k in buf.counters})
        else:
            warnings.warn(
                "ReplayBuffer.from_dataset: no buffer metadata in info.description; config from kwargs/defaults, "
                "reward statistics seeded from the stored rewards",
                RuntimeWarning,
                stacklevel=2,
            )
            for e in entries:
                buf._update_stats(e.reward)

        if len(entries) > buf.capacity:
            now = max(e.step for e in entries)
            keep = sorted(entries, key=lambda e: (-buf.priority(e, now), -e.step, e.prompt))[: buf.capacity]
            keep_ids = {id(e) for e in keep}
            warnings.warn(
                f"ReplayBuffer.from_dataset: {len(entries)} rows exceed capacity {buf.capacity}; "
                "dropping the lowest-priority ones",
                RuntimeWarning,
                stacklevel=2,
            )
            entries = [e for e in entries if id(e) in keep_ids]
        for e in entries:
            buf._entries.setdefault(e.prompt, []).append(e)
        buf._states_shape = shape if (entries or shape is not None) else None
        return buf

    def save_to_disk(self, path) -> None:
        """Write the buffer (entries + config) to the directory ``path`` via `datasets.Dataset.save_to_disk`."""
        ds = self.to_dataset()
        # datasets cannot reload a 0-shard dataset: force one shard for an empty buffer.
        ds.save_to_disk(str(path), num_shards=1 if len(ds) == 0 else None)

    @classmethod
    def load_from_disk(cls, path, **kwargs) -> "ReplayBuffer":
        """Inverse of `save_to_disk`; ``kwargs`` override the stored config (see `from_dataset`)."""
        import datasets

        return cls.from_dataset(datasets.load_from_disk(str(path)), **kwargs)

    def push_to_hub(self, repo_id: str, **kwargs):
        """``to_dataset().push_to_hub(repo_id, **kwargs)``. The Hub drops ``info.description`` (the config)."""
        return self.to_dataset().push_to_hub(repo_id, **kwargs)
