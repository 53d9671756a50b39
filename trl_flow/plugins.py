"""Entry points of the extension registries (adapters: ``trl_flow.adapters``; trainers: ``trl_flow.trainers``): one
loader for both. Ground floor: imports nothing of trl_flow."""

from __future__ import annotations

import warnings


def spec(obj, package: str = "") -> str:
    """``module:qualname`` of a registered object, or of a lazy ``"module:Class"`` string (``.module`` relative to
    ``package``), as an entry point's value spells it."""
    if isinstance(obj, str):
        return package + obj if obj.startswith(".") else obj
    return f"{obj.__module__}:{obj.__qualname__}"


def load_entry_points(group: str, current, register, what: str, package: str = "") -> None:
    """Register every entry point of ``group`` with ``register(name, loaded object)``. ``current(name)``: what the
    name is registered to already (None if free). A name registered to the same object (a plug-in that also
    registers itself on import) is skipped silently; to another one, skipped with a warning; a plug-in that fails to
    load or register warns and is skipped, so it never breaks the built-in ones."""
    from importlib.metadata import entry_points

    for ep in entry_points(group=group):
        existing = current(ep.name)
        if existing is not None:
            if ep.value.replace(" ", "") != spec(existing, package):
                short = spec(existing, package).rpartition(":")[2]
                warnings.warn(f"trl_flow: entry point {ep.name} = {ep.value} ({group}) ignored: {ep.name} already "
                              f"has {what} ({short}); register it with overwrite=True to replace it", stacklevel=4)
            continue
        try:
            register(ep.name, ep.load())
        except Exception as e:  # a broken plug-in must not break the built-in ones
            warnings.warn(f"trl_flow: entry point {ep.name} = {ep.value} ({group}) could not be registered: "
                          f"{type(e).__name__}: {e}", stacklevel=4)
