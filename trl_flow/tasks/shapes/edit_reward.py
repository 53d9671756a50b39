"""The detector reward of the shapes editing task: was the instructed edit made, and nothing else changed?

The detector of :mod:`~trl_flow.tasks.shapes.reward` runs on the source and on the output. The named object is the
one source object of the instruction's colour and shape (a source without exactly one is refused). Constraints:

* ``edited``: the output holds the edited object: recolour: the new colour, same shape, box within ``BOX_TOL`` of
  the source box (each coordinate); move: same colour and shape, box = the source box shifted ``MOVE_CELLS`` canvas
  pixels (``2 * MOVE_CELLS`` image pixels at 32 x 32) in the direction, within ``BOX_TOL``;
* ``gone``: no object of the named colour and shape is left at the source box (within ``BOX_TOL``);
* ``kept`` (one per untouched source object): an output object of its colour and shape with its box within
  ``BOX_TOL``;
* ``count``: the output has as many objects as the source (nothing added, nothing lost).

``strict`` = 1 when all hold, ``partial`` = the share that hold. The target scene scores 1; the unedited source
scores 0 (partial 0.5 or 0.6: it keeps the untouched objects and the count). ``BOX_TOL`` is 2 pixels at 32 x 32 (one
canvas pixel), scaled with the image size.
"""

from __future__ import annotations

import numpy as np

from .edit import DIRECTIONS, MOVE_CELLS, CANVAS, EditSpec, parse_instruction
from .reward import _iter_images, detect

BOX_TOL_AT_32 = 2


def _near(box_a, box_b, tol: float) -> bool:
    return max(abs(a - b) for a, b in zip(box_a, box_b)) <= tol


def edit_constraints(output, source, instruction: EditSpec | str) -> dict[str, list[bool]]:
    """The constraint outcomes by name (``edited``, ``gone``, ``kept``, ``count``; see the module docstring).
    ``output``, ``source``: one image each, (3, H, W) in [0, 1] (or what :func:`~.reward.detect` takes)."""
    e = instruction if isinstance(instruction, EditSpec) else parse_instruction(instruction)
    src, out = detect(source), detect(output)
    h = np.asarray(source.shape[-2:] if hasattr(source, "shape") else (32, 32))[0]
    tol = BOX_TOL_AT_32 * h / 32
    named = [o for o in src if (o["color"], o["shape"]) == (e.color, e.shape)]
    if len(named) != 1:
        raise ValueError(f"shapes_edit: the source image holds {len(named)} {e.color} {e.shape}s (detected: "
                         f"{[(o['color'], o['shape']) for o in src]}); the instruction {e.to_instruction()!r} needs "
                         "exactly one (render sources with trl_flow.tasks.shapes.edit)")
    box = named[0]["box"]
    if e.kind == "recolor":
        want = (e.new_color, e.shape, box)
    else:
        step = MOVE_CELLS * h / CANVAS
        dx, dy = DIRECTIONS[e.direction]
        want = (e.color, e.shape, tuple(v + step * (dx if i % 2 == 0 else dy) for i, v in enumerate(box)))
    has = [(o["color"], o["shape"]) for o in out]
    groups = {
        "edited": [any(c == want[:2] and _near(o["box"], want[2], tol) for c, o in zip(has, out))],
        "gone": [not any(c == (e.color, e.shape) and _near(o["box"], box, tol) for c, o in zip(has, out))],
        "kept": [any(c == (u["color"], u["shape"]) and _near(o["box"], u["box"], tol) for c, o in zip(has, out))
                 for u in src if u is not named[0]],
        "count": [len(out) == len(src)],
    }
    return groups


def edit_score(output, source, instruction) -> dict[str, float]:
    """``{"strict": 0/1, "partial": share of constraints met}`` of one edited image against its source."""
    met = [ok for group in edit_constraints(output, source, instruction).values() for ok in group]
    return {"strict": float(all(met)), "partial": float(np.mean(met))}


def _check(images, prompts, source_image):
    if source_image is None:
        raise ValueError("shapes_edit needs source_image (an editing dataset with a `source_image` column and an "
                         "editing pipeline, e.g. trl_flow.tasks.shapes.load_edit_base_pipeline())")
    imgs, srcs = list(_iter_images(images)), list(_iter_images(source_image))
    if isinstance(prompts, str):
        prompts = [prompts]
    if not len(imgs) == len(srcs) == len(prompts):
        raise ValueError(f"shapes_edit: got {len(imgs)} images, {len(srcs)} source images and {len(prompts)} prompts")
    return imgs, srcs, prompts


def shapes_edit_reward(images, prompts, source_image=None, **columns) -> list[float]:
    """Strict edit success per image (1.0 when every constraint holds). ``images``, ``source_image``: float tensors
    (B, 3, H, W) in [0, 1]; ``prompts``: B instructions of :mod:`~trl_flow.tasks.shapes.edit`'s grammar."""
    return [edit_score(i, s, p)["strict"] for i, s, p in zip(*_check(images, prompts, source_image))]


def shapes_edit_partial_reward(images, prompts, source_image=None, **columns) -> list[float]:
    """Share of the edit's constraints met per image (see the module docstring); arguments as
    :func:`shapes_edit_reward`."""
    return [edit_score(i, s, p)["partial"] for i, s, p in zip(*_check(images, prompts, source_image))]


shapes_edit_reward.__name__ = "shapes_edit"
shapes_edit_partial_reward.__name__ = "shapes_edit_partial"


def evaluate_edits(images, prompts, sources) -> dict[str, dict[str, float]]:
    """Strict / partial edit success and shape cleanliness, overall and per edit kind: ``{"overall": {"strict",
    "partial", "cleanliness", "n"}, "recolor": {...}, "move": {...}}`` (the kinds present)."""
    from .reward import shape_cleanliness

    imgs, srcs, prompts = _check(images, prompts, sources)
    rows = []
    for img, src, p in zip(imgs, srcs, prompts):
        s = edit_score(img, src, p)
        rows.append((parse_instruction(p).kind, s["strict"], s["partial"], shape_cleanliness([img])[0]))

    def summary(sel):
        return {"strict": float(np.mean([r[1] for r in sel])), "partial": float(np.mean([r[2] for r in sel])),
                "cleanliness": float(np.mean([r[3] for r in sel])), "n": len(sel)}

    out = {"overall": summary(rows)}
    for kind in ("recolor", "move"):
        sel = [r for r in rows if r[0] == kind]
        if sel:
            out[kind] = summary(sel)
    return out
