"""What the shapes task's two pretraining scripts share (``scripts/pretrain_shapes.py``, the text-to-image base, and
``scripts/pretrain_shapes_edit.py``, the editing base): the learning-rate schedule, the optimizer step with its
EMA, and the step loop whose length is fixed up front (``steps``) or measured from a time budget (``minutes``).

The schedule is a linear warm-up, then a cosine decay to 0 at the last step. It is written here rather than taken
from ``transformers.get_cosine_schedule_with_warmup`` because a timed run only knows its last step after the
warm-up has begun (the timing steps are the run's first steps), and because the committed bases were trained with
this exact form (warm-up factor ``(step + 1) / warmup``).
"""

from __future__ import annotations

import math
import time
from typing import Callable

import numpy as np
import torch


def lr_at(step: int, total: int, warmup: int) -> float:
    """The learning-rate factor of ``step`` (0-based) of ``total``: ``(step + 1) / warmup`` during the warm-up,
    then ``0.5 (1 + cos(pi p))`` with ``p`` the fraction of the remaining steps done."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))


def set_lr(opt: torch.optim.Optimizer, step: int, total: int, warmup: int) -> None:
    """Each parameter group's ``lr`` = its ``peak_lr`` (its initial ``lr`` when the group has none) x :func:`lr_at`."""
    for g in opt.param_groups:
        g.setdefault("peak_lr", g["lr"])
        g["lr"] = g["peak_lr"] * lr_at(step, total, warmup)


def optimizer_step(opt: torch.optim.Optimizer, params: list[torch.Tensor], ema: list[torch.Tensor],
                   ema_decay: float, loss: torch.Tensor, max_grad_norm: float = 1.0) -> float:
    """One update: backward, gradient-norm clip, step, then ``ema <- ema_decay ema + (1 - ema_decay) params``.
    Returns the loss as a float."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    opt.step()
    with torch.no_grad():
        torch._foreach_lerp_(ema, [p.detach() for p in params], 1 - ema_decay)
    return loss.item()


def run_steps(train_step: Callable[[int, int], float], steps: int | None, minutes: float, *, batch_size: int,
              threads: int, log_every: int, lr_now: Callable[[], float], calib: int = 40
              ) -> tuple[int, list[float], float]:
    """Calls ``train_step(step, total)`` for every step and logs the smoothed loss. ``steps=None``: the first
    ``calib`` steps (of a schedule as long as no run) time the step, and the total is what fits in ``minutes``
    (printed, so ``--steps N`` repeats the run). Returns (total steps, per-step losses, training seconds)."""
    total, step, smooth, losses = steps, 0, None, []
    t_train = time.time()
    if total is None:  # timing run: these steps count as the first steps of the real run (warm-up phase)
        for step in range(calib):
            losses.append(train_step(step, 10**9))
            if step == 9:
                t_calib = time.time()
        sec = (time.time() - t_calib) / (calib - 10)
        total = int((minutes * 60 - (time.time() - t_train)) / sec) + calib
        step = calib
        print(f"timing: {sec:.3f} s/step at batch {batch_size} with {threads} thread(s) -> --steps {total} "
              f"for {minutes} min", flush=True)
    while step < total:
        loss = train_step(step, total)
        losses.append(loss)
        smooth = loss if smooth is None else 0.99 * smooth + 0.01 * loss
        step += 1
        if step % log_every == 0 or step == total:
            el = time.time() - t_train
            print(f"step {step}/{total} loss {loss:.4f} smoothed {smooth:.4f} lr {lr_now():.2e} "
                  f"{el / step:.3f} s/step elapsed {el / 60:.1f} min", flush=True)
    seconds = time.time() - t_train
    print(f"trained {total} steps in {seconds:.0f}s; mean loss of the last 200 steps {np.mean(losses[-200:]):.4f}",
          flush=True)
    return total, losses, seconds
