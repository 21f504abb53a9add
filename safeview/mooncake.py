"""A guard around a Mooncake transfer engine: the local address of every transfer is checked
against a registration before the engine moves a byte.

Over TCP, Mooncake's transfer engine checks the peer's address against the peer's registered
buffers and nothing on the local side: a write from, or a read into, local memory outside every
registration succeeds, and so does a row on another layer's page or across two pages.
``guard(engine, registration)`` returns a proxy (the engine is a pybind object whose methods
cannot be replaced) that checks, before the engine runs:

- ``transfer_sync_write``, ``transfer_sync_read``, ``transfer_sync``, ``transfer_submit_write``:
  the local row ``(buffer, length)`` against the registration;
- ``batch_transfer_sync_write`` / ``_read``, ``batch_transfer_async_write`` / ``_read``,
  ``batch_transfer_sync``, ``batch_transfer_async``: every local row, and the rows written (the
  peer's for a write, the local ones for a read) against each other (``overlapping_writes``);
- ``register_memory``, ``batch_register_memory``: a region overlapping one registered before
  through the guard is a ``duplicate_registration``; ``unregister_memory`` and
  ``batch_unregister_memory`` forget it.

Every other attribute is the engine's own. Mooncake is never imported here. An engine without
the methods this guard knows (Mooncake 0.3.13) gets one ``integration_unavailable`` event and is
returned as it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib import metadata
from typing import Any

from safeview import log
from safeview.findings import Descriptor
from safeview.policy import Policy, PolicyArg, current_policy
from safeview.transfer import MemoryMap, _check, _enforce, _Registered, memory_map

__all__ = ["GuardedEngine", "guard"]

_NEEDS = (
    "register_memory",
    "unregister_memory",
    "transfer_sync_write",
    "transfer_sync_read",
    "batch_transfer_sync_write",
    "batch_transfer_sync_read",
)
_HOST = ("DRAM", None)  # Mooncake's buffers are addresses of one process: one memory
_reported: set[str] = set()


def _version() -> str | None:
    for name in ("mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def guard(
    engine: Any,
    registration: object,
    *,
    policy: PolicyArg | None = None,
    whole_pages: bool = True,
) -> Any:
    """A proxy of ``engine`` (a Mooncake ``TransferEngine``) that checks each transfer's local
    rows against ``registration`` (what ``safeview.kv.block_views`` or
    ``safeview.vllm.check_registration`` returned, or a ``safeview.transfer.MemoryMap``) before
    the engine moves a byte; use it in the engine's place.

    Under strict a wrong row raises ``safeview.AddressError`` and the engine is not called;
    under warn each finding is an ``address_violation`` event and the call goes ahead; ``off``
    checks nothing. The policy is looked up at each call unless given here.
    ``whole_pages=False`` lets rows be slices of one page.
    """
    memory = memory_map(registration)
    if isinstance(engine, GuardedEngine):
        engine._safeview_memory = memory
        engine._safeview_policy = policy
        engine._safeview_whole_pages = whole_pages
        return engine
    missing = [name for name in _NEEDS if not callable(getattr(engine, name, None))]
    if missing:
        reason = f"the engine ({type(engine).__name__}) has no {', '.join(missing)}"
        if reason not in _reported:
            _reported.add(reason)
            log.integration(
                "integration_unavailable",
                integration="mooncake",
                reason=reason,
                version=_version(),
            )
        return engine
    return GuardedEngine(engine, memory, policy, whole_pages)


def _argument(args: tuple[Any, ...], kwargs: dict[str, Any], position: int, name: str) -> Any:
    return args[position] if len(args) > position else kwargs[name]


def _reads(opcode: Any) -> bool:
    """Whether a ``TransferOpcode`` is a read (its name is ``Read``)."""
    return str(getattr(opcode, "name", opcode)).lower().endswith("read")


class GuardedEngine:
    """A Mooncake transfer engine whose transfers are checked first; everything else is the
    engine's own (``engine`` is the engine itself)."""

    def __init__(
        self, engine: Any, memory: MemoryMap, policy: PolicyArg | None, whole_pages: bool
    ) -> None:
        self.engine = engine
        self._safeview_memory = memory
        self._safeview_policy = policy
        self._safeview_whole_pages = whole_pages
        self._safeview_registered = _Registered("Mooncake transfer engine")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def __repr__(self) -> str:
        return f"<safeview guard of {self.engine!r}>"

    # -- checks ----------------------------------------------------------------------------

    def _active(self) -> Policy:
        return current_policy(self._safeview_policy)

    def _local(
        self, rows: Sequence[tuple[int, int]], active: Policy, source: str, writes: bool
    ) -> None:
        _check(
            rows,
            self._safeview_memory,
            whole_pages=self._safeview_whole_pages,
            writes=writes,
            active=active,
            source=source,
        )

    def _one(self, source: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        active = self._active()
        if active is not Policy.OFF:
            buffer = _argument(args, kwargs, 1, "buffer")
            length = _argument(args, kwargs, 3, "length")
            self._local([(buffer, length)], active, source, writes=False)

    def _batch(
        self, source: str, args: tuple[Any, ...], kwargs: dict[str, Any], reading: bool
    ) -> None:
        active = self._active()
        if active is Policy.OFF:
            return
        buffers = _argument(args, kwargs, 1, "buffers")
        peers = _argument(args, kwargs, 2, "peer_buffer_addresses")
        lengths = _argument(args, kwargs, 3, "lengths")
        local = list(zip(buffers, lengths))
        self._local(local, active, source, writes=reading)
        if not reading:
            _check(
                list(zip(peers, lengths)),
                None,
                writes=True,
                active=active,
                source=source + " (peer addresses)",
            )

    def _register(self, source: str, regions: list[Descriptor]) -> None:
        active = self._active()
        if active is not Policy.OFF:
            found = self._safeview_registered.overlapping(_HOST, regions)
            _enforce(found, active, source)

    # -- the engine's methods, checked ----------------------------------------------------

    def transfer_sync_write(self, *args: Any, **kwargs: Any) -> Any:
        self._one("mooncake.transfer_sync_write", args, kwargs)
        return self.engine.transfer_sync_write(*args, **kwargs)

    def transfer_sync_read(self, *args: Any, **kwargs: Any) -> Any:
        self._one("mooncake.transfer_sync_read", args, kwargs)
        return self.engine.transfer_sync_read(*args, **kwargs)

    def transfer_sync(self, *args: Any, **kwargs: Any) -> Any:
        self._one("mooncake.transfer_sync", args, kwargs)
        return self.engine.transfer_sync(*args, **kwargs)

    def transfer_submit_write(self, *args: Any, **kwargs: Any) -> Any:
        self._one("mooncake.transfer_submit_write", args, kwargs)
        return self.engine.transfer_submit_write(*args, **kwargs)

    def batch_transfer_sync_write(self, *args: Any, **kwargs: Any) -> Any:
        self._batch("mooncake.batch_transfer_sync_write", args, kwargs, reading=False)
        return self.engine.batch_transfer_sync_write(*args, **kwargs)

    def batch_transfer_sync_read(self, *args: Any, **kwargs: Any) -> Any:
        self._batch("mooncake.batch_transfer_sync_read", args, kwargs, reading=True)
        return self.engine.batch_transfer_sync_read(*args, **kwargs)

    def batch_transfer_async_write(self, *args: Any, **kwargs: Any) -> Any:
        self._batch("mooncake.batch_transfer_async_write", args, kwargs, reading=False)
        return self.engine.batch_transfer_async_write(*args, **kwargs)

    def batch_transfer_async_read(self, *args: Any, **kwargs: Any) -> Any:
        self._batch("mooncake.batch_transfer_async_read", args, kwargs, reading=True)
        return self.engine.batch_transfer_async_read(*args, **kwargs)

    def batch_transfer_sync(self, *args: Any, **kwargs: Any) -> Any:
        reading = _reads(_argument(args, kwargs, 4, "opcode"))
        self._batch("mooncake.batch_transfer_sync", args, kwargs, reading=reading)
        return self.engine.batch_transfer_sync(*args, **kwargs)

    def batch_transfer_async(self, *args: Any, **kwargs: Any) -> Any:
        reading = _reads(_argument(args, kwargs, 4, "opcode"))
        self._batch("mooncake.batch_transfer_async", args, kwargs, reading=reading)
        return self.engine.batch_transfer_async(*args, **kwargs)

    def register_memory(self, *args: Any, **kwargs: Any) -> Any:
        address = _argument(args, kwargs, 0, "buffer_addr")
        capacity = _argument(args, kwargs, 1, "capacity")
        regions = [Descriptor(0, int(address), int(capacity))]
        self._register("mooncake.register_memory", regions)
        result = self.engine.register_memory(*args, **kwargs)
        if result == 0:
            self._safeview_registered.add(_HOST, regions)
        return result

    def batch_register_memory(self, *args: Any, **kwargs: Any) -> Any:
        addresses = _argument(args, kwargs, 0, "buffer_addresses")
        capacities = _argument(args, kwargs, 1, "capacities")
        regions = [
            Descriptor(index, int(address), int(capacity))
            for index, (address, capacity) in enumerate(zip(addresses, capacities))
        ]
        self._register("mooncake.batch_register_memory", regions)
        result = self.engine.batch_register_memory(*args, **kwargs)
        if result == 0:
            self._safeview_registered.add(_HOST, regions)
        return result

    def unregister_memory(self, *args: Any, **kwargs: Any) -> Any:
        address = _argument(args, kwargs, 0, "arg0")
        result = self.engine.unregister_memory(*args, **kwargs)
        if result == 0:
            self._safeview_registered.remove(_HOST, int(address))
        return result

    def batch_unregister_memory(self, *args: Any, **kwargs: Any) -> Any:
        addresses = _argument(args, kwargs, 0, "arg0")
        result = self.engine.batch_unregister_memory(*args, **kwargs)
        if result == 0:
            for address in addresses:
                self._safeview_registered.remove(_HOST, int(address))
        return result
