"""Scoring that overlaps sampling: each microbatch is decoded and scored in a thread pool as soon as it is
sampled, while the sampler moves on to the next microbatch (``reward_num_workers > 0``).

The trainer passes :meth:`OverlappedScoring.submit` to the sampler as its per-microbatch callback and collects
the results with :func:`collect_scores` when it scores the rollout. Decoding uses the same microbatches as the
sequential path and rewards are per-sample, so the images and rewards are the same as scoring after sampling;
the difference is that a reward sees one microbatch per call, from a worker thread (rewards must be thread-safe
when ``reward_num_workers > 1``). A reward that raises fails the iteration, naming itself, before any update.
The workers are daemon threads (:mod:`.threads`): a reward that hangs in one never keeps the process alive.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from concurrent.futures import Future

import torch

from .threads import DaemonPool


class _Stopped(RuntimeError):
    """A job skipped because an earlier one failed (or the scoring was closed)."""


class OverlappedScoring:
    """Decode and score the microbatches of one sampling call in ``num_workers`` threads.

    Args:
        decode: ``latents (b, *L) -> images (b, 3, H, W)``.
        reward: ``(images, prompts, columns) -> (combined (b,), {name: (b,)})`` (the trainer's ``reward``).
        prompts, columns: the N samples of the sampling call.
        device: the trainer's device (a worker thread selects it before running CUDA work).
    """

    def __init__(self, num_workers: int, decode: Callable, reward: Callable, prompts: list[str],
                 columns: dict[str, list], device: torch.device):
        self.pool = DaemonPool(num_workers, "trl_flow-reward")
        self.decode, self.reward = decode, reward
        self.prompts, self.columns = list(prompts), columns
        self.device = torch.device(device)
        self.jobs: list[tuple[int, int, Future]] = []
        self.failed = False  # a job raised: the later ones do nothing (fail fast, and nothing runs on at exit)
        self.error: BaseException | None = None  # the first job's own error (set before `failed`)

    def __len__(self) -> int:
        return len(self.prompts)

    def submit(self, rows: slice, final_states: torch.Tensor) -> None:
        """Start decoding and scoring samples ``rows`` (their final states (b, *L)); raise a finished job's error."""
        for _, _, fut in self.jobs:  # fail fast: a reward that raised stops the sampling early
            if fut.done() and fut.exception() is not None:
                self.close()
                # the reward's own error, not a later job's stop (which can finish first: the failing job sets
                # `failed` before its future holds the error)
                raise self.error or fut.exception()
        lo, hi, _ = rows.indices(len(self.prompts))
        states = final_states.detach().clone()
        columns = {k: list(v[lo:hi]) for k, v in self.columns.items()}
        self.jobs.append((lo, hi, self.pool.submit(self._work, states, self.prompts[lo:hi], columns)))

    def _work(self, states, prompts, columns):
        ctx = torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()
        try:
            with ctx:  # the current CUDA device is per thread
                self._check_going()
                images = self.decode(states)
                self._check_going()
                t0 = time.perf_counter()
                total, per_func = self.reward(images, prompts, columns)
                return images, total, per_func, time.perf_counter() - t0
        except _Stopped:
            raise
        except BaseException as e:
            if self.error is None:
                self.error = e
            self.failed = True
            raise

    def _check_going(self) -> None:
        if self.failed or self.pool.closed:
            raise _Stopped("overlapped scoring: stopped after an earlier failure")


    def close(self) -> None:
        """Cancel the queued jobs; never waits for a running one (a hung reward is left behind)."""
        self.pool.shutdown()


def collect_scores(pending: list[OverlappedScoring], n: int):
    """Wait for every job of ``pending`` (in sample order) and concatenate: images (n, 3, H, W), combined rewards
    (n,), per-reward rewards {name: (n,)} and the seconds spent inside the rewards."""
    images, totals, per_func, reward_s = [], [], {}, 0.0
    try:
        for scoring in pending:
            covered = 0
            for lo, hi, fut in scoring.jobs:
                if lo != covered:
                    raise RuntimeError(f"overlapped scoring: rows {lo}:{hi} arrived after row {covered}")
                im, tot, pf, dt = fut.result()
                images.append(im)
                totals.append(tot)
                for name, r in pf.items():
                    per_func.setdefault(name, []).append(r)
                reward_s += dt
                covered = hi
            if covered != len(scoring):
                raise RuntimeError(f"overlapped scoring: {covered} of {len(scoring)} samples were submitted")
    finally:
        for scoring in pending:
            scoring.close()
    total = torch.cat(totals)
    if len(total) != n:
        raise RuntimeError(f"overlapped scoring: scored {len(total)} samples for a rollout of {n}")
    return torch.cat(images), total, {k: torch.cat(v) for k, v in per_func.items()}, reward_s
