"""Ground-truth renderer of the shapes task: flat palette shapes on a black background.

Shapes are drawn on a coarse canvas of ``size // grid`` pixels and upsampled by ``grid`` (nearest). The default
``grid=2`` matches the base pipeline's VAE, whose latents are the 2x2 average pool of the image: a shape drawn on
the 2x2 grid survives the VAE round trip exactly, so the checker's ceiling on what the pipeline can represent
is 1.0 (shapes drawn at full 32x32 resolution, ``grid=1``, get blurred edges when pooled: the ceiling falls to
about 0.85).

Sizes (bounding-box side on a 16-pixel canvas, scaled with the canvas): a lone object 6-9, objects of a
two-object scene 6-7, scenes of three or more objects 5-6. Squares fill their box; circles are pixel-centre
discs of diameter d (fill 0.75-0.89); triangles point up with odd row widths 1, 1, 3, 3, 5, ... (fill 0.5-0.6).
Objects keep >= 1 empty canvas pixel between each other; position prompts are placed so that GenEval's relation
test passes with a margin (angle within ~45 degrees of the axis instead of 60).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from .grammar import PromptSpec, parse_prompt
from .reward import PALETTE, relation_holds

DEFAULT_GRID = 2
GAP = 1  # empty canvas pixels between objects (on a 16-pixel canvas; scales with the canvas)
RENDER_RELATION_THRESHOLD = 0.7


def _as_rng(rng) -> np.random.Generator:
    if isinstance(rng, np.random.Generator):
        return rng
    return np.random.default_rng(rng)


@lru_cache(maxsize=None)
def shape_stamp(shape: str, d: int) -> np.ndarray:
    """Boolean (d, d) mask of one shape with bounding-box side d (read-only, cached)."""
    y, x = np.mgrid[0:d, 0:d]
    if shape == "square":
        m = np.ones((d, d), dtype=bool)
    elif shape == "circle":
        c = d / 2.0
        m = (x + 0.5 - c) ** 2 + (y + 0.5 - c) ** 2 <= c * c
    elif shape == "triangle":
        half = y // 2  # row widths 1, 1, 3, 3, 5, 5, ...
        m = np.abs(x - (d - 1) // 2) <= half
    else:
        raise ValueError(f"unknown shape {shape!r}")
    m.setflags(write=False)
    return m


def _sizes(n_objects: int, canvas: int) -> tuple[int, int]:
    lo, hi = (6, 9) if n_objects == 1 else (6, 7) if n_objects == 2 else (5, 6)
    scale = canvas / 16.0
    return max(3, int(round(lo * scale))), max(3, int(round(hi * scale)))


def layout(spec: PromptSpec | str, rng=None, canvas: int = 16, max_tries: int = 400) -> list[tuple]:
    """Random placement of the objects of a prompt on a ``canvas`` x ``canvas`` grid.

    Returns a list of (color, shape, box) with box = (x0, y0, x1, y1) inclusive canvas coordinates of the
    shape's pixels.
    """
    spec = spec if isinstance(spec, PromptSpec) else parse_prompt(spec)
    rng = _as_rng(rng)
    items = [(o.color, o.shape) for o in spec.objects for _ in range(o.count)]
    lo, hi = _sizes(len(items), canvas)
    gap = max(1, int(round(GAP * canvas / 16)))
    for attempt in range(max_tries * 3):
        shrink = attempt // max_tries  # after max_tries failures, try smaller objects
        placed = []
        occupied = np.zeros((canvas + 2 * gap, canvas + 2 * gap), dtype=bool)  # padded by gap
        ok = True
        for color, shape in items:
            d = int(rng.integers(max(3, lo - shrink), max(3, hi - shrink) + 1))
            x0 = int(rng.integers(0, canvas - d + 1))
            y0 = int(rng.integers(0, canvas - d + 1))
            stamp = shape_stamp(shape, d)
            if (occupied[y0 + gap : y0 + gap + d, x0 + gap : x0 + gap + d] & stamp).any():
                ok = False
                break
            # mark the stamp dilated by `gap` (Chebyshev) as occupied
            for dy in range(2 * gap + 1):
                for dx in range(2 * gap + 1):
                    occupied[y0 + dy : y0 + dy + d, x0 + dx : x0 + dx + d] |= stamp
            ys, xs = np.nonzero(stamp)
            placed.append((color, shape, (x0 + xs.min(), y0 + ys.min(), x0 + xs.max(), y0 + ys.max()), (x0, y0, d)))
        if not ok:
            continue
        if spec.relation is not None and not relation_holds(
            placed[0][2], placed[1][2], spec.relation, RENDER_RELATION_THRESHOLD
        ):
            continue
        return placed
    raise RuntimeError(f"could not place {spec.to_prompt()!r} on a {canvas}x{canvas} canvas")


def render(
    prompt: PromptSpec | str, rng=None, size: int = 32, dtype: str = "uint8", grid: int = DEFAULT_GRID
) -> np.ndarray:
    """Renders one prompt: an array (3, size, size), uint8 in [0, 255] or (``dtype="float32"``) float in [0, 1].

    ``rng``: a ``numpy.random.Generator``, a seed, or None. ``grid``: shapes are drawn on a (size // grid)
    canvas and upsampled (2 = what the base pipeline's VAE represents exactly; 1 = full resolution).
    """
    if size % grid:
        raise ValueError("size must be a multiple of grid")
    canvas = size // grid
    img = np.zeros((3, canvas, canvas), dtype=np.float32)
    for color, shape, _box, (x0, y0, d) in layout(prompt, rng, canvas):
        stamp = shape_stamp(shape, d)
        region = img[:, y0 : y0 + d, x0 : x0 + d]
        region[:, stamp] = np.asarray(PALETTE[color], dtype=np.float32)[:, None]
    if grid > 1:
        img = img.repeat(grid, axis=1).repeat(grid, axis=2)
    if dtype == "uint8":
        return (img * 255).round().astype(np.uint8)
    return img.astype(dtype)


def render_batch(prompts, rng=None, size: int = 32, grid: int = DEFAULT_GRID):
    """Renders a list of B prompts into a float tensor (B, 3, size, size) in [0, 1]."""
    import torch

    rng = _as_rng(rng)
    return torch.from_numpy(np.stack([render(p, rng, size, dtype="float32", grid=grid) for p in prompts]))
