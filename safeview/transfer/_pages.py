"""The memory descriptors are judged against: storages at their addresses and the views of a
registration, in plain integers (``MemoryMap``), and the same arranged for lookups (``_Index``).

A ``MemoryMap`` is read by the index as the checker's own records (``safeview.check``:
``StorageRecord`` for each storage, the int8 block ``ViewRecord`` for each view), so that a view
is understood in one way by the checker and by the transfer checks. Private to ``safeview``: the
public names are re-exported by ``safeview.transfer``.
"""

from __future__ import annotations

import bisect
import itertools
import operator
import re
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, NamedTuple

from safeview import _arith
from safeview.check import StorageRecord, ViewRecord
from safeview.errors import ArgumentError

if TYPE_CHECKING:
    from safeview.manifest import Manifest

__all__ = ["ADDRESS_LIMIT", "MemoryMap", "StorageSpan", "ViewSpan", "memory_map"]

ADDRESS_LIMIT = 2**64
"""One past the last address: descriptors are unsigned 64-bit numbers."""
_TOP = ADDRESS_LIMIT - 1


def _numpy() -> None:
    """Import numpy, or say how to install it."""
    try:
        import numpy  # noqa: F401
    except ImportError as missing:  # pragma: no cover - exercised where numpy is absent
        raise ImportError(
            "safeview.transfer needs numpy, which is not installed; from a checkout of "
            'safeview: pip install -e ".[transfer]" (or pip install numpy)'
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

        >>> from safeview.transfer import check_descriptors
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
        object.__setattr__(self, "storages", _spans("storages", self.storages, StorageSpan))
        object.__setattr__(self, "views", _spans("views", self.views, ViewSpan))
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

    def records(self) -> tuple[dict[str, StorageRecord], list[ViewRecord]]:
        """The map as the checker's records (``safeview.check``): each storage a
        ``StorageRecord`` whose ``base`` is its address and whose ``memory`` is its device id,
        each view the int8 block ``ViewRecord`` of its pages. The index reads these."""
        storages = {
            s.name: StorageRecord(s.nbytes, memory=s.device_id, base=s.address)
            for s in self.storages
        }
        views = [
            ViewRecord.block(
                v.name,
                v.storage,
                num_blocks=v.num_blocks,
                page_bytes=v.page_bytes,
                block_stride_bytes=v.block_stride_bytes,
                byte_offset=v.byte_offset,
            )
            for v in self.views
        ]
        return storages, views

    @classmethod
    def from_manifest(
        cls,
        manifest: Manifest,
        *,
        addresses: Mapping[str, int],
        storage_of: Mapping[str, str] | str = "storage0",
        nbytes: Mapping[str, int] | None = None,
        devices: Mapping[str, str] | None = None,
    ) -> MemoryMap:
        """The map of a manifest's layers (``safeview.describe``), read from the records the
        checker reads (``Manifest.records``): each storage at ``addresses[name]`` (the address
        of its byte 0), of ``nbytes[name]`` bytes (default: just large enough for its views),
        on ``devices[name]`` (``cpu`` when not given); ``storage_of`` as ``Manifest.records``
        takes it. A storage without an address is an ``ArgumentError`` naming it."""
        records, views = manifest.records(storage_of, nbytes)
        storages = []
        for name, record in records.items():
            if name not in addresses:
                raise ArgumentError(f"addresses has no entry for storage {name!r}")
            device = (devices or {}).get(name, "cpu")
            storages.append(
                StorageSpan(name, _address_of(name, addresses[name]), record.nbytes, device)
            )
        layers = set(manifest.layers)
        return cls(tuple(storages), tuple(_view_span(view, layers) for view in views))

    @cached_property
    def _index(self) -> _Index:
        return _Index(self)


def _spans(argument: str, given: object, kind: type[Any]) -> tuple[Any, ...]:
    """``given`` as a tuple of ``kind`` (``StorageSpan`` or ``ViewSpan``): spans as they are,
    plain tuples of their fields made into spans; anything else is an ``ArgumentError`` naming
    the argument and the entry."""
    if isinstance(given, (str, bytes, Mapping)) or not isinstance(given, Iterable):
        raise ArgumentError(
            f"MemoryMap {argument} must be a sequence of {kind.__name__}; "
            f"got {type(given).__name__}"
        )
    spans = []
    for position, entry in enumerate(given):
        if not isinstance(entry, kind):
            try:
                if not isinstance(entry, tuple):
                    raise TypeError
                entry = kind(*entry)
            except TypeError:
                raise ArgumentError(
                    f"MemoryMap {argument}[{position}] must be a {kind.__name__} (or a tuple of "
                    f"its fields {', '.join(kind._fields)}); got {type(entry).__name__}"
                ) from None
        if not isinstance(entry.name, str):
            raise ArgumentError(
                f"MemoryMap {argument}[{position}]: name must be a string; got {entry.name!r}"
            )
        spans.append(entry)
    return tuple(spans)


def _address_of(name: str, value: object) -> int:
    """The address given for storage ``name`` in ``addresses``, as an integer."""
    try:
        if isinstance(value, bool):
            raise TypeError
        address = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ArgumentError(
            f"addresses[{name!r}] must be an integer address; got {value!r}"
        ) from None
    if not 0 <= address < ADDRESS_LIMIT:
        raise ArgumentError(f"addresses[{name!r}] is {address:#x}, outside 0..2**64 - 1")
    return address


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
    for argument, mapping in (("addresses", addresses), ("devices", devices)):
        if mapping is not None and not isinstance(mapping, Mapping):
            raise ArgumentError(
                f"{argument} must map storage names to values; got {type(mapping).__name__}"
            )
    if addresses is not None:
        addresses = {name: _address_of(name, value) for name, value in addresses.items()}
    for name, device in (devices or {}).items():
        if not isinstance(device, str):
            raise ArgumentError(f"devices[{name!r}] must be a device name; got {device!r}")
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
        storages, records = memory.records()
        aliases: dict[tuple[int, ...], int] = {}
        self.aliases: list[_Alias] = []
        alias_views: list[list[str]] = []
        alias_layers: list[set[str]] = []
        for record, view in zip(records, memory.views):
            storage = storages[record.storage]
            device = int(storage.memory)  # type: ignore[call-overload]
            base = storage.base + record.byte_offset
            end = storage.base + storage.nbytes
            (blocks, page), (stride, _) = record.shape, record.strides
            if not page or not blocks or base + page > end:
                continue
            if stride:
                blocks = min(blocks, (end - base - page) // stride + 1)
            key = (device, base, page, stride, blocks)
            index = aliases.get(key)
            if index is None:
                index = aliases[key] = len(self.aliases)
                self.aliases.append(_Alias(base, page, stride, blocks, device, record.storage, ()))
                alias_views.append([])
                alias_layers.append(set())
            alias_views[index].append(record.name)
            alias_layers[index].update((record.name, view.layer or view.name))
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
            # sorted by numbers only, so that the families do not depend on the views' order
            pending = sorted(members, key=lambda i: (self.aliases[i].base, self.aliases[i].page, i))
            # Windows: the lowest page left starts one (so a family's first member is at offset
            # 0). Pages that fill the window back to back (a packed group) are its members if
            # there are such; otherwise it takes greedily the pages after it that fit without
            # overlapping. The others start windows of their own.
            while pending:
                origin = self.aliases[pending[0]].base
                chosen = self._tiling(pending, origin, stride)
                if chosen is None:
                    chosen, reach = [], origin
                    for index in pending:
                        alias = self.aliases[index]
                        if reach <= alias.base and alias.base + alias.page <= origin + stride:
                            chosen.append(index)
                            reach = alias.base + alias.page
                taken = set(chosen)
                pending = [index for index in pending if index not in taken]
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

    def _tiling(self, pending: list[int], origin: int, stride: int) -> list[int] | None:
        """Aliases of ``pending`` whose pages fill ``[origin, origin + stride)`` back to back,
        or ``None``: a depth-first walk from ``origin``, each position tried once."""
        starts: dict[int, list[int]] = {}
        for index in pending:
            alias = self.aliases[index]
            if alias.base >= origin + stride:
                break
            if alias.base + alias.page <= origin + stride:
                starts.setdefault(alias.base, []).append(index)
        end = origin + stride
        dead: set[int] = set()
        # the chain so far, each with the position of the next candidate to try at its start
        chain: list[int] = []
        tries = [0]
        at = origin
        while True:
            if at == end:
                return chain
            options = starts.get(at, [])
            if at in dead or tries[-1] >= len(options):
                dead.add(at)
                if not chain:
                    return None
                tries.pop()
                at -= self.aliases[chain.pop()].page
                tries[-1] += 1
                continue
            index = options[tries[-1]]
            chain.append(index)
            tries.append(0)
            at += self.aliases[index].page

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
