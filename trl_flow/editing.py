"""Source images of an editing dataset: checked at set-up, decoded lazily, handed to the adapter and the rewards.

An editing prompt dataset has, next to ``prompt``, a source-image column (default ``source_image``). A value is a
file path (str / ``os.PathLike``), a ``PIL.Image``, an array / tensor (H, W, 3) or (3, H, W) (uint8 in [0, 255] or
float in [0, 1]; a float one is quantised to 8 bits, as saving it to a file would), or what a ``datasets.Image``
column holds. The trainer checks every row when it is built (:func:`check_sources`: a path must exist, an in-memory
value must have a usable mode / shape; nothing is decoded) and decodes only the rows an iteration uses
(:func:`load_source`), to an RGB ``PIL.Image``: what an editing pipeline's ``image=`` takes. Rewards get the
decoded sources as a float32 (B, 3, H, W) tensor in [0, 1] at the generated size (:func:`source_tensor`).
"""

from __future__ import annotations

import os

import torch

#: Default name of the source-image column (a dataset column; the reward keyword is always ``source_image``).
SOURCE_COLUMN = "source_image"
#: PIL modes converted to RGB without loss of meaning (an alpha channel is dropped).
_MODES = ("RGB", "RGBA", "L", "P", "LA", "I;16", "CMYK", "YCbCr")


def _where(name: str, row: int | None, column: str) -> str:
    # row None: a batch's value, decoded lazily; the messages name a path themselves
    return f"{name}: column `{column}`" if row is None else f"{name}: row {row}, column `{column}`"


def _is_path(value) -> bool:
    return isinstance(value, (str, os.PathLike))


def check_sources(dataset, column: str, name: str = "train_dataset") -> list[tuple[int, int]]:
    """Check every row's source image without decoding it: a path must name an existing image file (its header is
    read); a PIL image must have an image mode; an array / tensor must be (H, W, 3) or (3, H, W) (or (H, W)) with
    H, W >= 1. Raises one ``ValueError`` naming the dataset, the row, the column and the fix, before any model
    compute. Returns each row's (width, height)."""
    if column not in dataset.column_names:
        raise ValueError(f"{name}: no `{column}` column (columns: {dataset.column_names}); an editing pipeline "
                         f"needs a source image per prompt: add a `{column}` column of image paths or images")
    from datasets import Image as ImageFeature

    values = dataset.cast_column(column, ImageFeature(decode=False))[column] if isinstance(
        dataset.features[column], ImageFeature) else dataset[column]
    return [_check_value(value, _where(name, row, column)) for row, value in enumerate(values)]


def _check_value(value, where: str) -> tuple[int, int]:
    """The (width, height) of a valid source value; a ``ValueError`` starting with ``where`` otherwise."""
    from PIL import Image

    if value is None:
        raise ValueError(f"{where}: no source image (None); give every row an image path or drop the row")
    if isinstance(value, dict) and ("path" in value or "bytes" in value):  # datasets.Image(decode=False)
        if value.get("bytes") is None and (value.get("path") is None or not os.path.isfile(value["path"])):
            raise ValueError(f"{where}: image file {value.get('path')!r} not found")
        if value.get("bytes") is None:
            value = value["path"]
        else:
            import io

            try:
                with Image.open(io.BytesIO(value["bytes"])) as im:
                    return im.size
            except OSError as e:
                raise ValueError(f"{where}: the stored image bytes are not a readable image ({e})") from None
    if _is_path(value):
        if not os.path.isfile(value):
            raise ValueError(f"{where}: image file {os.fspath(value)!r} not found (relative paths are resolved "
                             f"against the working directory {os.getcwd()!r}; load_prompts resolves a .jsonl's "
                             "paths against its folder)")
        try:  # reads the header only: an unreadable file fails here, its pixels are decoded when used
            with Image.open(value) as im:
                return im.size
        except OSError as e:
            raise ValueError(f"{where}: {os.fspath(value)!r} is not a readable image ({type(e).__name__})") from None
    if isinstance(value, Image.Image):
        if value.mode not in _MODES:
            raise ValueError(f"{where}: PIL image of mode {value.mode!r}; convert it, e.g. image.convert('RGB')")
        return value.size
    shape = tuple(getattr(value, "shape", ()))
    if not shape and isinstance(value, (list, tuple)):
        import numpy as np

        shape = np.asarray(value).shape
    if not _array_ok(shape):
        raise ValueError(f"{where}: an image array must be (H, W, 3), (3, H, W) or (H, W), got shape {shape} "
                         f"({type(value).__name__})")
    h, w = shape[1:] if len(shape) == 3 and shape[0] == 3 and shape[-1] != 3 else shape[:2]
    return int(w), int(h)


def _array_ok(shape) -> bool:
    if len(shape) == 2:
        return min(shape) >= 1
    return len(shape) == 3 and (shape[-1] == 3 or shape[0] == 3) and min(shape) >= 1


def load_source(value, row: int | None, column: str, name: str = "train_dataset"):
    """Decode one source image to an RGB ``PIL.Image``; a missing, unreadable or malformed one raises a one-line
    ``ValueError`` naming the dataset, the row (or, for ``row=None``, the value's path) and the column."""
    import numpy as np
    from PIL import Image, UnidentifiedImageError

    where = _where(name, row, column)
    _check_value(value, where)
    try:
        if isinstance(value, dict):
            from datasets import Image as ImageFeature

            value = ImageFeature().decode_example(value)
        if _is_path(value):
            with Image.open(value) as im:
                im.load()
                value = im.copy()
        if isinstance(value, Image.Image):
            return value if value.mode == "RGB" else value.convert("RGB")
    except (OSError, UnidentifiedImageError, ValueError) as e:
        what = repr(os.fspath(value)) if _is_path(value) else "the image"
        raise ValueError(f"{where}: cannot decode {what} ({type(e).__name__}: {e}); check the file") from None
    a = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
    if a.ndim == 3 and a.shape[0] == 3 and a.shape[-1] != 3:
        a = a.transpose(1, 2, 0)
    integer = np.issubdtype(a.dtype, np.integer) or a.dtype == bool
    if a.dtype != np.uint8:  # integers in [0, 255] (a datasets column of arrays holds int64 lists) or floats in [0, 1]
        hi = 255 if integer else 1
        if not (integer or np.issubdtype(a.dtype, np.floating)) or not np.isfinite(a).all() or a.min() < 0 \
                or a.max() > hi:
            raise ValueError(f"{where}: an image array must be integers in [0, 255] or floats in [0, 1], got "
                             f"{a.dtype} in [{a.min()}, {a.max()}]")
        a = a.astype(np.uint8) if integer else np.round(a * 255).astype(np.uint8)
    return Image.fromarray(a).convert("RGB")


def load_sources(values, rows, column: str, name: str = "train_dataset") -> list:
    """:func:`load_source` of each value (``rows``: their dataset row numbers, for the error message)."""
    return [load_source(v, r, column, name) for v, r in zip(values, rows)]


def source_tensor(images, height: int, width: int) -> torch.Tensor:
    """(B, 3, height, width) float32 in [0, 1] of RGB PIL images, each resized to the generated size with PIL's
    bicubic filter (what the rewards receive as ``source_image``)."""
    import numpy as np
    from PIL import Image

    out = [torch.from_numpy(np.asarray(im.resize((width, height), Image.BICUBIC) if im.size != (width, height)
                                       else im, dtype=np.float32) / 255.0).permute(2, 0, 1) for im in images]
    return torch.stack(out) if out else torch.zeros(0, 3, height, width)


def check_dataset_for(adapter, dataset, name: str) -> None:
    """Set-up check of a train / eval dataset against the adapter: an editing adapter needs its source column on
    every row; a text-to-image adapter refuses a dataset with a ``source_image`` column (it would ignore the
    images and learn edit instructions as text-to-image prompts)."""
    if dataset is None:
        return
    column = getattr(adapter, "source_column", SOURCE_COLUMN)
    choose = getattr(adapter, "choose_conditioning", None)
    if choose is not None:  # a family that both generates and edits (Qwen-Image 2.1): the dataset decides
        choose(column in dataset.column_names, name)
    if adapter.conditioning == "text_and_image":
        adapter.check_source_sizes(check_sources(dataset, column, name), f"{name}, column `{column}`")
    elif SOURCE_COLUMN in dataset.column_names:
        raise ValueError(f"{name}: has a `{SOURCE_COLUMN}` column, but {type(adapter).__name__} generates from text "
                         "alone and would ignore the source images; use an editing pipeline (e.g. "
                         f"FluxKontextPipeline) or drop the column: dataset.remove_columns('{SOURCE_COLUMN}')")


def adapter_images(adapter, columns: dict, name: str = "train_dataset") -> list | None:
    """The decoded sources (RGB PIL images) of a batch's ``columns`` for an editing adapter, None for a
    text-to-image one. Each distinct path is decoded once."""
    if adapter.conditioning != "text_and_image":
        return None
    column = getattr(adapter, "source_column", SOURCE_COLUMN)
    if column not in columns:
        raise ValueError(f"{type(adapter).__name__} needs the `{column}` column (a source image per prompt); got "
                         f"columns {sorted(columns)}; pass the prompts' dataset columns, e.g. "
                         f"trainer.generate(prompts, columns={{'{column}': images}})")
    memo, out = {}, []
    for v in columns[column]:
        key = os.fspath(v) if _is_path(v) else id(v)
        if key not in memo:  # decoded when used: a file that changed since set-up is named by its path
            memo[key] = load_source(v, None, column, name)
        out.append(memo[key])
    return out


def reward_columns(adapter, columns: dict, height: int, width: int) -> dict:
    """The columns the rewards get: for an editing adapter the source column is replaced by ``source_image``, the
    decoded sources as (B, 3, height, width) float32 in [0, 1] (:func:`source_tensor`)."""
    images = adapter_images(adapter, columns)
    if images is None:
        return columns
    column = getattr(adapter, "source_column", SOURCE_COLUMN)
    out = {k: v for k, v in columns.items() if k != column}
    out[SOURCE_COLUMN] = source_tensor(images, height, width)
    return out
