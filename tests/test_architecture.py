"""The house as its imports draw it: rooms import downwards only, and no module imports itself back.

Rooms, top to bottom: train -> serve_eval -> drafts -> kernels. Every import counts, lazy ones
inside functions too (a lazy import is still a dependency), except those under `if TYPE_CHECKING:`,
which exist only for annotations.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOMS = ("kernels", "drafts", "serve_eval", "train")   # a room may import the rooms before it


def _modules() -> dict[str, Path]:
    found = {}
    for room in ROOMS:
        for path in sorted((REPO / "draftsmith" / room).rglob("*.py")):
            parts = list(path.relative_to(REPO / "draftsmith").with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found["draftsmith." + ".".join(parts)] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported(path: Path, module: str, known: set[str]) -> set[str]:
    """Project modules `module` imports (resolved to the longest known module name)."""
    names: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    resolved = set()
    for name in names:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name and name != module:
            resolved.add(name)
    return resolved


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {module: _imported(path, module, known) for module, path in modules.items()}


def test_rooms_import_downwards_only(graph):
    rank = {room: i for i, room in enumerate(ROOMS)}
    upward = sorted(f"{a} -> {b}" for a, deps in graph.items() for b in deps
                    if rank[b.split(".")[1]] > rank[a.split(".")[1]])
    assert not upward, "imports against the room order (train -> serve_eval -> drafts -> kernels):\n" + "\n".join(upward)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_no_import_circles(graph):
    # A package's __init__ importing its own submodules is how packages re-export; that is no circle.
    edges = {a: {b for b in deps if not a.startswith(b + ".") and not b.startswith(a + ".")}
             for a, deps in graph.items()}
    circles = _cycles(edges)
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_the_checker_sees_a_circle_and_an_upward_import():
    """Negative control: the same functions flag a scripted circle and a scripted upward import."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _imported(Path(__file__), "tests.test_architecture", {"pytest", "ast"}) == {"pytest", "ast"}
