"""Exact aliasing checks between views of one storage. Plain integers, no torch.

Two views overlap when they share at least one byte. Spans are not enough: the interleaved pages
of a packed block layout span almost the whole storage each and share nothing. ``find_overlaps``
splits every view into runs of equally spaced blocks and answers exactly:

- views with one block stride (a packed group) are rectangles in (block index, byte within the
  block) coordinates, found by one sweep over the byte within the block, in O(L log L);
- contiguous views, and views of different strides, meet through a sweep over their spans, and
  only pairs whose spans intersect get the exact arithmetic test (``_arith.shared_byte``).
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import heapq
import threading
from collections import defaultdict
from collections.abc import Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from safeview import _arith
from safeview._arith import Blocks
from safeview.errors import ArgumentError
from safeview.spec import BlockLayout, Layout

__all__ = ["Overlap", "find_overlaps", "overlaps_among", "pieces_of"]


@dataclass(frozen=True, slots=True)
class Overlap:
    """Views ``first`` and ``second`` (in the order they were given) both touch byte ``byte``.
    ``group`` is their aliasing group, ``None`` when no groups were given."""

    first: str
    second: str
    byte: int
    group: Hashable | None = None

    def message(self) -> str:
        group = f" (group {self.group!r})" if self.group is not None else ""
        return f"views {self.first!r} and {self.second!r}{group} both use byte {self.byte}"


def pieces_of(layout: Layout) -> list[Blocks]:
    """The bytes a layout touches, as runs of equally spaced blocks."""
    if isinstance(layout, BlockLayout):  # already one run of blocks
        if not layout.num_blocks:
            return []
        return [
            Blocks(
                layout.byte_offset,
                layout.num_blocks,
                layout.block_stride_bytes,
                layout.page_bytes,
            )
        ]
    return _arith.blocks(layout.byte_offset, layout.shape, layout.strides, layout.itemsize)


def _normalised(piece: Blocks) -> Blocks:
    """Back-to-back blocks are one contiguous run (``number == 1``)."""
    if piece.number == 1 or piece.stride == piece.run:
        run = piece.run * piece.number
        return Blocks(piece.offset, 1, run, run)
    return piece


_gc_lock = threading.Lock()
_gc_depth = 0
_gc_restore = False


@contextlib.contextmanager
def _without_cyclic_gc() -> Iterator[None]:
    """The sweeps allocate many small, cycle-free tuples; each allocation burst would make the
    cyclic collector rescan the caller's whole heap (millions of objects in an inference server),
    turning a linear sweep quadratic. Pause it, and restore it as found, also across threads."""
    global _gc_depth, _gc_restore
    with _gc_lock:
        if _gc_depth == 0:
            _gc_restore = gc.isenabled()
            gc.disable()
        _gc_depth += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_depth -= 1
            if _gc_depth == 0 and _gc_restore:
                gc.enable()


# A rectangle in (block index, byte within the block) coordinates of one block stride:
# (first residue, end residue, first block, end block, view index).
_Rect = tuple[int, int, int, int, int]


def _rectangles(piece: Blocks, view: int) -> list[_Rect]:
    block, residue = divmod(piece.offset, piece.stride)
    end = residue + piece.run
    rects = [(residue, min(end, piece.stride), block, block + piece.number, view)]
    if end > piece.stride:  # each page spills over into the next block period
        rects.append((0, end - piece.stride, block + 1, block + 1 + piece.number, view))
    return rects


def _record(found: dict[tuple[int, int], int], a: int, b: int, byte: int) -> None:
    key = (a, b) if a < b else (b, a)
    known = found.get(key)
    if known is None or byte < known:
        found[key] = byte


def _sweep_one_stride(
    rects: list[_Rect], stride: int, found: dict[tuple[int, int], int], *, exhaustive: bool
) -> bool:
    """Report every pair of rectangles from different views that intersect. Returns whether any
    did. The fast pass stops scanning at the first active block range that misses; that is exact
    while no two active rectangles intersect, i.e. until the first overlap, after which the caller
    runs the exhaustive pass."""
    rects = sorted(rects)
    if not exhaustive and len({(rect[2], rect[3]) for rect in rects}) == 1:
        # All on the same blocks (a packed group): pages meet iff their ranges within the block
        # do, so one pass over the sorted ranges settles the clean case.
        reach = 0
        for r0, r1, *_ in rects:
            if r0 < reach:
                break
            reach = r1
        else:
            return False
    starts: list[int] = []  # first block of each active rectangle, sorted
    active: list[_Rect] = []  # in the same order
    expiry: list[tuple[int, int, int, int, int]] = []  # heap of (end residue, first block, ...)
    any_found = False
    for rect in rects:
        r0, _, b0, b1, view = rect
        while expiry and expiry[0][0] <= r0:
            gone = heapq.heappop(expiry)
            at = bisect.bisect_left(active, (gone[1], gone[2], gone[3], gone[4], gone[0]))
            del active[at]
            del starts[at]
        position = bisect.bisect_left(starts, b1)
        candidates = range(position - 1, -1, -1)
        for index in candidates:
            o_b0, o_b1, o_r0, o_view, _ = active[index]
            if o_b1 <= b0:
                if exhaustive:
                    continue
                break
            if o_view != view:
                any_found = True
                byte = max(b0, o_b0) * stride + max(r0, o_r0)
                _record(found, view, o_view, byte)
        entry = (b0, b1, r0, view, rect[1])
        at = bisect.bisect_left(active, entry)
        active.insert(at, entry)
        starts.insert(at, b0)
        heapq.heappush(expiry, (rect[1], b0, b1, r0, view))
    return any_found


def _sweep_spans(pieces: list[tuple[Blocks, int]], found: dict[tuple[int, int], int]) -> None:
    """Pairs of pieces whose spans intersect and that the stride sweep does not cover: contiguous
    runs against everything, and runs of different block strides against each other."""
    ordered = sorted(pieces, key=lambda item: (item[0].offset, item[1]))
    # Active pieces per class: 0 for contiguous runs, else the block stride.
    active: dict[int, list[tuple[int, int, Blocks, int]]] = defaultdict(list)
    serial = 0
    for piece, view in ordered:
        kind = 0 if piece.number == 1 else piece.stride
        for other_kind, heap in active.items():
            if other_kind == kind and kind != 0:
                continue
            while heap and heap[0][0] <= piece.offset:
                heapq.heappop(heap)
            for _, _, other, other_view in heap:
                if other_view == view:
                    continue
                byte = _arith.shared_byte(piece, other)
                if byte is not None:
                    _record(found, view, other_view, byte)
        serial += 1
        heapq.heappush(active[kind], (piece.end, serial, piece, view))


def _overlaps_in_group(pieces: list[tuple[Blocks, int]]) -> dict[tuple[int, int], int]:
    found: dict[tuple[int, int], int] = {}
    by_stride: dict[int, list[_Rect]] = defaultdict(list)
    for piece, view in pieces:
        if piece.number > 1:
            by_stride[piece.stride].extend(_rectangles(piece, view))
    for stride, rects in by_stride.items():
        if _sweep_one_stride(rects, stride, found, exhaustive=False):
            _sweep_one_stride(rects, stride, found, exhaustive=True)
    if len(by_stride) > 1 or any(piece.number == 1 for piece, _ in pieces):
        # contiguous runs, or runs of different strides: only the span sweep can pair them
        _sweep_spans(pieces, found)
    return found


def find_overlaps(
    layouts: Mapping[str, Layout], *, groups: Mapping[str, Hashable | None] | None = None
) -> list[Overlap]:
    """Every pair of views that share at least one byte, each with one shared byte.

    ``layouts`` maps view names to layouts over one storage. ``groups`` maps view names to their
    aliasing groups: views of two different groups may share bytes (in vLLM's hybrid allocator a
    block id belongs to one KV-cache group at a time) and are not reported. A view without a group
    (absent from ``groups``, or mapped to ``None``) may share a byte with no other view, and
    without ``groups`` no two views may. The result is ordered by the positions of the two views
    in ``layouts``; each witness is the lowest shared byte found for that pair.

    >>> from safeview import packed_layouts
    >>> find_overlaps(packed_layouts({"k": 64, "v": 64}, num_blocks=100))
    []
    """
    with _without_cyclic_gc():
        named = {}
        for name, layout in layouts.items():
            try:
                named[name] = pieces_of(layout)
            except ValueError as error:
                raise ArgumentError(f"view {name!r}: {error}") from None
        return overlaps_among(named, groups=groups)


def overlaps_among(
    pieces: Mapping[str, Sequence[Blocks]], *, groups: Mapping[str, Hashable | None] | None = None
) -> list[Overlap]:
    """``find_overlaps`` on views already split into ``Blocks`` (see ``pieces_of``)."""
    with _without_cyclic_gc():
        return _overlaps_among(pieces, groups)


def _overlaps_among(
    pieces: Mapping[str, Sequence[Blocks]], groups: Mapping[str, Hashable | None] | None
) -> list[Overlap]:
    names = list(pieces)
    group_of = [None if groups is None else groups.get(name) for name in names]
    found: dict[tuple[int, int], int] = {}
    if any(group is None for group in group_of) or len(set(group_of)) == 1:
        # One sweep over everything, keeping the pairs that may not share.
        every = [
            (_normalised(piece), index)
            for index, name in enumerate(names)
            for piece in pieces[name]
        ]
        for (a, b), byte in _overlaps_in_group(every).items():
            if group_of[a] is None or group_of[b] is None or group_of[a] == group_of[b]:
                found[(a, b)] = byte
    else:
        members: dict[Hashable, list[tuple[Blocks, int]]] = defaultdict(list)
        for index, name in enumerate(names):
            members[group_of[index]].extend((_normalised(p), index) for p in pieces[name])
        for member_pieces in members.values():
            found.update(_overlaps_in_group(member_pieces))
    shared = group_of if groups is not None else [None] * len(names)
    return [
        Overlap(names[a], names[b], byte, shared[a] if shared[a] == shared[b] else None)
        for (a, b), byte in sorted(found.items())
    ]
