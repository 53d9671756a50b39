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
import numbers
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np
import torch

from .threads import CallTimeout, call_with_timeout

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
            raise TypeError(
                f"reward_funcs[{i}]: {f!r} is not callable; a reward is reward(images, prompts, **columns)")
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


FLOAT32_MAX = float(np.finfo(np.float32).max)


def call_scores(out, n: int, name: str) -> list[float]:
    """A reward's output as ``n`` floats, NaN for None / NaN / inf (inf with a warning); a :class:`RewardError`
    naming the reward for a wrong length or a non-number. A value beyond float32's range (e.g. 1e39, what the
    reward tensors hold) is infinite there and treated as inf. Strings, bytes and mappings are not numbers (a
    numeric string is refused, not converted)."""
    if isinstance(out, torch.Tensor):
        out = out.detach().float().cpu().reshape(-1).tolist()
    elif isinstance(out, np.ndarray):
        out = out.reshape(-1).tolist()
    if isinstance(out, (str, bytes, Mapping)) or not isinstance(out, Iterable):
        raise RewardError(f"reward function {name!r} returned a {type(out).__name__}; return a list of {n} floats "
                          "(or None to skip an image), one per image")
    values = list(out)
    if len(values) != n:
        raise RewardError(
            f"reward function {name!r} returned {len(values)} values for {n} images; return a list of floats, "
            "one (or None to skip) per image"
        )
    bad = [v for v in values if v is not None and not _is_number(v)]
    if bad:
        raise RewardError(f"reward function {name!r} returned non-numbers ({', '.join(repr(v) for v in bad[:3])}"
                          f"{', ...' if len(bad) > 3 else ''}); return a list of floats (or None to skip an image)")
    arr = [float("nan") if v is None else float(v) for v in values]
    n_inf = sum(math.isinf(v) for v in arr)
    n_big = sum(math.isfinite(v) and abs(v) > FLOAT32_MAX for v in arr)
    if n_inf:  # an infinite score is as unusable as none
        warnings.warn(f"reward function {name!r} returned inf for {n_inf} of {n} images: treated as no score for "
                      "them", RuntimeWarning, stacklevel=3)
    if n_big:  # infinite once in the float32 reward tensor: the same as inf
        warnings.warn(f"reward function {name!r} returned a value beyond float32's range (|r| > 3.4e38) for {n_big} "
                      f"of {n} images: treated as no score for them, like inf", RuntimeWarning, stacklevel=3)
    return [v if math.isfinite(v) and abs(v) <= FLOAT32_MAX else float("nan") for v in arr]


def _is_number(v) -> bool:
    if isinstance(v, torch.Tensor):
        return v.numel() == 1 and not v.dtype.is_complex
    return isinstance(v, numbers.Real)


def _copy_columns(columns: dict) -> dict:
    """A copy per reward call: lists stay lists, tensors (an editing run's ``source_image`` (B, 3, H, W)) stay
    tensors."""
    return {k: v.clone() if isinstance(v, torch.Tensor) else list(v) for k, v in columns.items()}


def compute_rewards(
    reward_funcs: list[RewardFunc],
    names: list[str],
    weights: list[float],
    images: torch.Tensor,
    prompts: list[str],
    columns: dict[str, list],
    timeout: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Call every reward and combine: ``r = sum_i w_i r_i`` over the rewards that scored the sample.

    Returns the combined rewards (B,) float32 (NaN where no reward scored the sample) and each reward (B,).
    A reward that raises or returns the wrong length raises a :class:`RewardError` naming it. With ``timeout``
    (seconds, the trainer's ``reward_timeout``), each reward runs in a daemon thread and one that has not returned
    in time raises a :class:`RewardError` naming it and the limit (the call is abandoned: it cannot be stopped).
    """
    n = len(prompts)
    per_func = {}
    for func, name in zip(reward_funcs, names):
        try:
            out = call_with_timeout(func, (images.clone(), list(prompts)), _copy_columns(columns), timeout)
        except CallTimeout:
            raise RewardError(
                f"reward function {name!r} did not return within reward_timeout={timeout:g} s (the call is left "
                "running in a background thread); if it is only slow, raise --reward_timeout (0 = no limit) or "
                "lower --per_device_reward_batch_size") from None
        except Exception as e:  # re-raise with the reward's name; nothing has been updated yet
            raise RewardError(f"reward function {name!r} raised {type(e).__name__}: {e}") from e
        per_func[name] = torch.tensor(call_scores(out, n, name), dtype=torch.float32)
    stacked = torch.stack([per_func[k] for k in names], dim=1)  # (B, F)
    w = torch.tensor(weights, dtype=torch.float32)
    valid = ~torch.isnan(stacked)
    total = torch.where(valid, stacked * w, torch.zeros_like(stacked)).sum(dim=1)
    overflow = valid.any(dim=1) & ~torch.isfinite(total)  # finite scores whose weighted sum float32 cannot hold
    if overflow.any():
        warnings.warn(f"rewards {names}: the weighted sum (reward_weights {weights}) is beyond float32's range for "
                      f"{int(overflow.sum())} of {n} images: treated as no score for them", RuntimeWarning,
                      stacklevel=2)
    total = torch.where(valid.any(dim=1) & ~overflow, total, torch.full_like(total, float("nan")))
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
