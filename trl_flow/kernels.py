"""Gaussian transition kernels of a rectified-flow sampler (torch only, no diffusers import).

Rectified flow: ``x_s = (1 - s) x0 + s eps``; the model predicts the velocity ``v ~ eps - x0``. One sampling step
moves ``x`` at noise level ``s = sigma`` to ``x'`` at ``s' = sigma_next < s`` (``dt = s' - s < 0``). Every kernel
here is Gaussian, ``x' ~ N(mean(x, v), std^2 I)``, so the log-probability of a stored transition, the PPO ratio and
the exact KL between two policies are closed-form.

=============  ====================================  ===============================================
sampler        std                                   mean
=============  ====================================  ===============================================
``flow_sde``   ``a sqrt(s / (1 - s)) sqrt(-dt)``      ``x (1 + a^2 s/(1-s) dt / (2s)) + v (1 + a^2 (1-s)/(2s) s/(1-s))
dt``
``cps``        ``s' sin(a pi / 2)``                  ``(1 - s') x0hat + sqrt(s'^2 - std^2) x1hat``
``ddim``       ``eta s' sqrt(1 - s)``                same as ``cps``
``ode``        ``0``                                 ``x + v dt`` (the diffusers Euler step)
=============  ====================================  ===============================================

with ``x0hat = x - s v`` and ``x1hat = x + (1 - s) v``. ``flow_sde`` is Flow-GRPO's SDE (arXiv 2505.05470; at
``s = 1`` the ``1 - s`` in the denominator uses ``s'`` instead), ``cps`` is Coefficients-Preserving Sampling
(arXiv 2509.05952), ``ddim`` is the kernel of Stepwise-Flow-GRPO (arXiv 2603.28718).

A step whose ``std`` is 0 (``ode``, the first ``ddim`` step, the last ``cps``/``ddim`` step) has no density: its
log-prob is returned as 0 and such a step must never be trained (the trainers mask ``std > 0``).
Everything is computed in float32 whatever the dtype of ``x`` and ``v``.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

SAMPLERS = ("flow_sde", "cps", "ddim", "ode")
#: The ``1 - s`` in flow_sde's std where ``s`` is (near) 1: ``next_sigma`` uses ``s'`` at ``s = 1`` (Flow-GRPO's
#: ``sd3_sde_with_logprob.py``, UniRL's rollout kernel); ``clamp`` uses ``1 - min(s, 0.99)`` at every step (UniRL's
#: Flow-DPPO loss, ``unirl/algorithms/flowdppo.py`` ``_compute_sigma_t``).
FIRST_STEP_STDS = ("next_sigma", "clamp")
REDUCTIONS = ("mean", "sum")
KL_FORMS = ("reference", "exact")
_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)

Sampler = Literal["flow_sde", "cps", "ddim", "ode"]


def _as_level(value, ref: torch.Tensor) -> torch.Tensor:
    """A noise level (float, 0-d or (B,) tensor) as a float32 tensor broadcastable to ``ref`` (B, ...)."""
    t = torch.as_tensor(value, dtype=torch.float32, device=ref.device)
    if t.ndim == 1:
        t = t.view(-1, *([1] * (ref.ndim - 1)))
    return t


def _reduce(x: torch.Tensor, reduction: str) -> torch.Tensor:
    dims = tuple(range(1, x.ndim))
    if reduction == "mean":
        return x.mean(dim=dims)
    if reduction == "sum":
        return x.sum(dim=dims)
    raise ValueError(f"logprob_reduction must be one of {REDUCTIONS}, got {reduction!r}")


def flow_sde_std(sigma, sigma_next, noise_level: float, first_step: str = "next_sigma",
                 ref: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """flow_sde's ``(std_dev_t^2, std)``: ``std_dev_t^2 = a^2 s / (1 - s~)``, ``std = std_dev_t sqrt(-dt)``.

    ``first_step`` (:data:`FIRST_STEP_STDS`) says what ``s~`` is: ``next_sigma`` (default): ``s`` except ``s'`` at
    ``s = 1``; ``clamp``: ``min(s, 0.99)``. At step 0 of SD3.5's 10-step schedule (diffusers, ``s' = 0.960``)
    ``clamp``'s std is 2.00x ``next_sigma``'s (1.89x on UniRL's own, ``s' = 0.964``); they agree where
    ``s <= 0.99``. Levels as in :func:`kernel_mean_std` (``ref``: the tensor they broadcast to; default: 0-d or (B,)
    as given)."""
    ref = torch.zeros(()) if ref is None else ref
    s = _as_level(sigma, ref)
    s_next = _as_level(sigma_next, ref)
    if first_step == "next_sigma":
        # sigma = 1 would divide by zero: use s' in the denominator there (as the reference code uses sigmas[1]).
        denom = 1 - torch.where(s == 1, s_next, s)
    elif first_step == "clamp":
        denom = 1 - s.clamp(max=0.99)
    else:
        raise ValueError(f"first_step must be one of {FIRST_STEP_STDS}, got {first_step!r}")
    var_t = noise_level**2 * s / denom  # std_dev_t^2 = a^2 s / (1 - s)
    return var_t, torch.sqrt(var_t) * torch.sqrt(s - s_next)


def kernel_mean_std(
    sampler: str, x: torch.Tensor, v: torch.Tensor, sigma, sigma_next, noise_level: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean (B, ...) and std (broadcastable to x: 0-d or (B, 1, ...)) of one transition kernel, in float32."""
    x = x.float()
    v = v.float()
    s = _as_level(sigma, x)
    s_next = _as_level(sigma_next, x)
    dt = s_next - s
    if sampler == "ode":
        return x + dt * v, torch.zeros_like(s_next)
    if sampler == "flow_sde":
        var_t, std = flow_sde_std(sigma, sigma_next, noise_level, ref=x)
        mean = x * (1 + var_t / (2 * s) * dt) + v * (1 + var_t * (1 - s) / (2 * s)) * dt
        return mean, std
    if sampler in ("cps", "ddim"):
        if sampler == "cps":
            std = s_next * math.sin(noise_level * math.pi / 2)
        else:
            std = noise_level * s_next * torch.sqrt(1 - s)
        x0hat = x - s * v
        x1hat = x + (1 - s) * v
        mean = (1 - s_next) * x0hat + torch.sqrt((s_next**2 - std**2).clamp_min(0)) * x1hat
        return mean, std
    raise ValueError(f"sampler must be one of {SAMPLERS}, got {sampler!r}")


def gaussian_log_prob(
    sample: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, reduction: str = "mean"
) -> torch.Tensor:
    """log N(sample; mean, std^2 I), reduced over the non-batch dims -> (B,). Where ``std == 0`` it returns 0."""
    sample = sample.float()
    positive = std > 0
    safe_std = torch.where(positive, std, torch.ones_like(std))
    lp = -((sample - mean) ** 2) / (2 * safe_std**2) - torch.log(safe_std) - _LOG_SQRT_2PI
    lp = torch.where(positive, lp, torch.zeros_like(lp))
    return _reduce(lp, reduction)


def sde_step(
    sampler: str,
    x: torch.Tensor,
    v: torch.Tensor,
    sigma,
    sigma_next,
    noise_level: float,
    prev_sample: torch.Tensor | None = None,
    generator: torch.Generator | list[torch.Generator] | None = None,
    logprob_reduction: str = "mean",
):
    """One transition ``x (at sigma) -> x' (at sigma_next)``.

    Args:
        sampler: ``"flow_sde" | "cps" | "ddim" | "ode"``.
        x: (B, ...) current state. v: (B, ...) predicted velocity (any float dtype).
        sigma, sigma_next: float, 0-d or (B,) noise levels, ``sigma_next < sigma``.
        noise_level: ``a`` (flow_sde, cps) or ``eta`` (ddim); ignored by ``ode``.
        prev_sample: (B, ...) if given, the transition is scored instead of sampled.
        generator: a ``torch.Generator`` for the Gaussian noise when sampling, or a list of B (row i's noise from
            generator i).
        logprob_reduction: ``"mean"`` (reference implementations) or ``"sum"`` over non-batch dims.

    Returns:
        ``(prev_sample (B, ...), log_prob (B,), mean (B, ...), std)``, all float32; ``std`` broadcasts to ``x``.
    """
    mean, std = kernel_mean_std(sampler, x, v, sigma, sigma_next, noise_level)
    if prev_sample is None:
        if sampler == "ode" or not bool((std > 0).any()):
            prev_sample = mean
        else:
            if isinstance(generator, (list, tuple)):
                noise = torch.stack([torch.randn(mean.shape[1:], generator=g, device=g.device, dtype=torch.float32)
                                     .to(mean.device) for g in generator])
            else:
                device = generator.device if generator is not None else mean.device
                noise = torch.randn(mean.shape, generator=generator, device=device, dtype=torch.float32)
            prev_sample = mean + std * noise.to(mean.device)
    prev_sample = prev_sample.float()
    log_prob = gaussian_log_prob(prev_sample, mean, std, logprob_reduction)
    return prev_sample, log_prob, mean, std


def gaussian_kl(
    mean_a: torch.Tensor, mean_b: torch.Tensor, std: torch.Tensor, reduction: str = "mean"
) -> torch.Tensor:
    """Exact KL(N(mean_a, std^2) || N(mean_b, std^2)) = ||mean_a - mean_b||^2 / (2 std^2), reduced -> (B,).

    Zero where ``std == 0`` (no density there; such steps are never trained).
    """
    positive = std > 0
    safe_std = torch.where(positive, std, torch.ones_like(std))
    kl = (mean_a.float() - mean_b.float()) ** 2 / (2 * safe_std**2)
    kl = torch.where(positive, kl, torch.zeros_like(kl))
    return _reduce(kl, reduction)


def reference_kl(
    sampler: str,
    mean: torch.Tensor,
    ref_mean: torch.Tensor,
    std: torch.Tensor,
    sigma,
    sigma_next,
    form: str = "reference",
    reduction: str = "mean",
) -> torch.Tensor:
    """KL penalty of one step between the policy's kernel and the reference policy's, -> (B,).

    ``form="exact"`` is :func:`gaussian_kl`. ``form="reference"`` is what the Flow-GRPO reference code
    (``scripts/train_sd3.py``) computes and what its published ``beta`` values were tuned with: for ``flow_sde`` it
    divides ``||mu - mu_ref||^2`` by ``2 a^2 s / (1 - s)``, i.e. without the ``sqrt(-dt)`` of the kernel's std, so
    it equals the exact KL times ``|dt| = sigma - sigma_next``. For ``cps`` the reference divides by the kernel's
    own std (the forms agree); ``ddim`` has no reference code, so both forms are the exact KL.
    """
    if form not in KL_FORMS:
        raise ValueError(f"kl_form must be one of {KL_FORMS}, got {form!r}")
    kl = gaussian_kl(mean, ref_mean, std, reduction)
    if form == "reference" and sampler == "flow_sde":
        dt = torch.as_tensor(sigma, dtype=torch.float32) - torch.as_tensor(sigma_next, dtype=torch.float32)
        kl = kl * dt.to(kl.device).reshape(-1)  # 0-d or (B,) levels
    return kl
