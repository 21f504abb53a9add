"""Nothing left behind: every layer a connector is to transfer lies, whole, in the descriptors it
prepared for its transfers.

A transfer engine checks the descriptors it is given, never the ones it is not: a layer that no
descriptor covers is simply never transferred, and every transfer is reported done (the receiving
side keeps zeros, or stale bytes, for that layer). ``check_coverage(prepared, registration)``
takes the descriptor lists a connector prepared (rows as ``safeview.transfer.check_descriptors``
reads them) and the registration of its caches, and says of each layer that is to be transferred
which of its bytes no row covers: one ``unregistered`` finding per layer.

A layer's bytes are its pages (each view's ``num_blocks`` pages of ``page_bytes``). A packed row
that spans every layer's pages of a block covers them all. For layers named in ``touched`` (state
whose pages are padded, such as Mamba's, and whose rows cover the state but not the padding) a
page counts as covered when some row reaches into it. numpy is imported on first use.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from safeview import log
from safeview.errors import ArgumentError, CoverageError
from safeview.findings import Finding
from safeview.policy import Policy, PolicyArg, current_policy
from safeview.transfer._pages import MemoryMap, _numpy, memory_map
from safeview.transfer._rows import _MAX_ELEMENTS, _rows

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

    from safeview.manifest import Manifest

__all__ = ["check_coverage"]


def check_coverage(
    prepared: Iterable[object],
    registration: object,
    *,
    layers: Iterable[str] | None = None,
    touched: Iterable[str] = (),
    policy: PolicyArg | None = None,
    source: str = "check_coverage",
    manifest: Manifest | None = None,
) -> list[Finding]:
    """Check that every layer of ``layers`` (every layer of ``registration`` when ``None``) lies
    whole in the descriptor lists ``prepared`` (each a list of rows ``(address, length[, device[,
    stride, count]])`` or an integer array of them, as the connector handed them to its engine).

    Returns one ``unregistered`` finding per layer with bytes in no row. Under strict raises
    ``safeview.CoverageError`` for them (all layers named); under warn emits one
    ``coverage_violation`` event per layer and returns them; ``off`` checks nothing.
    ``layers`` naming no layer of the registration is an ``ArgumentError``. With the
    ``manifest`` of the layers (``safeview.describe``), a finding also names the part of a row
    its first byte left out lies in (a scale beside the data, a state's segment).
    """
    active = current_policy(policy)
    if active is Policy.OFF:
        return []
    found = uncovered(
        _lists(prepared), memory_map(registration), layers, set(touched), manifest=manifest
    )
    enforce(found, active, source)
    return found


def enforce(found: Sequence[Finding], active: Policy, source: str) -> None:
    """Log every finding; under strict, raise ``CoverageError`` for them."""
    if active is Policy.OFF or not found:
        return
    strict = active is Policy.STRICT
    for finding in found:
        log.coverage_violation(finding, strict=strict, policy=active.value, source=source)
    if strict:
        raise CoverageError(found, policy=active.value, source=source)


def _lists(prepared: Iterable[object]) -> list[object]:
    """``prepared`` as a list of descriptor lists; rows given in its place (one list of rows,
    or one 2-d array, the usual slip) are an ``ArgumentError`` that says what to pass, instead
    of a complaint about the first row's first number."""
    if isinstance(prepared, (str, bytes)) or not isinstance(prepared, Iterable):
        raise ArgumentError(
            "prepared must be a list of descriptor lists (each a list of rows (address, "
            "length[, device[, stride, count]]) or a 2-d integer array); got "
            f"{type(prepared).__name__}"
        )
    lists = list(prepared)
    for index, item in enumerate(lists):
        row: tuple[int, ...] | None = None
        if getattr(item, "ndim", None) == 1:  # a row of an array: the array itself was passed
            row = tuple(int(value) for value in item)  # type: ignore[attr-defined]
        elif isinstance(item, (list, tuple)) and item and hasattr(item[0], "__index__"):
            row = tuple(
                value.__index__() if hasattr(value, "__index__") else value for value in item
            )
        if row is not None:
            raise ArgumentError(
                "prepared must be a list of descriptor lists (one per list the connector handed "
                "its engine, each a list of rows (address, length[, device[, stride, count]]) or "
                f"a 2-d integer array); its item {index} is one row, {row}: to check one list "
                "of rows, call check_coverage([rows], ...)"
            )
    return lists


def uncovered(
    prepared: Sequence[object],
    memory: MemoryMap,
    layers: Iterable[str] | None,
    touched: set[str],
    manifest: Manifest | None = None,
) -> list[Finding]:
    """The ``unregistered`` findings of ``layers`` against the rows of ``prepared``; with the
    layers' ``manifest``, each names the part its first byte left out lies in."""
    _numpy()
    import numpy as np

    by_layer: dict[str, list[Any]] = {}
    for view in memory.views:
        by_layer.setdefault(view.layer or view.name, []).append(view)
    wanted = list(by_layer) if layers is None else list(dict.fromkeys(layers))
    unknown = [name for name in wanted if name not in by_layer]
    if unknown:
        raise ArgumentError(
            f"layers names {unknown[0]!r}, which is no layer of the registration (it has "
            f"{', '.join(repr(name) for name in list(by_layer)[:8])})"
        )
    starts, ends = _merged(prepared)
    covered_before = np.concatenate(([0], np.cumsum(ends - starts, dtype=np.uint64)))
    storages = {storage.name: storage for storage in memory.storages}

    def covered_up_to(points: NDArray[np.uint64]) -> NDArray[np.uint64]:
        """Bytes covered by the rows below each address of ``points``."""
        if not len(starts):
            return np.zeros(len(points), dtype=np.uint64)
        index = np.searchsorted(starts, points, side="right").astype(np.intp) - 1
        inside = np.clip(points, starts[np.maximum(index, 0)], ends[np.maximum(index, 0)])
        partial = np.where(index >= 0, inside - starts[np.maximum(index, 0)], np.uint64(0))
        before = covered_before[np.maximum(index, 0)]
        return np.where(index >= 0, before + partial, np.uint64(0)).astype(np.uint64)

    whole_rows = _described(prepared)
    layers_reached: list[str] = []
    pending: list[tuple[str, tuple[Any, int, int, int], int, int, int]] = []
    found: list[Finding] = []
    for name in wanted:
        missing_pages = pages_total = bytes_missing = 0
        first: tuple[Any, int, int, int] | None = None  # view, block, first missing, its end
        reached = False
        for view in by_layer[name]:
            storage = storages[view.storage]
            base = storage.address + view.byte_offset
            blocks = view.num_blocks
            page = view.page_bytes
            if not page or not blocks:
                continue
            end = storage.address + storage.nbytes
            if base + page > end:
                continue
            if view.block_stride_bytes:
                blocks = min(blocks, (end - base - page) // view.block_stride_bytes + 1)
            pages = base + np.arange(blocks, dtype=np.uint64) * np.uint64(view.block_stride_bytes)
            got = covered_up_to(pages + np.uint64(page)) - covered_up_to(pages)
            reached = reached or bool((got > 0).any())
            short = got == 0 if name in touched else got < page
            pages_total += blocks
            count = int(short.sum())
            if not count:
                continue
            missing_pages += count
            bytes_missing += (
                int((np.uint64(page) - got)[short].sum()) if name not in touched else (count * page)
            )
            if first is None:
                block = int(np.flatnonzero(short)[0])
                start = int(pages[block])
                first = (view, block, *_first_gap(starts, ends, start, start + page))
        if reached:
            layers_reached.append(name)
        if first is not None:
            pending.append((name, first, missing_pages, pages_total, bytes_missing))
    words = _prepared_words(whole_rows, layers_reached, wanted)
    for name, (view, block, low, high), missing_pages, pages_total, bytes_missing in pending:
        storage = storages[view.storage]
        said = words + _part_words(manifest, name, view, block, low - storage.address)
        found.append(
            Finding.unregistered(
                layer=name,
                storage=view.storage,
                byte_offset=low - storage.address,
                extent_bytes=high - storage.address,
                block=block,
                pages_missing=missing_pages,
                pages=pages_total,
                page_bytes=view.page_bytes,
                bytes_missing=bytes_missing,
                prepared=said,
            )
        )
    return found


def _part_words(
    manifest: Manifest | None, name: str, view: Any, block: int, byte_offset: int
) -> str:
    """Words for the part of a row that a layer's first byte left out lies in, where the
    manifest gives the layer parts: ``; the first byte left out is in part 'scale' ...``."""
    layer = None if manifest is None else manifest.layers.get(name)
    if layer is None or not layer.parts:
        return ""
    page_byte = byte_offset - view.byte_offset - block * view.block_stride_bytes
    if view.name != name:  # one chunk of a page whose K and V lie apart: name[i]
        chunk = int(view.name.rsplit("[", 1)[-1].rstrip("]"))
        page_byte += chunk * layer.chunk_bytes
    found = layer.part_at(page_byte)
    if found is None:
        return "; the first byte left out is in no part of its row (padding)"
    part, row = found
    return (
        f"; the first byte left out is in part {part.name!r} ({part.role}, {part.dtype}), "
        f"byte {row} of its {layer.row_bytes}-byte row"
    )


def _merged(prepared: Sequence[object]) -> tuple[NDArray[np.uint64], NDArray[np.uint64]]:
    """Every element of every row, as sorted disjoint ``[start, end)`` address intervals."""
    import numpy as np

    starts_of: list[Any] = []
    ends_of: list[Any] = []
    for rows_given in prepared:
        rows = _rows(rows_given)
        counts = np.ones(len(rows.addresses), np.uint64) if rows.counts is None else rows.counts
        total = int(counts.sum(dtype=np.uint64)) if len(counts) else 0
        if total > _MAX_ELEMENTS:
            raise ArgumentError(
                f"the prepared lists hold {total} elements, more than {_MAX_ELEMENTS}"
            )
        repeats = counts.astype(np.intp)
        first = np.cumsum(repeats) - repeats
        element = np.arange(total, dtype=np.uint64) - np.repeat(first.astype(np.uint64), repeats)
        owner = np.repeat(np.arange(len(counts)), repeats)
        step = np.zeros(len(counts), np.uint64) if rows.strides is None else rows.strides
        start = rows.addresses[owner] + element * step[owner]
        starts_of.append(start)
        ends_of.append(start + rows.lengths[owner])
    if not starts_of:
        empty = np.zeros(0, np.uint64)
        return empty, empty
    starts = np.concatenate(starts_of)
    ends = np.concatenate(ends_of)
    keep = ends > starts
    starts, ends = starts[keep], ends[keep]
    if not len(starts):
        return starts, ends
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], np.maximum.accumulate(ends[order])
    # a new interval begins where a start lies past every end before it
    opens = np.concatenate(([True], starts[1:] > ends[:-1]))
    closes = np.concatenate((opens[1:], [True]))
    return starts[opens], ends[closes]


def _first_gap(
    starts: NDArray[np.uint64], ends: NDArray[np.uint64], low: int, high: int
) -> tuple[int, int]:
    """The first run of bytes of ``[low, high)`` in no interval."""
    import numpy as np

    index = int(np.searchsorted(starts, low, side="right")) - 1
    at = low
    if index >= 0 and int(ends[index]) > low:
        at = int(ends[index])
    following = int(np.searchsorted(starts, at, side="left"))
    stop = int(starts[following]) if following < len(starts) else high
    return at, min(stop, high)


def _described(prepared: Sequence[object]) -> str:
    lists = len(prepared)
    rows = 0
    for rows_given in prepared:
        rows += len(_rows(rows_given).addresses)
    return f"{rows:,} row{'s' if rows != 1 else ''} in {lists} list{'s' if lists != 1 else ''}"


def _prepared_words(rows: str, reached: list[str], wanted: list[str]) -> str:
    if not reached:
        return f"{rows}, reaching none of the layers to transfer"
    shown = ", ".join(repr(name) for name in reached[:4])
    more = f" and {len(reached) - 4} more" if len(reached) > 4 else ""
    return f"{rows}, covering layers {shown}{more} of the {len(wanted)} to transfer"


def layers_of(
    memory: MemoryMap, rows_given: object, indices: Sequence[int] | None = None
) -> list[str]:
    """The layers whose pages the rows (or, of a strided list, the descriptors ``indices`` by
    NIXL's numbering: each row's elements in turn) start in, in order, each once: what a failed
    registration or transfer concerns. Rows in no page name no layer."""
    import numpy as np

    rows = _rows(rows_given)
    counts = np.ones(len(rows.addresses), np.uint64) if rows.counts is None else rows.counts
    step = np.zeros(len(counts), np.uint64) if rows.strides is None else rows.strides
    if indices is None:
        chosen = [(int(row), 0) for row in range(len(counts))]
    else:
        ends = np.cumsum(counts.astype(np.int64))
        chosen = []
        for index in indices:
            row = int(np.searchsorted(ends, int(index), side="right"))
            if row < len(counts):
                chosen.append((row, int(index) - (int(ends[row]) - int(counts[row]))))
    index_of = memory._index
    names: dict[str, None] = {}
    for row, element in chosen[:4096]:
        address = int(rows.addresses[row]) + element * int(step[row])
        page = index_of.page_at(address, None)
        if page is not None:
            names.update(dict.fromkeys(view for view in page[0]))
        else:  # a packed block, or a region of the whole storage: the pages it holds
            for hit in index_of.hits(address, address + max(int(rows.lengths[row]), 1) - 1,
                                     int(rows.lengths[row]), None):  # fmt: skip
                names.update(dict.fromkeys(hit.views))
    layer_of = {view.name: view.layer or view.name for view in memory.views}
    return list(dict.fromkeys(layer_of.get(name, name) for name in names))


def layers_in(memory: MemoryMap, regions: Sequence[tuple[int, int]]) -> list[str]:
    """The layers with a view that shares bytes with one of ``regions`` (``(address, length)``):
    what a registration of those regions concerns."""
    storages = {storage.name: storage for storage in memory.storages}
    names: dict[str, None] = {}
    for view in memory.views:
        storage = storages[view.storage]
        low = storage.address + view.byte_offset
        high = low + (view.num_blocks - 1) * view.block_stride_bytes + view.page_bytes
        if view.num_blocks and any(a < high and low < a + n for a, n in regions):
            names[view.layer or view.name] = None
    return list(names)
