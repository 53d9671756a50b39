"""Advantages: group-relative reward normalisation (GRPO).

All functions take the rewards of the whole gathered batch (every process), so group statistics are exact even
when a group is split across processes.
"""

from __future__ import annotations

import torch

SCALE_REWARDS = ("group", "batch", "none")


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    scale_rewards: str = "group",
    eps: float = 1e-4,
    clip: float | None = 5.0,
    baseline: torch.Tensor | None = None,
) -> torch.Tensor:
    """``A_i = (r_i - mean_group) / (std + eps)``, clipped to ``+-clip``.

    Args:
        rewards: (N,) rewards, NaN for a sample without a reward (its advantage is 0; it is left out of every
            statistic).
        group_ids: (N,) group of each sample.
        scale_rewards: ``"group"`` (std over the group), ``"batch"`` (std over the whole batch) or ``"none"``
            (only centre). Stds are population stds (``unbiased=False``) as in the reference code.
        baseline: optional (N,) bool, the samples whose rewards make the statistics (group mean and std, batch
            std); every valid sample still gets an advantage against them. Default: all valid samples. A group
            with no baseline sample gets advantage 0.

    Returns:
        (N,) float32 advantages.
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}")
    r = rewards.float()
    valid = ~torch.isnan(r)
    base = valid if baseline is None else valid & baseline.to(valid.device).bool()
    adv = torch.zeros_like(r)
    batch_std = r[base].std(unbiased=False) if base.sum() > 1 else torch.tensor(0.0)
    for g in torch.unique(group_ids):
        m = (group_ids == g) & valid
        b = (group_ids == g) & base
        if b.sum() == 0:
            continue
        centred = r[m] - r[b].mean()
        if scale_rewards == "group":
            std = r[b].std(unbiased=False)
            if baseline is not None and std < eps:
                std = r[m].std(unbiased=False)
            centred = centred / (std + eps)
        elif scale_rewards == "batch":
            centred = centred / (batch_std + eps)
        adv[m] = centred
    if clip is not None:
        adv = adv.clamp(-clip, clip)
    return adv


def normalize_jointly(values: torch.Tensor, valid: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-4):
    """Normalise (N, K) per-step values jointly over all (sample, step) pairs of each group.

    Args:
        values: (N, K) e.g. per-step gains. valid: (N, K) bool, the pairs that count.
    Returns:
        (N, K) float32, 0 where not valid.
    """
    out = torch.zeros_like(values, dtype=torch.float32)
    for g in torch.unique(group_ids):
        rows = group_ids == g
        m = valid & rows[:, None]
        if m.sum() == 0:
            continue
        sel = values[m].float()
        out[m] = (sel - sel.mean()) / (sel.std(unbiased=False) + eps)
    return out
