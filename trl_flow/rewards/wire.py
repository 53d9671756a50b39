"""The JSON wire format of remote rewards (schema version 1), shared by the reward server and :class:`RemoteReward`.

``POST /score`` request::

    {"schema_version": 1,
     "images":  [PNG, ...]              # one base64 PNG (RGB, 8 bit) per sample, or per sample a list of
                                        # frame PNGs for video; every image of a request has the same size
     "prompts": ["...", ...],           # one per sample
     "columns": {"name": [v, ...]},     # optional: other dataset columns, one JSON value per sample
     "source_images": [PNG, ...]}       # optional: an editing run's source images (the reward's `source_image=`),
                                        # one base64 PNG per sample, all of one size (the generated one)

answer: ``{"schema_version": 1, "reward": NAME, "scores": [float | null, ...]}`` (one per sample, null = no
score). ``GET /health`` answers ``{"status": "ok", "schema_version": 1, "reward": NAME}``. Errors answer an HTTP
status >= 400 with ``{"detail": ...}``. No pickle anywhere: images are PNG, everything else is JSON.
"""

from __future__ import annotations

import base64
import binascii
import io

import numpy as np
import torch

from .base import to_uint8

SCHEMA_VERSION = 1
MAX_IMAGE_PIXELS = 4096 * 4096
#: Pixels a request may hold in all (every image and frame), what bounds the server's memory per request (decoding
#: takes about 21 bytes per pixel at its peak: 0.7 GB here): 2**25 = 32 images of 1024x1024, or 2 of 4096x4096.
MAX_REQUEST_PIXELS = 2**25


def _png(chw_uint8: np.ndarray) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(chw_uint8.transpose(1, 2, 0)).save(buf, format="PNG", compress_level=1)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def encode_images(images: torch.Tensor) -> list:
    """(B, 3, H, W) or video (B, F, 3, H, W) floats in [0, 1] -> B base64 PNGs (video: B lists of F PNGs)."""
    arr = to_uint8(images).numpy()
    if arr.ndim == 5:
        return [[_png(f) for f in frames] for frames in arr]
    return [_png(a) for a in arr]


class TooManyPixels(ValueError):
    """A request whose images have more pixels in all than the server decodes (HTTP 413)."""


def _open_png(data: str, where: str, max_pixels: int):
    """The PNG of a base64 string, opened lazily: only its header is read (size and format), no pixel."""
    from PIL import Image

    try:
        raw = base64.b64decode(data, validate=True)
        im = Image.open(io.BytesIO(raw))
    except (binascii.Error, ValueError, OSError) as e:
        raise ValueError(f"{where}: not a base64 PNG ({type(e).__name__})") from None
    if im.format != "PNG":
        raise ValueError(f"{where}: expected a PNG, got {im.format}")
    if im.size[0] * im.size[1] > max_pixels:
        raise ValueError(f"{where}: {im.size[0]}x{im.size[1]} is over the limit of {max_pixels} pixels")
    return im


def _pixels(im, where: str) -> np.ndarray:
    try:
        return np.asarray(im.convert("RGB")).transpose(2, 0, 1)
    except OSError as e:
        raise ValueError(f"{where}: broken PNG ({e})") from None


def _open_all(items: list, field: str, max_pixels: int) -> tuple[list, int, bool]:
    """Every PNG of ``items`` opened lazily (headers only): per sample a list of (where, image), the pixels in all
    (every frame counted) and whether the items are videos."""
    video = isinstance(items[0], list)
    opened = []  # (where, lazily opened PNG) per image, or per sample a list of frames
    total = 0
    for i, item in enumerate(items):
        if isinstance(item, list) != video:
            raise ValueError(f"{field}[{i}]: mixes single images and videos (lists of frames) in one request")
        if video:
            if not item:
                raise ValueError(f"{field}[{i}]: a video needs at least one frame")
            frames = [(f"{field}[{i}][{j}]", _open_png(f, f"{field}[{i}][{j}]", max_pixels))
                      for j, f in enumerate(item)]
        else:
            frames = [(f"{field}[{i}]", _open_png(item, f"{field}[{i}]", max_pixels))]
        total += sum(im.size[0] * im.size[1] for _, im in frames)
        opened.append(frames)
    return opened, total, video


def _decode_all(opened: list, video: bool, field: str) -> torch.Tensor:
    arrays = []
    for frames in opened:
        decoded = [_pixels(im, where) for where, im in frames]
        arrays.append(np.stack(decoded) if video else decoded[0])
    shapes = {a.shape for a in arrays}
    if len(shapes) > 1:
        raise ValueError(f"{field}: all images of a request must have the same size (and frame count), got {shapes}")
    return torch.from_numpy(np.stack(arrays)).float().div_(255.0)


def _too_many(what: str, total: int, max_total_pixels: int) -> TooManyPixels:
    return TooManyPixels(
        f"request of {what} has {total} pixels in all, over the limit of {max_total_pixels} pixels per request; "
        "send smaller batches (RemoteReward(batch_size=...), or ?batch_size= in a --reward_funcs URL) or start the "
        "server with a larger --max-request-pixels")


def decode_images(items: list, max_pixels: int = MAX_IMAGE_PIXELS,
                  max_total_pixels: int | None = MAX_REQUEST_PIXELS) -> torch.Tensor:
    """The inverse of :func:`encode_images`: float32 (B, 3, H, W) or (B, F, 3, H, W) in [0, 1]. Raises
    ``ValueError`` naming the offending entry, and :class:`TooManyPixels` when the images (every frame counted)
    have more than ``max_total_pixels`` pixels in all. Both limits are checked on the PNG headers of every image
    before any pixel is decoded."""
    return decode_request(items, None, max_pixels, max_total_pixels)[0]


def decode_request(items: list, source_items: list | None, max_pixels: int = MAX_IMAGE_PIXELS,
                   max_total_pixels: int | None = MAX_REQUEST_PIXELS) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A request's ``images`` and ``source_images`` (None: none sent), as :func:`decode_images` decodes them; the
    pixel limit counts both, checked on the PNG headers before any pixel is decoded. The sources must be single
    images (B, 3, H, W)."""
    if not items:
        return torch.zeros(0, 3, 1, 1), None if source_items is None else torch.zeros(0, 3, 1, 1)
    opened, total, video = _open_all(items, "images", max_pixels)
    what = f"{len(items)} {'videos' if video else 'images'}"
    sources = None
    if source_items is not None:
        sources, source_total, source_video = _open_all(source_items, "source_images", max_pixels)
        if source_video:
            raise ValueError("source_images: one PNG per sample, not lists of frames")
        total += source_total
        what += f" and {len(source_items)} source images"
    if max_total_pixels is not None and total > max_total_pixels:
        raise _too_many(what, total, max_total_pixels)
    return (_decode_all(opened, video, "images"),
            None if sources is None else _decode_all(sources, False, "source_images"))


def parse_scores(answer, n: int, where: str) -> list[float | None]:
    """Check a ``/score`` answer and return its scores; any deviation is a ``ValueError`` saying what is wrong."""
    if not isinstance(answer, dict):
        raise ValueError(f"{where} answered {type(answer).__name__}, expected a JSON object")
    if answer.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(f"{where} speaks schema_version {answer.get('schema_version')!r}, this client "
                         f"{SCHEMA_VERSION}; use the same trl_flow version on both sides")
    scores = answer.get("scores")
    if not isinstance(scores, list):
        raise ValueError(f"{where} answered without a `scores` list: {str(answer)[:200]}")
    if len(scores) != n:
        raise ValueError(f"{where} answered {len(scores)} scores for {n} images")
    out = []
    for s in scores:
        if s is not None and (isinstance(s, bool) or not isinstance(s, (int, float))):
            raise ValueError(f"{where} answered a non-numeric score {s!r}")
        out.append(None if s is None else float(s))
    return out
