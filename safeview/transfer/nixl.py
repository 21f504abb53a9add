"""A guard around a NIXL agent: the descriptors of our own memory are checked against a
registration before NIXL sees them.

NIXL refuses a descriptor that leaves every registered region, and nothing else: a descriptor on
another layer's page, across two pages or short of a page is moved, and reported done; a second
registration of the same bytes is accepted. ``guard(agent, registration)`` returns the same agent
with checked methods (vLLM and other connectors keep their reference to it):

- ``prep_xfer_dlist(agent_name, xfer_list, ...)`` for the local agent (``"NIXL_INIT_AGENT"``, or
  the agent's own name for a loopback): every row is checked once, here, at preparation;
  ``make_prepped_xfer`` then moves descriptors by index, unchecked (it only remembers which,
  to name their layers if the transfer fails). Lists prepared for a peer are the peer's
  addresses, and are left alone.
- ``initialize_xfer(operation, local_descs, remote_descs, remote_agent, ...)``: the local rows
  are checked (and a loopback's remote rows), and the rows that are written (the local ones of a
  ``READ``, the remote ones of a ``WRITE``) must not share a byte (``overlapping_writes``).
- ``register_memory(reg_list, ...)``: a region that overlaps one registered before through this
  agent is a ``duplicate_registration``; ``deregister_memory`` forgets it.
- ``get_xfer_descs`` builds lists of a peer's addresses as well as ours: it is never checked.
- Failures NIXL reports (it raises, or a transfer's state is ``"ERR"``) in ``register_memory``,
  ``initialize_xfer``, ``make_prepped_xfer``, ``transfer`` and ``check_xfer_state`` are a
  ``registration_failed`` or ``transfer_failed`` event naming the layers; the failure reaches
  the caller unchanged.

The intent: ``layers`` tells the guard which layer each row of a local list is meant for, so a
row of whole pages of another layer is a ``wrong_layer`` finding (without it such a row is
right: it is whole pages of *a* view). A layer no row covers is found by ``check_coverage``
once the connector has prepared its lists.

NIXL is never imported here: the agent is used as it is given. Methods wrapped by
instrumentation with a bare ``(*args, **kwargs)`` signature are bound by NIXL 1.5's own
signatures. An agent whose methods are not the ones this guard knows (NIXL 1.5) gets one
``integration_unavailable`` event and a Python warning (so that it is seen under default
logging), and is left alone.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from importlib import metadata
from typing import Any

from safeview import log
from safeview.errors import AddressError
from safeview.findings import Descriptor
from safeview.policy import Policy, PolicyArg, current_policy
from safeview.transfer import (
    Intent,
    MemoryMap,
    _check,
    _enforce,
    _intended,
    _Registered,
    memory_map,
)

__all__ = ["LOCAL_AGENT", "check_coverage", "guard"]

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


def _documented() -> dict[str, inspect.Signature]:
    """NIXL 1.5's own signatures of the methods the guard wraps (``nixl._api.nixl_agent``), for
    methods whose own signature says nothing (``(*args, **kwargs)`` wrappers)."""
    plain = inspect.Parameter.POSITIONAL_OR_KEYWORD

    def signature(*names: str, **defaults: Any) -> inspect.Signature:
        parameters = [inspect.Parameter(name, plain) for name in names]
        parameters += [
            inspect.Parameter(name, plain, default=value) for name, value in defaults.items()
        ]
        return inspect.Signature(parameters)

    return {
        "prep_xfer_dlist": signature("agent_name", "xfer_list", mem_type=None, backends=()),
        "initialize_xfer": signature(
            "operation", "local_descs", "remote_descs", "remote_agent", notif_msg=b"",
            backends=(),
        ),
        "register_memory": signature("reg_list", mem_type=None, backends=()),
        "deregister_memory": signature("dereg_list", backends=()),
    }  # fmt: skip


_DOCUMENTED = _documented()


def _informative(signature: inspect.Signature) -> bool:
    """Whether a signature names any parameter (a bare ``(*args, **kwargs)`` names none)."""
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return any(p.kind not in variadic for p in signature.parameters.values())


def _version() -> str | None:
    for name in ("nixl", "nixl-cu12", "nixl-cu13"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _unavailable(reason: str, *, warn: bool = False) -> None:
    """One ``integration_unavailable`` event per reason and process; with ``warn``, a Python
    warning too (attributed to the caller of ``guard``), which default logging shows."""
    if reason not in _reported:
        _reported.add(reason)
        log.integration(
            "integration_unavailable", integration="nixl", reason=reason, version=_version()
        )
        if warn:
            warnings.warn(
                f"safeview.transfer.nixl.guard left the agent unguarded: {reason}",
                RuntimeWarning,
                stacklevel=4,
            )


class _Guard:
    """What a guarded agent checks against, what it registered and what it prepared."""

    def __init__(
        self, memory: MemoryMap, policy: PolicyArg | None, whole_pages: bool, layers: Intent
    ) -> None:
        self.memory = memory
        self.policy = policy
        self.whole_pages = whole_pages
        self.layers = layers
        self.registered = _Registered("NIXL agent")
        self.signatures: dict[str, inspect.Signature] = {}
        self.prepared: list[Any] = []  # the local lists prepared, as rows
        # what each handle's transfer moves, to name its layers if it fails: a prepared list's
        # handle -> its rows; a transfer's handle -> (rows, descriptor indices or None)
        # keyed by NIXL's own handle number (its handle objects take no weak references), the
        # most recent ones only: a number NIXL reuses is written again when its handle is made
        self.lists: OrderedDict[Any, Any] = OrderedDict()
        self.transfers: OrderedDict[Any, Any] = OrderedDict()
        self.failed: OrderedDict[Any, None] = OrderedDict()


def guard(
    agent: Any,
    registration: object,
    *,
    policy: PolicyArg | None = None,
    whole_pages: bool = True,
    layers: Intent = None,
) -> Any:
    """Check the descriptors ``agent`` (a NIXL ``nixl_agent``) is given for its own memory
    against ``registration`` (what ``safeview.kv.block_views`` or
    ``safeview.vllm.check_registration`` returned, or a ``safeview.transfer.MemoryMap``), before
    NIXL uses them; returns the agent.

    Under strict a wrong row raises ``safeview.AddressError`` and NIXL never sees the list; under
    warn each finding is an ``address_violation`` event and the call goes ahead; ``off`` checks
    nothing. The policy is looked up at each call (``policy_scope`` applies) unless given here.
    ``whole_pages=False`` lets rows be slices of one page (heterogeneous tensor parallelism).

    ``layers`` is the intent, which layer each row of a local list is meant for: a list of layer
    names in the order the connector lists its regions (a list of as many rows is one row per
    layer; of ``k`` times as many, ``k`` consecutive rows per layer; of any other length, no
    intent), ``"views"`` for the layers of the registration in the order of its views, or a
    function of the number of rows that returns one name (or ``None``) per row, or ``None``. A
    row meant for one layer on another's pages is then ``wrong_layer``.

    Guarding an agent again replaces its registration. An agent this guard cannot wrap is
    returned as it is, with one ``integration_unavailable`` event and a ``RuntimeWarning``.
    """
    return _install(agent, registration, policy, whole_pages, layers, warn=True)


def _install(
    agent: Any,
    registration: object,
    policy: PolicyArg | None,
    whole_pages: bool,
    layers: Intent,
    *,
    warn: bool,
) -> Any:
    memory = memory_map(registration)
    state = getattr(agent, "__dict__", {}).get(_STATE)
    if isinstance(state, _Guard):
        state.memory, state.policy, state.whole_pages = memory, policy, whole_pages
        state.layers = layers
        return agent
    signatures = {}
    for name, parameters in _NEEDS.items():
        method = getattr(agent, name, None)
        if not callable(method):
            _unavailable(f"the agent ({type(agent).__name__}) has no method {name}", warn=warn)
            return agent
        try:
            signature = inspect.signature(method)
        except (TypeError, ValueError):
            signature = _DOCUMENTED[name]  # a builtin: NIXL's own signature
        if not _informative(signature):
            signature = _DOCUMENTED[name]  # a bare (*args, **kwargs) wrapper
        missing = [p for p in parameters if p not in signature.parameters]
        if missing:
            _unavailable(
                f"{name} of {type(agent).__name__} takes no {', '.join(missing)}", warn=warn
            )
            return agent
        signatures[name] = signature
    if not isinstance(getattr(agent, "name", None), str):
        _unavailable(f"the agent ({type(agent).__name__}) has no name", warn=warn)
        return agent
    state = _Guard(memory, policy, whole_pages, layers)
    state.signatures = signatures
    try:
        setattr(agent, _STATE, state)
        for name, make in _WRAPPERS.items():
            setattr(agent, name, make(agent, state, getattr(agent, name)))
        for name, make in _OPTIONAL.items():
            if callable(getattr(agent, name, None)):
                setattr(agent, name, make(agent, state, getattr(agent, name)))
    except (AttributeError, TypeError) as error:  # an agent whose methods cannot be replaced
        _unavailable(f"the agent's methods cannot be replaced ({error})", warn=warn)
        return agent
    return agent


def check_coverage(
    agent: Any,
    *,
    layers: Sequence[str] | None = None,
    policy: PolicyArg | None = None,
) -> list[Any]:
    """After a connector registered its caches through the guarded ``agent``: check that every
    layer of ``layers`` (every layer of the guard's registration when ``None``) lies whole in the
    local lists prepared through it since it was guarded (``prep_xfer_dlist`` for
    ``"NIXL_INIT_AGENT"``). NIXL only checks the rows it is given: a layer no row covers is never
    transferred, and every transfer is reported done.

    Returns one ``unregistered`` finding per layer left out; under strict raises
    ``safeview.CoverageError``, under warn emits a ``coverage_violation`` event per layer; off
    checks nothing. ``ArgumentError`` for an agent that ``guard`` did not guard.
    """
    from safeview.errors import ArgumentError
    from safeview.transfer.coverage import enforce, uncovered

    state = getattr(agent, "__dict__", {}).get(_STATE)
    if not isinstance(state, _Guard):
        raise ArgumentError(
            f"agent must be a NIXL agent guarded by safeview.transfer.nixl.guard; got "
            f"{type(agent).__name__} without a guard"
        )
    active = current_policy(policy if policy is not None else state.policy)
    if active is Policy.OFF:
        return []
    found = uncovered(state.prepared, state.memory, layers, set())
    enforce(found, active, "nixl.check_coverage")
    return found


# -- reading NIXL's lists --------------------------------------------------------------------------


def _rows(value: Any) -> Any:
    """The ``(address, length, device)`` or strided rows of a list NIXL takes, or ``None`` for
    a list this guard does not understand (it then goes to NIXL unchecked). Read in NIXL's own
    order (``get_xfer_descs``, ``get_reg_descs``): a descriptor list, one tensor (one row, its
    bytes, whatever its shape), an ``N x 3`` or ``N x 5`` integer array, a list of tensors, a
    list of tuples."""
    if value is None:
        return None
    if hasattr(value, "descCount") and hasattr(value, "__getitem__"):  # a NIXL descriptor list
        return [tuple(value[i])[:3] for i in range(value.descCount())]
    if hasattr(value, "data_ptr") and hasattr(value, "element_size"):  # one tensor
        return [_tensor_row(value)]
    if hasattr(value, "ndim") and hasattr(value, "shape"):  # a numpy array, strided or not
        shape = tuple(value.shape)
        return value if len(shape) == 2 and shape[1] in (3, 5) else None
    if isinstance(value, (list, tuple)):
        if not value:
            return []
        if hasattr(value[0], "data_ptr"):
            return [_tensor_row(tensor) for tensor in value]
        if all(isinstance(row, (list, tuple)) for row in value):
            return [tuple(row)[:3] if len(row) == 4 else tuple(row) for row in value]
    return None


def _tensor_row(tensor: Any) -> tuple[int, int, int]:
    device = tensor.get_device()
    return tensor.data_ptr(), tensor.numel() * tensor.element_size(), max(device, 0)


def _memory_kind(value: Any, mem_type: Any) -> str:
    """The kind of memory a registration's regions lie in (``DRAM``, ``VRAM``, ``FILE``, ...):
    host memory is one address space, the others one per device id (``_Registered``)."""
    kind = mem_type
    if kind is None and hasattr(value, "getType"):
        kind = value.getType()
    if kind is None:
        tensor = value[0] if isinstance(value, (list, tuple)) and value else value
        if hasattr(tensor, "get_device"):
            kind = "DRAM" if tensor.get_device() < 0 else "VRAM"
    text = str(getattr(kind, "name", kind)).upper()
    if text.startswith(("DRAM", "CPU")):
        return "DRAM"
    if text.startswith(("VRAM", "CUDA")):
        return "VRAM"
    return text


def _arguments(
    state: _Guard, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any] | None:
    """The call's arguments by name, or ``None`` (one event) when it does not fit the method's
    signature: the call then goes to NIXL unchecked, and NIXL says what it thinks of it."""
    try:
        bound = state.signatures[name].bind(*args, **kwargs)
    except TypeError as error:
        _unavailable(f"a call of {name} did not fit its signature ({error}); it went unchecked")
        return None
    bound.apply_defaults()
    return dict(bound.arguments)


def _guarded_call(where: str, check: Callable[[], None]) -> None:
    """Run ``check``: an ``AddressError`` (a finding, under strict) reaches the caller; any other
    failure is safeview's own, reported, and the call goes on unchecked."""
    try:
        check()
    except AddressError:
        raise
    except Exception as error:
        log.internal_error(where=where, error=error)


# -- the checked methods ---------------------------------------------------------------------------


def _prep_xfer_dlist(agent: Any, state: _Guard, original: Callable[..., Any]) -> Any:
    @functools.wraps(original)
    def prep_xfer_dlist(*args: Any, **kwargs: Any) -> Any:
        active = current_policy(state.policy)
        checked: list[
            Any
        ] = []  # the local rows, once checked (per call: handshakes run in threads)
        if active is not Policy.OFF:

            def check() -> None:
                given = _arguments(state, "prep_xfer_dlist", args, kwargs)
                if given is not None and given["agent_name"] in (LOCAL_AGENT, "", agent.name):
                    rows = _local(
                        state, given["xfer_list"], active, "nixl.prep_xfer_dlist", writes=False,
                        intent=True,
                    )  # fmt: skip
                    if rows is not None:
                        checked.append(rows)

            _guarded_call("nixl.prep_xfer_dlist", check)
        handle = original(*args, **kwargs)
        if checked:  # prepared: its rows now count for coverage, and name a failed transfer
            state.prepared.append(checked[0])
            _remember(state.lists, handle, checked[0])
        return handle

    return prep_xfer_dlist


def _initialize_xfer(agent: Any, state: _Guard, original: Callable[..., Any]) -> Any:
    @functools.wraps(original)
    def initialize_xfer(*args: Any, **kwargs: Any) -> Any:
        active = current_policy(state.policy)
        if active is not Policy.OFF:

            def check() -> None:
                given = _arguments(state, "initialize_xfer", args, kwargs)
                if given is None:
                    return
                reading = str(given["operation"]).upper() == "READ"
                source = "nixl.initialize_xfer"
                _local(state, given["local_descs"], active, source, writes=reading)
                remote = given["remote_descs"]
                if given["remote_agent"] == agent.name:  # a loopback: the remote rows are ours
                    _local(state, remote, active, source + " (remote list)", writes=not reading)
                elif not reading:
                    rows = _rows(remote)
                    if rows is not None:
                        _check(
                            rows, None, writes=True, active=active, source=source + " (remote list)"
                        )

            _guarded_call("nixl.initialize_xfer", check)
        try:
            handle = original(*args, **kwargs)
        except Exception as error:
            if active is not Policy.OFF:
                _transfer_failed(
                    state, "nixl.initialize_xfer", error, _local_rows(state, args, kwargs)
                )
            raise
        if active is not Policy.OFF:
            _remember(state.transfers, handle, _local_rows(state, args, kwargs))
        return handle

    return initialize_xfer


def _local_rows(state: _Guard, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The local rows of an ``initialize_xfer`` call, with no indices (all of them)."""
    try:
        given = _arguments(state, "initialize_xfer", args, kwargs)
        rows = None if given is None else _rows(given["local_descs"])
    except Exception:  # only a name for an event: never a failure of its own
        return None
    return None if rows is None else (rows, None)


_KEPT = 4096  # handles remembered per agent


def _key(handle: Any) -> Any:
    """What identifies a NIXL handle: its handle number (``_handle``), else the object."""
    number = getattr(handle, "_handle", None)
    return ("nixl", number) if isinstance(number, int) else ("object", id(handle))


def _remember(table: OrderedDict[Any, Any], handle: Any, value: Any) -> None:
    key = _key(handle)
    table.pop(key, None)
    table[key] = value
    while len(table) > _KEPT:
        table.popitem(last=False)


def _make_prepped_xfer(agent: Any, state: _Guard, original: Callable[..., Any]) -> Any:
    """Checks nothing (its descriptors were checked when prepared); remembers which prepared
    descriptors a transfer moves, to name their layers if it fails."""

    @functools.wraps(original)
    def make_prepped_xfer(*args: Any, **kwargs: Any) -> Any:
        try:
            handle = original(*args, **kwargs)
        except Exception as error:
            if current_policy(state.policy) is not Policy.OFF:
                _transfer_failed(
                    state, "nixl.make_prepped_xfer", error, _prepped(state, args, kwargs)
                )
            raise
        if current_policy(state.policy) is not Policy.OFF:
            _remember(state.transfers, handle, _prepped(state, args, kwargs))
        return handle

    return make_prepped_xfer


def _prepped(state: _Guard, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``(rows, indices)`` of the local side of a ``make_prepped_xfer`` call, if known."""
    try:
        bound = _PREPPED.bind(*args, **kwargs).arguments
        rows = state.lists.get(_key(bound["local_xfer_side"]))
        return None if rows is None else (rows, list(bound["local_indices"]))
    except Exception:  # only a name for an event
        return None


_PREPPED = inspect.Signature(
    [
        inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        for name in ("operation", "local_xfer_side", "local_indices", "remote_xfer_side",
                     "remote_indices")
    ]
    + [inspect.Parameter("rest", inspect.Parameter.VAR_POSITIONAL),
       inspect.Parameter("options", inspect.Parameter.VAR_KEYWORD)]
)  # fmt: skip


def _status(name: str, state: _Guard, original: Callable[..., Any]) -> Any:
    """``transfer`` and ``check_xfer_state``: a state of ``"ERR"``, or an exception, is a
    ``transfer_failed`` event (once per transfer), and reaches the caller unchanged."""

    @functools.wraps(original)
    def checked(handle: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            result = original(handle, *args, **kwargs)
        except Exception as error:
            _status_failed(state, name, handle, error)
            raise
        if result == "ERR":
            _status_failed(state, name, handle, result)
        return result

    return checked


def _status_failed(state: _Guard, name: str, handle: Any, status: object) -> None:
    if current_policy(state.policy) is Policy.OFF:
        return
    key = _key(handle)
    if key in state.failed:  # polled again: said once
        return
    _remember(state.failed, handle, None)
    _transfer_failed(state, f"nixl.{name}", status, state.transfers.get(key))


def _transfer_failed(state: _Guard, source: str, status: object, moved: Any) -> None:
    """One ``transfer_failed`` event, naming the layers of what the transfer moves."""
    from safeview.transfer.coverage import layers_of

    layers: list[str] = []
    regions: list[tuple[int, int]] = []
    try:
        if moved is not None:
            rows, indices = moved
            layers = layers_of(state.memory, rows, indices)
    except Exception as error:  # naming the layers failed: the event goes without them
        log.internal_error(where=source, error=error)
    log.engine_failed(
        "transfer_failed",
        source=source,
        engine="NIXL agent",
        status=_said(status),
        layers=layers,
        regions=regions,
        policy=current_policy(state.policy).value,
    )


def _said(status: object) -> object:
    """An engine's status as an event carries it: a code or a word as it is, an exception as its
    type and message."""
    if isinstance(status, BaseException):
        return f"{type(status).__name__}: {status}"
    return status


def _local(
    state: _Guard, value: Any, active: Policy, source: str, *, writes: bool, intent: bool = False
) -> Any:
    """Check a local list; returns its rows (``None`` for a list this guard cannot read)."""
    rows = _rows(value)
    if rows is None:
        log.internal_error(
            where=source,
            error=TypeError(f"a descriptor list of type {type(value).__name__} is not checked"),
        )
        return None
    layers = _intended(state.layers, state.memory, len(rows)) if intent else None
    _check(
        rows,
        state.memory,
        layers=layers,
        whole_pages=state.whole_pages,
        writes=writes,
        active=active,
        source=source,
    )
    return rows


def _register_memory(agent: Any, state: _Guard, original: Callable[..., Any]) -> Any:
    @functools.wraps(original)
    def register_memory(*args: Any, **kwargs: Any) -> Any:
        regions: list[tuple[str, Descriptor]] = []

        def check() -> None:
            given = _arguments(state, "register_memory", args, kwargs)
            if given is None:
                return
            value = given["reg_list"]
            rows = _rows(value)
            kind = _memory_kind(value, given.get("mem_type"))
            regions.extend((kind, _region(index, row)) for index, row in enumerate(rows or ()))
            active = current_policy(state.policy)
            if active is not Policy.OFF:
                found = state.registered.overlapping(regions)
                _enforce(found, active, "nixl.register_memory")

        _guarded_call("nixl.register_memory", check)
        try:
            result = original(*args, **kwargs)
        except Exception as error:
            _registration_failed(state, error, [region for _, region in regions])
            raise
        state.registered.add(regions)
        return result

    return register_memory


def _registration_failed(state: _Guard, error: BaseException, regions: list[Descriptor]) -> None:
    """One ``registration_failed`` event, naming the layers of the regions."""
    from safeview.transfer.coverage import layers_in

    active = current_policy(state.policy)
    if active is Policy.OFF:
        return
    spans = [(region.address, region.length_bytes) for region in regions]
    try:
        layers = layers_in(state.memory, spans)
    except Exception as failure:
        log.internal_error(where="nixl.register_memory", error=failure)
        layers = []
    log.engine_failed(
        "registration_failed",
        source="nixl.register_memory",
        engine="NIXL agent",
        status=_said(error),
        layers=layers,
        regions=spans,
        policy=active.value,
    )


def _deregister_memory(agent: Any, state: _Guard, original: Callable[..., Any]) -> Any:
    @functools.wraps(original)
    def deregister_memory(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)

        def forget() -> None:
            given = _arguments(state, "deregister_memory", args, kwargs)
            if given is None:
                return
            value = given["dereg_list"]
            kind = _memory_kind(value, None)
            for index, row in enumerate(_rows(value) or ()):
                state.registered.remove(kind, _region(index, row))

        _guarded_call("nixl.deregister_memory", forget)
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
# wrapped where the agent has them: what reports a transfer's outcome
_OPTIONAL: dict[str, Callable[[Any, _Guard, Callable[..., Any]], Any]] = {
    "make_prepped_xfer": _make_prepped_xfer,
    "transfer": lambda agent, state, original: _status("transfer", state, original),
    "check_xfer_state": lambda agent, state, original: _status("check_xfer_state", state, original),
}
