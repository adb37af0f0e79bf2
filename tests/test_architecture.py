"""The package's layers, read from its imports: no cycles, and no import that runs back up.

Layers, lowest first: errors; core (the algorithm, no models); kernels (C and their bindings);
runners, loading and cache (model execution); drafters; the decoder; the engine; and on top the server, bench and the CLI.
A module may import from its own layer or below. Imports inside functions count too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import specdecode

PACKAGE = Path(specdecode.__file__).parent
LAYERS = [
    ("specdecode.errors", "specdecode.cpu", "specdecode.precision"),
    ("specdecode.core",),
    ("specdecode.kernels",),
    ("specdecode.runners", "specdecode.loading", "specdecode.cache"),
    ("specdecode.drafters",),
    ("specdecode.decoder",),
    ("specdecode.engine",),
    ("specdecode.server", "specdecode.bench", "specdecode.training", "specdecode.cli", "specdecode"),
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """The specdecode modules a file imports, anywhere in it."""
    modules = {module_name(p) for p in PACKAGE.rglob("*.py")}
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from specdecode.runners import fast_llama` imports a module, not a name of the package
            submodules = {f"{node.module}.{alias.name}" for alias in node.names} & modules
            found |= submodules if len(submodules) == len(node.names) else {node.module} | submodules
    return {name for name in found if name in modules}


def graph() -> dict[str, set[str]]:
    return {module_name(path): imports(path) - {module_name(path)} for path in PACKAGE.rglob("*.py")}


def layer(module: str) -> int:
    matches = [
        (len(prefix), i)
        for i, prefixes in enumerate(LAYERS)
        for prefix in prefixes
        if module == prefix or module.startswith(prefix + ".")
    ]
    return max(matches)[1]  # the longest prefix names the module's layer


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        path.pop()
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_package_has_no_import_cycle():
    assert find_cycle(graph()) is None, " -> ".join(find_cycle(graph()))


def test_the_cycle_finder_finds_a_cycle():  # negative control
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_module_imports_from_a_layer_above_its_own():
    upward = [
        f"{module} (layer {layer(module)}) imports {target} (layer {layer(target)})"
        for module, targets in graph().items()
        for target in targets
        if layer(target) > layer(module)
    ]
    assert not upward, "\n".join(upward)


def test_the_layers_are_read_as_intended():
    assert layer("specdecode.core.verification") == 1
    assert layer("specdecode.kernels.int8_layer") == 2
    assert layer("specdecode.runners.fast_llama") == 3
    assert layer("specdecode.server.worker") == 7
    assert layer("specdecode.training.trainer") == 7
    assert layer("specdecode.precision") == 0
    assert "specdecode.runners.fast_llama" in graph()["specdecode.runners.select"]
