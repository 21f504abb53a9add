"""``sanitize()``: check every view that code we do not own makes, before it is made.

Inside ``with safeview.sanitize() as seen:`` a dispatch mode (``ViewGuard`` of
``safeview.guard._torch_dispatch``, the same idea as torch's CUDA stream sanitizer) sees every aten
op. What an op does to memory is read from its schema (``_torch_dispatch`` says how): an op that
places a tensor on a storage (``set_``, ``set``, ``as_strided``, ``as_strided_``) is judged before
it runs; an op that would grow a storage other tensors use (``resize_``, ``resize_as_``, an ``out=``
tensor of the wrong size, whatever the op) is judged before it runs, on meta copies of its
arguments; a view op (``view``, ``_reshape_alias``, ``slice``, ...) is judged on the view it
returns, before the caller gets it. ``strict`` raises ``BoundsError`` (the storage is never
reallocated and no view past its end reaches the caller); ``warn`` emits ``bounds_violation`` and
lets the op run; ``off`` installs nothing. Every other op, and every correct view, runs as it would
without it.

Sanitizers belong to the context that opened them: a thread, and within a thread an asyncio task
(``contextvars``). One guard is installed per thread while any sanitizer is open in it; an op is
judged by the innermost sanitizer open in the context that issued it, and recorded by every one.

Given the layers' cache tensors (``layers=``, with ``groups=``), the views made from them (through
``as_strided``, ``set_`` from a tensor, or any view op in between) are attributed to their layer,
and views of two layers of one group that share a byte are an ``overlap`` finding under the
policy, as ``check_registration`` judges the allocation. Views whose layer cannot be known (a
``set_`` from a bare storage) are recorded, and ``seen.report()`` judges them all together.
"""

from __future__ import annotations

import functools
import inspect
import os
import threading
import weakref
from collections.abc import Callable, Generator, Hashable, Mapping, Sequence
from contextvars import ContextVar, Token
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from safeview import _arith, log
from safeview.check import Report, StorageRecord, ViewRecord, bounds, check_views, pieces
from safeview.errors import ArgumentError, BoundsError, OverlapError, UnprovenWriteError
from safeview.findings import Finding
from safeview.guard._piece_index import PieceIndex
from safeview.plan import Plan
from safeview.policy import Policy, PolicyArg, current_policy

if TYPE_CHECKING:
    from types import TracebackType

    from safeview.guard._torch_dispatch import Op, ViewGuard

__all__ = ["Sanitizer", "SeenView", "sanitize"]

F = TypeVar("F", bound=Callable[..., Any])


class SeenView(NamedTuple):
    """One view made under a sanitizer: the ``op`` that made it, its ``storage`` (named
    ``storage0``, ``storage1``, ... in order of first sight) on ``device`` with
    ``storage_nbytes`` bytes, its first byte, ``shape`` and ``strides`` in elements of
    ``itemsize`` bytes of type ``dtype``, its exclusive end ``extent_bytes``, the call site
    (``file``, ``line``, ``function``: the first frame outside torch and safeview), and the
    ``layer`` it was made from, when the sanitizer was told the layers and could tell."""

    op: str
    storage: str
    device: str
    storage_nbytes: int
    byte_offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    itemsize: int
    dtype: str
    extent_bytes: int
    file: str
    line: int
    function: str
    layer: str | None = None

    @property
    def site(self) -> str:
        """``dir/file.py:line in function``, the last two parts of the path."""
        return _site_text(self.file, self.line, self.function)


def _site_text(file: str, line: int, function: str) -> str:
    parts = Path(file).parts[-2:]
    return f"{os.path.join(*parts)}:{line} in {function}"


# The sanitizers open in the current context, innermost last.
_open: ContextVar[tuple[Sanitizer, ...]] = ContextVar("safeview_sanitizers", default=())


class _ThreadGuard:
    """The one guard of a thread, installed while sanitizers are open in it."""

    __slots__ = ("guard", "users")

    def __init__(self) -> None:
        self.guard: ViewGuard | None = None
        self.users = 0


_threads = threading.local()


def _this_thread() -> _ThreadGuard:
    state: _ThreadGuard | None = getattr(_threads, "state", None)
    if state is None:
        state = _threads.state = _ThreadGuard()
    return state


def _current() -> tuple[Sanitizer, ...]:
    """The sanitizers open in this context, innermost last; one closed elsewhere (from another
    thread or context, whose variable it could not reset) no longer counts."""
    sanitizers = _open.get()
    for sanitizer in sanitizers:
        if not sanitizer._entries:
            return tuple(open_ for open_ in sanitizers if open_._entries)
    return sanitizers


def _active() -> bool:
    return bool(_current())


def _tracks() -> bool:
    return any(sanitizer._layer_of is not None for sanitizer in _current())


def _on_view(op: Op) -> None:
    sanitizers = _current()
    if sanitizers:
        sanitizers[-1]._on_view(op, sanitizers)


def _on_alias(source: Any, result: Any) -> None:
    for sanitizer in _current():
        sanitizer._on_alias(source, result)


def _on_error(error: BaseException) -> None:
    log.internal_error(where="sanitize", error=error)


def _install() -> _ThreadGuard:
    state = _this_thread()
    if state.guard is None:
        from safeview.guard import (
            _torch_dispatch,  # torch is needed only once a sanitizer is entered
        )

        guard = _torch_dispatch.ViewGuard(_active, _on_view, _on_error, _on_alias, _tracks)
        guard.__enter__()  # type: ignore[no-untyped-call,unused-ignore]
        state.guard = guard
    state.users += 1
    return state


def _uninstall(state: _ThreadGuard) -> None:
    state.users -= 1
    if state.users > 0 or state is not _this_thread() or state.guard is None:
        # still in use, or closed from another thread than the one it guards: a mode can be
        # popped only in its own thread, so it stays there, idle, for that thread's next use
        return
    from safeview.guard import _torch_dispatch

    # Only the top of the mode stack can be popped: if other code pushed a mode of its own
    # above ours and has not popped it yet, ours stays, idle (it judges nothing outside a
    # sanitizer), and is used again by the next sanitizer of this thread.
    if _torch_dispatch.is_current(state.guard):
        guard, state.guard = state.guard, None
        guard.__exit__(None, None, None)  # type: ignore[no-untyped-call,unused-ignore]


class Sanitizer:
    """The record of a ``sanitize()`` block: ``views`` lists every view made inside it (also the
    refused one, last), ``findings`` what it found, ``policy`` the policy it applied. Use
    ``sanitize()`` to make one. A sanitizer may be entered again while open (the inner block
    adds to the same record) and used as a decorator."""

    def __init__(
        self,
        policy: PolicyArg | None = None,
        *,
        layers: Mapping[str, Any] | None = None,
        groups: Mapping[str, Hashable] | None = None,
    ) -> None:
        self._policy_arg = policy
        self._layers_arg = layers
        self._groups_arg = groups
        self.policy: Policy = Policy.STRICT
        self.views: list[SeenView] = []
        self.findings: list[Finding] = []
        self._storages: dict[int, str] = {}
        self._memories: dict[str, StorageRecord] = {}
        self._entries: list[tuple[Token[tuple[Sanitizer, ...]] | None, _ThreadGuard | None]] = []
        self._layer_of: _LayerOf | None = None
        self._groups: Mapping[str, Hashable] = groups or {}
        self._attributed: _Attributed = {}
        self._owners: dict[int, str | None] = {}
        self._spans: dict[int, list[tuple[int, int, str]]] = {}

    # -- as a context manager and a decorator -------------------------------------------------

    def __enter__(self) -> Sanitizer:
        if not self._entries:
            self.policy = current_policy(self._policy_arg)
            if self._layers_arg is not None and self.policy is not Policy.OFF:
                known = _known_layers(self._layers_arg, self._groups)
                self._layer_of, self._owners, self._attributed, self._spans = known
        if self.policy is Policy.OFF:
            self._entries.append((None, None))
            return self
        state = _install()
        token = _open.set((*_open.get(), self))
        self._entries.append((token, state))
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if not self._entries:
            return
        token, state = self._entries.pop()
        if token is not None:
            try:
                _open.reset(token)
            except ValueError:  # closed in another context, or out of order: drop this entry
                current = list(_open.get())
                for index in range(len(current) - 1, -1, -1):
                    if current[index] is self:
                        del current[index]
                        break
                _open.set(tuple(current))
        if state is not None:
            _uninstall(state)

    def __call__(self, function: F) -> F:
        """Run ``function`` under a fresh sanitizer of the same policy and layers at each call.
        A generator function is sanitized while it runs, not while it is suspended; a coroutine
        function (``async def``) for the whole of its run, in its own task's context."""
        return _decorate(function, self._fresh)

    def _fresh(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Sanitizer:
        return Sanitizer(self._policy_arg, layers=self._layers_arg, groups=self._groups_arg)

    # -- what the guard hands over ------------------------------------------------------------

    def _on_view(self, op: Op, sanitizers: Sequence[Sanitizer]) -> None:
        if op.unproven is not None:
            self._on_unproven(op)
            return
        try:
            seen, found = self._judge(op)
        except Exception as error:  # a failure of ours never stops the host's op
            _on_error(error)
            return
        for other in dict.fromkeys(sanitizers):
            if other is not self:
                other._record(seen)
        if not found:
            return
        strict = self.policy is Policy.STRICT
        self.findings.extend(found)
        bounds_found = [finding for finding in found if finding.kind == "out_of_bounds"]
        overlaps = [finding for finding in found if finding.kind == "overlap"]
        if bounds_found:
            geometry = _geometry(seen)
            where = {"op": seen.op, "file": seen.file, "line": seen.line, "function": seen.function}
            for finding in bounds_found:
                log.bounds_violation(
                    finding,
                    strict=strict,
                    policy=self.policy.value,
                    device=seen.device,
                    storage_nbytes=seen.storage_nbytes,
                    geometry=geometry,
                    site=where,
                )
        for finding in overlaps:
            log.overlap_violation(finding, strict=strict, policy=self.policy.value)
        if not strict:
            return
        if bounds_found:
            raise BoundsError(
                bounds_found[0],
                storage_nbytes=seen.storage_nbytes,
                device=seen.device,
                policy=self.policy.value,
                op=seen.op,
                site=seen.site,
            )
        raise OverlapError(overlaps, policy=self.policy.value)

    def _on_unproven(self, op: Op) -> None:
        """An op that writes into a shared storage and whose effect on it could not be worked
        out: an ``unproven_write`` event, and under strict ``UnprovenWriteError`` before it
        runs."""
        strict = self.policy is Policy.STRICT
        facts = op.storage
        file, line, function = op.site
        error = UnprovenWriteError(
            op=op.op,
            storage_nbytes=facts.nbytes,
            device=facts.device,
            policy=self.policy.value,
            reason=op.unproven or "",
            site=_site_text(file, line, function),
            name=self._owners.get(facts.key),
        )
        log.unproven_write(
            strict=strict,
            policy=self.policy.value,
            op=op.op,
            name=error.name,
            device=facts.device,
            storage_nbytes=facts.nbytes,
            reason=error.reason,
            site={"file": file, "line": line, "function": function},
            message=str(error),
        )
        if strict:
            raise error

    def _on_alias(self, source: Any, result: Any) -> None:
        layer_of = self._layer_of
        if layer_of is None or source is None:
            return
        layer = layer_of.get(source)
        if layer is None:
            return
        for tensor in result if isinstance(result, (list, tuple)) else (result,):
            if tensor is not source:
                layer_of[tensor] = layer

    def _storage_name(self, op: Op) -> str:
        facts = op.storage
        name = self._storages.get(facts.key)
        if name is None:
            name = self._storages[facts.key] = f"storage{len(self._storages)}"
            self._memories[name] = StorageRecord(facts.nbytes, facts.memory, facts.base)
        return name

    def _record(self, seen: SeenView) -> None:
        self.views.append(seen)

    def _judge(self, op: Op) -> tuple[SeenView, list[Finding]]:
        facts = op.storage
        name = self._storage_name(op)
        negative = op.byte_offset < 0 or min(op.shape + op.strides, default=0) < 0
        extent = (
            op.byte_offset
            if negative
            else _arith.extent_bytes(op.byte_offset, op.shape, op.strides, op.itemsize)
        )
        layer = None
        if self._layer_of is not None:
            if op.source is not None:
                layer = self._layer_of.get(op.source)
            if layer is None:
                # made from a bare storage, or from a tensor it was not told of: the layer
                # whose cache the storage is, when exactly one known layer's is
                layer = self._owners.get(facts.key)
        file, line, function = op.site
        seen = SeenView(
            op.op,
            name,
            facts.device,
            facts.nbytes,
            op.byte_offset,
            op.shape,
            op.strides,
            op.itemsize,
            op.dtype,
            extent,
            file,
            line,
            function,
            layer,
        )
        self.views.append(seen)
        if negative:  # torch refuses these itself (negative offsets, sizes and strides)
            return seen, []
        if extent == op.byte_offset and not op.explicit:
            # An empty tensor torch derives itself (chunk of an empty tensor, its copies in
            # deepcopy, torch.load, autograd) may start past the end; only a placement the
            # caller asks for is held to the empty-view rule.
            return seen, []
        found = bounds(
            layer,
            storage=None,
            byte_offset=op.byte_offset,
            extent_bytes=extent,
            storage_nbytes=facts.nbytes,
        )
        if found and layer is None and self._spans:
            named = self._starts_in(facts.key, op.byte_offset)
            if named is not None:
                found = bounds(
                    named,
                    storage=None,
                    byte_offset=op.byte_offset,
                    extent_bytes=extent,
                    storage_nbytes=facts.nbytes,
                )
        if not found and layer is not None and extent > op.byte_offset:
            found = self._aliasing(seen, layer, len(self.views) - 1)
        return seen, found

    def _starts_in(self, storage_key: int, byte_offset: int) -> str | None:
        """The one known layer whose cache holds byte ``byte_offset`` of the storage: the name
        a view placed there from the bare storage is reported under."""
        names = {
            layer
            for start, end, layer in self._spans.get(storage_key, ())
            if start <= byte_offset < end
        }
        return names.pop() if len(names) == 1 else None

    def _aliasing(self, seen: SeenView, layer: str, index: int) -> list[Finding]:
        """An ``overlap`` finding when this view, made from ``layer``'s cache, shares a byte with
        a view made earlier from another layer of the same group."""
        group = self._groups.get(layer)
        if group is None:
            return []
        record = ViewRecord(
            _label(index, seen), seen.storage, seen.byte_offset, seen.shape, seen.strides,
            seen.itemsize,
        )  # fmt: skip
        if _arith.self_overlap(record.shape, record.strides) is not None:
            return []  # a view that touches its own bytes twice is not a block layout to judge
        memory = self._memories[seen.storage]
        try:
            mine = [part._replace(offset=part.offset + memory.base) for part in pieces(record)]
        except ArgumentError:
            return []
        key = memory.memory if memory.memory is not None else ("storage", seen.storage)
        earlier = self._attributed.get((key, group))
        if earlier is None:
            earlier = self._attributed[(key, group)] = PieceIndex()
        # the first view or cache tensor of another layer, in the order they came, that shares
        # a byte with this one: the index tries only those that can
        shared = earlier.first_overlap(layer, mine)
        earlier.add(layer, record.name, mine)
        if shared is None:
            return []
        other_name, byte = shared
        return [
            Finding.overlap(
                other_name, record.name, storage=seen.storage, byte=byte - memory.base, group=group
            )
        ]

    # -- afterwards ---------------------------------------------------------------------------

    def _records(self) -> list[ViewRecord]:
        return [
            ViewRecord(
                _label(index, seen),
                seen.storage,
                seen.byte_offset,
                seen.shape,
                seen.strides,
                seen.itemsize,
                dtype=seen.dtype,
            )
            for index, seen in enumerate(self.views)
        ]

    def report(self) -> Report:
        """Every view seen, judged together by the checker: bounds, each against itself, and
        every pair over one memory (no groups are known here, so any shared byte is reported,
        also between views the code meant to share: read it as a map, not a verdict)."""
        return check_views(self._memories, self._records())

    def to_plan(self, path: str | Path | None = None, *, description: str | None = None) -> Plan:
        """The block-shaped views seen (int8, ``(num_blocks, page_bytes)`` with strides
        ``(block_stride_bytes, 1)``, at least one byte a page) as a plan for
        ``safeview check --map``, written to ``path`` if given. Other views (typed, empty, a
        stride of 0) are left out, and the description says how many."""
        records = [
            record
            for record in self._records()
            if record.is_block
            and record.dtype == "int8"
            and record.shape[1] >= 1
            and (record.strides[0] >= 1 or record.shape[0] <= 1)
        ]
        records = [
            record._replace(strides=(max(record.strides[0], 1), 1), dtype=None)
            for record in records
        ]
        left_out = len(self.views) - len(records)
        text = description or "views seen by safeview.sanitize()"
        if left_out:
            noun = (
                "view that is not an int8 block view"
                if left_out == 1
                else ("views that are not int8 block views")
            )
            text += f" ({left_out} {noun} left out)"
        devices = {seen.storage: seen.device for seen in self.views}
        sizes = {name: record.nbytes for name, record in self._memories.items()}
        plan = Plan.from_views(sizes, records, devices=devices, description=text)
        if path is not None:
            plan.dump(path)
        return plan


def _label(index: int, seen: SeenView) -> str:
    layer = f"{seen.layer}: " if seen.layer is not None else ""
    return f"{layer}view{index} ({seen.op} at {seen.site})"


class _LayerOf:
    """Tensor -> the layer it was made from, by identity (a tensor's ``==`` compares values),
    holding no tensor alive."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref[Any], str]] = {}

    def __setitem__(self, tensor: Any, layer: str) -> None:
        key = id(tensor)
        entries = self._entries

        def forget(_: object) -> None:
            entries.pop(key, None)

        entries[key] = (weakref.ref(tensor, forget), layer)

    def get(self, tensor: Any) -> str | None:
        entry = self._entries.get(id(tensor))
        if entry is None or entry[0]() is not tensor:
            return None
        return entry[1]


_Attributed = dict[Hashable, PieceIndex]


class _KnownLayers(NamedTuple):
    layer_of: _LayerOf  # each cache tensor's layer, by identity
    owners: dict[int, str | None]  # storage key -> the one layer whose cache it is, else None
    attributed: _Attributed  # (memory, group) -> each layer's own bytes, as pieces, indexed
    spans: dict[int, list[tuple[int, int, str]]]  # storage key -> (first, end byte, layer)


def _known_layers(layers: Mapping[str, Any], groups: Mapping[str, Hashable]) -> _KnownLayers:
    """What a sanitizer told the layers knows of them: each cache tensor's layer (by identity),
    the layer whose cache each storage is (``None`` where several layers' are), the byte range
    of each tensor, and, per memory and group, the bytes each layer's own tensors cover, so that
    a view of another layer is judged against them from the first view on.

    A layer's tensors are attributed to the layer that owns those bytes by group membership: a
    layer in no group whose tensor is one of a grouped layer's (the same object, or the same
    storage, offset, shape, strides and dtype: vLLM's cross-layer KV sharing hands a layer its
    target's cache) is that layer's alias, and neither takes its name nor hides its bytes."""
    if not isinstance(layers, Mapping):
        raise ArgumentError(
            "layers must map each layer's name to its cache tensor (or a list of tensors); "
            f"got {type(layers).__name__}"
        )
    from safeview import _torch

    found = _LayerOf()
    owner_of_bytes: dict[tuple[Any, ...], str] = {}
    storage_layers: dict[int, set[str]] = {}
    attributed: _Attributed = {}
    spans: dict[int, list[tuple[int, int, str]]] = {}
    # grouped layers first: they own the bytes they share with a layer in no group
    ordered = sorted(layers.items(), key=lambda item: item[0] not in groups)
    for name, value in ordered:
        layer = str(name)
        group = groups.get(layer)
        for tensor in value if isinstance(value, (list, tuple)) else (value,):
            if not _torch.is_strided_tensor(tensor):
                raise ArgumentError(
                    f"layers[{name!r}] must be a tensor or a list of tensors; "
                    f"got {type(tensor).__name__}"
                )
            storage = tensor.untyped_storage()
            facts = _torch.storage_facts(storage)
            byte_offset, shape, strides, itemsize = _torch.geometry(tensor)
            key = (facts.key, byte_offset, shape, strides, tensor.dtype)
            owner = owner_of_bytes.setdefault(key, layer)
            if group is not None:
                owner = layer  # two grouped layers on one tensor: each keeps its name
            if found.get(tensor) is None:
                found[tensor] = owner
            storage_layers.setdefault(facts.key, set()).add(owner)
            end = _arith.extent_bytes(byte_offset, shape, strides, itemsize)
            spans.setdefault(facts.key, []).append((byte_offset, end, owner))
            if group is None:
                continue
            record = ViewRecord(
                f"{layer}: its cache tensor", "", byte_offset, shape, strides, itemsize
            )
            if _arith.self_overlap(shape, strides) is not None:
                continue  # not a layout whose bytes can be told apart: judged by check_tensors
            try:
                mine = [part._replace(offset=part.offset + facts.base) for part in pieces(record)]
            except ArgumentError:
                continue
            index = attributed.get((facts.memory, group))
            if index is None:
                index = attributed[(facts.memory, group)] = PieceIndex()
            index.add(layer, record.name, mine)
    owners = {
        key: next(iter(names)) if len(names) == 1 else None for key, names in storage_layers.items()
    }
    return _KnownLayers(found, owners, attributed, spans)


def _geometry(seen: SeenView) -> dict[str, Any]:
    if seen.dtype == "int8" and len(seen.shape) == 2 and seen.strides[1:] == (1,):
        return log.block_geometry(seen.byte_offset, seen.shape[0], seen.shape[1], seen.strides[0])
    return log.strided_geometry(seen.byte_offset, seen.dtype, seen.shape, seen.strides)


def _decorate(function: F, make: Callable[[tuple[Any, ...], dict[str, Any]], Any]) -> F:
    """``function`` run under a fresh context manager from ``make(args, kwargs)`` at each call:
    for the whole call of a plain or ``async def`` function, for each step of a generator."""
    if inspect.isasyncgenfunction(function):
        raise ArgumentError(
            f"{getattr(function, '__qualname__', function)!r} is an async generator function, "
            "which safeview cannot follow across its suspensions; use `with sanitize():` "
            "inside it, around the code that makes views"
        )
    if inspect.iscoroutinefunction(function):

        @functools.wraps(function)
        async def run_coroutine(*args: Any, **kwargs: Any) -> Any:
            with make(args, kwargs):
                return await function(*args, **kwargs)

        return run_coroutine  # type: ignore[return-value]
    if inspect.isgeneratorfunction(function):

        @functools.wraps(function)
        def run_generator(*args: Any, **kwargs: Any) -> Generator[Any, Any, Any]:
            manager = make(args, kwargs)
            return (yield from _stepwise(function(*args, **kwargs), manager))

        return run_generator  # type: ignore[return-value]

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        with make(args, kwargs):
            return function(*args, **kwargs)

    return run  # type: ignore[return-value]


def _stepwise(generator: Generator[Any, Any, Any], manager: Any) -> Generator[Any, Any, Any]:
    """Drive ``generator`` with ``manager`` entered around each step, and only then: while it is
    suspended, its caller runs unsanitized."""
    sent: Any = None
    thrown: BaseException | None = None
    while True:
        try:
            with manager:
                value = generator.throw(thrown) if thrown is not None else generator.send(sent)
        except StopIteration as stop:
            return stop.value
        sent, thrown = None, None
        try:
            sent = yield value
        except GeneratorExit:
            with manager:
                generator.close()
            raise
        except BaseException as error:
            thrown = error


def sanitize(
    policy: PolicyArg | None = None,
    *,
    layers: Mapping[str, Any] | None = None,
    groups: Mapping[str, Hashable] | None = None,
) -> Sanitizer:
    """Check every view made in a block (or a decorated function) before it is made::

        with safeview.sanitize(layers=kv_caches, groups=layer_to_group) as seen:
            connector.register_kv_caches(kv_caches)   # code you do not own, unchanged
        seen.views        # every view it made: op, storage, offset, shape, strides, call site
        seen.report()     # all of them judged together, bounds and any shared byte
        seen.to_plan("registration.json")   # for: safeview check registration.json --map m.png

    Under ``strict`` (the default) a view past the end of its storage, or a growth of a storage
    other tensors use, raises ``BoundsError`` before the op runs, naming the op, the numbers and
    the call site; with ``layers`` and ``groups``, views made from two layers of one group that
    share a byte raise ``OverlapError``. Under ``warn`` the events say the same and the op runs;
    ``off`` installs nothing. Views that are correct come back exactly as torch makes them. Per
    thread and per asyncio task.
    """
    return Sanitizer(policy, layers=layers, groups=groups)
