"""How each descriptor row lies in the pages of a memory map: numpy proves the rows it can, all
at once (``_proven``); the others are explained one by one (``_explain``), each into its finding.
Private to ``safeview``: ``safeview.transfer`` is the public module.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from safeview.errors import ArgumentError
from safeview.findings import Descriptor, Finding
from safeview.transfer._pages import _FAMILY, _RUN, ADDRESS_LIMIT, StorageSpan, _Hit, _Index
from safeview.transfer._rows import _Rows

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray


def _columns(index: _Index, layers: object, count: int) -> list[int] | None:
    """Each row's column of the layer matrix (-1: no layer named), or ``None``."""
    if layers is None:
        return None
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Iterable):
        raise ArgumentError(
            f"layers must hold one layer name (or None) per descriptor; got {type(layers).__name__}"
        )
    names = list(layers)
    if len(names) != count:
        raise ArgumentError(
            f"layers has {len(names)} names for {count} descriptors; it must have one per row"
        )
    columns = index.columns
    found = []
    for position, name in enumerate(names):
        if name is None:
            found.append(-1)
            continue
        column = columns.get(name)
        if column is None:
            known = ", ".join(repr(n) for n in list(columns)[:8])
            more = ", ..." if len(columns) > 8 else ""
            raise ArgumentError(
                f"layers[{position}] is {name!r}, which is no layer or view of the "
                f"registration (it has {known}{more})"
            )
        found.append(column)
    return found


def _judge(
    rows: _Rows,
    index: _Index,
    *,
    layers: object = None,
    whole_pages: bool = True,
    first_only: bool = False,
    vectorised: bool = True,
) -> list[Finding]:
    """The findings of every row, in row order: numpy proves the rows it can, and the rest are
    explained one by one (``vectorised=False``: every row one by one)."""
    import numpy as np

    count = len(rows.addresses)
    columns = _columns(index, layers, count)
    if vectorised:
        proven = _proven(rows, index, columns, whole_pages)
        suspects = np.flatnonzero(~proven).tolist()
    else:
        suspects = list(range(count))
    names: list[Any] = [] if layers is None else list(layers)  # type: ignore[call-overload]
    found = []
    for position in suspects:
        column = None if columns is None or columns[position] < 0 else columns[position]
        layer = None if column is None else str(names[position])
        finding = _explain(index, rows.describe(position), column, layer, whole_pages)
        if finding is not None:
            found.append(finding)
            if first_only:
                break
    return found


class _Resolved:
    """What numpy learnt of the first element of each row: ``ok`` (right by itself), and for
    strided rows and layer checks the way it lies in the views (see ``_Hit``): ``hit`` 1 inside
    a page, 2 a run of whole pages, 3 whole blocks; ``row`` of the layer matrix, ``block``,
    ``units``, ``stride``, ``limit``, ``page``, ``in_page``, ``contiguous``."""

    def __init__(self, count: int, detail: bool) -> None:
        import numpy as np

        self.ok = np.zeros(count, dtype=bool)
        self.detail = detail
        if detail:
            self.hit = np.zeros(count, dtype=np.int8)
            self.whole = np.zeros(count, dtype=bool)
            self.row = np.zeros(count, dtype=np.intp)
            self.block = np.zeros(count, dtype=np.uint64)
            self.units = np.ones(count, dtype=np.uint64)
            self.stride = np.ones(count, dtype=np.uint64)
            self.limit = np.zeros(count, dtype=np.uint64)
            self.page = np.ones(count, dtype=np.uint64)
            self.in_page = np.zeros(count, dtype=np.uint64)
            self.contiguous = np.zeros(count, dtype=bool)

    def put(self, chosen: Any, values: dict[str, Any]) -> None:
        """Store ``values`` for the rows ``chosen`` (a slice for all of them, or indices)."""
        for name, value in values.items():
            if name == "ok" or self.detail:
                getattr(self, name)[chosen] = value


def _run_part(
    index: _Index, picked: Any, length: Any, first: Any, span: Any, whole_pages: bool,
    detail: bool,
) -> dict[str, Any]:  # fmt: skip
    """Rows inside runs of contiguous views (``picked``: each row's entry, already known to hold
    it): a whole page, a run of whole pages, or (without ``whole_pages``) a slice of one
    page."""
    import numpy as np

    one, zero = np.uint64(1), np.uint64(0)
    start, unit = index.e_start[picked], index.e_unit[picked]
    offset = first - start
    residue = offset % unit
    exact = (residue == zero) & (length == unit)  # one whole page: the usual row
    in_one: Any = None
    if detail or not whole_pages:
        in_one = residue + span <= unit
    ok = exact if whole_pages else exact | in_one
    # runs of whole pages, looked for among the rest only
    runs = np.zeros(len(ok), dtype=bool)
    others = np.flatnonzero(~ok)
    if len(others):
        unit_of = unit if np.ndim(unit) == 0 else unit[others]
        span_of = length[others]
        runs[others] = (residue[others] == zero) & (span_of > zero) & (span_of % unit_of == zero)
        ok = ok | runs
    runs |= exact
    values: dict[str, Any] = {"ok": ok}
    if detail:
        values.update(
            hit=np.where(in_one, 1, np.where(runs, 2, 0)),
            whole=runs,
            row=index.e_ref[picked],
            block=offset // unit,
            units=np.where(runs, length // unit, one),
            stride=unit,
            limit=(index.e_last[picked] - start + one) // unit,
            page=unit,
            in_page=residue,
            contiguous=True,
        )
    return values


def _family_part(
    index: _Index, number: int, length: Any, first: Any, span: Any, whole_pages: bool,
    detail: bool,
) -> dict[str, Any]:  # fmt: skip
    """Rows inside a periodic family: a page of one member (whole, or a slice without
    ``whole_pages``), or whole blocks when the members' pages fill each block. Rows outside the
    family are refused here too (so that one family needs no other bounds check): their offset
    from the family wraps around to a block past its last, and no comparison can overflow."""
    import numpy as np

    family = index.families[number]
    offsets, pages, blocks, aliases = index.f_arrays[number]
    one, zero = np.uint64(1), np.uint64(0)
    period = np.uint64(family.stride)
    # Few arrays, reused in place: on a list of millions of rows, fresh memory costs more than
    # the arithmetic.
    residue = np.subtract(first, np.uint64(family.origin))
    block = np.empty_like(residue)
    np.divmod(residue, period, out=(block, residue))
    # The first member starts the window (offset 0), so every residue falls after some
    # member's start: the search needs no bounds, and one member none at all.
    member: Any = 0
    if len(offsets) > 1:
        member = np.searchsorted(offsets, residue, side="right")
        member -= 1
    member_page = pages[member]
    # members of one block count (the usual case) need no lookup of it
    member_blocks = blocks[0] if bool((blocks == blocks[0]).all()) else blocks[member]
    inner = offsets[member]
    inner = np.subtract(residue, inner, out=inner) if len(offsets) > 1 else residue - inner
    exact = inner == zero
    exact &= length == member_page
    exact &= block < member_blocks
    in_page: Any = None
    if detail or not whole_pages:
        in_page = (block < member_blocks) & (span <= member_page) & (inner <= member_page - span)
    ok = exact if whole_pages else in_page
    whole_blocks = np.zeros(len(ok), dtype=bool)
    if family.tiles:
        others = np.flatnonzero(~(exact if in_page is None else in_page))
        candidates = others[residue[others] == zero]
        if len(candidates):
            total = np.uint64(family.whole_blocks * family.stride)
            span_bytes = length[candidates]
            start = block[candidates] * period + residue[candidates]
            whole_blocks[candidates] = (
                (span_bytes > zero)
                & (span_bytes % period == zero)
                & (start < total)
                & (span_bytes <= total - start)
            )
            ok = ok | whole_blocks
    values: dict[str, Any] = {"ok": ok}
    if detail:
        values.update(
            hit=np.where(in_page, 1, np.where(whole_blocks, 3, 0)),
            whole=exact | whole_blocks,
            row=np.where(in_page, aliases[member], len(index.aliases) + number),
            block=block,
            units=np.where(whole_blocks, length // period, one),
            stride=period,
            limit=np.where(in_page, member_blocks, np.uint64(family.whole_blocks)),
            page=np.where(in_page, member_page, period),
            in_page=inner,
            contiguous=False,
        )
    return values


def _proven(
    rows: _Rows, index: _Index, columns: list[int] | None, whole_pages: bool
) -> NDArray[np.bool_]:
    """Which rows are right, decided with numpy for all rows at once. ``False`` means only
    "not proven here": the row-by-row path decides."""
    import numpy as np

    count = len(rows.addresses)
    if not count or not len(index.e_start):
        return np.zeros(count, dtype=bool)
    strided = rows.counts is not None
    detail = strided or columns is not None
    resolved = _Resolved(count, detail)
    everything = slice(None)
    with np.errstate(all="ignore"):
        first, length = rows.addresses, rows.lengths
        one, zero = np.uint64(1), np.uint64(0)
        single_family = len(index.e_start) == 1 and index.e_kind[0] == _FAMILY
        # rows of zero bytes are placed as their first byte; only slices need the span
        span = np.maximum(length, one) if detail or not whole_pages or not single_family else None
        if single_family:
            entry: Any = 0  # one family: it bounds its rows itself
            inside = np.ones(count, dtype=bool)
        elif len(index.e_start) == 1:  # one run: its numbers are scalars
            entry = 0
            last = first + (span - one)
            inside = (first >= index.e_start[0]) & (last <= index.e_last[0]) & (last >= first)
        else:
            last = first + (span - one)
            position = np.searchsorted(index.e_start, first, side="right").astype(np.intp) - 1
            entry = np.maximum(position, 0)
            inside = (position >= 0) & (last >= first) & (last <= index.e_last[entry])
        if rows.devices is not None:
            inside &= index.e_dev[entry] == rows.devices
        kinds = index.e_kind[entry]
        refs = index.e_ref[entry]
        for kind in np.unique(kinds).tolist():
            mine = inside if np.ndim(kinds) == 0 else inside & (kinds == kind)
            if kind == _RUN:
                groups: list[tuple[int, Any]] = [(-1, mine)]
            else:
                numbers = refs if np.ndim(refs) == 0 else refs[mine]
                groups = [(n, mine & (refs == n)) for n in np.unique(numbers).tolist()]
            for number, selected in groups:
                chosen: Any = everything if selected.all() else np.flatnonzero(selected)
                if isinstance(chosen, np.ndarray) and not len(chosen):
                    continue
                part = (length[chosen], first[chosen], None if span is None else span[chosen])
                if kind == _RUN:
                    picked = entry if np.ndim(entry) == 0 else entry[chosen]
                    values = _run_part(index, picked, *part, whole_pages, detail)
                else:
                    values = _family_part(index, number, *part, whole_pages, detail)
                resolved.put(chosen, values)
        ok = resolved.ok
        if columns is not None:
            wanted = np.array(columns, dtype=np.intp)
            named = wanted >= 0
            layer_ok = np.ones(count, dtype=bool)
            layer_ok[named] = index.matrix[resolved.row[named], wanted[named]]
            ok = ok & layer_ok
        else:
            layer_ok = None
        if not strided:
            return ok
        elements, step = rows.counts, rows.strides
        assert elements is not None
        assert step is not None
        hit, whole, units, page = resolved.hit, resolved.whole, resolved.units, resolved.page
        room = resolved.limit - resolved.block
        page_mode = (
            (hit == 1)
            & (whole | (not whole_pages))
            & (step == resolved.stride)
            & (elements <= room)
        )
        run_mode = (hit >= 2) & whole & (step == length) & (elements <= room // units)
        assert span is not None  # strided rows are judged in detail
        pieces = page // span
        piece_mode = (
            (hit == 1)
            & ~whole
            & (resolved.in_page == zero)
            & (length > zero)
            & (step == length)
            & (length < page)
            & (page % span == zero)
            & (elements % np.maximum(pieces, one) == zero)
            & np.where(resolved.contiguous, elements // np.maximum(pieces, one) <= room,
                       elements == pieces)
        )  # fmt: skip
        strided_ok = page_mode | run_mode | piece_mode
        if layer_ok is not None:
            strided_ok &= layer_ok
        result: NDArray[np.bool_] = np.where(
            elements == zero, True, np.where(elements == one, ok, strided_ok)
        )
        return result


def _explain(
    index: _Index, row: Descriptor, column: int | None, layer: str | None, whole_pages: bool
) -> Finding | None:
    """The finding of one row, or ``None`` when it is right after all."""
    elements = 1 if row.count is None else row.count
    if elements == 0:
        return None
    step = row.stride_bytes or 0
    span = max(row.length_bytes, 1)
    strided = row.count is not None
    if row.address + (elements - 1) * step + span > ADDRESS_LIMIT:
        if not step or row.address + span > ADDRESS_LIMIT:
            element = 0
        else:
            element = max(0, -(-(ADDRESS_LIMIT - row.address - span + 1) // step))
        end = row.address + element * step + span
        return Finding.outside_memory(
            row,
            reason="wraps",
            element=element if strided else None,
            end_address=end,
            layer=layer,
        )
    verdict, hits, partial = _element(index, row, column, layer, whole_pages)
    if elements == 1:
        return verdict
    length, stride = row.length_bytes, step
    for hit in hits:
        if hit.kind == "page" and stride == hit.stride and elements <= hit.limit - hit.block:
            return None
        if (
            hit.kind != "page"
            and stride == length
            and elements * hit.units <= hit.limit - hit.block
        ):
            return None
    for hit in partial:
        pieces = hit.page // length if length else 0
        if (
            length
            and not hit.in_page
            and stride == length
            and length < hit.page
            and hit.page % length == 0
            and elements % pieces == 0
            and (
                elements // pieces <= hit.limit - hit.block
                if hit.contiguous
                else elements == pieces
            )
        ):
            return None
    if verdict is not None:
        return verdict
    hit = hits[0]
    expected = hit.stride if hit.kind == "page" else length
    storage, byte_offset, extent = _where(index, row, 0)
    if stride != expected:
        return Finding.outside_view(
            row,
            reason="stride",
            views=hit.views,
            storage=storage,
            byte_offset=byte_offset,
            extent_bytes=extent,
            block_stride_bytes=expected,
            packed=hit.kind == "blocks",
            layer=layer,
        )
    return Finding.outside_view(
        row,
        reason="count",
        views=hit.views,
        storage=storage,
        byte_offset=byte_offset,
        extent_bytes=extent,
        blocks=(hit.block, hit.block + elements * hit.units - 1),
        num_blocks=hit.limit,
        packed=hit.kind == "blocks",
        layer=layer,
    )


def _where(
    index: _Index, row: Descriptor, element: int
) -> tuple[str | None, int | None, int | None]:
    """The storage an element starts in and the bytes of it the element covers."""
    first = row.address + element * (row.stride_bytes or 0)
    found = index.storage_at(first, row.device)
    if not found:
        return None, None, None
    storage = found[0]
    offset = first - storage.address
    return storage.name, offset, offset + row.length_bytes


def _element(
    index: _Index, row: Descriptor, column: int | None, layer: str | None, whole_pages: bool
) -> tuple[Finding | None, list[_Hit], list[_Hit]]:
    """Element 0 of a row: its finding (or ``None``), the right ways it lies in the views (for
    the layer named, if any) and the partial pages it lies in (for the same layer)."""
    element = 0 if row.count is not None else None
    first, length = row.address, row.length_bytes
    last = first + max(length, 1) - 1
    holders = index.storage_at(first, None)
    if not holders:
        return (
            Finding.outside_memory(row, reason="no_storage", element=element, layer=layer),
            [],
            [],
        )
    if row.device is not None:
        on_device = [s for s in holders if s.device_id == row.device]
        if not on_device:
            storage = holders[0]
            return (
                Finding.outside_memory(
                    row,
                    reason="device",
                    element=element,
                    storage=storage.name,
                    storage_device=storage.device,
                    layer=layer,
                ),
                [],
                [],
            )
        holders = on_device
    storage = holders[0]
    byte_offset, extent = first - storage.address, first - storage.address + length
    storage_last = storage.address + storage.nbytes - 1
    if last > storage_last:
        # Storages next to each other (two allocations) hold all its bytes, or some lie in none.
        following: list[StorageSpan] = []
        reached = storage_last
        while reached < last:
            after = index.storage_at(reached + 1, row.device)
            if not after:
                break
            following.append(after[0])
            reached = after[0].address + after[0].nbytes - 1
        if reached >= last:
            return (
                Finding.outside_view(
                    row,
                    reason="storages",
                    storages=(storage.name, following[0].name),
                    element=element,
                    layer=layer,
                ),
                [],
                [],
            )
        return (
            Finding.outside_memory(
                row,
                reason="past_end",
                element=element,
                storage=storage.name,
                storage_nbytes=storage.nbytes,
                byte_offset=byte_offset,
                extent_bytes=byte_offset + max(length, 1),
                layer=layer,
            ),
            [],
            [],
        )
    every = index.hits(first, last, length, row.device)
    mine = every if column is None else [h for h in every if index.matrix[h.row, column]]
    right = [h for h in mine if h.whole or (h.kind == "page" and not whole_pages)]
    partial = [h for h in mine if h.kind == "page" and not h.whole]
    if right:
        return None, right, partial
    where: dict[str, Any] = {
        "storage": storage.name,
        "byte_offset": byte_offset,
        "extent_bytes": extent,
        "element": element,
    }
    if column is not None and layer is not None:
        elsewhere = [h for h in every if h.whole or (h.kind == "page" and not whole_pages)]
        if elsewhere:
            hit = elsewhere[0]
            return (
                Finding.wrong_layer(
                    row,
                    layer=layer,
                    views=hit.views,
                    blocks=(hit.block, hit.block + hit.units - 1),
                    packed=hit.kind == "blocks",
                    **where,
                ),
                [],
                partial,
            )
    cut = partial or [h for h in every if h.kind == "page" and not h.whole]
    if cut:
        hit = cut[0]
        page_offset = first - hit.in_page - storage.address
        return (
            Finding.partial_page(
                row,
                view=hit.views[0],
                block=hit.block,
                page_offset=page_offset,
                page_bytes=hit.page,
                layer=layer,
                **where,
            ),
            [],
            partial,
        )
    # Walk the pages from the first byte: the first byte in no page, or the pages it spans.
    touched: list[tuple[tuple[str, ...], int]] = []
    address = first
    for _ in range(64):
        page = index.page_at(address, row.device)
        if page is None:
            return (
                Finding.outside_view(
                    row,
                    reason="gap",
                    byte=address,
                    gap_offset=address - storage.address,
                    layer=layer,
                    **where,
                ),
                [],
                partial,
            )
        views, block, page_last = page
        touched.append((views, block))
        if page_last >= last:
            break
        address = page_last + 1
    names = [views for views, _ in touched]
    other = next((i for i, views in enumerate(names) if views != names[0]), None)
    if other is not None:
        return (
            Finding.outside_view(
                row,
                reason="views",
                views=(names[0][0], names[other][0]),
                blocks=(touched[0][1], touched[other][1]),
                layer=layer,
                **where,
            ),
            [],
            partial,
        )
    return (
        Finding.outside_view(
            row,
            reason="pages",
            views=names[0],
            blocks=(touched[0][1], touched[-1][1]),
            layer=layer,
            **where,
        ),
        [],
        partial,
    )
