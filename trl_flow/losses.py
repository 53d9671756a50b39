"""Policy losses for one trained sampling step of a microbatch (B samples). Every input is (B,) float32."""

from __future__ import annotations

import torch


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over ``mask``; 0 (with a gradient path) when the mask is empty. Uses ``where`` so a non-finite
    masked-out value cannot leak into the result."""
    x = torch.where(mask, x, torch.zeros_like(x))
    return x.sum() / mask.sum().clamp_min(1)


#: Where an importance weight ``w`` enters the clipped objective (:func:`clipped_policy_loss`).
WEIGHT_PLACEMENTS = ("objective", "unclipped_term")


def clipped_policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    clip_range: float,
    weights: torch.Tensor | None = None,
    weight_placement: str = "objective",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO/GRPO clipped objective per sample: ``max(-A rho, -A clip(rho, 1 - eps, 1 + eps))``.

    Args:
        log_prob: (B,) log-prob under the current policy (with grad). old_log_prob: (B,) frozen ``logp_old``.
        advantages: (B,). clip_range: ``eps``.
        weights: optional (B,) detached, positive importance weights ``w`` (OP-GRPO's sequence-level correction).
        weight_placement: ``"objective"`` (default; OP-GRPO, arXiv 2604.04142: ``w`` is "a multiplicative factor
            on the objective", ``w * max(-A rho, -A clip(rho))``, so inside the trust region the gradient with
            respect to ``rho`` is ``-A w`` for both signs of ``A`` and outside it is 0, as without ``w``) or
            ``"unclipped_term"`` (ABLATION: ``max(-A w rho, -A clip(rho))``; inside the trust region this acts like
            ``min(w, 1)`` for ``A > 0`` and ``max(w, 1)`` for ``A < 0``, and once ``|log w| > eps`` it moves the clip
            boundary to ``(1 +- eps) / w``).

    Returns:
        per-sample loss (B,) and per-sample stats: ``ratio``, ``clipped`` (|rho - 1| > eps), ``clip_active`` (the
        clipped branch strictly wins the max, with ``w`` where it stands: for ``objective`` the sample has no
        gradient; for ``unclipped_term`` its ``w`` has no effect),
        ``approx_kl``.
    """
    if weight_placement not in WEIGHT_PLACEMENTS:
        raise ValueError(f"weight_placement must be one of {WEIGHT_PLACEMENTS}, got {weight_placement!r}")
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    if weights is not None and weight_placement == "unclipped_term":
        unclipped = unclipped * weights
    loss = torch.maximum(unclipped, clipped)
    active = (clipped.detach() > unclipped.detach()).float()
    if weights is not None and weight_placement == "objective":
        loss = weights * loss
    stats = {
        "ratio": ratio.detach(),
        "clipped": ((ratio.detach() - 1.0).abs() > clip_range).float(),
        "clip_active": active,
        "approx_kl": 0.5 * log_ratio.detach() ** 2,
    }
    return loss, stats
