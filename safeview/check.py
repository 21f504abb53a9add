"""Bounds checks: does a layout stay inside its storage and its region? Plain integers, no torch.

The same functions serve ``make_view`` (live tensors) and ``safeview check`` (plan files), so a
plan and a live registration are judged by one rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from safeview.spec import Region

__all__ = ["Violation", "bounds_violations"]


def _view(name: str | None) -> str:
    return f"view {name!r}" if name is not None else "the view"


@dataclass(frozen=True, slots=True)
class Violation:
    """One broken bound of one view.

    ``check`` is ``"storage"`` (the view needs bytes past the end of its storage) or ``"region"``
    (it needs bytes outside its region). ``limit_bytes`` is the storage size or the region's end;
    ``overflow_bytes`` counts the view's bytes that lie outside (for an empty view, how far its
    offset lies past the limit).
    """

    check: Literal["storage", "region"]
    name: str | None
    byte_offset: int
    extent_bytes: int
    limit_bytes: int
    overflow_bytes: int
    region: Region | None = None

    @property
    def slack_bytes(self) -> int:
        return self.limit_bytes - self.extent_bytes

    def message(self, storage: str | None = None) -> str:
        """The violation in one sentence, with every number; ``storage`` names the storage."""
        empty = self.extent_bytes == self.byte_offset
        the_storage = "the storage" if storage is None else f"storage {storage!r}"
        if self.check == "storage":
            if empty:
                return (
                    f"empty {_view(self.name)} starts at byte {self.byte_offset} but "
                    f"{the_storage} has {self.limit_bytes} bytes "
                    f"({self.overflow_bytes} bytes past the end)"
                )
            return (
                f"{_view(self.name)} needs bytes [{self.byte_offset}, {self.extent_bytes}) but "
                f"{the_storage} has {self.limit_bytes} bytes "
                f"({self.overflow_bytes} bytes past the end)"
            )
        assert self.region is not None
        start, end = self.region.start_byte, self.region.end_byte
        before = max(0, start - self.byte_offset)
        after = max(0, self.extent_bytes - end)
        parts = []
        if before:
            parts.append(f"{before} bytes before its start")
        if after:
            parts.append(f"{after} bytes past its end")
        needs = (
            f"starts at byte {self.byte_offset}"
            if empty
            else f"needs bytes [{self.byte_offset}, {self.extent_bytes})"
        )
        what = "empty " + _view(self.name) if empty else _view(self.name)
        return f"{what} {needs} but its region is [{start}, {end}) ({' and '.join(parts)})"

    def fields(self) -> dict[str, Any]:
        """Log event fields of this violation."""
        return {
            "check": self.check,
            "limit_bytes": self.limit_bytes,
            "slack_bytes": self.slack_bytes,
            "overflow_bytes": self.overflow_bytes,
            "message": self.message(),
        }


def bounds_violations(
    *,
    name: str | None,
    byte_offset: int,
    extent_bytes: int,
    storage_nbytes: int,
    region: Region | None = None,
) -> list[Violation]:
    """Every bound that the view ``[byte_offset, extent_bytes)`` breaks: storage, then region.

    An empty view (``extent_bytes == byte_offset``) must still start inside, at most at the end:
    numpy and Rust ndarray refuse an empty view that starts past the end, and torch does not.
    """
    found = []
    if extent_bytes > storage_nbytes:
        found.append(
            Violation(
                "storage",
                name,
                byte_offset,
                extent_bytes,
                storage_nbytes,
                extent_bytes - storage_nbytes,
            )
        )
    if region is not None:
        start, end = region.start_byte, region.end_byte
        if extent_bytes == byte_offset:
            outside = max(0, start - byte_offset) + max(0, byte_offset - end)
        else:
            # Bytes of [byte_offset, extent_bytes) that fall outside [start, end).
            inside = max(0, min(extent_bytes, end) - max(byte_offset, start))
            outside = (extent_bytes - byte_offset) - inside
        if outside:
            found.append(Violation("region", name, byte_offset, extent_bytes, end, outside, region))
    return found
