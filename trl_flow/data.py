"""Prompts: validating a prompt dataset and choosing each iteration's prompts."""

from __future__ import annotations

import functools

import torch


def check_prompt_dataset(dataset, name: str = "train_dataset"):
    """A ``datasets.Dataset`` with a non-empty string column ``prompt``. A list of strings or a dict of columns is
    converted. Raises ``ValueError`` / ``TypeError`` naming ``name``, the offending row and the fix, before any
    compute: a ``DatasetDict`` (pick a split), a list holding a non-string, empty or whitespace-only prompts."""
    from datasets import Dataset, DatasetDict, IterableDataset, IterableDatasetDict

    if isinstance(dataset, (DatasetDict, IterableDatasetDict)):
        raise TypeError(f"{name}: got a DatasetDict with splits {list(dataset)}; pick one split, e.g. "
                        f"{name}=dataset[{next(iter(dataset), 'train')!r}]")
    if isinstance(dataset, IterableDataset):
        raise TypeError(f"{name}: got a streaming IterableDataset; load it without streaming=True (a prompt set is "
                        "small) or collect it with Dataset.from_list(list(dataset))")
    if isinstance(dataset, (list, tuple)):
        bad = next((i for i, p in enumerate(dataset) if not isinstance(p, str)), None)
        if bad is not None:
            raise TypeError(f"{name}: a list of prompts must hold only strings; item {bad} is {dataset[bad]!r} "
                            f"({type(dataset[bad]).__name__})")
        dataset = Dataset.from_dict({"prompt": list(dataset)})
    elif isinstance(dataset, dict):
        dataset = Dataset.from_dict(dataset)
    if not isinstance(dataset, Dataset):
        raise TypeError(f"{name}: expected a datasets.Dataset with a `prompt` column, a list of prompts or a dict of "
                        f"columns, got {type(dataset).__name__}")
    if "prompt" not in dataset.column_names:
        raise ValueError(
            f"{name}: no `prompt` column (columns: {dataset.column_names}); rename yours with "
            "dataset.rename_column(<name>, 'prompt')"
        )
    if len(dataset) == 0:
        raise ValueError(f"{name}: the dataset is empty")
    prompts = dataset["prompt"]
    bad = [i for i, p in enumerate(prompts) if not isinstance(p, str)]
    if bad:
        raise ValueError(f"{name}: `prompt` must hold strings; row {bad[0]} is {prompts[bad[0]]!r}")
    empty = [i for i, p in enumerate(prompts) if not p.strip()]
    if empty:
        raise ValueError(f"{name}: {len(empty)} empty or whitespace-only prompt(s), first at row {empty[0]} "
                         f"({prompts[empty[0]]!r}); drop them, e.g. dataset.filter(lambda r: r['prompt'].strip())")
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


def load_prompts(source: str, split: str = "train", name: str | None = None):
    """Prompts as a ``datasets.Dataset`` with a ``prompt`` column, from:

    - ``shapes``: the shapes task's prompts, ``split`` ``train`` or ``test``;
    - a ``.txt`` file: one prompt per non-empty line, stripped (e.g. Flow-GRPO's OCR prompts), read with
      ``datasets.load_dataset("text")``;
    - a ``.jsonl`` file: one JSON object per line with a ``prompt`` key; every other key becomes a column, nested
      values (lists, dicts) JSON-encoded as strings so that heterogeneous metadata (GenEval's ``include``) loads
      as written (``load_dataset("json")`` would merge the nested records into one schema, adding ``None`` keys);
    - a folder written by ``save_to_disk``: a ``Dataset``, or the ``split`` of a ``DatasetDict``;
    - anything else: ``datasets.load_dataset(source, name, split=split)`` (a Hub dataset or a local folder).

    A file has no splits: ``split`` applies to ``shapes``, saved ``DatasetDict`` folders and Hub datasets only.
    """
    import json
    import os

    from datasets import Dataset, DatasetDict, load_dataset, load_from_disk

    if source == "shapes" and not os.path.exists(source):
        from .tasks import shapes

        if split not in ("train", "test"):
            raise ValueError(f"shapes: split must be `train` or `test`, got {split!r}")
        return shapes.train_prompts() if split == "train" else shapes.test_prompts()
    if source.endswith(".txt"):
        ds = load_dataset("text", data_files=source, split="train")
        ds = ds.map(lambda row: {"prompt": row["text"].strip()}, remove_columns=["text"])
        return check_prompt_dataset(ds.filter(lambda row: bool(row["prompt"])), source)
    if source.endswith(".jsonl"):
        rows = []
        with open(source, encoding="utf-8") as f:
            for i, line in enumerate(f):
                if line.strip():
                    row = json.loads(line)
                    if "prompt" not in row:
                        raise ValueError(f"{source}: line {i + 1} has no `prompt` key")
                    rows.append(row)
        keys = sorted({k for r in rows for k in r}, key=lambda k: (k != "prompt", k))
        cols = {}
        for k in keys:
            vals = [r.get(k) for r in rows]
            nested = any(isinstance(v, (list, dict)) for v in vals)
            cols[k] = [json.dumps(v) if nested else v for v in vals]
        return check_prompt_dataset(Dataset.from_dict(cols), source)
    if os.path.isdir(source) and (os.path.exists(os.path.join(source, "dataset_info.json"))
                                  or os.path.exists(os.path.join(source, "dataset_dict.json"))):
        ds = load_from_disk(source)
        if isinstance(ds, DatasetDict):
            if split not in ds:
                raise ValueError(f"{source}: no split {split!r}; splits: {sorted(ds)}")
            ds = ds[split]
        return check_prompt_dataset(ds, f"{source}[{split}]")
    return check_prompt_dataset(load_dataset(source, name, split=split), f"{source}[{split}]")
