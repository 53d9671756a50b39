"""Rewards: the contract, how several rewards combine, and two weight-free rewards.

A reward is any callable ``reward(images, prompts, **columns) -> list[float | None]`` where ``images`` is a float
tensor (B, 3, H, W) in [0, 1] (video: (B, F, 3, H, W)), ``prompts`` a list of B strings and ``columns`` the
prompts' other dataset columns, each a list of B values. ``None`` or NaN means "no score for this sample": that
reward is skipped for that sample and the weighted sum uses the remaining rewards. A sample with no score at all
gets no advantage and is not trained on; an infinite score counts as no score (with a warning). Each reward gets
its own copy of the images and of the column lists: a reward that modifies them in place affects nothing else.
"""

from __future__ import annotations

import io
import math
import warnings
from collections.abc import Callable, Sequence

import numpy as np
import torch

RewardFunc = Callable[..., Sequence[float | None]]


class RewardError(RuntimeError):
    """A reward function raised or returned something unusable; the message names it."""


def reward_name(func) -> str:
    """The name a reward is logged under: ``__name__``, else the class name."""
    return getattr(func, "__name__", None) or type(func).__name__


def validate_reward_funcs(reward_funcs, reward_weights) -> tuple[list[RewardFunc], list[str], list[float]]:
    """Normalise ``reward_funcs`` to a list, check callability, names and weights. Raises before any compute."""
    if callable(reward_funcs):
        reward_funcs = [reward_funcs]
    if not isinstance(reward_funcs, (list, tuple)) or not reward_funcs:
        raise ValueError("reward_funcs: pass a callable or a non-empty list of callables")
    for i, f in enumerate(reward_funcs):
        if not callable(f):
            raise TypeError(f"reward_funcs[{i}]: {f!r} is not callable; a reward is reward(images, prompts, **columns)")
    names = [reward_name(f) for f in reward_funcs]
    seen = {}
    for i, n in enumerate(names):  # make names unique for logging
        if n in seen:
            seen[n] += 1
            names[i] = f"{n}_{seen[n]}"
        else:
            seen[n] = 0
    if reward_weights is None:
        weights = [1.0] * len(reward_funcs)
    else:
        weights = [float(w) for w in reward_weights]
        if len(weights) != len(reward_funcs):
            raise ValueError(
                f"reward_weights: got {len(weights)} weights for {len(reward_funcs)} reward functions; "
                "give one weight per reward function"
            )
        if not all(math.isfinite(w) for w in weights):
            raise ValueError(f"reward_weights: weights must be finite, got {weights}")
    return list(reward_funcs), names, weights


def call_scores(out, n: int, name: str) -> list[float]:
    """A reward's output as ``n`` floats, NaN for None / NaN / inf (inf with a warning); a :class:`RewardError`
    naming the reward for a wrong length or a non-number."""
    if isinstance(out, torch.Tensor):
        out = out.detach().float().cpu().reshape(-1).tolist()
    try:
        values = list(out)
    except TypeError:
        raise RewardError(
            f"reward function {name!r} returned {type(out).__name__}; it must return a list of {n} floats"
        ) from None
    if len(values) != n:
        raise RewardError(
            f"reward function {name!r} returned {len(values)} values for {n} images; it must return one "
            "float (or None to skip) per image"
        )
    try:
        arr = [float("nan") if v is None else float(v) for v in values]
    except (TypeError, ValueError):
        raise RewardError(f"reward function {name!r} returned a non-numeric value: {values[:4]}...") from None
    n_inf = sum(math.isinf(v) for v in arr)
    if n_inf:  # an infinite score is as unusable as none
        warnings.warn(f"reward function {name!r} returned inf for {n_inf} of {n} images: treated as no score for "
                      "them", RuntimeWarning, stacklevel=3)
    return [v if math.isfinite(v) else float("nan") for v in arr]


def compute_rewards(
    reward_funcs: list[RewardFunc],
    names: list[str],
    weights: list[float],
    images: torch.Tensor,
    prompts: list[str],
    columns: dict[str, list],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Call every reward and combine: ``r = sum_i w_i r_i`` over the rewards that scored the sample.

    Returns the combined rewards (B,) float32 (NaN where no reward scored the sample) and each reward (B,).
    A reward that raises or returns the wrong length raises a :class:`RewardError` naming it.
    """
    n = len(prompts)
    per_func = {}
    for func, name in zip(reward_funcs, names):
        try:
            out = func(images.clone(), list(prompts), **{k: list(v) for k, v in columns.items()})
        except Exception as e:  # re-raise with the reward's name; nothing has been updated yet
            raise RewardError(f"reward function {name!r} raised {type(e).__name__}: {e}") from e
        per_func[name] = torch.tensor(call_scores(out, n, name), dtype=torch.float32)
    stacked = torch.stack([per_func[k] for k in names], dim=1)  # (B, F)
    w = torch.tensor(weights, dtype=torch.float32)
    valid = ~torch.isnan(stacked)
    total = torch.where(valid, stacked * w, torch.zeros_like(stacked)).sum(dim=1)
    total = torch.where(valid.any(dim=1), total, torch.full_like(total, float("nan")))
    return total, per_func


def _jpeg_size_kb(images: torch.Tensor) -> list[float]:
    from PIL import Image

    arr = (images.detach().float().clamp(0, 1).cpu().numpy() * 255).round().astype(np.uint8)
    sizes = []
    for img in arr:
        if img.ndim == 4:  # video (F, 3, H, W): score the frames together
            img = np.concatenate(list(img), axis=1)
        buf = io.BytesIO()
        Image.fromarray(img.transpose(1, 2, 0)).save(buf, format="JPEG", quality=95)
        sizes.append(buf.tell() / 1000)
    return sizes


def jpeg_compressibility(images: torch.Tensor, prompts: list[str], **kwargs) -> list[float]:
    """DDPO's reward: minus the JPEG size (kB, quality 95) of each image. Images (B, 3, H, W) in [0, 1]."""
    return [-s for s in _jpeg_size_kb(images)]


def jpeg_incompressibility(images: torch.Tensor, prompts: list[str], **kwargs) -> list[float]:
    """DDPO's reward: the JPEG size (kB, quality 95) of each image. Images (B, 3, H, W) in [0, 1]."""
    return _jpeg_size_kb(images)
