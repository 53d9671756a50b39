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
        dataset = _from_columns(dataset, name)
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


def load_prompts(source: str, split: str = "train", name: str | None = None, source_column: str = "source_image"):
    """Prompts as a ``datasets.Dataset`` with a ``prompt`` column, from:

    - ``shapes``: the shapes task's prompts, ``split`` ``train`` or ``test``;
    - a ``.txt`` file: one prompt per non-empty line, stripped (e.g. Flow-GRPO's OCR prompts);
    - a ``.jsonl`` file: one JSON object per line with a string ``prompt``; every other key becomes a column
      (a missing key is ``None``). A key holding only lists / dicts (GenEval's ``include``) becomes a column of
      their JSON text, ``json.loads`` of a value gives back what was written (``load_dataset("json")`` would merge
      the nested records into one schema, adding ``None`` keys); other keys keep their type. An editing file gives
      each prompt's source image as a path under ``source_column`` (default ``source_image``), e.g. ``{"prompt": "make
      the sky red", "source_image": "images/0.png"}``: a relative path is resolved against the file's folder (the
      trainer checks and decodes the images, :mod:`trl_flow.editing`);
    - a folder written by ``save_to_disk``: a ``Dataset``, or the ``split`` of a ``DatasetDict``;
    - anything else: ``datasets.load_dataset(source, name, split=split)`` (a Hub dataset or a local folder).

    A file has no splits: ``split`` applies to ``shapes``, saved ``DatasetDict`` folders and Hub datasets only.
    Files are read as UTF-8 (a leading BOM is dropped). Bad content (not UTF-8, invalid JSON, a non-string or empty
    prompt, a key with values of several types) raises a one-line ``ValueError`` naming the file, line and key.
    """
    import os

    from datasets import DatasetDict, load_dataset, load_from_disk

    if source == "shapes" and not os.path.exists(source):
        from .tasks import shapes

        if split not in ("train", "test"):
            raise ValueError(f"shapes: split must be `train` or `test`, got {split!r}")
        return shapes.train_prompts() if split == "train" else shapes.test_prompts()
    if source.endswith(".txt"):
        return check_prompt_dataset([text.strip() for _, text in _read_lines(source) if text.strip()], source)
    if source.endswith(".jsonl"):
        columns = _read_jsonl(source)
        if source_column in columns:
            columns[source_column] = _resolve_paths(source, source_column, columns[source_column])
        return check_prompt_dataset(columns, source)
    if os.path.isfile(source):
        return _load_data_file(source)
    if os.path.isdir(source) and (os.path.exists(os.path.join(source, "dataset_info.json"))
                                  or os.path.exists(os.path.join(source, "dataset_dict.json"))):
        ds = load_from_disk(source)
        if isinstance(ds, DatasetDict):
            if split not in ds:
                raise ValueError(f"{source}: no split {split!r}; splits: {sorted(ds)}")
            ds = ds[split]
        return check_prompt_dataset(ds, f"{source}[{split}]")
    return check_prompt_dataset(load_dataset(source, name, split=split), f"{source}[{split}]")


# ------------------------------------------------------------------------------------------------ prompt files
def _read_lines(source: str):
    """``(line number, text)`` of a UTF-8 file (a leading BOM dropped; lines split on ``\\n``, as editors number
    them). A line that is not UTF-8 raises a ``ValueError`` naming it."""
    import codecs

    try:
        with open(source, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"{source}: no such file") from None
    if data.startswith(codecs.BOM_UTF8):
        data = data[len(codecs.BOM_UTF8):]
    for n, raw in enumerate(data.split(b"\n"), 1):
        try:
            yield n, raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{source}: line {n} is not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                             "save the file as UTF-8, e.g. `iconv -f latin1 -t utf-8 OLD > NEW`") from None


_KINDS = {str: "a string", bool: "a boolean", int: "a number", float: "a number", list: "a list", dict: "an object",
          type(None): "null"}


def _kind(value) -> str:
    return _KINDS.get(type(value), type(value).__name__)


def _read_jsonl(source: str) -> dict:
    """The columns of a ``.jsonl`` prompt file (see :func:`load_prompts`), every line checked: valid JSON, an
    object, a non-empty string ``prompt``, and each key of one kind (string, number, boolean, or lists/objects)."""
    import json

    rows, lines = [], []
    for n, text in _read_lines(source):
        if not text.strip():
            continue
        try:
            row = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{source}: line {n}, column {e.colno}: invalid JSON ({e.msg}); each line must be one "
                             'JSON object, e.g. {"prompt": "a cat"}') from None
        if not isinstance(row, dict):
            raise ValueError(f"{source}: line {n} is {_kind(row)}, not a JSON object; each line must be one JSON "
                             'object, e.g. {"prompt": "a cat"}')
        if "prompt" not in row:
            raise ValueError(f"{source}: line {n} has no `prompt` key (keys: {sorted(row)})")
        prompt = row["prompt"]
        if not isinstance(prompt, str):
            raise ValueError(f"{source}: line {n}: `prompt` is {_kind(prompt)} ({json.dumps(prompt)[:80]}); each "
                             'prompt must be one string, e.g. "prompt": "a cat" (other information goes in other '
                             'keys)')
        if not prompt.strip():
            raise ValueError(f"{source}: line {n}: `prompt` is empty; drop the line or write the prompt")
        rows.append(row)
        lines.append(n)
    if not rows:
        raise ValueError(f"{source}: no prompts (the file holds no JSON object)")
    keys = sorted({k for r in rows for k in r}, key=lambda k: (k != "prompt", k))
    cols = {}
    for k in keys:
        vals = [r.get(k) for r in rows]
        first = {}  # kind -> line of its first value
        for n, v in zip(lines, vals):
            if v is not None:
                first.setdefault("nested" if isinstance(v, (list, dict)) else _kind(v), (n, v))
        if len(first) > 1:
            (n1, v1), (n2, v2) = list(first.values())[:2]
            raise ValueError(f"{source}: key `{k}` mixes types: line {n1} has {_kind(v1)} ({json.dumps(v1)[:40]}), "
                             f"line {n2} has {_kind(v2)} ({json.dumps(v2)[:40]}); give `{k}` one type on every line "
                             "(e.g. all strings)")
        if "nested" in first:
            vals = [None if v is None else json.dumps(v) for v in vals]
        _check_int64(source, k, lines, vals)
        cols[k] = vals
    return cols


def _check_int64(source: str, key: str, lines: list[int], values: list) -> None:
    """Arrow stores whole numbers in 64 bits: one beyond that is named (file, line, key) instead of pyarrow's
    ``OverflowError`` traceback."""
    for n, v in zip(lines, values):
        if isinstance(v, int) and not isinstance(v, bool) and not -2**63 <= v < 2**63:
            raise ValueError(f"{source}: line {n}: key `{key}` holds {str(v)[:30]}, a whole number beyond 64 bits "
                             f"(what Arrow can store); write it as a string (\"{str(v)[:20]}...\") or a float")


#: Prompt files other than .txt / .jsonl, read by ``datasets``' builder of that format.
DATA_FILE_BUILDERS = {".json": "json", ".csv": "csv", ".parquet": "parquet"}


def _load_data_file(source: str):
    """A ``.json`` / ``.csv`` / ``.parquet`` prompt file, through ``datasets``' builder for its format (given the
    file as ``load_dataset(source)`` would look for a dataset script or folder and say "Couldn't find any data
    file"). Any other file: a one-line error listing the formats."""
    import os

    from datasets import load_dataset

    ext = os.path.splitext(source)[1].lower()
    if ext not in DATA_FILE_BUILDERS:
        raise ValueError(f"{source}: a prompt file must be .txt (one prompt a line), .jsonl (one JSON object a line) "
                         f"or {', '.join(DATA_FILE_BUILDERS)} with a `prompt` column; got a {ext or 'suffix-less'} "
                         "file")
    try:
        ds = load_dataset(DATA_FILE_BUILDERS[ext], data_files=source, split="train")
    except Exception as e:  # noqa: BLE001 - the builders' errors name neither the file nor the format
        cause = " ".join(str(e).split())[:200]
        raise ValueError(f"{source}: cannot be read as {ext[1:].upper()} ({type(e).__name__}: {cause}); it must "
                         "hold a `prompt` column (JSON: a list of objects, or one object per line)") from None
    return check_prompt_dataset(ds, source)


def _resolve_paths(source: str, key: str, values: list) -> list:
    """Image paths of a ``.jsonl`` (strings or null) resolved against the file's folder."""
    import os

    folder = os.path.dirname(os.path.abspath(source))
    out = []
    for v in values:
        if v is not None and not isinstance(v, str):
            raise ValueError(f"{source}: key `{key}` must hold image paths (strings), got {_kind(v)}")
        out.append(v if v is None else os.path.normpath(os.path.join(folder, os.path.expanduser(v))))
    return out


def _from_columns(columns: dict, name: str):
    """``Dataset.from_dict`` of a dict of columns, with errors naming the column (Arrow's name none)."""
    import pyarrow as pa
    from datasets import Dataset

    for k, v in columns.items():
        if isinstance(v, (str, bytes)) or not hasattr(v, "__len__"):
            raise TypeError(f"{name}: column `{k}` must be a list of values, got {type(v).__name__} {v!r:.60}; "
                            f"e.g. {{{k!r}: [{v!r:.40}]}}")
    prompts = columns.get("prompt")
    if prompts is not None:
        bad = next((i for i, p in enumerate(prompts) if not isinstance(p, str)), None)
        if bad is not None:
            raise ValueError(f"{name}: `prompt` must hold strings; row {bad} is {prompts[bad]!r} "
                             f"({type(prompts[bad]).__name__})")
    try:
        return Dataset.from_dict(columns)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        for k, v in columns.items():
            try:
                Dataset.from_dict({k: v})
            except (pa.ArrowInvalid, pa.ArrowTypeError) as col_error:
                raise ValueError(f"{name}: column `{k}` mixes value types ({col_error}); give it one type in every "
                                 "row") from None
        raise ValueError(f"{name}: {e}") from None
