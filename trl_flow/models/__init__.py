"""Pipeline adapters: the model-family-specific part of the library (prompt encoding, schedule, velocity, decode)."""

from .base import FlowAdapter, PromptEmbeds, Schedule, cat_embeds, index_embeds
from .sd3 import SD3Adapter

_ADAPTERS = {"StableDiffusion3Pipeline": SD3Adapter}


def get_adapter(pipe) -> FlowAdapter:
    """The adapter for a diffusers pipeline, chosen by the pipeline's class (or a base class) name."""
    for cls in type(pipe).__mro__:
        if cls.__name__ in _ADAPTERS:
            return _ADAPTERS[cls.__name__](pipe)
    raise TypeError(
        f"pipe: no trl_flow adapter for {type(pipe).__name__}; supported pipelines: {sorted(_ADAPTERS)}"
    )


__all__ = ["FlowAdapter", "PromptEmbeds", "Schedule", "SD3Adapter", "get_adapter", "cat_embeds", "index_embeds"]
