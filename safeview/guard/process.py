"""The process guard: every view a Python process makes over existing memory, judged, in every
thread, without a change to the program.

Turn it on for a program you did not write with one environment variable::

    SAFEVIEW_GUARD=strict python serve.py      # or: safeview run -- python serve.py

or from Python, for a program that starts it itself: ``safeview.guard.process.start("warn")``. The
start-up hook installed with safeview (``safeview-guard.pth``) reads ``SAFEVIEW_GUARD`` at
interpreter start; when torch (or NIXL, or Mooncake) is imported, the guard goes on for it
(``safeview.guard._entry_guard`` names the entry points). Each call to a watched entry point is
judged by the one checker (``safeview.check.bounds``) before torch runs it:

- under ``strict`` a view past the end of its storage, a growth of a storage other tensors
  use, or a shrink that leaves a live tensor past the new end, raises ``BoundsError`` and
  nothing is made, moved or resized;
- under ``warn`` a ``bounds_violation`` event, and the call goes on exactly as without safeview.

A raw address (``ctypes`` memory at an address however wrapped, a numpy array over it, a DLPack
capsule) is judged against the memory the guard knows, with its real bounds: storages of tensors
it has seen made into views, the layers handed to ``know`` (the vLLM plugin hands it every
connector's ``register_kv_caches``; ``safeview.kv.block_views`` and ``check_tensors`` theirs),
the memory a Python buffer or numpy array owns once a tensor aliases it, and mappings of files
and shared memory (``safeview.guard._memory``). An address whose span runs past the end of its
memory, or out of its layer into another known layer's bytes, or that starts exactly at the end of
an allocation where no other allocation begins, is refused under strict; an address it knows
nothing about is let through and counted. The local rows
handed to NIXL's agents and Mooncake's engines are judged the same way
(``safeview.guard._engine_hooks``), by ``safeview.transfer``'s descriptor check. The events
``process_guard_started`` (once) and ``process_guard_stopped`` (at exit, with the counts) say
what it did. A failure inside safeview never stops the host: an
``internal_error`` event, and the call goes on unjudged.
"""

from __future__ import annotations

import atexit
import bisect
import contextlib
import sys
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from safeview import log
from safeview.check import bounds
from safeview.errors import ArgumentError, BoundsError
from safeview.findings import Finding
from safeview.guard import _memory as _memory_of
from safeview.guard import _startup
from safeview.policy import Policy, PolicyArg, coerce_policy

if TYPE_CHECKING:
    from types import ModuleType

    from safeview._torch import StorageFacts

__all__ = [
    "ENV_GUARD", "Counts", "active", "counts", "know", "policy", "run_command", "start", "stop",
]  # fmt: skip

ENV_GUARD = _startup.ENV_GUARD


class Counts(NamedTuple):
    """What the guard did so far: ``judged`` calls of watched entry points it looked at,
    ``refused`` (strict) and ``warned`` (warn) violations, ``unknown_addresses``: raw addresses
    outside all memory it knows (let through), ``internal_errors``: calls it let through unjudged
    because it failed itself."""

    judged: int
    refused: int
    warned: int
    unknown_addresses: int
    internal_errors: int


# judged, refused, warned, unknown addresses, internal errors: a list, so that the hot path adds
# to a slot without a lookup of its own
_counts = [0, 0, 0, 0, 0]
_state: dict[str, Any] = {"policy": None, "source": None, "stopped_event": False}
_lock = threading.RLock()


# -- the memory the guard knows ----------------------------------------------------------------


class _Storage:
    """A storage (an allocation) the guard knows: where it is, its size, the layers in it."""

    __slots__ = (
        "address", "device", "fixed", "key", "layers", "name", "nbytes", "pages", "ref", "source",
    )  # fmt: skip

    def __init__(
        self, key: Any, name: str, address: int, nbytes: int, device: str, ref: Any, source: str
    ) -> None:
        # fixed: memory torch did not allocate (a buffer's owner, a mapping): its extent is the
        # owner's, not the storage's window, and never moves
        self.fixed = False
        self.key = key
        self.name = name
        self.address = address
        self.nbytes = nbytes
        self.device = device
        self.ref = ref
        self.source = source
        self.layers: list[tuple[int, int, str]] = []  # (first byte, exclusive end, layer)
        # (layer, first byte, page bytes, block stride bytes, blocks): the layers' pages, as a
        # transfer engine's descriptors must hit them
        self.pages: list[tuple[str, int, int, int, int]] = []


class _Memory:
    """Known storages by key, and an index by address built when asked after a change."""

    def __init__(self) -> None:
        self.storages: dict[Any, _Storage] = {}
        self._named = 0
        self._index: tuple[list[int], list[_Storage]] | None = None
        self._map: Any = None  # the transfer checks' MemoryMap of it, made when asked

    def add(
        self,
        key: Any,
        address: int,
        nbytes: int,
        device: str,
        ref: Any,
        *,
        source: str,
        fixed: bool = False,
        name: str | None = None,
    ) -> _Storage:
        with _lock:
            known = self.storages.get(key)
            if known is None:
                known = _Storage(
                    key, name or f"storage{self._named}", address, nbytes, device, ref, source
                )
                known.fixed = fixed
                self._named += name is None
                self.storages[key] = known
            elif not known.fixed:  # a fixed extent is the owner's: a window never narrows it
                known.address, known.nbytes = address, nbytes
            self._index = self._map = None
            return known

    def remove(self, key: Any) -> None:
        with _lock:
            if self.storages.pop(key, None) is not None:
                self._index = self._map = None

    def clear(self) -> None:
        """Forget every known storage, and which storages the entry guard has looked at: a
        storage it looked at and that is no longer known would otherwise stay unseen, and so
        would a later one whose handle (``_cdata``) is the same address."""
        with _lock:
            self.storages.clear()
            self._index = self._map = None
            entry_guard = sys.modules.get("safeview.guard._entry_guard")
            if entry_guard is not None:
                entry_guard.forget_all()

    def _refresh(self) -> tuple[list[int], list[_Storage]]:
        """Re-read every storage held by an object (a resize moves it) and sort them."""
        from safeview.guard import _entry_guard

        with _lock:
            for key, storage in list(self.storages.items()):
                if storage.ref is None:
                    continue
                now = _entry_guard.live(storage.ref)
                if now is None:
                    del self.storages[key]
                elif not storage.fixed:
                    storage.address, storage.nbytes = now
            ordered = sorted(self.storages.values(), key=lambda s: (s.address, -s.nbytes))
            if self._index is None or self._index[1] != ordered:
                self._map = None
            self._index = ([s.address for s in ordered], ordered)
            return self._index

    def memory_map(self) -> Any:
        """The known memory as ``safeview.transfer.MemoryMap``: each storage at its address; the
        pages of its known layers, or the whole storage as one page when none is known."""
        from safeview.transfer import MemoryMap, StorageSpan, ViewSpan

        self._refresh()
        with _lock:
            if self._map is not None:
                return self._map
            storages, views = [], []
            for storage in self.storages.values():
                storages.append(
                    StorageSpan(storage.name, storage.address, storage.nbytes, storage.device)
                )
                if not storage.pages:
                    views.append(ViewSpan(storage.name, storage.name, 0, storage.nbytes,
                                          storage.nbytes, 1))  # fmt: skip
                for layer, first, page, stride, blocks in storage.pages:
                    views.append(ViewSpan(layer, storage.name, first, page, stride, blocks, layer))
            self._map = MemoryMap(tuple(storages), tuple(views))
            return self._map

    def at(self, address: int) -> _Storage | None:
        """The known storage whose bytes hold ``address``; else the one that ends exactly there
        (the first byte past a storage: the usual off-by-one) unless that byte belongs to
        another allocation (``safeview.guard._memory.other_allocation``); else the mapping of a file
        or of shared memory that holds it (``mapped``); else ``None``."""
        storage = self._at(address)
        if storage is not None and storage.address <= address < storage.address + storage.nbytes:
            return storage
        if storage is not None and not _memory_of.other_allocation(
            storage.device, address - 1, address
        ):
            return storage
        return self.mapped(address)

    def mapped(self, address: int) -> _Storage | None:
        """The mapping of a file or of shared memory (``/proc/self/maps``) that holds
        ``address``, known from now on as one allocation (named by its file), or ``None``."""
        if not _memory_of.maps_available():
            return None
        mapping = _memory_of.mapping_at(address)
        if mapping is None or not mapping.data:
            return None
        key = ("mapping", mapping.start, mapping.end, mapping.inode, mapping.offset)
        known = self.storages.get(key)
        if known is None:
            known = self.add(
                key, mapping.start, mapping.data_end() - mapping.start, "cpu", None,
                source="mapping", fixed=True, name=mapping.path or f"mapping {mapping.start:#x}",
            )  # fmt: skip
        return known

    def drop_stale(self) -> None:
        """Forget the mappings that ``/proc/self/maps``, as last read, no longer holds."""
        now = {
            ("mapping", m.start, m.end, m.inode, m.offset) for m in _memory_of.current_mappings()
        }
        with _lock:
            for key, storage in list(self.storages.items()):
                if storage.source == "mapping" and key not in now:
                    del self.storages[key]
                    self._index = self._map = None

    def _at(self, address: int) -> _Storage | None:
        index = self._index or self._refresh()
        starts, ordered = index
        at = bisect.bisect_right(starts, address) - 1
        ends_here = None
        while at >= 0:
            storage = ordered[at]
            if storage.address <= address < storage.address + storage.nbytes:
                return storage
            if address == storage.address + storage.nbytes and ends_here is None:
                ends_here = storage
            if address - storage.address > 1 << 48:
                break
            at -= 1
        return ends_here


_memory = _Memory()


def know(layers: Mapping[str, Any]) -> None:
    """Tell the guard which layer each cache tensor is (``{name: tensor or list of tensors}``,
    as ``register_kv_caches`` takes them): their storages become known memory, so a raw address
    in them is judged, and a raw view that starts in one layer and runs into another layer's
    bytes is refused under strict. Layers whose bytes interleave (block-major packing) are known
    by their storage only. The vLLM plugin calls this for every connector's
    ``register_kv_caches`` while the guard is on. Needs torch."""
    if not isinstance(layers, Mapping):
        raise ArgumentError(
            f"layers must map each layer's name to its cache tensor; got {type(layers).__name__}"
        )
    from safeview.guard import _entry_guard

    spans: dict[Any, list[tuple[tuple[int, int, str], tuple[str, int, int, int, int]]]] = {}
    for name, value in layers.items():
        for tensor in value if isinstance(value, (list, tuple)) else (value,):
            described = _entry_guard.describe_tensor(tensor)
            if described is None:
                continue
            key, address, nbytes, device, ref, first, end = described
            storage = _region_of(key, address, nbytes, device, ref, tensor)
            # offsets from the start of the memory the storage is a window onto
            shift = address - storage.address
            first, end = first + shift, end + shift
            page, stride, blocks = _entry_guard.pages_of(tensor)
            spans.setdefault(storage.key, []).append(
                ((first, end, str(name)), (str(name), first, page, stride, blocks))
            )
    with _lock:
        for key, found in spans.items():
            storage = _memory.storages[key]
            storage.layers = sorted({*storage.layers, *(span for span, _ in found)})
            storage.pages = sorted({*storage.pages, *(pages for _, pages in found)})
        _memory._map = None


def _region_of(key: Any, address: int, nbytes: int, device: str, ref: Any, tensor: Any) -> _Storage:
    """The known memory a layer's storage is: itself when torch allocated it or the guard knows
    its owner already; the file or shared-memory mapping it lies in; else its own bytes."""
    if key not in _memory.storages and device == "cpu" and not tensor.untyped_storage().resizable():
        mapping = _memory.mapped(address)
        if mapping is not None and address + nbytes <= mapping.address + mapping.nbytes:
            return mapping
    return _memory.add(key, address, nbytes, device, ref, source="layers")


def learn_layers(layers: Any) -> None:
    """``know(layers)`` while the guard is on; nothing otherwise. Never raises (the vLLM plugin
    calls it for each connector's ``register_kv_caches``): a failure is an ``internal_error``."""
    if _state["policy"] is None:
        return
    try:
        know(layers)
    except Exception as error:
        _internal_error("learn_layers", error)


# -- judging ------------------------------------------------------------------------------------


def _policy() -> Policy:
    value = _state["policy"]
    return value if value is not None else Policy.STRICT


def _site_text(site: tuple[str, int, str]) -> str:
    import os

    file, line, function = site
    parts = file.replace("\\", "/").split("/")[-2:]
    return f"{os.path.join(*parts)}:{line} in {function}"


def _violation(
    finding: Finding,
    op: str,
    *,
    device: str,
    storage_nbytes: int,
    geometry: dict[str, Any],
    site: tuple[str, int, str],
) -> None:
    """Report ``finding``; raise ``BoundsError`` under strict."""
    active = _policy()
    strict = active is Policy.STRICT
    _counts[1 if strict else 2] += 1
    file, line, function = site
    log.bounds_violation(
        finding,
        strict=strict,
        policy=active.value,
        device=device,
        storage_nbytes=storage_nbytes,
        geometry=geometry,
        site={"op": op, "file": file, "line": line, "function": function},
    )
    if strict:
        raise BoundsError(
            finding,
            storage_nbytes=storage_nbytes,
            device=device,
            policy=active.value,
            op=op,
            site=_site_text(site),
        )


def _geometry(
    byte_offset: int, shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int, dtype: str
) -> dict[str, Any]:
    if dtype in ("int8", "uint8") and len(shape) == 2 and strides[1:] == (1,):
        return log.block_geometry(byte_offset, shape[0], shape[1], strides[0])
    return log.strided_geometry(byte_offset, dtype, shape, strides)


def _judge_view(
    op: str,
    facts: StorageFacts,
    byte_offset: int,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    itemsize: int,
    dtype: str,
    site_internal: tuple[tuple[str, int, str], bool],
    growth: bool,
) -> None:
    """A view (or a growth) that the entry guard found reaching past its storage: judged by the
    checker, reported, refused under strict. An empty view that torch's own Python code places
    past the end (deepcopy, ``torch.load``) is torch's bookkeeping and passes."""
    site, internal = site_internal
    try:
        from safeview import _arith

        extent = _arith.extent_bytes(byte_offset, shape, strides, itemsize)
        if extent == byte_offset and internal:
            return
        known = _memory.storages.get(facts.key)
        found = bounds(
            None,
            storage=known.name if known is not None else None,
            byte_offset=byte_offset,
            extent_bytes=extent,
            storage_nbytes=facts.nbytes,
        )
        geometry = _geometry(byte_offset, shape, strides, itemsize, dtype)
    except Exception as error:
        _internal_error(op, error)
        return
    for finding in found:
        _violation(
            finding,
            op,
            device=facts.device,
            storage_nbytes=facts.nbytes,
            geometry=geometry,
            site=site,
        )


def _judge_raw(
    op: str,
    address: int,
    length: int,
    where: Callable[[], tuple[tuple[str, int, str], bool]],
    owner: tuple[int, int, str] | None = None,
) -> None:
    """``length`` bytes at a raw ``address``, about to become a tensor (or be copied into one):
    judged against ``owner`` (``(address, nbytes, name)`` of the memory the object handed to
    torch owns) when it is given, else against the known memory. Unknown addresses are counted
    and let through. ``where()`` finds the call site (only for a violation: walking the stack
    costs more than the check)."""
    try:
        for attempt in range(2):
            if owner is not None:
                start, nbytes, name = owner
                storage = _Storage(None, name, start, nbytes, "cpu", None, "buffer")
            else:
                found_storage = _memory.at(address)
                if found_storage is None:
                    _counts[3] += 1
                    return
                storage = found_storage
            byte_offset = address - storage.address
            extent = byte_offset + max(length, 0)
            layer, region = _layer_region(storage, byte_offset, extent)
            found = bounds(
                layer,
                storage=storage.name,
                byte_offset=byte_offset,
                extent_bytes=extent,
                storage_nbytes=storage.nbytes,
                region=region,
            )
            if not found or storage.source != "mapping" or attempt:
                break
            # a mapping known from an earlier read of /proc/self/maps may be gone: read it
            # again before refusing
            _memory_of.mapping_at(address, fresh=True)
            _memory.drop_stale()
        geometry = {"byte_offset": byte_offset, "address": address, "length_bytes": length}
    except Exception as error:
        _internal_error(op, error)
        return
    for finding in found[:1]:
        _violation(
            finding,
            op,
            device=storage.device,
            storage_nbytes=storage.nbytes,
            geometry=geometry,
            site=where()[0],
        )


def _judge_rows(source: str, rows: Any) -> None:
    """Descriptor rows of this process's own memory, about to be handed to a transfer engine
    (``source`` names the call): those that start in known memory are judged by
    ``safeview.transfer.check_descriptors`` against it (slices of pages allowed: a peer of
    another tensor-parallel size reads parts of pages); the rest are counted and let through.
    Raises ``AddressError`` under strict."""
    from safeview.errors import AddressError
    from safeview.transfer import _check

    try:
        _counts[0] += 1
        rows = [tuple(int(value) for value in row) for row in rows]
        kept, mapped = _known_rows(rows)
        if not kept:
            return
        memory = _memory.memory_map()
        if mapped and _check(
            kept, memory, whole_pages=False, writes=False, active=Policy.OFF, source=source
        ):
            # a finding on a mapping known from an earlier read of /proc/self/maps, which may
            # be gone: read it again before judging
            _memory_of.mapping_at(mapped[0], fresh=True)
            _memory.drop_stale()
            kept, _ = _known_rows(rows, count=False)
            if not kept:
                return
            memory = _memory.memory_map()
    except Exception as error:
        _internal_error(source, error)
        return
    active = _policy()
    try:
        found = _check(kept, memory, whole_pages=False, writes=False, active=active, source=source)
    except AddressError:
        _counts[1] += 1
        raise
    except Exception as error:
        _internal_error(source, error)
        return
    if found:
        _counts[2] += 1


def _known_rows(rows: list[tuple[int, ...]], *, count: bool = True) -> tuple[list[Any], list[int]]:
    """The rows that start in known memory, and the addresses of those in a mapping; the others
    counted as unknown addresses (when ``count``)."""
    kept, mapped = [], []
    for row in rows:
        storage = _memory.at(row[0])
        if storage is None:
            _counts[3] += count
        else:
            kept.append(row)
            if storage.source == "mapping":
                mapped.append(row[0])
    return kept, mapped


def _layer_region(
    storage: _Storage, byte_offset: int, extent: int
) -> tuple[str | None, tuple[int, int] | None]:
    """The layer whose bytes hold ``byte_offset`` (if exactly one does), and its byte range
    when the span runs out of it into another layer's bytes (the range the view must keep
    to), else ``None``."""
    holding = [entry for entry in storage.layers if entry[0] <= byte_offset < entry[1]]
    if not holding:
        # a span that starts where a layer ends, in no layer: the pointer one layer too far
        before = [name for _, end, name in storage.layers if end == byte_offset]
        return (f"{before[0]} (the bytes after it)" if len(before) == 1 else None), None
    if len(holding) != 1:
        return None, None
    first, end, name = holding[0]
    if extent <= end:
        return name, None
    for other_first, other_end, other in storage.layers:
        if other != name and other_first < extent and other_end > end:
            return name, (first, end)
    return name, None


def _internal_error(where: str, error: BaseException) -> None:
    _counts[4] += 1
    log.internal_error(where=f"process guard ({where})", error=error)


# -- on and off ---------------------------------------------------------------------------------


def _on_import(name: str, module: ModuleType, policy: str) -> None:
    """The start-up hook's finder saw ``name`` finish importing: the guard goes on for it."""
    if _state["policy"] is None:
        _begin(coerce_policy(policy, source=ENV_GUARD), source=ENV_GUARD)
    if name == "torch":
        from safeview.guard import _aten_guard, _entry_guard

        _entry_guard.install(sys.modules[__name__])
        _aten_guard.install()  # set_ and resize_ at the dispatcher, and the storage's resize_
    elif name.endswith("._api") and name.startswith("nixl"):
        from safeview.guard import _engine_hooks

        _engine_hooks.patch_nixl(module, _judge_rows)
    elif name == "mooncake.engine":
        from safeview.guard import _engine_hooks

        _engine_hooks.patch_mooncake(module, _judge_rows)


def _begin(active: Policy, *, source: str) -> None:
    with _lock:
        if _state["policy"] is not None:
            _state["policy"] = active
            return
        _state["policy"] = active
        _state["source"] = source
        if not _state.get("atexit"):
            _state["atexit"] = True
            atexit.register(_closing)
    from safeview.guard._entry_guard import WATCHED

    log.process_guard(
        "process_guard_started",
        policy=active.value,
        source=source,
        watches=list(WATCHED),
        counts=None,
    )


def start(policy: PolicyArg = "strict") -> None:
    """Turn the process guard on now, in every thread (``strict`` or ``warn``; ``off`` turns it
    off). Needs torch. Calling it again changes the policy."""
    active = coerce_policy(policy)
    if active is Policy.OFF:
        stop()
        return
    _begin(active, source="safeview.guard.process.start")
    # torch now (it is needed; _torch says what to install when it is missing), the engines now
    # or when they are imported
    from safeview import _torch  # noqa: F401

    _startup.install(active.value)


def stop() -> None:
    """Turn the guard off: torch's own entry points are back, and ``process_guard_stopped`` says
    what it did."""
    sys.meta_path[:] = [f for f in sys.meta_path if not _startup.is_hook(f)]
    if "safeview.guard._entry_guard" in sys.modules:
        from safeview.guard import _aten_guard, _entry_guard

        _aten_guard.uninstall()
        _entry_guard.uninstall()
    if _state["policy"] is not None:
        _closing()
        _state["policy"] = None


def active() -> bool:
    """Whether the guard is on in this process."""
    return _state["policy"] is not None


def policy() -> Policy | None:
    """The guard's policy, or ``None`` when it is off."""
    value: Policy | None = _state["policy"]
    return value


def counts() -> Counts:
    """What the guard did so far (see ``Counts``)."""
    return Counts(*_counts)


def run_command(argv: list[str], policy: str = "strict") -> int:
    """Run ``argv`` with ``SAFEVIEW_GUARD=policy`` in its environment and return its exit status
    (``128 + N`` when a signal ``N`` ended it, as a shell says; 127 when it cannot be started)."""
    import os
    import subprocess

    environment = dict(os.environ)
    environment[ENV_GUARD] = coerce_policy(policy, source="--policy").value
    try:
        status = subprocess.call(argv, env=environment)
    except OSError as error:
        sys.stderr.write(f"safeview: cannot run {argv[0]!r}: {error.strerror or error}\n")
        return 127
    return 128 - status if status < 0 else status


def _closing() -> None:
    active = _state["policy"]
    if active is None:
        return
    with contextlib.suppress(Exception):  # at exit, logging may already be gone
        log.process_guard(
            "process_guard_stopped",
            policy=active.value,
            source=_state["source"],
            watches=None,
            counts=counts()._asdict(),
        )
