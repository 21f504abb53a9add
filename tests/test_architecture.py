"""The package's shape, read from its source (issue 27): a folder per face and per engine over
a core of plain rules, each allowed to import only what lies below it; torch only behind the
torch boundary; no import circle, imports on first use included."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import safeview

PACKAGE = Path(safeview.__file__).parent

# The contract every face shares, at the root: integers, layouts, the one checker and its
# sweeps, errors, findings, policy, events, ``make_view`` and its torch boundary, plans.
CORE = {
    "_arith", "check", "errors", "findings", "log", "overlap", "plan", "policy", "spec",
    "testing", "view", "_torch",
}  # fmt: skip
# What each part may import besides itself and the core: the faces stand on the core and on
# the faces below them; an engine's folder (vLLM, SGLang) uses the faces; nothing imports it but
# the package's own lazy names.
MAY_IMPORT = {
    "core": set(),
    "manifest": set(),  # two parties: what each page byte means, and the diff
    "transfer": {"manifest"},  # descriptors judged over a memory map (of a manifest's pages)
    "guard": {"transfer", "manifest"},  # sanitize, the process guard (it judges engines' rows)
    "kv": {"guard"},  # whole registrations, checked, then run under sanitize()
    "cli": {"manifest", "transfer", "guard"},  # the command: check, diff, run, the map
    "vllm": {"kv", "manifest", "transfer", "guard"},  # vLLM's names, rules and plugin
    "sglang": {"kv", "manifest", "transfer", "guard"},  # SGLang's pools and plugin (issue 39)
    "package": {"manifest", "transfer", "guard", "kv", "cli", "vllm"},  # safeview/__init__.py
}
# The torch boundary: storages, geometry and views (the core's), the digest's arithmetic on pages
# (``manifest._digest_torch``), the dispatch-level guard, the
# process guard's entry points and kernels, and its memory map (which asks torch's CUDA
# allocator where its blocks end). Everything else works on integers.
TORCH_BOUNDARY = {
    "_torch", "guard._torch_dispatch", "guard._entry_guard", "guard._aten_guard", "guard._memory",
    "manifest._digest_torch",
}  # fmt: skip
# Started from outside the package (the interpreter's start-up hook, a console script,
# ``python -m``): they import the package from above, so an edge back to them is no circle.
ENTRY_POINTS = {"guard._startup", "cli", "__main__"}


def _modules() -> dict[str, Path]:
    """Every module of the package by its dotted name under ``safeview``: ``log``,
    ``guard.process``; a folder's ``__init__.py`` by the folder's name (``transfer``)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1] or ("__init__",)
        found[".".join(parts)] = path
    return found


def _part(name: str) -> str:
    """The part of the package a module belongs to (a key of ``MAY_IMPORT``)."""
    if name == "__init__":
        return "package"
    if name in CORE or name == "__main__":
        return "core" if name in CORE else "cli"
    return name.split(".")[0]


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path: Path) -> list[tuple[str, bool]]:
    """Every module ``path`` imports when it runs (``if TYPE_CHECKING:`` blocks left out), and
    whether the import is at module level (``False``: inside a function, on first use)."""
    modules = _modules()
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, top: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for statement in node.orelse:
                visit(statement, top)
            return
        if isinstance(node, ast.Import):
            found.extend((alias.name, top) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert not node.level, f"{path}: a relative import"
            module = node.module or ""
            for alias in node.names:  # from safeview.guard import process: a module
                inner = f"{module}.{alias.name}"
                inside = inner.removeprefix("safeview.")
                found.append((inner if inside in modules else module, top))
        inner_top = top and not isinstance(
            node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
        )
        for child in ast.iter_child_nodes(node):
            visit(child, inner_top)

    for statement in ast.parse(path.read_text()).body:
        visit(statement, True)
    return found


def _package_imports(name: str, path: Path, top_only: bool) -> set[str]:
    """The package's modules ``name`` imports; importing ``safeview.transfer.nixl`` from outside
    the folder runs the folder's ``safeview.transfer`` first, so it counts as importing both."""
    modules = _modules()
    found = set()
    for module, top in _imports(path):
        if not module.startswith("safeview.") or (top_only and not top):
            continue
        parts = module.removeprefix("safeview.").split(".")
        for end in range(1, len(parts) + 1):
            inside = ".".join(parts[:end])
            # a folder's own modules are imported by its __init__, not the other way round
            if inside in modules and inside != name and not name.startswith(inside + "."):
                found.add(inside)
    return found


def test_only_the_torch_boundary_modules_import_torch() -> None:
    importers = {
        name
        for name, path in _modules().items()
        for module, _ in _imports(path)
        if module == "torch" or module.startswith("torch.")
    }
    assert importers == TORCH_BOUNDARY


def test_every_module_belongs_to_a_known_part() -> None:
    parts = {_part(name) for name in _modules()}
    assert parts == set(MAY_IMPORT), parts ^ set(MAY_IMPORT)
    assert {"guard.process", "transfer.nixl", "manifest.diff", "vllm._layout"} <= set(_modules())


@pytest.mark.parametrize("top_only", [True, False], ids=["module level", "imports on first use"])
def test_each_part_imports_only_the_core_and_the_parts_below_it(top_only: bool) -> None:
    broken = []
    for name, path in _modules().items():
        part = _part(name)
        allowed = {"core", part} | MAY_IMPORT[part]
        for imported in sorted(_package_imports(name, path, top_only)):
            if _part(imported) not in allowed:
                broken.append(f"{name} ({part}) imports {imported} ({_part(imported)})")
    assert broken == []


def test_the_core_imports_no_face_and_no_engine() -> None:
    # the rule above, said for the core by name: a bug that lets it import upward fails here
    for name in CORE:
        imported = _package_imports(name, _modules()[name], top_only=False)
        assert {_part(module) for module in imported} <= {"core"}, (name, imported)


def test_the_dispatch_guard_builds_on_the_first_half_and_neither_imports_upward() -> None:
    modules = _modules()
    assert _package_imports("_torch", modules["_torch"], top_only=False) == {"errors"}
    dispatch = _package_imports("guard._torch_dispatch", modules["guard._torch_dispatch"], False)
    assert dispatch == {"_torch"}


@pytest.mark.parametrize("top_only", [True, False], ids=["module level", "imports on first use"])
def test_no_module_imports_another_in_a_circle(top_only: bool) -> None:
    graph = {
        name: _package_imports(name, path, top_only=top_only) for name, path in _modules().items()
    }
    assert "_torch" in graph["view"]  # the scan sees the package's own imports
    if not top_only:  # and a folder's own module under a submodule imported from outside
        assert {"transfer", "transfer.nixl"} <= graph["guard._engine_hooks"]
    if not top_only:
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
        if name != "__init__":  # the package itself names everything, lazily
            walk(name, ())


def test_a_folder_module_that_holds_no_code_says_why_it_is_there() -> None:
    # no module only re-exports another: a folder's __init__ holds its public module's code,
    # or only its docstring
    for name, path in _modules().items():
        tree = ast.parse(path.read_text())
        body = [node for node in tree.body if not isinstance(node, (ast.Import, ast.ImportFrom))]
        if len(body) < len(tree.body) and len(body) <= 1:
            assert ast.get_docstring(tree), f"{name} re-exports without saying why"
