"""The package's import graph: no cycles, and no arrow up a floor.

Every import of ``trl_flow`` modules counts, at module level or inside a function (a function-local import hides a
cycle from Python, not from the reader). Floors, lowest first: ``storage``; the shared modules (models/, rewards/,
kernels, rollout, ...); the engine wing (``engine/``, its ``distributed`` lowest); ``hub``; the trainers; the CLI.
"""

from __future__ import annotations

import ast
import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "trl_flow")


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, os.path.dirname(ROOT))[: -len(".py")].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def _modules() -> dict[str, str]:
    out = {}
    for root, _, names in os.walk(ROOT):
        for n in names:
            if n.endswith(".py"):
                out[_module_name(os.path.join(root, n))] = os.path.join(root, n)
    return out


def _resolve(name: str, known: set[str]) -> str | None:
    """The known module ``name`` refers to (``a.b.c`` -> ``a.b`` when ``c`` is an attribute)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.endswith("__init__.py") else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - node.level + 1]
                    prefix = ".".join(base + ([node.module] if node.module else []))
                else:
                    prefix = node.module or ""
                targets = [f"{prefix}.{a.name}" for a in node.names] + [prefix]
            for t in targets:
                if t.startswith("trl_flow"):
                    dep = _resolve(t, known)
                    if dep and dep != mod and not mod.startswith(dep + "."):  # a package's own __init__ is no edge
                        graph[mod].add(dep)
    return graph


def _cycles(graph):
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def _is_package_init_edge(a: str, b: str) -> bool:
    # `trl_flow/__init__.py` and a subpackage's __init__ re-export their members: edges into them are how users import
    return b in ("trl_flow",)


def test_no_import_cycle():
    graph = {m: {d for d in deps if not _is_package_init_edge(m, d)} for m, deps in import_graph().items()}
    assert _cycles(graph) == []


def _deps(prefix: str):
    return {(m, d) for m, deps in import_graph().items() if m == prefix or m.startswith(prefix + ".") for d in deps}


def test_floors():
    graph = import_graph()
    assert graph["trl_flow.storage"] == set(), "storage is the ground floor: it imports nothing of trl_flow"
    up = {"trl_flow.trainers", "trl_flow.cli", "trl_flow.hub"}
    engine_upper = {m for m in graph if m.startswith("trl_flow.engine.") and m != "trl_flow.engine.distributed"}

    def bad(mod_prefix, forbidden):
        return sorted((m, d) for m, d in _deps(mod_prefix)
                      if any(d == f or d.startswith(f + ".") for f in forbidden))

    assert bad("trl_flow.models", up | {"trl_flow.engine"}) == []
    assert bad("trl_flow.hub", {"trl_flow.trainers", "trl_flow.cli"} | engine_upper) == []
    assert bad("trl_flow.engine", up) == []
    assert bad("trl_flow.engine.distributed", engine_upper) == []
    # trainers/ holds the methods, their configs and the base layers only: no run machinery left there
    machinery = {"checkpoints", "distributed", "guards", "interrupts", "model_setup", "output_dir", "prompt_encoding",
                 "tracking", "train_loop", "export"}
    assert not [m for m in graph if m.startswith("trl_flow.trainers.") and m.rsplit(".", 1)[1] in machinery]


def test_the_checks_can_fail():
    """The graph records imports made inside functions (hub's before/after grid imports ``video`` there), and the
    cycle finder finds a two-module loop."""
    assert "trl_flow.video" in import_graph()["trl_flow.hub"]
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
