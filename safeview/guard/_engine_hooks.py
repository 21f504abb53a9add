"""The process guard's transfer-engine side: NIXL's agent class and Mooncake's engine class,
patched when they are imported.

The methods that ``safeview.transfer.nixl.guard`` and ``safeview.transfer.mooncake.guard`` check on
one agent or engine are replaced on the class, so every agent and engine of the process is checked,
including those made by code nobody wrapped. The rows of memory this process owns (NIXL's local
lists, Mooncake's local buffers) that lie in memory the process guard knows
(``safeview.guard.process``) are judged by ``safeview.transfer.check_descriptors`` against it,
before the engine sees them; rows elsewhere are let through and counted (``unknown_addresses``). A
peer's addresses are never judged here. Neither engine is imported by this module.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

__all__ = ["patch_mooncake", "patch_nixl"]

_PATCHED = "__safeview_process_guard__"
LOCAL_AGENT = "NIXL_INIT_AGENT"


# the judge of local rows, handed over by ``safeview.guard.process`` (which imports this module)
# when it patches an engine: ``judge_rows(source, rows)``
_judges: list[Callable[[str, Any], None]] = []


def _judge(source: str, rows: Any) -> None:
    _judges[0](source, rows)


def _replace(owner: Any, name: str, make: Callable[[Callable[..., Any]], Any]) -> None:
    original = owner.__dict__.get(name)
    if original is None or getattr(original, _PATCHED, False):
        return
    replacement = make(original)
    setattr(replacement, _PATCHED, True)
    setattr(owner, name, replacement)


# -- NIXL ---------------------------------------------------------------------------------------


def patch_nixl(module: Any, judge_rows: Callable[[str, Any], None]) -> None:
    """Check the local descriptor lists of every ``nixl_agent`` of ``module`` (``nixl_cu12._api``
    and its siblings) with ``judge_rows``."""
    _judges[:] = [judge_rows]
    from safeview.transfer.nixl import _rows

    agent_class = getattr(module, "nixl_agent", None)
    if agent_class is None:
        return

    def prep(original: Callable[..., Any]) -> Any:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def prep_xfer_dlist(self: Any, *args: Any, **kwargs: Any) -> Any:
            given = signature.bind(self, *args, **kwargs).arguments
            if given.get("agent_name") in (LOCAL_AGENT, "", getattr(self, "name", None)):
                rows = _rows(given.get("xfer_list"))
                if rows is not None:
                    _judge("nixl.prep_xfer_dlist", rows)
            return original(self, *args, **kwargs)

        return prep_xfer_dlist

    def initialize(original: Callable[..., Any]) -> Any:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def initialize_xfer(self: Any, *args: Any, **kwargs: Any) -> Any:
            given = signature.bind(self, *args, **kwargs).arguments
            rows = _rows(given.get("local_descs"))
            if rows is not None:
                _judge("nixl.initialize_xfer", rows)
            if given.get("remote_agent") == getattr(self, "name", None):  # a loopback
                remote = _rows(given.get("remote_descs"))
                if remote is not None:
                    _judge("nixl.initialize_xfer (remote list)", remote)
            return original(self, *args, **kwargs)

        return initialize_xfer

    _replace(agent_class, "prep_xfer_dlist", prep)
    _replace(agent_class, "initialize_xfer", initialize)


# -- Mooncake -------------------------------------------------------------------------------------

_ONE = ("transfer_sync_write", "transfer_sync_read", "transfer_sync", "transfer_submit_write")
_BATCH = (
    "batch_transfer_sync_write",
    "batch_transfer_sync_read",
    "batch_transfer_async_write",
    "batch_transfer_async_read",
    "batch_transfer_sync",
    "batch_transfer_async",
)


def _argument(args: tuple[Any, ...], kwargs: dict[str, Any], position: int, name: str) -> Any:
    return args[position] if len(args) > position else kwargs.get(name)


def patch_mooncake(module: Any, judge_rows: Callable[[str, Any], None]) -> None:
    """Check the local buffers of every transfer of every ``TransferEngine`` of ``module``
    (``mooncake.engine``) with ``judge_rows``."""
    _judges[:] = [judge_rows]
    engine_class = getattr(module, "TransferEngine", None)
    if engine_class is None:
        return

    def one(name: str) -> Callable[[Callable[..., Any]], Any]:
        def make(original: Callable[..., Any]) -> Any:
            def transfer(self: Any, *args: Any, **kwargs: Any) -> Any:
                buffer = _argument(args, kwargs, 1, "buffer")
                length = _argument(args, kwargs, 3, "length")
                if buffer is not None and length is not None:
                    _judge(f"mooncake.{name}", [(int(buffer), int(length))])
                return original(self, *args, **kwargs)

            transfer.__name__ = transfer.__qualname__ = name
            return transfer

        return make

    def batch(name: str) -> Callable[[Callable[..., Any]], Any]:
        def make(original: Callable[..., Any]) -> Any:
            def transfer(self: Any, *args: Any, **kwargs: Any) -> Any:
                buffers = _argument(args, kwargs, 1, "buffers")
                lengths = _argument(args, kwargs, 3, "lengths")
                if buffers is not None and lengths is not None:
                    rows = [(int(b), int(n)) for b, n in zip(buffers, lengths)]
                    _judge(f"mooncake.{name}", rows)
                return original(self, *args, **kwargs)

            transfer.__name__ = transfer.__qualname__ = name
            return transfer

        return make

    for name in _ONE:
        _replace(engine_class, name, one(name))
    for name in _BATCH:
        _replace(engine_class, name, batch(name))
