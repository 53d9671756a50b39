"""Editing pairs of the shapes task: instructions, source scenes and the scenes the edit should produce.

Instructions come from a small fixed grammar over the task's colours, shapes and four directions:

==========  ==================================  =========================================================
kind        example                             the edit
==========  ==================================  =========================================================
``recolor`` "make the red square blue"          the one red square turns blue; its box stays where it was
``move``    "move the green circle left"        the one green circle moves ``MOVE_CELLS`` canvas pixels
                                                (8 image pixels at 32 x 32) left / right / up / down
==========  ==================================  =========================================================

18 recolour (colour, shape, new colour) and 36 move (colour, shape, direction) instructions, 54 in all. A scene is
the named object plus, with probability ``SECOND_OBJECT_PROB``, one other object of another (colour, shape)
combination, placed by the renderer's :func:`~trl_flow.tasks.shapes.render.layout`; the target is the same layout
with the edit applied (untouched objects keep their colour, shape, position and size). Scenes are drawn on the
16-pixel canvas and upsampled 2x like every rendered image of the task (exact under the base pipeline's VAE).

Fixed train / held-out split of the instructions (no RNG): a recolour instruction is held out when
``(colour index + shape index + new colour index) % 3 == 0`` (6 of 18), a move instruction when
``(colour index + shape index + direction index) % 4 == 0`` (9 of 36); see :func:`is_test_instruction`. Every
object, new colour and direction of a held-out instruction is seen in training, never in that combination.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .grammar import COLORS, SHAPES, ObjectSpec, PromptSpec
from .render import GAP, _as_rng, layout, shape_stamp

DIRECTIONS: dict[str, tuple[int, int]] = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
EDIT_KINDS: tuple[str, ...] = ("recolor", "move")
MOVE_CELLS = 4  # canvas pixels a move shifts the object by (x2 in the 32 x 32 image)
SECOND_OBJECT_PROB = 0.5
CANVAS = 16

# Every word an instruction can use (the editing base's tokenizers make each one token).
EDIT_VOCABULARY: tuple[str, ...] = ("make", "move", "the", *COLORS, *SHAPES, *DIRECTIONS)


@dataclass(frozen=True)
class EditSpec:
    """One instruction: ``kind`` (``"recolor"`` / ``"move"``), the object (``color``, ``shape``) it names and its
    ``new_color`` (recolour) or ``direction`` (move, one of ``DIRECTIONS``)."""

    kind: str
    color: str
    shape: str
    new_color: str | None = None
    direction: str | None = None

    def to_instruction(self) -> str:
        if self.kind == "recolor":
            return f"make the {self.color} {self.shape} {self.new_color}"
        return f"move the {self.color} {self.shape} {self.direction}"


def parse_instruction(text: str) -> EditSpec:
    """Parses an instruction of the grammar (raises ``ValueError`` naming the problem otherwise).

    >>> parse_instruction("make the red square blue")
    EditSpec(kind='recolor', color='red', shape='square', new_color='blue', direction=None)
    """
    words = text.strip().lower().rstrip(".").split()
    if len(words) != 5 or words[1] != "the" or words[0] not in ("make", "move"):
        raise ValueError(f"cannot parse edit instruction {text!r}: expected 'make the <colour> <shape> <colour>' "
                         "or 'move the <colour> <shape> <left|right|up|down>'")
    _, _, color, shape, last = words
    if color not in COLORS or shape not in SHAPES:
        raise ValueError(f"edit instruction {text!r}: unknown colour {color!r} or shape {shape!r}")
    if words[0] == "make":
        if last not in COLORS or last == color:
            raise ValueError(f"edit instruction {text!r}: the new colour must be another of {COLORS}")
        return EditSpec("recolor", color, shape, new_color=last)
    if last not in DIRECTIONS:
        raise ValueError(f"edit instruction {text!r}: unknown direction {last!r} (one of {tuple(DIRECTIONS)})")
    return EditSpec("move", color, shape, direction=last)


def all_edits() -> list[EditSpec]:
    """Every instruction: the 18 recolour ones, then the 36 move ones (colour-major)."""
    out = [EditSpec("recolor", c, s, new_color=n) for c in COLORS for s in SHAPES for n in COLORS if n != c]
    out += [EditSpec("move", c, s, direction=d) for c in COLORS for s in SHAPES for d in DIRECTIONS]
    return out


def is_test_instruction(edit: EditSpec | str) -> bool:
    """Whether an instruction belongs to the fixed held-out split (see the module docstring)."""
    e = edit if isinstance(edit, EditSpec) else parse_instruction(edit)
    base = COLORS.index(e.color) + SHAPES.index(e.shape)
    if e.kind == "recolor":
        return (base + COLORS.index(e.new_color)) % 3 == 0
    return (base + list(DIRECTIONS).index(e.direction)) % 4 == 0


def train_instructions() -> list[str]:
    return [e.to_instruction() for e in all_edits() if not is_test_instruction(e)]


def test_instructions() -> list[str]:
    return [e.to_instruction() for e in all_edits() if is_test_instruction(e)]


test_instructions.__test__ = False  # type: ignore[attr-defined]


# ------------------------------------------------------------------------------------------------ scenes
Item = tuple  # (color, shape, x0, y0, d): a shape of bounding-box side d at canvas cell (x0, y0)


def _fits(items: list[Item], index: int, canvas: int = CANVAS) -> bool:
    """Whether item ``index`` lies inside the canvas and keeps ``GAP`` empty pixels from every other item."""
    color, shape, x0, y0, d = items[index]
    if x0 < 0 or y0 < 0 or x0 + d > canvas or y0 + d > canvas:
        return False
    occupied = np.zeros((canvas + 2 * GAP, canvas + 2 * GAP), dtype=bool)  # padded by GAP, as render.layout
    for j, (_, s, x, y, dd) in enumerate(items):
        if j != index:
            stamp = shape_stamp(s, dd)
            for dy in range(2 * GAP + 1):
                for dx in range(2 * GAP + 1):
                    occupied[y + dy: y + dy + dd, x + dx: x + dx + dd] |= stamp
    return not (occupied[y0 + GAP: y0 + GAP + d, x0 + GAP: x0 + GAP + d] & shape_stamp(shape, d)).any()


def apply_edit(items: list[Item], edit: EditSpec) -> list[Item] | None:
    """The target scene: ``items`` with ``edit`` applied to its (first) named object (None when the moved object
    would leave the canvas or touch another object)."""
    idx = next(i for i, it in enumerate(items) if it[:2] == (edit.color, edit.shape))
    out = list(items)
    color, shape, x0, y0, d = items[idx]
    if edit.kind == "recolor":
        out[idx] = (edit.new_color, shape, x0, y0, d)
        return out
    dx, dy = DIRECTIONS[edit.direction]
    out[idx] = (color, shape, x0 + dx * MOVE_CELLS, y0 + dy * MOVE_CELLS, d)
    return out if _fits(out, idx) else None


def sample_scene(edit: EditSpec | str, rng=None, max_tries: int = 200) -> tuple[list[Item], list[Item]]:
    """A random (source, target) pair of scenes for an instruction: lists of (color, shape, x0, y0, d) canvas
    items. The source holds the named object once, and maybe one other object of another combination."""
    e = edit if isinstance(edit, EditSpec) else parse_instruction(edit)
    rng = _as_rng(rng)
    others = [(c, s) for c in COLORS for s in SHAPES if (c, s) != (e.color, e.shape)]
    for _ in range(max_tries):
        objects = [ObjectSpec(e.color, e.shape)]
        if rng.random() < SECOND_OBJECT_PROB:
            objects.append(ObjectSpec(*others[rng.integers(len(others))]))
        spec = PromptSpec(tuple(objects), None, "single" if len(objects) == 1 else "colors")
        source = [(c, s, x0, y0, d) for c, s, _box, (x0, y0, d) in layout(spec, rng, CANVAS)]
        target = apply_edit(source, e)
        if target is not None:
            return source, target
    raise RuntimeError(f"could not place a scene for {e.to_instruction()!r}")


def draw(items: list[Item], size: int = 32) -> np.ndarray:
    """Draws canvas items: uint8 array (3, size, size) (the canvas upsampled ``size // CANVAS`` x, nearest)."""
    from .reward import PALETTE

    img = np.zeros((3, CANVAS, CANVAS), dtype=np.float32)
    for color, shape, x0, y0, d in items:
        region = img[:, y0: y0 + d, x0: x0 + d]
        region[:, shape_stamp(shape, d)] = np.asarray(PALETTE[color], dtype=np.float32)[:, None]
    g = size // CANVAS
    img = img.repeat(g, axis=1).repeat(g, axis=2)
    return (img * 255).round().astype(np.uint8)


def render_pair(edit: EditSpec | str, rng=None, size: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """A rendered (source, target) pair for an instruction: two uint8 arrays (3, size, size)."""
    source, target = sample_scene(edit, rng)
    return draw(source, size), draw(target, size)


def edit_rows(instructions, n: int, seed: int) -> dict[str, list]:
    """``n`` editing rows cycling through ``instructions``, each with its own scene: ``{"prompt": [...],
    "source_image": [PIL images 32 x 32], "target": [uint8 (3, 32, 32)]}`` (a dataset's columns)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    rows: dict[str, list] = {"prompt": [], "source_image": [], "target": []}
    for i in range(n):
        text = instructions[i % len(instructions)]
        src, tgt = render_pair(text, rng)
        rows["prompt"].append(text)
        rows["source_image"].append(Image.fromarray(src.transpose(1, 2, 0)))
        rows["target"].append(tgt)
    return rows


def edit_dataset(instructions, n: int, seed: int):
    """A ``datasets.Dataset`` of ``n`` editing rows (``prompt`` and ``source_image`` columns; see
    :func:`edit_rows`), ready as a trainer's ``train_dataset`` / ``eval_dataset`` for an editing pipeline."""
    import datasets

    rows = edit_rows(instructions, n, seed)
    return datasets.Dataset.from_dict({"prompt": rows["prompt"], "source_image": rows["source_image"]})

