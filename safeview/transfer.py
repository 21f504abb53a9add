"""Descriptors for a transfer engine, checked against the views they must hit.

Connectors that move KV caches between processes hand a transfer engine raw descriptors:
``(address, length)``, ``(address, length, device)``, or NIXL's strided rows
``(address, length, device, stride, count)`` (``count`` elements of ``length`` bytes, ``stride``
bytes apart). The engines check only that a descriptor lies inside some registered region; a
descriptor on another layer's page, across two pages or short of a page goes through. Yet a
descriptor is a view in another form: a strided row is the block view ``(byte_offset,
page_bytes, block_stride_bytes, num_blocks)``. This module says of every descriptor whether it
hits whole pages of one layer's view, and nothing else.

The pipeline: ``memory_map(registration)`` turns what ``safeview.kv.block_views`` or
``safeview.vllm.check_registration`` returned into plain integers (each storage's address and
size, each view's pages); ``check_descriptors`` judges rows against that map with numpy, and
explains one by one only the rows it cannot prove right; the findings go through the policy.

What a row may be (every other row is a finding):

- one whole page of a view; with ``whole_pages=False``, any slice inside one page;
- a run of whole pages of one contiguous view (block stride equal to the page);
- a run of whole blocks of a packed group: views of one block stride whose pages tile each block
  back to back (vLLM's NIXL rows for packed MLA caches, the offloading worker's packed blocks);
- a strided row is one view: its elements sit at the same place of consecutive blocks (its stride
  is the view's block stride), or abut (stride equal to length) as runs of whole pages or blocks,
  or cut whole pages into equal pieces, all of them (vLLM's rows for a peer with smaller blocks).

All arithmetic is unsigned 64-bit: an address with bit 63 set is judged like any other, and a row
whose end passes 2**64 is an ``outside_memory`` finding. numpy is needed by this module only
(``pip install 'safeview[transfer]'``) and is imported on first use.
"""

from __future__ import annotations

import array as array_module
import bisect
import itertools
import operator
import re
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, NamedTuple

from safeview import _arith, log
from safeview.errors import AddressError, ArgumentError
from safeview.findings import Descriptor, Finding
from safeview.policy import Policy, PolicyArg, current_policy

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

    U64 = NDArray[np.uint64]

__all__ = ["MemoryMap", "StorageSpan", "ViewSpan", "check_descriptors", "memory_map"]

ADDRESS_LIMIT = 2**64
"""One past the last address: descriptors are unsigned 64-bit numbers."""
_TOP = ADDRESS_LIMIT - 1
# Up to this many rows, rows are judged one by one: cheaper than numpy's fixed cost.
_FEW_ROWS = 8
# The most elements a writes check expands strided rows into (16 bytes each).
_MAX_ELEMENTS = 1 << 27


def _numpy() -> None:
    """Import numpy, or say how to install it."""
    try:
        import numpy  # noqa: F401
    except ImportError as missing:  # pragma: no cover - exercised where numpy is absent
        raise ImportError(
            "safeview.transfer needs numpy, which is not installed; install it with: "
            "pip install 'safeview[transfer]'"
        ) from missing


# -- the map: storages and views in plain integers ----------------------------------------------


class StorageSpan(NamedTuple):
    """A storage of a registration: ``name``, the ``address`` of its byte 0, ``nbytes`` and its
    ``device`` (``"cpu"``, ``"cuda:1"``); a descriptor's device id must be the device's index (0
    for ``cpu``)."""

    name: str
    address: int
    nbytes: int
    device: str = "cpu"

    @property
    def device_id(self) -> int:
        """The device's index, as descriptors name it: ``cuda:1`` is 1, ``cpu`` is 0."""
        _, _, index = self.device.partition(":")
        return int(index) if index.isdigit() else 0


class ViewSpan(NamedTuple):
    """A view of a registration, in block terms: ``num_blocks`` pages of ``page_bytes``,
    ``block_stride_bytes`` apart, from ``byte_offset`` of the storage named ``storage``.
    ``layer`` is the layer it belongs to (its ``name`` when not given: a layer with split K/V
    tensors has views ``"x[0]"`` and ``"x[1]"`` of layer ``"x"``)."""

    name: str
    storage: str
    byte_offset: int
    page_bytes: int
    block_stride_bytes: int
    num_blocks: int
    layer: str | None = None


@dataclass(frozen=True)
class MemoryMap:
    """The storages and views descriptors are checked against, in plain integers.

    Usually made by ``memory_map(registration)``; made by hand for a layout known only as
    numbers::

        >>> kv = MemoryMap(
        ...     storages=(StorageSpan("kv", address=0x10000, nbytes=4 * 96),),
        ...     views=(ViewSpan("layers.0", "kv", 0, 32, 96, 4),
        ...            ViewSpan("layers.1", "kv", 32, 64, 96, 4)),
        ... )
        >>> check_descriptors([(0x10000 + 96, 32)], kv)
        []
    """

    storages: tuple[StorageSpan, ...]
    views: tuple[ViewSpan, ...]

    def __post_init__(self) -> None:
        names = set()
        for storage in self.storages:
            for field_name, value in (("address", storage.address), ("nbytes", storage.nbytes)):
                if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                    raise ArgumentError(
                        f"storage {storage.name!r}: {field_name} must be a non-negative integer; "
                        f"got {value!r}"
                    )
            if storage.address + storage.nbytes > ADDRESS_LIMIT:
                raise ArgumentError(
                    f"storage {storage.name!r} ends at {storage.address + storage.nbytes:#x}, "
                    "past the last address (2**64 - 1)"
                )
            names.add(storage.name)
        for view in self.views:
            if view.storage not in names:
                raise ArgumentError(
                    f"view {view.name!r} names storage {view.storage!r}, which is not listed"
                )
            for field_name in ("byte_offset", "page_bytes", "block_stride_bytes", "num_blocks"):
                value = getattr(view, field_name)
                if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                    raise ArgumentError(
                        f"view {view.name!r}: {field_name} must be a non-negative integer; "
                        f"got {value!r}"
                    )

    @cached_property
    def _index(self) -> _Index:
        return _Index(self)


_MAPS: dict[int, tuple[weakref.ref[Any], MemoryMap]] = {}
_SPLIT_NAME = re.compile(r"^(.*)\[\d+\]$")


def memory_map(
    registration: object,
    *,
    addresses: Mapping[str, int] | None = None,
    devices: Mapping[str, str] | None = None,
) -> MemoryMap:
    """The ``MemoryMap`` of a registration: what ``safeview.kv.block_views`` or
    ``safeview.vllm.check_registration`` returned (its views, and each storage's address from
    ``Registration.storages``), a ``Report`` from ``check_tensors`` with ``addresses`` (storage
    name -> address of its byte 0) and ``devices`` (storage name -> device, ``cpu`` when not
    given), or a ``MemoryMap`` as it is.

    Storages without an address (``meta``) are left out. A view that is not an int8 block view
    (a ``check_tensors`` tensor) is taken block by block along its first axis, each block's page
    being the span of the rest. The map of a registration is made once and kept while the
    registration lives.
    """
    if isinstance(registration, MemoryMap):
        return registration
    key = id(registration)
    cached = _MAPS.get(key)
    if cached is not None and cached[0]() is registration and addresses is None:
        return cached[1]
    report = getattr(registration, "report", registration)
    records = getattr(report, "views", None)
    sizes = getattr(report, "storages", None)
    if records is None or not isinstance(sizes, Mapping):
        raise ArgumentError(
            "registration must be what safeview.kv.block_views, check_tensors or "
            "safeview.vllm.check_registration returned, or a MemoryMap; "
            f"got {type(registration).__name__}"
        )
    facts = getattr(registration, "storages", None) if report is not registration else None
    known_devices = dict(getattr(registration, "devices", None) or {})
    known_devices.update(devices or {})
    storages = []
    for name, size in sizes.items():
        fact = facts.get(name) if isinstance(facts, Mapping) else None
        if addresses is not None and name in addresses:
            address = addresses[name]
        elif fact is not None:
            address = fact.base
        else:
            address = 0
        if not address:
            continue  # no address (meta, or a report without addresses): nothing to hit there
        device = fact.device if fact is not None else known_devices.get(name, "cpu")
        storages.append(StorageSpan(name, int(address), int(size), str(device)))
    if not storages:
        hint = (
            " (a check_tensors Report carries none: pass addresses={storage: address})"
            if facts is None and addresses is None
            else " (storages on meta have none)"
        )
        raise ArgumentError(f"the registration has no storage with an address{hint}")
    kept = {storage.name for storage in storages}
    layers = set(getattr(registration, "page_bytes", None) or ())
    views = [
        _view_span(record, layers) for record in records if record.storage in kept
    ]  # fmt: skip
    made = MemoryMap(tuple(storages), tuple(views))
    if addresses is None:
        try:
            ref = weakref.ref(registration, _forget(key))
        except TypeError:
            pass  # an object without weak references is mapped again next time
        else:
            _MAPS[key] = (ref, made)
    return made


def _forget(key: int) -> Any:
    return lambda _: _MAPS.pop(key, None)


def _view_span(record: Any, layers: set[str]) -> ViewSpan:
    name, storage, byte_offset, shape, strides, itemsize = tuple(record)[:6]
    if itemsize == 1 and len(shape) == 2 and strides[1] == 1:
        num_blocks, page_bytes = shape
        block_stride_bytes = strides[0]
    elif not shape:
        num_blocks, page_bytes, block_stride_bytes = 1, itemsize, itemsize
    else:
        num_blocks, block_stride_bytes = shape[0], strides[0] * itemsize
        page_bytes = _arith.extent_bytes(0, shape[1:], strides[1:], itemsize)
    layer = name
    if name not in layers:
        split = _SPLIT_NAME.match(name)
        if split is not None and split.group(1) in layers:
            layer = split.group(1)
    return ViewSpan(
        name, storage, int(byte_offset), int(page_bytes), int(block_stride_bytes),
        int(num_blocks), layer,
    )  # fmt: skip


# -- the index: pages as runs and periodic families ----------------------------------------------


class _Alias(NamedTuple):
    """Views with the same pages (layers of different KV-cache groups on the same bytes are
    one alias): first page at ``base`` (an address), ``blocks`` pages inside their storage."""

    base: int
    page: int
    stride: int
    blocks: int
    device: int
    storage: str
    views: tuple[str, ...]


class _Family(NamedTuple):
    """Views of one block stride whose pages sit in one window ``[origin, origin + stride)``
    without overlapping: ``offsets`` (sorted, from ``origin``), ``pages``, ``blocks`` and
    ``aliases`` of its members. ``tiles``: the pages fill the window, so a whole block is a row
    of its own, for the ``whole_blocks`` first blocks that every member has."""

    origin: int
    stride: int
    offsets: tuple[int, ...]
    pages: tuple[int, ...]
    blocks: tuple[int, ...]
    aliases: tuple[int, ...]
    tiles: bool
    whole_blocks: int
    device: int
    storage: str


_RUN, _FAMILY = 0, 1


class _Hit(NamedTuple):
    """One way a row's bytes lie in the views: ``kind`` ``page`` (inside one page, ``whole`` or
    not), ``run`` (whole pages of a contiguous view) or ``blocks`` (whole blocks of a packed
    family); ``row`` is its row of the layer matrix; ``block`` the first page or block, ``units``
    how many; ``stride`` the block stride that elements of a strided row must keep, ``limit``
    the blocks there are, ``page`` the page (or block) size, ``in_page`` the offset in it."""

    kind: str
    row: int
    block: int
    units: int
    whole: bool
    stride: int
    limit: int
    page: int
    in_page: int
    contiguous: bool
    views: tuple[str, ...]


class _Index:
    """A memory map arranged for lookups: entries sorted by address, each a run of one
    contiguous view or one periodic family; views whose pages overlap each other are kept
    aside for the row-by-row path."""

    def __init__(self, memory: MemoryMap) -> None:
        _numpy()
        import numpy as np

        spans = sorted((s for s in memory.storages if s.nbytes), key=lambda s: s.address)
        self.storages = spans
        by_name = {storage.name: storage for storage in memory.storages}
        aliases: dict[tuple[int, ...], int] = {}
        self.aliases: list[_Alias] = []
        alias_views: list[list[str]] = []
        alias_layers: list[set[str]] = []
        for view in memory.views:
            storage = by_name[view.storage]
            base = storage.address + view.byte_offset
            end = storage.address + storage.nbytes
            page, stride = view.page_bytes, view.block_stride_bytes
            blocks = view.num_blocks
            if not page or not blocks or base + page > end:
                continue
            if stride:
                blocks = min(blocks, (end - base - page) // stride + 1)
            key = (storage.device_id, base, page, stride, blocks)
            index = aliases.get(key)
            if index is None:
                index = aliases[key] = len(self.aliases)
                self.aliases.append(
                    _Alias(base, page, stride, blocks, storage.device_id, storage.name, ())
                )
                alias_views.append([])
                alias_layers.append(set())
            alias_views[index].append(view.name)
            alias_layers[index].update((view.name, view.layer or view.name))
        self.aliases = [
            alias._replace(views=tuple(names)) for alias, names in zip(self.aliases, alias_views)
        ]
        entries: list[tuple[int, int, int, int, int, int]] = []  # start, last, kind, ref, unit, dev
        self.odd: list[int] = []
        periodic: dict[tuple[int, str, int], list[int]] = {}
        for index, alias in enumerate(self.aliases):
            if alias.stride > alias.page:
                periodic.setdefault((alias.device, alias.storage, alias.stride), []).append(index)
            elif alias.stride == alias.page or alias.blocks == 1:
                last = alias.base + alias.blocks * alias.page - 1
                entries.append((alias.base, last, _RUN, index, alias.page, alias.device))
            else:
                self.odd.append(index)  # pages overlap each other: a broken view
        self.families: list[_Family] = []
        for (device, storage_name, stride), members in periodic.items():
            pending = sorted(members, key=lambda i: self.aliases[i].base)
            # Greedy windows: the lowest page left starts one (so a family's first member is
            # at offset 0), and takes the pages after it that fit in the window without
            # overlapping; the others start windows of their own.
            while pending:
                origin = self.aliases[pending[0]].base
                chosen, rest, reach = [], [], origin
                for index in pending:
                    alias = self.aliases[index]
                    if reach <= alias.base and alias.base + alias.page <= origin + stride:
                        chosen.append(index)
                        reach = alias.base + alias.page
                    else:
                        rest.append(index)
                pending = rest
                members_ = [self.aliases[i] for i in chosen]
                family = _Family(
                    origin,
                    stride,
                    tuple(a.base - origin for a in members_),
                    tuple(a.page for a in members_),
                    tuple(a.blocks for a in members_),
                    tuple(chosen),
                    sum(a.page for a in members_) == stride,
                    min(a.blocks for a in members_),
                    device,
                    storage_name,
                )
                last = max(a.base + (a.blocks - 1) * stride + a.page - 1 for a in members_)
                entries.append((origin, last, _FAMILY, len(self.families), stride, device))
                self.families.append(family)
        entries.sort(key=lambda entry: (entry[0], -entry[1]))
        self.entries = entries
        self.starts = [entry[0] for entry in entries]
        self.reach = list(itertools.accumulate((entry[1] for entry in entries), max))
        u64 = np.uint64
        self.e_start = np.array(self.starts, dtype=u64)
        self.e_last = np.array([entry[1] for entry in entries], dtype=u64)
        self.e_kind = np.array([entry[2] for entry in entries], dtype=np.int8)
        self.e_ref = np.array([entry[3] for entry in entries], dtype=np.intp)
        self.e_unit = np.array([entry[4] for entry in entries], dtype=u64)
        self.e_dev = np.array([entry[5] for entry in entries], dtype=u64)
        self.f_arrays = [
            (
                np.array(f.offsets, dtype=u64),
                np.array(f.pages, dtype=u64),
                np.array(f.blocks, dtype=u64),
                np.array(f.aliases, dtype=np.intp),
            )
            for f in self.families
        ]
        # Which names (views and layers) each alias, and each family's whole block, belongs to.
        # every view and layer of the map is a name rows may be meant for, pages or none
        names = sorted({n for v in memory.views for n in (v.name, v.layer or v.name)})
        self.columns = {name: column for column, name in enumerate(names)}
        matrix = np.zeros((len(self.aliases) + len(self.families), len(names)), dtype=bool)
        for row, layers in enumerate(alias_layers):
            matrix[row, [self.columns[name] for name in layers]] = True
        for number, family in enumerate(self.families):
            matrix[len(self.aliases) + number] = matrix[list(family.aliases)].any(axis=0)
        self.matrix = matrix
        self.family_views = [
            tuple(name for alias in f.aliases for name in self.aliases[alias].views)
            for f in self.families
        ]

    def storage_at(self, address: int, device: int | None) -> list[StorageSpan]:
        """The storages that hold ``address`` (on ``device`` when given), the longest first."""
        found = [
            s
            for s in self.storages
            if s.address <= address < s.address + s.nbytes
            and (device is None or s.device_id == device)
        ]
        return sorted(found, key=lambda s: -(s.address + s.nbytes))

    # -- the row-by-row path ---------------------------------------------------------------

    def hits(self, first: int, last: int, length: int, device: int | None) -> list[_Hit]:
        """Every way the bytes ``[first, last]`` lie in pages: inside one page, a run of whole
        pages of a contiguous view, whole blocks of a packed family."""
        found: list[_Hit] = []
        position = bisect.bisect_right(self.starts, first) - 1
        while position >= 0 and self.reach[position] >= first:
            start, entry_last, kind, ref, unit, entry_device = self.entries[position]
            position -= 1
            if entry_last < first or (device is not None and entry_device != device):
                continue
            if kind == _RUN:
                alias = self.aliases[ref]
                if last > entry_last:
                    continue
                block, last_block = (first - start) // unit, (last - start) // unit
                page_start = start + block * unit
                if block == last_block:
                    whole = first == page_start and last == page_start + unit - 1 and length > 0
                    found.append(
                        _Hit("page", ref, block, 1, whole, unit, alias.blocks, unit,
                             first - page_start, True, alias.views)
                    )  # fmt: skip
                elif (first - start) % unit == 0 and (last + 1 - start) % unit == 0:
                    found.append(
                        _Hit("run", ref, block, last_block - block + 1, True, unit,
                             alias.blocks, unit, 0, True, alias.views)
                    )  # fmt: skip
            else:
                found += self._family_hits(ref, first, last, length)
        for ref in self.odd:
            alias = self.aliases[ref]
            if device is not None and alias.device != device:
                continue
            if first < alias.base:
                continue
            low = 0 if not alias.stride else max(0, -(-(first - alias.base - alias.page + 1)
                                                      // alias.stride))  # fmt: skip
            high = (
                alias.blocks - 1
                if not alias.stride
                else min(alias.blocks - 1, (first - alias.base) // alias.stride)
            )
            for block in range(low, min(high, low + 64) + 1):
                page_start = alias.base + block * alias.stride
                if page_start <= first and last < page_start + alias.page:
                    whole = first == page_start and last == page_start + alias.page - 1
                    found.append(
                        _Hit("page", ref, block, 1, whole and length > 0, alias.stride,
                             alias.blocks, alias.page, first - page_start, False, alias.views)
                    )  # fmt: skip
        return found

    def _family_hits(self, ref: int, first: int, last: int, length: int) -> list[_Hit]:
        family = self.families[ref]
        found = []
        block, residue = divmod(first - family.origin, family.stride)
        member = bisect.bisect_right(family.offsets, residue) - 1
        if member >= 0:
            offset, page = family.offsets[member], family.pages[member]
            if residue < offset + page and block < family.blocks[member]:
                page_start = family.origin + block * family.stride + offset
                if last < page_start + page:
                    alias = family.aliases[member]
                    whole = first == page_start and last == page_start + page - 1 and length > 0
                    found.append(
                        _Hit("page", alias, block, 1, whole, family.stride,
                             family.blocks[member], page, first - page_start, False,
                             self.aliases[alias].views)
                    )  # fmt: skip
        if (
            family.tiles
            and residue == 0
            and length > 0
            and length % family.stride == 0
            and (first - family.origin + length - 1) // family.stride < family.whole_blocks
        ):
            found.append(
                _Hit("blocks", len(self.aliases) + ref, block, length // family.stride, True,
                     family.stride, family.whole_blocks, family.stride, 0, True,
                     self.family_views[ref])
            )  # fmt: skip
        return found

    def page_at(self, address: int, device: int | None) -> tuple[tuple[str, ...], int, int] | None:
        """The views, block and last byte of a page that holds ``address``, or ``None``."""
        for hit in self.hits(address, address, 1, device):
            if hit.kind == "page":
                page_last = address - hit.in_page + hit.page - 1
                return hit.views, hit.block, page_last
        return None


# -- rows -----------------------------------------------------------------------------------------


class _Rows(NamedTuple):
    """The columns of a descriptor list, as ``uint64`` arrays (``device``, ``stride`` and
    ``count`` ``None`` where the rows do not carry them)."""

    addresses: U64
    lengths: U64
    devices: U64 | None
    strides: U64 | None
    counts: U64 | None

    def describe(self, index: int) -> Descriptor:
        return Descriptor(
            index,
            int(self.addresses[index]),
            int(self.lengths[index]),
            None if self.devices is None else int(self.devices[index]),
            None if self.strides is None else int(self.strides[index]),
            None if self.counts is None else int(self.counts[index]),
        )


def _rows(descriptors: object) -> _Rows:
    _numpy()
    import numpy as np

    if not isinstance(descriptors, np.ndarray):
        if not isinstance(descriptors, Iterable) or isinstance(descriptors, (str, bytes)):
            raise ArgumentError(
                "descriptors must be a list of (address, length[, device[, stride, count]]) "
                f"rows or an integer array of them; got {type(descriptors).__name__}"
            )
        rows = descriptors if isinstance(descriptors, (list, tuple)) else list(descriptors)
        return _columns_of(rows) if rows else _Rows(*_empty_columns(), None, None, None)
    array = descriptors
    if array.ndim != 2:
        raise ArgumentError(f"a descriptor array must be 2-d; got shape {array.shape}")
    _width(array.shape[1])
    if array.dtype.kind == "O":
        try:
            array = np.array(array.tolist(), dtype=np.uint64).reshape(array.shape)
        except (OverflowError, ValueError, TypeError):
            raise _bad_value(array.tolist()) from None
    elif array.dtype.kind in "iu":
        # a signed array holds the 64-bit patterns the engines read: -1 is 2**64 - 1
        array = array.astype(np.uint64, copy=False)
    else:
        raise ArgumentError(f"a descriptor array must hold integers; got dtype {array.dtype}")
    width = array.shape[1]
    columns = np.ascontiguousarray(array.T)  # one pass; each column then reads in order
    return _Rows(
        columns[0],
        columns[1],
        columns[2] if width >= 3 else None,
        columns[3] if width == 5 else None,
        columns[4] if width == 5 else None,
    )


def _empty_columns() -> tuple[U64, U64]:
    import numpy as np

    return np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.uint64)


def _columns_of(rows: Sequence[Any]) -> _Rows:
    """A list of rows as columns, each read straight into its own array."""
    import numpy as np

    try:
        widths = set(map(len, rows))
    except TypeError:
        raise ArgumentError(
            "each descriptor must be a row (address, length[, device[, stride, count]]); "
            f"got {type(rows[0]).__name__}"
        ) from None
    if len(widths) != 1:
        raise ArgumentError(
            f"descriptors must all have one width; got rows of {sorted(widths)} numbers"
        )
    width = widths.pop()
    _width(width)
    columns = []
    for position in range(width):
        try:
            # array's "Q" takes integers (and __index__) from 0 to 2**64 - 1 and refuses floats
            # and strings, which numpy.fromiter would truncate or parse
            column = array_module.array("Q", map(operator.itemgetter(position), rows))
        except (OverflowError, ValueError, TypeError, IndexError, KeyError):
            raise _bad_value(rows) from None
        columns.append(np.frombuffer(column, dtype=np.uint64))
    return _Rows(
        columns[0],
        columns[1],
        columns[2] if width >= 3 else None,
        columns[3] if width == 5 else None,
        columns[4] if width == 5 else None,
    )


def _width(width: int) -> None:
    if width not in (2, 3, 5):
        raise ArgumentError(
            "a descriptor is (address, length), (address, length, device) or "
            f"(address, length, device, stride, count); got rows of {width} numbers"
        )


def _bad_value(rows: Sequence[Any]) -> ArgumentError:
    for index, row in enumerate(rows):
        for value in row:
            if not (isinstance(value, int) and 0 <= value < ADDRESS_LIMIT) or isinstance(
                value, bool
            ):
                return ArgumentError(
                    f"descriptor {index} holds {value!r}; descriptors hold integers from 0 to "
                    "2**64 - 1"
                )
    return ArgumentError("descriptors hold integers from 0 to 2**64 - 1")


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


# -- the check ----------------------------------------------------------------------------------


def check_descriptors(
    descriptors: object,
    registration: object,
    *,
    layers: Sequence[str | None] | None = None,
    whole_pages: bool = True,
    writes: bool = False,
    policy: PolicyArg | None = None,
) -> list[Finding]:
    """Check that every descriptor hits whole pages of one view of ``registration``, and
    nothing else.

    ``descriptors``: rows ``(address, length)``, ``(address, length, device_id)`` or NIXL's
    strided ``(address, length, device_id, stride, count)``, as a list of tuples or an integer
    array (``uint64`` included; a signed array is read as the 64-bit patterns it holds).
    ``registration``: what ``safeview.kv.block_views``, ``safeview.vllm.check_registration`` or
    (with addresses) ``check_tensors`` returned, or a ``MemoryMap`` (see ``memory_map``).

    Findings: ``outside_memory`` (bytes in no storage), ``outside_view`` (in a storage but not
    whole pages of one view: a gap, two pages, two layers, a stride that is not the view's),
    ``partial_page`` (inside one page but not all of it; ``whole_pages=False`` allows such
    slices), ``wrong_layer`` (``layers[i]`` names the layer row ``i`` is meant for, and it lies
    in another), ``overlapping_writes`` (with ``writes=True``: two rows of the batch, or two
    elements of one row, write the same byte).

    Under strict, raises ``safeview.AddressError`` for the first finding; under warn, emits an
    ``address_violation`` event per finding and returns them; ``off`` checks nothing and returns
    ``[]``. Rows that are not numbers below 2**64, or a ``layers`` list of another length, raise
    ``ArgumentError``.
    """
    active = current_policy(policy)
    if active is Policy.OFF:
        return []
    return _check(
        descriptors,
        memory_map(registration),
        layers=layers,
        whole_pages=whole_pages,
        writes=writes,
        active=active,
        source="check_descriptors",
    )


def _check(
    descriptors: object,
    memory: MemoryMap | None,
    *,
    layers: Sequence[str | None] | None = None,
    whole_pages: bool = True,
    writes: bool = False,
    active: Policy,
    source: str,
) -> list[Finding]:
    """``check_descriptors`` under a policy already resolved, naming ``source`` in its events
    and errors; with ``memory=None`` only writes that share a byte are looked for (a peer's
    addresses, which no registration of ours describes)."""
    rows = _rows(descriptors)
    index = memory._index if memory is not None else None
    found: list[Finding] = []
    if index is not None:
        found = _judge(
            rows,
            index,
            layers=layers,
            whole_pages=whole_pages,
            first_only=active is Policy.STRICT,
            # a few rows (one transfer of an engine without preparation) cost less one by one
            vectorised=len(rows.addresses) > _FEW_ROWS,
        )
    if writes and not (found and active is Policy.STRICT):
        found += _overlapping_writes(rows, index)
    _enforce(found, active, source)
    return found


def _enforce(found: Sequence[Finding], active: Policy, source: str) -> None:
    """Log every finding; under strict, raise for them."""
    if active is Policy.OFF or not found:
        return
    strict = active is Policy.STRICT
    for finding in found:
        log.address_violation(finding, strict=strict, policy=active.value, source=source)
    if strict:
        raise AddressError(found, policy=active.value, source=source)


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


# -- writes that share a byte -------------------------------------------------------------------


def _overlapping_writes(rows: _Rows, index: _Index | None) -> list[Finding]:
    """One finding per pair of rows (or per row, for its own elements) that write a byte twice,
    naming the byte found: every row that shares a byte with another is named in one."""
    import numpy as np

    count = len(rows.addresses)
    if count < 1:
        return []
    with np.errstate(all="ignore"):
        numbers = np.ones(count, dtype=np.uint64) if rows.counts is None else rows.counts
        keep = (rows.lengths > 0) & (numbers > 0)
        total = int(numbers[keep].sum(dtype=np.uint64)) if keep.any() else 0
        if total > _MAX_ELEMENTS:
            raise ArgumentError(
                f"writes=True would check {total} elements, more than {_MAX_ELEMENTS}; check "
                "the batch in parts"
            )
        chosen = np.flatnonzero(keep)
        repeats = numbers[chosen].astype(np.intp)
        owner = np.repeat(chosen, repeats)
        first_of_row = np.cumsum(repeats) - repeats
        element = np.arange(total, dtype=np.uint64) - np.repeat(
            first_of_row.astype(np.uint64), repeats
        )
        step = np.zeros(count, dtype=np.uint64) if rows.strides is None else rows.strides
        starts = rows.addresses[owner] + element * step[owner]
        lasts = starts + rows.lengths[owner] - np.uint64(1)
        lasts = np.where(lasts < starts, np.uint64(_TOP), lasts)
        devices = np.zeros(total, dtype=np.uint64) if rows.devices is None else rows.devices[owner]
        # Sorted by start, an element shares a byte with an earlier one exactly when it starts
        # before the farthest end so far; the element that reaches that far is named with it.
        order = np.lexsort((starts, devices))
        starts, lasts, owner, devices = starts[order], lasts[order], owner[order], devices[order]
        pairs: dict[tuple[int, int], int] = {}
        for device in np.unique(devices).tolist():
            part = np.flatnonzero(devices == device)
            if len(part) < 2:
                continue
            part_starts, part_lasts, part_owner = starts[part], lasts[part], owner[part]
            reach = np.maximum.accumulate(part_lasts)
            holder = np.maximum.accumulate(np.where(part_lasts == reach, np.arange(len(part)), 0))
            later = np.flatnonzero(part_starts[1:] <= reach[:-1]) + 1
            for position in later.tolist():
                one = int(part_owner[holder[position - 1]])
                other = int(part_owner[position])
                key = (min(one, other), max(one, other))
                byte = int(part_starts[position])
                if key not in pairs or byte < pairs[key]:
                    pairs[key] = byte
    found = []
    for (first, second), byte in sorted(pairs.items()):
        where: dict[str, Any] = {}
        if index is not None:
            device = None if rows.devices is None else int(rows.devices[first])
            holders = index.storage_at(byte, device)
            if holders:
                page = index.page_at(byte, device)
                where = {
                    "storage": holders[0].name,
                    "byte_offset": byte - holders[0].address,
                    "views": page[0] if page is not None else (),
                }
        found.append(
            Finding.overlapping_writes(
                rows.describe(first), rows.describe(second), byte=byte, **where
            )
        )
    return found


# -- regions registered with an engine ------------------------------------------------------------


class _Registered:
    """The regions registered with one engine through a guard, to refuse a region that overlaps
    one registered before (the engines accept both, and a transfer could then use either)."""

    def __init__(self, engine: str) -> None:
        self.engine = engine
        self.regions: list[tuple[Any, Descriptor]] = []  # (memory key, region)

    def overlapping(self, key: Any, regions: Sequence[Descriptor]) -> list[Finding]:
        """A ``duplicate_registration`` finding for each of ``regions`` that overlaps one
        registered before, or one before it in the same call."""
        found = []
        earlier = [region for known, region in self.regions if known == key]
        for region in regions:
            if region.length_bytes:
                for other in earlier:
                    low = max(region.address, other.address)
                    if low < min(
                        region.address + region.length_bytes, other.address + other.length_bytes
                    ):
                        found.append(
                            Finding.duplicate_registration(
                                region, other, byte=low, engine=self.engine
                            )
                        )
                        break
            earlier.append(region)
        return found

    def add(self, key: Any, regions: Iterable[Descriptor]) -> None:
        self.regions += [(key, region) for region in regions if region.length_bytes]

    def remove(self, key: Any, address: int, length: int | None = None) -> None:
        """Forget the regions of ``key`` at ``address`` (of ``length`` bytes, if given)."""
        self.regions = [
            (known, region)
            for known, region in self.regions
            if not (
                known == key
                and region.address == address
                and (length is None or region.length_bytes == length)
            )
        ]
