"""Policy losses for one trained sampling step of a microbatch (B samples). Every input is (B,) float32."""

from __future__ import annotations

import torch


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over ``mask``; 0 (with a gradient path) when the mask is empty. Uses ``where`` so a non-finite
    masked-out value cannot leak into the result."""
    x = torch.where(mask, x, torch.zeros_like(x))
    return x.sum() / mask.sum().clamp_min(1)


def clipped_policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    clip_range: float,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO/GRPO clipped objective per sample: ``max(-A w rho, -A clip(rho, 1 - eps, 1 + eps))``.

    Args:
        log_prob: (B,) log-prob under the current policy (with grad). old_log_prob: (B,) frozen ``logp_old``.
        advantages: (B,). clip_range: ``eps``.
        weights: optional (B,) detached importance weights multiplying the unclipped term only (OP-GRPO).

    Returns:
        per-sample loss (B,) and per-sample stats: ``ratio``, ``clipped`` (|rho - 1| > eps), ``approx_kl``.
    """
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    if weights is not None:
        unclipped = unclipped * weights
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    loss = torch.maximum(unclipped, clipped)
    stats = {
        "ratio": ratio.detach(),
        "clipped": ((ratio.detach() - 1.0).abs() > clip_range).float(),
        "approx_kl": 0.5 * log_ratio.detach() ** 2,
    }
    return loss, stats
