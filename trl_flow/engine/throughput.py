"""Achieved TFLOPS and model FLOPs utilisation (MFU) of an iteration, after verl-omni's docs/perf/diffusion_mfu.md.

Model FLOPs: one forward of the trained transformer on one latent row is counted once with
``torch.utils.flop_counter.FlopCounterMode`` (:func:`flops_per_row`, on the first iteration's rollout: a one-row
probe at the training size). An iteration's FLOPs are then that count times the rows the transformer saw: rows
forwarded without gradient (sampling, reference passes) count 1x, rows forwarded with gradient (the update) 3x (the
backward is ~2x the forward). Recomputation (gradient checkpointing) is not model FLOPs and is not counted; text
encoders and VAE are left out (their share is small and they do not scale with the steps).

MFU = achieved TFLOPS / the device's dense bf16 peak (:data:`PEAK_TFLOPS`, or the ``peak_tflops`` field). A CPU or
an unknown device logs TFLOPS only.
"""

from __future__ import annotations

import re

import torch

#: Dense (no sparsity) bf16 tensor-core peaks, TFLOPS, matched in order against ``torch.cuda.get_device_name``.
#: Vendor datasheets give the sparse figure with an asterisk; dense is half of it:
#: NVIDIA H100 Tensor Core GPU datasheet: BF16 1,979 (SXM), 1,671 (NVL), 1,513 (PCIe) sparse;
#: NVIDIA H200 datasheet: BF16 1,979 (SXM), 1,671 (NVL) sparse; NVIDIA A100 datasheet: BF16 312 dense;
#: NVIDIA L40S datasheet: BF16 362.05 dense; L40 datasheet: 181.05 dense; L4 datasheet: 242 sparse;
#: A10 datasheet: BF16 125 dense; B200 (HGX B200 datasheet): FP16/BF16 4.5 PFLOPS sparse; H20: 148 dense.
PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    (r"H200 NVL", 835.0),
    (r"H200", 989.0),
    (r"H100 NVL", 835.0),
    (r"H100 PCIe", 756.0),
    (r"H100", 989.0),
    (r"H20\b", 148.0),
    (r"B200", 2250.0),
    (r"A100", 312.0),
    (r"L40S", 362.0),
    (r"L40\b", 181.0),
    (r"L4\b", 121.0),
    (r"A10\b", 125.0),
)


def peak_tflops_for(name: str) -> float | None:
    """The dense bf16 peak of a device named ``name`` (``torch.cuda.get_device_name``), or None if unknown."""
    for pattern, peak in PEAK_TFLOPS:
        if re.search(pattern, name):
            return peak
    return None


def device_peak_tflops(device, override: float | None = None) -> float | None:
    """``override`` (the ``peak_tflops`` field) if set, else the table's peak of a CUDA ``device``; None on a CPU or
    an unknown GPU."""
    if override is not None:
        return float(override)
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return peak_tflops_for(torch.cuda.get_device_name(device))


def _rows(args, kwargs) -> int:
    x = kwargs.get("hidden_states", args[0] if args else None)
    return int(x.shape[0]) if isinstance(x, torch.Tensor) and x.ndim else 0


def count_rows(modules, counts: dict) -> list:
    """Forward pre-hooks adding each call's batch rows (``hidden_states`` or the first argument) to
    ``counts["rows_grad"]`` (gradient enabled) or ``counts["rows_nograd"]``. Returns the hook handles."""

    def hook(module, args, kwargs):
        key = "rows_grad" if torch.is_grad_enabled() else "rows_nograd"
        counts[key] = counts.get(key, 0) + _rows(args, kwargs)

    return [m.register_forward_pre_hook(hook, with_kwargs=True) for m in modules]


@torch.no_grad()
def flops_per_row(adapter, model, x, timestep, embeds, autocast) -> float:
    """FLOPs of one trained-transformer forward on one latent row: ``adapter.velocity`` on ``x`` (1, *L) unguided
    (guidance 0: one pass), counted by ``FlopCounterMode`` and divided by the rows the transformer saw."""
    from torch.utils.flop_counter import FlopCounterMode

    counts: dict = {}
    hooks = count_rows([getattr(adapter.pipe, n) for n in adapter.trained_components()], counts)
    try:
        with FlopCounterMode(display=False) as counter, autocast():
            adapter.velocity(model, x, timestep, embeds, 0.0)
    finally:
        for h in hooks:
            h.remove()
    rows = counts.get("rows_nograd", 0) + counts.get("rows_grad", 0)
    return counter.get_total_flops() / max(rows, 1)


def metrics(flops_row: float, rows_grad: int, rows_nograd: int, seconds: float, peak: float | None) -> dict:
    """``throughput/tflop`` (the iteration's model TFLOPs on this process), ``throughput/tflops`` (achieved, per
    process) and, where the peak is known, ``throughput/mfu``."""
    tflop = flops_row * (3 * rows_grad + rows_nograd) / 1e12
    out = {"throughput/tflop": tflop, "throughput/tflops": tflop / max(seconds, 1e-9)}
    if peak:
        out["throughput/mfu"] = out["throughput/tflops"] / peak
    return out
