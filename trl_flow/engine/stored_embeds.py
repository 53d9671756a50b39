"""Prompt embeddings precomputed into the prompt dataset, so that a run needs no text encoders.

:func:`precompute_prompt_embeds` encodes every distinct prompt of a ``datasets.Dataset`` once and returns the dataset
with the embedding tensors as columns (``embeds.<key>``, one per key of the adapter's ``encode_prompts``) and the
settings they depend on (column ``embeds.settings``, JSON); ``save_to_disk`` keeps both. Flow-Factory
(guidance/workflow.md) and DanceGRPO / MixGRPO (scripts/preprocess) precompute embeddings in the same spirit.

Bit identity. A trainer encodes a distinct prompt in a call of as many rows as its sampling chunk
(``per_device_train_batch_size``; :mod:`.prompt_encoding`), because a GEMM's result can change in the last bits with
its row count. So the precompute encodes the distinct prompts in calls of ``batch_size`` rows (the last call filled
up with its last prompt, as the trainer does): each stored row is the trainer's own value for a full chunk, bit for
bit. A chunk of another size (the last one of an evaluation whose prompts per process are not a multiple of
``per_device_train_batch_size``) encodes on the fly when the pipeline has its text encoders; without them it takes
the stored row (a deviation in the last bits at most) and warns once.

A trainer given such a dataset (train or eval) checks the settings against its config and pipeline at construction
(:func:`take_stored`) and strips the columns (the rewards never see them); a pipeline without text encoders
(``pipe.text_encoder = None``, ...) then trains from the stored rows alone.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import warnings

import torch

from ..data import check_prompt_dataset
from ..models import get_adapter

PREFIX = "embeds."
SETTINGS_COLUMN = "embeds.settings"
FORMAT = 1
_NUMPY = {torch.float32: "float32", torch.bfloat16: "float32", torch.float16: "float32", torch.float64: "float64",
          torch.bool: "bool", torch.int64: "int64", torch.int32: "int32"}  # bf16/fp16 -> float32 and back: exact
_FIX = "precompute again with trl_flow.precompute_prompt_embeds(pipe, dataset, config=config)"


def text_encoder_names(pipe) -> list[str]:
    """The pipeline's ``text_encoder*`` components that are present (not None)."""
    return sorted(n for n, m in pipe.components.items()
                  if n.startswith("text_encoder") and isinstance(m, torch.nn.Module))


def _fingerprint(module) -> str | None:
    """A short hash of a module's class and config (private ``_`` keys left out): what tells two models apart when
    their folders' names do not."""
    config = getattr(module, "config", None)
    if config is None:
        return None
    items = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    text = json.dumps([type(module).__name__, {k: v for k, v in items.items() if not k.startswith("_")}],
                      sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _model(pipe) -> dict:
    return {"pipeline": type(pipe).__name__, "name_or_path": getattr(pipe, "name_or_path", None) or None,
            "transformer": _fingerprint(getattr(pipe, "transformer", None))}


def _encoders(pipe) -> dict:
    """{text encoder name: fingerprint} of the present ones."""
    return {n: _fingerprint(pipe.components[n]) for n in text_encoder_names(pipe)}


def _mixed_precision(config) -> str:
    return "bf16" if getattr(config, "bf16", False) else "fp16" if getattr(config, "fp16", False) else "no"


@contextlib.contextmanager
def _precision(pipe, mixed_precision: str, device):
    """The trainer's encoding precision: text encoders cast to the mixed-precision dtype (as model set-up does) and
    the calls under autocast (as ``accelerator.autocast()``); the encoders' dtypes are restored after."""
    if mixed_precision == "no":
        yield
        return
    from ..memory import is_quantized

    dtype = torch.bfloat16 if mixed_precision == "bf16" else torch.float16
    saved = {}
    for name in text_encoder_names(pipe):
        module = pipe.components[name]
        if not is_quantized(module):
            saved[name] = next(module.parameters()).dtype
            module.to(dtype=dtype)
    try:
        with torch.autocast(device_type=torch.device(device).type, dtype=dtype):
            yield
    finally:
        for name, d in saved.items():
            pipe.components[name].to(dtype=d)


def _feature(shape: tuple, dtype: str):
    import datasets

    if len(shape) == 0:
        return datasets.Value(dtype)
    if len(shape) == 1:
        return datasets.Sequence(datasets.Value(dtype), length=shape[0])
    arrays = {2: datasets.Array2D, 3: datasets.Array3D, 4: datasets.Array4D, 5: datasets.Array5D}
    if len(shape) not in arrays:
        raise ValueError(f"precompute_prompt_embeds: an embedding row of shape {shape} has more than 5 dimensions")
    return arrays[len(shape)](shape=shape, dtype=dtype)


@torch.no_grad()
def precompute_prompt_embeds(pipe_or_adapter, dataset, *, guidance_scale: float | None = None,
                             max_sequence_length: int | None = None, batch_size: int | None = None,
                             mixed_precision: str | None = None, config=None):
    """``dataset`` (a ``datasets.Dataset`` with a ``prompt`` column, or a list of prompts) with its prompts'
    embeddings added as columns ``embeds.<key>`` (the keys of the adapter's ``encode_prompts``: ``prompt_embeds``,
    ``pooled_prompt_embeds``, the negative ones under CFG, ...) and the settings they depend on in ``embeds.settings``
    (JSON: the pipeline class and ``name_or_path``, the adapter, ``max_sequence_length``, ``guidance`` (CFG on:
    ``guidance_scale > 1``), ``batch_size``, ``mixed_precision``, the device type, the text encoders, each key's
    dtype). The other columns are kept. Save it with ``save_to_disk`` and pass it to a trainer as ``train_dataset``
    or ``eval_dataset``; the trainer refuses it when a setting differs from its own.

    ``config``: a trainer config giving the defaults: ``guidance_scale``, ``max_sequence_length``,
    ``per_device_train_batch_size`` (``batch_size``) and ``bf16`` / ``fp16`` (``mixed_precision``: ``"no"``,
    ``"bf16"`` or ``"fp16"``). For an eval dataset pass ``guidance_scale=config.eval_guidance_scale`` when that is
    set. The pipeline runs where it is (move it to the training device first: a GPU's values differ from a CPU's).
    Each distinct prompt is encoded once, in calls of ``batch_size`` rows, so the stored rows are bit for bit what
    the trainer encodes (module docstring)."""
    adapter = get_adapter(pipe_or_adapter)
    pipe = adapter.pipe
    ds = check_prompt_dataset(dataset, "dataset")
    if guidance_scale is None:
        guidance_scale = getattr(config, "guidance_scale", None)
    if max_sequence_length is None:
        max_sequence_length = getattr(config, "max_sequence_length", None)
    if batch_size is None:
        batch_size = getattr(config, "per_device_train_batch_size", None)
    if mixed_precision is None:
        mixed_precision = _mixed_precision(config)
    for name, value in (("guidance_scale", guidance_scale), ("max_sequence_length", max_sequence_length),
                        ("batch_size", batch_size)):
        if value is None:
            raise ValueError(f"precompute_prompt_embeds: {name} is required (or pass config=, the trainer's config)")
    if not (isinstance(batch_size, int) and batch_size >= 1):
        raise ValueError(f"precompute_prompt_embeds: batch_size={batch_size!r} must be an integer >= 1 (the trainer's "
                         "per_device_train_batch_size)")
    if mixed_precision not in ("no", "bf16", "fp16"):
        raise ValueError(f"precompute_prompt_embeds: mixed_precision={mixed_precision!r} must be 'no', 'bf16' or "
                         "'fp16'")
    if adapter.conditioning != "text":
        raise ValueError(f"precompute_prompt_embeds: {type(adapter).__name__} conditions on a source image too; "
                         "its embeddings cannot be precomputed from the prompts (train it with its encoders, or "
                         "cache_prompt_embeds=True)")
    if getattr(adapter, "prompt_padding", "max_length") != "max_length":
        raise ValueError(f"precompute_prompt_embeds: {type(adapter).__name__} pads a batch of prompts to its longest "
                         "one, so a prompt's embedding depends on the prompts sampled with it; use "
                         "cache_prompt_embeds=True instead")
    encoders = text_encoder_names(pipe)
    if not encoders:
        raise ValueError("precompute_prompt_embeds: the pipeline has no text encoder (every text_encoder* component "
                         "is None); load it with its text encoders to precompute")
    if any(c.startswith(PREFIX) for c in ds.column_names):
        raise ValueError(f"precompute_prompt_embeds: dataset already has embedding columns "
                         f"{[c for c in ds.column_names if c.startswith(PREFIX)]}; drop them first with "
                         "dataset.remove_columns(...)")
    guidance = guidance_scale > 1
    prompts = ds["prompt"]
    distinct = list(dict.fromkeys(prompts))
    device = next(pipe.components[encoders[0]].parameters()).device
    parts = []
    with _precision(pipe, mixed_precision, device):
        for lo in range(0, len(distinct), batch_size):
            part = distinct[lo : lo + batch_size]
            out = adapter.encode_prompts(part + part[-1:] * (batch_size - len(part)), guidance, max_sequence_length)
            parts.append({k: v[: len(part)].detach().cpu() for k, v in out.items()})
    where = {p: i for i, p in enumerate(distinct)}
    index = torch.tensor([where[p] for p in prompts])
    import datasets

    columns, features, dtypes = {}, {}, {}
    for k in parts[0]:
        t = torch.cat([p[k] for p in parts])[index]
        if t.dtype not in _NUMPY:
            raise ValueError(f"precompute_prompt_embeds: embedding {k!r} has dtype {t.dtype}, which cannot be stored")
        dtypes[k] = str(t.dtype).removeprefix("torch.")
        np_dtype = _NUMPY[t.dtype]
        columns[PREFIX + k] = t.to(getattr(torch, np_dtype) if np_dtype != "bool" else torch.bool).numpy()
        features[PREFIX + k] = _feature(tuple(t.shape[1:]), np_dtype)
    settings = {"format": FORMAT, **_model(pipe), "adapter": type(adapter).__name__,
                "max_sequence_length": max_sequence_length, "guidance": guidance, "batch_size": batch_size,
                "mixed_precision": mixed_precision, "device": device.type, "text_encoders": _encoders(pipe),
                "dtypes": dtypes}
    columns[SETTINGS_COLUMN] = [json.dumps(settings, sort_keys=True)] * len(ds)
    features[SETTINGS_COLUMN] = datasets.Value("string")
    emb = datasets.Dataset.from_dict(columns, features=datasets.Features(features))
    return datasets.concatenate_datasets([ds, emb], axis=1)


class StoredEmbeds:
    """Embedding rows read from precomputed datasets: ``{(guidance, max_sequence_length, prompt): {key: (1, ...)}}``
    (CPU, in the encoders' dtype), served by :meth:`lookup` to :func:`.prompt_encoding.encode_samples`."""

    def __init__(self, batch_size: int, has_encoders: bool):
        self.batch_size, self.has_encoders = batch_size, has_encoders
        self.rows: dict = {}
        self._warned = False

    def lookup(self, guidance: bool, max_sequence_length: int, size: int, prompt):
        """The stored row of ``prompt`` for a call of ``size`` rows, or None to encode it on the fly."""
        row = self.rows.get((guidance, max_sequence_length, prompt))
        if row is not None and size == self.batch_size:
            return row
        if self.has_encoders:
            return None
        if row is None:
            raise ValueError(f"prompt {prompt!r} has no precomputed embedding (guidance={guidance}, "
                             f"max_sequence_length={max_sequence_length}) and the pipeline has no text encoders; "
                             "add it to a dataset passed through trl_flow.precompute_prompt_embeds, or load the "
                             "pipeline with its text encoders")
        if not self._warned:
            self._warned = True
            warnings.warn(f"a chunk of {size} prompts (not per_device_train_batch_size={self.batch_size}) takes its "
                          "precomputed embeddings, encoded in calls of that batch size: they may differ from encoding "
                          "on the fly in the last bits", stacklevel=2)
        return row


def _read(dataset, name: str) -> tuple[dict, dict]:
    raw = set(dataset[SETTINGS_COLUMN])
    if len(raw) != 1:
        raise ValueError(f"{name}: rows precomputed with {len(raw)} different settings ({SETTINGS_COLUMN}); "
                         f"{_FIX} on the whole dataset")
    settings = json.loads(raw.pop())
    if settings.get("format") != FORMAT:
        raise ValueError(f"{name}: embeddings in format {settings.get('format')!r}, this trl_flow reads {FORMAT}; "
                         f"{_FIX}")
    keys = list(settings["dtypes"])
    missing = [PREFIX + k for k in keys if PREFIX + k not in dataset.column_names]
    if missing:
        raise ValueError(f"{name}: embedding columns {missing} are missing; {_FIX}")
    arrays = dataset.with_format("numpy", columns=[PREFIX + k for k in keys])[:]
    tensors = {k: torch.as_tensor(arrays[PREFIX + k]).to(getattr(torch, settings["dtypes"][k])) for k in keys}
    return settings, tensors


def _check(settings: dict, name: str, adapter, config, guidance_scale: float, device, encoders: list[str]) -> None:
    pipe = adapter.pipe
    model = _model(pipe)
    expected = {
        "pipeline": (model["pipeline"], "another pipeline class: the embeddings belong to another model family"),
        "adapter": (type(adapter).__name__, "another adapter"),
        "max_sequence_length": (config.max_sequence_length, "set max_sequence_length to the stored value or "
                                + _FIX),
        "guidance": (guidance_scale > 1, "CFG on (guidance_scale > 1) differs: the stored rows lack or hold the "
                     "negative embeddings"),
        "batch_size": (config.per_device_train_batch_size, "the trainer encodes in chunks of "
                       "per_device_train_batch_size rows; set it to the stored batch_size or " + _FIX),
        "mixed_precision": (_mixed_precision(config), "the text encoders run in another precision under bf16 / fp16"),
        "device": (torch.device(device).type, "a GPU encodes to other values than a CPU"),
        "transformer": (model["transformer"], "another transformer configuration: the embeddings belong to another "
                        "model"),
    }
    if model["name_or_path"] and settings.get("name_or_path"):
        expected["name_or_path"] = (model["name_or_path"], "another model")
    if encoders:  # a pipeline with its encoders: the same ones (SD3 without T5 encodes other values)
        expected["text_encoders"] = (_encoders(pipe), "the pipeline's text encoders (their classes and configs) "
                                     "differ")
    for key, (want, why) in expected.items():
        if settings.get(key) != want:
            raise ValueError(f"{name}: its prompt embeddings were precomputed with {key}={settings.get(key)!r}, this "
                             f"trainer has {key}={want!r} ({why}); {_FIX}")


def take_stored(trainer, dataset, name: str, guidance_scale: float):
    """``dataset`` without its embedding columns, after checking their settings against the trainer and adding its
    rows to ``trainer._stored_embeds`` (created on first use). A dataset without them, given a pipeline without text
    encoders, is refused naming the fix."""
    if dataset is None:
        return None
    encoders = text_encoder_names(trainer.pipe)
    cols = [c for c in dataset.column_names if c.startswith(PREFIX)]
    if SETTINGS_COLUMN not in dataset.column_names:
        if not encoders:
            raise ValueError(f"{name}: the pipeline has no text encoders (every text_encoder* component is None) and "
                             f"{name} has no precomputed embeddings; pass "
                             f"trl_flow.precompute_prompt_embeds(pipe_with_encoders, {name}, config=config) (for "
                             "the eval dataset with guidance_scale=eval_guidance_scale when set), or give the "
                             "pipeline its text encoders")
        if cols:
            raise ValueError(f"{name}: embedding columns {cols} without {SETTINGS_COLUMN}; {_FIX}")
        return dataset
    cfg = trainer.config
    settings, tensors = _read(dataset, name)
    _check(settings, name, trainer.adapter, cfg, guidance_scale, trainer.device, encoders)
    if trainer._stored_embeds is None:
        trainer._stored_embeds = StoredEmbeds(cfg.per_device_train_batch_size, bool(encoders))
    rows = trainer._stored_embeds.rows
    for i, prompt in enumerate(dataset["prompt"]):
        rows[(settings["guidance"], settings["max_sequence_length"], prompt)] = {
            k: v[i : i + 1] for k, v in tensors.items()}
    return dataset.remove_columns(cols)
