"""Detector, scores and reward functions of the shapes task.

The detector assigns every pixel to its nearest palette colour (black background, red, green, blue), finds the
4-connected components of each colour (pieces smaller than ``MIN_PIXELS_AT_32`` pixels at 32x32, scaled with
the image area, are ignored) and classifies each component's shape by its fill ratio (area / bounding-box
area) and its corner occupancy (the share of the box's four corner patches, each a quarter of the side, that it
covers): fill >= 0.7 is a square when the corner occupancy is >= 0.625, else a circle; fill >= 0.4 a triangle;
lower fill ratios and lopsided boxes (aspect ratio outside [0.6, 1/0.6]) are ``"other"``. The rule was chosen
from measured distributions (docs/shapes.md): rendered discs reach fill 0.89 (the smallest ones) but never a
corner occupancy above 0.556, and the base models draw squares with soft corners (fill median 0.86).

A prompt is turned into constraints (all counts are exact):

* for every colour named: number of components of that colour (any shape) == requested number;
* for every shape named: number of components of that shape (any colour) == requested number;
* for every object: at least one component of its colour and shape (presence), and the number of such
  components == its count (binding, counting);
* total number of components == total requested (nothing extra);
* for position prompts: both objects found exactly once and the relation holds (GenEval's rule:
  ``relation_holds``).

``partial`` = share of constraints met, ``strict`` = 1 if all are met. Strict on a rendered ground-truth image
is 1 (>= 0.98 after the VAE round trip of the base pipeline, see tests); on uniform noise about 0.

Reward callables follow the library contract ``reward(images, prompts, **columns) -> list[float]`` with
``images`` a float tensor (B, 3, H, W) in [0, 1]; extra dataset columns are accepted and ignored.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from .grammar import CATEGORIES, COLORS, PromptSpec, parse_prompt

# RGB in [0, 1]; index 0 is the background.
PALETTE: dict[str, tuple[float, float, float]] = {
    "black": (0.0, 0.0, 0.0),
    "red": (1.0, 0.0, 0.0),
    "green": (0.0, 1.0, 0.0),
    "blue": (0.0, 0.0, 1.0),
}
_PALETTE_NAMES = list(PALETTE)
_PALETTE_ARRAY = np.array(list(PALETTE.values()), dtype=np.float32)  # (4, 3)
assert _PALETTE_NAMES[1:] == list(COLORS)

MIN_PIXELS_AT_32 = 20
SQUARE_CORNER = 0.625  # corner occupancy from which a full (fill >= CIRCLE_FILL) component is a square
CIRCLE_FILL = 0.7
TRIANGLE_FILL = 0.4
MAX_ASPECT = 1.0 / 0.6
POSITION_THRESHOLD = 0.1  # GenEval: offsets shrink by 0.1 x (sum of box sizes) before the angle test
CLEAN_DISTANCE = 0.25  # shape_cleanliness: a pixel is clean when within this RGB distance of a palette colour


# --------------------------------------------------------------------------------------------------- images


def to_hwc_float(image) -> np.ndarray:
    """Converts one image to a float32 array (H, W, 3) in [0, 1].

    Accepts a torch tensor or numpy array (3, H, W) or (H, W, 3) (float in [0, 1] or uint8 in [0, 255]) or a
    PIL image.
    """
    if hasattr(image, "convert") and hasattr(image, "size") and not hasattr(image, "shape"):  # PIL
        return np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0
    if hasattr(image, "detach"):  # torch tensor
        t = image.detach().cpu()
        image = t.numpy() if str(t.dtype) == "torch.uint8" else t.float().numpy()
    arr = np.asarray(image)
    if arr.ndim != 3:
        raise ValueError(f"expected one image (3, H, W) or (H, W, 3), got shape {arr.shape}")
    if arr.shape[0] == 3 and arr.shape[-1] != 3:
        arr = arr.transpose(1, 2, 0)
    elif arr.shape[0] == 3 and arr.shape[-1] == 3:  # 3x3 image: assume CHW
        arr = arr.transpose(1, 2, 0)
    if arr.dtype == np.uint8:
        return arr.astype(np.float32) / 255.0
    return np.clip(arr.astype(np.float32), 0.0, 1.0)


def _iter_images(images):
    """Yields single images from a batch tensor/array (B, 3, H, W), a list of images or a list of PIL images."""
    if hasattr(images, "shape") and len(images.shape) == 3:
        yield images
        return
    for image in images:
        yield image


def palette_labels(image) -> np.ndarray:
    """Nearest palette index per pixel: int array (H, W), 0 = background, 1.. = ``COLORS``."""
    hwc = to_hwc_float(image)
    d = ((hwc[:, :, None, :] - _PALETTE_ARRAY[None, None]) ** 2).sum(-1)  # (H, W, 4)
    return d.argmin(-1)


# -------------------------------------------------------------------------------------------------- detector


def _components(mask: np.ndarray, corners: bool = False) -> list[tuple]:
    """4-connected components of a boolean (H, W) mask as (area, x0, y0, x1, y1) with inclusive boxes, plus
    the component's corner occupancy (see :func:`corner_occupancy`) as a sixth value when ``corners``."""
    h, w = mask.shape
    flat = mask.ravel().tolist()
    seen = bytearray(h * w)
    comps = []
    for start in range(h * w):
        if not flat[start] or seen[start]:
            continue
        seen[start] = 1
        stack = [start]
        pixels = []
        area = 0
        x0, y0, x1, y1 = w, h, -1, -1
        while stack:
            p = stack.pop()
            pixels.append(p)
            y, x = divmod(p, w)
            area += 1
            x0 = x if x < x0 else x0
            x1 = x if x > x1 else x1
            y0 = y if y < y0 else y0
            y1 = y if y > y1 else y1
            if x > 0 and flat[p - 1] and not seen[p - 1]:
                seen[p - 1] = 1
                stack.append(p - 1)
            if x < w - 1 and flat[p + 1] and not seen[p + 1]:
                seen[p + 1] = 1
                stack.append(p + 1)
            if y > 0 and flat[p - w] and not seen[p - w]:
                seen[p - w] = 1
                stack.append(p - w)
            if y < h - 1 and flat[p + w] and not seen[p + w]:
                seen[p + w] = 1
                stack.append(p + w)
        if corners:
            ys, xs = np.divmod(np.asarray(pixels), w)
            comps.append((area, x0, y0, x1, y1, corner_occupancy(xs - x0, ys - y0, x1 - x0 + 1, y1 - y0 + 1)))
        else:
            comps.append((area, x0, y0, x1, y1))
    return comps


def corner_occupancy(xs, ys, width: int, height: int) -> float:
    """Share of the four corner patches of a component's bounding box that the component covers.

    ``xs``, ``ys``: the component's pixel coordinates relative to its box (width x height). Each patch is
    ``max(1, round(width / 4))`` x ``max(1, round(height / 4))`` pixels; the result is the mean over the four
    patches. A square covers them fully (1.0); a rendered disc leaves their outer cells empty (at most 0.556, for
    the smallest discs, after the VAE round trip); the soft-cornered squares of the base models sit in between.
    """
    kw, kh = max(1, int(round(width / 4))), max(1, int(round(height / 4)))
    xs, ys = np.asarray(xs), np.asarray(ys)
    left, right = xs < kw, xs >= width - kw
    top, bottom = ys < kh, ys >= height - kh
    covered = int((left & top).sum() + (right & top).sum() + (left & bottom).sum() + (right & bottom).sum())
    return covered / float(4 * kw * kh)


def classify_shape(area: int, width: int, height: int, corner: float) -> str:
    """Shape of a component from its pixel count, bounding box size (pixels) and corner occupancy
    (:func:`corner_occupancy`): lopsided boxes are ``"other"``; fill ratio (area / box area) below
    ``TRIANGLE_FILL`` is ``"other"``, below ``CIRCLE_FILL`` a triangle; a fuller component is a square when its
    corner occupancy reaches ``SQUARE_CORNER``, else a circle."""
    aspect = width / height
    if aspect > MAX_ASPECT or aspect < 1.0 / MAX_ASPECT:
        return "other"
    fill = area / float(width * height)
    if fill < TRIANGLE_FILL:
        return "other"
    if fill < CIRCLE_FILL:
        return "triangle"
    return "square" if corner >= SQUARE_CORNER else "circle"


def colored_components(image, min_pixels: int | None = None, corners: bool = False):
    """The detector's raw measurements of one image: ``(min_pixels, [(color, area, (x0, y0, x1, y1)), ...])``, every
    4-connected component of every palette colour (no size filter; ``min_pixels`` is the size threshold for this
    resolution, ``MIN_PIXELS_AT_32`` scaled with the image area, unless given). With ``corners=True`` each entry
    has a fourth value, the component's :func:`corner_occupancy`."""
    labels = palette_labels(image)
    h, w = labels.shape
    if min_pixels is None:
        min_pixels = max(1, int(round(MIN_PIXELS_AT_32 * h * w / (32 * 32))))
    comps = []
    for ci, color in enumerate(COLORS, start=1):
        mask = labels == ci
        if mask.any():
            comps += [(color, c[0], tuple(c[1:5])) + tuple(c[5:]) for c in _components(mask, corners)]
    return min_pixels, comps


def detect(image, min_pixels: int | None = None) -> list[dict]:
    """Objects found in one image: a list of dicts with ``color``, ``shape``, ``area``, ``box``
    (x0, y0, x1, y1), inclusive pixel coordinates, y pointing down) and ``corner`` (corner occupancy)."""
    min_pixels, comps = colored_components(image, min_pixels, corners=True)
    return [{"color": color, "shape": classify_shape(area, box[2] - box[0] + 1, box[3] - box[1] + 1, corner),
             "area": area, "box": box, "corner": corner} for color, area, box, corner in comps if area >= min_pixels]


def relations_between(box_a, box_b, threshold: float = 0.5) -> set[str]:
    """GenEval's relative position of box A with respect to box B: a subset of {left, right, above, below}.

    Boxes are (x0, y0, x1, y1), y down. The centre offset shrinks by ``POSITION_THRESHOLD`` x (sum of box sizes)
    per axis; a relation holds when that revised offset, divided by the raw offset's length, passes
    ``threshold`` (0.5 = within 60 degrees of the axis) in the relation's direction.
    """
    a = np.asarray(box_a, dtype=np.float64)
    b = np.asarray(box_b, dtype=np.float64)
    center_a = (a[:2] + a[2:]) / 2
    center_b = (b[:2] + b[2:]) / 2
    dim_a = a[2:] - a[:2] + 1
    dim_b = b[2:] - b[:2] + 1
    offset = center_a - center_b
    revised = np.maximum(np.abs(offset) - POSITION_THRESHOLD * (dim_a + dim_b), 0) * np.sign(offset)
    if np.all(np.abs(revised) < 1e-3):
        return set()
    dx, dy = revised / np.linalg.norm(offset)
    rel = set()
    if dx < -threshold:
        rel.add("left")
    if dx > threshold:
        rel.add("right")
    if dy < -threshold:
        rel.add("above")
    if dy > threshold:
        rel.add("below")
    return rel


def relation_holds(box_a, box_b, relation: str, threshold: float = 0.5) -> bool:
    """Whether ``A <relation> B`` holds for boxes A and B (see :func:`relations_between`)."""
    return relation in relations_between(box_a, box_b, threshold)


# ---------------------------------------------------------------------------------------------------- scores


def _as_spec(prompt) -> PromptSpec:
    return prompt if isinstance(prompt, PromptSpec) else parse_prompt(prompt)


def constraints_met(objects: list[dict], spec: PromptSpec) -> list[bool]:
    """The list of constraint outcomes of ``spec`` on detected ``objects`` (see module docstring)."""
    return [ok for group in constraint_groups(objects, spec).values() for ok in group]


FAILURE_KINDS = ("ok", "count", "colour", "shape", "relation")


def constraint_groups(objects: list[dict], spec: PromptSpec) -> dict[str, list[bool]]:
    """:func:`constraints_met`'s outcomes by what they check: ``colour`` (objects per colour), ``shape`` (objects
    per shape, presence and count of each colour-shape object), ``count`` (the total), ``relation`` (position
    prompts only; an empty list otherwise). Flattened in this order they are :func:`constraints_met`."""
    want_color: Counter = Counter()
    want_shape: Counter = Counter()
    for o in spec.objects:
        want_color[o.color] += o.count
        want_shape[o.shape] += o.count
    got_color = Counter(o["color"] for o in objects)
    got_shape = Counter(o["shape"] for o in objects)
    got_combo = Counter((o["color"], o["shape"]) for o in objects)
    groups = {"colour": [got_color[c] == n for c, n in want_color.items()]}
    groups["shape"] = [got_shape[s] == n for s, n in want_shape.items()]
    groups["shape"] += [got_combo[o.combo] >= 1 for o in spec.objects]
    groups["shape"] += [got_combo[o.combo] == o.count for o in spec.objects]
    groups["count"] = [len(objects) == sum(o.count for o in spec.objects)]
    groups["relation"] = []
    if spec.relation is not None:
        a, b = spec.objects
        boxes_a = [o["box"] for o in objects if (o["color"], o["shape"]) == a.combo]
        boxes_b = [o["box"] for o in objects if (o["color"], o["shape"]) == b.combo]
        ok = len(boxes_a) == 1 and len(boxes_b) == 1 and relation_holds(boxes_a[0], boxes_b[0], spec.relation)
        groups["relation"].append(bool(ok))
    return groups


def failure_kind(objects: list[dict], spec) -> str:
    """Why a sample fails strict, as one of ``FAILURE_KINDS``: ``"ok"`` when it passes, else the first failing
    group in the order ``count`` (too many or too few objects), ``colour``, ``shape``, ``relation`` (all else
    right). ``objects``: :func:`detect`'s output; ``spec``: a prompt or its ``PromptSpec``. Tells which share of
    a model's failures a relation-only fix can reach."""
    groups = constraint_groups(objects, _as_spec(spec))
    for kind in ("count", "colour", "shape", "relation"):
        if not all(groups[kind]):
            return kind
    return "ok"


def colour_relation_holds(image, prompt, objects: list[dict] | None = None) -> bool | None:
    """Colour-level relation check of a position prompt whose two objects differ in colour: the largest detected
    object of each colour stands in the asked relation, shapes ignored (what the noisy-caption base gets wrong,
    apart from its shapes). ``image``: (3, H, W) in [0, 1]; ``objects``: its :func:`detect` output, when the caller
    has it already. None for prompts without a relation or with one colour; False when a colour is missing."""
    spec = _as_spec(prompt)
    if spec.relation is None or spec.objects[0].color == spec.objects[1].color:
        return None
    objects = detect(image) if objects is None else objects
    boxes = []
    for o in spec.objects:
        mine = [d for d in objects if d["color"] == o.color]
        if not mine:
            return False
        boxes.append(max(mine, key=lambda d: d["area"])["box"])
    return relation_holds(boxes[0], boxes[1], spec.relation)


def _score_objects(objects: list[dict], spec: PromptSpec) -> dict[str, float]:
    met = constraints_met(objects, spec)
    return {"strict": float(all(met)), "partial": float(np.mean(met))}


def score(image, prompt) -> dict[str, float]:
    """Scores one image (3, H, W) against a prompt: ``{"strict": 0/1, "partial": share of constraints met}``."""
    return _score_objects(detect(image), _as_spec(prompt))


def _check_batch(images, prompts) -> list:
    imgs = list(_iter_images(images))
    if isinstance(prompts, str):
        prompts = [prompts]
    if len(imgs) != len(prompts):
        raise ValueError(f"got {len(imgs)} images but {len(prompts)} prompts")
    return imgs


def shapes_partial_reward(images, prompts, **columns) -> list[float]:
    """Share of the prompt's constraints met, per image. ``images``: float tensor (B, 3, H, W) in [0, 1];
    ``prompts``: B strings; extra dataset columns (keyword lists) are ignored. Returns B floats in [0, 1]."""
    imgs = _check_batch(images, prompts)
    return [score(img, p)["partial"] for img, p in zip(imgs, prompts)]


def shapes_strict_reward(images, prompts, **columns) -> list[float]:
    """1.0 when every constraint of the prompt is met (GenEval-style strict accuracy), else 0.0, per image.
    ``images``: float tensor (B, 3, H, W) in [0, 1]; ``prompts``: B strings; extra columns ignored."""
    imgs = _check_batch(images, prompts)
    return [score(img, p)["strict"] for img, p in zip(imgs, prompts)]


shapes_partial_reward.__name__ = "shapes_partial"
shapes_strict_reward.__name__ = "shapes_strict"


def shape_cleanliness(images, **columns) -> list[float]:
    """Not a reward: share of pixels within ``CLEAN_DISTANCE`` (RGB, [0, 1] scale) of a palette colour or the
    black background, per image. ``images``: (B, 3, H, W) in [0, 1]. Rendered images score 1; smeared,
    noisy or off-palette images (reward hacking) score lower."""
    out = []
    for img in _iter_images(images):
        hwc = to_hwc_float(img)
        d = np.sqrt(((hwc[:, :, None, :] - _PALETTE_ARRAY[None, None]) ** 2).sum(-1)).min(-1)
        out.append(float((d <= CLEAN_DISTANCE).mean()))
    return out


shape_cleanliness.__name__ = "shape_cleanliness"


def evaluate(images, prompts, categories=None) -> dict[str, dict[str, float]]:
    """Strict and partial accuracy per category and overall.

    ``images``: (B, 3, H, W) in [0, 1] (or a list of images), ``prompts``: B strings, ``categories``: B labels
    (parsed from the prompts when None). Returns ``{"overall": {"strict", "partial", "cleanliness", "n"},
    <category>: {...}, ...}`` for the categories present, in ``CATEGORIES`` order.
    """
    imgs = _check_batch(images, prompts)
    if categories is None:
        categories = [parse_prompt(p).category for p in prompts]
    rows = []
    for img, p, c in zip(imgs, prompts, categories):
        objects, spec = detect(img), _as_spec(p)  # one detection serves the scores and the relation check
        s = _score_objects(objects, spec)
        rows.append((c, s["strict"], s["partial"], shape_cleanliness([img])[0],
                     colour_relation_holds(img, spec, objects=objects)))

    def summary(sel):
        out = {
            "strict": float(np.mean([r[1] for r in sel])),
            "partial": float(np.mean([r[2] for r in sel])),
            "cleanliness": float(np.mean([r[3] for r in sel])),
            "n": len(sel),
        }
        rel = [r[4] for r in sel if r[4] is not None]
        if rel:  # position prompts of two colours: colour-level relation accuracy and how many it is over
            out["relation"], out["n_relation"] = float(np.mean(rel)), len(rel)
        return out

    result = {"overall": summary(rows)}
    present = [c for c in CATEGORIES if c in set(categories)] + sorted(set(categories) - set(CATEGORIES))
    for c in present:
        result[c] = summary([r for r in rows if r[0] == c])
    return result


def format_evaluation(result: dict) -> str:
    """One line per category of an :func:`evaluate` result."""
    lines = [f"{'category':<12} {'n':>5} {'strict':>7} {'partial':>8} {'clean':>6}"]
    for name, r in result.items():
        lines.append(f"{name:<12} {r['n']:>5} {r['strict']:>7.3f} {r['partial']:>8.3f} {r['cleanliness']:>6.3f}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- dense reward

DENSE_TEMPERATURE = 0.03  # width (in fill ratio) of the soft shape thresholds
DENSE_ASPECT_TEMPERATURE = 0.1
DENSE_CORNER_TEMPERATURE = 0.03  # width (in corner occupancy) of the soft square / circle decision
DENSE_RELATION_TEMPERATURE = 0.1


def _sigmoid(x: float) -> float:
    return float(1.0 / (1.0 + np.exp(-np.clip(x, -60, 60))))


def soft_objects(image, min_pixels: int | None = None) -> list[dict]:
    """The detector's components with graded instead of hard decisions: every component of at least a quarter of
    ``min_pixels`` gets a weight ``w`` (0 at a quarter, 1 from ``min_pixels`` on, linear between) and soft
    shape memberships ``p`` (dict shape -> [0, 1], summing to <= 1) from sigmoids around the detector's fill-ratio
    thresholds (width ``DENSE_TEMPERATURE``), its corner-occupancy threshold between square and circle (width
    ``DENSE_CORNER_TEMPERATURE``) and its aspect-ratio limit."""
    min_pixels, comps = colored_components(image, min_pixels, corners=True)
    lo = min_pixels / 4
    out = []
    for color, area, (x0, y0, x1, y1), corner in comps:
        if area < lo:
            continue
        bw, bh = x1 - x0 + 1, y1 - y0 + 1
        fill = area / float(bw * bh)
        aspect = max(bw / bh, bh / bw)
        ok = _sigmoid((MAX_ASPECT - aspect) / DENSE_ASPECT_TEMPERATURE)
        c_ci, c_tr = (_sigmoid((fill - t) / DENSE_TEMPERATURE) for t in (CIRCLE_FILL, TRIANGLE_FILL))
        c_sq = _sigmoid((corner - SQUARE_CORNER) / DENSE_CORNER_TEMPERATURE)
        p = {"square": ok * c_ci * c_sq, "circle": ok * c_ci * (1.0 - c_sq), "triangle": ok * max(0.0, c_tr - c_ci)}
        weight = min(1.0, max(0.0, (area - lo) / (min_pixels - lo)))
        out.append({"color": color, "w": weight, "p": p, "box": (x0, y0, x1, y1)})
    return out


def dense_score(image, prompt, relation_weight: float | None = None) -> float:
    """A dense, graded version of :func:`score`'s ``partial``: the same constraints, each scored in [0, 1] from
    :func:`soft_objects` (soft counts ``sum w p``; a count constraint scores ``max(0, 1 - |got - want|)``, a
    presence ``min(1, got)``, the relation a sigmoid of GenEval's angular margin). Equals 1 only for a clean,
    correct image, and moves with every pixel that changes a component's fill ratio, corner occupancy, size or
    position. ``relation_weight``: None averages every constraint (the relation is one of ten in a position
    prompt); a number w in [0, 1] scores ``w * relation + (1 - w) * mean(the others)`` for prompts with a
    relation (the others are unchanged)."""
    if relation_weight is not None and not 0.0 <= relation_weight <= 1.0:
        raise ValueError(f"relation_weight must be in [0, 1], got {relation_weight}")
    spec = _as_spec(prompt)
    objs = soft_objects(image)

    def count(pred) -> float:
        return sum(o["w"] * pred(o) for o in objs)

    def near(got, want) -> float:
        return max(0.0, 1.0 - abs(got - want))

    want_color: Counter = Counter()
    want_shape: Counter = Counter()
    for o in spec.objects:
        want_color[o.color] += o.count
        want_shape[o.shape] += o.count
    vals = [near(count(lambda o, c=c: float(o["color"] == c)), n) for c, n in want_color.items()]
    vals += [near(count(lambda o, s=s: o["p"][s]), n) for s, n in want_shape.items()]
    for ob in spec.objects:
        got = count(lambda o, ob=ob: float(o["color"] == ob.color) * o["p"][ob.shape])
        vals += [min(1.0, got), near(got, ob.count)]
    vals.append(near(sum(o["w"] for o in objs), sum(ob.count for ob in spec.objects)))
    if spec.relation is not None:
        a, b = spec.objects

        def best(ob):
            cands = [(o["w"] * o["p"][ob.shape], o) for o in objs if o["color"] == ob.color]
            return max(cands, key=lambda t: t[0], default=(0.0, None))

        (pa, oa), (pb, ob_) = best(a), best(b)
        rel = 0.0
        if oa is not None and ob_ is not None and oa is not ob_:
            bx_a, bx_b = np.asarray(oa["box"], float), np.asarray(ob_["box"], float)
            offset = (bx_a[:2] + bx_a[2:]) / 2 - (bx_b[:2] + bx_b[2:]) / 2
            dims = (bx_a[2:] - bx_a[:2] + 1) + (bx_b[2:] - bx_b[:2] + 1)
            revised = np.maximum(np.abs(offset) - POSITION_THRESHOLD * dims, 0) * np.sign(offset)
            norm = float(np.linalg.norm(offset))
            if norm > 1e-6:
                dx, dy = revised / norm
                toward = {"left": -dx, "right": dx, "above": -dy, "below": dy}[spec.relation]
                rel = min(pa, pb) * _sigmoid((toward - 0.5) / DENSE_RELATION_TEMPERATURE)
        if relation_weight is not None:
            return float(relation_weight * rel + (1.0 - relation_weight) * np.mean(vals))
        vals.append(rel)
    return float(np.mean(vals))


def shapes_dense_reward(images, prompts, **columns) -> list[float]:
    """Dense training reward of the shapes task (:func:`dense_score`), per image in [0, 1]. The benchmark's score
    stays the detector's strict / partial accuracy; this is the shaped reward a policy gradient can climb.
    ``images``: float tensor (B, 3, H, W) in [0, 1]; ``prompts``: B strings; extra columns ignored."""
    imgs = _check_batch(images, prompts)
    return [dense_score(img, p) for img, p in zip(imgs, prompts)]


shapes_dense_reward.__name__ = "shapes_dense"

RELATION_REWARD_WEIGHT = 0.5


def shapes_relation_reward(images, prompts, **columns) -> list[float]:
    """:func:`dense_score` with the relation weighted ``RELATION_REWARD_WEIGHT`` (half) and the other soft
    constraints (colours, shapes, counts: the shape terms stay in) sharing the rest: the noisy-caption base's
    main failure is the relation, one term of ten in :func:`shapes_dense_reward`. Prompts without a relation score
    as in ``shapes_dense``. ``images``: float tensor (B, 3, H, W) in [0, 1]; ``prompts``: B strings."""
    imgs = _check_batch(images, prompts)
    return [dense_score(img, p, relation_weight=RELATION_REWARD_WEIGHT) for img, p in zip(imgs, prompts)]


shapes_relation_reward.__name__ = "shapes_relation"
