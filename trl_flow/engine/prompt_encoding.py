"""Prompt encoding for the trainers: each distinct prompt (and source image) of an iteration encoded once.

An iteration holds ``num_generations`` (G) samples of every prompt, so encoding the samples' prompt list as it is runs
the text encoder G times on each prompt (FLUX.2-dev: a 24B encoder, G x the work). :func:`encode_samples` encodes the
distinct rows and expands them to the samples with an index. The values are those of the former path (chunks of
``per_device_train_batch_size`` samples, so that a sample's embedding does not depend on how many samples a process
holds) bit for bit: a distinct row is encoded in a call of as many rows as its chunk had, since a GEMM's result can
change in the last bits with its number of rows (SD3's pooled CLIP projection does on CPU).
"""

from __future__ import annotations

import os

import torch

from .. import editing
from ..models import cat_embeds


def source_key(value):
    """A hashable identity of a source-image value: its path, its stored bytes, or the object itself (in-memory
    images: two equal images in different objects are encoded separately, which changes nothing but the cost)."""
    if isinstance(value, (str, os.PathLike)):
        return ("path", os.fspath(value))
    if isinstance(value, dict) and ("path" in value or "bytes" in value):  # datasets.Image(decode=False)
        return ("file", value.get("path"), value.get("bytes"))
    return ("object", id(value))


def sample_keys(adapter, prompts: list[str], columns: dict | None) -> list:
    """One hashable key per sample (N): what its conditioning depends on. The prompt; for an editing adapter
    (``conditioning="text_and_image"``) the prompt and its source image."""
    if adapter.conditioning != "text_and_image":
        return list(prompts)
    sources = (columns or {}).get(getattr(adapter, "source_column", editing.SOURCE_COLUMN))
    if sources is None:  # editing.adapter_images names the missing column
        return [(p, i) for i, p in enumerate(prompts)]
    return [(p, source_key(s)) for p, s in zip(prompts, sources)]


def _take(embeds: dict, index: list[int]) -> dict:
    """Rows ``index`` of every tensor (on the tensor's device)."""
    return {k: v.index_select(0, torch.tensor(index, dtype=torch.long, device=v.device)) for k, v in embeds.items()}


def encode_samples(adapter, prompts: list[str], columns: dict | None, guidance: bool, max_sequence_length: int,
                   batch_size: int) -> dict:
    """Prompt embeddings of N samples (each tensor (N, ...)), bit for bit ``cat_embeds`` of
    ``adapter.encode_prompts`` on each chunk of ``batch_size`` samples (the former path), with each distinct row
    encoded once. ``columns``: the samples' dataset columns ({name: N values}; an editing adapter reads its source
    images there).

    * ``adapter.prompt_padding == "max_length"`` (the pipeline pads every prompt to a fixed length): a row's values
      depend on its prompt and on the number of rows encoded with it only, so the distinct rows are encoded in calls
      of the chunks' size (the last call filled up with its last row), then indexed to the samples: about
      ``distinct`` rows instead of N.
    * ``"longest"`` (the pipeline pads to the longest prompt of the call, Qwen-Image): a row's values depend on its
      companions too, so each chunk is encoded as before and only identical chunks (the ``num_generations /
      batch_size`` chunks of one prompt) are encoded once.
    """
    keys = sample_keys(adapter, prompts, columns)
    chunks = [range(lo, min(lo + batch_size, len(prompts))) for lo in range(0, len(prompts), batch_size)]

    def encode(rows):
        sub = {k: [v[r] for r in rows] for k, v in (columns or {}).items()}
        images = editing.adapter_images(adapter, sub)
        extra = {} if images is None else {"images": images}
        return adapter.encode_prompts([prompts[r] for r in rows], guidance, max_sequence_length, **extra)

    calls, where = [], []  # the encoder calls' outputs; each sample's (call, row)
    if getattr(adapter, "prompt_padding", "max_length") == "longest":
        seen = {}
        for chunk in chunks:
            key = tuple(keys[i] for i in chunk)
            if key not in seen:
                seen[key] = len(calls)
                calls.append(encode(list(chunk)))
            where += [(seen[key], j) for j in range(len(chunk))]
    else:
        first: dict[int, dict] = {}  # chunk size -> {key: its first sample}: each row encoded in a call of its size
        for chunk in chunks:
            for i in chunk:
                first.setdefault(len(chunk), {}).setdefault(keys[i], i)
        slot = {}
        for size, rows_of in first.items():
            distinct = list(rows_of.items())
            for lo in range(0, len(distinct), size):
                part = distinct[lo : lo + size]
                rows = [i for _, i in part]
                calls.append(encode(rows + rows[-1:] * (size - len(rows))))
                slot.update({(size, key): (len(calls) - 1, j) for j, (key, _) in enumerate(part)})
        where = [slot[(len(chunk), keys[i])] for chunk in chunks for i in chunk]
    offsets = [0]
    for out in calls:
        offsets.append(offsets[-1] + len(next(iter(out.values()))))
    return _take(cat_embeds(calls), [offsets[c] + j for c, j in where])
