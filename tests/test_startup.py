"""The start-up hook's cost, as every process a guarded server starts pays it: with
``SAFEVIEW_GUARD`` set, ``python -c pass`` imports nothing that it does not import unset, not even
the hook's own file until a watched module is looked up (benchmarks/bench_startup.py measures the
milliseconds). What the hook does
(a bad value, a second read, the guard going on at a watched import) is tested in
tests/test_process_guard.py."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HOOK_INSTALLED = (Path(sysconfig.get_paths()["purelib"]) / "safeview-guard.pth").exists()
needs_hook = pytest.mark.skipif(
    not HOOK_INSTALLED, reason="safeview-guard.pth is not installed here (reinstall safeview)"
)
# what the hook of 0.4.1 imported: 9 to 13 ms of start-up together, measured on this machine
SLOW = {
    "typing", "re", "enum", "contextlib", "importlib.util", "importlib.machinery",
    "collections.abc", "functools", "types", "__future__", "warnings",
}  # fmt: skip


def _run(*options: str, **variables: str) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("SAFEVIEW_")}
    environment.update(variables)
    return subprocess.run(
        [sys.executable, *options],
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",  # not the checkout: the hook must find the package as an installed one
    )


def _modules(**variables: str) -> set[str]:
    result = _run("-c", "import sys; print(sorted(sys.modules))", **variables)
    assert result.returncode == 0, result.stderr
    return set(ast.literal_eval(result.stdout))


@needs_hook
@pytest.mark.parametrize("value", ["strict", "warn", "off", "strcit"])
def test_the_hook_imports_nothing_python_c_pass_does_not(value: str) -> None:
    unset = _modules()
    hooked = _modules(SAFEVIEW_GUARD=value)
    assert hooked & SLOW == unset & SLOW
    # a policy: only the placeholder on sys.meta_path, not even the hook's file (read when a
    # watched module is looked up); a bad value: the hook's file, which says so
    assert hooked - unset == (set() if value != "strcit" else {"safeview.guard._startup"})


@needs_hook
@pytest.mark.parametrize("value", ["strict", "warn"])
def test_the_placeholder_hands_over_at_the_first_watched_import(value: str) -> None:
    program = (
        "import sys\n"
        "names = lambda: [type(f).__name__ for f in sys.meta_path if 'Distutils' not in repr(f)]\n"
        "before = names()\n"
        "import json\n"  # an import that is not watched: nothing happens
        "middle = names()\n"
        "import torch\n"
        "from safeview.guard import process\n"
        "print(before[0], middle[0], names()[0], process.policy().value, names().count('Finder'))"
    )
    result = _run("-c", program, SAFEVIEW_GUARD=value)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["SafeviewGuardHook", "SafeviewGuardHook", "Finder", value, "1"]


@pytest.mark.slow
def test_the_hooks_file_still_starts_the_guard_for_a_hook_of_0_6_2() -> None:
    # an editable install updated without reinstalling keeps its old safeview-guard.pth, which
    # loads _startup.py at start with _from_hook set: the finder goes on at once, as it did
    program = f"""
import importlib.util, sys
sys.path[:0] = [{sysconfig.get_paths()["purelib"]!r}, {str(ROOT)!r}]
spec = importlib.util.spec_from_file_location(
    "safeview.guard._startup", {str(ROOT / "safeview" / "guard" / "_startup.py")!r})
module = importlib.util.module_from_spec(spec)
module._from_hook = True
sys.modules[spec.name] = module
spec.loader.exec_module(module)
print(type(sys.meta_path[0]).__name__)
import torch
from safeview.guard import process
print(process.active(), process.policy().value)
"""
    result = _run("-S", "-c", program, SAFEVIEW_GUARD="warn")  # -S: no .pth read at all
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["Finder", "True", "warn"]


@needs_hook
def test_importtime_lists_the_same_imports_with_the_variable_set() -> None:
    def imported(**variables: str) -> set[str]:
        result = _run("-X", "importtime", "-c", "pass", **variables)
        assert result.returncode == 0, result.stderr
        rows = [line.split("|") for line in result.stderr.splitlines()]
        return {row[-1].strip() for row in rows if line_is_row(row)}

    def line_is_row(row: list[str]) -> bool:
        return len(row) == 3 and row[0].startswith("import time:") and "package" not in row[-1]

    unset = imported()
    assert "site" in unset  # the lines were read
    assert imported(SAFEVIEW_GUARD="strict") == unset


def test_the_hooks_file_imports_only_os_and_sys_when_it_runs() -> None:
    # the same promise without the hook installed: module-level imports outside
    # ``if TYPE_CHECKING:``, and none inside its functions (the guard's own,
    # ``safeview.guard.process`` and ``safeview.log``, load only when a watched module is imported)
    tree = ast.parse((ROOT / "safeview" / "guard" / "_startup.py").read_text())
    at_start: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            at_start.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            at_start.add(node.module or "")
        elif isinstance(node, ast.If) and ast.unparse(node.test) != "TYPE_CHECKING":
            assert not any(isinstance(n, (ast.Import, ast.ImportFrom)) for n in ast.walk(node))
    assert at_start == {"os", "sys"}
    functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
    later = {
        node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
        for function in functions
        for node in ast.walk(function)
        if isinstance(node, (ast.Import, ast.ImportFrom))
    }
    # the rest of the hook, the guard and its events: when a watched module is looked up
    assert later == {"safeview", "safeview.guard", "safeview.guard._import_hook"}


def test_the_pth_line_uses_only_what_the_interpreter_has_loaded() -> None:
    line = (ROOT / "safeview" / "guard" / "_guard.pth").read_text()
    assert line.count("\n") == 1  # one line: site runs a .pth line that starts with import
    code = ast.literal_eval(line[line.index("exec(") + 5 : line.rindex(", {")])
    tree = ast.parse(code)
    first = tree.body[0]
    assert isinstance(first, ast.Try)
    preferred = {n.module for n in first.body if isinstance(n, ast.ImportFrom)}
    assert preferred == {"_frozen_importlib", "_frozen_importlib_external"}
    imported = {alias.name for n in tree.body if isinstance(n, ast.Import) for alias in n.names}
    for name in preferred | imported:  # loaded before any .pth is read, in every CPython
        assert name in sys.modules
    # the placeholder watches what the hook's file watches, under the name process.stop knows
    from safeview.guard import _startup

    (hook,) = [n for n in tree.body if isinstance(n, ast.ClassDef)]
    assert hook.name == _startup.HOOK
    assert set(_startup.WATCHED) <= {
        n.value for n in ast.walk(hook) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }
