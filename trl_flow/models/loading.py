"""A model id or folder wherever a pipeline is accepted: ``FlowGRPOTrainer(config, "org/model", rewards)`` loads the
pipeline itself, as TRL's ``GRPOTrainer(model="Qwen/...")`` does, with the config's ``model_init_kwargs``.

What cannot be loaded fails here, before any compute, with an error naming the model and what is missing: a
folder without ``model_index.json``, a string that is neither a folder nor a Hub id, a Hub model absent from the
local cache while ``HF_HUB_OFFLINE`` is set, a Hub model the Hub does not have (or does not let this user read).
"""

from __future__ import annotations

import os
import warnings

INDEX_NAME = "model_index.json"
#: ``model_init_kwargs`` keys that also select which ``model_index.json`` is read.
_INDEX_KWARGS = ("revision", "cache_dir", "token", "local_files_only", "proxies", "subfolder")


def load_model(model, config):
    """``model`` as a pipeline: a pipeline (or adapter) is returned as it is (``model_init_kwargs`` is then ignored,
    with a warning, as TRL does); a str / ``os.PathLike`` is a Hub id or a local folder, loaded with
    :func:`trl_flow.models.load_pipeline` and ``config.model_init_kwargs``. ``dtype`` (or ``torch_dtype``) defaults
    to ``"auto"``: bfloat16 / float16 when the config sets ``bf16`` / ``fp16``, else float32 (as the command line's
    ``--dtype auto``)."""
    kwargs = dict(getattr(config, "model_init_kwargs", None) or {})
    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    if not isinstance(model, str):
        if kwargs:
            warnings.warn(f"model_init_kwargs={kwargs!r}: the trainer got a {type(model).__name__}, not a model id or "
                          "folder, so they are ignored (load the pipeline with them, or pass its id)", stacklevel=3)
        return model
    dtype = kwargs.pop("dtype", kwargs.pop("torch_dtype", "auto"))
    if dtype == "auto":
        dtype = "bfloat16" if config.bf16 else "float16" if config.fp16 else "float32"
    _check_dtype(dtype)
    check_loadable(model, kwargs)
    from . import load_pipeline

    try:
        return load_pipeline(model, dtype, **kwargs)
    except (OSError, ValueError) as e:  # huggingface_hub's and diffusers' errors of a missing or partial model
        raise ValueError(f"model {model!r} cannot be loaded as a diffusers pipeline: {type(e).__name__}: {e}") from e


def _check_dtype(dtype) -> None:
    import torch

    if not isinstance(dtype, torch.dtype) and not isinstance(getattr(torch, str(dtype), None), torch.dtype):
        raise ValueError(f"model_init_kwargs: dtype={dtype!r} is not a torch dtype; use e.g. 'bfloat16', "
                         "'float16', 'float32' or 'auto'")


def check_loadable(model: str, kwargs: dict | None = None) -> None:
    """Raise ``ValueError`` naming ``model`` when it cannot be a loadable pipeline, reading only small files: not a
    folder with ``model_index.json`` nor a Hub id; or, with ``HF_HUB_OFFLINE`` set, not in the local cache."""
    kwargs = kwargs or {}
    sub = kwargs.get("subfolder") or ""
    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, sub, INDEX_NAME)):
            raise ValueError(f"model {model!r}: the folder has no {os.path.join(sub, INDEX_NAME)}, so it is not a "
                             "saved diffusers pipeline (write one with pipe.save_pretrained(folder))")
        return
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(model)
        hub_id = not os.path.exists(model) and not model.startswith((".", "/", "~"))
    except HFValidationError:
        hub_id = False
    if not hub_id:
        raise ValueError(f"model {model!r}: no such folder, and not a Hugging Face Hub id (`org/name`); give a "
                         "pipeline, the folder of one saved with save_pretrained, or a Hub id")
    if constants.HF_HUB_OFFLINE or kwargs.get("local_files_only"):
        index = try_to_load_from_cache(model, "/".join(p for p in (sub, INDEX_NAME) if p),
                                       cache_dir=kwargs.get("cache_dir"), revision=kwargs.get("revision"))
        if not isinstance(index, str):
            why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "local_files_only=True"
            rev = f" at revision {kwargs['revision']!r}" if kwargs.get("revision") else ""
            raise ValueError(f"model {model!r}{rev} is not in the local Hugging Face cache "
                             f"({kwargs.get('cache_dir') or constants.HF_HUB_CACHE}) and {why}: download it first "
                             f"(`hf download {model}`), or give the folder of a saved pipeline")
