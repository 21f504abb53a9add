"""sanitize(): every view code we do not own makes, checked before it is made, on CPU and meta."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

import safeview
from safeview import BoundsError, Plan, sanitize
from safeview.guard.sanitize import Sanitizer
from safeview.kv import guard_registration
from safeview.testing import capture_events

PAGE, NUM_BLOCKS, LAYERS = 4_096, 8, 3


def vllm_like_caches(device: str = "cpu") -> dict[str, torch.Tensor]:
    """Layer-outer caches in one int8 buffer, each layer an fp16 tensor of its own blocks."""
    raw = torch.zeros(LAYERS * NUM_BLOCKS * PAGE, dtype=torch.int8, device=device)
    halves = raw.view(torch.float16)
    per_layer = NUM_BLOCKS * PAGE // 2
    return {
        f"model.layers.{i}.self_attn": halves[i * per_layer : (i + 1) * per_layer].view(
            NUM_BLOCKS, 2, PAGE // 4
        )
        for i in range(LAYERS)
    }


def register_like_vllm(
    kv_caches: dict[str, torch.Tensor], page: int, num_blocks: int
) -> dict[str, torch.Tensor]:
    """The call pattern of vLLM 0.33's offloading worker, written here: a four-argument set_."""
    views = {}
    for layer, ref in kv_caches.items():
        elem = ref.element_size()
        views[layer] = torch.tensor([], dtype=torch.int8, device=ref.device).set_(
            ref.untyped_storage(),
            ref.storage_offset() * elem,
            (num_blocks, page),
            (ref.stride(0) * elem, 1),
        )
    return views


def _state(tensor: torch.Tensor) -> tuple[int, int]:
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.shape == b.shape
        and a.stride() == b.stride()
        and a.storage_offset() == b.storage_offset()
        and a.dtype == b.dtype
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    )


def test_clean_registration_gives_the_same_views_as_without_the_sanitizer() -> None:
    caches = vllm_like_caches()
    plain = register_like_vllm(caches, PAGE, NUM_BLOCKS)
    with sanitize() as seen:
        guarded = register_like_vllm(caches, PAGE, NUM_BLOCKS)
    assert all(_same_view(plain[layer], guarded[layer]) for layer in caches)
    assert len(seen.views) == LAYERS
    first = seen.views[0]
    assert (first.op, first.byte_offset, first.shape, first.strides) == (
        "aten::set_",
        0,
        (NUM_BLOCKS, PAGE),
        (PAGE, 1),
    )
    assert seen.views[2].byte_offset == 2 * NUM_BLOCKS * PAGE
    assert seen.views[2].extent_bytes == 3 * NUM_BLOCKS * PAGE == first.storage_nbytes
    assert first.function == "register_like_vllm"
    assert first.file == __file__


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_strict_refuses_a_page_too_big_before_the_storage_is_reallocated(device: str) -> None:
    caches = vllm_like_caches(device)
    before = _state(next(iter(caches.values())))
    with pytest.raises(BoundsError) as caught, sanitize(policy="strict"):
        register_like_vllm(caches, 2 * PAGE, NUM_BLOCKS)  # the spec's page, one notch too big
    assert _state(next(iter(caches.values()))) == before
    error = caught.value
    assert error.op == "aten::set_"
    assert error.site is not None
    assert "register_like_vllm" in error.site
    assert error.site.startswith("tests/test_sanitize.py:")
    last = 2 * NUM_BLOCKS * PAGE  # the first layer whose view runs past the end
    assert error.byte_offset == last
    assert error.extent_bytes == last + (NUM_BLOCKS - 1) * PAGE + 2 * PAGE
    assert error.storage_nbytes == LAYERS * NUM_BLOCKS * PAGE
    assert error.device == device
    assert "by aten::set_ at tests/test_sanitize.py:" in str(error)
    if device == "cpu":  # what was prevented: the same calls, unsanitized, move the cache
        register_like_vllm(caches, 2 * PAGE, NUM_BLOCKS)
        assert _state(next(iter(caches.values()))) != before


def test_warn_logs_the_op_and_the_call_site_and_lets_it_run() -> None:
    caches = {"only": vllm_like_caches("meta")["model.layers.2.self_attn"]}
    with capture_events() as events, sanitize(policy="warn") as seen:
        (view,) = register_like_vllm(caches, PAGE, NUM_BLOCKS + 1).values()
    assert view.shape == (NUM_BLOCKS + 1, PAGE)  # the op ran
    [event] = [e for e in events if e["event"] == "bounds_violation"]
    assert event["level"] == "warning"
    assert event["op"] == "aten::set_"
    assert event["function"] == "register_like_vllm"
    assert event["file"] == __file__
    assert isinstance(event["line"], int)
    assert event["overflow_bytes"] == PAGE
    assert event["num_blocks"] == NUM_BLOCKS + 1
    assert seen.views[-1].extent_bytes == event["extent_bytes"]


def test_off_installs_nothing_and_records_nothing() -> None:
    caches = vllm_like_caches("meta")
    with sanitize(policy="off") as seen:
        assert _get_current_dispatch_mode() is None
        register_like_vllm(caches, 2 * PAGE, NUM_BLOCKS)
    assert seen.views == []


def test_the_mode_is_gone_after_the_block_even_when_it_raised() -> None:
    with sanitize():
        assert _get_current_dispatch_mode() is not None
    with pytest.raises(BoundsError), sanitize():
        torch.as_strided(torch.empty(8, device="meta"), (4,), (4,))
    assert _get_current_dispatch_mode() is None


def test_as_strided_past_the_end_on_meta_is_refused_where_torch_checks_nothing() -> None:
    meta = torch.empty(64, dtype=torch.int8, device="meta")
    assert torch.as_strided(meta, (5, 16), (16, 1)).shape == (5, 16)  # torch alone accepts it
    message = r"needs bytes \[0, 80\) .*\(16 bytes past the end\)"
    with pytest.raises(BoundsError, match=message), sanitize():
        torch.as_strided(meta, (5, 16), (16, 1))


def test_an_empty_view_far_past_the_end_is_refused_as_in_make_view() -> None:
    meta = torch.empty(16, dtype=torch.int8, device="meta")
    message = "the empty view starts at byte 1,000,000,000,000"
    with pytest.raises(BoundsError, match=message), sanitize():
        torch.as_strided(meta, (0, 16), (16, 1), 10**12)


def test_in_place_as_strided_and_the_tensor_source_set_are_checked() -> None:
    kv = torch.zeros(64, dtype=torch.int8)
    with sanitize() as seen:
        torch.empty(0, dtype=torch.int8).set_(kv)  # type: ignore[call-overload]
        with pytest.raises(BoundsError, match="aten::as_strided_"):
            torch.empty(0, dtype=torch.int8).set_(kv.untyped_storage()).as_strided_((9, 8), (8, 1))
        with pytest.raises(BoundsError, match="aten::set_"):
            torch.empty(0, dtype=torch.int8).set_(kv, 8, (8, 8), (8, 1))  # type: ignore[call-overload]
    assert [view.op for view in seen.views] == ["aten::set_", "aten::as_strided_", "aten::set_"]
    assert kv.untyped_storage().nbytes() == 64


def test_resize_that_grows_a_shared_storage_is_refused_and_fresh_tensors_still_grow() -> None:
    kv = torch.zeros(64, dtype=torch.int8)
    layer = kv[:32]
    pointer = kv.untyped_storage().data_ptr()
    with sanitize():
        fresh = torch.empty(0, dtype=torch.int8).resize_(100)  # a new tensor's storage: fine
        out = torch.empty(0)
        torch.add(torch.ones(3), 1, out=out)  # out= resizes its output: fine
        with pytest.raises(BoundsError, match="aten::resize_"):
            kv.resize_(128)
    assert fresh.shape == (100,)
    assert out.tolist() == [2.0, 2.0, 2.0]
    assert kv.untyped_storage().data_ptr() == pointer == layer.untyped_storage().data_ptr()
    assert kv.untyped_storage().nbytes() == 64


def test_a_resize_of_a_view_at_a_storage_offset_counts_the_bytes_before_it() -> None:
    # the view starts at byte 32 of 64: 48 elements need bytes [32, 80), past the end, though
    # 48 bytes alone would fit (a judgement that drops the offset lets this growth through)
    kv = torch.zeros(64, dtype=torch.int8)
    tail = kv[32:]
    pointer = kv.untyped_storage().data_ptr()
    with sanitize() as seen:
        tail.resize_(16)  # shrinks the view, not the storage: fine
        with pytest.raises(BoundsError, match=r"needs bytes \[32, 80\) .*\(16 bytes past"):
            tail.resize_(48)
    assert [(view.op, view.byte_offset) for view in seen.views] == [("aten::resize_", 32)]
    assert (kv.untyped_storage().nbytes(), kv.untyped_storage().data_ptr()) == (64, pointer)
    assert tail.shape == (16,)


def test_typed_views_count_elements_of_their_dtype() -> None:
    raw = torch.zeros(64, dtype=torch.int8)
    halves = raw.view(torch.float16)
    with sanitize() as seen:
        torch.as_strided(halves, (4, 8), (8, 1), 0)
        with pytest.raises(BoundsError, match=r"needs bytes \[2, 66\)"):
            torch.as_strided(halves, (4, 8), (8, 1), 1)
    assert [(view.itemsize, view.dtype) for view in seen.views] == [(2, "float16")] * 2


def test_a_sanitizer_in_one_thread_does_not_see_another_thread() -> None:
    meta = torch.empty(64, dtype=torch.int8, device="meta")
    made: list[tuple[int, ...]] = []
    entered, done = threading.Event(), threading.Event()

    modes: list[object] = []

    def other_thread() -> None:
        entered.wait(timeout=30)
        modes.append(_get_current_dispatch_mode())  # nothing installed here: no cost per op
        made.append(tuple(torch.as_strided(meta, (5, 16), (16, 1)).shape))  # past the end
        done.set()

    worker = threading.Thread(target=other_thread)
    worker.start()
    with sanitize() as seen:
        entered.set()
        assert done.wait(timeout=30)
    worker.join()
    assert modes == [None]
    assert made == [(5, 16)]  # not refused: that thread has no sanitizer
    assert seen.views == []  # and this one saw nothing of it


def test_as_a_decorator_each_call_gets_a_fresh_sanitizer() -> None:
    @sanitize(policy="strict")
    def view_of(tensor: torch.Tensor, rows: int) -> torch.Tensor:
        return torch.as_strided(tensor, (rows, 8), (8, 1))

    meta = torch.empty(32, dtype=torch.int8, device="meta")
    assert view_of(meta, 4).shape == (4, 8)
    with pytest.raises(BoundsError):
        view_of(meta, 5)
    assert _get_current_dispatch_mode() is None


def test_a_failure_of_its_own_lets_the_op_run_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: Sanitizer, op: Any) -> Any:
        raise RuntimeError("a bug in safeview")

    monkeypatch.setattr(Sanitizer, "_judge", broken)
    meta = torch.empty(64, dtype=torch.int8, device="meta")
    with capture_events() as events, sanitize():
        view = torch.as_strided(meta, (5, 16), (16, 1))
    assert view.shape == (5, 16)
    [event] = events
    assert event["event"] == "internal_error"
    assert event["error"] == "RuntimeError: a bug in safeview"


def test_to_plan_writes_the_block_views_for_safeview_check(tmp_path: Path) -> None:
    caches = vllm_like_caches("meta")
    with sanitize() as seen:
        register_like_vllm(caches, PAGE, NUM_BLOCKS)
        torch.as_strided(next(iter(caches.values())), (2, 2), (2, 1))  # fp16: not a block view
    path = tmp_path / "seen.json"
    plan = seen.to_plan(path)
    assert [view.byte_offset for view in plan.views] == [0, 32_768, 65_536]
    assert plan.description is not None
    assert "1 view that is not an int8 block view left out" in plan.description
    assert Plan.load(path).check().ok
    # the same views, read through the checker directly
    assert seen.report().ok is False  # the fp16 view lies on layer 0's bytes


def test_guard_registration_runs_the_method_under_the_sanitizer() -> None:
    caches = vllm_like_caches()
    state = _state(next(iter(caches.values())))

    class Connector:
        page = 2 * PAGE  # the connector's own, wrong, page

        @guard_registration
        def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
            register_like_vllm(kv_caches, self.page, NUM_BLOCKS)

    with pytest.raises(BoundsError, match="in register_like_vllm"):
        Connector().register_kv_caches(caches)
    assert _state(next(iter(caches.values()))) == state


def test_events_of_a_refused_view_are_one_json_line_with_the_call_site() -> None:
    import io

    out = io.StringIO()
    safeview.configure_logging("json", level="WARNING", stream=out)
    meta = torch.empty(64, dtype=torch.int8, device="meta")
    with pytest.raises(BoundsError), sanitize():
        torch.as_strided(meta, (5, 16), (16, 1))
    [event] = [json.loads(line) for line in out.getvalue().splitlines()]
    assert event["event"] == "bounds_violation"
    assert event["level"] == "error"
    assert event["function"] == "test_events_of_a_refused_view_are_one_json_line_with_the_call_site"
    assert logging.getLogger("safeview").propagate is False
