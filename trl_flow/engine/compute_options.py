"""Set-up options that change how the trained transformer(s) compute, not what: the attention backend and regional
compilation. Applied by :func:`~trl_flow.engine.model_setup.setup_model` to every trained component
(:meth:`~trl_flow.models.FlowAdapter.trained_components`).
"""

from __future__ import annotations

import torch

#: Backends that run on a CPU (diffusers' AttentionBackendName values); every other one needs an accelerator.
CPU_BACKENDS = ("native", "_native_math", "flex")


def attention_backends() -> list[str]:
    """The names diffusers' ``set_attention_backend`` accepts (``AttentionBackendName``)."""
    from diffusers.models.attention_dispatch import AttentionBackendName

    return [b.value for b in AttentionBackendName]


def check_attention_backend_name(name: str | None) -> str | None:
    """The error message for an unknown ``attention_backend`` name, or None (a known name, or None)."""
    if name is None:
        return None
    valid = attention_backends()
    if name not in valid:
        return f"unknown backend; one of {valid} (diffusers AttentionBackendName), or None for the pipeline's own"
    return None


def set_attention_backend(adapter, name: str | None, device) -> None:
    """``transformer.set_attention_backend(name)`` on every trained component; ``ValueError`` naming
    ``attention_backend`` when the backend cannot run here (a missing package, or a GPU-only backend on a CPU)."""
    if name is None:
        return
    from diffusers.models.attention_dispatch import AttentionBackendName, _check_attention_backend_requirements

    device = torch.device(device)
    if device.type == "cpu" and name not in CPU_BACKENDS:
        raise ValueError(f"attention_backend={name!r}: needs an accelerator, this run is on the CPU; use one of "
                         f"{list(CPU_BACKENDS)} or None")
    try:
        _check_attention_backend_requirements(AttentionBackendName(name))
    except RuntimeError as e:
        raise ValueError(f"attention_backend={name!r}: not usable on this machine ({e}); pick another or None") from e
    for component in adapter.trained_components():
        module = getattr(adapter.pipe, component)
        if not callable(getattr(module, "set_attention_backend", None)):
            raise ValueError(f"attention_backend={name!r}: pipe.{component} ({type(module).__name__}) has no "
                             "set_attention_backend (a diffusers ModelMixin method); leave it None")
        module.set_attention_backend(name)


def repeated_block_names(module) -> list[str]:
    """Class names of ``module``'s repeated blocks: its ``_repeated_blocks`` (diffusers), else the classes of its
    ``transformer_blocks`` / ``single_transformer_blocks`` / ``blocks`` lists (SD3's ``_repeated_blocks`` is empty in
    diffusers 0.42)."""
    names = list(getattr(module, "_repeated_blocks", None) or [])
    if not names:
        for attr in ("transformer_blocks", "single_transformer_blocks", "blocks"):
            blocks = getattr(module, attr, None)
            if isinstance(blocks, torch.nn.ModuleList):
                names += sorted({type(b).__name__ for b in blocks} - set(names))
    return names


def compile_repeated_blocks(adapter) -> int:
    """``torch.compile`` each repeated block (``nn.Module.compile``, in place) of every trained component, as
    diffusers' ``ModelMixin.compile_repeated_blocks``. Returns the number of blocks compiled."""
    count = 0
    for component in adapter.trained_components():
        module = getattr(adapter.pipe, component)
        names = repeated_block_names(module)
        blocks = [m for m in module.modules() if type(m).__name__ in names]
        if not blocks:
            raise ValueError(f"compile_repeated_blocks=True: pipe.{component} ({type(module).__name__}) has no "
                             "repeated blocks to compile; set it to False")
        for block in blocks:
            block.compile()
        count += len(blocks)
    return count
