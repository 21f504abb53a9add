"""The process guard (``SAFEVIEW_GUARD``, ``safeview run``, ``safeview.guard.process``): real
subprocesses with the variable set and unset, and the guard started in this process for the
entry points one by one (stopped after each test)."""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from safeview import BoundsError
from safeview.guard import process
from safeview.guard._startup import resolve
from safeview.testing import capture_events

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
SITE_PACKAGES = sysconfig.get_paths()["purelib"]
HOOK_INSTALLED = (Path(SITE_PACKAGES) / "safeview-guard.pth").exists()
needs_hook = pytest.mark.skipif(
    not HOOK_INSTALLED, reason="safeview-guard.pth is not installed here (reinstall safeview)"
)


def _environment(**variables: str) -> dict[str, str]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("SAFEVIEW_")}
    environment.update(variables)
    return environment


def _python(
    code: str, *options: str, python: str = PYTHON, **variables: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [python, *options, "-c", textwrap.dedent(code)],
        env=_environment(**variables),
        capture_output=True,
        text=True,
        timeout=300,
        cwd="/",
    )


# The program of the issue: an out-of-bounds four-argument set_ on a worker thread started before
# torch was imported, on one started after, and in a ThreadPoolExecutor, over a resizable storage
# that another tensor uses (torch reallocates it: the bug). It prints what happened, as JSON.
OUT_OF_BOUNDS_SET = """
    import json, threading
    from concurrent.futures import ThreadPoolExecutor
    go = threading.Event()
    results = {}

    def attempt(where):
        import torch
        try:
            torch.empty(0, dtype=torch.int8).set_(kv.untyped_storage(), 0, (5, 16), (16, 1))
            results[where] = "made"
        except Exception as error:
            results[where] = type(error).__name__ + ": " + str(error)

    early = threading.Thread(target=lambda: (go.wait(), attempt("thread started before torch")))
    early.start()
    import torch
    kv = torch.arange(64, dtype=torch.int8)
    layer = kv[16:32]
    before = (kv.untyped_storage().nbytes(), kv.untyped_storage().data_ptr())
    go.set(); early.join()
    late = threading.Thread(target=attempt, args=("thread",)); late.start(); late.join()
    with ThreadPoolExecutor(2) as pool:
        pool.submit(attempt, "executor").result()
    after = (kv.untyped_storage().nbytes(), kv.untyped_storage().data_ptr())
    print(json.dumps({
        "results": results,
        "nbytes": [before[0], after[0]],
        "moved": before[1] != after[1],
        "layer": layer.tolist(),
    }, sort_keys=True))
"""


@needs_hook
def test_strict_refuses_out_of_bounds_set_in_every_thread_and_resizes_nothing() -> None:
    result = _python(OUT_OF_BOUNDS_SET, SAFEVIEW_GUARD="strict")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert set(report["results"]) == {"thread started before torch", "thread", "executor"}
    for outcome in report["results"].values():
        assert outcome.startswith("BoundsError: ")
        assert "needs bytes [0, 80) but the storage has 64 bytes (16 bytes past the end)" in outcome
        assert "by Tensor.set_" in outcome
    assert report["nbytes"] == [64, 64]
    assert report["moved"] is False
    assert report["layer"] == list(range(16, 32))


@pytest.mark.slow
@needs_hook
def test_unset_runs_byte_for_byte_as_without_the_hook() -> None:
    # "before": the same interpreter and packages with no .pth file read at all (-S, the
    # site-packages folder on PYTHONPATH); "now": the hook installed, SAFEVIEW_GUARD unset.
    before = _python(OUT_OF_BOUNDS_SET, "-S", PYTHONPATH=SITE_PACKAGES)
    now = _python(OUT_OF_BOUNDS_SET)
    empty = _python(OUT_OF_BOUNDS_SET, SAFEVIEW_GUARD="  ")
    assert before.returncode == now.returncode == empty.returncode == 0, now.stderr
    assert now.stdout == before.stdout == empty.stdout
    assert now.stderr == before.stderr == empty.stderr == ""
    report = json.loads(now.stdout)
    # unguarded, torch reallocates the storage under the other tensor: the bug, as it is
    assert set(report["results"].values()) == {"made"}
    assert report["nbytes"] == [64, 80]
    checked = _python(
        "import sys, torch; print(sorted(m for m in sys.modules if m.startswith('safeview')))"
    )
    assert checked.stdout.strip() == "[]"


@needs_hook
def test_warn_logs_and_changes_nothing() -> None:
    unguarded = _python(OUT_OF_BOUNDS_SET)
    warned = _python(OUT_OF_BOUNDS_SET, SAFEVIEW_GUARD="warn", SAFEVIEW_LOG_FORMAT="json")
    assert warned.returncode == 0, warned.stderr
    assert warned.stdout == unguarded.stdout
    events = [json.loads(line) for line in warned.stderr.splitlines() if line.startswith("{")]
    names = [event["event"] for event in events]
    assert names[0] == "process_guard_started"
    assert names.count("process_guard_started") == 1
    # the first set_ grows the storage to 80 bytes, as torch does: the next two then fit
    assert names.count("bounds_violation") == 1
    assert names[-1] == "process_guard_stopped"
    started, stopped = events[0], events[-1]
    assert started["policy"] == "warn"
    assert started["source"] == "SAFEVIEW_GUARD"
    assert "Tensor.set_" in started["watches"]
    assert "torch.frombuffer" in started["watches"]
    assert stopped["warned"] == 1
    assert stopped["refused"] == 0
    violation = events[names.index("bounds_violation")]
    assert violation["policy"] == "warn"
    assert violation["op"] == "Tensor.set_"
    assert violation["overflow_bytes"] == 16
    assert violation["function"] == "attempt"


@pytest.mark.slow
@needs_hook
@pytest.mark.parametrize("value", ["1", "yes", "strcit", "strict!", "on"])
def test_bad_values_warn_in_one_line_and_run_unguarded(value: str) -> None:
    result = _python(
        "import torch; from safeview.guard import process; print(process.active())",
        SAFEVIEW_GUARD=value,
    )
    assert result.returncode == 0
    assert result.stdout.strip() == "False"
    lines = result.stderr.splitlines()
    assert len(lines) == 1
    assert f"SAFEVIEW_GUARD={value!r} is not a valid value" in lines[0]
    assert "allowed values: strict, warn, off" in lines[0]


@pytest.mark.parametrize(
    ("raw", "expected"),
    [(None, None), ("", None), ("   ", None), ("off", None), (" Strict ", "strict"),
     ("WARN", "warn"), ("warn\n", "warn")],
)  # fmt: skip
def test_values_are_read_as_the_bounds_policy_is(raw: str | None, expected: str | None) -> None:
    assert resolve(raw, report=False) == expected


@needs_hook
def test_a_program_without_torch_or_safeview_imports_neither() -> None:
    code = (
        "import sys; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'safeview')))"
    )
    unset = _python(code)
    assert unset.stdout.strip() == "[]"
    guarded = _python(code, SAFEVIEW_GUARD="strict")
    # the hook puts its placeholder on sys.meta_path: it loads neither the package nor torch,
    # nor its own file until torch (or an engine) is looked up
    assert guarded.stdout.strip() == "[]"
    assert guarded.stderr == ""


_MODULES = "import sys; print(' '.join(sorted(sys.modules)))"


def _startup_modules(python: str) -> set[str]:
    """The modules an interpreter has loaded when its program's first line runs."""
    result = subprocess.run(
        [python, "-c", _MODULES], env=_environment(), check=True, capture_output=True, text=True
    )
    return set(result.stdout.split())


def _with_and_without_hook(python: str, purelib: Path) -> tuple[set[str], set[str]]:
    """The modules ``python`` starts with, without and with ``safeview-guard.pth``
    (``SAFEVIEW_GUARD`` unset). What the hook costs in time is measured in
    ``benchmarks/bench_startup.py``, not here: a timed test fails on a busy machine."""
    hook = purelib / "safeview-guard.pth"
    aside = purelib / "safeview-guard.pth.aside"
    hook.rename(aside)
    try:
        without = _startup_modules(python)
    finally:
        aside.rename(hook)
    return without, _startup_modules(python)


@pytest.fixture(scope="module")
def venvs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two fresh virtual environments, safeview installed into one with ``pip install .`` and
    into the other with ``pip install -e .`` (hatchling builds both; no dependencies: the test
    interpreter's packages are reachable through a path file). The modules each starts with,
    before and after the install."""
    if shutil.which("git") is None:  # pragma: no cover
        pytest.skip("no git")
    root = tmp_path_factory.mktemp("venvs")
    made: dict[str, Any] = {}
    for kind in ("regular", "editable"):
        folder = root / kind
        subprocess.run([PYTHON, "-m", "venv", "--without-pip", str(folder)], check=True)
        python = str(folder / "bin" / "python")
        purelib = subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        # this interpreter's packages (torch, pydantic, ...), after the venv's own
        Path(purelib, "zz-test-packages.pth").write_text(SITE_PACKAGES + "\n")
        made[kind] = {"python": python, "purelib": Path(purelib)}
    # start-up before safeview is installed
    for info in made.values():
        info["before"] = _startup_modules(info["python"])
    for kind, info in made.items():
        target = ["-e", str(ROOT)] if kind == "editable" else [str(ROOT)]
        subprocess.run(
            [sys.executable, "-m", "pip", "--python", info["python"], "install", "--quiet",
             "--no-deps", *target],
            check=True, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        info["without"], info["with"] = _with_and_without_hook(info["python"], info["purelib"])
    return made


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["regular", "editable"])
def test_hook_works_for_pip_install_and_pip_install_e(venvs: dict[str, Any], kind: str) -> None:
    info = venvs[kind]
    assert (info["purelib"] / "safeview-guard.pth").exists()
    result = _python(OUT_OF_BOUNDS_SET, python=info["python"], SAFEVIEW_GUARD="strict")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert all(outcome.startswith("BoundsError") for outcome in report["results"].values())
    assert report["nbytes"] == [64, 64]
    where = _python("import safeview; print(safeview.__file__)", python=info["python"])
    if kind == "editable":
        assert where.stdout.strip() == str(ROOT / "safeview" / "__init__.py")
    else:
        assert where.stdout.strip().startswith(str(info["purelib"]))


@pytest.mark.parametrize("kind", ["regular", "editable"])
def test_start_up_unset_imports_nothing(venvs: dict[str, Any], kind: str) -> None:
    info = venvs[kind]
    # unset, the hook's one line reads a variable: the interpreter starts with the modules it
    # started with before safeview was installed, and with the hook set aside
    assert info["with"] == info["without"] == info["before"], info["with"] ^ info["before"]
    assert "safeview" not in " ".join(info["with"])


@pytest.mark.slow
def test_hook_read_twice_is_harmless(venvs: dict[str, Any]) -> None:
    info = venvs["regular"]
    hook = info["purelib"] / "safeview-guard.pth"
    twice = info["purelib"] / "safeview-guard-again.pth"
    shutil.copy(hook, twice)
    try:
        result = _python(
            """
            import sys
            kinds = lambda: [type(f).__name__ for f in sys.meta_path]
            placeholders = kinds().count("SafeviewGuardHook")
            import torch
            from safeview.guard import process
            print(placeholders, kinds().count("SafeviewGuardHook"), kinds().count("Finder"),
                  process.active())
            """,
            python=info["python"],
            SAFEVIEW_GUARD="strict",
            SAFEVIEW_LOG_FORMAT="json",
        )
    finally:
        twice.unlink()
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1", "0", "1", "True"]
    assert result.stderr.count('"process_guard_started"') == 1


def test_safeview_run_sets_the_policy_and_passes_the_exit_status_through() -> None:
    result = subprocess.run(
        [PYTHON, "-m", "safeview", "run", "--policy", "warn", "--", PYTHON, "-c",
         "import os, sys; print(os.environ['SAFEVIEW_GUARD']); sys.exit(3)"],
        env=_environment(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 3
    assert result.stdout.strip() == "warn"
    missing = subprocess.run(
        [PYTHON, "-m", "safeview", "run", "--"],
        env=_environment(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert missing.returncode == 2
    assert missing.stderr.startswith("safeview: ")


@pytest.mark.slow
@needs_hook
def test_safeview_run_guards_the_command() -> None:
    result = subprocess.run(
        [PYTHON, "-m", "safeview", "run", "--", PYTHON, "-c", textwrap.dedent(OUT_OF_BOUNDS_SET)],
        env=_environment(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["nbytes"] == [64, 64]


COMPILED = """
    import sys, torch
    graphs = []
    def backend(graph, inputs):
        graphs.append(graph)
        return graph.forward
    @torch.compile(backend=backend)
    def step(x, y):
        return (x * 2 + y).relu().sum(dim=-1)
    for size in (8, 8, 16):
        step(torch.randn(4, size), torch.randn(4, size))
    from safeview.guard import process
    print(len(graphs), process.active())
"""


@pytest.mark.slow
@needs_hook
def test_torch_compile_compiles_the_same_graphs_under_the_guard() -> None:
    plain = _python(COMPILED)
    guarded = _python(COMPILED, SAFEVIEW_GUARD="strict")
    assert plain.returncode == guarded.returncode == 0, guarded.stderr
    graphs_plain, active_plain = plain.stdout.split()
    graphs_guarded, active_guarded = guarded.stdout.split()
    assert (active_plain, active_guarded) == ("False", "True")
    assert int(graphs_plain) >= 1
    assert graphs_guarded == graphs_plain


# -- in this process, entry point by entry point -------------------------------------------------


def _from_dlpack() -> Any:
    return torch.from_dlpack  # type: ignore[attr-defined]


@pytest.fixture
def guard() -> Iterator[None]:
    process.start("strict")
    try:
        yield
    finally:
        process.stop()
        process._memory.clear()


def test_other_ops_are_torchs_own_while_guarded(guard: None) -> None:
    # nothing but the closed list is replaced: every other op runs torch's own function
    assert torch.Tensor.add is torch._C.TensorBase.add
    assert torch.add is torch._C._VariableFunctions.add
    assert torch.Tensor.view is torch._C.TensorBase.view
    assert torch.Tensor.as_strided is not torch._C.TensorBase.as_strided


def test_stop_puts_torchs_entry_points_back() -> None:
    originals = (torch.as_strided, torch.frombuffer, _from_dlpack())
    process.start("warn")
    assert torch.as_strided is not originals[0]
    process.stop()
    assert (torch.as_strided, torch.frombuffer, _from_dlpack()) == originals
    assert "set_" not in torch.Tensor.__dict__
    assert "resize_" not in torch.UntypedStorage.__dict__


@pytest.mark.parametrize("form", ["function", "method", "in_place"])
def test_strict_refuses_as_strided_past_the_end_in_every_form(guard: None, form: str) -> None:
    kv = torch.zeros(64, dtype=torch.int8)
    calls = {
        "function": lambda: torch.as_strided(kv, (5, 16), (16, 1), 0),
        "method": lambda: kv.as_strided((5, 16), (16, 1), 0),
        "in_place": lambda: (
            torch.empty(0, dtype=torch.int8)
            .set_(kv.untyped_storage())
            .as_strided_((5, 16), (16, 1))
        ),
    }
    with pytest.raises(BoundsError) as caught:
        calls[form]()
    assert caught.value.extent_bytes == 80
    assert caught.value.storage_nbytes == 64
    assert caught.value.overflow_bytes == 16
    assert torch.as_strided(kv, (4, 16), (16, 1), 0).shape == (4, 16)  # the views that fit


def test_resizes_of_a_storage_other_tensors_use_are_refused(guard: None) -> None:
    kv = torch.zeros(64, dtype=torch.int8)
    layer = kv[8:16]
    pointer = kv.data_ptr()
    for grow in (
        lambda: kv.resize_(100),
        lambda: kv.resize_as_(torch.empty(100)),
        lambda: kv.untyped_storage().resize_(100),
    ):
        with pytest.raises(BoundsError):
            grow()
        assert (kv.untyped_storage().nbytes(), kv.data_ptr()) == (64, pointer)
    assert layer.data_ptr() == pointer + 8
    lone = torch.zeros(4)
    lone.resize_(100)  # a storage nobody else uses grows as torch grows it
    assert lone.untyped_storage().nbytes() == 400


def test_raw_addresses_are_judged_against_known_memory(guard: None) -> None:
    kv = torch.zeros(4, 32, dtype=torch.int8)
    blocks = torch.as_strided(kv, (4, 32), (32, 1))  # a view made of it: kv's storage is known
    address = kv.data_ptr()
    before = process.counts()
    inside = torch.frombuffer((ctypes.c_uint8 * 64).from_address(address + 64), dtype=torch.uint8)
    assert inside.data_ptr() == address + 64
    with pytest.raises(BoundsError) as caught:  # 32 bytes past the end
        torch.frombuffer((ctypes.c_uint8 * 64).from_address(address + 96), dtype=torch.uint8)
    assert (caught.value.byte_offset, caught.value.extent_bytes) == (96, 160)
    with pytest.raises(BoundsError):  # the first byte past the end: the usual off-by-one
        torch.frombuffer((ctypes.c_uint8 * 8).from_address(address + 128), dtype=torch.uint8)
    elsewhere = ctypes.create_string_buffer(256)
    unknown = torch.frombuffer(
        (ctypes.c_uint8 * 256).from_address(ctypes.addressof(elsewhere)), dtype=torch.uint8
    )
    assert unknown.numel() == 256
    after = process.counts()
    assert after.unknown_addresses == before.unknown_addresses + 1
    assert after.refused == before.refused + 2
    assert blocks.shape == (4, 32)


def test_a_raw_view_across_two_known_layers_is_refused_naming_the_layer(guard: None) -> None:
    raw = torch.zeros(3 * 256, dtype=torch.int8)
    layers = {f"model.layers.{i}": raw[i * 256 : (i + 1) * 256].view(4, 64) for i in range(3)}
    process.know(layers)
    address = raw.data_ptr()
    whole = torch.frombuffer((ctypes.c_uint8 * 256).from_address(address + 256), dtype=torch.int8)
    assert whole.numel() == 256
    with pytest.raises(BoundsError) as caught:
        torch.frombuffer((ctypes.c_uint8 * 320).from_address(address + 256), dtype=torch.int8)
    error = caught.value
    assert error.name == "model.layers.1"
    assert error.region == (256, 512)
    assert error.kind == "out_of_region"
    assert "view 'model.layers.1' needs bytes [256, 576) but its region is [256, 512)" in str(error)


def test_from_dlpack_past_known_memory_is_refused_before_the_caller_gets_it(guard: None) -> None:
    kv = torch.zeros(64, dtype=torch.int8)
    torch.as_strided(kv, (64,), (1,))
    past = np.ctypeslib.as_array((ctypes.c_uint8 * 80).from_address(kv.data_ptr()))
    with pytest.raises(BoundsError) as caught:
        _from_dlpack()(past)
    assert caught.value.overflow_bytes == 16
    fits = np.ctypeslib.as_array((ctypes.c_uint8 * 64).from_address(kv.data_ptr()))
    assert _from_dlpack()(fits).numel() == 64


def test_warn_reports_and_torch_runs_the_call_as_it_would() -> None:
    process.start("warn")
    try:
        kv = torch.arange(64, dtype=torch.int8)
        other = kv[:8]
        with capture_events() as events:
            torch.empty(0, dtype=torch.int8).set_(kv.untyped_storage(), 0, (5, 16), (16, 1))
    finally:
        process.stop()
    assert kv.untyped_storage().nbytes() == 80  # what torch does without safeview
    assert other.tolist() == list(range(8))
    (violation,) = [event for event in events if event["event"] == "bounds_violation"]
    assert violation["policy"] == "warn"
    assert violation["level"] == "warning"
    assert violation["extent_bytes"] == 80


def test_a_failure_of_its_own_lets_the_call_go_on(
    guard: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from safeview.guard import _entry_guard

    def broken(storage: Any) -> None:
        raise RuntimeError("the guard broke")

    monkeypatch.setattr(_entry_guard, "_seen", broken)
    kv = torch.zeros(64, dtype=torch.int8)
    before = process.counts().internal_errors
    with capture_events() as events:
        view = torch.as_strided(kv, (4, 16), (16, 1))
    assert view.shape == (4, 16)
    assert process.counts().internal_errors == before + 1
    assert events[0]["event"] == "internal_error"
    assert "the guard broke" in events[0]["error"]


def test_threads_and_executors_started_before_the_guard_are_guarded() -> None:
    kv = torch.zeros(64, dtype=torch.int8)
    shared = kv[:8]
    go = threading.Event()
    outcomes: list[str] = []

    def attempt() -> None:
        go.wait()
        try:
            torch.empty(0, dtype=torch.int8).set_(kv.untyped_storage(), 0, (5, 16), (16, 1))
            outcomes.append("made")
        except BoundsError:
            outcomes.append("refused")

    pool = ThreadPoolExecutor(1)
    pool.submit(lambda: None).result()  # its worker thread exists before the guard
    early = threading.Thread(target=attempt)
    early.start()
    process.start("strict")
    try:
        go.set()
        early.join()
        pool.submit(attempt).result()
    finally:
        process.stop()
        pool.shutdown()
    assert outcomes == ["refused", "refused"]
    assert kv.untyped_storage().nbytes() == 64
    assert shared.data_ptr() == kv.data_ptr()


# -- the transfer engines, patched when they are imported ----------------------------------------

NIXL_MISSING = importlib.util.find_spec("nixl") is None
MOONCAKE_MISSING = importlib.util.find_spec("mooncake") is None
if (NIXL_MISSING or MOONCAKE_MISSING) and os.environ.get("SAFEVIEW_REQUIRE_ENGINES") == "1":
    raise ImportError("SAFEVIEW_REQUIRE_ENGINES=1 but NIXL or Mooncake is not installed")

# Four layers of four 64-byte pages in one storage, told to the guard as the vLLM plugin tells
# it; rows: one whole page (fine), one across two pages, one past the end, one in memory the
# guard does not know (let through, counted). The child leaves with os._exit (UCX may crash an
# interpreter at exit).
ENGINE_CASES = """
    import json, os, torch
    {imports}
    from safeview.guard import process
    kv = torch.zeros(4 * 256, dtype=torch.uint8)
    process.know({{f"l{{i}}": kv[i * 256 : (i + 1) * 256].view(4, 64) for i in range(4)}})
    elsewhere = torch.zeros(1024, dtype=torch.uint8)
    {setup}
    base = kv.data_ptr()
    rows = {{"page": (base + 64, 64), "across": (base + 32, 64), "past": (base + 1000, 64),
            "unknown": (elsewhere.data_ptr(), 64)}}
    out = {{}}
    for name, (address, length) in rows.items():
        try:
            {call}
            out[name] = "done"
        except Exception as error:
            out[name] = type(error).__name__ + ": " + str(error)
    out["counts"] = process.counts()._asdict()
    print("REPORT " + json.dumps(out), flush=True)
    os._exit(0)
"""

ENGINES = {
    "nixl": {
        "imports": "from nixl._api import nixl_agent, nixl_agent_config",
        "setup": 'agent = nixl_agent("a", nixl_agent_config(backends=["UCX"]))\n'
        '    agent.register_memory([(kv.data_ptr(), 1024, 0, ""), '
        '(elsewhere.data_ptr(), 1024, 0, "")], "DRAM")',
        "call": 'agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(address, length, 0)], "DRAM")',
        "source": "nixl.prep_xfer_dlist",
    },
    "mooncake": {
        "imports": "from mooncake.engine import TransferEngine",
        "setup": 'engine = TransferEngine()\n    engine.initialize("127.0.0.1", "P2PHANDSHAKE", '
        '"tcp", "")\n    peer = f"127.0.0.1:{engine.get_rpc_port()}"\n'
        "    target = torch.zeros(1024, dtype=torch.uint8)\n"
        "    engine.register_memory(target.data_ptr(), 1024)",
        "call": "assert engine.transfer_sync_write(peer, address, target.data_ptr(), length) == 0",
        "source": "mooncake.transfer_sync_write",
    },
}


@pytest.mark.slow
@needs_hook
@pytest.mark.parametrize("engine", ["nixl", "mooncake"])
def test_engines_imported_under_the_guard_have_their_local_rows_judged(engine: str) -> None:
    if {"nixl": NIXL_MISSING, "mooncake": MOONCAKE_MISSING}[engine]:
        pytest.skip(f"{engine} is not installed")
    case = ENGINES[engine]
    code = textwrap.dedent(ENGINE_CASES).format(
        imports=case["imports"], setup=case["setup"].replace("\n    ", "\n"), call=case["call"]
    )
    result = _python(code, SAFEVIEW_GUARD="strict")
    lines = [line for line in result.stdout.splitlines() if line.startswith("REPORT ")]
    assert lines, result.stdout + result.stderr
    out = json.loads(lines[-1][len("REPORT ") :])
    assert out["page"] == "done"
    assert out["unknown"] == "done"
    assert out["across"].startswith("AddressError: ")
    assert "spans pages 0 and 1 of view 'l0'" in out["across"]
    assert out["past"].startswith("AddressError: ")
    assert "(40 bytes past its end)" in out["past"]
    assert f"(by {case['source']})" in out["past"]
    assert out["counts"]["refused"] == 2
    assert out["counts"]["unknown_addresses"] == 1


def test_layers_registered_through_block_views_are_known_memory(guard: None) -> None:
    from safeview.kv import block_views

    raw = torch.zeros(2 * 4 * 64, dtype=torch.int8)
    caches = {"a": raw[:256].view(4, 64), "b": raw[256:].view(4, 64)}
    block_views(caches, {"a": 64, "b": 64}, num_blocks=4)
    with pytest.raises(BoundsError) as caught:  # from layer a's last page into layer b
        torch.frombuffer(
            (ctypes.c_uint8 * 128).from_address(raw.data_ptr() + 192), dtype=torch.uint8
        )
    assert caught.value.name == "a"
    assert caught.value.region == (0, 256)


@pytest.mark.slow
@needs_hook
def test_a_compiled_function_that_makes_views_is_judged_at_run_time() -> None:
    # Dynamo traces through the guard's functions (symbolic sizes are never judged, nor
    # specialized); the compiled code calls them with real numbers
    result = _python(
        """
        import torch
        from safeview import BoundsError
        from safeview.guard import process
        @torch.compile(backend="eager")
        def f(x):
            return x.as_strided((2, 4), (4, 1)).sum() + torch.as_strided(x, (3,), (1,)).sum()
        outcomes = [float(f(torch.arange(8.0)))]
        try:
            f(torch.arange(4.0))
        except BoundsError as error:
            outcomes.append(error.overflow_bytes)
        outcomes.append(float(f(torch.arange(12.0))))
        print(outcomes, process.counts().internal_errors)
        """,
        SAFEVIEW_GUARD="strict",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[31.0, 16, 31.0] 0"
