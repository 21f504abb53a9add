"""Whole-layout checks: every view against its storage and region, its own pages against each
other, and every pair of views of one storage, as plain data. No torch.

``check_views`` is the one place where a set of block views is judged; a plan file
(``safeview check``) and a live registration (``safeview.kv.block_views``) both come here.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from safeview import _arith
from safeview._arith import Blocks
from safeview.check import bounds_violations
from safeview.errors import ArgumentError
from safeview.overlap import Overlap, overlaps_among
from safeview.spec import Region

__all__ = ["Finding", "Kind", "Report", "ViewRecord", "ViewRow", "check_views"]

Kind = Literal["out_of_bounds", "out_of_region", "self_overlap", "overlap"]


class ViewRecord(NamedTuple):
    """One view to check: ``shape`` and ``strides`` (in elements of ``itemsize`` bytes) from
    ``byte_offset`` of storage ``storage``. The numbers are not validated beyond being integers,
    so that a broken layout can be reported instead of refused. ``ViewRecord.block`` makes the
    record of a block view."""

    name: str
    storage: str
    byte_offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    itemsize: int = 1
    group: Hashable | None = None
    region: Region | None = None

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
        region: Region | None = None,
    ) -> ViewRecord:
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
        return _arith.extent_bytes(self.byte_offset, self.shape, self.strides, self.itemsize)

    @property
    def as_blocks(self) -> Blocks | None:
        """The view as one run of int8 pages, if it is one (the common case, checked fast)."""
        if self.itemsize == 1 and len(self.shape) == 2 and self.strides[1] == 1:
            return Blocks(self.byte_offset, self.shape[0], self.strides[0], self.shape[1])
        return None

    @property
    def nbytes(self) -> int:
        """Bytes the view holds, not counting gaps (or counting twice what it touches twice)."""
        count = self.itemsize
        for size in self.shape:
            count *= size
        return count

    def self_overlap_message(self, overlap: _arith.SelfOverlap) -> tuple[str, int]:
        """Why this view touches some byte twice, and the first such byte."""
        if self.itemsize == 1 and len(self.shape) == 2 and self.strides[1] == 1:
            num_blocks, page_bytes = self.shape
            stride = self.strides[0]
            byte = self.byte_offset + stride
            return (
                f"view {self.name!r} has block_stride_bytes={stride} smaller than "
                f"page_bytes={page_bytes}: each of its {num_blocks} pages shares "
                f"{page_bytes - stride} bytes with the next, from byte {byte} on",
                byte,
            )
        byte = self.byte_offset + overlap.stride * self.itemsize
        return (
            f"view {self.name!r} (shape {self.shape}, strides {self.strides}) touches some "
            f"elements twice: axis {overlap.axis} (size {overlap.size}, stride {overlap.stride}) "
            f"steps no further than the {overlap.reach} elements its faster axes reach",
            byte,
        )


@dataclass(frozen=True, slots=True)
class Finding:
    """One violation: its ``kind``, the views involved, their storage, a sentence, and numbers."""

    kind: Kind
    views: tuple[str, ...]
    storage: str
    message: str
    numbers: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "views": list(self.views),
            "storage": self.storage,
            "message": self.message,
            **self.numbers,
        }


class ViewRow(NamedTuple):
    """One line of the report: where a view ends, how much room is left, and what is wrong."""

    name: str
    storage: str
    group: Hashable | None
    byte_offset: int
    extent_bytes: int
    storage_nbytes: int
    kinds: tuple[Kind, ...] = ()

    @property
    def slack_bytes(self) -> int:
        return self.storage_nbytes - self.extent_bytes

    @property
    def status(self) -> str:
        return ", ".join(dict.fromkeys(self.kinds)) if self.kinds else "ok"

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "storage": self.storage,
            "group": self.group,
            "byte_offset": self.byte_offset,
            "extent_bytes": self.extent_bytes,
            "storage_nbytes": self.storage_nbytes,
            "slack_bytes": self.slack_bytes,
            "status": self.status,
        }


@dataclass(frozen=True, slots=True)
class Report:
    """Every view's row and every finding, in the order of the views."""

    rows: tuple[ViewRow, ...]
    findings: tuple[Finding, ...]
    storages: dict[str, int]

    @property
    def ok(self) -> bool:
        return not self.findings

    def of_kind(self, kind: Kind) -> list[Finding]:
        return [finding for finding in self.findings if finding.kind == kind]

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "storages": [{"name": n, "nbytes": b} for n, b in self.storages.items()],
            "views": [row.to_json() for row in self.rows],
            "violations": [finding.to_json() for finding in self.findings],
        }

    def table(self) -> str:
        """The rows as an aligned text table, one block per storage."""
        lines = []
        for storage, nbytes in self.storages.items():
            rows = [row for row in self.rows if row.storage == storage]
            lines.append(f"storage {storage!r}: {nbytes:,} bytes, {len(rows)} views")
            cells = [("view", "group", "offset", "extent", "slack", "status")]
            for row in rows:
                cells.append(
                    (
                        row.name,
                        "-" if row.group is None else str(row.group),
                        f"{row.byte_offset:,}",
                        f"{row.extent_bytes:,}",
                        f"{row.slack_bytes:,}",
                        row.status,
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


def _overlap_finding(overlap: Overlap, storage: str) -> Finding:
    return Finding(
        "overlap",
        (overlap.first, overlap.second),
        storage,
        overlap.message() + f" of storage {storage!r}",
        {"byte": overlap.byte, "group": overlap.group},
    )


def check_views(
    storages: Mapping[str, int], views: Sequence[ViewRecord], *, checks: bool = True
) -> Report:
    """Check every view and every pair of views of each storage.

    Kinds: ``out_of_bounds`` (past the end of the storage), ``out_of_region``, ``self_overlap``
    (pages that overlap their neighbours: ``block_stride_bytes < page_bytes``) and ``overlap`` (two
    views of one group, or without a group, that share a byte). A self-overlapping view is left out
    of the pairwise check; its finding already says what is wrong. With ``checks=False`` only the
    rows are computed (the ``off`` policy).
    """
    findings: list[Finding] = []
    kinds: dict[str, list[Kind]] = defaultdict(list)
    pieces: dict[str, dict[str, list[Blocks]]] = defaultdict(dict)
    groups: dict[str, dict[str, Hashable | None]] = defaultdict(dict)
    extents: dict[str, int] = {}
    for view in views:
        end = view.extent_bytes
        extents[view.name] = end
        nbytes = storages[view.storage]
        if not checks:
            continue
        broken = (
            bounds_violations(
                name=view.name,
                byte_offset=view.byte_offset,
                extent_bytes=end,
                storage_nbytes=nbytes,
                region=view.region,
            )
            if end > nbytes or view.region is not None
            else ()
        )
        for violation in broken:
            kind: Kind = "out_of_bounds" if violation.check == "storage" else "out_of_region"
            findings.append(
                Finding(
                    kind,
                    (view.name,),
                    view.storage,
                    violation.message(view.storage),
                    {
                        "extent_bytes": end,
                        "limit_bytes": violation.limit_bytes,
                        "overflow_bytes": violation.overflow_bytes,
                    },
                )
            )
            kinds[view.name].append(kind)
        block = view.as_blocks
        if block is not None:
            # the 2-d int8 case of the rules below: pages overlap iff stride < page
            overlap = (
                _arith.SelfOverlap(0, block.number, block.stride, block.run - 1)
                if block.number > 1 and block.stride < block.run
                else None
            )
        else:
            overlap = _arith.self_overlap(view.shape, view.strides)
        if overlap is not None:
            message, byte = view.self_overlap_message(overlap)
            findings.append(
                Finding("self_overlap", (view.name,), view.storage, message, {"byte": byte})
            )
            kinds[view.name].append("self_overlap")
            continue
        if block is not None:
            pieces[view.storage][view.name] = [block] if block.number else []
        else:
            try:
                pieces[view.storage][view.name] = _arith.blocks(
                    view.byte_offset, view.shape, view.strides, view.itemsize
                )
            except ValueError as error:  # too many pieces to decide exactly
                raise ArgumentError(f"view {view.name!r}: {error}") from None
        groups[view.storage][view.name] = view.group
    for storage, named in pieces.items():
        for found in overlaps_among(named, groups=groups[storage]):
            findings.append(_overlap_finding(found, storage))
            kinds[found.first].append("overlap")
            kinds[found.second].append("overlap")
    rows = tuple(
        ViewRow(
            view.name,
            view.storage,
            view.group,
            view.byte_offset,
            extents[view.name],
            storages[view.storage],
            tuple(kinds.get(view.name, ())),
        )
        for view in views
    )
    return Report(rows, tuple(findings), dict(storages))
