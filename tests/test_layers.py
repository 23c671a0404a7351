"""The package's layers: every import points down, no import circle, no file too long.

The rooms of ``pagedserve``, bottom up (a room is a module or a package; a module belongs
to the room of its longest listed prefix). A module may import its own room and the rooms
below it, never one above:

1. ``version``, ``config``, ``args``: the package version; resolved configs and the
   engine's arguments (dataclasses, no behaviour).
2. ``cpu_ops``: loads our C++ kernels.
3. ``metrics``: Prometheus collectors.
4. ``sampling_params``, ``outputs``: what a user passes in and gets back.
5. ``tokenizer``, ``detokenizer``: text <-> token ids, incremental decoding, stop strings.
6. ``request``: one sequence's state machine (it reaches its grammar through an interface
   it defines, without importing ``structured_output``).
7. ``structured_output``: grammars and their token bitmasks.
8. ``core``: block pool, KV cache manager, scheduler (no tensors).
9. ``attention``: paged attention backends and their metadata.
10. ``model_loader``: model files (paths, configs, weights); formats, not architectures.
11. ``quantization``: how a ``Linear`` holds and multiplies its weight.
12. ``models``: architectures and their layers.
13. ``sample``: the sampler.
14. ``spec_decode``: speculative decoding's draft proposers (no model) and rejection sampler.
15. ``distributed``: rank groups and sharding of a model.
16. ``worker``: one rank's model, KV cache and model runner; builds the model.
17. ``executor``: where the workers run (uni, mp, ray).
18. ``engine``: the engines (sync, async, data-parallel replicas) and their processors.
19. ``entrypoints.openai``: the HTTP server and the dashboard.
20. ``benchmarks``: benchmark commands (they drive engines and draw the dashboard's charts).
21. ``entrypoints``: the offline ``LLM`` API and the command line.
22. ``pagedserve`` itself (``__init__.py``): the public facade, importing from anywhere.

Imports inside functions count (a lazy import hides a circle, it does not remove it); only
imports under ``if TYPE_CHECKING:`` are exempt.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import pagedserve

PACKAGE = Path(pagedserve.__file__).parent

ROOMS = [
    "version", "config", "args", "cpu_ops", "metrics", "sampling_params", "outputs",
    "tokenizer", "detokenizer", "request", "structured_output", "core", "attention",
    "model_loader", "quantization", "models", "sample", "spec_decode", "lora", "distributed",
    "worker",
    "executor", "engine", "entrypoints.openai", "benchmarks", "entrypoints", "",
]
MAX_LINES = 450
MAX_ENGINE_LINES = 250  # engine/llm_engine.py: schedule -> execute -> update, and requests


def module_name(path: Path) -> str:
    parts = ["pagedserve", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:`` (exempt: never run)."""
    exempt = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            exempt.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return exempt


def imported_names(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """Every ``pagedserve...`` name ``module`` imports, at any depth, absolute or relative;
    ``from a import b`` yields ``a.b`` (a module, or a name of module ``a``)."""
    package = module if is_package else module.rpartition(".")[0]
    exempt, names = type_checking_nodes(tree), set()
    for node in ast.walk(tree):
        if id(node) in exempt:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return {n for n in names if n == "pagedserve" or n.startswith("pagedserve.")}


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (each name resolved to the longest
    module that it starts with; a module's imports of itself dropped)."""
    files = {module_name(p): p for p in package.rglob("*.py")}
    graph = {}
    for module, path in files.items():
        targets = set()
        for name in imported_names(ast.parse(path.read_text()), module,
                                   path.name == "__init__.py"):
            while name not in files:
                name = name.rpartition(".")[0]
            if name != module:
                targets.add(name)
        graph[module] = targets
    return graph


def room_of(module: str) -> int:
    """Index in ``ROOMS`` of the module's room; ``KeyError`` for a module in none."""
    rest = module.removeprefix("pagedserve").removeprefix(".")
    matches = [i for i, room in enumerate(ROOMS)
               if rest == room or (room and rest.startswith(room + "."))]
    best = max(matches, key=lambda i: len(ROOMS[i]), default=None)
    if best is None:
        raise KeyError(f"{module} has no room: add it to ROOMS in tests/test_layers.py")
    return best


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} ({ROOMS[room_of(m)] or 'pagedserve'}) imports {t} "
                  f"({ROOMS[room_of(t)] or 'pagedserve'})"
                  for m, targets in graph.items() for t in targets if room_of(t) > room_of(m))


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_every_module_has_a_room():
    for module in import_graph():
        room_of(module)


def test_imports_point_down():
    assert upward_imports(import_graph()) == []


def test_no_import_circles():
    assert import_circles(import_graph()) == []


def test_the_checks_catch_what_they_look_for():
    """Fed a graph with an upward import and a circle (and a lazy import, which counts),
    the checks name them."""
    graph = {"pagedserve.core.scheduler": {"pagedserve.engine.llm_engine"},
             "pagedserve.engine.llm_engine": {"pagedserve.core.scheduler"},
             "pagedserve.request": set()}
    assert upward_imports(graph) == [("pagedserve.core.scheduler (core) imports "
                                      "pagedserve.engine.llm_engine (engine)")]
    assert import_circles(graph) == [["pagedserve.core.scheduler",
                                      "pagedserve.engine.llm_engine"]]
    lazy = ast.parse("def f():\n    from pagedserve.engine import llm_engine\n"
                     "if TYPE_CHECKING:\n    from pagedserve.worker import worker\n")
    assert imported_names(lazy, "pagedserve.core.scheduler", False) == {
        "pagedserve.engine.llm_engine"}
    relative = ast.parse("from . import block_pool\nfrom ..request import Request\n")
    assert imported_names(relative, "pagedserve.core.scheduler", False) == {
        "pagedserve.core.block_pool", "pagedserve.request.Request"}
    with pytest.raises(KeyError, match="has no room"):
        room_of("pagedserve.newroom.module")


def test_files_are_short():
    lengths = {p.relative_to(PACKAGE): len(p.read_text().splitlines())
               for p in PACKAGE.rglob("*.py")}
    assert {p: n for p, n in lengths.items() if n > MAX_LINES} == {}
    assert lengths[Path("engine/llm_engine.py")] <= MAX_ENGINE_LINES
