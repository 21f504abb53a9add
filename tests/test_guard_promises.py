"""The guard's promises: every op that would grow a shared storage or place a view past its end is
refused under strict before it runs, whatever the op; torch's own bookkeeping is never refused;
sanitizers belong to their thread and asyncio task, nest, and decorate any kind of function."""

from __future__ import annotations

import asyncio
import copy
import importlib
import io
import json
import logging
import threading
from collections.abc import Callable, Generator
from math import inf
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from safeview import (
    ArgumentError,
    BoundsError,
    OverlapError,
    SafeViewError,
    UnprovenWriteError,
    configure_logging,
    policy_scope,
    reset_logging,
    sanitize,
)
from safeview.kv import block_views, check_tensors, guard_registration
from safeview.testing import capture_events


def shared_cache(nbytes: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache and a layer's view of it: its storage has two users."""
    kv = torch.zeros(nbytes, dtype=torch.int8)
    return kv, kv[:16]


def state(tensor: torch.Tensor) -> tuple[int, int]:
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


GROWING_OPS: dict[str, Callable[[torch.Tensor], Any]] = {
    "add_out": lambda kv: torch.add(torch.ones(128, dtype=torch.int8), 1, out=kv[:16]),
    "cat_out": lambda kv: torch.cat([torch.ones(100, dtype=torch.int8)], out=kv[:16]),
    "mul_out": lambda kv: torch.mul(torch.ones(100, dtype=torch.int8), 2, out=kv[:16]),
    "resize_as_": lambda kv: kv[:16].resize_as_(torch.ones(200, dtype=torch.int8)),
    "functional_set": lambda kv: torch.ops.aten.set.source_Storage_storage_offset(
        torch.empty(0, dtype=torch.int8), kv.untyped_storage(), 0, [100], [1]
    ),
    "functional_set_out": lambda kv: torch.ops.aten.set.source_Storage_storage_offset_out(
        torch.empty(0, dtype=torch.int8),
        kv.untyped_storage(),
        0,
        [100],
        [1],
        out=torch.empty(0, dtype=torch.int8),
    ),
    "reshape_alias_past_the_end": lambda kv: torch.ops.aten._reshape_alias(kv, [1000], [1]),
    "four_argument_set_": lambda kv: torch.empty(0, dtype=torch.int8).set_(
        kv.untyped_storage(), 0, (5, 16), (16, 1)
    ),
}


@pytest.mark.filterwarnings("ignore:An output with one or more elements was resized")
@pytest.mark.parametrize("op", sorted(GROWING_OPS))
def test_strict_refuses_every_op_that_grows_a_shared_storage_or_views_past_it(op: str) -> None:
    kv, layer = shared_cache()
    before = state(kv)
    layer.fill_(7)
    with pytest.raises(BoundsError) as raised, sanitize("strict"):
        GROWING_OPS[op](kv)
    assert state(kv) == before  # never reallocated, never grown
    assert state(layer) == before
    assert int(layer.sum()) == 7 * 16  # and the data is where it was
    assert raised.value.storage_nbytes == 64
    assert raised.value.extent_bytes is not None
    assert raised.value.extent_bytes > 64
    assert raised.value.site is not None
    assert "test_guard_promises.py" in raised.value.site


@pytest.mark.filterwarnings("ignore:An output with one or more elements was resized")
@pytest.mark.parametrize("op", sorted(GROWING_OPS))
def test_without_the_sanitizer_those_ops_do_harm(op: str) -> None:
    """The oracle for the test above: torch alone grows the storage or makes the view."""
    kv, _ = shared_cache()
    before = state(kv)
    result = GROWING_OPS[op](kv)
    grown = state(kv) != before
    past_end = isinstance(result, torch.Tensor) and result.numel() > kv.untyped_storage().nbytes()
    assert grown or past_end


def test_out_into_a_fresh_tensor_still_grows_it() -> None:
    """Growing a storage nobody else uses is what ``out=`` is for: not refused."""
    out = torch.empty(0, dtype=torch.int8)
    with sanitize("strict") as seen:
        torch.add(torch.ones(128, dtype=torch.int8), 1, out=out)
    assert out.shape == (128,)
    assert seen.views == []


@pytest.mark.filterwarnings("ignore:An output with one or more elements was resized")
def test_warn_lets_the_growing_op_run_and_says_so() -> None:
    kv, _ = shared_cache()
    with capture_events() as events, sanitize("warn"):
        torch.add(torch.ones(128, dtype=torch.int8), 1, out=kv[:16])
    [event] = [e for e in events if e["event"] == "bounds_violation"]
    assert event["op"] == "aten::add (out=)"
    assert event["extent_bytes"] == 128
    assert event["limit_bytes"] == 64
    assert event["level"] == "warning"


def test_untyped_storage_resize_bypasses_the_dispatcher_and_is_not_seen() -> None:
    """What the README says the guard cannot see: a storage's own ``resize_``."""
    kv, _layer = shared_cache()
    with sanitize("strict") as seen:
        kv.untyped_storage().resize_(128)
    assert kv.untyped_storage().nbytes() == 128
    assert seen.views == []


def empty_chunk() -> torch.Tensor:
    chunk = torch.zeros(4, 0).chunk(2)[1]
    assert chunk.storage_offset() * chunk.element_size() > chunk.untyped_storage().nbytes()
    return chunk


def test_torchs_own_copies_of_an_empty_chunk_are_not_refused() -> None:
    chunk = empty_chunk()
    with sanitize("strict") as seen:
        copied = copy.deepcopy(chunk)
        buffer = io.BytesIO()
        torch.save(chunk, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer)
    assert copied.shape == loaded.shape == chunk.shape
    assert seen.findings == []


def test_backward_through_an_in_place_op_on_a_view_is_not_refused() -> None:
    leaf = torch.zeros(4, 0, requires_grad=True)
    with sanitize("strict") as seen:
        out = leaf * 2
        out[2:].mul_(3)  # the view starts past the end of an empty storage
        out.sum().backward()  # type: ignore[no-untyped-call]
        base = torch.ones(4, 3, requires_grad=True)
        doubled = base * 2
        doubled[1:].mul_(3)
        doubled.sum().backward()  # type: ignore[no-untyped-call]
    assert base.grad is not None
    assert base.grad[1:].eq(6).all()
    assert seen.findings == []


def test_an_empty_view_the_caller_places_far_past_the_end_is_still_refused() -> None:
    kv, _ = shared_cache()
    with pytest.raises(BoundsError, match="starts at byte 1,000,000,000,000"), sanitize("strict"):
        torch.as_strided(kv, (0, 16), (16, 1), 10**12)


# -- sanitizers per task, nested, as decorators -------------------------------------------------


def test_two_asyncio_tasks_each_get_their_own_sanitizer() -> None:
    meta = torch.empty(64, dtype=torch.int8, device="meta")

    async def task(policy: Any, rows: int, entered: asyncio.Event, go: asyncio.Event) -> Any:
        with sanitize(policy) as seen:
            entered.set()
            await go.wait()
            try:
                torch.as_strided(meta, (rows, 16), (16, 1))
            except BoundsError as error:
                return seen, error
        return seen, None

    async def main() -> tuple[Any, Any]:
        a_in, b_in, go_a, go_b = (asyncio.Event() for _ in range(4))
        a = asyncio.create_task(task("strict", 4, a_in, go_a))
        b = asyncio.create_task(task("warn", 5, b_in, go_b))
        await a_in.wait()
        await b_in.wait()
        go_a.set()
        result_a = await a  # A closes first, while B is still open
        go_b.set()
        return result_a, await b

    with capture_events() as events:
        (seen_a, error_a), (seen_b, error_b) = asyncio.run(main())
    assert error_a is None  # A's view fits
    assert error_b is None  # B is warn: logged, not raised
    assert [v.shape for v in seen_a.views] == [(4, 16)]  # A did not record B's view
    assert [v.shape for v in seen_b.views] == [(5, 16)]
    assert [e["policy"] for e in events if e["event"] == "bounds_violation"] == ["warn"]
    assert _get_current_dispatch_mode() is None


def test_a_sanitizer_entered_twice_is_gone_after_both_exits() -> None:
    guard = sanitize()
    with guard:
        with guard:
            pass
        assert _get_current_dispatch_mode() is not None
    assert _get_current_dispatch_mode() is None


def test_nested_sanitizers_both_record_and_the_inner_policy_decides() -> None:
    meta = torch.empty(64, dtype=torch.int8, device="meta")
    with sanitize("strict") as outer:
        with sanitize("warn") as inner:
            torch.as_strided(meta, (5, 16), (16, 1))  # warn: runs
        with pytest.raises(BoundsError):
            torch.as_strided(meta, (6, 16), (16, 1))
    assert [v.shape for v in inner.views] == [(5, 16)]
    assert [v.shape for v in outer.views] == [(5, 16), (6, 16)]


def test_a_decorated_generator_is_checked_while_it_runs_and_only_then() -> None:
    meta = torch.empty(64, dtype=torch.int8, device="meta")

    @sanitize("strict")
    def views(rows: list[int]) -> Generator[torch.Tensor, None, str]:
        for count in rows:
            yield torch.as_strided(meta, (count, 16), (16, 1))
        return "done"

    made = views([2, 4, 5])
    assert next(made).shape == (2, 16)
    # suspended: the caller's own view past the end is not the generator's business
    assert torch.as_strided(meta, (9, 16), (16, 1)).shape == (9, 16)
    assert next(made).shape == (4, 16)
    with pytest.raises(BoundsError):
        next(made)
    assert _get_current_dispatch_mode() is None


def test_a_decorated_coroutine_is_checked_across_its_awaits() -> None:
    meta = torch.empty(64, dtype=torch.int8, device="meta")

    @sanitize("strict")
    async def register(rows: int) -> torch.Tensor:
        await asyncio.sleep(0)
        return torch.as_strided(meta, (rows, 16), (16, 1))

    assert asyncio.run(register(4)).shape == (4, 16)
    with pytest.raises(BoundsError):
        asyncio.run(register(5))
    assert _get_current_dispatch_mode() is None


def test_an_async_generator_is_refused_at_decoration_time() -> None:
    async def views() -> Any:
        yield 1

    with pytest.raises(ArgumentError, match="async generator"):
        sanitize()(views)


def test_guard_registration_on_an_async_method_checks_its_body() -> None:
    kv = torch.zeros(64, dtype=torch.int8)

    class Connector:
        @guard_registration
        async def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
            await asyncio.sleep(0)
            torch.empty(0, dtype=torch.int8).set_(kv.untyped_storage(), 0, (5, 16), (16, 1))

    with pytest.raises(BoundsError):
        asyncio.run(Connector().register_kv_caches({"layer.0": kv}))
    assert state(kv)[1] == 64


# -- what it records and reports ---------------------------------------------------------------


def test_to_plan_leaves_out_empty_and_stride_zero_views() -> None:
    kv = torch.zeros(64, dtype=torch.int8)
    with sanitize() as seen:
        torch.as_strided(kv, (4, 0), (1, 1))
        torch.as_strided(kv, (4, 16), (0, 1))
        torch.as_strided(kv, (4, 16), (16, 1))
    plan = seen.to_plan()
    assert [(v.num_blocks, v.page_bytes, v.block_stride_bytes) for v in plan.views] == [(4, 16, 16)]
    assert plan.description is not None
    assert "2 views that are not" in plan.description


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float8_e4m3fn, torch.bool])
def test_bounds_events_of_other_one_byte_types_carry_their_dtype(dtype: torch.dtype) -> None:
    kv = torch.zeros(64, dtype=dtype)
    with capture_events() as events, sanitize("warn"), pytest.raises(RuntimeError):
        torch.as_strided(kv, (5, 16), (16, 1))  # torch refuses on CPU after the event
    [event] = [e for e in events if e["event"] == "bounds_violation"]
    assert event["dtype"] == str(dtype).removeprefix("torch.")
    assert event["shape"] == [5, 16]
    assert event["strides"] == [16, 1]
    assert "num_blocks" not in event


# -- aliasing between layers, seen under the guard ----------------------------------------------


def two_layer_cache() -> dict[str, torch.Tensor]:
    raw = torch.zeros(4 * 1024, dtype=torch.int8)
    return {"layers.0": raw[:2048], "layers.1": raw[2048:]}


def lmcache_like(kv_caches: dict[str, torch.Tensor], v_offset_of_layer_1: int) -> None:
    """K and V views of each layer, made from the layer's own tensor; layer 1's V offset is the
    connector's own number."""
    for index, (_, cache) in enumerate(kv_caches.items()):
        torch.as_strided(cache, (2, 512), (1024, 1), cache.storage_offset())  # K
        v = v_offset_of_layer_1 if index == 1 else cache.storage_offset() + 512
        torch.as_strided(cache, (2, 512), (1024, 1), v)  # V


def test_a_layers_view_on_another_layers_bytes_is_refused_within_a_group() -> None:
    caches = two_layer_cache()
    groups = {"layers.0": 0, "layers.1": 0}
    with sanitize("strict", layers=caches, groups=groups) as seen:
        lmcache_like(caches, v_offset_of_layer_1=2048 + 512)  # correct
    assert seen.findings == []
    with (
        pytest.raises(OverlapError, match=r"layers\.1") as raised,
        sanitize("strict", layers=caches, groups=groups),
    ):
        lmcache_like(caches, v_offset_of_layer_1=512)  # on layer 0's V
    [finding] = raised.value.findings
    assert finding.byte == 512
    assert finding.group == 0
    assert finding.views[0].startswith("layers.0: ")
    assert finding.views[1].startswith("layers.1: ")


def test_layers_of_different_groups_may_share_bytes_under_the_guard() -> None:
    caches = two_layer_cache()
    with sanitize("strict", layers=caches, groups={"layers.0": 0, "layers.1": 1}) as seen:
        lmcache_like(caches, v_offset_of_layer_1=512)
    assert seen.findings == []
    assert {v.layer for v in seen.views} == {"layers.0", "layers.1"}


def test_under_warn_the_aliasing_is_an_event_and_the_views_are_made() -> None:
    caches = two_layer_cache()
    with (
        capture_events() as events,
        sanitize("warn", layers=caches, groups={"layers.0": 0, "layers.1": 0}) as seen,
    ):
        lmcache_like(caches, v_offset_of_layer_1=512)
    [event] = [e for e in events if e["event"] == "overlap_violation"]
    assert event["kind"] == "overlap"
    assert event["byte"] == 512
    assert event["policy"] == "warn"
    assert len(seen.views) == 4
    json.dumps(event)


def test_views_derived_through_view_ops_keep_their_layer() -> None:
    caches = two_layer_cache()
    with sanitize("strict", layers=caches, groups={"layers.0": 0, "layers.1": 0}) as seen:
        reshaped = caches["layers.1"].view(2, 1024)[:, :512]
        torch.as_strided(reshaped, (2, 512), (1024, 1), 2048)
    assert [v.layer for v in seen.views] == ["layers.1"]


# -- events exactly as the table says ----------------------------------------------------------


def test_check_tensors_under_off_still_sums_up_the_registration() -> None:
    kv = torch.zeros(64, dtype=torch.int8)
    with capture_events() as events:
        check_tensors({"a": kv[:32], "b": kv[16:48]}, groups={"a": 0, "b": 0}, policy="off")
    [summary] = events
    assert summary["event"] == "registration_checked"
    assert summary["checked"] is False
    assert summary["violations"] == 0
    # and docs/policies.md says so in check_tensors' `off` cell (it once said "no event")
    policies = (Path(__file__).parent.parent / "docs" / "policies.md").read_text()
    [row] = [line for line in policies.splitlines() if line.startswith("| `check_tensors`")]
    off_cell = row.strip("|").split("|")[-1]
    assert "`registration_checked` says `checked=false`" in off_cell
    assert "no event" not in off_cell


def test_an_infinite_group_is_written_as_json_text() -> None:
    stream = io.StringIO()
    configure_logging("json", level="WARNING", stream=stream)
    try:
        kv = torch.zeros(64, dtype=torch.int8)
        check_tensors({"a": kv[:32], "b": kv[16:48]}, groups={"a": inf, "b": inf}, policy="warn")
    finally:
        reset_logging()
    [line] = [line for line in stream.getvalue().splitlines() if "overlap_violation" in line]
    event = json.loads(line)  # strict JSON: no bare Infinity
    assert event["group"] == "inf"
    assert "Infinity" not in line


def test_records_from_code_under_a_folder_named_torch_point_at_that_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "torch"
    folder.mkdir()
    (folder / "my_connector.py").write_text(
        "from safeview.kv import check_tensors\n"
        "def register(kv):\n"
        "    views = {'a': kv[:32], 'b': kv[16:48]}\n"
        "    check_tensors(views, groups={'a': 0, 'b': 0}, policy='warn')\n"
    )
    monkeypatch.syspath_prepend(str(folder))
    module = importlib.import_module("my_connector")
    with caplog.at_level(logging.WARNING, logger="safeview"):
        module.register(torch.zeros(64, dtype=torch.int8))
    [record] = [r for r in caplog.records if "overlap_violation" in r.getMessage()]
    assert record.pathname == str(folder / "my_connector.py")
    assert (record.funcName, record.lineno) == ("register", 4)


# -- every error from safeview's own functions is a SafeViewError -------------------------------


def _kv() -> torch.Tensor:
    return torch.zeros(64, dtype=torch.int8)


BAD_CALLS: dict[str, Callable[[], Any]] = {
    "block_views_of_none": lambda: block_views(None, {}, num_blocks=1),  # type: ignore[arg-type]
    "block_views_of_a_list_without_its_specs": lambda: block_views(
        [_kv()], {"a": 16}, num_blocks=4
    ),
    "block_views_specs_none": lambda: block_views({"a": _kv()}, None, num_blocks=1),  # type: ignore[arg-type]
    "block_views_num_blocks_str": lambda: block_views({"a": _kv()}, {"a": 16}, num_blocks="4"),  # type: ignore[arg-type]
    "block_views_groups_list": lambda: block_views(
        {"a": _kv()},
        {"a": 16},
        num_blocks=4,
        groups=[0],  # type: ignore[arg-type]
    ),
    "block_views_region_reversed": lambda: block_views(
        {"a": _kv()}, {"a": 16}, num_blocks=4, regions={"a": (5, 1)}
    ),
    "block_views_packed_int": lambda: block_views(
        {"a": _kv()},
        {"a": 16},
        num_blocks=4,
        packed=3,  # type: ignore[arg-type]
    ),
    "block_views_packed_str": lambda: block_views(
        {"a": _kv()}, {"a": 16}, num_blocks=4, packed="a"
    ),
    "check_tensors_of_none": lambda: check_tensors(None),  # type: ignore[arg-type]
    "check_tensors_of_an_int": lambda: check_tensors({"a": 3}),  # type: ignore[dict-item]
    "check_tensors_groups_list": lambda: check_tensors({"a": _kv()}, groups=[1]),  # type: ignore[arg-type]
    "sanitize_layers_list": lambda: sanitize(layers=[_kv()]).__enter__(),  # type: ignore[arg-type]
    "sanitize_unknown_policy": lambda: sanitize("lax").__enter__(),  # type: ignore[arg-type]
}


@pytest.mark.parametrize("call", sorted(BAD_CALLS))
def test_bad_arguments_raise_a_safeview_error_naming_them(call: str) -> None:
    with pytest.raises(SafeViewError) as raised:
        BAD_CALLS[call]()
    message = str(raised.value)
    assert any(word in message for word in ("kv_caches", "specs", "num_blocks", "groups",
                                            "regions", "packed", "layers", "policy"))  # fmt: skip
    assert _get_current_dispatch_mode() is None


def test_a_list_of_layers_is_a_registration_with_layers_named_by_position() -> None:
    kv = torch.zeros(4 * 64, dtype=torch.int8)
    caches = [kv[:128], kv[128:]]
    registration = block_views(caches, {"0": 32, "1": 32}, num_blocks=4)
    assert list(registration.tensors_per_block) == ["0", "1"]

    class Connector:
        @guard_registration(groups={"0": 0, "1": 0})
        def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> int:
            return len(kv_caches)

    assert Connector().register_kv_caches(caches) == 2
    with pytest.raises(OverlapError):
        Connector().register_kv_caches([kv[:128], kv[64:192]])


def test_a_sanitizer_closed_in_another_thread_leaves_that_thread_and_its_own_consistent() -> None:
    meta = torch.empty(64, dtype=torch.int8, device="meta")
    guard = sanitize("strict")
    guard.__enter__()
    closed = threading.Event()

    def close_elsewhere() -> None:
        guard.__exit__(None, None, None)
        closed.set()

    worker = threading.Thread(target=close_elsewhere)
    worker.start()
    worker.join()
    assert closed.is_set()
    assert _get_current_dispatch_mode() is not None  # this thread's guard stays, idle
    assert torch.as_strided(meta, (9, 16), (16, 1)).shape == (9, 16)  # no sanitizer open here
    with sanitize("strict"), pytest.raises(BoundsError):  # and serves the next one
        torch.as_strided(meta, (9, 16), (16, 1))
    assert _get_current_dispatch_mode() is None


# -- out= into a shared storage, whatever the op and its inputs (issue 21, points 1 to 3) -------
#
# A float32 cache of 64 elements (256 bytes); each op writes through ``out=`` into a slice that
# starts at element 48, and each would need more than the 16 elements left after it.

OUT_OPS: dict[str, Callable[[torch.Tensor], Any]] = {
    # a weight that is an nn.Parameter (a tensor subclass): meta copies are plain meta tensors
    "mm_with_a_parameter": lambda kv: torch.mm(
        torch.ones(4, 4), torch.nn.Parameter(torch.ones(4, 8)), out=kv[48:52]
    ),
    # size and stride arguments, but it places nothing: its out= is what it writes
    "as_strided_copy": lambda kv: torch.as_strided_copy(torch.ones(40), (40,), (1,), out=kv[48:52]),
    # no meta kernel, or an output size that depends on the data
    "nonzero": lambda kv: torch.nonzero(torch.ones(40), out=kv.view(torch.int64)[24:26]),
    "masked_select": lambda kv: torch.masked_select(
        torch.ones(40), torch.ones(40, dtype=torch.bool), out=kv[48:52]
    ),
    "histogram": lambda kv: torch.histogram(torch.ones(40), 40, out=(kv[48:52], kv[52:56])),
}


def float_cache() -> torch.Tensor:
    return torch.arange(64, dtype=torch.float32)


@pytest.mark.filterwarnings("ignore:An output with one or more elements was resized")
@pytest.mark.parametrize("op", sorted(OUT_OPS))
def test_strict_refuses_an_out_that_would_grow_a_shared_storage_whatever_the_op(op: str) -> None:
    kv = float_cache()
    alone = float_cache()
    with torch.no_grad():
        OUT_OPS[op](alone)  # the oracle: torch alone grows and moves the storage
    assert alone.untyped_storage().nbytes() > 256
    before = state(kv)
    with torch.no_grad(), pytest.raises(BoundsError) as raised, sanitize("strict"):
        OUT_OPS[op](kv)
    assert state(kv) == before  # same bytes, same address
    assert torch.equal(kv, float_cache())  # nothing written
    assert raised.value.storage_nbytes == 256
    assert raised.value.extent_bytes is not None
    # the first out= that grows it (histogram's bin_edges would grow it further)
    assert 256 < raised.value.extent_bytes <= alone.untyped_storage().nbytes()
    assert raised.value.op is not None
    assert raised.value.op.startswith(f"aten::{op.split('_with')[0]} (")


@pytest.mark.filterwarnings("ignore:An output with one or more elements was resized")
@pytest.mark.parametrize("op", sorted(OUT_OPS))
def test_under_warn_an_out_that_grows_a_shared_storage_runs_as_without_safeview(op: str) -> None:
    kv = float_cache()
    alone = float_cache()
    with torch.no_grad():
        OUT_OPS[op](alone)
        with capture_events() as events, sanitize("warn"):
            OUT_OPS[op](kv)
    assert kv.untyped_storage().nbytes() == alone.untyped_storage().nbytes()
    assert torch.equal(kv, alone)
    event = next(e for e in events if e["event"] == "bounds_violation")
    assert 256 < event["extent_bytes"] <= alone.untyped_storage().nbytes()
    assert event["limit_bytes"] == 256


RIGHT_SIZE_OUT_OPS: dict[str, Callable[[torch.Tensor], Any]] = {
    "mm_with_a_parameter": lambda kv: torch.mm(
        torch.ones(2, 2), torch.nn.Parameter(torch.ones(2, 2)), out=kv[40:44].view(2, 2)
    ),
    "as_strided_copy": lambda kv: torch.as_strided_copy(torch.ones(40), (4,), (10,), out=kv[44:48]),
    "nonzero": lambda kv: torch.nonzero(
        torch.tensor([0.0, 1.0, 0.0, 1.0]), out=kv.view(torch.int64)[24:26].view(2, 1)
    ),
    "nonzero_into_a_larger_out": lambda kv: torch.nonzero(
        torch.tensor([0.0, 1.0, 0.0, 1.0]), out=kv.view(torch.int64)[28:30]
    ),  # resized to (2, 1) within its own bytes: the storage keeps its size
    "masked_select": lambda kv: torch.masked_select(
        torch.tensor([0.0, 1.0, 0.0, 1.0]), torch.tensor([0, 1, 0, 1]).bool(), out=kv[60:62]
    ),
    "histogram": lambda kv: torch.histogram(
        torch.tensor([0.0, 1.0, 0.0, 1.0]), 2, out=(kv[48:50], kv[50:53])
    ),
}


@pytest.mark.filterwarnings("ignore:An output with one or more elements was resized")
@pytest.mark.parametrize("op", sorted(RIGHT_SIZE_OUT_OPS))
def test_an_out_that_needs_no_growth_is_not_refused(op: str) -> None:
    kv = float_cache()
    alone = float_cache()
    before = state(kv)
    with torch.no_grad():
        expected = RIGHT_SIZE_OUT_OPS[op](alone)
        with capture_events() as events, sanitize("strict") as seen:
            result = RIGHT_SIZE_OUT_OPS[op](kv)
    assert state(kv) == before
    assert torch.equal(kv, alone)  # the op wrote what it writes without safeview
    for got, want in zip(result if isinstance(result, tuple) else (result,),
                         expected if isinstance(expected, tuple) else (expected,)):  # fmt: skip
        assert torch.equal(got, want)
    assert seen.findings == []
    assert [e for e in events if e["level"] in ("warning", "error")] == []


# An op safeview cannot work out: not one of torch's own (it is not run twice), no meta kernel,
# and an out= that its kernel resizes below the dispatcher.
_LIBRARY = torch.library.Library("safeview_tests", "DEF")  # type: ignore[no-untyped-call]
_LIBRARY.define("grow_into(Tensor x, *, Tensor(a!) out) -> Tensor(a!)")  # type: ignore[no-untyped-call]


def _grow_into(x: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
    out.resize_(x.shape)
    return out.copy_(x)


_LIBRARY.impl("grow_into", _grow_into, "CPU")  # type: ignore[no-untyped-call]


def grow_into(kv: torch.Tensor) -> Any:
    return torch.ops.safeview_tests.grow_into(torch.ones(40), out=kv[48:52])


def test_strict_refuses_an_out_whose_growth_cannot_be_worked_out() -> None:
    kv = float_cache()
    before = state(kv)
    with (
        capture_events() as events,
        pytest.raises(UnprovenWriteError) as raised,
        sanitize("strict"),
    ):
        grow_into(kv)
    assert state(kv) == before
    assert torch.equal(kv, float_cache())
    error = raised.value
    assert isinstance(error, SafeViewError)
    assert error.op == "safeview_tests::grow_into (out=)"
    assert error.storage_nbytes == 256
    assert "meta cannot run it" in error.reason
    assert "not one of torch's own ops" in error.reason
    assert error.site is not None
    assert "test_guard_promises.py" in error.site
    [event] = [e for e in events if e["event"] == "unproven_write"]
    assert event["level"] == "error"
    assert event["message"] == str(error)


def test_under_warn_an_unproven_out_is_an_event_and_runs_as_without_safeview() -> None:
    kv = float_cache()
    alone = float_cache()
    grow_into(alone)
    with capture_events() as events, sanitize("warn"):
        grow_into(kv)
    assert kv.untyped_storage().nbytes() == alone.untyped_storage().nbytes() == 352
    assert torch.equal(kv, alone)
    [event] = [e for e in events if e["event"] == "unproven_write"]
    assert event["level"] == "warning"
    assert event["policy"] == "warn"
    assert event["op"] == "safeview_tests::grow_into (out=)"
    assert event["storage_nbytes"] == 256
    json.dumps(event)


def test_an_op_that_fails_on_its_stand_ins_is_unproven_under_strict() -> None:
    kv = float_cache()
    before = state(kv)
    with pytest.raises(UnprovenWriteError, match="failed"), sanitize("strict"):
        torch.nonzero(torch.ones(40), out=kv[48:52])  # nonzero writes int64, not float32
    assert state(kv) == before


_LIBRARY.define("add_one_in_place(Tensor(a!) x) -> ()")  # type: ignore[no-untyped-call]


def _add_one_in_place(x: torch.Tensor) -> None:
    x.add_(1)


_LIBRARY.impl("add_one_in_place", _add_one_in_place, "CPU")  # type: ignore[no-untyped-call]


def test_an_in_place_op_meta_cannot_run_is_left_alone() -> None:
    """In-place arguments are never resized by torch's kernels, and a custom kernel's ``Tensor!``
    is written where it is: no refusal, no event, the op runs as without safeview."""
    kv = float_cache()
    with capture_events() as events, sanitize("strict") as seen:
        torch.ops.safeview_tests.add_one_in_place(kv[:16])
    assert seen.findings == []
    assert [e for e in events if e["level"] in ("warning", "error")] == []
    assert torch.equal(kv[:16], torch.arange(1, 17, dtype=torch.float32))


# -- a connector's views judged against the layers' own tensors (issue 21, point 5 and a
# newcomer's point 4)

PAGE = 64


class OneViewConnector:
    """Makes one view of one layer, from that layer's own tensor, as a connector's registration
    does; ``rows`` and ``offset`` (in elements) are its own numbers."""

    rows = 16
    offset: int | None = None
    layer = "layers.0"

    @guard_registration(groups={"layers.0": 0, "layers.1": 0})
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> torch.Tensor:
        cache = kv_caches[self.layer]
        offset = cache.storage_offset() if self.offset is None else self.offset
        return torch.as_strided(cache, (self.rows, PAGE), (PAGE, 1), offset)


def two_layers_of_16_pages() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    raw = torch.zeros(2 * 16 * PAGE, dtype=torch.int8)
    return raw, {"layers.0": raw[: 16 * PAGE], "layers.1": raw[16 * PAGE :]}


def test_a_view_of_one_layer_over_another_layers_pages_is_refused_with_no_view_of_the_other() -> (
    None
):
    raw, caches = two_layers_of_16_pages()
    before = state(raw)
    connector = OneViewConnector()
    assert connector.register_kv_caches(caches).shape == (16, PAGE)  # its own pages: fine
    connector.offset = 16 * PAGE  # layer 0's view on layer 1's 16 pages
    with pytest.raises(OverlapError) as raised:
        connector.register_kv_caches(caches)
    [finding] = raised.value.findings
    assert finding.views[0].startswith("layers.1: ")
    assert finding.views[1].startswith("layers.0: ")
    assert finding.byte == 16 * PAGE
    assert finding.group == 0
    assert state(raw) == before


def test_under_warn_a_view_over_another_layers_pages_is_an_event_and_is_made() -> None:
    raw, caches = two_layers_of_16_pages()
    before = state(raw)
    connector = OneViewConnector()
    connector.offset = 16 * PAGE
    expected = torch.as_strided(caches["layers.0"], (16, PAGE), (PAGE, 1), 16 * PAGE)
    with policy_scope("warn"), capture_events() as events:
        view = connector.register_kv_caches(caches)
    assert (view.shape, view.stride(), view.storage_offset(), view.data_ptr()) == (
        expected.shape, expected.stride(), expected.storage_offset(), expected.data_ptr()
    )  # fmt: skip
    [event] = [e for e in events if e["event"] == "overlap_violation"]
    assert event["byte"] == 16 * PAGE
    assert event["policy"] == "warn"
    assert state(raw) == before


def test_a_view_past_the_end_made_from_a_layer_names_the_layer() -> None:
    raw, caches = two_layers_of_16_pages()
    before = state(raw)
    connector = OneViewConnector()
    connector.layer, connector.rows = "layers.1", 17  # one page more than the layer has
    with pytest.raises(BoundsError) as raised:
        connector.register_kv_caches(caches)
    assert raised.value.name == "layers.1"
    assert "view 'layers.1' needs bytes [1,024, 2,112)" in str(raised.value)
    assert state(raw) == before


def test_a_view_placed_from_the_bare_storage_is_named_after_the_layer_it_starts_in() -> None:
    raw, caches = two_layers_of_16_pages()
    before = state(raw)

    class Connector:
        @guard_registration(groups={"layers.0": 0, "layers.1": 0})
        def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
            cache = kv_caches["layers.1"]  # the worker's four-argument set_, one page too many
            torch.empty(0, dtype=torch.int8).set_(
                cache.untyped_storage(), cache.storage_offset(), (17, PAGE), (PAGE, 1)
            )

    with pytest.raises(BoundsError) as raised:
        Connector().register_kv_caches(caches)
    assert raised.value.name == "layers.1"
    assert state(raw) == before


def test_a_layer_in_no_group_handed_another_layers_tensor_does_not_hide_it() -> None:
    """vLLM's cross-layer KV sharing: the sharing layer holds its target's very tensor."""
    raw, caches = two_layers_of_16_pages()
    before = state(raw)
    shared = {**caches, "layers.2": caches["layers.1"]}  # layers.2 shares layers.1's cache
    groups = {"layers.0": 0, "layers.1": 0}
    with sanitize("strict", layers=shared, groups=groups):
        torch.as_strided(shared["layers.1"], (16, PAGE), (PAGE, 1), 16 * PAGE)  # its own
        with pytest.raises(OverlapError) as raised:
            torch.as_strided(shared["layers.0"], (16, PAGE), (PAGE, 1), 16 * PAGE)  # layer 1's
    [finding] = raised.value.findings
    assert finding.views[0].startswith("layers.1: ")
    assert finding.views[1].startswith("layers.0: ")
    assert state(raw) == before
