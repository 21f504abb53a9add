"""An independent oracle for ``safeview.check.check_views``: every page (or element) a view
touches, listed one by one, sorted, and swept.

It imports nothing from safeview, so that a bug in the library's extent, bounds, self-overlap or
overlap code cannot change the oracle with it (it once did: this file was a frozen copy of the
0.2.0 sweep and called ``safeview._arith``). The arithmetic here is the plainest there is: a view
is the list of ``[start, end)`` byte ranges of its pages (a block view) or of its elements (any
other view); its extent is the largest end; a byte is shared when two ranges sorted by start meet.
numpy only sorts and takes running maxima (4.25 million pages of GLM-5.2's plan take a second);
the pairs themselves are named by a plain Python sweep over the few ranges that meet.

Findings are compared as the numbers they carry (``project``), not as sentences: the sentences
are ``safeview.findings``' own and are pinned by tests/test_findings.py.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import numpy as np

Projected = tuple[Any, ...]
"""``(kind, views, storage, byte_offset, extent_bytes, limit_bytes, overflow_bytes, region, byte,
group)``: what a finding of ``check_views`` says, without its sentence."""


def project(finding: Any) -> Projected:
    """A finding of ``check_views`` as the numbers the oracle computes."""
    return (
        finding.kind,
        tuple(finding.views),
        finding.storage,
        finding.byte_offset,
        finding.extent_bytes,
        finding.limit_bytes,
        finding.overflow_bytes,
        finding.region,
        finding.byte,
        finding.group,
    )


def _is_block(view: Any) -> bool:
    # ViewRecord.block's shape: one-byte items, (num_blocks, page_bytes), strides (stride, 1)
    _, _, _, shape, strides, itemsize, *_ = view
    return itemsize == 1 and len(shape) == 2 and strides[1] == 1


def ranges(view: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(starts, ends)`` of every byte range the view touches, in storage bytes (unsorted): one
    per page of a block view, one per element otherwise. Empty for an empty view."""
    _, _, offset, shape, strides, itemsize, *_ = view
    if 0 in shape:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    if _is_block(view):
        number, page = shape
        starts = offset + np.arange(number, dtype=np.int64) * strides[0]
        return starts, starts + page
    element_starts = [
        offset + sum(i * s * itemsize for i, s in zip(index, strides))
        for index in itertools.product(*(range(size) for size in shape))
    ]
    starts = np.array(element_starts, dtype=np.int64)
    return starts, starts + itemsize


def extent(view: Any) -> int:
    """The byte after the last byte the view touches; its offset when it touches none."""
    _, ends = ranges(view)
    return int(ends.max()) if ends.size else int(view[2])


def first_repeated_byte(starts: np.ndarray, ends: np.ndarray) -> int | None:
    """The lowest byte that two of the ranges both hold, or ``None``. Sorted by start, a range
    meets an earlier one exactly when it starts before the farthest earlier end, and then its own
    start is held twice (and is the lowest such byte of that range)."""
    if starts.size < 2:
        return None
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], ends[order]
    reach = np.maximum.accumulate(ends)[:-1]
    hit = starts[1:] < reach
    return int(starts[1:][hit].min()) if hit.any() else None


def _pairs_in(
    starts: np.ndarray, ends: np.ndarray, owners: np.ndarray, found: dict[tuple[int, int], int]
) -> None:
    """Every pair of owners whose ranges meet, with the lowest byte they share (kept in
    ``found`` when lower than what is there)."""
    if starts.size < 2:
        return
    order = np.lexsort((owners, starts))
    starts, ends, owners = starts[order], ends[order], owners[order]
    reach = np.maximum.accumulate(ends)
    meets = np.flatnonzero(starts[1:] < reach[:-1]) + 1
    if not meets.size:
        return
    # clusters: runs of ranges each of which meets something before it; sweep only those
    cluster_starts = np.flatnonzero(np.concatenate(([True], starts[1:] >= reach[:-1])))
    for index in np.unique(np.searchsorted(cluster_starts, meets, side="right") - 1):
        first = int(cluster_starts[index])
        last = int(cluster_starts[index + 1]) if index + 1 < cluster_starts.size else starts.size
        active: list[tuple[int, int, int]] = []  # heap of (end, owner, start)
        for start, end, owner in zip(
            starts[first:last].tolist(), ends[first:last].tolist(), owners[first:last].tolist()
        ):
            while active and active[0][0] <= start:
                heapq.heappop(active)
            for _, other, _ in active:
                if other != owner:
                    key = (other, owner) if other < owner else (owner, other)
                    if found.get(key, start + 1) > start:
                        found[key] = start  # sorted by start: the later start is the first byte
            heapq.heappush(active, (end, owner, start))


def reference_findings(storages: Mapping[str, Any], views: Sequence[Any]) -> list[Projected]:
    """What ``check_views(storages, views).findings`` must say, projected (``project``).

    ``storages`` maps a name to its size in bytes or to a ``(nbytes, memory, base)`` triple (a
    ``StorageRecord``); ``views`` are ``(name, storage, byte_offset, shape, strides, itemsize,
    group, region, dtype)`` tuples (``ViewRecord``s). The rules, each from the docs:

    - bounds, in view order: ``out_of_bounds`` when the view touches a byte at or past its
      storage's end, or, empty, starts past it; ``out_of_region`` when it touches a byte outside
      its region, or, empty, starts outside it. ``overflow_bytes`` counts the bytes of
      ``[byte_offset, extent)`` outside (for an empty view, how far its offset lies outside).
    - ``self_overlap`` after them: the view touches a byte twice. ``byte`` is the lowest such byte
      for a block view (made by ``ViewRecord.block``, no dtype); for any other view, its first
      byte when its first element is touched twice, else ``None`` (not named).
    - then per memory (storages of one ``memory`` are one address space, byte 0 at ``base``), in
      order of the memory's first view that does not overlap itself: every pair of such views
      that share a byte, sorted by their positions, unless both have a group and the groups
      differ; ``byte`` is the lowest shared byte in the first view's storage, ``group`` theirs
      when equal.
    """
    records = {
        name: (value, None, 0) if isinstance(value, int) else tuple(value)
        for name, value in storages.items()
    }
    findings: list[Projected] = []
    memories: dict[Hashable, list[int]] = {}
    touched: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for index, view in enumerate(views):
        name, storage, offset, _, _, _, group, region, dtype = view
        nbytes, memory, _ = records[storage]
        starts, ends = ranges(view)
        end = int(ends.max()) if ends.size else offset
        empty = end == offset
        if end > nbytes:
            outside = offset - nbytes if empty else len(range(max(offset, nbytes), end))
            findings.append(
                ("out_of_bounds", (name,), storage, offset, end, nbytes, outside, None, None, None)
            )
        if region is not None:
            first, last = region
            if empty:
                before, after = len(range(offset, first)), len(range(last, offset))
            else:
                before = len(range(offset, min(end, first)))
                after = len(range(max(offset, last), end))
            if before or after:
                findings.append(
                    ("out_of_region", (name,), storage, offset, end, last, before + after,
                     (first, last), None, None)
                )  # fmt: skip
        twice = first_repeated_byte(starts, ends)
        if twice is not None:
            block = _is_block(view) and dtype is None
            byte = twice if block or twice == offset else None
            findings.append(("self_overlap", (name,), storage, None, None, None, None, None,
                             byte, group))  # fmt: skip
            continue
        key = memory if memory is not None else ("storage", storage)
        members = memories.setdefault(key, [])
        if starts.size:
            members.append(index)
            touched[index] = (starts, ends)
    for members in memories.values():
        if len(members) < 2:
            continue
        groups = {views[index][6] for index in members}
        named = sorted(groups - {None}, key=repr)
        # views that may not share: one group with the views of none, or all of none
        classes = [[i for i in members if views[i][6] in (g, None)] for g in named] or [members]
        found: dict[tuple[int, int], int] = {}
        for chosen in classes:
            bases = {i: records[views[i][1]][2] for i in chosen}
            starts = np.concatenate([touched[i][0] + bases[i] for i in chosen])
            ends = np.concatenate([touched[i][1] + bases[i] for i in chosen])
            owners = np.concatenate(
                [np.full(touched[i][0].size, i, dtype=np.int64) for i in chosen]
            )
            _pairs_in(starts, ends, owners, found)
        for (a, b), byte in sorted(found.items()):
            first_view, second_view = views[a], views[b]
            group = first_view[6] if first_view[6] == second_view[6] else None
            findings.append(
                ("overlap", (first_view[0], second_view[0]), first_view[1], None, None, None,
                 None, None, byte - records[first_view[1]][2], group)
            )  # fmt: skip
    return findings
