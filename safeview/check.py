"""The one checker: plain records in, findings out. No torch, no pydantic.

Every judgement safeview makes is one of the rules here, with one message each (the sentences
live in ``safeview.findings``):

- ``bounds``: a view inside its storage and its region (the empty-view rule included);
- ``self_overlap``: a view that touches no byte twice (Rust ndarray's rule);
- ``check_views``: both of the above for every view, then every pair of views over one memory
  (``safeview.overlap``), scoped by KV-cache group.

``make_view`` asks ``bounds`` about one view; a plan (``safeview check``), a live registration
(``safeview.kv``), a tensor check and the sanitizer ask ``check_views`` about many.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from safeview import _arith
from safeview._arith import Blocks
from safeview.errors import ArgumentError
from safeview.findings import Finding, Kind
from safeview.overlap import Pieces, overlapping_pairs

__all__ = [
    "Report",
    "StorageRecord",
    "ViewRecord",
    "bounds",
    "check_views",
    "self_overlap",
]


class ViewRecord(NamedTuple):
    """One view to check: ``shape`` and ``strides`` in elements of ``itemsize`` bytes, from
    ``byte_offset`` of the storage named ``storage``. Not validated beyond being integers, so that
    a broken view is reported instead of refused. ``group`` is its KV-cache group (views of two
    different groups may share bytes; a view without a group shares with none); ``region`` the
    ``(start, end)`` byte range it must stay inside; ``dtype`` names the element type in events
    (``int8`` when not given for a one-byte item)."""

    name: str
    storage: str
    byte_offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    itemsize: int = 1
    group: Hashable | None = None
    region: tuple[int, int] | None = None
    dtype: str | None = None

    @classmethod
    def block(
        cls,
        name: str,
        storage: str,
        *,
        num_blocks: int,
        page_bytes: int,
        block_stride_bytes: int,
        byte_offset: int,
        group: Hashable | None = None,
        region: tuple[int, int] | None = None,
    ) -> ViewRecord:
        """The int8 ``(num_blocks, page_bytes)`` view with strides ``(block_stride_bytes, 1)``."""
        return cls(
            name,
            storage,
            byte_offset,
            (num_blocks, page_bytes),
            (block_stride_bytes, 1),
            1,
            group,
            region,
        )

    @property
    def extent_bytes(self) -> int:
        """Exclusive end byte (the offset, for an empty view)."""
        return _arith.extent_bytes(self.byte_offset, self.shape, self.strides, self.itemsize)

    @property
    def nbytes(self) -> int:
        """Bytes the view holds, gaps not counted (bytes touched twice counted twice)."""
        count = self.itemsize
        for size in self.shape:
            count *= size
        return count

    @property
    def is_block(self) -> bool:
        """Whether it is a ``(num_blocks, page_bytes)`` int8 block view."""
        return self.itemsize == 1 and len(self.shape) == 2 and self.strides[1] == 1


class StorageRecord(NamedTuple):
    """A storage: ``nbytes``, and where its bytes lie. Storages with the same ``memory`` key are
    one address space, byte 0 of this one at ``base`` in it: their views are compared with each
    other (two storage objects over the same memory, as ``torch.frombuffer`` twice, DLPack or a
    virtual-memory allocator make). ``memory=None``: a memory of its own."""

    nbytes: int
    memory: Hashable | None = None
    base: int = 0


def bounds(
    name: str | None,
    *,
    storage: str | None,
    byte_offset: int,
    extent_bytes: int,
    storage_nbytes: int,
    region: tuple[int, int] | None = None,
) -> list[Finding]:
    """Every bound that the view ``[byte_offset, extent_bytes)`` breaks: storage, then region.

    An empty view (``extent_bytes == byte_offset``) must still start inside, at most at the end:
    numpy and Rust ndarray refuse an empty view that starts past the end, and torch does not.
    """
    found = []
    if extent_bytes > storage_nbytes:
        found.append(
            Finding.out_of_bounds(
                name,
                storage=storage,
                byte_offset=byte_offset,
                extent_bytes=extent_bytes,
                storage_nbytes=storage_nbytes,
            )
        )
    if region is not None:
        start, end = region
        if extent_bytes == byte_offset:
            before, after = max(0, start - byte_offset), max(0, byte_offset - end)
        else:
            before = max(0, min(extent_bytes, start) - byte_offset)
            after = max(0, extent_bytes - max(byte_offset, end))
        if before or after:
            found.append(
                Finding.out_of_region(
                    name,
                    storage=storage,
                    byte_offset=byte_offset,
                    extent_bytes=extent_bytes,
                    region=(start, end),
                    before=before,
                    after=after,
                )
            )
    return found


def self_overlap(
    name: str | None,
    *,
    storage: str | None,
    byte_offset: int,
    shape: Sequence[int],
    strides: Sequence[int],
    itemsize: int,
    block: bool = False,
    group: Hashable | None = None,
) -> Finding | None:
    """The finding when the view touches some byte twice, else ``None``.

    Rust ndarray's rule (``_arith.self_overlap``); for a 2-d int8 view with an inner stride of 1
    it reads ``num_blocks > 1 and block_stride_bytes < page_bytes``. ``block``: the view is a
    block view (a ``BlockLayout``, a plan's view), and the message speaks of its block stride.
    """
    if len(shape) == 2 and itemsize == 1 and strides[1] == 1:
        # the block case, decided without sorting axes: the common one by far
        if shape[0] < 2 or shape[1] == 0 or strides[0] >= shape[1]:
            return None
        if shape[1] == 1:  # one byte per page: the page axis does not count
            if strides[0] > 0:
                return None
            axis, reach = 0, 0
        else:
            axis, reach = 0, shape[1] - 1
    else:
        found = _arith.self_overlap(shape, strides)
        if found is None:
            return None
        axis, reach = found.axis, found.reach
    return Finding.self_overlap(
        name,
        storage=storage,
        byte_offset=byte_offset,
        shape=shape,
        strides=strides,
        itemsize=itemsize,
        axis=axis,
        reach=reach,
        block=block and axis == 0 and len(shape) == 2 and itemsize == 1,
        group=group,
    )


def pieces(record: ViewRecord) -> list[Blocks]:
    """The bytes a view that passed ``self_overlap`` touches, as runs of equally spaced blocks.

    Raises ``ArgumentError`` for a view that splits into more runs than are checked exactly.
    """
    if record.is_block:
        number, run = record.shape
        if not number or not run:
            return []
        # one block is never stepped over: its stride may be anything, 0 included
        stride = record.strides[0] if number > 1 else run
        return [Blocks(record.byte_offset, number, stride, run)]
    try:
        return _arith.blocks(record.byte_offset, record.shape, record.strides, record.itemsize)
    except ValueError as error:
        raise ArgumentError(f"view {record.name!r}: {error}") from None


@dataclass(frozen=True, slots=True)
class Report:
    """What ``check_views`` found: the storages (name -> bytes), every view in the order given,
    and every finding (bounds and self-overlaps in view order, then overlapping pairs)."""

    storages: dict[str, int]
    views: tuple[ViewRecord, ...]
    findings: tuple[Finding, ...]

    @property
    def ok(self) -> bool:
        return not self.findings

    def of_kind(self, *kinds: Kind) -> list[Finding]:
        """The findings of these kinds, in order."""
        return [finding for finding in self.findings if finding.kind in kinds]

    def kinds_of(self) -> dict[str, list[Kind]]:
        """View name -> the kinds of the findings that name it."""
        kinds: dict[str, list[Kind]] = defaultdict(list)
        for finding in self.findings:
            for name in finding.views:
                kinds[name].append(finding.kind)
        return kinds

    def rows(self) -> list[dict[str, Any]]:
        """A row per view: name, storage, group, offset, extent, slack and status."""
        kinds = self.kinds_of()
        rows = []
        for view in self.views:
            extent = view.extent_bytes
            nbytes = self.storages[view.storage]
            listed = kinds.get(view.name)
            rows.append(
                {
                    "name": view.name,
                    "storage": view.storage,
                    "group": view.group,
                    "byte_offset": view.byte_offset,
                    "extent_bytes": extent,
                    "storage_nbytes": nbytes,
                    "slack_bytes": nbytes - extent,
                    "status": ", ".join(dict.fromkeys(listed)) if listed else "ok",
                }
            )
        return rows

    def min_slack_bytes(self) -> int | None:
        """The least room left between a view's end and its storage's end."""
        if not self.views:
            return None
        return min(self.storages[view.storage] - view.extent_bytes for view in self.views)

    def to_json(self) -> dict[str, Any]:
        rows = self.rows()
        for row in rows:
            group = row["group"]
            if not (group is None or isinstance(group, (str, int))):
                row["group"] = str(group)
        return {
            "ok": self.ok,
            "storages": [{"name": n, "nbytes": b} for n, b in self.storages.items()],
            "views": rows,
            "violations": [finding.to_json() for finding in self.findings],
        }

    def table(self) -> str:
        """The rows as an aligned text table, one block per storage."""
        lines = []
        rows = self.rows()
        for storage, nbytes in self.storages.items():
            mine = [row for row in rows if row["storage"] == storage]
            lines.append(f"storage {storage!r}: {nbytes:,} bytes, {len(mine)} views")
            cells = [("view", "group", "offset", "extent", "slack", "status")]
            for row in mine:
                cells.append(
                    (
                        row["name"],
                        "-" if row["group"] is None else str(row["group"]),
                        f"{row['byte_offset']:,}",
                        f"{row['extent_bytes']:,}",
                        f"{row['slack_bytes']:,}",
                        row["status"],
                    )
                )
            widths = [max(len(line[i]) for line in cells) for i in range(len(cells[0]))]
            for line in cells:
                text = "  ".join(
                    cell.ljust(width) if i in (0, 1, 5) else cell.rjust(width)
                    for i, (cell, width) in enumerate(zip(line, widths))
                )
                lines.append("  " + text.rstrip())
        return "\n".join(lines)


class _Memory:
    """The views over one memory that take part in the pairwise check: their positions in the
    caller's list (``indices``), their storages and groups, and their runs as columns of
    integers (``safeview.overlap.Pieces``: no object per view)."""

    __slots__ = ("groups", "indices", "pieces", "storages")

    def __init__(self) -> None:
        self.indices: list[int] = []
        self.storages: list[str] = []
        self.groups: list[Hashable | None] = []
        self.pieces = Pieces()


def check_views(
    storages: Mapping[str, int | StorageRecord],
    views: Iterable[ViewRecord],
    *,
    checks: bool = True,
) -> Report:
    """Check every view, and every pair of views over one memory.

    ``storages`` maps each storage named by a view to its size in bytes, or to a
    ``StorageRecord`` that also says which memory it lies in. Each view is checked against its
    storage and region (``bounds``) and against itself (``self_overlap``); then every pair of
    views that may not share bytes is checked exactly (``safeview.overlap``). A view that overlaps
    itself is left out of the pairwise check: its own finding already says what is wrong. With
    ``checks=False`` nothing is checked (the ``off`` policy) and the report has no findings.
    Arguments of the wrong kind raise ``ArgumentError``.
    """
    if not isinstance(storages, Mapping):
        raise ArgumentError(
            "storages must be a mapping of storage names to sizes in bytes or StorageRecords; "
            f"got {type(storages).__name__}"
        )
    records = {}
    for name, value in storages.items():
        if type(value) is StorageRecord:
            records[name] = value
        elif type(value) is int and value >= 0:
            records[name] = StorageRecord(value)
        else:
            raise ArgumentError(
                f"storages[{name!r}] must be a size in bytes (an int >= 0) or a StorageRecord; "
                f"got {value!r} ({type(value).__name__})"
            )
    try:
        views = tuple(views)
    except TypeError:
        raise ArgumentError(
            f"views must be an iterable of ViewRecords; got {type(views).__name__}"
        ) from None
    sizes = {name: record.nbytes for name, record in records.items()}
    if not checks:
        for view in views:
            if type(view) is not ViewRecord and not isinstance(view, ViewRecord):
                raise _not_a_record(view)
        return Report(sizes, views, ())
    findings: list[Finding] = []
    memories: dict[Hashable, _Memory] = {}
    last_storage: str | None = None
    storage = StorageRecord(0)
    memory: _Memory | None = None
    for index, view in enumerate(views):
        if type(view) is not ViewRecord and not isinstance(view, ViewRecord):
            raise _not_a_record(view)
        name, storage_name, offset, shape, strides, itemsize, group, region, dtype = view
        if storage_name != last_storage:  # views come in runs of one storage: look it up once
            known = records.get(storage_name)
            if known is None:
                raise ArgumentError(
                    f"view {name!r} names storage {storage_name!r}, which is not listed"
                )
            storage, last_storage, memory = known, storage_name, None
        block = itemsize == 1 and len(shape) == 2 and strides[1] == 1
        if block:
            number, run = shape
            stride = strides[0]
            end = offset + (number - 1) * stride + run if number and run else offset
        else:
            end = _arith.extent_bytes(offset, shape, strides, itemsize)
        if end > storage.nbytes or region is not None:
            findings += bounds(
                name,
                storage=storage_name,
                byte_offset=offset,
                extent_bytes=end,
                storage_nbytes=storage.nbytes,
                region=region,
            )
        if not block or (number > 1 and stride < run):
            overlap = self_overlap(
                name,
                storage=storage_name,
                byte_offset=offset,
                shape=shape,
                strides=strides,
                itemsize=itemsize,
                block=block and dtype is None,
                group=group,
            )
            if overlap is not None:
                findings.append(overlap)
                continue
        if memory is None:  # the first view of a run of one storage that takes part
            key = storage.memory if storage.memory is not None else ("storage", storage_name)
            memory = memories.get(key)
            if memory is None:
                memory = memories[key] = _Memory()
            base = storage.base
            # the memory's columns, bound once per run of views (safeview.overlap.Pieces)
            add_index, add_storage, add_group = (
                memory.indices.append,
                memory.storages.append,
                memory.groups.append,
            )
            columns = memory.pieces
            add_offset, add_number, add_stride, add_run, add_owner = (
                columns.offsets.append, columns.numbers.append, columns.strides.append,
                columns.runs.append, columns.owners.append,
            )  # fmt: skip
        if block and not (number and run):
            continue  # an empty view shares nothing
        position = len(memory.indices)
        add_index(index)
        add_storage(storage_name)
        add_group(group)
        if block:  # Pieces.add, inlined: this loop runs once per view of a plan
            if number == 1 or stride == run:
                run *= number
                number, stride = 1, run
            add_offset(offset + base)
            add_number(number)
            add_stride(stride)
            add_run(run)
            add_owner(position)
        else:
            for part in pieces(view):
                columns.add(part.offset + base, part.number, part.stride, part.run, position)
    for memory in memories.values():
        findings += _pairs(memory, views, records)
    return Report(sizes, views, tuple(findings))


def _not_a_record(value: object) -> ArgumentError:
    return ArgumentError(
        f"views must hold safeview.check.ViewRecord tuples; got {type(value).__name__}"
    )


def _pairs(
    memory: _Memory, views: Sequence[ViewRecord], records: Mapping[str, StorageRecord]
) -> list[Finding]:
    """The overlap findings among the views of one memory."""
    if len(memory.indices) < 2:
        return []
    indices = memory.indices
    found = []
    for (a, b), byte in overlapping_pairs(
        memory.pieces, memory.groups, lambda position: views[indices[position]].name
    ):
        first, second = views[indices[a]], views[indices[b]]
        storage = memory.storages[a]
        found.append(
            Finding.overlap(
                first.name,
                second.name,
                storage=storage,
                byte=byte - records[storage].base,
                group=first.group if first.group == second.group else None,
            )
        )
    return found
