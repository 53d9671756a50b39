"""Prompt grammar of the shapes task, in GenEval's categories.

Scenes hold flat coloured shapes on a black background. Prompts come in five categories:

==============  =================================================  ==========================================
category        example                                            what it tests
==============  =================================================  ==========================================
``single``      "a red circle"                                     one object, colour + shape
``colors``      "a red square and a green circle"                  attribute binding: two objects that differ
                                                                   in colour AND shape (GenEval color_attr)
``counting``    "two green triangles" / "one blue square"          exact count (1..max_count) of one object
``two_objects`` "a red circle and a red square"                    two different objects that share their
                                                                   colour or their shape
``position``    "a red circle to the left of a blue square"        relation: left of / right of / above /
                                                                   below (GenEval's rule, see reward.py)
==============  =================================================  ==========================================

With the default 3 colours x 3 shapes and counts 1-2 there are 387 prompts: single 9, colors 36, counting 18,
two_objects 36, position 288.

The train/test split is fixed and deterministic (no RNG involved):

* pair categories (``colors``, ``two_objects``, ``position``) are split by (colour, shape) combination pairs:
  a fixed set of unordered pairs {A, B} of (colour, shape) combinations is held out (5 of the 18 pairs that
  differ in colour and shape, 5 of the 18 pairs that share one attribute), and every prompt that mentions both
  A and B (either order, any relation) is a test prompt. So no training prompt ever shows a held-out pair of
  objects together; all held-out objects are seen individually in training.
* ``single``: test = the 3 combinations with (colour index + shape index) % 3 == 0.
* ``counting``: test = the prompts with (colour index + shape index + count) % 3 == 0.

Default split sizes: train 278 (single 6, colors 26, counting 12, two_objects 26, position 208), test 109
(single 3, colors 10, counting 6, two_objects 10, position 80).
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass, field

COLORS: tuple[str, ...] = ("red", "green", "blue")
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
# relation name -> phrase used in prompts
RELATIONS: dict[str, str] = {
    "left": "to the left of",
    "right": "to the right of",
    "above": "above",
    "below": "below",
}
NUMBER_WORDS: tuple[str, ...] = ("zero", "one", "two", "three", "four")
DEFAULT_MAX_COUNT = 2
CATEGORIES: tuple[str, ...] = ("single", "colors", "counting", "two_objects", "position")

# Every word any prompt of the grammar (max_count <= 4) can use; the tokenizers are built from this list.
VOCABULARY: tuple[str, ...] = (
    "a", "and", "one", "two", "three", "four",
    "red", "green", "blue",
    "circle", "circles", "square", "squares", "triangle", "triangles",
    "to", "the", "left", "right", "of", "above", "below",
)  # fmt: skip

# How many held-out (colour, shape) pairs per pair kind (see module docstring).
_N_HELD_OUT_BINDING = 5
_N_HELD_OUT_SHARED = 5


@dataclass(frozen=True)
class ObjectSpec:
    """One requested object kind: ``count`` objects of colour ``color`` and shape ``shape``."""

    color: str
    shape: str
    count: int = 1

    @property
    def combo(self) -> tuple[str, str]:
        return (self.color, self.shape)


@dataclass(frozen=True)
class PromptSpec:
    """Parsed prompt: the objects (in mention order), an optional relation ``objects[0] <relation> objects[1]``
    (one of ``RELATIONS``), and the category."""

    objects: tuple[ObjectSpec, ...]
    relation: str | None = None
    category: str = field(default="single", compare=False)

    def to_prompt(self) -> str:
        return spec_to_prompt(self)


def _object_phrase(obj: ObjectSpec, counted: bool) -> str:
    if counted:
        noun = obj.shape + ("s" if obj.count != 1 else "")
        return f"{NUMBER_WORDS[obj.count]} {obj.color} {noun}"
    return f"a {obj.color} {obj.shape}"


def spec_to_prompt(spec: PromptSpec) -> str:
    """Renders a :class:`PromptSpec` as text (inverse of :func:`parse_prompt`)."""
    if spec.category == "counting":
        return _object_phrase(spec.objects[0], counted=True)
    if len(spec.objects) == 1:
        return _object_phrase(spec.objects[0], counted=False)
    a, b = spec.objects
    joiner = RELATIONS[spec.relation] if spec.relation is not None else "and"
    return f"{_object_phrase(a, False)} {joiner} {_object_phrase(b, False)}"


def _pair_category(a: ObjectSpec, b: ObjectSpec, relation: str | None) -> str:
    if relation is not None:
        return "position"
    if a.color != b.color and a.shape != b.shape:
        return "colors"
    return "two_objects"


def _parse_object(words: list[str]) -> ObjectSpec:
    if len(words) != 3:
        raise ValueError(f"cannot parse object phrase {' '.join(words)!r}")
    det, color, noun = words
    if color not in COLORS:
        raise ValueError(f"unknown colour {color!r}")
    if det == "a":
        count = 1
        shape = noun
    elif det in NUMBER_WORDS[1:]:
        count = NUMBER_WORDS.index(det)
        shape = noun[:-1] if count != 1 and noun.endswith("s") else noun
        if (count != 1) != noun.endswith("s"):
            raise ValueError(f"number agreement broken in {' '.join(words)!r}")
    else:
        raise ValueError(f"unknown determiner {det!r}")
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {noun!r}")
    return ObjectSpec(color, shape, count)


def parse_prompt(prompt: str) -> PromptSpec:
    """Parses a prompt of the grammar into a :class:`PromptSpec` (raises ``ValueError`` otherwise).

    >>> spec = parse_prompt("a red circle to the left of a blue square")
    >>> spec.category, spec.relation, spec.objects[0]
    ('position', 'left', ObjectSpec(color='red', shape='circle', count=1))
    """
    words = prompt.strip().lower().rstrip(".").split()
    if len(words) == 3:
        obj = _parse_object(words)
        category = "counting" if words[0] != "a" else "single"
        return PromptSpec((obj,), None, category)
    if len(words) < 7:
        raise ValueError(f"cannot parse prompt {prompt!r}")
    first, rest = words[:3], words[3:]
    second = rest[-3:]
    joiner = " ".join(rest[:-3])
    if joiner == "and":
        relation = None
    else:
        matches = [name for name, phrase in RELATIONS.items() if phrase == joiner]
        if not matches:
            raise ValueError(f"unknown relation {joiner!r} in {prompt!r}")
        relation = matches[0]
    a, b = _parse_object(first), _parse_object(second)
    if first[0] != "a" or second[0] != "a":
        raise ValueError(f"pair prompts use 'a' for both objects: {prompt!r}")
    if a.combo == b.combo:
        raise ValueError(f"the two objects of a pair prompt must differ: {prompt!r}")
    return PromptSpec((a, b), relation, _pair_category(a, b, relation))


def combos() -> list[tuple[str, str]]:
    """All (colour, shape) combinations, colour-major."""
    return [(c, s) for c in COLORS for s in SHAPES]


def _pair_key(a: tuple[str, str], b: tuple[str, str]) -> tuple[tuple[str, str], tuple[str, str]]:
    return tuple(sorted([a, b]))  # type: ignore[return-value]


def held_out_pairs() -> frozenset:
    """The fixed set of unordered (colour, shape) pairs whose pair prompts are all test prompts.

    Chosen by md5 rank (deterministic on every platform): the first 5 pairs that differ in colour and shape,
    and the first 5 pairs that share their colour or their shape.
    """
    pairs = [_pair_key(a, b) for a, b in itertools.combinations(combos(), 2)]

    def rank(p):
        return hashlib.md5(repr(p).encode()).hexdigest()

    binding = sorted([p for p in pairs if p[0][0] != p[1][0] and p[0][1] != p[1][1]], key=rank)
    shared = sorted([p for p in pairs if not (p[0][0] != p[1][0] and p[0][1] != p[1][1])], key=rank)
    return frozenset(binding[:_N_HELD_OUT_BINDING] + shared[:_N_HELD_OUT_SHARED])


def all_specs(max_count: int = DEFAULT_MAX_COUNT) -> list[PromptSpec]:
    """Every prompt of the grammar as a :class:`PromptSpec`, grouped by category in ``CATEGORIES`` order."""
    if not 1 <= max_count < len(NUMBER_WORDS):
        raise ValueError(f"max_count must be in 1..{len(NUMBER_WORDS) - 1}")
    specs: list[PromptSpec] = []
    specs += [PromptSpec((ObjectSpec(c, s),), None, "single") for c, s in combos()]
    ordered_pairs = [(a, b) for a in combos() for b in combos() if a != b]
    for a, b in ordered_pairs:
        oa, ob = ObjectSpec(*a), ObjectSpec(*b)
        if _pair_category(oa, ob, None) == "colors":
            specs.append(PromptSpec((oa, ob), None, "colors"))
    specs += [
        PromptSpec((ObjectSpec(c, s, n),), None, "counting") for c, s in combos() for n in range(1, max_count + 1)
    ]
    for a, b in ordered_pairs:
        oa, ob = ObjectSpec(*a), ObjectSpec(*b)
        if _pair_category(oa, ob, None) == "two_objects":
            specs.append(PromptSpec((oa, ob), None, "two_objects"))
    specs += [
        PromptSpec((ObjectSpec(*a), ObjectSpec(*b)), rel, "position") for a, b in ordered_pairs for rel in RELATIONS
    ]
    return specs


def is_test_spec(spec: PromptSpec) -> bool:
    """Whether a prompt belongs to the fixed held-out test split (see module docstring)."""
    if spec.category == "single":
        o = spec.objects[0]
        return (COLORS.index(o.color) + SHAPES.index(o.shape)) % 3 == 0
    if spec.category == "counting":
        o = spec.objects[0]
        return (COLORS.index(o.color) + SHAPES.index(o.shape) + o.count) % 3 == 0
    a, b = spec.objects
    return _pair_key(a.combo, b.combo) in held_out_pairs()


def all_prompts(max_count: int = DEFAULT_MAX_COUNT) -> list[tuple[str, str]]:
    """Every prompt of the grammar as ``(prompt, category)`` pairs."""
    return [(spec.to_prompt(), spec.category) for spec in all_specs(max_count)]


def _dataset(rows: list[tuple[str, str]]):
    import datasets

    return datasets.Dataset.from_dict({"prompt": [p for p, _ in rows], "category": [c for _, c in rows]})


def train_prompts(max_count: int = DEFAULT_MAX_COUNT):
    """The fixed training split: a ``datasets.Dataset`` with columns ``prompt`` and ``category``."""
    return _dataset([(s.to_prompt(), s.category) for s in all_specs(max_count) if not is_test_spec(s)])


def test_prompts(max_count: int = DEFAULT_MAX_COUNT):
    """The fixed held-out split: a ``datasets.Dataset`` with columns ``prompt`` and ``category``."""
    return _dataset([(s.to_prompt(), s.category) for s in all_specs(max_count) if is_test_spec(s)])


VAL_FRACTION = 0.2


def is_val_spec(spec: PromptSpec) -> bool:
    """Whether a TRAIN-split prompt is held out from RL training as the validation split: the md5 rank of the
    prompt text puts ``VAL_FRACTION`` of each category's train prompts there (deterministic on every platform).
    Unlike the test split, validation prompts may combine objects that training prompts also pair."""
    if is_test_spec(spec):
        return False
    digest = hashlib.md5(("val/" + spec.to_prompt()).encode()).digest()
    return int.from_bytes(digest[:4], "little") / 2**32 < VAL_FRACTION


def rl_train_prompts(max_count: int = DEFAULT_MAX_COUNT, categories: tuple[str, ...] | None = None):
    """The prompts RL trains on: the train split minus the validation split (optionally only ``categories``)."""
    return _dataset([(s.to_prompt(), s.category) for s in all_specs(max_count)
                     if not is_test_spec(s) and not is_val_spec(s)
                     and (categories is None or s.category in categories)])


def val_prompts(max_count: int = DEFAULT_MAX_COUNT):
    """Prompts of the train split that RL never trains on (``is_val_spec``): the held-out split of the same
    grammar. The stricter held-out-pairs split is :func:`test_prompts`."""
    return _dataset([(s.to_prompt(), s.category) for s in all_specs(max_count) if is_val_spec(s)])


# pytest must not collect ``test_prompts`` as a test when it is imported into a test module.
test_prompts.__test__ = False  # type: ignore[attr-defined]


# ------------------------------------------------------------------------------------------ caption noise

OPPOSITE_RELATION: dict[str, str] = {"left": "right", "right": "left", "above": "below", "below": "above"}


def noisy_caption(
    prompt: PromptSpec | str,
    rng,
    flip_relation: float = 0.0,
    swap_colors: float = 0.0,
    count_off: float = 0.0,
    max_count: int = DEFAULT_MAX_COUNT,
) -> tuple[str, tuple[str, ...]]:
    """A caption of an image rendered for ``prompt`` with planted errors, as web captions have.

    Each error is drawn independently with its own probability, where it applies:

    * ``flip_relation``: position prompts say the opposite relation (left <-> right, above <-> below);
    * ``swap_colors``: pair prompts whose objects differ in colour swap the two colours ("a red square and a
      blue circle" -> "a blue square and a red circle"); a no-op in meaning for two same-shape objects joined
      by "and", which are therefore left alone;
    * ``count_off``: single and counting prompts name a count off by one (1 -> 2, ``max_count`` -> its
      predecessor, otherwise up or down at random; "a red circle" -> "two red circles", "two red circles" ->
      "one red circle").

    ``rng``: a ``numpy.random.Generator``. Returns ``(caption, errors)`` with ``errors`` the names of the
    errors applied (``"relation"``, ``"colors"``, ``"count"``), empty for a clean caption. Every caption is a
    prompt of the grammar (``parse_prompt`` reads it).
    """
    spec = prompt if isinstance(prompt, PromptSpec) else parse_prompt(prompt)
    objects = list(spec.objects)
    relation, category = spec.relation, spec.category
    errors: list[str] = []
    if relation is not None and flip_relation > 0 and rng.random() < flip_relation:
        relation = OPPOSITE_RELATION[relation]
        errors.append("relation")
    if len(objects) == 2 and objects[0].color != objects[1].color and swap_colors > 0:
        a, b = objects
        same_shape_and = a.shape == b.shape and relation is None
        if not same_shape_and and rng.random() < swap_colors:
            objects = [ObjectSpec(b.color, a.shape, a.count), ObjectSpec(a.color, b.shape, b.count)]
            errors.append("colors")
    if len(objects) == 1 and count_off > 0 and rng.random() < count_off and max_count >= 2:
        o = objects[0]
        if o.count <= 1:
            n = 2
        elif o.count >= max_count:
            n = o.count - 1
        else:
            n = o.count + (1 if rng.random() < 0.5 else -1)
        objects = [ObjectSpec(o.color, o.shape, n)]
        category = "counting"
        errors.append("count")
    if len(objects) == 2 and relation is None:
        category = _pair_category(objects[0], objects[1], None)
    caption = PromptSpec(tuple(objects), relation, category).to_prompt()
    return caption, tuple(errors)
