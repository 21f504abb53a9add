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

Descriptors handed to a transfer engine (``safeview.transfer``) have kinds of their own:

==========================  =================================================================
``kind``                    the invariant that is broken
==========================  =================================================================
``outside_memory``          a descriptor's bytes lie (partly) in no storage of the registration
``outside_view``            inside the storages but not whole pages of one view (a gap, two
                            pages, two layers, a stride that is not the view's)
``partial_page``            inside one page but not all of it (with ``whole_pages=True``)
``wrong_layer``             whole pages, but of another layer than the one it is meant for
``overlapping_writes``      two descriptors of one batch write the same byte
``duplicate_registration``  a region registered with an engine overlaps one registered before
``unregistered``            a layer to be transferred, or part of one, is in no descriptor list
                            prepared for its transfers (``safeview.transfer.coverage``)
==========================  =================================================================

Two manifests compared by ``safeview.diff`` have the kinds ``byte`` (a byte a receiver reads as
something else than what its sender wrote there), ``dtype``, ``missing_layer``, ``missing_rank``
and ``refused`` (a pair the connector refuses); two digests of one request's meaning
(``safeview.verify``) have ``digest`` (a layer's heads the receiver holds otherwise than the sender
digested them) and ``digest_unmatched`` (heads, or token counts, that no digest of the other side
covers); their constructors are the last below.

Every finding is built by one of the constructors below, which also write its sentence;
errors (``safeview.errors``), events (``safeview.log``) and the command line all read the same
finding instead of deriving the facts again.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, get_args

if TYPE_CHECKING:
    from safeview.manifest.diff import Meaning

__all__ = [
    "DESCRIPTOR_KINDS",
    "DIFF_KINDS",
    "DIGEST_KINDS",
    "KINDS",
    "Descriptor",
    "Finding",
    "Kind",
]

Kind = Literal[
    "out_of_bounds",
    "out_of_region",
    "self_overlap",
    "overlap",
    "outside_memory",
    "outside_view",
    "partial_page",
    "wrong_layer",
    "overlapping_writes",
    "duplicate_registration",
    "unregistered",
    "byte",
    "dtype",
    "missing_layer",
    "missing_rank",
    "refused",
    "digest",
    "digest_unmatched",
]
KINDS: tuple[Kind, ...] = get_args(Kind)
DESCRIPTOR_KINDS: tuple[Kind, ...] = KINDS[4:11]
"""The kinds of ``safeview.transfer``: descriptors handed to a transfer engine."""
DIFF_KINDS: tuple[Kind, ...] = KINDS[11:16]
"""The kinds of ``safeview.diff``: two manifests that read a layer's bytes differently."""
DIGEST_KINDS: tuple[Kind, ...] = KINDS[16:]
"""The kinds of ``safeview.verify``: two digests of one request's meaning that differ."""


def _view(name: str | None, empty: bool = False) -> str:
    if name is None:
        return "the empty view" if empty else "the view"
    return f"empty view {name!r}" if empty else f"view {name!r}"


def _storage(storage: str | None) -> str:
    return f"storage {storage!r}" if storage is not None else "the storage"


def _n(number: int | None) -> str:
    """A number as every sentence writes it, with thousands separators: 130,343,768,064."""
    return f"{number:,}" if number is not None else "?"


@dataclass(frozen=True, slots=True)
class Descriptor:
    """A descriptor as a finding names it: ``index`` in its list, ``address``, ``length_bytes``,
    ``device`` (``None`` when the rows carry none) and, for a strided row of ``count`` elements
    ``stride_bytes`` apart, those two."""

    index: int
    address: int
    length_bytes: int
    device: int | None = None
    stride_bytes: int | None = None
    count: int | None = None

    def describe(self, element: int | None = None) -> str:
        """``descriptor 3 (address 0x7f00, 16384 bytes x 10 every 49152 bytes, device 0)``,
        preceded by ``element k (address ...) of`` for one element of a strided row."""
        text = f"descriptor {self.index} (address {self.address:#x}, {_n(self.length_bytes)} bytes"
        if self.count is not None and self.stride_bytes is not None:
            text += f" x {_n(self.count)} every {_n(self.stride_bytes)} bytes"
        if self.device is not None:
            text += f", device {self.device}"
        text += ")"
        if element is not None and self.stride_bytes is not None:
            at = self.address + element * self.stride_bytes
            text = f"element {element} (address {at:#x}) of {text}"
        return text


def _target(views: Sequence[str], packed: bool) -> str:
    if packed and len(views) > 1:
        return f"the packed blocks of views {views[0]!r} .. {views[-1]!r} ({len(views)} views)"
    return f"view {views[0]!r}" if views else "no view"


def _covers(storage: str | None, byte_offset: int | None, extent_bytes: int | None) -> str:
    if storage is None or byte_offset is None or extent_bytes is None:
        return ""
    return f" covers bytes [{_n(byte_offset)}, {_n(extent_bytes)}) of storage {storage!r}:"


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

    Descriptor findings (``safeview.transfer``) fill ``rows`` (the row's index in its list; two
    for ``overlapping_writes`` and ``duplicate_registration``), ``address``, ``length_bytes``,
    ``device`` (``None`` when the rows carry none), ``stride_bytes`` and ``count`` (strided rows),
    ``element`` (the element of a strided row the finding is about), ``layer`` (the layer the row
    was meant for), ``views`` (the views it touches), and where known ``storage``,
    ``byte_offset`` and ``extent_bytes`` (the bytes of that storage it covers); ``byte`` is an
    address there: the first byte in no page, or the first byte written or registered twice.

    Diff findings (``safeview.diff``) fill ``layer``, ``byte`` (the receiver's page byte),
    ``block`` (under ``in_place``), ``receiver_rank``, ``sender_ranks`` and, for a byte read
    differently, ``receiver_reads`` and ``sender_wrote`` (``Meaning``: what it is to each side).
    Digest findings (``safeview.verify``) fill ``layer``, ``heads`` (global KV heads; ``-1`` for
    a layer without heads), ``receiver_rank`` and ``sender_ranks``.
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
    rows: tuple[int, ...] = ()
    address: int | None = None
    length_bytes: int | None = None
    device: int | None = None
    stride_bytes: int | None = None
    count: int | None = None
    element: int | None = None
    layer: str | None = None
    block: int | None = None
    receiver_rank: int | None = None
    sender_ranks: tuple[int, ...] = ()
    receiver_reads: Meaning | None = None
    sender_wrote: Meaning | None = None
    heads: tuple[int, ...] = ()
    tokens: tuple[int, int] | None = None

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
        numbers that apply to its kind (a diff finding: the object ``safeview diff --json``
        prints for it)."""
        if self.kind in DIGEST_KINDS:
            return {
                "kind": self.kind,
                "layer": self.layer,
                "heads": list(self.heads),
                "tokens": None if self.tokens is None else list(self.tokens),
                "receiver_rank": self.receiver_rank,
                "sender_ranks": list(self.sender_ranks),
                "message": self.message,
            }
        if self.kind in DIFF_KINDS:
            reads, wrote = self.receiver_reads, self.sender_wrote
            return {
                "kind": self.kind,
                "layer": self.layer,
                "byte": self.byte,
                "block": self.block,
                "receiver_rank": self.receiver_rank,
                "sender_ranks": list(self.sender_ranks),
                "receiver_reads": None if reads is None else reads.to_json(),
                "sender_wrote": None if wrote is None else wrote.to_json(),
                "message": self.message,
            }
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
        elif self.kind in DESCRIPTOR_KINDS:
            data.update(
                rows=list(self.rows),
                address=self.address,
                length_bytes=self.length_bytes,
                device=self.device,
                stride_bytes=self.stride_bytes,
                count=self.count,
                element=self.element,
                layer=self.layer,
                byte_offset=self.byte_offset,
                extent_bytes=self.extent_bytes,
                byte=self.byte,
            )
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
            needs = f"starts at byte {_n(byte_offset)}"
        else:
            overflow = (extent_bytes - byte_offset) - max(0, storage_nbytes - byte_offset)
            needs = f"needs bytes [{_n(byte_offset)}, {_n(extent_bytes)})"
        what = _view(name, empty)
        return cls(
            "out_of_bounds",
            (name,) if name is not None else (),
            storage,
            f"{what} {needs} but {_storage(storage)} has {_n(storage_nbytes)} bytes "
            f"({_n(overflow)} bytes past the end)",
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
            parts.append(f"{_n(before)} bytes before its start")
        if after:
            parts.append(f"{_n(after)} bytes past its end")
        needs = (
            f"starts at byte {_n(byte_offset)}"
            if empty
            else (f"needs bytes [{_n(byte_offset)}, {_n(extent_bytes)})")
        )
        what = _view(name, empty)
        return cls(
            "out_of_region",
            (name,) if name is not None else (),
            storage,
            f"{what} {needs} but its region is [{_n(start)}, {_n(end)}) ({' and '.join(parts)})",
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
                f"{_view(name)} has block_stride_bytes={_n(stride)} smaller than "
                f"page_bytes={_n(page_bytes)}: each of its {_n(num_blocks)} pages shares "
                f"{_n(page_bytes - stride)} bytes with the next, from byte {_n(byte)} on (a "
                "stride of one kernel block or of one half of a K/V split taken as the block "
                "stride?)"
            )
        else:
            # The rule is exact for a stride of 0 (every step lands on the same bytes); for other
            # strides it may refuse a view that only interleaves, so no byte is named.
            byte = byte_offset if stride == 0 else None
            message = (
                f"{_view(name)} (shape {tuple(shape)}, strides {tuple(strides)}) may touch some "
                f"elements twice: axis {axis} (size {_n(shape[axis])}, stride {_n(stride)}) steps "
                f"no further than the {_n(reach)} elements its faster axes reach"
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
            f"views {first!r} and {second!r}{in_group} both use byte {_n(byte)}{of}",
            byte=byte,
            group=group,
        )

    # -- descriptors handed to a transfer engine (safeview.transfer): one sentence per kind -------

    @classmethod
    def _descriptor(
        cls,
        kind: Kind,
        row: Descriptor,
        message: str,
        *,
        views: Sequence[str] = (),
        storage: str | None = None,
        byte_offset: int | None = None,
        extent_bytes: int | None = None,
        element: int | None = None,
        layer: str | None = None,
        byte: int | None = None,
        overflow_bytes: int | None = None,
        limit_bytes: int | None = None,
        rows: tuple[int, ...] | None = None,
    ) -> Finding:
        return cls(
            kind,
            tuple(views),
            storage,
            message,
            byte_offset=byte_offset,
            extent_bytes=extent_bytes,
            limit_bytes=limit_bytes,
            overflow_bytes=overflow_bytes,
            byte=byte,
            rows=rows if rows is not None else (row.index,),
            address=row.address,
            length_bytes=row.length_bytes,
            device=row.device,
            stride_bytes=row.stride_bytes,
            count=row.count,
            element=element,
            layer=layer,
        )

    @classmethod
    def outside_memory(
        cls,
        row: Descriptor,
        *,
        reason: Literal["no_storage", "past_end", "device", "wraps"],
        element: int | None = None,
        storage: str | None = None,
        storage_nbytes: int | None = None,
        storage_device: str | None = None,
        byte_offset: int | None = None,
        extent_bytes: int | None = None,
        end_address: int | None = None,
        layer: str | None = None,
    ) -> Finding:
        """The row's bytes lie (partly) in no storage of the registration: none at all
        (``no_storage``), past the end of the one it starts in (``past_end``: ``byte_offset``
        and ``extent_bytes`` in it, ``storage_nbytes``), on another device than the row names
        (``device``), or past the last address, 2**64 - 1 (``wraps``: ``end_address``).
        ``layer``, the layer the row is meant for, is named in the message too."""
        what = row.describe(element)
        if layer is not None:
            what += f", meant for layer {layer!r},"
        overflow = None
        if reason == "past_end":
            assert byte_offset is not None
            assert extent_bytes is not None
            assert storage_nbytes is not None
            overflow = extent_bytes - storage_nbytes
            tail = (
                f"needs bytes [{_n(byte_offset)}, {_n(extent_bytes)}) of storage {storage!r}, "
                f"which has {_n(storage_nbytes)} bytes ({_n(overflow)} bytes past its end)"
            )
        elif reason == "device":
            tail = (
                f"names device {row.device}, but its bytes lie in storage {storage!r} on "
                f"{storage_device}"
            )
        elif reason == "wraps":
            assert end_address is not None
            overflow = end_address - 2**64
            tail = (
                f"ends at {end_address:#x}, {_n(overflow)} bytes past the last address "
                "(2**64 - 1): no memory lies there"
            )
        else:
            tail = "lies in no storage of the registration"
        return cls._descriptor(
            "outside_memory",
            row,
            f"{what} {tail}",
            storage=storage,
            byte_offset=byte_offset,
            extent_bytes=extent_bytes,
            element=element,
            overflow_bytes=overflow,
            limit_bytes=storage_nbytes,
            layer=layer,
        )

    @classmethod
    def outside_view(
        cls,
        row: Descriptor,
        *,
        reason: Literal["gap", "pages", "views", "storages", "stride", "count"],
        views: Sequence[str] = (),
        storage: str | None = None,
        byte_offset: int | None = None,
        extent_bytes: int | None = None,
        blocks: tuple[int, int] | None = None,
        byte: int | None = None,
        gap_offset: int | None = None,
        storages: tuple[str, str] | None = None,
        block_stride_bytes: int | None = None,
        num_blocks: int | None = None,
        packed: bool = False,
        element: int | None = None,
        layer: str | None = None,
    ) -> Finding:
        """Inside the storages, but not whole pages of one view: byte ``byte`` (``gap_offset``
        in its storage) lies in no page (``gap``); the row spans ``blocks`` of one view without
        being whole pages (``pages``), or pages of two views (``views``, one block each), or two
        storages (``storages``); a strided row's stride is not its view's
        ``block_stride_bytes`` (``stride``), or its elements need ``blocks`` (first and last)
        past the view's ``num_blocks`` (``count``). ``layer``, the layer the row is meant for,
        is named in the message too."""
        what = row.describe(element)
        if layer is not None:
            what += f", meant for layer {layer!r},"
        covers = _covers(storage, byte_offset, extent_bytes)
        if reason == "gap":
            tail = f"byte {_n(gap_offset)} there lies in no page of any view (a gap or padding)"
        elif reason == "pages":
            assert blocks is not None
            tail = (
                f"it spans pages {blocks[0]} and {blocks[1]} of view {views[0]!r} without "
                "being whole pages"
            )
        elif reason == "views":
            assert blocks is not None
            tail = (
                f"it spans view {views[0]!r} (page {blocks[0]}) and view {views[1]!r} "
                f"(page {blocks[1]}): pages of two views"
            )
        elif reason == "storages":
            assert storages is not None
            covers = ""
            tail = f" spans storages {storages[0]!r} and {storages[1]!r}"
        elif reason == "stride":
            tail = (
                f"a strided row is one view, and {_target(views, packed)} has a block stride of "
                f"{_n(block_stride_bytes)} bytes, not {_n(row.stride_bytes)}"
            )
        else:
            assert blocks is not None
            assert num_blocks is not None
            assert row.count is not None
            tail = (
                f"its {_n(row.count)} elements need blocks {blocks[0]}..{blocks[1]} of "
                f"{_target(views, packed)}, which has {_n(num_blocks)} "
                f"({_n(blocks[1] + 1 - num_blocks)} too many)"
            )
        joiner = "" if reason == "storages" else (covers + " " if covers else " ")
        return cls._descriptor(
            "outside_view",
            row,
            f"{what}{joiner}{tail}",
            views=views,
            storage=storage,
            byte_offset=byte_offset,
            extent_bytes=extent_bytes,
            element=element,
            byte=byte,
            layer=layer,
        )

    @classmethod
    def partial_page(
        cls,
        row: Descriptor,
        *,
        view: str,
        block: int,
        storage: str,
        byte_offset: int,
        extent_bytes: int,
        page_offset: int,
        page_bytes: int,
        element: int | None = None,
        layer: str | None = None,
    ) -> Finding:
        """The row lies inside page ``block`` of ``view`` (at ``page_offset`` of ``storage``)
        without covering all of it, and whole pages are required."""
        what = row.describe(element)
        return cls._descriptor(
            "partial_page",
            row,
            f"{what}{_covers(storage, byte_offset, extent_bytes)} "
            f"{_n(extent_bytes - byte_offset)} of the {_n(page_bytes)} bytes of page {block} of "
            f"view {view!r} (bytes [{_n(page_offset)}, {_n(page_offset + page_bytes)})), and "
            "whole pages are required",
            views=(view,),
            storage=storage,
            byte_offset=byte_offset,
            extent_bytes=extent_bytes,
            element=element,
            layer=layer,
        )

    @classmethod
    def wrong_layer(
        cls,
        row: Descriptor,
        *,
        layer: str,
        views: Sequence[str],
        blocks: tuple[int, int],
        packed: bool,
        storage: str | None,
        byte_offset: int | None,
        extent_bytes: int | None,
        element: int | None = None,
    ) -> Finding:
        """The row is whole pages (``blocks``, first and last) of ``views``, none of them of
        ``layer``, the layer it is meant for."""
        first, last = blocks
        noun = "packed block" if packed else "page"
        pages = f"{noun} {first}" if first == last else f"{noun}s {first}..{last}"
        return cls._descriptor(
            "wrong_layer",
            row,
            f"{row.describe(element)} is meant for layer {layer!r} but covers {pages} of "
            f"{_target(views, packed)}",
            views=views,
            storage=storage,
            byte_offset=byte_offset,
            extent_bytes=extent_bytes,
            element=element,
            layer=layer,
        )

    @classmethod
    def overlapping_writes(
        cls,
        first: Descriptor,
        second: Descriptor,
        *,
        byte: int,
        views: Sequence[str] = (),
        storage: str | None = None,
        byte_offset: int | None = None,
    ) -> Finding:
        """Write descriptors ``first`` and ``second`` of one batch (or two elements of one
        strided row) both write the byte at address ``byte``."""
        where = ""
        if storage is not None and byte_offset is not None:
            where = f" (byte {_n(byte_offset)} of storage {storage!r}"
            where += f", in view {views[0]!r})" if views else ")"
        if first.index == second.index:
            message = (
                f"{first.describe()} writes byte {byte:#x}{where} twice: its stride of "
                f"{_n(first.stride_bytes)} bytes is shorter than its {_n(first.length_bytes)} bytes"
            )
        else:
            message = (
                f"write descriptors {first.index} and {second.index} both write byte "
                f"{byte:#x}{where}: {first.describe()} and {second.describe()}"
            )
        return cls._descriptor(
            "overlapping_writes",
            first,
            message,
            views=views,
            storage=storage,
            byte_offset=byte_offset,
            byte=byte,
            rows=(first.index, second.index),
        )

    @classmethod
    def duplicate_registration(
        cls, region: Descriptor, earlier: Descriptor, *, byte: int, engine: str
    ) -> Finding:
        """Region ``region`` overlaps ``earlier``, registered before with the same engine, from
        the address ``byte`` on."""
        text = region.describe().replace("descriptor", "region", 1)
        before = f"address {earlier.address:#x}, {_n(earlier.length_bytes)} bytes"
        return cls._descriptor(
            "duplicate_registration",
            region,
            f"{text} overlaps the region ({before}) registered before with this {engine}, from "
            f"byte {byte:#x} on: a transfer's addresses could then resolve to either region",
            byte=byte,
            rows=(region.index, earlier.index),
        )

    @classmethod
    def unregistered(
        cls,
        *,
        layer: str,
        storage: str | None,
        byte_offset: int,
        extent_bytes: int,
        block: int,
        pages_missing: int,
        pages: int,
        page_bytes: int,
        bytes_missing: int,
        prepared: str,
    ) -> Finding:
        """Layer ``layer`` is to be transferred, but ``bytes_missing`` bytes of it, in
        ``pages_missing`` of its ``pages`` pages, lie in no descriptor prepared for its
        transfers; ``[byte_offset, extent_bytes)`` of ``storage`` are the first such bytes (in
        page ``block``). ``prepared`` says what was prepared, in words."""
        where = f"bytes [{_n(byte_offset)}, {_n(extent_bytes)}) of {_storage(storage)}"
        return cls(
            "unregistered",
            (layer,),
            storage,
            f"layer {layer!r} is to be transferred, but {_n(bytes_missing)} of its bytes lie in "
            f"no descriptor prepared for its transfers (in {_n(pages_missing)} of its {_n(pages)} "
            f"pages of {_n(page_bytes)} bytes; the first: {where}, page {block}); prepared: "
            f"{prepared}. Those bytes are never transferred, and nothing else says so",
            byte_offset=byte_offset,
            extent_bytes=extent_bytes,
            layer=layer,
            count=pages_missing,
            length_bytes=bytes_missing,
        )

    # -- two manifests read a layer's bytes differently (``safeview.diff``) ----------------------

    @classmethod
    def _of_layer(cls, kind: Kind, layer: str | None, message: str, **numbers: Any) -> Finding:
        """A diff finding of ``kind`` about ``layer``."""
        return cls(
            kind, (layer,) if layer is not None else (), None, message, layer=layer, **numbers
        )

    @classmethod
    def diff_byte(
        cls,
        layer: str,
        *,
        byte: int,
        receiver_reads: Meaning,
        sender_wrote: Meaning,
        receiver_rank: int,
        sender_ranks: tuple[int, ...],
        block: int | None = None,
        where: str = "",
    ) -> Finding:
        """Receiver page byte ``byte`` (of block ``block``'s page, when the receiver reads the
        sender's memory in place) reads ``receiver_reads``; the sender wrote ``sender_wrote``
        there. ``where`` names the ranks, in words, when a side has several."""
        page = "receiver page byte" if block is None else f"block {block}'s page byte"
        return cls._of_layer(
            "byte",
            layer,
            f"{layer}: {page} {_n(byte)} reads {receiver_reads.words()}, the sender wrote "
            f"{sender_wrote.words()} there{where}",
            byte=byte,
            block=block,
            receiver_rank=receiver_rank,
            sender_ranks=sender_ranks,
            receiver_reads=receiver_reads,
            sender_wrote=sender_wrote,
        )

    @classmethod
    def diff_past_page(
        cls,
        layer: str,
        *,
        sender_page_bytes: int,
        receiver_page_bytes: int,
        receiver_rank: int,
        sender_ranks: tuple[int, ...],
        where: str = "",
    ) -> Finding:
        """A page copy of the sender's larger page writes past each receiver page (``byte``:
        the receiver's page size, the first byte written past it)."""
        past = sender_page_bytes - receiver_page_bytes
        return cls._of_layer(
            "byte",
            layer,
            f"{layer}: the sender's page is {_n(sender_page_bytes)} bytes, the receiver's "
            f"{_n(receiver_page_bytes)}: a page copy writes {_n(past)} bytes past each receiver "
            f"page{where}",
            byte=receiver_page_bytes,
            receiver_rank=receiver_rank,
            sender_ranks=sender_ranks,
        )

    @classmethod
    def diff_dtype(
        cls,
        layer: str,
        *,
        reads: str,
        wrote: str,
        receiver_rank: int,
        sender_ranks: tuple[int, ...],
        where: str = "",
    ) -> Finding:
        """The receiver reads ``reads`` elements where the sender wrote ``wrote``."""
        return cls._of_layer(
            "dtype",
            layer,
            f"{layer}: the receiver reads {reads}, the sender wrote {wrote}{where}",
            byte=0,
            receiver_rank=receiver_rank,
            sender_ranks=sender_ranks,
        )

    @classmethod
    def missing_layer(cls, layer: str, *, side: Literal["sender", "receiver"]) -> Finding:
        """Only ``side`` has ``layer``: layers are paired by name, never by position."""
        return cls._of_layer("missing_layer", layer, f"{layer}: only the {side} has this layer")

    @classmethod
    def missing_rank(
        cls,
        layer: str | None,
        *,
        rank: int,
        receiver_rank: int | None,
        sender_ranks: tuple[int, ...] = (),
        where: str = "",
        side: Literal["sender", "receiver"] = "sender",
        tp_size: int | None = None,
    ) -> Finding:
        """No ``side`` manifest for ``rank`` (``layer`` None; ``tp_size`` the TP size that side
        declares), or the rank-``rank`` sender manifest that ``layer`` of ``receiver_rank``
        reads from (or its layer) is missing."""
        if layer is None and tp_size is not None:
            judged = "is not judged" if side == "receiver" else "is read by no receiver rank judged"
            message = (
                f"the {side} declares TP {tp_size} but no manifest of its rank {rank} was "
                f"given: rank {rank} {judged}"
            )
        elif layer is None:
            message = f"no {side} manifest for rank {rank}"
        else:
            message = f"{layer}: the sender's rank {rank} manifest (or its layer) is missing{where}"
        return cls._of_layer(
            "missing_rank",
            layer,
            message,
            receiver_rank=receiver_rank,
            sender_ranks=sender_ranks,
        )

    @classmethod
    def refused(
        cls, layer: str, *, connector: str, reason: str, receiver_rank: int, where: str = ""
    ) -> Finding:
        """``connector`` itself refuses to move ``layer`` between the two sides: ``reason``."""
        return cls._of_layer(
            "refused",
            layer,
            f"{layer}: {connector} refuses this pair: {reason}{where}",
            receiver_rank=receiver_rank,
        )

    # -- two digests of one request's meaning differ (``safeview.verify``) -----------------------

    @classmethod
    def digest_mismatch(
        cls,
        layer: str,
        *,
        heads: tuple[int, ...],
        message: str,
        receiver_rank: int | None = None,
        sender_ranks: tuple[int, ...] = (),
        tokens: tuple[int, int] | None = None,
    ) -> Finding:
        """``layer``'s ``heads`` (global; ``-1``: a layer without heads) hold other values on
        the receiver than the sender digested; ``tokens``: the first and last request position
        of the first run of tokens whose values differ, where the digests tell."""
        return cls._of_layer(
            "digest",
            layer,
            message,
            heads=heads,
            receiver_rank=receiver_rank,
            sender_ranks=sender_ranks,
            tokens=tokens,
        )

    @classmethod
    def digest_unmatched(
        cls, layer: str | None, *, heads: tuple[int, ...], message: str
    ) -> Finding:
        """The receiver's ``heads`` of ``layer`` are in no digest of the sender (``layer``
        None: the two sides digested different numbers of positions, or their digests are of
        two schemes)."""
        return cls._of_layer("digest_unmatched", layer, message, heads=heads)


def _json_group(group: Hashable | None) -> str | int | None:
    if group is None or (isinstance(group, (str, int)) and not isinstance(group, bool)):
        return group
    return str(group)
