"""Prompts: validating a prompt dataset and choosing each iteration's prompts."""

from __future__ import annotations

import functools

import torch


def check_prompt_dataset(dataset, name: str = "train_dataset"):
    """A ``datasets.Dataset`` with a non-empty string column ``prompt``. A list of strings or a dict of columns is
    converted. Raises ``ValueError`` naming ``name`` otherwise, before any compute."""
    from datasets import Dataset

    if isinstance(dataset, (list, tuple)) and all(isinstance(p, str) for p in dataset):
        dataset = Dataset.from_dict({"prompt": list(dataset)})
    elif isinstance(dataset, dict):
        dataset = Dataset.from_dict(dataset)
    if not isinstance(dataset, Dataset):
        raise TypeError(f"{name}: expected a datasets.Dataset with a `prompt` column, got {type(dataset).__name__}")
    if "prompt" not in dataset.column_names:
        raise ValueError(
            f"{name}: no `prompt` column (columns: {dataset.column_names}); rename yours with "
            "dataset.rename_column(<name>, 'prompt')"
        )
    if len(dataset) == 0:
        raise ValueError(f"{name}: the dataset is empty")
    bad = [i for i, p in enumerate(dataset["prompt"]) if not isinstance(p, str)]
    if bad:
        raise ValueError(f"{name}: `prompt` must hold strings; row {bad[0]} is {dataset[bad[0]]['prompt']!r}")
    return dataset


@functools.lru_cache(maxsize=8)
def _epoch_order(n: int, epoch: int, seed: int) -> tuple[int, ...]:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return tuple(torch.randperm(n, generator=gen).tolist())


def prompt_indices(n: int, prompts_per_step: int, step: int, seed: int) -> list[int]:
    """Dataset rows of iteration ``step``: consecutive slices of a per-epoch shuffle, a pure function of
    (n, step, seed), so a resumed run sees the same prompts as an uninterrupted one."""
    out = []
    for j in range(prompts_per_step):
        pos = step * prompts_per_step + j
        out.append(_epoch_order(n, pos // n, seed)[pos % n])
    return out
