"""The package's import graph flows one way: no two rooms import each other, even lazily; no
module cycle inside a room; and every import goes down a declared order of layers."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import specbatch

ROOT = Path(specbatch.__file__).parent
# name -> module, for the names the package's __init__ re-exports
_FACADE = {
    alias.asname or alias.name: node.module
    for node in ast.walk(ast.parse((ROOT / "__init__.py").read_text()))
    if isinstance(node, ast.ImportFrom) and node.module
    for alias in node.names
}


def _room(module: str) -> str | None:
    """The room a module lives in: its subpackage, or itself for a top-level module (either
    way the name after ``specbatch.``)."""
    parts = module.split(".")
    if parts[0] != "specbatch" or len(parts) == 1:
        return None  # outside the package, or the package's own facade
    return parts[1]


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> Iterator[str]:
    """Every module imported at run time (module level or inside functions), not the
    imports that exist for type checkers only."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                yield from _imports(child)
            continue
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert not node.level, "relative imports would hide rooms from this check"
            if node.module == "specbatch":  # through the facade: where each name comes from
                yield from (_FACADE.get(alias.name, "specbatch") for alias in node.names)
            elif node.module:
                yield node.module
        yield from _imports(node)


def module_graph() -> dict[str, set[str]]:
    """Every module of the package and the package's modules it imports (a name imported
    from a module counts as that module)."""
    sources: dict[str, ast.AST] = {}
    for path in ROOT.rglob("*.py"):
        module = ".".join(("specbatch", *path.relative_to(ROOT).with_suffix("").parts))
        sources[module.removesuffix(".__init__")] = ast.parse(path.read_text())

    def known(name: str) -> str:
        while name and name not in sources:
            name = name.rpartition(".")[0]
        return name

    graph: dict[str, set[str]] = {}
    for module, tree in sources.items():
        imported = {known(name) for name in _imports(tree) if name.startswith("specbatch")}
        graph[module] = imported - {module, ""}
    return graph


def import_graph() -> dict[str, set[str]]:
    """The rooms (subpackages and top-level modules) and the rooms each imports."""
    graph: dict[str, set[str]] = {}
    for module, imported in module_graph().items():
        source = _room(module)
        if source is None:
            continue
        for target in filter(None, map(_room, imported)):
            if target != source:
                graph.setdefault(source, set()).add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one room (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_cycle_finder_finds_a_loop() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}}) == []


def test_no_room_imports_a_room_that_imports_it() -> None:
    graph = import_graph()
    assert {"engine", "scheduler", "cache", "spec_decode", "runner"} <= set(graph)
    assert cycles(graph) == []


def test_lower_rooms_do_not_reach_up() -> None:
    graph = import_graph()
    # Policy and memory never see the engine or the proposers; kernels hold no state.
    for low in ("scheduler", "cache", "kernels", "sequence", "runner", "models"):
        assert not graph.get(low, set()) & {"engine", "spec_decode", "server", "cli"}, low


# Bottom to top; a module may import only from layers below its own (or from its own room).
# Rooms in one layer may not import each other.
LAYERS: dict[str, list[set[str]]] = {
    "specbatch": [
        {"errors", "utils"},
        {"sampling_params"},
        {"kernels"},
        {"sequence", "models", "outputs"},
        {"tokenizer", "cache"},
        {"runner", "scheduler", "structured"},
        {"spec_decode"},
        {"config"},
        {"parallel"},
        {"engine"},
        {"distill", "server"},
        {"batch"},
        {"cli"},
    ],
    "specbatch.spec_decode": [
        {"tuning"},
        {"config"},
        {"verification"},
        {"control", "proposers"},
        {"plan"},
        {"speculator"},
        {"factory"},
    ],
}


def _child(package: str, module: str) -> str | None:
    """The room of ``package`` that ``module`` lives in (its first name below the package)."""
    if not module.startswith(package + "."):
        return None
    return module[len(package) + 1 :].split(".")[0]


def layer_violations(graph: dict[str, set[str]], package: str, layers: list[set[str]]) -> list:
    """Imports inside ``package`` that do not go down ``layers``."""
    level = {room: i for i, rooms in enumerate(layers) for room in rooms}
    found = []
    for module, imported in graph.items():
        source = _child(package, module)
        for target in filter(None, (_child(package, name) for name in imported)):
            if source is None or source == target:
                continue
            if level[source] <= level[target]:
                found.append((module, target))
    return found


def test_no_module_cycles_inside_a_room() -> None:
    assert cycles(module_graph()) == []


def test_every_module_is_in_a_declared_layer() -> None:
    graph = module_graph()
    for package, layers in LAYERS.items():
        declared = set().union(*layers)
        rooms = {_child(package, module) for module in graph} - {None}
        assert rooms <= declared, (package, rooms - declared)


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_imports_go_down_the_declared_layers(package: str) -> None:
    assert layer_violations(module_graph(), package, LAYERS[package]) == []


def test_a_layer_violation_is_found() -> None:
    graph = {"p.low.a": {"p.high"}, "p.high": {"p.low.b"}}
    assert layer_violations(graph, "p", [{"low"}, {"high"}]) == [("p.low.a", "high")]
    assert layer_violations(graph, "p", [{"low", "high"}]) == [
        ("p.low.a", "high"),
        ("p.high", "low"),
    ]
