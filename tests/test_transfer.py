"""Descriptors checked against the views they must hit: the rules against a byte-level oracle,
and the check's policy, inputs and registrations.

The oracle knows every byte of every page of small layouts (packed groups, contiguous layers,
padding, aliases, storages next to each other, addresses with bit 63 set) and judges each row
by sets of bytes, as the rules in ``safeview/transfer/__init__.py`` say them in words.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import safeview
from safeview import AddressError, ArgumentError, SafeViewError
from safeview.findings import DESCRIPTOR_KINDS, KINDS
from safeview.kv import block_views
from safeview.testing import capture_events
from safeview.transfer import (
    ADDRESS_LIMIT,
    MemoryMap,
    StorageSpan,
    ViewSpan,
    _judge,
    _overlapping_writes,
    _rows,
    check_descriptors,
    memory_map,
)

TOP = ADDRESS_LIMIT - 1
#: the install lines of the engines, pinned to the versions tested (as the example prints them)
ENGINES_HINT = (
    "pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1; apt-get install libibverbs1; "
    "pip install mooncake-transfer-engine-non-cuda==0.3.13.post1"
)
BASES = (0x1000, 2**63 - 0x100, 2**63 + 0x1000, ADDRESS_LIMIT - 0x400)

# -- the oracle -----------------------------------------------------------------------------------


@dataclass
class Layout:
    """A registration as sets of bytes: storages, views, and the packed groups whose whole blocks
    are rows of their own."""

    storages: list[StorageSpan]
    views: list[ViewSpan]
    # packed groups whose pages fill each block: view names, block stride
    groups: list[tuple[list[str], int]] = field(default_factory=list)

    def memory(self) -> MemoryMap:
        return MemoryMap(tuple(self.storages), tuple(self.views))

    def storage(self, name: str) -> StorageSpan:
        return next(s for s in self.storages if s.name == name)

    def pages(self, view: ViewSpan) -> list[range]:
        """The view's pages that lie inside its storage, as address ranges."""
        storage = self.storage(view.storage)
        end = storage.address + storage.nbytes
        found = []
        for block in range(view.num_blocks):
            start = storage.address + view.byte_offset + block * view.block_stride_bytes
            if start + view.page_bytes > end or not view.page_bytes:
                break
            found.append(range(start, start + view.page_bytes))
        return found

    def names(self, view: ViewSpan) -> set[str]:
        return {view.name, view.layer or view.name}


def contiguous(view: ViewSpan, pages: list[range]) -> bool:
    return view.block_stride_bytes == view.page_bytes or len(pages) == 1


@dataclass
class Hit:
    kind: str  # page, run, blocks
    whole: bool
    names: set[str]
    key: Any  # the view (or group) and first page (or block), for the strided rules


def element_hits(layout: Layout, first: int, length: int) -> list[Hit]:
    span = range(first, first + max(length, 1))
    hits = []
    for view in layout.views:
        pages = layout.pages(view)
        for block, page in enumerate(pages):
            if span.start >= page.start and span.stop <= page.stop:
                whole = span == page and length > 0
                hits.append(Hit("page", whole, layout.names(view), (view.name, block)))
        if contiguous(view, pages) and length > 0:
            for low in range(len(pages)):
                for high in range(low + 1, len(pages)):
                    if span == range(pages[low].start, pages[high].stop):
                        hits.append(Hit("run", True, layout.names(view), (view.name, low)))
    for members, _ in layout.groups:
        views = [v for v in layout.views if v.name in members]
        all_pages = [layout.pages(v) for v in views]
        if length <= 0:
            continue
        whole_blocks = min(len(p) for p in all_pages)
        names = set().union(*(layout.names(v) for v in views))
        for low in range(whole_blocks):
            for high in range(low, whole_blocks):
                covered = {byte for p in all_pages for b in range(low, high + 1) for byte in p[b]}
                if len(covered) == len(span) and covered == set(span):
                    hits.append(Hit("blocks", True, names, (tuple(members), low)))
    return hits


def in_storages(layout: Layout, first: int, length: int, device: int | None) -> str | None:
    """None when the bytes lie in one storage; else the kind of the finding: in storages next to
    each other is outside the views, any byte in none (on the row's device) outside memory."""
    span = range(first, first + max(length, 1))
    mine = [s for s in layout.storages if device is None or s.device_id == device]
    for storage in mine:
        if storage.address <= span.start and span.stop <= storage.address + storage.nbytes:
            return None
    reached = span.start
    for storage in sorted(mine, key=lambda s: s.address):  # walk storages next to each other
        if storage.address <= reached < storage.address + storage.nbytes:
            reached = storage.address + storage.nbytes
    return "outside_view" if reached >= span.stop else "outside_memory"


def element_verdict(
    layout: Layout, first: int, length: int, device: int | None, layer: str | None, whole: bool
) -> tuple[str | None, list[Hit], list[Hit]]:
    if first + max(length, 1) > ADDRESS_LIMIT:
        return "outside_memory", [], []
    where = in_storages(layout, first, length, device)
    if where is not None:
        return where, [], []
    every = element_hits(layout, first, length)
    mine = [h for h in every if layer is None or layer in h.names]
    right = [h for h in mine if h.whole or (h.kind == "page" and not whole)]
    partial = [h for h in mine if h.kind == "page" and not h.whole]
    if right:
        return None, right, partial
    if layer is not None and any(h.whole or (h.kind == "page" and not whole) for h in every):
        return "wrong_layer", [], partial
    if any(h.kind == "page" and not h.whole for h in every):
        return "partial_page", [], partial
    return "outside_view", [], partial


def row_verdict(layout: Layout, row: tuple[int, ...], layer: str | None, whole: bool) -> str | None:
    first, length = row[0], row[1]
    device = row[2] if len(row) >= 3 else None
    if len(row) < 5:
        return element_verdict(layout, first, length, device, layer, whole)[0]
    stride, count = row[3], row[4]
    if count == 0:
        return None
    if first + (count - 1) * stride + max(length, 1) > ADDRESS_LIMIT:
        return "outside_memory"
    verdict, right, _ = element_verdict(layout, first, length, device, layer, whole)
    if count == 1 or in_storages(layout, first, length, device) is not None:
        return verdict
    elements = [first + k * stride for k in range(count)]
    # one view at its stride, a page (or slice) per block
    for view in layout.views:
        if layer is not None and layer not in layout.names(view):
            continue
        pages = layout.pages(view)
        for start in range(len(pages)):
            if start + count > len(pages):
                break
            inside = all(
                pages[start + k].start <= e and e + max(length, 1) <= pages[start + k].stop
                for k, e in enumerate(elements)
            )
            same_place = stride == view.block_stride_bytes or (
                contiguous(view, pages) and stride == view.page_bytes
            )
            if inside and same_place and (not whole or length == view.page_bytes):
                return None
    # abutting runs of whole pages, or whole blocks
    if stride == length and length > 0:
        kinds = {(h.kind, str(h.key[0])) for h in right if h.kind != "page"}
        for kind, owner in kinds:
            if all(
                any(h.kind == kind and str(h.key[0]) == owner for h in hits)
                for hits in (
                    [
                        h
                        for h in element_hits(layout, e, length)
                        if layer is None or layer in h.names
                    ]
                    for e in elements
                )
            ):
                return None
        # equal pieces that cut whole pages, all of them
        for view in layout.views:
            if layer is not None and layer not in layout.names(view):
                continue
            pages = layout.pages(view)
            if length >= view.page_bytes or view.page_bytes % length:
                continue
            covered = range(first, first + count * length)
            for low in range(len(pages)):
                for high in range(low, len(pages)):
                    if high > low and not contiguous(view, pages):
                        continue
                    if covered == range(pages[low].start, pages[high].stop):
                        return None
    return verdict if verdict is not None else "outside_view"


def oracle_writes(rows: list[tuple[int, ...]]) -> set[tuple[int, int]]:
    """Every pair of rows (or a row with itself) that writes some byte twice."""
    owner: dict[tuple[int | None, int], list[int]] = {}
    for index, row in enumerate(rows):
        count = row[4] if len(row) == 5 else 1
        stride = row[3] if len(row) == 5 else 0
        device = row[2] if len(row) >= 3 else None
        for k in range(count):
            start = row[0] + k * stride
            for byte in range(start, min(start + row[1], ADDRESS_LIMIT)):
                owner.setdefault((device, byte), []).append(index)
    pairs = set()
    for holders in owner.values():
        for i, a in enumerate(holders):
            for b in holders[i + 1 :]:
                pairs.add((min(a, b), max(a, b)))
    return pairs


# -- layouts and rows -----------------------------------------------------------------------------


@st.composite
def layouts(draw: st.DrawFn) -> Layout:
    storages: list[StorageSpan] = []
    views: list[ViewSpan] = []
    groups: list[tuple[list[str], int]] = []
    address = draw(st.sampled_from(BASES))
    for number in range(draw(st.integers(1, 2))):
        name = f"s{number}"
        kind = draw(st.sampled_from(["packed", "contiguous"]))
        offset = draw(st.integers(0, 3))
        if kind == "packed":
            pages = draw(st.lists(st.integers(1, 6), min_size=1, max_size=3))
            padding = draw(st.sampled_from([0, 0, 0, 1, 3]))
            stride = sum(pages) + padding
            blocks = draw(st.integers(1, 4))
            nbytes = offset + blocks * stride + draw(st.integers(0, 3))
            at = offset
            members = []
            for index, page in enumerate(pages):
                view = f"{name}.l{index}"
                extra = draw(st.sampled_from([0, 0, 0, 1]))  # a view past the end: clipped
                views.append(ViewSpan(view, name, at, page, stride, blocks + extra))
                members.append(view)
                at += page
            if not padding:
                groups.append((members, stride))
        else:
            at = offset
            for index in range(draw(st.integers(1, 3))):
                page = draw(st.integers(1, 6))
                blocks = draw(st.integers(1, 4))
                views.append(ViewSpan(f"{name}.l{index}", name, at, page, page, blocks))
                at += page * blocks + draw(st.sampled_from([0, 0, 1, 2]))
            nbytes = at + draw(st.integers(0, 3))
        device = draw(st.sampled_from(["cpu", "cpu", "cuda:1"]))
        address = min(address, ADDRESS_LIMIT - nbytes)
        storages.append(StorageSpan(name, address, nbytes, device))
        address += nbytes + draw(st.sampled_from([0, 0, 5]))  # next to it, or after a gap
        if address + 64 > ADDRESS_LIMIT:
            break
    if draw(st.booleans()):  # a layer of another group on the same bytes
        original = draw(st.sampled_from(views))
        views.append(original._replace(name="alias", layer="alias"))
        for members, _ in groups:
            if original.name in members:
                members.append("alias")
    addition = draw(st.sampled_from(["none", "none", "overlay", "broken"]))
    if addition == "overlay":  # another group's pages over the same bytes, of another size
        storage = draw(st.sampled_from(storages))
        page = draw(st.integers(2, 12))
        views.append(ViewSpan("overlay", storage.name, 0, page, page, storage.nbytes // page))
    elif addition == "broken":  # a view whose pages overlap each other (registered under warn)
        storage = draw(st.sampled_from(storages))
        views.append(ViewSpan("broken", storage.name, 0, 4, 2, 3))
    return Layout(storages, views, groups)


def clip(value: int) -> int:
    return max(0, min(TOP, value))


@st.composite
def rows_for(draw: st.DrawFn, layout: Layout, width: int) -> tuple[int, ...]:
    view = draw(st.sampled_from(layout.views))
    storage = layout.storage(view.storage)
    block = draw(st.integers(0, view.num_blocks))
    anchor = storage.address + view.byte_offset + block * view.block_stride_bytes
    first = clip(anchor + draw(st.sampled_from([0, 0, 0, -1, 1, view.page_bytes, -3])))
    page, stride = view.page_bytes, view.block_stride_bytes
    length = draw(
        st.sampled_from([page, page, 2 * page, stride, 2 * stride, 0, 1, page // 2 or 1])
        | st.integers(0, 3 * stride + 2)
        | st.just(TOP)
    )
    row: tuple[int, ...] = (first, clip(length))
    if width >= 3:
        device = StorageSpan("x", 0, 0, storage.device).device_id
        row += (draw(st.sampled_from([device, device, device, 1 - min(device, 1)])),)
    if width == 5:
        step = draw(st.sampled_from([stride, stride, page, length, max(1, page // 2), 0]))
        count = draw(st.sampled_from([0, 1, 2, view.num_blocks, view.num_blocks + 1]))
        if length and page % max(length, 1) == 0 and draw(st.booleans()):
            step, count = length, (page // length) * draw(st.integers(1, 3))
        row += (clip(step), count)
    return row


@st.composite
def cases(draw: st.DrawFn) -> tuple[Layout, list[tuple[int, ...]], list[str | None] | None]:
    layout = draw(layouts())
    width = draw(st.sampled_from([2, 3, 5]))
    rows = draw(st.lists(rows_for(layout, width), min_size=1, max_size=6))
    layers = None
    if draw(st.booleans()):
        names = sorted({v.layer or v.name for v in layout.views})
        layers = draw(st.lists(st.sampled_from([None, *names]), min_size=len(rows),
                               max_size=len(rows)))  # fmt: skip
    return layout, rows, layers


# -- the rules against the oracle -----------------------------------------------------------------

# twice the profile's examples: 400 with --slow (as CI runs), 100 in the quick run
SETTINGS = settings(
    max_examples=2 * settings().max_examples,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@SETTINGS
@given(cases(), st.booleans(), st.booleans())
def test_every_row_is_judged_as_the_byte_level_oracle_judges_it(
    case: tuple[Layout, list[tuple[int, ...]], list[str | None] | None],
    whole_pages: bool,
    vectorised: bool,
) -> None:
    layout, rows, layers = case
    found = _judge(
        _rows(rows),
        layout.memory()._index,
        layers=layers,
        whole_pages=whole_pages,
        vectorised=vectorised,
    )
    got = {finding.rows[0]: finding.kind for finding in found}
    expected = {}
    for index, row in enumerate(rows):
        kind = row_verdict(layout, row, None if layers is None else layers[index], whole_pages)
        if kind is not None:
            expected[index] = kind
    assert got == expected, (rows, layers, [f.message for f in found])
    for finding in found:
        assert finding.message.startswith(("descriptor", "element"))


@pytest.mark.slow
@SETTINGS
@given(cases())
def test_numpy_proves_no_row_that_the_oracle_refuses(
    case: tuple[Layout, list[tuple[int, ...]], list[str | None] | None],
) -> None:
    from safeview.transfer import _columns, _proven

    layout, rows, layers = case
    index = layout.memory()._index
    proven = _proven(_rows(rows), index, _columns(index, layers, len(rows)), True)
    for position, row in enumerate(rows):
        if proven[position]:
            layer = None if layers is None else layers[position]
            assert row_verdict(layout, row, layer, True) is None, row


@pytest.mark.slow
@SETTINGS
@given(cases())
def test_overlapping_writes_name_every_row_that_shares_a_byte(
    case: tuple[Layout, list[tuple[int, ...]], list[str | None] | None],
) -> None:
    _, rows, _ = case
    rows = [row for row in rows if (row[4] if len(row) == 5 else 1) * row[1] < 4096]
    if not rows:
        return
    found = _overlapping_writes(_rows(rows), None)
    truth = oracle_writes(rows)
    named = {pair for f in found for pair in [tuple(sorted(f.rows))]}
    assert named <= truth
    assert {i for pair in named for i in pair} == {i for pair in truth for i in pair}
    for finding in found:
        assert finding.kind == "overlapping_writes"
        assert finding.byte is not None
        for index in finding.rows:
            row = rows[index]
            count, stride = (row[4], row[3]) if len(row) == 5 else (1, 0)
            assert any(
                row[0] + k * stride <= finding.byte < row[0] + k * stride + row[1]
                for k in range(count)
            )


# -- the rules, one by one, on a packed and a contiguous layout -----------------------------------

BASE = 2**63 + 0x10000  # bit 63 set: judged like any address


def packed() -> MemoryMap:
    """Three MLA-like layers packed block-major: pages 32, 32, 32 in a 96-byte block, 4 blocks,
    then two contiguous layers of 48-byte pages in a second storage."""
    return MemoryMap(
        storages=(
            StorageSpan("kv", BASE, 4 * 96),
            StorageSpan("lb", BASE + 0x1000, 2 * 4 * 48),
        ),
        views=(
            ViewSpan("mla.0", "kv", 0, 32, 96, 4),
            ViewSpan("mla.1", "kv", 32, 32, 96, 4),
            ViewSpan("mla.2", "kv", 64, 32, 96, 4),
            ViewSpan("attn.0", "lb", 0, 48, 48, 4),
            ViewSpan("attn.1", "lb", 4 * 48, 48, 48, 4),
        ),
    )


def kinds(rows: Any, **options: Any) -> list[str]:
    return [f.kind for f in check_descriptors(rows, packed(), policy="warn", **options)]


def test_a_whole_packed_block_covering_three_layers_is_a_row_of_its_own() -> None:
    assert kinds([(BASE, 96, 0, 96, 4)]) == []
    assert kinds([(BASE + 96, 2 * 96)]) == []


def test_each_layers_page_of_a_packed_block_at_the_block_stride_is_right() -> None:
    assert kinds([(BASE + 32 * layer, 32, 0, 96, 4) for layer in range(3)]) == []


def test_strided_row_with_a_kernel_block_stride_is_outside_the_view() -> None:
    assert kinds([(BASE + 0x1000, 48, 0, 24, 8)]) == ["outside_view"]


def test_row_across_two_pages_names_both_layers() -> None:
    [finding] = check_descriptors([(BASE + 16, 32)], packed(), policy="warn")
    assert finding.kind == "outside_view"
    assert finding.views == ("mla.0", "mla.1")
    assert "view 'mla.0' (page 0) and view 'mla.1' (page 0)" in finding.message


def test_row_short_of_a_page_is_a_partial_page_unless_slices_are_allowed() -> None:
    [finding] = check_descriptors([(BASE + 0x1000, 19)], packed(), policy="warn")
    assert finding.kind == "partial_page"
    assert "19 of the 48 bytes of page 0 of view 'attn.0'" in finding.message
    assert kinds([(BASE + 0x1000 + 5, 19)], whole_pages=False) == []


def test_a_run_of_whole_pages_of_a_contiguous_layer_is_right_but_not_across_two_layers() -> None:
    assert kinds([(BASE + 0x1000, 4 * 48)]) == []
    assert kinds([(BASE + 0x1000 + 3 * 48, 2 * 48)]) == ["outside_view"]


def test_row_meant_for_one_layer_on_another_is_the_wrong_layer() -> None:
    [finding] = check_descriptors(
        [(BASE + 32, 32, 0, 96, 4)], packed(), layers=["mla.0"], policy="warn"
    )
    assert finding.kind == "wrong_layer"
    assert finding.layer == "mla.0"
    assert finding.views == ("mla.1",)
    assert "meant for layer 'mla.0' but covers page 0 of view 'mla.1'" in finding.message


def test_equal_pieces_that_cut_every_page_are_whole_pages() -> None:
    # vLLM's local rows for a peer whose blocks are half as long
    assert kinds([(BASE + 0x1000, 24, 0, 24, 8)]) == []
    assert kinds([(BASE + 0x1000, 24, 0, 24, 7)]) == ["partial_page"]


def test_strided_row_past_the_last_block_of_its_view_is_refused() -> None:
    [finding] = check_descriptors([(BASE, 32, 0, 96, 5)], packed(), policy="warn")
    assert finding.kind == "outside_view"
    assert "need blocks 0..4 of view 'mla.0', which has 4 (1 too many)" in finding.message


def test_row_past_the_storage_and_row_past_the_address_space_are_outside_memory() -> None:
    [past] = check_descriptors([(BASE + 3 * 96, 97)], packed(), policy="warn")
    assert past.kind == "outside_memory"
    assert "(1 bytes past its end)" in past.message
    [wraps] = check_descriptors([(TOP - 7, 16)], packed(), policy="warn")
    assert wraps.kind == "outside_memory"
    assert "8 bytes past the last address" in wraps.message
    [huge] = check_descriptors([(BASE, 8, 0, 2**62, 8)], packed(), policy="warn")
    assert huge.kind == "outside_memory"
    assert huge.element == 2  # BASE + 2 * 2**62 passes 2**64
    assert "meant for layer" not in past.message  # no layer was named for the row
    # a row meant for a layer says which, past the storage or across a gap
    [named] = check_descriptors([(BASE + 3 * 96, 97)], packed(), layers=["mla.2"], policy="warn")
    assert named.layer == "mla.2"
    assert "(address 0x" in named.message
    assert "meant for layer 'mla.2', needs bytes" in named.message
    [gap] = check_descriptors([(BASE + 32, 64)], packed(), layers=["mla.0"], policy="warn")
    assert gap.kind == "outside_view"
    assert "meant for layer 'mla.0'," in gap.message


def test_a_row_on_another_device_is_outside_memory() -> None:
    [finding] = check_descriptors([(BASE, 32, 1)], packed(), policy="warn")
    assert finding.kind == "outside_memory"
    assert "names device 1, but its bytes lie in storage 'kv' on cpu" in finding.message


def test_overlapping_write_rows_are_refused_only_when_writes_are_checked() -> None:
    rows = [(BASE, 32), (BASE + 16, 16)]
    assert kinds(rows, whole_pages=False) == []
    [finding] = check_descriptors(rows, packed(), writes=True, whole_pages=False, policy="warn")
    assert finding.kind == "overlapping_writes"
    assert finding.rows == (0, 1)
    assert finding.byte == BASE + 16
    assert finding.views == ("mla.0",)


def test_a_strided_write_row_whose_elements_overlap_writes_bytes_twice() -> None:
    [finding] = check_descriptors(
        [(BASE + 0x1000, 48, 0, 24, 2)], packed(), writes=True, whole_pages=False, policy="warn"
    )[-1:]
    assert finding.kind == "overlapping_writes"
    assert finding.rows == (0, 0)
    assert finding.byte == BASE + 0x1000 + 24
    assert "writes byte" in finding.message
    assert "twice: its stride of 24 bytes is shorter than its 48 bytes" in finding.message


# -- inputs ---------------------------------------------------------------------------------------


def test_uint64_int64_and_python_int_rows_with_bit_63_give_the_same_findings() -> None:
    rows = [(BASE, 32, 0, 96, 4), (BASE + 16, 32, 0, 96, 4), (TOP, 2, 0, 1, 1)]
    as_list = check_descriptors(rows, packed(), policy="warn")
    unsigned = check_descriptors(np.array(rows, dtype=np.uint64), packed(), policy="warn")
    signed = check_descriptors(
        np.array(rows, dtype=np.uint64).view(np.int64), packed(), policy="warn"
    )
    assert [f.kind for f in as_list] == ["outside_view", "outside_memory"]
    assert [f.message for f in unsigned] == [f.message for f in as_list]
    assert [f.message for f in signed] == [f.message for f in as_list]


@pytest.mark.parametrize(
    ("rows", "words"),
    [
        ([(1, 2, 3, 4)], "got rows of 4 numbers"),
        ([(1, 2), (1, 2, 3)], "one width"),
        ([(-1, 2)], "descriptor 0 holds -1"),
        ([(2**64, 2)], "descriptor 0 holds 18446744073709551616"),
        ([(1.5, 2)], "descriptor 0 holds 1.5"),
        (np.zeros((2, 3), dtype=np.float64), "must hold integers"),
        (np.zeros(3, dtype=np.uint64), "must be 2-d"),
        ("rows", "got str"),
    ],
)
def test_rows_that_are_not_64_bit_numbers_are_an_argument_error(rows: Any, words: str) -> None:
    with pytest.raises(ArgumentError, match=words):
        check_descriptors(rows, packed())


def test_layers_must_have_one_known_name_per_row() -> None:
    with pytest.raises(ArgumentError, match="layers has 1 names for 2 descriptors"):
        check_descriptors([(BASE, 32), (BASE, 32)], packed(), layers=["mla.0"])
    with pytest.raises(ArgumentError, match=r"layers\[0\] is 'mla.9', which is no layer"):
        check_descriptors([(BASE, 32)], packed(), layers=["mla.9"])


def test_an_empty_list_has_no_findings() -> None:
    assert check_descriptors([], packed()) == []
    assert check_descriptors(np.zeros((0, 5), dtype=np.uint64), packed()) == []


# -- policy ---------------------------------------------------------------------------------------


def test_strict_raises_an_address_error_with_its_numbers_and_layers() -> None:
    with pytest.raises(AddressError) as caught:
        check_descriptors([(BASE, 96), (BASE + 16, 32)], packed(), policy="strict")
    error = caught.value
    assert isinstance(error, SafeViewError)
    assert error.kind == "outside_view"
    assert error.row == 1
    assert error.address == BASE + 16
    assert error.length == 32
    assert error.device is None
    assert error.layers == ("mla.0", "mla.1")
    assert error.finding.kind == "outside_view"
    assert str(error).endswith("(by check_descriptors) [policy strict]")
    assert hex(BASE + 16) in str(error)


def test_warn_emits_one_address_violation_per_finding_and_returns_them() -> None:
    with capture_events() as events:
        found = check_descriptors([(BASE + 16, 32), (BASE + 0x1000, 19)], packed(), policy="warn")
    violations = [e for e in events if e["event"] == "address_violation"]
    assert [e["kind"] for e in violations] == [f.kind for f in found]
    assert [e["kind"] for e in violations] == ["outside_view", "partial_page"]
    assert violations[0]["level"] == "warning"
    assert violations[0]["address"] == BASE + 16
    assert violations[0]["rows"] == [0]
    assert violations[0]["layers"] == ["mla.0", "mla.1"]
    assert violations[0]["source"] == "check_descriptors"
    assert violations[0]["message"] == found[0].message


def test_off_checks_nothing() -> None:
    with capture_events() as events:
        assert check_descriptors([(0, 1)], packed(), policy="off") == []
        assert check_descriptors("not even rows", packed(), policy="off") == []
    assert events == []


def test_policy_scope_decides_when_no_policy_is_given() -> None:
    with safeview.policy_scope("warn"):
        assert kinds([(BASE + 16, 32)]) == ["outside_view"]
        assert [f.kind for f in check_descriptors([(BASE + 16, 32)], packed())] == ["outside_view"]


def test_descriptor_kinds_are_kinds_and_have_json() -> None:
    assert set(DESCRIPTOR_KINDS) <= set(KINDS)
    [finding] = check_descriptors([(BASE + 16, 32, 0, 96, 2)], packed(), policy="warn")
    data = finding.to_json()
    assert data["kind"] == "outside_view"
    assert data["address"] == BASE + 16
    assert data["stride_bytes"] == 96
    assert data["count"] == 2
    assert data["rows"] == [0]


# -- registrations --------------------------------------------------------------------------------


def mla_registration() -> Any:
    """vLLM's packed MLA layout (BLHNC): three layers' 576-byte pages in each 1,728-byte block."""
    raw = torch.zeros(10 * 1728, dtype=torch.int8)
    caches = {
        f"layers.{layer}": torch.as_strided(raw, (10, 576), (1728, 1), layer * 576)
        for layer in range(3)
    }
    specs = dict.fromkeys(caches, 576)
    return raw, block_views(caches, specs, num_blocks=10, packed=caches)


def test_a_registration_maps_its_storage_address_and_its_views() -> None:
    raw, registration = mla_registration()
    mapped = memory_map(registration)
    assert mapped.storages == (StorageSpan("storage0", raw.data_ptr(), 17280, "cpu"),)
    assert [v.name for v in mapped.views] == ["layers.0", "layers.1", "layers.2"]
    assert mapped.views[1] == ViewSpan("layers.1", "storage0", 576, 576, 1728, 10, "layers.1")
    assert memory_map(registration) is mapped  # made once while the registration lives


def test_vllm_packed_mla_rows_pass_and_a_layer_with_another_block_length_does_not() -> None:
    raw, registration = mla_registration()
    base = raw.data_ptr()
    whole_blocks = np.array([[base, 1728, 0, 1728, 10]], dtype=np.uint64)
    assert check_descriptors(whole_blocks, registration, policy="strict") == []
    per_layer = np.array([[base + n * 576, 576, 0, 1728, 10] for n in range(3)], np.uint64)
    assert check_descriptors(per_layer, registration, policy="strict") == []
    short = per_layer.copy()
    short[1, 1] = 320  # another layer's block length (vLLM issue 57661)
    with pytest.raises(AddressError, match=r"320 of the 576 bytes of page 0 of view 'layers\.1'"):
        check_descriptors(short, registration, policy="strict")


def test_a_report_needs_addresses_and_a_meta_registration_has_none() -> None:
    kv = torch.zeros(4 * 64, dtype=torch.int8)
    report = safeview.kv.check_tensors({"x": kv.view(4, 64)})
    with pytest.raises(ArgumentError, match="pass addresses"):
        memory_map(report)
    mapped = memory_map(report, addresses={"storage0": kv.data_ptr()})
    assert mapped.views == (ViewSpan("x", "storage0", 0, 64, 64, 4, "x"),)
    assert check_descriptors([(kv.data_ptr() + 64, 128)], mapped) == []
    meta = torch.empty(256, dtype=torch.int8, device="meta")
    on_meta = block_views({"x": meta.view(4, 64)}, {"x": 64}, num_blocks=4)
    with pytest.raises(ArgumentError, match="no storage with an address"):
        memory_map(on_meta)


def test_split_kv_views_belong_to_their_layer() -> None:
    k = torch.zeros(4, 32, dtype=torch.int8)
    v = torch.zeros(4, 32, dtype=torch.int8)
    registration = block_views({"x": [k, v]}, {"x": 64}, num_blocks=4)
    rows = [(k.data_ptr() + 32, 32), (v.data_ptr(), 32)]
    assert check_descriptors(rows, registration, layers=["x", "x[1]"]) == []
    with pytest.raises(AddressError, match="meant for layer 'x\\[1\\]'"):
        check_descriptors(rows[:1], registration, layers=["x[1]"])


def test_events_reach_a_host_logger_as_warnings(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="safeview"):
        check_descriptors([(BASE + 16, 32)], packed(), policy="warn")
    [record] = [r for r in caplog.records if "address_violation" in r.getMessage()]
    assert record.levelno == logging.WARNING
    assert record.pathname == __file__


# -- arguments and order ---------------------------------------------------------------------------


#: the constructors, called with what their types refuse
ANY_MAP: Any = MemoryMap
ANY_MEMORY_MAP: Any = memory_map


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: ANY_MAP(None, None), "MemoryMap storages must be a sequence of StorageSpan"),
        (
            lambda: ANY_MAP(
                [{"name": "kv", "address": 4096, "nbytes": 64}],
                [],
            ),
            "MemoryMap storages[0] must be a StorageSpan",
        ),
        (
            lambda: ANY_MAP((StorageSpan("kv", 4096, 64),), [{"name": "x"}]),
            "MemoryMap views[0] must be a ViewSpan",
        ),
        (
            lambda: ANY_MEMORY_MAP(
                _report(),
                addresses={"storage0": "0x1000"},
            ),
            "addresses['storage0'] must be an integer address; got '0x1000'",
        ),
        (
            lambda: ANY_MEMORY_MAP(
                _report(), addresses={"storage0": 4096}, devices={"storage0": 0}
            ),
            "devices['storage0'] must be a device name",
        ),
    ],
    ids=["none", "storages_of_dicts", "views_of_dicts", "address_string", "device_number"],
)
def test_a_memory_map_of_the_wrong_kind_is_an_argument_error_naming_the_argument(
    make: Any, words: str
) -> None:
    with pytest.raises(ArgumentError) as raised:
        make()
    assert words in str(raised.value)


def _report() -> Any:
    from safeview.kv import check_tensors

    kv = torch.zeros(64, dtype=torch.int8)
    return check_tensors({"x": kv.view(4, 16)})


def test_a_memory_map_takes_plain_tuples_of_the_spans_fields() -> None:
    made = ANY_MAP([("kv", 0x1000, 64)], [("x", "kv", 0, 16, 16, 4)])
    assert made.storages == (StorageSpan("kv", 0x1000, 64),)
    assert made.views == (ViewSpan("x", "kv", 0, 16, 16, 4),)


def test_whole_blocks_of_a_packed_group_pass_whatever_the_order_of_the_views() -> None:
    # three layers packed block-major (576-byte pages in 1,728-byte blocks) and a layer of
    # another group over the same bytes from the same base (its own page, the same period)
    base = 0x7F00_0000_0000
    packed = [ViewSpan(f"layers.{n}", "kv", n * 576, 576, 1728, 10) for n in range(3)]
    other = [ViewSpan("state.0", "kv", 0, 1024, 1728, 10)]
    for views in (other + packed, packed + other, packed[::-1] + other):
        kv = MemoryMap((StorageSpan("kv", base, 10 * 1728),), tuple(views))
        assert check_descriptors([(base, 1728, 0, 1728, 10)], kv) == [], [v.name for v in views]
        assert check_descriptors([(base + 1728 * 4, 1728 * 2, 0)] * 9, kv) == []  # vectorised
        assert check_descriptors([(base, 1024, 0, 1728, 10)], kv) == []  # the other layer


# -- the example ---------------------------------------------------------------------------------


def test_the_transfer_example_runs_against_both_engines_and_says_what_the_guard_did() -> None:
    import importlib.util
    import os

    engines = [importlib.util.find_spec(name) is not None for name in ("nixl", "mooncake")]
    if not all(engines) and os.environ.get("SAFEVIEW_REQUIRE_ENGINES") != "1":
        pytest.skip(
            f"NIXL or Mooncake is not installed here ({ENGINES_HINT}); .ci/run installs both"
        )
    example = Path(__file__).resolve().parent.parent / "examples" / "transfer_guard.py"
    done = subprocess.run(
        [sys.executable, str(example)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]  # os._exit(0): no crash at exit
    said = [line for line in done.stdout.splitlines() if line.startswith(("NIXL,", "Mooncake,"))]
    assert said == [
        "NIXL, whole pages: DONE",
        "NIXL, strict: partial_page - ('layers.1',)",
        "NIXL, warn: moved anyway: DONE",
        "NIXL, rows in the wrong order: wrong_layer - meant for 'layers.0'",
        "Mooncake, one whole page: status 0",
        "Mooncake, strict: outside_view - ('layers.0',)",
    ]
    assert done.stdout.count("address_violation") == 4  # each refusal or warning, as an event


def test_without_numpy_the_hint_says_what_works_from_a_checkout() -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "sys.modules['numpy'] = None  # as if numpy were not installed\n"
        "from safeview.transfer import MemoryMap, StorageSpan, ViewSpan, check_descriptors\n"
        "m = MemoryMap((StorageSpan('kv', 4096, 64),), (ViewSpan('x', 'kv', 0, 16, 16, 4),))\n"
        "try:\n"
        "    check_descriptors([(4096, 16)], m)\n"
        "except ImportError as error:\n"
        "    print(error)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert 'pip install -e ".[transfer]"' in done.stdout
    assert "'safeview[transfer]'" not in done.stdout


@pytest.mark.slow
def test_the_transfer_example_says_what_it_skipped_and_the_pinned_install_lines() -> None:
    # the engines hidden as on a machine without them (None in sys.modules: not installed)
    example = Path(__file__).parent.parent / "examples" / "transfer_guard.py"
    hide = (
        "import runpy, sys; sys.modules['nixl'] = sys.modules['mooncake'] = None; "
        f"runpy.run_path({str(example)!r}, run_name='__main__')"
    )
    done = subprocess.run([sys.executable, "-c", hide], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert "NIXL: SKIPPED, not installed" in lines
    assert "Mooncake: SKIPPED, not installed" in lines
    assert "Skipped 2 of 2 engines; to run them too:" in lines
    said = [line.strip() for line in lines]
    for line in (
        "pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1",
        "sudo apt-get install libibverbs1",
        "pip install mooncake-transfer-engine-non-cuda==0.3.13.post1",
    ):
        assert line in said
