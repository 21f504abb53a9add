"""Exact aliasing between views of one memory: the sweeps. Plain integers, no torch.

Two views overlap when they share at least one byte. Spans are not enough: the interleaved pages
of a packed block layout span almost the whole storage each and share nothing. Every view is split
into runs of equally spaced blocks (``_arith.Blocks``), kept as columns of integers (``Pieces``),
and:

- first a quick exit (``_suspects``): when every block stride divides the largest, a view's
  pages fall on a few ranges of places within that period; a view whose ranges meet no other
  view's (and contiguous runs that lie apart) shares no byte. One sort settles a correct layout,
  however its views interleave, and allocates nothing per view but integers; in a broken one only
  the views that may be at fault go on to the sweeps below;
- views of different KV-cache groups may share bytes: each group is judged with the views that
  have no group, instead of judging everything and discarding the pairs across groups;
- otherwise runs of one block stride (a packed group) are rectangles in (block index, byte within
  the block) coordinates, found by one sweep over the byte within the block, in O(L log L);
  strides that divide one another are folded into the largest one's period first;
- contiguous runs, and runs of strides that do not divide one another, meet through a sweep over
  their spans, and only pairs whose spans intersect get the exact arithmetic test
  (``_arith.shared_byte``). That sweep is near-linear when spans of different strides seldom
  intersect, and quadratic in the worst case (many views of different strides interleaved over
  the same bytes).

``overlapping_pairs`` is what the checker (``safeview.check``) calls; ``find_overlaps`` is the
same on layouts, returning ``overlap`` findings.
"""

from __future__ import annotations

import bisect
import heapq
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Protocol

from safeview import _arith
from safeview._arith import Blocks
from safeview.errors import ArgumentError
from safeview.findings import Finding

__all__ = ["Pieces", "find_overlaps", "overlapping_pairs"]


class Pieces:
    """The runs of the views over one memory, as columns of integers: run ``i`` is
    ``numbers[i]`` blocks of ``runs[i]`` bytes, one every ``strides[i]`` bytes from
    ``offsets[i]``, and belongs to view ``owners[i]`` (a position, ``0`` to ``views - 1``).
    Back-to-back blocks are kept as one contiguous run (``numbers[i] == 1``, ``strides[i] ==
    runs[i]``); empty runs are not kept. No object per run: 100,000 views make five lists."""

    __slots__ = ("numbers", "offsets", "owners", "runs", "strides")

    def __init__(self) -> None:
        self.offsets: list[int] = []
        self.numbers: list[int] = []
        self.strides: list[int] = []
        self.runs: list[int] = []
        self.owners: list[int] = []

    def add(self, offset: int, number: int, stride: int, run: int, owner: int) -> None:
        """Keep a run of a view whose own blocks do not overlap (``stride >= run`` when
        ``number > 1``)."""
        if not number or not run:
            return
        if number == 1 or stride == run:
            run *= number
            number, stride = 1, run
        self.offsets.append(offset)
        self.numbers.append(number)
        self.strides.append(stride)
        self.runs.append(run)
        self.owners.append(owner)

    def __len__(self) -> int:
        return len(self.offsets)


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


def _suspects(pieces: Pieces, indices: Iterable[int]) -> list[int] | None:
    """The runs that may share a byte with another of these, found without comparing pairs:
    every other run is proven to share none. An empty list proves them all apart; ``None`` says
    that this cannot be told (block strides that do not divide one another).

    When every block stride divides the largest one (the period), a byte's place within the
    period is the same in every run that touches it, so runs whose ranges of places within the
    period meet no other run's share nothing, whatever blocks they span: a run of stride ``s``
    falls on ``period / s`` such ranges (fewer when it has fewer blocks), and a page that runs
    over the end of the period on two. Contiguous runs are judged by their spans against each
    other; one that reaches among the strided runs also by its places within the period (or,
    when not shorter than the period, it is taken with every strided run). One sort of plain
    integers settles a correct layout, however its views interleave; a broken one's sweep then
    runs over the few runs that may be at fault instead of all of them.
    """
    offsets, numbers, strides, runs = pieces.offsets, pieces.numbers, pieces.strides, pieces.runs
    indices = list(indices)
    strided = [index for index in indices if numbers[index] > 1]
    contiguous = [index for index in indices if numbers[index] == 1]
    suspects: set[int] = set()
    if strided:
        used = set(map(strides.__getitem__, strided))
        period = max(used)
        if any(period % stride or period // stride > MAX_FOLD_RATIO for stride in used):
            return None
        # The range [start, end) of places within the period of run `index` is the integer
        # (start * width + end) * size + index: sorting those sorts by start, with no tuple.
        width, size = period + 1, len(offsets)
        ranges: list[int] = []
        add = ranges.append

        def place(index: int, first: int, count: int, step: int) -> None:
            run = runs[index]
            for start in range(first, first + count * step, step):
                start %= period
                end = start + run
                if end <= period:
                    add((start * width + end) * size + index)
                else:  # the page runs over the end of the period
                    add((start * width + period) * size + index)
                    add((end - period) * size + index)

        for index in strided:
            offset, stride, run = offsets[index], strides[index], runs[index]
            if stride == period:  # one range, the usual case: inlined
                start = offset % period
                end = start + run
                if end <= period:
                    add((start * width + end) * size + index)
                    continue
            place(index, offset, min(numbers[index], period // stride), stride)
        if contiguous:
            low = min(map(offsets.__getitem__, strided))
            high = max(
                offsets[index] + (numbers[index] - 1) * strides[index] + runs[index]
                for index in strided
            )
            for index in contiguous:
                if offsets[index] < high and low < offsets[index] + runs[index]:
                    if runs[index] < period:  # among the strided runs: by its places too
                        place(index, offsets[index], 1, period)
                    else:
                        suspects.add(index)
                        suspects.update(strided)
        ranges.sort()
        limit, unit = 0, width * size  # limit: the previous range's end, in the keys' units
        for key in ranges:
            if key < limit:
                suspects.update(_meeting_places(ranges, width, size))
                break
            limit = key // size % width * unit
    if len(contiguous) > 1:
        spans = [(offsets[index], offsets[index] + runs[index], index) for index in contiguous]
        suspects.update(_meeting(spans))
    return sorted(suspects)


def _meeting_places(ranges: list[int], width: int, size: int) -> set[int]:
    """The runs whose ranges of places (sorted and encoded as in ``_suspects``) meet another."""
    decoded = []
    for key in ranges:
        rest, index = divmod(key, size)
        start, end = divmod(rest, width)
        decoded.append((start, end, index))
    return _meeting(decoded)


def _meeting(ranges: list[tuple[int, int, int]]) -> set[int]:
    """The indices of the ranges ``(start, end, index)`` that meet another range."""
    ranges.sort()
    meeting = set()
    reach = None
    for position, (start, end, index) in enumerate(ranges):
        if reach is not None and start < reach:
            meeting.add(index)  # meets an earlier range
        reach = end if reach is None else max(reach, end)
        if position + 1 < len(ranges) and ranges[position + 1][0] < end:
            meeting.add(index)  # meets the next one, which starts first among the later ones
    return meeting


def _sweep(pieces: Pieces, indices: Iterable[int]) -> dict[tuple[int, int], int]:
    """Every pair of views of these runs that share a byte, with the lowest shared byte."""
    offsets, numbers, strides, runs = pieces.offsets, pieces.numbers, pieces.strides, pieces.runs
    owners = pieces.owners
    return _overlaps_in_group(
        [
            (Blocks(offsets[index], numbers[index], strides[index], runs[index]), owners[index])
            for index in indices
        ]
    )


def _judge(pieces: Pieces, indices: Sequence[int]) -> dict[tuple[int, int], int]:
    """Every pair of views of these runs that share a byte: the sweep over the runs that may be
    at fault (``_suspects``), or over all of them when that cannot be told."""
    suspects = _suspects(pieces, indices)
    if suspects is None:
        return _sweep(pieces, indices)
    return _sweep(pieces, suspects) if suspects else {}


def overlapping_pairs(
    pieces: Pieces,
    group_of: Sequence[Hashable | None],
    name_of: Callable[[int], str] | None = None,
) -> list[tuple[tuple[int, int], int]]:
    """Every pair ``(a, b)``, ``a < b``, of views that share a byte and may not, with the lowest
    shared byte, sorted by ``(a, b)``.

    ``pieces`` are the runs of the views (positions ``0`` to ``len(group_of) - 1``, in one
    address space); ``group_of[a]`` is view ``a``'s group; ``name_of(a)`` its name, for the error
    below. Views of two different groups may share bytes; a view without a group (``None``) may
    share with none.

    Cost: O(P log P) in the number of runs P when all block strides divide the largest (one
    stride, or kernel blocks beside manager blocks, a packed whole-block view beside its
    layers); otherwise pairs whose spans meet are tested one by one, which is quadratic when many
    such views interleave over the same bytes, and past ``MAX_EXACT_TESTS`` tests it stops with
    an ``ArgumentError`` naming two of them.
    """
    try:
        return _pairs(pieces, group_of)
    except _TooMuchWorkError as stop:
        a, b = (repr(name_of(i)) if name_of is not None else str(i) for i in stop.views)
        raise ArgumentError(
            f"views {a} and {b} (block strides {stop.strides[0]} and {stop.strides[1]}, which do "
            f"not divide one another) and others like them interleave over the same bytes: "
            f"checking them exactly took more than {MAX_EXACT_TESTS:,} tests, the limit; split "
            "the check by storage or group, or give those views strides that divide each other"
        ) from None


def _pairs(
    pieces: Pieces, group_of: Sequence[Hashable | None]
) -> list[tuple[tuple[int, int], int]]:
    count = len(pieces)
    if count < 2:
        return []
    groups = set(group_of)
    groups.discard(None)
    if len(groups) < 2:
        # one group, with or without views of none: every pair that shares a byte is reported
        return sorted(_judge(pieces, range(count)).items())
    members: dict[Hashable, list[int]] = defaultdict(list)
    owners = pieces.owners
    for index in range(count):
        members[group_of[owners[index]]].append(index)
    loose = members.pop(None, [])
    found: dict[tuple[int, int], int] = {}
    if len(loose) * (len(members) - 1) > count:
        # many views without a group beside many groups: one sweep, keeping the pairs that may
        # not share, costs less than judging those views again with every group
        for (a, b), byte in _sweep(pieces, range(count)).items():
            if group_of[a] is None or group_of[b] is None or group_of[a] == group_of[b]:
                found[(a, b)] = byte
        return sorted(found.items())
    # Views of two groups may share bytes: each group is judged with the views of none, and no
    # pair across groups is ever looked at.
    for indices in members.values():
        if loose:
            indices += loose
        found.update(_judge(pieces, indices))
    return sorted(found.items())


class _LayoutLike(Protocol):
    @property
    def byte_offset(self) -> int: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def strides(self) -> tuple[int, ...]: ...
    @property
    def itemsize(self) -> int: ...


def find_overlaps(
    layouts: Mapping[str, _LayoutLike], *, groups: Mapping[str, Hashable | None] | None = None
) -> list[Finding]:
    """Every pair of views that share at least one byte, as ``overlap`` findings, each with the
    lowest shared byte (``finding.byte``).

    ``layouts`` maps view names to layouts (``BlockLayout``, ``StridedLayout``) over one storage.
    ``groups`` maps view names to their aliasing groups: views of two different groups may share
    bytes (in vLLM's hybrid allocator a block id belongs to one KV-cache group at a time) and are
    not reported. A view without a group (absent from ``groups``, or mapped to ``None``) may share
    a byte with no other view, and without ``groups`` no two views may. The result is ordered by
    the positions of the two views in ``layouts``. Arguments of the wrong kind raise
    ``ArgumentError``.

    >>> from safeview import packed_layouts
    >>> find_overlaps(packed_layouts({"k": 64, "v": 64}, num_blocks=100))
    []
    """
    if not isinstance(layouts, Mapping):
        raise ArgumentError(
            "layouts must be a mapping of view names to layouts ({name: BlockLayout or "
            f"StridedLayout}}); got {type(layouts).__name__}"
        )
    if groups is not None and not isinstance(groups, Mapping):
        raise ArgumentError(
            "groups must be a mapping of view names to groups, or None; "
            f"got {type(groups).__name__}"
        )
    names = list(layouts)
    pieces = Pieces()
    add = pieces.add
    for position, name in enumerate(names):
        layout = layouts[name]
        try:
            offset, shape, strides = layout.byte_offset, layout.shape, layout.strides
            itemsize = layout.itemsize
        except AttributeError:
            raise ArgumentError(
                f"layouts[{name!r}] must be a safeview BlockLayout or StridedLayout; got "
                f"{type(layout).__name__}"
            ) from None
        if itemsize == 1 and len(shape) == 2 and strides[1] == 1:  # a block view: one run
            add(offset, shape[0], strides[0], shape[1], position)
            continue
        try:
            parts = _arith.blocks(offset, shape, strides, itemsize)
        except ValueError as error:
            raise ArgumentError(f"view {name!r}: {error}") from None
        for part in parts:
            add(*part, position)
    group_of: list[Hashable | None] = [None] * len(names)
    if groups is not None:
        for position, name in enumerate(names):
            group = group_of[position] = groups.get(name)
            try:
                hash(group)
            except TypeError:
                raise ArgumentError(
                    f"groups[{name!r}] must be a hashable group key (a str, an int, ...); "
                    f"got {group!r} ({type(group).__name__})"
                ) from None
    return [
        Finding.overlap(
            names[a],
            names[b],
            storage=None,
            byte=byte,
            group=group_of[a] if group_of[a] == group_of[b] else None,
        )
        for (a, b), byte in overlapping_pairs(pieces, group_of, names.__getitem__)
    ]
