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

import contextlib
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
    """The batch rows of a transformer call: its ``hidden_states`` (or, for a model whose latent input has another
    name, its first tensor argument)."""
    x = kwargs.get("hidden_states", args[0] if args else None)
    if not torch.is_tensor(x):
        x = next((v for v in (*args, *kwargs.values()) if torch.is_tensor(v)), None)
    return int(x.shape[0]) if isinstance(x, torch.Tensor) and x.ndim else 0


@contextlib.contextmanager
def count_forwards(pipe, trained_components):
    """Counts forward passes while the block runs: ``{"transformer": ..., "text_encoder": ...}`` (the trained
    transformer(s), every ``text_encoder*`` component), ``"transformer_rows"``: the latent rows the trained
    transformer(s) saw (the batch size of each call's ``hidden_states``, so a true-CFG call counts its conditional
    and unconditional rows), and ``"transformer_rows_grad"``: those of them forwarded with gradient enabled (the
    update's; MFU counts them 3x). The hooks are removed at the end."""
    calls = {"transformer": 0, "text_encoder": 0, "transformer_rows": 0, "transformer_rows_grad": 0}

    def seen(module, args, kwargs, kind):
        calls[kind] += 1
        if kind == "transformer":
            n = _rows(args, kwargs)
            calls["transformer_rows"] += n
            calls["transformer_rows_grad"] += n if torch.is_grad_enabled() else 0

    hooks = []
    for name, module in pipe.components.items():
        kind = "transformer" if name in trained_components else "text_encoder" if name.startswith(
            "text_encoder") else None
        if kind is not None and isinstance(module, torch.nn.Module):
            hooks.append(module.register_forward_pre_hook(lambda m, a, kw, k=kind: seen(m, a, kw, k),
                                                          with_kwargs=True))
    try:
        yield calls
    finally:
        for h in hooks:
            h.remove()


@torch.no_grad()
def flops_per_row(adapter, model, x, timestep, embeds, autocast) -> float:
    """FLOPs of one trained-transformer forward on one latent row: ``adapter.velocity`` on ``x`` (1, *L) unguided
    (guidance 0: one pass), counted by ``FlopCounterMode`` and divided by the rows the transformer saw."""
    from torch.utils.flop_counter import FlopCounterMode

    with count_forwards(adapter.pipe, adapter.trained_components()) as calls:
        with FlopCounterMode(display=False) as counter, autocast():
            adapter.velocity(model, x, timestep, embeds, 0.0)
    return counter.get_total_flops() / max(calls["transformer_rows"], 1)


def metrics(flops_row: float, rows_grad: int, rows_nograd: int, seconds: float, peak: float | None) -> dict:
    """``throughput/tflop`` (the iteration's model TFLOPs on this process), ``throughput/tflops`` (achieved, per
    process) and, where the peak is known, ``throughput/mfu``."""
    tflop = flops_row * (3 * rows_grad + rows_nograd) / 1e12
    out = {"throughput/tflop": tflop, "throughput/tflops": tflop / max(seconds, 1e-9)}
    if peak:
        out["throughput/mfu"] = out["throughput/tflops"] / peak
    return out
