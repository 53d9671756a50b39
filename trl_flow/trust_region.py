"""The divergence trust region of Flow-DPPO (arXiv 2606.11025): a KL mask instead of a ratio clip.

Per trained step of one microbatch (B samples), with the frozen old kernel ``N(mu_old, std^2)`` and the current one
``N(mu_theta, std^2)``:

* ``D = ||mu_old - mu_theta||^2 / (2 std^2)``, mean-reduced over the latent dims (:func:`old_policy_kl`), as the
  authors' released code computes it; the published thresholds ``delta`` assume this form.
* ``M = 0`` iff ``D > delta`` and the update moves away from the old policy in the advantage's direction
  (``A > 0 and rho > 1`` or ``A < 0 and rho < 1``); otherwise ``M = 1`` (:func:`kl_mask`). Detached.
* loss per sample ``-M w rho A`` (:func:`kl_masked_policy_loss`): no min, no clip. ``w`` is an optional detached
  importance weight (OP-GRPO); it multiplies the kept term, as it multiplies the whole clipped objective of the
  ratio clip.

The ratio clip itself is :func:`trl_flow.losses.clipped_policy_loss`.
"""

from __future__ import annotations

import torch

from .kernels import gaussian_kl

TRUST_REGIONS = ("clip", "kl_mask")
KL_MASK_MODES = ("asymmetric", "symmetric")
#: Default delta for the mean-reduced old-vs-new KL, every kernel: the authors' released Flow-DPPO code (1e-5, same
#: mean-reduced exact-KL form as ours). The project follows the reference code where code and write-up differ.
DEFAULT_KL_MASK_DELTA = 1e-5
#: The write-up's per-kernel values (unverified against the code; pass them as `kl_mask_delta` to use them).
PAPER_KL_MASK_DELTAS = {"flow_sde": 1e-7, "cps": 1e-6}


def old_policy_kl(old_mean: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Detached exact KL(N(old_mean, std^2) || N(mean, std^2)), mean-reduced -> (B,).

    Args:
        old_mean: (B, *L) the frozen behaviour mean ``mu_old``. mean: (B, *L) the current mean ``mu_theta``.
        std: the kernel's full std (``flow_sde``: including ``sqrt(-dt)``), broadcastable to (B, *L).
    """
    return gaussian_kl(old_mean.detach(), mean.detach(), std.detach(), reduction="mean")


def kl_mask(
    kl: torch.Tensor, log_ratio: torch.Tensor, advantages: torch.Tensor, delta: float, mode: str = "asymmetric"
) -> torch.Tensor:
    """(B,) bool ``M``: True where the sample's term is kept. All inputs (B,) and treated as detached.

    ``asymmetric`` (Flow-DPPO): blocked iff ``kl > delta`` and ``sign(log_ratio) == sign(A) != 0``, so a step back
    toward the old policy (or ``A == 0``, or ``rho == 1``) is never blocked. ``symmetric`` (ablation only; the
    paper reports that training collapses with it): blocked iff ``kl > delta``.
    """
    kl, log_ratio, advantages = kl.detach(), log_ratio.detach(), advantages.detach()
    outside = kl > delta
    if mode == "symmetric":
        return ~outside
    if mode != "asymmetric":
        raise ValueError(f"kl_mask_mode must be one of {KL_MASK_MODES}, got {mode!r}")
    away = ((advantages > 0) & (log_ratio > 0)) | ((advantages < 0) & (log_ratio < 0))
    return ~(outside & away)


def kl_masked_policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    kl: torch.Tensor,
    delta: float,
    weights: torch.Tensor | None = None,
    mode: str = "asymmetric",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Flow-DPPO's objective per sample: ``-M w rho A`` with ``M = kl_mask(...)``.

    Args:
        log_prob: (B,) log-prob under the current policy (with grad). old_log_prob: (B,) frozen ``logp_old``.
        advantages: (B,). kl: (B,) old-vs-new KL of the step (:func:`old_policy_kl`). delta: the threshold.
        weights: optional (B,) detached importance weights multiplying the kept term (OP-GRPO).
        mode: ``"asymmetric"`` (Flow-DPPO) or ``"symmetric"`` (ablation).

    Returns:
        per-sample loss (B,) and per-sample stats: ``ratio``, ``mask_frac`` (1 where blocked),
        ``mask_frac_pos_adv`` / ``mask_frac_neg_adv`` (the same, NaN outside ``A > 0`` / ``A < 0``) and ``kl_old``.

    A blocked sample contributes exactly 0 to the loss and to the gradient, even where its ratio overflows: its
    log-ratio is replaced by 0 before the ``exp`` (``where``, never ``inf * 0``).
    """
    log_ratio = log_prob - old_log_prob
    keep = kl_mask(kl, log_ratio, advantages, delta, mode)
    ratio = torch.exp(torch.where(keep, log_ratio, torch.zeros_like(log_ratio)))
    term = -advantages * ratio
    if weights is not None:
        term = term * weights
    loss = torch.where(keep, term, torch.zeros_like(term))
    blocked = (~keep).float()
    nan = torch.full_like(blocked, float("nan"))
    stats = {
        "ratio": torch.exp(log_ratio.detach()),
        "mask_frac": blocked,
        "mask_frac_pos_adv": torch.where(advantages > 0, blocked, nan),
        "mask_frac_neg_adv": torch.where(advantages < 0, blocked, nan),
        "kl_old": kl.detach(),
    }
    return loss, stats
