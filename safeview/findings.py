"""What can be wrong with a view: one ``Finding`` type, one ``kind`` vocabulary, one message per
kind. Plain data; imports nothing of safeview, torch or pydantic.

=================  ==========================================================================
``kind``           the invariant that is broken
=================  ==========================================================================
``out_of_bounds``  a view needs bytes past the end of its storage
``out_of_region``  a view needs bytes outside the region it was given
``self_overlap``   a view touches some byte twice (pages closer than a page apart)
``overlap``        two views that must not share bytes do
=================  ==========================================================================

Every finding is built by one of the four constructors below, which also write its sentence;
errors (``safeview.errors``), events (``safeview.log``) and the command line all read the same
finding instead of deriving the facts again.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

__all__ = ["KINDS", "Finding", "Kind"]

Kind = Literal["out_of_bounds", "out_of_region", "self_overlap", "overlap"]
KINDS: tuple[Kind, ...] = get_args(Kind)


def _view(name: str | None, empty: bool = False) -> str:
    if name is None:
        return "the empty view" if empty else "the view"
    return f"empty view {name!r}" if empty else f"view {name!r}"


def _storage(storage: str | None) -> str:
    return f"storage {storage!r}" if storage is not None else "the storage"


@dataclass(frozen=True, slots=True)
class Finding:
    """One broken invariant of one view (or of one pair of views), with its numbers.

    ``views`` holds one name (two for ``overlap``); ``storage`` names the storage in a plan or a
    registration (``None`` for a single ``make_view``). Bounds findings fill ``byte_offset``,
    ``extent_bytes`` (exclusive end), ``limit_bytes`` (storage size, or the end of the region),
    ``overflow_bytes`` (bytes of the view's span that lie outside; for an empty view, how far its
    offset lies outside) and, for ``out_of_region``, ``region``. Overlap findings fill ``byte``,
    the lowest byte found in both (in a ``self_overlap``, the first byte its own pages share, when
    it can be named exactly) and ``group``.
    """

    kind: Kind
    views: tuple[str, ...]
    storage: str | None
    message: str
    byte_offset: int | None = None
    extent_bytes: int | None = None
    limit_bytes: int | None = None
    overflow_bytes: int | None = None
    region: tuple[int, int] | None = None
    byte: int | None = None
    group: Hashable | None = None

    @property
    def check(self) -> Literal["storage", "region"] | None:
        """The bound a bounds finding breaks, as the ``check`` key of ``bounds_violation``
        names it."""
        if self.kind == "out_of_bounds":
            return "storage"
        if self.kind == "out_of_region":
            return "region"
        return None

    @property
    def slack_bytes(self) -> int | None:
        """``limit_bytes - extent_bytes``: negative when past the limit."""
        if self.limit_bytes is None or self.extent_bytes is None:
            return None
        return self.limit_bytes - self.extent_bytes

    def to_json(self) -> dict[str, Any]:
        """The finding as a JSON object: ``kind``, ``views``, ``storage``, ``message`` and the
        numbers that apply to its kind."""
        data: dict[str, Any] = {
            "kind": self.kind,
            "views": list(self.views),
            "storage": self.storage,
            "message": self.message,
        }
        if self.kind in ("out_of_bounds", "out_of_region"):
            data.update(
                byte_offset=self.byte_offset,
                extent_bytes=self.extent_bytes,
                limit_bytes=self.limit_bytes,
                overflow_bytes=self.overflow_bytes,
            )
            if self.region is not None:
                data["region"] = list(self.region)
        else:
            data.update(byte=self.byte, group=_json_group(self.group))
        return data

    # -- the four constructors: one rule, one sentence each --------------------------------------

    @classmethod
    def out_of_bounds(
        cls,
        name: str | None,
        *,
        storage: str | None,
        byte_offset: int,
        extent_bytes: int,
        storage_nbytes: int,
    ) -> Finding:
        """``[byte_offset, extent_bytes)`` reaches past ``storage_nbytes``."""
        empty = extent_bytes == byte_offset
        if empty:
            overflow = byte_offset - storage_nbytes
            needs = f"starts at byte {byte_offset}"
        else:
            overflow = (extent_bytes - byte_offset) - max(0, storage_nbytes - byte_offset)
            needs = f"needs bytes [{byte_offset}, {extent_bytes})"
        what = _view(name, empty)
        return cls(
            "out_of_bounds",
            (name,) if name is not None else (),
            storage,
            f"{what} {needs} but {_storage(storage)} has {storage_nbytes} bytes "
            f"({overflow} bytes past the end)",
            byte_offset=byte_offset,
            extent_bytes=extent_bytes,
            limit_bytes=storage_nbytes,
            overflow_bytes=overflow,
        )

    @classmethod
    def out_of_region(
        cls,
        name: str | None,
        *,
        storage: str | None,
        byte_offset: int,
        extent_bytes: int,
        region: tuple[int, int],
        before: int,
        after: int,
    ) -> Finding:
        """``[byte_offset, extent_bytes)`` has ``before`` bytes before ``region`` and ``after``
        bytes past it."""
        start, end = region
        empty = extent_bytes == byte_offset
        parts = []
        if before:
            parts.append(f"{before} bytes before its start")
        if after:
            parts.append(f"{after} bytes past its end")
        needs = (
            f"starts at byte {byte_offset}"
            if empty
            else (f"needs bytes [{byte_offset}, {extent_bytes})")
        )
        what = _view(name, empty)
        return cls(
            "out_of_region",
            (name,) if name is not None else (),
            storage,
            f"{what} {needs} but its region is [{start}, {end}) ({' and '.join(parts)})",
            byte_offset=byte_offset,
            extent_bytes=extent_bytes,
            limit_bytes=end,
            overflow_bytes=before + after,
            region=(start, end),
        )

    @classmethod
    def self_overlap(
        cls,
        name: str | None,
        *,
        storage: str | None,
        byte_offset: int,
        shape: Sequence[int],
        strides: Sequence[int],
        itemsize: int,
        axis: int,
        reach: int,
        block: bool,
        group: Hashable | None = None,
    ) -> Finding:
        """Axis ``axis`` steps no further than ``reach`` elements, the farthest its faster axes
        already go (Rust ndarray's rule). ``block``: the view is a ``(num_blocks, page_bytes)``
        block view, and the sentence speaks of its block stride and page."""
        stride = strides[axis]
        byte: int | None
        if block:
            num_blocks, page_bytes = shape
            byte = byte_offset + stride
            message = (
                f"{_view(name)} has block_stride_bytes={stride} smaller than "
                f"page_bytes={page_bytes}: each of its {num_blocks} pages shares "
                f"{page_bytes - stride} bytes with the next, from byte {byte} on (a stride of "
                "one kernel block or of one half of a K/V split taken as the block stride?)"
            )
        else:
            # The rule is exact for a stride of 0 (every step lands on the same bytes); for other
            # strides it may refuse a view that only interleaves, so no byte is named.
            byte = byte_offset if stride == 0 else None
            message = (
                f"{_view(name)} (shape {tuple(shape)}, strides {tuple(strides)}) may touch some "
                f"elements twice: axis {axis} (size {shape[axis]}, stride {stride}) steps no "
                f"further than the {reach} elements its faster axes reach"
            )
        return cls(
            "self_overlap",
            (name,) if name is not None else (),
            storage,
            message,
            byte=byte,
            group=group,
        )

    @classmethod
    def overlap(
        cls, first: str, second: str, *, storage: str | None, byte: int, group: Hashable | None
    ) -> Finding:
        """Views ``first`` and ``second`` both use ``byte``."""
        in_group = f" (group {group!r})" if group is not None else ""
        of = f" of {_storage(storage)}" if storage is not None else ""
        return cls(
            "overlap",
            (first, second),
            storage,
            f"views {first!r} and {second!r}{in_group} both use byte {byte}{of}",
            byte=byte,
            group=group,
        )


def _json_group(group: Hashable | None) -> str | int | None:
    if group is None or (isinstance(group, (str, int)) and not isinstance(group, bool)):
        return group
    return str(group)
