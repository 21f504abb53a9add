"""The package's shape, read from its source: torch only behind the torch boundary, no import
circle, no module past 800 lines (issue 19, point 6)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import safeview

PACKAGE = Path(safeview.__file__).parent

# The torch boundary: storages, geometry and views; the dispatch-level guard; the process-wide
# guard's entry-point patches. Everything else works on integers.
TORCH_BOUNDARY = {"_torch", "_torch_dispatch", "_entry_guard", "_aten_guard", "_memory"}
MAX_LINES = 800


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path: Path) -> list[tuple[str, bool]]:
    """Every module ``path`` imports when it runs (``if TYPE_CHECKING:`` blocks left out), and
    whether the import is at module level (``False``: inside a function, on first use)."""
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, top: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for statement in node.orelse:
                visit(statement, top)
            return
        if isinstance(node, ast.Import):
            found.extend((alias.name, top) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                module = "safeview" + (f".{module}" if module else "")
            if module == "safeview":  # from safeview import log, _torch
                found.extend((f"safeview.{alias.name}", top) for alias in node.names)
            else:
                found.append((module, top))
        inner = top and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    for statement in ast.parse(path.read_text()).body:
        visit(statement, True)
    return found


def _modules() -> dict[str, Path]:
    return {path.stem: path for path in sorted(PACKAGE.glob("*.py"))}


def _package_imports(name: str, path: Path, top_only: bool) -> set[str]:
    modules = _modules()
    found = set()
    for module, top in _imports(path):
        parts = module.split(".")
        ours = parts[0] == "safeview" and len(parts) > 1 and parts[1] in modules
        if ours and parts[1] != name and (top or not top_only):
            found.add(parts[1])
    return found


def test_only_the_torch_boundary_modules_import_torch() -> None:
    importers = {
        name
        for name, path in _modules().items()
        for module, _ in _imports(path)
        if module == "torch" or module.startswith("torch.")
    }
    assert importers == TORCH_BOUNDARY


def test_the_dispatch_guard_builds_on_the_first_half_and_neither_imports_upward() -> None:
    modules = _modules()
    assert _package_imports("_torch", modules["_torch"], top_only=False) == {"errors"}
    assert _package_imports("_torch_dispatch", modules["_torch_dispatch"], top_only=False) == {
        "_torch"
    }


# Entry points, which the interpreter or another program starts and which import the package from
# above: the start-up hook (loaded by safeview-guard.pth before anything else, it imports
# safeview.process once torch or an engine is imported), the command, ``python -m safeview``.
ENTRY_POINTS = {"_startup", "cli", "__main__"}


@pytest.mark.parametrize("top_only", [True, False], ids=["module level", "imports on first use"])
def test_no_module_imports_another_in_a_circle(top_only: bool) -> None:
    graph = {
        name: _package_imports(name, path, top_only=top_only) for name, path in _modules().items()
    }
    assert "_torch" in graph["view"]  # the scan sees the package's own imports
    if not top_only:
        assert "process" in graph["_startup"]  # the scan sees imports inside functions
        graph = {
            name: imported if name not in ENTRY_POINTS else set()
            for name, imported in graph.items()
        }
    done: set[str] = set()

    def walk(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, " -> ".join((*path, name))
        if name in done:
            return
        for imported in sorted(graph[name]):
            walk(imported, (*path, name))
        done.add(name)

    for name in graph:
        walk(name, ())


def test_no_module_passes_800_lines() -> None:
    lengths = {name: len(path.read_text().splitlines()) for name, path in _modules().items()}
    assert lengths["_torch"] > 100  # the count reads the real files
    assert {name: n for name, n in lengths.items() if n > MAX_LINES} == {}
