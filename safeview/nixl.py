"""A guard around a NIXL agent: the descriptors of our own memory are checked against a
registration before NIXL sees them.

NIXL refuses a descriptor that leaves every registered region, and nothing else: a descriptor on
another layer's page, across two pages or short of a page is moved, and reported done; a second
registration of the same bytes is accepted. ``guard(agent, registration)`` returns the same agent
with checked methods (vLLM and other connectors keep their reference to it):

- ``prep_xfer_dlist(agent_name, xfer_list, ...)`` for the local agent (``"NIXL_INIT_AGENT"``, or
  the agent's own name for a loopback): every row is checked once, here, at preparation;
  ``make_prepped_xfer`` then moves descriptors by index at no extra cost. Lists prepared for a
  peer are the peer's addresses, and are left alone.
- ``initialize_xfer(operation, local_descs, remote_descs, remote_agent, ...)``: the local rows
  are checked (and a loopback's remote rows), and the rows that are written (the local ones of a
  ``READ``, the remote ones of a ``WRITE``) must not share a byte (``overlapping_writes``).
- ``register_memory(reg_list, ...)``: a region that overlaps one registered before through this
  agent is a ``duplicate_registration``; ``deregister_memory`` forgets it.
- ``get_xfer_descs`` builds lists of a peer's addresses as well as ours: it is never checked.

NIXL is never imported here: the agent is used as it is given. An agent whose methods are not
the ones this guard knows (NIXL 1.5) gets one ``integration_unavailable`` event and is left
alone.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from importlib import metadata
from typing import Any

from safeview import log
from safeview.findings import Descriptor
from safeview.policy import Policy, PolicyArg, current_policy
from safeview.transfer import MemoryMap, _check, _enforce, _Registered, memory_map

__all__ = ["LOCAL_AGENT", "guard"]

LOCAL_AGENT = "NIXL_INIT_AGENT"
"""The name NIXL's ``prep_xfer_dlist`` takes for a list of the local agent's own memory."""

_STATE = "_safeview_guard"
_NEEDS = {
    "prep_xfer_dlist": ("agent_name", "xfer_list"),
    "initialize_xfer": ("operation", "local_descs", "remote_descs", "remote_agent"),
    "register_memory": ("reg_list",),
    "deregister_memory": ("dereg_list",),
}
_reported: set[str] = set()


def _version() -> str | None:
    for name in ("nixl", "nixl-cu12", "nixl-cu13"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _unavailable(reason: str) -> None:
    """One ``integration_unavailable`` event per reason and process."""
    if reason not in _reported:
        _reported.add(reason)
        log.integration(
            "integration_unavailable", integration="nixl", reason=reason, version=_version()
        )


class _Guard:
    """What a guarded agent checks against, and what it registered."""

    def __init__(self, memory: MemoryMap, policy: PolicyArg | None, whole_pages: bool) -> None:
        self.memory = memory
        self.policy = policy
        self.whole_pages = whole_pages
        self.registered = _Registered("NIXL agent")
        self.signatures: dict[str, inspect.Signature] = {}


def guard(
    agent: Any,
    registration: object,
    *,
    policy: PolicyArg | None = None,
    whole_pages: bool = True,
) -> Any:
    """Check the descriptors ``agent`` (a NIXL ``nixl_agent``) is given for its own memory
    against ``registration`` (what ``safeview.kv.block_views`` or
    ``safeview.vllm.check_registration`` returned, or a ``safeview.transfer.MemoryMap``), before
    NIXL uses them; returns the agent.

    Under strict a wrong row raises ``safeview.AddressError`` and NIXL never sees the list; under
    warn each finding is an ``address_violation`` event and the call goes ahead; ``off`` checks
    nothing. The policy is looked up at each call (``policy_scope`` applies) unless given here.
    ``whole_pages=False`` lets rows be slices of one page (heterogeneous tensor parallelism).
    Guarding an agent again replaces its registration.
    """
    memory = memory_map(registration)
    state = getattr(agent, "__dict__", {}).get(_STATE)
    if isinstance(state, _Guard):
        state.memory, state.policy, state.whole_pages = memory, policy, whole_pages
        return agent
    signatures = {}
    for name, parameters in _NEEDS.items():
        method = getattr(agent, name, None)
        try:
            signature = inspect.signature(method)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            _unavailable(f"the agent ({type(agent).__name__}) has no method {name}")
            return agent
        missing = [p for p in parameters if p not in signature.parameters]
        if missing:
            _unavailable(f"{name} of {type(agent).__name__} takes no {', '.join(missing)}")
            return agent
        signatures[name] = signature
    if not isinstance(getattr(agent, "name", None), str):
        _unavailable(f"the agent ({type(agent).__name__}) has no name")
        return agent
    state = _Guard(memory, policy, whole_pages)
    state.signatures = signatures
    try:
        setattr(agent, _STATE, state)
        for name, make in _WRAPPERS.items():
            setattr(agent, name, make(agent, state, getattr(agent, name)))
    except (AttributeError, TypeError) as error:  # an agent whose methods cannot be replaced
        _unavailable(f"the agent's methods cannot be replaced ({error})")
        return agent
    return agent


# -- reading NIXL's lists --------------------------------------------------------------------------


def _rows(value: Any) -> Any:
    """The ``(address, length, device)`` or strided rows of a list NIXL takes, or ``None`` for
    a list this guard does not understand (it then goes to NIXL unchecked)."""
    if value is None:
        return None
    if hasattr(value, "ndim") and hasattr(value, "shape"):  # a numpy array, strided or not
        return value if getattr(value, "ndim", 0) == 2 else None
    if hasattr(value, "descCount") and hasattr(value, "__getitem__"):  # a NIXL descriptor list
        return [tuple(value[i])[:3] for i in range(value.descCount())]
    if hasattr(value, "data_ptr"):  # one tensor
        return [_tensor_row(value)]
    if isinstance(value, (list, tuple)):
        if not value:
            return []
        if hasattr(value[0], "data_ptr"):
            return [_tensor_row(tensor) for tensor in value]
        return [tuple(row)[:3] if len(row) == 4 else tuple(row) for row in value]
    return None


def _tensor_row(tensor: Any) -> tuple[int, int, int]:
    device = tensor.get_device()
    return tensor.data_ptr(), tensor.numel() * tensor.element_size(), max(device, 0)


def _memory_key(value: Any, mem_type: Any, rows: Sequence[Any]) -> tuple[str, int | None]:
    """Which memory a registration's regions lie in: host memory is one address space, device
    memory (and files, objects) one per device id."""
    kind = mem_type
    if kind is None and hasattr(value, "getType"):
        kind = value.getType()
    if kind is None:
        tensor = value[0] if isinstance(value, (list, tuple)) and value else value
        if hasattr(tensor, "get_device"):
            kind = "DRAM" if tensor.get_device() < 0 else "VRAM"
    text = str(getattr(kind, "name", kind)).upper()
    if text.startswith(("DRAM", "CPU")):
        return "DRAM", None
    if text.startswith(("VRAM", "CUDA")):
        text = "VRAM"
    devices = {int(row[2]) for row in rows} if rows and len(rows[0]) > 2 else {0}
    return text, devices.pop() if len(devices) == 1 else None


def _arguments(state: _Guard, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    bound = state.signatures[name].bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


# -- the checked methods ---------------------------------------------------------------------------


def _prep_xfer_dlist(agent: Any, state: _Guard, original: Callable[..., Any]) -> Any:
    @functools.wraps(original)
    def prep_xfer_dlist(*args: Any, **kwargs: Any) -> Any:
        active = current_policy(state.policy)
        if active is not Policy.OFF:
            given = _arguments(state, "prep_xfer_dlist", args, kwargs)
            if given["agent_name"] in (LOCAL_AGENT, "", agent.name):
                _local(state, given["xfer_list"], active, "nixl.prep_xfer_dlist", writes=False)
        return original(*args, **kwargs)

    return prep_xfer_dlist


def _initialize_xfer(agent: Any, state: _Guard, original: Callable[..., Any]) -> Any:
    @functools.wraps(original)
    def initialize_xfer(*args: Any, **kwargs: Any) -> Any:
        active = current_policy(state.policy)
        if active is not Policy.OFF:
            given = _arguments(state, "initialize_xfer", args, kwargs)
            reading = str(given["operation"]).upper() == "READ"
            source = "nixl.initialize_xfer"
            _local(state, given["local_descs"], active, source, writes=reading)
            remote = given["remote_descs"]
            if given["remote_agent"] == agent.name:  # a loopback: the remote rows are ours too
                _local(state, remote, active, source + " (remote list)", writes=not reading)
            elif not reading:
                rows = _rows(remote)
                if rows is not None:
                    _check(rows, None, writes=True, active=active, source=source + " (remote list)")
        return original(*args, **kwargs)

    return initialize_xfer


def _local(state: _Guard, value: Any, active: Policy, source: str, *, writes: bool) -> None:
    rows = _rows(value)
    if rows is None:
        log.internal_error(
            where=source,
            error=TypeError(f"a descriptor list of type {type(value).__name__} is not checked"),
        )
        return
    _check(
        rows,
        state.memory,
        whole_pages=state.whole_pages,
        writes=writes,
        active=active,
        source=source,
    )


def _register_memory(agent: Any, state: _Guard, original: Callable[..., Any]) -> Any:
    @functools.wraps(original)
    def register_memory(*args: Any, **kwargs: Any) -> Any:
        given = _arguments(state, "register_memory", args, kwargs)
        value = given["reg_list"]
        rows = _rows(value) or []
        key = _memory_key(value, given.get("mem_type"), rows)
        regions = [_region(index, row) for index, row in enumerate(rows)]
        active = current_policy(state.policy)
        if active is not Policy.OFF:
            found = state.registered.overlapping(key, regions)
            _enforce(found, active, "nixl.register_memory")
        result = original(*args, **kwargs)
        state.registered.add(key, regions)
        return result

    return register_memory


def _deregister_memory(agent: Any, state: _Guard, original: Callable[..., Any]) -> Any:
    @functools.wraps(original)
    def deregister_memory(*args: Any, **kwargs: Any) -> Any:
        given = _arguments(state, "deregister_memory", args, kwargs)
        value = given["dereg_list"]
        result = original(*args, **kwargs)
        rows = _rows(value) or []
        key = _memory_key(value, None, rows)
        for row in rows:
            state.registered.remove(key, int(row[0]), int(row[1]))
        return result

    return deregister_memory


def _region(index: int, row: Sequence[Any]) -> Descriptor:
    device = int(row[2]) if len(row) > 2 else None
    return Descriptor(index, int(row[0]), int(row[1]), device)


_WRAPPERS: dict[str, Callable[[Any, _Guard, Callable[..., Any]], Any]] = {
    "prep_xfer_dlist": _prep_xfer_dlist,
    "initialize_xfer": _initialize_xfer,
    "register_memory": _register_memory,
    "deregister_memory": _deregister_memory,
}
