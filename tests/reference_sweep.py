"""safeview 0.2.0's pairwise sweep, frozen: the oracle the faster checker is compared with.

A copy of ``safeview/overlap.py`` as it was before the quick exits and the per-group sweeps
(issue 14), so that ``tests/test_check.py`` can show that the checker finds exactly the pairs, and
the bytes, that it found then. Not used by the library; do not edit it to follow the library.
"""

from __future__ import annotations

import bisect
import heapq
from collections import defaultdict
from collections.abc import Hashable, Mapping, Sequence

from safeview import _arith
from safeview._arith import Blocks
from safeview.check import StorageRecord, ViewRecord, bounds, pieces, self_overlap
from safeview.errors import ArgumentError
from safeview.findings import Finding


def _normalised(piece: Blocks) -> Blocks:
    """Back-to-back blocks are one contiguous run (``number == 1``)."""
    if piece.number == 1 or piece.stride == piece.run:
        run = piece.run * piece.number
        return Blocks(piece.offset, 1, run, run)
    return piece


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


MAX_EXACT_TESTS = 5_000_000
"""How many exact pair tests the span sweep may run before it stops with an ``ArgumentError``
(a few seconds on a small machine): only views of block strides that do not divide one another,
interleaved over the same bytes, come near it."""


def _sweep_spans(pieces: list[tuple[Blocks, int]], found: dict[tuple[int, int], int]) -> None:
    """Pairs of pieces whose spans intersect and that the stride sweep does not cover: contiguous
    runs against everything, and runs of different block strides against each other. Stops with
    an ``ArgumentError`` after ``MAX_EXACT_TESTS`` exact tests instead of running on silently."""
    ordered = sorted(pieces, key=lambda item: (item[0].offset, item[1]))
    tests = 0
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
                tests += 1
                if tests > MAX_EXACT_TESTS:
                    raise _TooMuchWorkError(view, other_view, piece.stride, other.stride)
                byte = _arith.shared_byte(piece, other)
                if byte is not None:
                    _record(found, view, other_view, byte)
        serial += 1
        heapq.heappush(active[kind], (piece.end, serial, piece, view))


class _TooMuchWorkError(Exception):
    """The span sweep's limit was reached; the caller names the views."""

    def __init__(self, first: int, second: int, first_stride: int, second_stride: int) -> None:
        super().__init__()
        self.views = (first, second)
        self.strides = (first_stride, second_stride)


MAX_FOLD_RATIO = 64
"""The largest ratio between the largest block stride and a smaller one that divides it for
which views are folded into one period and swept together."""


def _folded(pieces: list[tuple[Blocks, int]]) -> tuple[int, list[_Rect]] | None:
    """Every piece as rectangles of one block stride, the largest, when every block stride
    divides it: a run of stride ``s`` is ``L / s`` interleaved runs of stride ``L``, and a
    contiguous run is a head, whole periods and a tail. ``None`` when the strides are not so
    related (or the pieces would grow more than ``MAX_FOLD_RATIO`` times). Rectangles are made
    straight from the numbers: a layout of 100,000 views makes no object it does not keep."""
    strides = {piece.stride for piece, _ in pieces if piece.number > 1}
    if len(strides) < 2:
        return None
    period = max(strides)
    if any(period % stride or period // stride > MAX_FOLD_RATIO for stride in strides):
        return None
    rects: list[_Rect] = []
    add = rects.append

    def run_of(offset: int, number: int, run: int, view: int) -> None:
        # ``number`` runs of ``run <= period`` bytes, one per period from ``offset`` on
        block, residue = divmod(offset, period)
        end = residue + run
        if end <= period:
            add((residue, end, block, block + number, view))
        else:  # each run spills over into the next period
            add((residue, period, block, block + number, view))
            add((0, end - period, block + 1, block + 1 + number, view))

    for (offset, number, stride, run), view in pieces:
        if number > 1:
            ratio = period // stride
            for phase in range(min(ratio, number)):
                run_of(offset + phase * stride, (number - phase + ratio - 1) // ratio, run, view)
            continue
        # a contiguous run: what fits in its first period, whole periods, then the rest
        head = min(run, period - offset % period)
        run_of(offset, 1, head, view)
        whole, tail = divmod(run - head, period)
        if whole:
            run_of(offset + head, whole, period, view)
        if tail:
            run_of(offset + head + whole * period, 1, tail, view)
    return period, rects


def _overlaps_in_group(pieces: list[tuple[Blocks, int]]) -> dict[tuple[int, int], int]:
    found: dict[tuple[int, int], int] = {}
    folded = _folded(pieces)
    if folded is not None:
        # strides that divide one another: one sweep over one period, near-linear
        period, rects = folded
        if _sweep_one_stride(rects, period, found, exhaustive=False):
            _sweep_one_stride(rects, period, found, exhaustive=True)
        return found
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


def packed_disjoint(
    offsets: Sequence[int], numbers: Sequence[int], strides: Sequence[int], runs: Sequence[int]
) -> bool:
    """A quick, exact test for the common case, on columns of integers (no object per view):
    ``True`` when the runs ``(offsets[i], numbers[i], strides[i], runs[i])`` all have one block
    stride and one number of blocks, start in the same block, do not spill over into the next
    block period, and their ranges within the block are disjoint (a packed group laid out
    correctly). ``False`` means only that the full sweep must decide.
    """
    stride, number = strides[0], numbers[0]
    if stride <= 0 or any(s != stride for s in strides) or any(n != number for n in numbers):
        return False
    first_block = offsets[0] // stride
    residues = [offset - first_block * stride for offset in offsets]
    ends = [residue + run for residue, run in zip(residues, runs)]
    if min(residues) < 0 or max(ends) > stride:
        return False
    reach = 0
    for position in sorted(range(len(residues)), key=residues.__getitem__):
        if residues[position] < reach:
            return False
        reach = ends[position]
    return True


def overlapping_pairs(
    pieces: Sequence[Sequence[Blocks]],
    group_of: Sequence[Hashable | None],
    names: Sequence[str] | None = None,
) -> list[tuple[tuple[int, int], int]]:
    """Every pair ``(a, b)``, ``a < b``, of views that share a byte and may not, with the lowest
    shared byte found, sorted by ``(a, b)``.

    ``pieces[i]`` are the runs of view ``i`` (in one address space); ``group_of[i]`` its group;
    ``names[i]`` its name, for the error below. Views of two different groups may share bytes; a
    view without a group (``None``) may share with none.

    Cost: O(P log P) in the number of runs P when all block strides divide the largest (one
    stride, or kernel blocks beside manager blocks, a packed whole-block view beside its
    layers); otherwise pairs whose spans meet are tested one by one, which is quadratic when many
    such views interleave over the same bytes, and past ``MAX_EXACT_TESTS`` tests it stops with
    an ``ArgumentError`` naming two of them.
    """
    try:
        return _pairs(pieces, group_of)
    except _TooMuchWorkError as stop:
        raise ArgumentError(f"too much work: views {stop.views}") from None


def _pairs(
    pieces: Sequence[Sequence[Blocks]], group_of: Sequence[Hashable | None]
) -> list[tuple[tuple[int, int], int]]:
    found: dict[tuple[int, int], int] = {}
    if any(group is None for group in group_of) or len(set(group_of)) == 1:
        # One sweep over everything, keeping the pairs that may not share.
        every = [
            (_normalised(piece), index)
            for index, view_pieces in enumerate(pieces)
            for piece in view_pieces
        ]
        for (a, b), byte in _overlaps_in_group(every).items():
            if group_of[a] is None or group_of[b] is None or group_of[a] == group_of[b]:
                found[(a, b)] = byte
    else:
        members: dict[Hashable, list[tuple[Blocks, int]]] = defaultdict(list)
        for index, view_pieces in enumerate(pieces):
            members[group_of[index]].extend((_normalised(p), index) for p in view_pieces)
        for member_pieces in members.values():
            found.update(_overlaps_in_group(member_pieces))
    return sorted(found.items())


def reference_findings(
    storages: Mapping[str, int | StorageRecord], views: Sequence[ViewRecord]
) -> list[Finding]:
    """0.2.0's ``check_views(storages, views).findings``: each view's bounds and self-overlap in
    view order, then the overlapping pairs of each memory, memories in order of first sight."""
    records = {
        name: value if isinstance(value, StorageRecord) else StorageRecord(value)
        for name, value in storages.items()
    }
    findings: list[Finding] = []
    memories: dict[Hashable, list[int]] = {}
    for index, view in enumerate(views):
        storage = records[view.storage]
        end = view.extent_bytes
        if end > storage.nbytes or view.region is not None:
            findings += bounds(
                view.name,
                storage=view.storage,
                byte_offset=view.byte_offset,
                extent_bytes=end,
                storage_nbytes=storage.nbytes,
                region=view.region,
            )
        found = self_overlap(
            view.name,
            storage=view.storage,
            byte_offset=view.byte_offset,
            shape=view.shape,
            strides=view.strides,
            itemsize=view.itemsize,
            block=view.is_block and view.dtype is None,
            group=view.group,
        )
        if found is not None:
            findings.append(found)
            continue
        key = storage.memory if storage.memory is not None else ("storage", view.storage)
        members = memories.setdefault(key, [])
        if pieces(view):
            members.append(index)
    for members in memories.values():
        if len(members) < 2:
            continue
        every = []
        for index in members:
            base = records[views[index].storage].base
            every.append([p._replace(offset=p.offset + base) for p in pieces(views[index])])
        group_of = [views[index].group for index in members]
        for (a, b), byte in overlapping_pairs(every, group_of):
            first, second = views[members[a]], views[members[b]]
            findings.append(
                Finding.overlap(
                    first.name,
                    second.name,
                    storage=first.storage,
                    byte=byte - records[first.storage].base,
                    group=first.group if first.group == second.group else None,
                )
            )
    return findings
