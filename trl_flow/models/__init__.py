"""Pipeline adapters: the model-family-specific part of the library (prompt encoding, schedule, velocity, decode)."""

from .base import FlowAdapter, PromptEmbeds, Schedule, cat_embeds, index_embeds
from .flux import FluxAdapter
from .sd3 import SD3Adapter
from .wan import WanAdapter
from .loading import _INDEX_KWARGS

GUIDE = "docs/adding_a_model.md"
ENTRY_POINT_GROUP = "trl_flow.adapters"

# pipeline class name -> adapter class, or "module:Class" (a module of this package, imported when first needed)
_ADAPTERS: dict[str, type | str] = {
    "StableDiffusion3Pipeline": SD3Adapter,
    "FluxPipeline": FluxAdapter,
    "WanPipeline": WanAdapter,  # Wan2.1 and Wan2.2 (two experts, expand_timesteps)
    "QwenImagePipeline": ".qwen_image:QwenImageAdapter",
    "Flux2Pipeline": ".flux2:Flux2Adapter",
    "Flux2KleinPipeline": ".flux2:Flux2KleinAdapter",
    "ZImagePipeline": ".zimage:ZImageAdapter",
    "FluxKontextPipeline": ".flux_kontext:FluxKontextAdapter",
    "QwenImageEditPipeline": ".qwen_image_edit:QwenImageEditAdapter",
    "QwenImageEditPlusPipeline": ".qwen_image_edit:QwenImageEditPlusAdapter",
    "WanImageToVideoPipeline": ".wan_i2v:WanImageToVideoAdapter",  # Wan2.1-I2V and Wan2.2-I2V-A14B
    "QwenImage21Pipeline": ".qwen_image21:QwenImage21Adapter",  # generation, and editing with a source
    "HunyuanVideo15Pipeline": ".hunyuan_video15:HunyuanVideo15Adapter",
    "LTX2Pipeline": ".ltx2:LTX2Adapter",  # video and audio denoised together; the rewards get the video
}
_entry_points_loaded = False


def register_adapter(pipeline_class, adapter_class, overwrite: bool = False) -> None:
    """Make every trainer accept pipelines of ``pipeline_class`` (a class or its name; subclasses match too)
    through ``adapter_class``, a :class:`FlowAdapter` subclass built as ``adapter_class(pipe, **options)``.

    Registering a name that already has an adapter raises ``ValueError`` unless ``overwrite=True``. Installed
    packages can register without being imported, with an entry point in the ``trl_flow.adapters`` group
    (``MyPipeline = "my_pkg.adapter:MyAdapter"``). The contract and a worked example: docs/adding_a_model.md.
    """
    name = pipeline_class if isinstance(pipeline_class, str) else getattr(pipeline_class, "__name__", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"register_adapter: pipeline_class must be a class or a class name, got {pipeline_class!r}")
    if not (isinstance(adapter_class, type) and issubclass(adapter_class, FlowAdapter)):
        raise TypeError(f"register_adapter: adapter_class must be a subclass of trl_flow.models.FlowAdapter, got "
                        f"{adapter_class!r} (see {GUIDE})")
    current = _ADAPTERS.get(name)
    if current is not None and current is not adapter_class and not overwrite:
        raise ValueError(f"register_adapter: {name} already has an adapter ({_adapter_name(current)}); pass "
                         "overwrite=True to replace it")
    _ADAPTERS[name] = adapter_class


def registered_adapters() -> dict[str, str]:
    """Pipeline class name -> adapter class name, for every registered family (entry points included)."""
    _load_entry_points()
    return {k: _adapter_name(v) for k, v in sorted(_ADAPTERS.items())}


def _adapter_name(entry) -> str:
    return entry.rsplit(":", 1)[-1] if isinstance(entry, str) else entry.__name__


def _resolve(name: str) -> type:
    entry = _ADAPTERS[name]
    if isinstance(entry, str):
        import importlib

        module, _, cls = entry.partition(":")
        entry = _ADAPTERS[name] = getattr(importlib.import_module(module, __name__), cls)
    return entry


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    from ..plugins import load_entry_points

    # registered before (a built-in, or by the plug-in itself): that one stays
    load_entry_points(ENTRY_POINT_GROUP, _ADAPTERS.get, register_adapter, "an adapter", package=__name__)


def get_adapter(pipe, **options) -> FlowAdapter:
    """The adapter for a diffusers pipeline, chosen by the pipeline's class (or a base class) name among the
    registered ones (:func:`register_adapter`); ``options`` go to the adapter (e.g. ``FluxAdapter``'s
    ``true_cfg_scale``). An adapter is returned as it is, so every trainer accepts a configured adapter in place
    of a pipeline."""
    if isinstance(pipe, FlowAdapter):
        if options:
            raise TypeError(f"get_adapter: got an adapter and options {sorted(options)}; set them on the adapter")
        return pipe
    _load_entry_points()
    for cls in type(pipe).__mro__:
        if cls.__name__ in _ADAPTERS:
            return _resolve(cls.__name__)(pipe, **options)
    raise TypeError(
        f"pipe: no trl_flow adapter for {type(pipe).__name__}; supported pipelines: {sorted(_ADAPTERS)}. To add "
        f"one: trl_flow.models.register_adapter({type(pipe).__name__}, YourAdapter), guide in {GUIDE}"
    )


def load_pipeline(model_name_or_path: str, torch_dtype="float32", **kwargs):
    """Load a supported diffusers pipeline (a Hub id such as ``stabilityai/stable-diffusion-3.5-medium``,
    ``black-forest-labs/FLUX.1-dev`` or ``Wan-AI/Wan2.1-T2V-1.3B-Diffusers``, or a local folder) with
    ``DiffusionPipeline.from_pretrained`` and check that trl_flow has an adapter for it. ``kwargs`` go to
    ``from_pretrained`` (``variant``, ``revision``, ...; ``revision``, ``cache_dir``, ``subfolder`` also to the read
    of ``model_index.json``)."""
    import torch
    from diffusers import DiffusionPipeline

    dtype = getattr(torch, torch_dtype) if isinstance(torch_dtype, str) else torch_dtype
    # Components saved as absent (e.g. an SD3 pipeline without T5: `"text_encoder_3": [null, null]`) must be
    # passed as None explicitly to from_pretrained.
    index = DiffusionPipeline.load_config(model_name_or_path, **{k: kwargs[k] for k in _INDEX_KWARGS if k in kwargs})
    check_component_backends(index, model_name_or_path)
    for name, value in index.items():
        if not name.startswith("_") and isinstance(value, (list, tuple)) and list(value) == [None, None]:
            kwargs.setdefault(name, None)
    pipe = DiffusionPipeline.from_pretrained(model_name_or_path, **{_dtype_keyword(): dtype}, **kwargs)
    get_adapter(pipe)  # fail early for an unsupported family
    return pipe


def check_component_backends(index: dict, source: str = "the pipeline") -> None:
    """Raise a one-line ``ImportError`` before any weight is loaded when a component's transformers class needs a
    package that is not installed (FLUX.2-dev's tokenizer, a ``PixtralProcessor``, needs torchvision; without it
    diffusers fails after loading the text encoder, saying the component "cannot be loaded"). ``index``: the
    pipeline's ``model_index.json``."""
    import transformers

    for name, value in index.items():
        if (name.startswith("_") or not isinstance(value, (list, tuple)) or len(value) != 2
                or value[0] != "transformers"):
            continue
        cls = getattr(transformers, str(value[1]), None)
        missing = [str(b) for b in getattr(cls, "_backends", ())] if type(cls).__name__ == "DummyObject" else []
        if missing:
            raise ImportError(f"{source}: component `{name}` ({value[1]}) needs {', '.join(missing)}, which is not "
                              f"installed: {_install_hint(missing)}")


def _install_hint(packages: list[str]) -> str:
    """The pip command for missing packages; torchvision pinned to the release of the installed torch (a bare
    `pip install torchvision` upgrades torch to the newest, CUDA, build), from the CPU index for a CPU torch."""
    if packages != ["torchvision"]:
        return "pip install " + " ".join(packages)
    import torch

    version = torch.__version__.split("+")[0].split(".")
    cmd = f'pip install "torchvision==0.{int(version[1]) + 15}.*"' if version[0] == "2" else "pip install torchvision"
    if "+cpu" in torch.__version__:
        cmd += " --index-url https://download.pytorch.org/whl/cpu"
    return f"{cmd} (the torchvision release of torch {torch.__version__})"


def _dtype_keyword() -> str:
    """``dtype`` where this diffusers' ``from_pretrained`` documents it (newer releases deprecate ``torch_dtype``
    with a FutureWarning on every load), else ``torch_dtype``."""
    import re

    from diffusers import DiffusionPipeline

    doc = DiffusionPipeline.from_pretrained.__doc__ or ""
    return "dtype" if re.search(r"^\s*dtype \(", doc, flags=re.M) else "torch_dtype"


__all__ = ["load_pipeline", "register_adapter", "registered_adapters", "FlowAdapter", "FluxAdapter", "PromptEmbeds",
           "Schedule", "SD3Adapter", "WanAdapter",
           "get_adapter", "cat_embeds", "index_embeds"]
