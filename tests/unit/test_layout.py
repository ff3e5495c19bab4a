"""The package's shape, checked from its imports: eval and loadtest share the verdict core and never import each
other, and no module-level import circle exists (a circle means two modules that cannot be read, or loaded, apart)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parents[2] / "dfserve"


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, module_level_only: bool) -> set[str]:
    tree = ast.parse(path.read_text())
    nodes = tree.body if module_level_only else list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in found if name == "dfserve" or name.startswith("dfserve.")}


MODULES = {_module(path): path for path in PACKAGE.rglob("*.py")}


def _graph(module_level_only: bool) -> dict[str, set[str]]:
    return {name: {i for i in _imports(path, module_level_only) if i in MODULES and i != name}
            for name, path in MODULES.items()}


def test_eval_and_loadtest_never_import_each_other() -> None:
    crossing = [(name, target) for name, targets in _graph(module_level_only=False).items() for target in targets
                if (name.startswith("dfserve.eval") and target.startswith("dfserve.loadtest"))
                or (name.startswith("dfserve.loadtest") and target.startswith("dfserve.eval"))]
    assert crossing == []


def test_no_module_level_import_circle() -> None:
    graph = _graph(module_level_only=True)
    for name in graph:  # a package's __init__ re-exporting its modules is no circle with them
        graph[name] = {t for t in graph[name] if not (name.startswith(t + ".") and MODULES[t].name == "__init__.py")}
    state: dict[str, int] = {}
    circles: list[list[str]] = []

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for target in sorted(graph[name]):
            if state.get(target) == 1:
                circles.append([*path[path.index(target):], target])
            elif target not in state:
                visit(target, [*path, target])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert circles == []


def test_the_graph_is_read_from_the_import_statements() -> None:
    """Two imports the package has: a graph that missed them would pass the checks above vacuously."""
    assert "dfserve.verdict.gate" in _graph(module_level_only=True)["dfserve.loadtest.judge"]
    assert "dfserve.verdict.results" in _graph(module_level_only=True)["dfserve.eval.records"]
