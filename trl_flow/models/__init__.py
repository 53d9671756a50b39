"""Pipeline adapters: the model-family-specific part of the library (prompt encoding, schedule, velocity, decode)."""

from .base import FlowAdapter, PromptEmbeds, Schedule, cat_embeds, index_embeds
from .flux import FluxAdapter
from .sd3 import SD3Adapter
from .wan import WanAdapter

_ADAPTERS = {"StableDiffusion3Pipeline": SD3Adapter, "FluxPipeline": FluxAdapter, "WanPipeline": WanAdapter}


def get_adapter(pipe, **options) -> FlowAdapter:
    """The adapter for a diffusers pipeline, chosen by the pipeline's class (or a base class) name; ``options`` go
    to the adapter (e.g. ``FluxAdapter``'s ``true_cfg_scale``). An adapter is returned as it is, so every trainer
    accepts a configured adapter in place of a pipeline."""
    if isinstance(pipe, FlowAdapter):
        if options:
            raise TypeError(f"get_adapter: got an adapter and options {sorted(options)}; set them on the adapter")
        return pipe
    for cls in type(pipe).__mro__:
        if cls.__name__ in _ADAPTERS:
            return _ADAPTERS[cls.__name__](pipe, **options)
    raise TypeError(
        f"pipe: no trl_flow adapter for {type(pipe).__name__}; supported pipelines: {sorted(_ADAPTERS)}"
    )


def load_pipeline(model_name_or_path: str, torch_dtype="float32", **kwargs):
    """Load a supported diffusers pipeline (a Hub id such as ``stabilityai/stable-diffusion-3.5-medium``,
    ``black-forest-labs/FLUX.1-dev`` or ``Wan-AI/Wan2.1-T2V-1.3B-Diffusers``, or a local folder) with
    ``DiffusionPipeline.from_pretrained`` and check that trl_flow has an adapter for it."""
    import torch
    from diffusers import DiffusionPipeline

    dtype = getattr(torch, torch_dtype) if isinstance(torch_dtype, str) else torch_dtype
    # Components saved as absent (e.g. an SD3 pipeline without T5: `"text_encoder_3": [null, null]`) must be
    # passed as None explicitly to from_pretrained.
    index = DiffusionPipeline.load_config(model_name_or_path)
    for name, value in index.items():
        if not name.startswith("_") and isinstance(value, (list, tuple)) and list(value) == [None, None]:
            kwargs.setdefault(name, None)
    pipe = DiffusionPipeline.from_pretrained(model_name_or_path, **{_dtype_keyword(): dtype}, **kwargs)
    get_adapter(pipe)  # fail early for an unsupported family
    return pipe


def _dtype_keyword() -> str:
    """``dtype`` where this diffusers' ``from_pretrained`` documents it (newer releases deprecate ``torch_dtype``
    with a FutureWarning on every load), else ``torch_dtype``."""
    import re

    from diffusers import DiffusionPipeline

    doc = DiffusionPipeline.from_pretrained.__doc__ or ""
    return "dtype" if re.search(r"^\s*dtype \(", doc, flags=re.M) else "torch_dtype"


__all__ = ["load_pipeline", "FlowAdapter", "FluxAdapter", "PromptEmbeds", "Schedule", "SD3Adapter", "WanAdapter",
           "get_adapter", "cat_embeds", "index_embeds"]
