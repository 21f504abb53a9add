"""Nothing left behind: ``safeview.transfer.coverage`` against a byte oracle (a mask of the bytes
the rows cover, one bool per byte of a small storage), and its policies."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import safeview
from safeview import ArgumentError
from safeview.testing import capture_events
from safeview.transfer import MemoryMap, StorageSpan, ViewSpan
from safeview.transfer.coverage import check_coverage

BASE = 0x10_0000
SIZE = 4096


def _map(views: list[ViewSpan]) -> MemoryMap:
    return MemoryMap((StorageSpan("kv", BASE, SIZE),), tuple(views))


def _covered(rows: list[tuple[int, ...]]) -> Any:
    """One bool per byte of the storage: does an element of some row cover it."""
    covered = np.zeros(SIZE, dtype=bool)
    for row in rows:
        address, length = row[0], row[1]
        stride, count = (row[3], row[4]) if len(row) == 5 else (0, 1)
        for element in range(count):
            start = address + element * stride - BASE
            covered[max(start, 0) : max(min(start + length, SIZE), 0)] = True
    return covered


def _oracle(views: list[ViewSpan], rows: list[tuple[int, ...]]) -> dict[str, int]:
    """Layer -> bytes of its pages that no element of any row covers, byte by byte."""
    covered = _covered(rows)
    missing: dict[str, int] = {}
    for view in views:
        for block in range(view.num_blocks):
            start = view.byte_offset + block * view.block_stride_bytes
            page = covered[start : start + view.page_bytes]
            missing[view.name] = missing.get(view.name, 0) + int((~page).sum())
    return missing


@st.composite
def layouts(draw: Any) -> tuple[list[ViewSpan], list[tuple[int, ...]]]:
    """Layers of one page size laid out layer by layer or packed, and rows that cover some."""
    layers = draw(st.integers(1, 4))
    page = draw(st.sampled_from([16, 32, 48, 64]))
    blocks = draw(st.integers(1, 8))
    packed = draw(st.booleans())
    views = []
    for n in range(layers):
        if packed:
            views.append(ViewSpan(f"l{n}", "kv", n * page, page, layers * page, blocks))
        else:
            views.append(ViewSpan(f"l{n}", "kv", n * blocks * page, page, page, blocks))
    rows: list[tuple[int, ...]] = []
    for view in views:
        choice = draw(st.sampled_from(["whole", "none", "short", "fewer", "pages"]))
        first = BASE + view.byte_offset
        stride = view.block_stride_bytes
        if choice == "whole":
            rows.append((first, page, 0, stride, blocks))
        elif choice == "short":
            rows.append((first, page - draw(st.integers(1, page - 1)), 0, stride, blocks))
        elif choice == "fewer":
            rows.append((first, page, 0, stride, draw(st.integers(0, blocks - 1))))
        elif choice == "pages":
            for block in draw(st.lists(st.integers(0, blocks - 1), max_size=blocks)):
                rows.append((first + block * stride, page, 0, 0, 1))
    if packed and draw(st.booleans()):  # whole-block rows, as vLLM's NIXL worker prepares
        rows.append((BASE, layers * page, 0, layers * page, draw(st.integers(0, blocks))))
    return views, rows


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_every_layer_is_reported_exactly_when_the_oracle_finds_bytes_left_out(
    layout: tuple[list[ViewSpan], list[tuple[int, ...]]],
) -> None:
    views, rows = layout
    found = check_coverage([np.array(rows, dtype=np.uint64).reshape(-1, 5)], _map(views),
                           policy="warn")  # fmt: skip
    expected = {name: count for name, count in _oracle(views, rows).items() if count}
    assert {f.layer: f.length_bytes for f in found} == expected
    covered = _covered(rows)
    for finding in found:  # the first missing bytes named are missing indeed
        low, high = finding.byte_offset, finding.extent_bytes
        assert low is not None
        assert high is not None
        assert low < high
        assert not covered[low:high].any()


def test_a_packed_row_spanning_every_layer_covers_them_all() -> None:
    views = [ViewSpan(f"l{n}", "kv", n * 576, 576, 1728, 2) for n in range(3)]
    assert check_coverage([[(BASE, 1728, 0, 1728, 2)]], _map(views)) == []


def test_a_layer_left_out_names_its_first_missing_bytes_and_what_was_prepared() -> None:
    views = [ViewSpan(f"l{n}", "kv", n * 256, 128, 128, 2) for n in range(3)]
    rows = [(BASE, 128, 0, 128, 2), (BASE + 512, 128, 0, 128, 2), (BASE + 256, 64)]
    [finding] = check_coverage([rows[:2], rows[2:]], _map(views), policy="warn")
    assert (finding.kind, finding.layer, finding.views) == ("unregistered", "l1", ("l1",))
    assert (finding.byte_offset, finding.extent_bytes) == (320, 384)
    assert (finding.count, finding.length_bytes) == (2, 192)
    assert "prepared: 3 rows in 2 lists, covering layers 'l0', 'l1', 'l2'" in finding.message


def test_padded_state_counts_as_covered_when_a_row_reaches_into_each_page() -> None:
    views = [ViewSpan("mamba", "kv", 0, 512, 512, 2)]
    rows = [(BASE, 100, 0, 512, 2)]  # the state, not the padding
    assert check_coverage([rows], _map(views), touched=["mamba"]) == []
    assert [f.length_bytes for f in check_coverage([rows], _map(views), policy="warn")] == [824]
    assert check_coverage([rows[:0]], _map(views), touched=["mamba"], policy="warn") != []


def test_strict_raises_coverage_error_naming_every_layer_left_out() -> None:
    views = [ViewSpan(f"l{n}", "kv", n * 256, 256, 256, 1) for n in range(3)]
    with capture_events() as events, pytest.raises(safeview.CoverageError) as refused:
        check_coverage([[(BASE + 256, 256)]], _map(views))
    assert refused.value.layers == ("l0", "l2")
    assert str(refused.value).endswith("[policy strict]; and 1 more layer left out")
    assert [(e["event"], e["level"], e["layer"]) for e in events] == [
        ("coverage_violation", "error", "l0"),
        ("coverage_violation", "error", "l2"),
    ]


def test_only_the_layers_named_are_judged_and_off_judges_none() -> None:
    views = [ViewSpan(f"l{n}", "kv", n * 256, 256, 256, 1) for n in range(2)]
    assert check_coverage([[(BASE, 256)]], _map(views), layers=["l0"]) == []
    assert check_coverage([], _map(views), policy="off") == []
    with pytest.raises(ArgumentError, match="layers names 'l9', which is no layer"):
        check_coverage([], _map(views), layers=["l9"], policy="warn")


def test_the_nixl_workers_layers_to_transfer_follow_vllms_own_rules() -> None:
    from types import SimpleNamespace

    import torch

    from safeview.vllm._nixl import layers_to_transfer

    cache = torch.zeros(4)  # host memory
    groups = (SimpleNamespace(kv_cache_spec=object(), layer_names=["a", "b"]),)
    config = SimpleNamespace(transfer_groups=groups, kv_cache_groups=groups)
    caches = {"a": cache, "b": cache, "shared": cache}  # "shared": KV sharing, no spec
    assert layers_to_transfer(SimpleNamespace(), caches, config)[0] == ["a", "b"]
    # a HiSparse host pool shared by the TP ranks: rank 0 transfers the host-memory layers
    rank_1 = SimpleNamespace(_skip_dram_xfer=True)
    assert layers_to_transfer(rank_1, caches, config)[0] == []


@pytest.mark.parametrize(
    "flat",
    [
        [(BASE, 64), (BASE + 64, 64)],  # rows, as a list of tuples
        [[BASE, 128, 0]],  # rows, as a list of lists
        np.array([[BASE, 64], [BASE + 64, 64]], dtype=np.uint64),  # rows, as one array
    ],
    ids=["tuples", "lists", "array"],
)
def test_rows_given_where_lists_of_rows_are_expected_say_so(flat: Any) -> None:
    memory = _map([ViewSpan("layers.0", "kv", 0, 64, 64, 2)])  # two pages of 64 bytes
    with pytest.raises(ArgumentError) as caught:
        check_coverage(flat, memory)
    message = str(caught.value)
    assert "prepared must be a list of descriptor lists" in message  # what is expected
    assert "its item 0 is one row" in message  # what was passed
    assert str(tuple(int(v) for v in flat[0])) in message  # the value
    assert "check_coverage([rows], ...)" in message  # how to pass it
    # the same rows, wrapped as the message says, are checked
    assert check_coverage([flat], memory) == []
