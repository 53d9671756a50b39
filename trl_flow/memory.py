"""Memory options: offloading the frozen text encoders and VAE between phases, and quantised base models.

``offload="model"`` keeps the text encoders and the VAE in CPU memory and moves each to the accelerator only for
its phase (prompt encoding, decoding); the transformer, its LoRA and the optimizer stay on the device. Results are
unchanged (the same modules compute the same values, only their placement changes between calls).

A base model quantised by diffusers / transformers (``BitsAndBytesConfig``, ``PipelineQuantizationConfig``:
QLoRA style) keeps its storage dtype: the trainer never casts it (diffusers refuses to), trains a float32 LoRA on
top, and refuses full fine-tuning of it. bitsandbytes quantisation is accepted on CUDA devices only.
"""

from __future__ import annotations

import contextlib
import importlib.util
import threading

import torch

OFFLOAD_MODES = ("none", "model")


def quantization_method(module) -> str | None:
    """The quantisation method of a diffusers / transformers model (``"bitsandbytes"``, ``"gguf"``, ...), or None
    if it is not quantised. Reads the attributes those libraries set on a quantised model."""
    quantizer = getattr(module, "hf_quantizer", None)
    config = getattr(quantizer, "quantization_config", None) or getattr(module, "quantization_config", None)
    if config is None:
        mcfg = getattr(module, "config", None)
        config = (mcfg.get("quantization_config") if isinstance(mcfg, dict)
                  else getattr(mcfg, "quantization_config", None))
    if config is None and not getattr(module, "is_quantized", False) and quantizer is None:
        return None
    method = config.get("quant_method") if isinstance(config, dict) else getattr(config, "quant_method", None)
    method = getattr(method, "value", method)
    return str(method) if method else "unknown"


def is_quantized(module) -> bool:
    return quantization_method(module) is not None


def check_quantized(pipe, config, device) -> None:
    """Before any set-up: errors for quantised components the trainer cannot handle, and for 8-bit AdamW without
    bitsandbytes."""
    for name, module in pipe.components.items():
        if not isinstance(module, torch.nn.Module):
            continue
        method = quantization_method(module)
        if method is None:
            continue
        if name == "transformer" and config.finetune == "full":
            raise ValueError(f"finetune='full': pipe.transformer is quantised ({method}) and cannot be trained "
                             "directly; use finetune='lora' (QLoRA) or load the transformer unquantised")
        if method.startswith("bitsandbytes"):
            if importlib.util.find_spec("bitsandbytes") is None:
                raise ImportError(f"pipe.{name} is quantised with bitsandbytes, which is not installed: "
                                  "pip install bitsandbytes")
            if torch.device(device).type != "cuda":
                raise ValueError(f"pipe.{name} is quantised with bitsandbytes, which trl_flow supports on CUDA GPUs "
                                 f"only (this process runs on {device}); load it without quantization_config here")
    if config.optim == "adamw_8bit" and importlib.util.find_spec("bitsandbytes") is None:
        raise ImportError("optim='adamw_8bit' needs bitsandbytes: pip install bitsandbytes (or optim='adamw_torch')")


class Offloader:
    """Placement of the frozen pipeline components for ``offload`` = ``"none"`` | ``"model"`` (see module doc)."""

    def __init__(self, pipe, mode: str, device):
        if mode not in OFFLOAD_MODES:
            raise ValueError(f"offload={mode!r}: must be one of {OFFLOAD_MODES}")
        self.pipe, self.mode, self.device = pipe, mode, torch.device(device)
        self.offloaded = [n for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)
                          and (n.startswith("text_encoder") or n == "vae")] if mode == "model" else []
        self._users = {n: 0 for n in self.offloaded}  # reward_num_workers decode from several threads at once
        self._lock = threading.Lock()

    def place(self) -> None:
        """Move every module to the device, except the offloaded ones, which go to the CPU."""
        if not self.offloaded:
            self.pipe.to(self.device)
            return
        for name, module in self.pipe.components.items():
            if isinstance(module, torch.nn.Module):
                module.to("cpu" if name in self.offloaded else self.device)

    @contextlib.contextmanager
    def use(self, *prefixes: str):
        """Bring the offloaded modules whose name starts with one of ``prefixes`` to the device for the block (they
        go back to the CPU when the last thread using them leaves)."""
        names = [n for n in self.offloaded if n.startswith(prefixes)]
        with self._lock:
            for n in names:
                self._users[n] += 1
                if self._users[n] == 1:
                    self.pipe.components[n].to(self.device)
        try:
            yield
        finally:
            with self._lock:
                for n in names:
                    self._users[n] -= 1
                    if self._users[n] == 0:
                        self.pipe.components[n].to("cpu")
