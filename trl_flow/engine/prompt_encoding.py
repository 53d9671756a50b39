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


def _cacheable(key) -> bool:
    """A key that names its conditioning by value (a prompt, a source image's path or bytes): an in-memory image is
    known only by its object id, which a later object may reuse."""
    return not (isinstance(key, tuple) and isinstance(key[1], tuple) and key[1][0] == "object")


def encode_samples(adapter, prompts: list[str], columns: dict | None, guidance: bool, max_sequence_length: int,
                   batch_size: int, cache: dict | None = None, device=None, stored=None) -> dict:
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

    ``cache`` (``cache_prompt_embeds``): a dict kept across calls. Each encoded row (``max_length``) or chunk
    (``longest``) is stored on the CPU under everything its values depend on (guidance, max_sequence_length, the
    call's size, the prompt and source key) and reused bit for bit, on ``device``; only rows never seen run the
    encoders.

    ``stored`` (a :class:`.stored_embeds.StoredEmbeds`, from datasets made by ``precompute_prompt_embeds``): rows
    served from there after the cache (``max_length`` adapters only), bit for bit the rows encoded here.
    """
    keys = sample_keys(adapter, prompts, columns)
    chunks = [range(lo, min(lo + batch_size, len(prompts))) for lo in range(0, len(prompts), batch_size)]

    def encode(rows):
        sub = {k: [v[r] for r in rows] for k, v in (columns or {}).items()}
        images = editing.adapter_images(adapter, sub)
        extra = {} if images is None else {"images": images}
        return adapter.encode_prompts([prompts[r] for r in rows], guidance, max_sequence_length, **extra)

    rows: dict = {}  # (size or "chunk", key) -> that row's or chunk's embeddings

    def store(slot, out):
        rows[slot] = out
        if cache is not None and all(_cacheable(k) for k in (slot[1] if slot[0] == "chunk" else (slot[1],))):
            cache[(guidance, max_sequence_length, *slot)] = {k: v.detach().cpu() for k, v in out.items()}

    def cached(slot):
        if cache is None or (guidance, max_sequence_length, *slot) not in cache:
            return None
        return cache[(guidance, max_sequence_length, *slot)]

    if getattr(adapter, "prompt_padding", "max_length") == "longest":
        for chunk in chunks:
            slot = ("chunk", tuple(keys[i] for i in chunk))
            if slot not in rows:
                hit = cached(slot)
                if hit is None:
                    store(slot, encode(list(chunk)))
                else:
                    rows[slot] = hit
        parts = [rows[("chunk", tuple(keys[i] for i in chunk))] for chunk in chunks]
    else:
        first: dict[int, dict] = {}  # chunk size -> {key: its first sample}: each row encoded in a call of its size
        for chunk in chunks:
            for i in chunk:
                first.setdefault(len(chunk), {}).setdefault(keys[i], i)
        for size, rows_of in first.items():
            todo = []
            for key, i in rows_of.items():
                hit = cached((size, key))
                if hit is None and stored is not None:
                    hit = stored.lookup(guidance, max_sequence_length, size, key)
                if hit is None:
                    todo.append((key, i))
                else:
                    rows[(size, key)] = hit
            for lo in range(0, len(todo), size):
                part = todo[lo : lo + size]
                idx = [i for _, i in part]
                out = encode(idx + idx[-1:] * (size - len(idx)))
                for j, (key, _) in enumerate(part):
                    store((size, key), {k: v[j : j + 1] for k, v in out.items()})
        parts = [rows[(len(chunk), keys[i])] for chunk in chunks for i in chunk]
    if (cache is not None or stored is not None) and device is not None:
        parts = [{k: v.to(device) for k, v in p.items()} for p in parts]
    return cat_embeds(parts)
