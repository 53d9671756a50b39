"""The trainer registry: one name per method, read by the CLI's subcommands, ``examples/``, the benchmarks and the
package's exports. ``register_trainer("name", MyTrainer)`` makes a method of your own a ``trl-flow name``
subcommand and a ``--method name`` of the examples; ``docs/adding_a_method.md`` walks through one.

A package can register its trainers without being imported first, through the entry-point group
:data:`ENTRY_POINT_GROUP` (``name = "package.module:TrainerClass"``), as adapters do with ``trl_flow.adapters``.
"""

from __future__ import annotations

import dataclasses
import re

ENTRY_POINT_GROUP = "trl_flow.trainers"
_NAME = re.compile(r"^[a-z][a-z0-9_-]*$")

_TRAINERS: dict[str, type] = {}  # name -> trainer class
_ALIASES: dict[str, str] = {}  # alias -> name
_entry_points_loaded = False


def register_trainer(name: str, trainer_cls: type, aliases=(), overwrite: bool = False) -> None:
    """Register ``trainer_cls`` under ``name`` (lower case, digits, ``-`` and ``_``: a command-line word) and
    ``aliases``. Its config is ``trainer_cls.config_class`` (a dataclass). A name or alias already taken by another
    class is refused unless ``overwrite``."""
    from .base_trainer import FlowRLTrainer

    if not isinstance(trainer_cls, type) or not issubclass(trainer_cls, FlowRLTrainer):
        raise TypeError(f"register_trainer({name!r}, ...): {trainer_cls!r} is not a FlowRLTrainer subclass")
    config_cls = getattr(trainer_cls, "config_class", None)
    if not (isinstance(config_cls, type) and dataclasses.is_dataclass(config_cls)):
        raise TypeError(f"register_trainer({name!r}, ...): {trainer_cls.__name__}.config_class must be a config "
                        f"dataclass (a FlowRLConfig subclass), got {config_cls!r}")
    from ..engine.checkpoints import resume_kinds

    resume_kinds(config_cls)  # every field says how a resumed run treats a change of it: TypeError naming the field
    for word in (name, *aliases):
        if not isinstance(word, str) or not _NAME.match(word):
            raise ValueError(f"register_trainer: {word!r} is not a command-line name (lower-case letters, digits, "
                             "'-' and '_', starting with a letter)")
        owner = _TRAINERS.get(_ALIASES.get(word, word))
        if owner is not None and owner is not trainer_cls and not overwrite:
            raise ValueError(f"register_trainer: {word!r} already names {owner.__name__}; pick another name or pass "
                             "overwrite=True")
    if overwrite:  # a replaced class keeps none of its old names
        for alias in [a for a, n in _ALIASES.items() if n == name]:
            del _ALIASES[alias]
    _TRAINERS[name] = trainer_cls
    for alias in aliases:
        _ALIASES[alias] = name


def registered_trainers() -> dict[str, type]:
    """``{name: trainer class}`` of every registered method (entry points included), in registration order."""
    _load_entry_points()
    return dict(_TRAINERS)


def trainer_aliases() -> dict[str, str]:
    """``{alias: name}``."""
    _load_entry_points()
    return dict(_ALIASES)


def get_trainer(name: str) -> type:
    """The trainer class registered under ``name`` or an alias of it; a ``KeyError`` naming the choices."""
    _load_entry_points()
    key = _ALIASES.get(name, name)
    if key not in _TRAINERS:
        raise KeyError(f"no trainer named {name!r}; registered: {', '.join(_TRAINERS)} (aliases: "
                       f"{', '.join(f'{a} = {n}' for a, n in _ALIASES.items())}); register_trainer adds one")
    return _TRAINERS[key]


def trainer_name(trainer_cls: type) -> str:
    """The registered name of ``trainer_cls`` (its own class, not a parent's)."""
    _load_entry_points()
    for name, cls in _TRAINERS.items():
        if cls is trainer_cls:
            return name
    raise KeyError(f"{trainer_cls.__name__} is not registered; call trl_flow.register_trainer(name, "
                   f"{trainer_cls.__name__})")


def summary(trainer_cls: type) -> str:
    """One line for ``--help``: the class's ``summary`` attribute, else its docstring's first sentence."""
    text = getattr(trainer_cls, "summary", None) or (trainer_cls.__doc__ or trainer_cls.__name__).strip()
    return " ".join(text.split(". ")[0].split())


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    from ..plugins import load_entry_points

    load_entry_points(ENTRY_POINT_GROUP, lambda name: _TRAINERS.get(_ALIASES.get(name, name)), register_trainer,
                      "a trainer")
