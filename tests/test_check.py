"""The one checker: every judgement over plain records, against brute force and numpy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from safeview import ArgumentError, OverlapError
from safeview.check import StorageRecord, ViewRecord, check_views
from safeview.kv import block_views, check_tensors


def _touched(view: ViewRecord) -> set[int]:
    """Every byte a view touches, by enumeration."""
    starts = {view.byte_offset}
    for size, stride in zip(view.shape, view.strides):
        if size == 0:
            return set()
        starts = {s + k * stride * view.itemsize for s in starts for k in range(size)}
    return {s + b for s in starts for b in range(view.itemsize)}


@st.composite
def block_records(draw: st.DrawFn, name: str) -> ViewRecord:
    number = draw(st.integers(0, 5))
    page = draw(st.integers(1, 12))
    stride = draw(st.sampled_from([page, 2 * page, 24, 36, draw(st.integers(1, 40))]))
    return ViewRecord.block(
        name,
        "kv",
        num_blocks=number,
        page_bytes=page,
        block_stride_bytes=stride,
        byte_offset=draw(st.integers(0, 60)),
        group=draw(st.sampled_from([None, 0, 1])),
    )


@given(data=st.data(), count=st.integers(1, 6), nbytes=st.integers(0, 200))
def test_findings_match_brute_force_on_small_block_layouts(
    data: st.DataObject, count: int, nbytes: int
) -> None:
    views = [data.draw(block_records(f"v{i}")) for i in range(count)]
    report = check_views({"kv": nbytes}, views)
    kinds = {(f.kind, f.views) for f in report.findings}
    touched = {view.name: _touched(view) for view in views}
    self_overlapping = set()
    for view in views:
        pages = [
            set(range(view.byte_offset + i * view.strides[0],
                      view.byte_offset + i * view.strides[0] + view.shape[1]))
            for i in range(view.shape[0])
        ]  # fmt: skip
        if sum(len(p) for p in pages) != len(set().union(*pages)):
            self_overlapping.add(view.name)
            assert ("self_overlap", (view.name,)) in kinds
        past = max(touched[view.name], default=view.byte_offset - 1) >= nbytes or (
            not touched[view.name] and view.byte_offset > nbytes
        )
        assert (("out_of_bounds", (view.name,)) in kinds) == past
    for i, first in enumerate(views):
        for second in views[i + 1 :]:
            if {first.name, second.name} & self_overlapping:
                continue  # kept out of the pairwise check
            may_share = (
                first.group is not None
                and second.group is not None
                and (first.group != second.group)
            )
            common = touched[first.name] & touched[second.name]
            expected = bool(common) and not may_share
            found = [f for f in report.findings if f.views == (first.name, second.name)]
            assert bool(found) == expected
            if found:
                assert found[0].byte == min(common)  # the witness is the lowest shared byte


def test_a_self_overlapping_view_is_kept_out_of_the_pairwise_check() -> None:
    views = [
        ViewRecord.block("bad", "kv", num_blocks=4, page_bytes=16, block_stride_bytes=8,
                         byte_offset=0),
        ViewRecord.block("good", "kv", num_blocks=1, page_bytes=16, block_stride_bytes=16,
                         byte_offset=0),
    ]  # fmt: skip
    report = check_views({"kv": 64}, views)
    assert [(f.kind, f.views) for f in report.findings] == [("self_overlap", ("bad",))]


def test_views_of_two_storages_over_one_memory_are_compared_by_address() -> None:
    storages = {
        "a": StorageRecord(64, memory="cpu", base=1000),
        "b": StorageRecord(64, memory="cpu", base=1032),  # its byte 0 is a's byte 32
    }
    views = [
        ViewRecord.block("x", "a", num_blocks=1, page_bytes=40, block_stride_bytes=40,
                         byte_offset=0),
        ViewRecord.block("y", "b", num_blocks=1, page_bytes=8, block_stride_bytes=8,
                         byte_offset=4),
    ]  # fmt: skip
    [finding] = check_views(storages, views).findings
    assert finding.views == ("x", "y")
    assert finding.byte == 36  # in x's storage: y's byte 4 is a's byte 36
    apart = {**storages, "b": StorageRecord(64, memory="cpu", base=2000)}
    assert check_views(apart, views).ok


def test_frombuffer_twice_gives_two_storages_whose_aliasing_is_still_found() -> None:
    buffer = bytearray(256)
    first = torch.frombuffer(buffer, dtype=torch.int8)
    second = torch.frombuffer(buffer, dtype=torch.int8)
    assert first.untyped_storage()._cdata != second.untyped_storage()._cdata
    caches = {
        "layer.0": torch.as_strided(first, (4, 32), (64, 1), 0),
        "layer.1": torch.as_strided(second, (4, 32), (64, 1), 16),  # shares 16 bytes a block
    }
    assert np.shares_memory(
        np.frombuffer(buffer, np.int8)[0:32], np.frombuffer(buffer, np.int8)[16:48]
    )
    with pytest.raises(OverlapError, match=r"'layer\.0' and 'layer\.1' both use byte 16"):
        check_tensors(caches)
    with pytest.raises(OverlapError):
        block_views(caches, {"layer.0": 32, "layer.1": 32}, num_blocks=4, packed=caches)


def test_meta_storages_are_each_their_own_memory() -> None:
    a = torch.empty(64, dtype=torch.int8, device="meta")
    b = torch.empty(64, dtype=torch.int8, device="meta")
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() == 0
    assert check_tensors({"a": a, "b": b}).ok


def test_a_view_naming_an_unknown_storage_is_an_argument_error() -> None:
    view = ViewRecord.block("v", "nowhere", num_blocks=1, page_bytes=1, block_stride_bytes=1,
                            byte_offset=0)  # fmt: skip
    with pytest.raises(ArgumentError, match="names storage 'nowhere'"):
        check_views({"kv": 8}, [view])


def test_off_judges_nothing() -> None:
    view = ViewRecord.block("v", "kv", num_blocks=9, page_bytes=8, block_stride_bytes=4,
                            byte_offset=0)  # fmt: skip
    assert check_views({"kv": 8}, [view], checks=False).ok
    assert {f.kind for f in check_views({"kv": 8}, [view]).findings} == {
        "out_of_bounds",
        "self_overlap",
    }


def test_bytes_covered_and_min_slack_are_the_views_own_numbers() -> None:
    views = [
        ViewRecord.block("a", "kv", num_blocks=3, page_bytes=8, block_stride_bytes=32,
                         byte_offset=0),
        ViewRecord.block("b", "kv", num_blocks=3, page_bytes=24, block_stride_bytes=32,
                         byte_offset=8),
    ]  # fmt: skip
    report = check_views({"kv": 100}, views)
    assert sum(view.nbytes for view in report.views) == 3 * 8 + 3 * 24
    assert report.min_slack_bytes() == 100 - (8 + 2 * 32 + 24)
    assert [row["status"] for row in report.rows()] == ["ok", "ok"]


def test_a_dlpack_alias_is_another_storage_over_the_same_memory_and_is_compared() -> None:
    kv = torch.zeros(1024, dtype=torch.int8)
    alias = torch.utils.dlpack.from_dlpack(kv)
    assert alias.untyped_storage()._cdata != kv.untyped_storage()._cdata
    report = check_tensors({"a": kv[:512], "b": alias[256:768]}, policy="warn")
    [finding] = report.findings
    assert (finding.kind, finding.views, finding.byte) == ("overlap", ("a", "b"), 256)
