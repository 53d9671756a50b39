"""Rewards by name or by dotted path, for command lines and configs (``--reward pickscore``,
``--reward my_package.rewards:my_reward``), in the manner of TRL's GRPO script.

A dotted path ``module:attribute`` is imported (never evaluated): a class is instantiated with the keyword
arguments, a function is the reward itself. A registered name calls its factory with the keyword arguments.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

_REGISTRY: dict[str, Callable] = {}


def register_reward(name: str, factory: Callable | None = None):
    """Register ``factory(**kwargs) -> reward`` under ``name`` (usable as a decorator). Re-registering replaces."""
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"register_reward: name={name!r} must be a non-empty string without ':'")

    def deco(f):
        if not callable(f):
            raise TypeError(f"register_reward({name!r}): {f!r} is not callable")
        _REGISTRY[name] = f
        return f

    return deco if factory is None else deco(factory)


def available_rewards() -> list[str]:
    """The registered reward names."""
    return sorted(_REGISTRY)


def register_function(name: str, load: Callable[[], Callable]) -> None:
    """Register a plain reward function under ``name``; ``load()`` returns it (so imports stay lazy)."""

    def factory(**kwargs):
        if kwargs:
            raise TypeError(f"reward {name!r} is a function and takes no keyword arguments, got {sorted(kwargs)}")
        return load()

    register_reward(name, factory)


def get_reward(spec, **kwargs):
    """The reward for ``spec``: a registered name, ``module:attribute``, or a callable (returned as is)."""
    if callable(spec) and not isinstance(spec, str):
        if kwargs:
            raise TypeError(f"get_reward: keyword arguments {sorted(kwargs)} need a name or a class, not a callable")
        return spec
    if not isinstance(spec, str) or not spec:
        raise TypeError(f"get_reward: expected a reward name, `module:callable` or a callable, got {spec!r}")
    if ":" in spec:
        module_name, _, attr = spec.partition(":")
        try:
            obj = importlib.import_module(module_name)
        except ImportError as e:
            raise ValueError(f"reward {spec!r}: cannot import module {module_name!r} ({e})") from None
        for part in attr.split("."):
            if not part or not hasattr(obj, part):
                raise ValueError(f"reward {spec!r}: module {module_name!r} has no attribute {attr!r}")
            obj = getattr(obj, part)
        if isinstance(obj, type):
            return obj(**kwargs)
        if not callable(obj):
            raise TypeError(f"reward {spec!r} is a {type(obj).__name__}, not a callable")
        if kwargs:
            raise TypeError(f"reward {spec!r} is a function and takes no keyword arguments (got {sorted(kwargs)}); "
                            "keyword arguments go to classes and registered names")
        return obj
    if spec not in _REGISTRY:
        raise ValueError(f"reward {spec!r}: unknown name; use one of {available_rewards()} or a dotted path "
                         "`module:callable`")
    return _REGISTRY[spec](**kwargs)
