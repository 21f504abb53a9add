"""The start-up hook's cost, as every process a guarded server starts pays it: with
``SAFEVIEW_GUARD`` set, ``python -c pass`` imports nothing that it does not import unset, but the
hook's own file (benchmarks/bench_startup.py measures the milliseconds). What the hook does
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
    assert "safeview.guard._startup" in hooked  # the hook ran
    assert hooked & SLOW == unset & SLOW
    assert hooked - unset == {"safeview.guard._startup"}


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
    assert later == {"safeview", "safeview.guard"}  # the guard and its events, when one is imported


def test_the_pth_line_uses_only_what_the_interpreter_has_loaded() -> None:
    line = (ROOT / "safeview" / "guard" / "_guard.pth").read_text()
    assert line.count("\n") == 1  # one line: site runs a .pth line that starts with import
    code = ast.literal_eval(line[line.index("exec(") + 5 : line.rindex(", {")])
    tree = ast.parse(code)
    first = tree.body[0]
    assert isinstance(first, ast.Try)
    preferred = {n.module for n in first.body if isinstance(n, ast.ImportFrom)}
    assert preferred == {"_frozen_importlib", "_frozen_importlib_external"}
    for name in preferred:  # loaded before any .pth is read, in every CPython
        assert name in sys.modules
