"""The process guard's doors (issue 26): every Python way into the ops that place a tensor on a
storage or grow or shrink one (``aten::set_``, ``aten::resize_``, a storage's ``resize_``) is
judged, also under ``torch.inference_mode()``, also on Tensor subclasses. Each door runs in real
child processes: with ``SAFEVIEW_GUARD`` unset (torch's own behaviour, the oracle: the door really
grows, shrinks or moves the shared storage), ``strict`` (refused, nothing resized or moved) and
``warn`` (a ``bounds_violation`` event, and torch's own behaviour)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from safeview import BoundsError
from safeview.guard import process
from safeview.testing import capture_events

PYTHON = sys.executable

# A float32 cache of 1,024 elements (4,096 bytes) and a layer view of its first 256; each door
# tries to grow it to 8,192 bytes (2,048 elements) or, for a shrink, to cut a known layer. Every
# door runs twice, plainly and under torch.inference_mode(), each time on a fresh cache.
DOORS_PROGRAM = """
    import json, torch
    from torch.utils._pytree import tree_map
    from safeview.guard import process
    from safeview.testing import capture_events

    class Sub(torch.Tensor):
        pass

    class ParameterSub(torch.nn.Parameter):  # the shape of vLLM's own parameter classes
        pass

    class Dispatching(torch.Tensor):  # a subclass with its own __torch_dispatch__
        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            with torch._C._DisableTorchDispatch():
                plain = lambda a: a.as_subclass(torch.Tensor) if isinstance(a, cls) else a
                return func(*tree_map(plain, args), **tree_map(plain, kwargs or {}))

    def empty():
        return torch.empty(0)

    DOORS = {
        "torch.resize_as_": lambda kv, view, s: torch.resize_as_(view, torch.empty(2048)),
        "Tensor.resize_as_": lambda kv, view, s: view.resize_as_(torch.empty(2048)),
        "subclass set_": lambda kv, view, s: empty().as_subclass(Sub).set_(s, 0, (2048,), (1,)),
        "Parameter subclass set_": lambda kv, view, s: ParameterSub(
            empty(), requires_grad=False).set_(s, 0, (2048,), (1,)),
        "subclass view resize_": lambda kv, view, s: view.as_subclass(Sub).resize_(2048),
        "__torch_dispatch__ subclass set_": lambda kv, view, s: torch.Tensor._make_subclass(
            Dispatching, empty()).set_(s, 0, (2048,), (1,)),
        "torch.ops.aten.set_": lambda kv, view, s:
            torch.ops.aten.set_.source_Storage_storage_offset(empty(), s, 0, [2048], [1]),
        "torch.ops.aten.resize_": lambda kv, view, s: torch.ops.aten.resize_(view, [2048]),
        "TensorBase.set_": lambda kv, view, s:
            torch._C.TensorBase.set_(empty(), s, 0, (2048,), (1,)),
        "TensorBase.resize_": lambda kv, view, s: torch._C.TensorBase.resize_(view, 2048),
        "StorageBase.resize_": lambda kv, view, s: torch._C.StorageBase.resize_(s, 8192),
        "UntypedStorage.resize_": lambda kv, view, s: s.resize_(8192),
        "shrink below a known layer": lambda kv, view, s: (
            process.know({"l0": kv[:512], "l1": kv[512:]}), s.resize_(3000)),
        "float32 set_ one element past": lambda kv, view, s: empty().set_(s, 0, (1025,), (1,)),
        "float16 set_ past": lambda kv, view, s:
            torch.empty(0, dtype=torch.float16).set_(s, 1024, (1025,), (1,)),
        "int64 set_ past": lambda kv, view, s:
            torch.empty(0, dtype=torch.int64).set_(s, 0, (2, 257), (257, 1)),
    }

    report = {}
    for name, door in DOORS.items():
        for mode in ("plain", "inference"):
            kv = torch.zeros(1024)
            view = kv[:256]
            storage = kv.untyped_storage()
            before = (storage.nbytes(), storage.data_ptr())
            with capture_events() as events:
                try:
                    if mode == "inference":
                        with torch.inference_mode():
                            door(kv, view, storage)
                    else:
                        door(kv, view, storage)
                    outcome = "made"
                except Exception as error:
                    outcome = type(error).__name__ + ": " + str(error)
            after = (storage.nbytes(), storage.data_ptr())
            report[name + " / " + mode] = {
                "outcome": outcome,
                "nbytes": [before[0], after[0]],
                "moved": before[1] != after[1],
                "violations": [
                    {key: event.get(key) for key in ("op", "policy", "overflow_bytes")}
                    for event in events if event["event"] == "bounds_violation"
                ],
            }
            process._memory.clear() if process.active() else None
    print(json.dumps({"doors": report, "counts": process.counts()._asdict()}))
"""

DOORS = [
    "torch.resize_as_",
    "Tensor.resize_as_",
    "subclass set_",
    "Parameter subclass set_",
    "subclass view resize_",
    "__torch_dispatch__ subclass set_",
    "torch.ops.aten.set_",
    "torch.ops.aten.resize_",
    "TensorBase.set_",
    "TensorBase.resize_",
    "StorageBase.resize_",
    "UntypedStorage.resize_",
    "shrink below a known layer",
    "float32 set_ one element past",
    "float16 set_ past",
    "int64 set_ past",
]
MODES = ["plain", "inference"]
# what the error says, byte for byte: the growths need 8,192 bytes of 4,096; the shrink leaves
# layer l1 ([2,048, 4,096)) 1,096 bytes past a 3,000-byte storage; the dtype cases count bytes,
# not elements (1,025 float32 elements are 4,100 bytes; 1,025 float16 from element 1,024 end at
# byte 4,098; 514 int64 are 4,112 bytes)
EXPECTED = {
    "shrink below a known layer": ("UntypedStorage.resize_", "needs bytes [2,048, 4,096)", 1096),
    "float32 set_ one element past": ("Tensor.set_", "needs bytes [0, 4,100)", 4),
    "float16 set_ past": ("Tensor.set_", "needs bytes [2,048, 4,098)", 2),
    "int64 set_ past": ("Tensor.set_", "needs bytes [0, 4,112)", 16),
}
GROWTH_OP = {
    "StorageBase.resize_": "UntypedStorage.resize_",
    "UntypedStorage.resize_": "UntypedStorage.resize_",
}


def _expected(door: str) -> tuple[str, str, int]:
    if door in EXPECTED:
        return EXPECTED[door]
    op = GROWTH_OP.get(door, "Tensor.set_" if "set_" in door else "Tensor.resize_")
    return op, "needs bytes [0, 8,192)", 4096


def _run(**variables: str) -> dict[str, Any]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("SAFEVIEW_")}
    environment.update(variables)
    result = subprocess.run(
        [PYTHON, "-c", textwrap.dedent(DOORS_PROGRAM)],
        env=environment, capture_output=True, text=True, timeout=300, cwd="/",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report: dict[str, Any] = json.loads(result.stdout.splitlines()[-1])
    return report


@pytest.fixture(scope="module")
def unguarded() -> dict[str, Any]:
    return _run()


@pytest.fixture(scope="module")
def strict() -> dict[str, Any]:
    return _run(SAFEVIEW_GUARD="strict")


@pytest.fixture(scope="module")
def warned() -> dict[str, Any]:
    return _run(SAFEVIEW_GUARD="warn")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("door", DOORS)
def test_each_door_is_refused_under_strict_and_nothing_is_resized_or_moved(
    strict: dict[str, Any], unguarded: dict[str, Any], door: str, mode: str
) -> None:
    plain = unguarded["doors"][f"{door} / {mode}"]
    # the oracle: without the guard, torch grows, shrinks or moves the shared storage
    assert plain["outcome"] == "made"
    assert plain["nbytes"][1] != 4096 or plain["moved"]
    guarded = strict["doors"][f"{door} / {mode}"]
    op, needs, overflow = _expected(door)
    assert guarded["outcome"].startswith("BoundsError: "), guarded["outcome"]
    assert needs in guarded["outcome"]
    assert f"({overflow:,} bytes past the end)" in guarded["outcome"]
    assert f"(by {op} at <string>:" in guarded["outcome"]  # the call site: the child's own line
    assert guarded["nbytes"] == [4096, 4096]
    assert guarded["moved"] is False


@pytest.mark.parametrize("door", DOORS)
def test_each_door_under_warn_reports_and_runs_as_torch_does(
    warned: dict[str, Any], unguarded: dict[str, Any], door: str
) -> None:
    for mode in MODES:
        plain = unguarded["doors"][f"{door} / {mode}"]
        seen = warned["doors"][f"{door} / {mode}"]
        op, _, overflow = _expected(door)
        assert seen["outcome"] == "made"
        assert seen["nbytes"] == plain["nbytes"]
        assert seen["violations"] == [{"op": op, "policy": "warn", "overflow_bytes": overflow}]


def test_the_guard_counts_every_door_it_refused(strict: dict[str, Any]) -> None:
    counts = strict["counts"]
    assert counts["refused"] == len(DOORS) * len(MODES)
    assert counts["internal_errors"] == 0


def test_a_refusal_shows_the_callers_line_and_one_frame_of_safeview() -> None:
    program = """
        import torch
        kv = torch.zeros(1024)
        layer = kv[:256]
        torch.resize_as_(layer, torch.empty(2048))
    """
    environment = {k: v for k, v in os.environ.items() if not k.startswith("SAFEVIEW_")}
    environment["SAFEVIEW_GUARD"] = "strict"
    result = subprocess.run(
        [PYTHON, "-c", textwrap.dedent(program)],
        env=environment, capture_output=True, text=True, timeout=300, cwd="/",
    )  # fmt: skip
    assert result.returncode == 1
    frames = [line for line in result.stderr.splitlines() if line.startswith('  File "')]
    assert len(frames) == 2, result.stderr
    assert frames[0].startswith('  File "<string>", line 5')
    assert "safeview" in frames[1]
    last = result.stderr.splitlines()[-1]
    assert last.startswith("safeview.errors.BoundsError: the view needs bytes [0, 8,192) but")
    assert "(by Tensor.resize_ at <string>:5 in <module>) [device cpu, policy strict]" in last


# -- in this process -----------------------------------------------------------------------------


@pytest.fixture
def guard() -> Iterator[None]:
    process.start("strict")
    try:
        yield
    finally:
        process.stop()
        process._memory.clear()


def _state(tensor: torch.Tensor) -> tuple[int, int]:
    storage = tensor.untyped_storage()
    return storage.nbytes(), storage.data_ptr()


def test_set_and_resize_follow_one_rule_for_storages_without_bytes_or_other_users(
    guard: None,
) -> None:
    # no bytes: nothing to leave dangling, through either door
    empty = torch.UntypedStorage(0)  # type: ignore[no-untyped-call]
    placed = torch.empty(0).set_(empty, 0, (4,), (1,))
    assert placed.untyped_storage().nbytes() == 16
    grown = torch.empty(0)
    grown.resize_(4)
    assert grown.untyped_storage().nbytes() == 16
    lone = torch.zeros(4)
    lone.resize_(100)  # bytes, and no other user: grows as torch grows it
    assert lone.untyped_storage().nbytes() == 400
    # bytes that another tensor holds: refused through both doors
    kv = torch.zeros(16)
    layer = kv[:4]
    with pytest.raises(BoundsError):
        torch.empty(0).set_(kv.untyped_storage(), 0, (32,), (1,))
    with pytest.raises(BoundsError):
        layer.resize_(32)
    assert _state(kv) == (64, layer.data_ptr())


def test_a_storage_holding_known_layers_is_never_grown_or_cut_below_them(guard: None) -> None:
    kv = torch.zeros(1024, dtype=torch.int8)
    process.know({"l0": kv[:512].view(4, 128)})
    before = _state(kv)
    with pytest.raises(BoundsError):  # its only tensor, but a transfer engine may hold l0's bytes
        kv.resize_(2048)
    with pytest.raises(BoundsError) as caught:
        kv.untyped_storage().resize_(500)
    assert caught.value.name == "l0"
    assert (caught.value.extent_bytes, caught.value.storage_nbytes) == (512, 500)
    assert _state(kv) == before
    with pytest.raises(BoundsError) as caught:  # every layer kept, but kv reaches 1,024 bytes
        kv.untyped_storage().resize_(600)
    assert (caught.value.name, caught.value.extent_bytes) == (None, 1024)
    kv.resize_(512)  # its only tensor now ends where l0 does
    kv.untyped_storage().resize_(600)  # a shrink that keeps every known layer and tensor
    assert kv.untyped_storage().nbytes() == 600


def test_freeing_a_storage_nobody_registered_is_allowed(guard: None) -> None:
    # FSDP frees a parameter's storage with resize_(0) while the parameter lives, and grows it
    # back before use: no layer of it is known, and an empty storage grows freely
    parameter = torch.nn.Parameter(torch.ones(64))
    flat = parameter.detach()
    parameter.untyped_storage().resize_(0)
    assert flat.untyped_storage().nbytes() == 0
    parameter.untyped_storage().resize_(256)
    assert flat.untyped_storage().nbytes() == 256


def test_stop_removes_the_kernels_and_the_storage_method() -> None:
    original = torch._C.StorageBase.__dict__["resize_"]
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    assert not has_kernel("aten::resize_", "BackendSelect")
    process.start("strict")
    try:
        assert has_kernel("aten::resize_", "BackendSelect")
        assert has_kernel("aten::set_.source_Storage_storage_offset", "BackendSelect")
        assert torch._C.StorageBase.__dict__["resize_"] is not original
    finally:
        process.stop()
    assert not has_kernel("aten::resize_", "BackendSelect")
    assert not has_kernel("aten::set_.source_Storage_storage_offset", "BackendSelect")
    assert torch._C.StorageBase.__dict__["resize_"] is original
    assert torch.UntypedStorage.resize_ is original
    kv = torch.zeros(16)
    layer = kv[:4]
    torch.ops.aten.resize_(layer, [32])  # torch's own again: it grows the shared storage
    torch._C.StorageBase.resize_(kv.untyped_storage(), 256)  # type: ignore[attr-defined]
    assert kv.untyped_storage().nbytes() == 256


def test_a_failure_of_its_own_at_the_dispatcher_lets_the_call_go_on(
    guard: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from safeview.guard import _aten_guard, _entry_guard

    def broken(*args: Any) -> int:
        raise RuntimeError("the guard broke")

    monkeypatch.setattr(_entry_guard, "_extent_elements", broken)
    monkeypatch.setattr(_aten_guard, "_others", broken)
    kv = torch.zeros(16)
    layer = kv[:4]
    before = process.counts().internal_errors
    with capture_events() as events:
        torch.empty(0).set_(kv.untyped_storage(), 0, (32,), (1,))  # unjudged, as torch does it
        layer.resize_(64)
        kv.untyped_storage().resize_(512)
    assert kv.untyped_storage().nbytes() == 512
    assert process.counts().internal_errors == before + 3
    errors = [event for event in events if event["event"] == "internal_error"]
    assert [event["where"] for event in errors] == [
        "process guard (Tensor.set_)",
        "process guard (Tensor.resize_)",
        "process guard (UntypedStorage.resize_)",
    ]
    assert all("the guard broke" in event["error"] for event in errors)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_an_out_tensor_of_the_wrong_size_on_cuda_is_refused(guard: None) -> None:
    # torch resizes a CUDA out= through the dispatcher (Tensor.resize_): judged there; on CPU it
    # calls at::native::resize_ directly, which no Python code sees (docs/process.md)
    kv = torch.zeros(1024, device="cuda")
    layer = kv[:256]
    before = _state(kv)
    with pytest.raises(BoundsError):
        torch.add(torch.ones(2048, device="cuda"), 1, out=layer)
    assert _state(kv) == before


# -- a storage shrunk under live tensors (issue 35) ----------------------------------------------
#
# A float32 cache of 1,024 elements (4,096 bytes). A storage's resize_ to 1,024 bytes reallocates
# it smaller under every tensor over it: a view of bytes [2,048, 4,096) then reads freed memory.
# Only a storage's own resize_ shrinks a storage; Tensor.resize_, aten::resize_ and set_ on another
# tensor of the storage never do (torch only grows a storage there), and stay allowed. Each case
# runs in a child process with SAFEVIEW_GUARD unset (torch's behaviour: the oracle), strict and
# warn; one view is made in a thread started before torch was imported (before the guard was on).
SHRINK_PROGRAM = """
    import json, threading
    held, ready, made = {}, threading.Event(), threading.Event()

    def worker():  # started before torch is imported, so before the guard goes on
        ready.wait(120)
        import torch
        held["view"] = torch.as_strided(held.pop("kv"), (512,), (1,), 512)
        made.set()

    threading.Thread(target=worker, daemon=True).start()

    import torch
    from safeview.guard import process
    from safeview.testing import capture_events

    def cache():
        return torch.arange(1024, dtype=torch.float32)

    def as_strided_view():
        kv = cache()
        return [kv, kv.as_strided((512,), (1,), 512)], lambda: kv.untyped_storage().resize_(1024)

    def slice_typed_storage():
        kv = cache()
        return [kv[512:]], lambda: kv.storage()._resize_(256)

    def storage_base_under_its_tensor():
        kv = cache()
        return [kv], lambda: torch._C.StorageBase.resize_(kv.untyped_storage(), 1024)

    def view_of_a_view_base_gone():
        view = cache()[256:][256:]  # the cache itself lives on as the view's _base only
        return [view], lambda: view.untyped_storage().resize_(1024)

    def view_made_in_an_earlier_thread():
        kv = cache()
        storage = kv.untyped_storage()
        held["kv"] = kv
        del kv
        ready.set()
        made.wait(120)
        return [held["view"]], lambda: storage.resize_(1024)

    def another_tensor_resize_():
        kv = cache()
        other = kv[:10]
        return [kv], lambda: other.resize_(5)

    def another_tensor_aten_resize_():
        kv = cache()
        other = kv[:10]
        return [kv], lambda: torch.ops.aten.resize_(other, [2])

    def set_to_fewer_bytes():
        kv = cache()
        return [kv], lambda: torch.empty(0).set_(kv.untyped_storage(), 0, (4,), (1,))

    def only_tensor_resize_():
        kv = cache()
        return [kv], lambda: kv.resize_(256)

    def shrink_above_every_tensor():
        kv = cache()
        kv.resize_(256)  # its only tensor now reaches 1,024 bytes
        return [kv], lambda: kv.untyped_storage().resize_(1024)

    def shrink_with_no_tensor():
        storage = torch.UntypedStorage(4096)
        return [storage], lambda: storage.resize_(1024)

    def free_under_its_tensor():
        kv = cache()
        return [kv], lambda: kv.untyped_storage().resize_(0)

    CASES = {
        "UntypedStorage.resize_ under an as_strided view": as_strided_view,
        "TypedStorage._resize_ under a slice": slice_typed_storage,
        "StorageBase.resize_ under its own tensor": storage_base_under_its_tensor,
        "a view whose base lives only as its _base": view_of_a_view_base_gone,
        "a view made in a thread started before the guard": view_made_in_an_earlier_thread,
        "Tensor.resize_ on another tensor": another_tensor_resize_,
        "torch.ops.aten.resize_ on another tensor": another_tensor_aten_resize_,
        "set_ to fewer bytes": set_to_fewer_bytes,
        "Tensor.resize_ of the only tensor to fewer elements": only_tensor_resize_,
        "a shrink that every tensor fits in": shrink_above_every_tensor,
        "a shrink of a storage no tensor uses": shrink_with_no_tensor,
        "a free to no bytes (FSDP)": free_under_its_tensor,
    }

    def reach(tensor):
        if isinstance(tensor, torch.UntypedStorage):
            return 0
        return (tensor.storage_offset() + tensor.numel()) * tensor.element_size()

    report = {}
    for name, case in CASES.items():
        tensors, act = case()
        first = tensors[0]
        storage = first if isinstance(first, torch.UntypedStorage) else first.untyped_storage()
        before = (storage.nbytes(), storage.data_ptr())
        with capture_events() as events:
            try:
                act()
                outcome = "made"
            except Exception as error:
                outcome = type(error).__name__ + ": " + str(error)
        report[name] = {
            "outcome": outcome,
            "nbytes": [before[0], storage.nbytes()],
            "moved": before[1] != storage.data_ptr(),
            "past_end": any(reach(tensor) > storage.nbytes() for tensor in tensors),
            "violations": [
                {key: event.get(key) for key in ("op", "policy", "overflow_bytes")}
                for event in events if event["event"] == "bounds_violation"
            ],
        }
        del tensors, act, storage
        process._memory.clear() if process.active() else None
    print(json.dumps({"cases": report, "counts": process.counts()._asdict()}))
"""

# what a refusal says: the live tensor that reaches farthest past the new 1,024 bytes (of two
# that end together, the one that starts later), and its bytes past that end
REFUSED = {
    "UntypedStorage.resize_ under an as_strided view": ("needs bytes [2,048, 4,096)", 2048),
    "TypedStorage._resize_ under a slice": ("needs bytes [2,048, 4,096)", 2048),
    "StorageBase.resize_ under its own tensor": ("needs bytes [0, 4,096)", 3072),
    "a view whose base lives only as its _base": ("needs bytes [2,048, 4,096)", 2048),
    "a view made in a thread started before the guard": ("needs bytes [2,048, 4,096)", 2048),
}
ALLOWED = {  # case: the storage's bytes after it, as torch leaves them
    "Tensor.resize_ on another tensor": 4096,
    "torch.ops.aten.resize_ on another tensor": 4096,
    "set_ to fewer bytes": 4096,
    "Tensor.resize_ of the only tensor to fewer elements": 4096,
    "a shrink that every tensor fits in": 1024,
    "a shrink of a storage no tensor uses": 1024,
    "a free to no bytes (FSDP)": 0,
}


def _run_shrinks(**variables: str) -> dict[str, Any]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("SAFEVIEW_")}
    environment.update(variables)
    result = subprocess.run(
        [PYTHON, "-W", "ignore", "-c", textwrap.dedent(SHRINK_PROGRAM)],
        env=environment, capture_output=True, text=True, timeout=300, cwd="/",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report: dict[str, Any] = json.loads(result.stdout.splitlines()[-1])
    return report


@pytest.fixture(scope="module")
def shrinks() -> dict[str, dict[str, Any]]:
    return {policy: _run_shrinks(**({"SAFEVIEW_GUARD": policy} if policy else {}))
            for policy in ("", "strict", "warn")}  # fmt: skip


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_shrink_under_a_live_tensor_is_refused_under_strict(
    shrinks: dict[str, dict[str, Any]], case: str
) -> None:
    plain = shrinks[""]["cases"][case]
    # the oracle: without the guard the storage shrinks and a live tensor lies past its end
    assert plain["outcome"] == "made"
    assert plain["nbytes"] == [4096, 1024]
    assert plain["past_end"] is True
    guarded = shrinks["strict"]["cases"][case]
    needs, overflow = REFUSED[case]
    assert guarded["outcome"].startswith("BoundsError: "), guarded["outcome"]
    assert f"{needs} but" in guarded["outcome"]
    assert f"has 1,024 bytes ({overflow:,} bytes past the end)" in guarded["outcome"]
    assert "(by UntypedStorage.resize_ at <string>:" in guarded["outcome"]
    assert guarded["nbytes"] == [4096, 4096]
    assert guarded["moved"] is False
    assert guarded["past_end"] is False
    warned = shrinks["warn"]["cases"][case]
    assert warned["outcome"] == "made"
    assert warned["nbytes"] == plain["nbytes"]
    assert warned["violations"] == [
        {"op": "UntypedStorage.resize_", "policy": "warn", "overflow_bytes": overflow}
    ]


@pytest.mark.parametrize("case", list(ALLOWED))
def test_what_leaves_no_live_tensor_past_the_end_stays_allowed(
    shrinks: dict[str, dict[str, Any]], case: str
) -> None:
    plain = shrinks[""]["cases"][case]
    assert plain["outcome"] == "made"
    assert plain["nbytes"] == [4096, ALLOWED[case]]  # torch's own: what each door does
    for policy in ("strict", "warn"):
        seen = shrinks[policy]["cases"][case]
        assert seen["outcome"] == "made", seen["outcome"]
        assert seen["nbytes"] == plain["nbytes"]
        assert seen["violations"] == []


def test_shrinks_are_counted_and_nothing_failed(shrinks: dict[str, dict[str, Any]]) -> None:
    assert shrinks["strict"]["counts"]["refused"] == len(REFUSED)
    assert shrinks["warn"]["counts"]["warned"] == len(REFUSED)
    assert shrinks["strict"]["counts"]["internal_errors"] == 0
    assert shrinks["warn"]["counts"]["internal_errors"] == 0


def test_a_shrink_under_a_view_another_thread_made_is_refused_in_process() -> None:
    # the thread is started before the guard goes on, and makes its view (a slice, which no door
    # of the guard sees being made) after; the main thread, holding only the storage, shrinks it
    source = [torch.arange(1024, dtype=torch.float32)]
    storage = source[0].untyped_storage()
    go, made, done = threading.Event(), threading.Event(), threading.Event()
    views: list[torch.Tensor] = []

    def worker() -> None:
        go.wait(60)
        views.append(source.pop()[512:])
        made.set()
        done.wait(60)

    thread = threading.Thread(target=worker)
    thread.start()
    process.start("strict")
    try:
        go.set()
        assert made.wait(60)
        with pytest.raises(BoundsError) as caught:
            storage.resize_(1024)
        assert (caught.value.byte_offset, caught.value.extent_bytes) == (2048, 4096)
        assert caught.value.storage_nbytes == 1024
        assert storage.nbytes() == 4096
        views.clear()  # no tensor over the storage now: the same shrink is allowed
        storage.resize_(1024)
        assert storage.nbytes() == 1024
    finally:
        done.set()
        thread.join()
        process.stop()
        process._memory.clear()
