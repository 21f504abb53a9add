"""The torch boundary, second half: the dispatch-level guard under ``sanitize()``.

``ViewGuard`` is a ``TorchDispatchMode`` that sees every aten op of its thread and hands each view
an op places, derives or grows, in plain numbers (``Op``), to the sanitizer before the op runs or
its result is returned. What an op does to memory is read from its schema (``_schema_of``); an op
that may grow a shared storage through a written tensor is dry-run on meta copies of its
arguments (``_meta_like``) or, for an ``out=`` tensor, on stand-ins (``_trial``). Tensors and
storages as numbers (``storage_facts``, ``geometry``) come from the first half,
``safeview._torch``; this module imports nothing else of safeview.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

try:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode
except ImportError:  # pragma: no cover - exercised in a subprocess without torch
    import safeview._torch  # noqa: F401 - raises the ImportError that says what to install

    raise

from safeview._torch import (
    _STRIDED,
    StorageFacts,
    _site,
    dtype_name,
    geometry,
    storage_facts,
)

__all__ = ["Op", "ViewGuard", "is_current"]


# -- the dispatch-level guard ----------------------------------------------------------------
#
# What an aten op does to memory is read from its schema, not from a list of names, so that an op
# torch adds later is judged the same way:
#
# - "place": an op with a ``source`` and a ``storage_offset``, ``size`` (and ``stride``): the
#   ``set_`` / ``set`` / ``set.out`` family. It puts a tensor on a storage with the geometry it is
#   given, and grows a resizable storage that is too small: judged before it runs.
# - "strided": ``as_strided`` and ``as_strided_``, the ops with ``size``, ``stride`` and
#   ``storage_offset`` that return ``self`` or an alias of it: judged before they run. An op
#   that only takes those arguments (``as_strided_copy``, ``as_strided_scatter``) places nothing
#   on ``self``'s storage; what it writes is judged as below.
# - "resize": ``resize_`` grows ``self``'s storage when the new size needs more bytes: judged
#   before it runs when other tensors use that storage.
# - "writes": any other op with a written tensor argument (``out=``, an in-place ``self``:
#   ``Tensor(a!)`` in the schema) may resize it (``out=`` tensors of the wrong size are resized
#   by the kernel itself, below the dispatcher); so may the ``out=`` of a placement op. When a
#   written tensor's storage is used by other tensors, the op is first run on meta copies of its
#   arguments (the same sizes, strides, offsets and storage sizes, no data; a tensor subclass
#   such as ``nn.Parameter`` becomes a plain meta tensor of the same geometry) and refused if
#   that grows the storage. Where meta cannot say (no meta kernel, an output whose size depends
#   on the data: ``nonzero``, ``masked_select``, ``histogram``), an ``out=`` argument is worked
#   out by running the op itself with a fresh tensor of the same geometry in place of each
#   ``out=`` (``_trial``): it writes only those, and the real op runs after the verdict. Where
#   even that cannot be done (a random or non-aten op, an op that also writes an input), the op
#   is reported as unproven: refused under strict. In-place arguments (``self`` of ``add_``, the
#   ``Tensor!`` of a custom kernel) are never resized by torch's kernels; when meta cannot run
#   them they run unjudged, as without safeview.
# - "view": any other op that returns an alias of an input (``Tensor(a)`` returned): the view it
#   returns is judged before the caller gets it; making a view reads and writes no memory.


class Op(NamedTuple):
    """A view (or a growth) an aten op is about to make, in plain numbers: ``op`` is its aten
    name, the view starts at ``byte_offset`` of the storage ``storage`` with ``shape`` and
    ``strides`` in elements of ``itemsize`` bytes; ``site`` is the file, line and function of
    the first frame outside torch and safeview. ``explicit``: the placement was asked for by code
    outside torch (the empty-view rule applies); ``False`` for torch's own bookkeeping and for
    views derived by ordinary view ops. ``source``: the tensor the view is made from, when it is
    made from a tensor."""

    op: str
    storage: StorageFacts
    byte_offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    itemsize: int
    dtype: str
    site: tuple[str, int, str]
    growth: bool = False
    explicit: bool = True
    source: Any = None
    unproven: str | None = None
    """Set when what the op writes into ``storage`` could not be worked out: why (the op is
    described by the written tensor as it is now)."""


_aten = torch.ops.aten


def _ints(values: Sequence[Any]) -> tuple[int, ...]:
    return tuple(map(int, values))


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _contiguous(shape: Sequence[int]) -> tuple[int, ...]:
    strides = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _is_plain(value: object) -> bool:
    return type(value) is torch.Tensor and value.layout is _STRIDED


_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__


def _has_storage(value: object) -> bool:
    """A strided tensor whose bytes are a storage's: a plain tensor, or a subclass that leaves
    dispatch to torch (``nn.Parameter``, ``nn.Buffer``, a subclass of the host's)."""
    return (
        isinstance(value, torch.Tensor)
        and value.layout is _STRIDED
        and type(value).__torch_dispatch__ is _PLAIN_DISPATCH
    )


def _shared(storage: torch.UntypedStorage) -> bool:
    # The tensor the op writes holds one reference and this Python wrapper another: more means
    # other tensors (views, the cache itself) use the same bytes.
    return bool(torch._C._storage_Use_Count(storage._cdata) > 2)


class _Schema(NamedTuple):
    """What an op's schema says it does to memory, worked out once per op."""

    kind: str  # "place", "strided", "resize", "set_tensor", "writes", "view" or "" (nothing)
    names: tuple[str, ...]  # argument names, in order
    defaults: dict[str, Any]
    written: tuple[str, ...]  # names of the written tensor arguments dry-run for growth
    aliased: str | None  # the argument a returned alias is a view of
    aliased_index: int  # its position
    outs: frozenset[str] = frozenset()  # the written arguments that are keyword-only (out=)
    trial: bool = False  # whether the op may be run once more on stand-ins for its out= tensors


_SCHEMAS: dict[Any, _Schema] = {}


def _schema_of(func: Any) -> _Schema:
    found = _SCHEMAS.get(func)
    if found is not None:
        return found
    schema = func._schema
    names = tuple(argument.name for argument in schema.arguments)
    defaults = {
        argument.name: argument.default_value
        for argument in schema.arguments
        if argument.has_default_value()
    }
    written_arguments = [
        argument
        for argument in schema.arguments
        if argument.alias_info is not None
        and argument.alias_info.is_write
        and "Tensor" in str(argument.type)
    ]
    written = tuple(argument.name for argument in written_arguments)
    outs = frozenset(argument.name for argument in written_arguments if argument.kwarg_only)
    returned_sets = {
        alias for ret in schema.returns if ret.alias_info is not None
        for alias in ret.alias_info.before_set
    }  # fmt: skip
    # as_strided (``Tensor(a) self -> Tensor(a)``) and as_strided_ (``Tensor(a!) self ->
    # Tensor(a!)``) return self or a view of it: they place a view on self's storage.
    returns_self = any(
        argument.name == "self"
        and argument.alias_info is not None
        and argument.alias_info.before_set & returned_sets
        for argument in schema.arguments
    )
    aliased = next(
        (
            argument.name
            for argument in schema.arguments
            if argument.alias_info is not None
            and not argument.alias_info.is_write
            and argument.alias_info.before_set & returned_sets
        ),
        None,
    )
    kind = ""
    if "source" in names and "storage_offset" in names and "size" in names:
        kind = "place"
    elif {"size", "stride", "storage_offset"} <= set(names) and returns_self:
        kind = "strided"
    elif func in _RESIZE:
        kind = "resize"
    elif func in _SET_TENSOR:
        kind = "set_tensor"
    elif written:
        kind = "writes"
    elif aliased is not None:
        kind = "view"
    if kind in ("place", "strided", "resize", "set_tensor"):
        # self is what the op places or resizes, judged as such; its other written tensors
        # (the out= of set.out) are dry-run like any op's
        written = tuple(name for name in written if name != "self")
    # Running the op once more on stand-ins for its out= tensors is harmless only for an aten
    # op that writes nothing else, draws no random numbers and takes no storage (which a
    # placement would grow).
    trial = (
        kind == "writes"
        and bool(outs)
        and set(written) == outs
        and schema.name.startswith("aten::")
        and torch.Tag.nondeterministic_seeded not in func.tags
        and not any(
            str(argument.type) in ("Generator", "Optional[Generator]", "Storage")
            for argument in schema.arguments
        )
    )
    index = names.index(aliased) if aliased is not None else len(names)
    found = _SCHEMAS[func] = _Schema(kind, names, defaults, written, aliased, index, outs, trial)
    return found


def _bind(schema: _Schema, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    bound = dict(schema.defaults)
    bound.update(zip(schema.names, args))
    bound.update(kwargs)
    return bound


def _placed(func: Any, schema: _Schema, bound: dict[str, Any]) -> Op:
    # set_(self, source, storage_offset, size, stride=()), source a storage or a tensor: the
    # offset and strides count elements of self's dtype, from byte 0 of the source's storage.
    self, source = bound["self"], bound["source"]
    view_source = source if isinstance(source, torch.Tensor) else None
    if isinstance(source, torch.Tensor):
        source = source.untyped_storage()
    itemsize = self.element_size()
    shape = _ints(bound["size"])
    stride = bound.get("stride") or ()
    strides = _ints(stride) if len(stride) else _contiguous(shape)
    site, internal = _site()
    return Op(
        _name(func),
        storage_facts(source),
        int(bound["storage_offset"]) * itemsize,
        shape,
        strides,
        itemsize,
        dtype_name(self.dtype),
        site,
        explicit=not internal,
        source=view_source,
    )


def _strided(func: Any, schema: _Schema, bound: dict[str, Any]) -> Op:
    # as_strided(self, size, stride, storage_offset=None): the offset counts elements from the
    # start of the storage; None keeps self's.
    self = bound["self"]
    offset = bound.get("storage_offset")
    if offset is None:
        offset = self.storage_offset()
    itemsize = self.element_size()
    site, internal = _site()
    return Op(
        _name(func),
        storage_facts(self.untyped_storage()),
        int(offset) * itemsize,
        _ints(bound["size"]),
        _ints(bound["stride"]),
        itemsize,
        dtype_name(self.dtype),
        site,
        explicit=not internal,
        source=self,
    )


def _set_tensor(func: Any, schema: _Schema, bound: dict[str, Any]) -> Op:
    source = bound["source"]
    byte_offset, shape, strides, itemsize = geometry(source)
    site, internal = _site()
    return Op(
        _name(func),
        storage_facts(source.untyped_storage()),
        byte_offset,
        shape,
        strides,
        itemsize,
        dtype_name(source.dtype),
        site,
        explicit=not internal,
        source=source,
    )


def _resize(func: Any, schema: _Schema, bound: dict[str, Any]) -> Op | None:
    # resize_ grows the storage when the new size needs more bytes. Growing one that other
    # tensors use reallocates it under them, as the four-argument set_ does.
    self = bound["self"]
    storage = self.untyped_storage()
    itemsize = self.element_size()
    shape = _ints(bound["size"])
    needed = (self.storage_offset() + _numel(shape)) * itemsize
    nbytes = storage.nbytes()
    if needed <= nbytes or nbytes == 0 or not _shared(storage):
        return None
    site, internal = _site()
    return Op(
        _name(func),
        storage_facts(storage),
        self.storage_offset() * itemsize,
        shape,
        _contiguous(shape),
        itemsize,
        dtype_name(self.dtype),
        site,
        growth=True,
        explicit=not internal,
    )


class _CannotTellError(Exception):
    """An op whose effect on its written tensors cannot be worked out on meta copies."""


def _meta_like(value: Any, storages: dict[int, torch.UntypedStorage]) -> Any:
    """A meta stand-in for an op argument: tensors keep their dtype, sizes, strides, offset and
    storage size (tensors over one storage share one meta storage), containers are copied,
    everything else is passed as it is."""
    if isinstance(value, torch.Tensor):
        if not _has_storage(value):
            raise _CannotTellError(f"a {type(value).__name__} that meta cannot stand in for")
        storage = value.untyped_storage()
        key = storage._cdata
        meta = storages.get(key)
        if meta is None:
            meta = storages[key] = torch.empty(
                storage.nbytes(), dtype=torch.int8, device="meta"
            ).untyped_storage()
        return torch.empty(0, dtype=value.dtype, device="meta").set_(
            meta, value.storage_offset(), value.shape, value.stride()
        )
    if isinstance(value, (list, tuple)):
        return type(value)(_meta_like(item, storages) for item in value)
    if isinstance(value, torch.UntypedStorage):
        raise _CannotTellError("a storage argument")
    if isinstance(value, torch.Generator):
        return None
    return value


def _written_tensors(schema: _Schema, bound: dict[str, Any]) -> list[tuple[str, int, Any]]:
    found = []
    for name in schema.written:
        value = bound.get(name)
        if isinstance(value, torch.Tensor):
            found.append((name, -1, value))
        elif isinstance(value, (list, tuple)):
            found.extend((name, index, item) for index, item in enumerate(value)
                         if isinstance(item, torch.Tensor))  # fmt: skip
    return found


def _argument(name: str, index: int) -> str:
    return name if index < 0 else f"{name}[{index}]"


def _writes(
    func: Any, schema: _Schema, bound: dict[str, Any], args: Sequence[Any], kwargs: dict[str, Any]
) -> Op | None:
    """The growth of a shared storage that the op would make to one of its written tensors, found
    by running the op on meta copies first, or else by ``_trial``; ``None`` when it grows none.
    An ``Op`` with ``unproven`` set when neither can tell for an ``out=`` tensor."""
    written = [
        item
        for item in _written_tensors(schema, bound)
        if _has_storage(item[2]) and _shared(item[2].untyped_storage())
    ]
    if not written:
        return None
    storages: dict[int, torch.UntypedStorage] = {}
    try:
        meta_args = [_meta_like(value, storages) for value in args]
        meta_kwargs = {key: _meta_like(value, storages) for key, value in kwargs.items()}
        meta_bound = _bind(schema, meta_args, meta_kwargs)
        meta_written = {(n, i): t for n, i, t in _written_tensors(schema, meta_bound)}
        func(*meta_args, **meta_kwargs)
    except Exception as error:  # no meta kernel, a data-dependent shape, a subclass, a storage
        return _trial(func, schema, written, args, kwargs, error)
    for name, index, tensor in written:
        meta = meta_written.get((name, index))
        if meta is None:
            continue
        storage = tensor.untyped_storage()
        if meta.untyped_storage().nbytes() <= storage.nbytes():
            continue
        return _growth(func, name, index, tensor, meta)
    return None


def _growth(func: Any, name: str, index: int, tensor: torch.Tensor, grown: torch.Tensor) -> Op:
    """The op, described by the place ``grown`` (the written tensor after a dry run) takes on
    ``tensor``'s storage: growth is true."""
    site, internal = _site()
    itemsize = grown.element_size()
    return Op(
        f"{_name(func)} ({_argument(name, index)}=)",
        storage_facts(tensor.untyped_storage()),
        int(grown.storage_offset()) * itemsize,
        _ints(grown.shape),
        _ints(grown.stride()),
        itemsize,
        dtype_name(grown.dtype),
        site,
        growth=True,
        explicit=not internal,
    )


def _trial(
    func: Any,
    schema: _Schema,
    written: list[tuple[str, int, Any]],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    meta_error: BaseException,
) -> Op | None:
    """What an op that meta cannot run does to its shared ``out=`` tensors, found by running it
    once on its real inputs with each ``out=`` tensor replaced by a fresh one of the same dtype,
    device, shape and strides (``empty_strided``: the bytes it spans, no more): the real
    storage is neither read as an output nor written. If a stand-in keeps its place, the real
    ``out=`` is not resized; if it was resized, the real one would take the same shape at its
    own offset, and that is judged against the real storage. An op whose in-place arguments
    alone are shared runs unjudged (torch's kernels resize ``out=`` tensors, never ``self``)."""
    if not any(name in schema.outs for name, _, _ in written):
        return None
    reason = f"meta cannot run it ({type(meta_error).__name__}: {_first_line(meta_error)})"
    if not schema.trial:
        return _unproven(func, written, schema, f"{reason}, and {_no_trial(func, schema)}")
    stand_ins: dict[tuple[str, int], torch.Tensor] = {}

    def tensor_stand_in(name: str, index: int, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if not _has_storage(value):
            raise _CannotTellError(f"{_argument(name, index)}= is a {type(value).__name__}")
        made = stand_ins[(name, index)] = torch.empty_strided(
            value.shape, value.stride(), dtype=value.dtype, device=value.device
        )
        return made

    def stand_in(name: str, value: Any) -> Any:
        if isinstance(value, (list, tuple)):
            return type(value)(
                tensor_stand_in(name, index, item) for index, item in enumerate(value)
            )
        return tensor_stand_in(name, -1, value)

    try:
        trial_args = list(args)
        trial_kwargs = dict(kwargs)
        for position, name in enumerate(schema.names[: len(args)]):
            if name in schema.outs:
                trial_args[position] = stand_in(name, args[position])
        for name in schema.outs:
            if name in kwargs:
                trial_kwargs[name] = stand_in(name, kwargs[name])
        before = {key: (t.shape, t.stride(), t.storage_offset()) for key, t in stand_ins.items()}
        func(*trial_args, **trial_kwargs)
    except Exception as error:
        reason += f"; run on stand-ins it failed ({type(error).__name__}: {_first_line(error)})"
        return _unproven(func, written, schema, reason)
    for name, index, tensor in written:
        made = stand_ins.get((name, index))
        if made is None:
            continue
        if (made.shape, made.stride(), made.storage_offset()) == before[(name, index)]:
            continue  # not resized: the real out= keeps its place
        itemsize = made.element_size()
        offset = int(tensor.storage_offset()) + int(made.storage_offset())
        shape, strides = _ints(made.shape), _ints(made.stride())
        if not _numel(shape):
            continue  # resizing to nothing needs no bytes
        last = offset + sum((size - 1) * stride for size, stride in zip(shape, strides))
        if (last + 1) * itemsize <= tensor.untyped_storage().nbytes():
            continue
        site, internal = _site()
        return Op(
            f"{_name(func)} ({_argument(name, index)}=)",
            storage_facts(tensor.untyped_storage()),
            offset * itemsize,
            shape,
            strides,
            itemsize,
            dtype_name(made.dtype),
            site,
            growth=True,
            explicit=not internal,
        )
    return None


def _no_trial(func: Any, schema: _Schema) -> str:
    """Why an op is not run on stand-ins (``_schema_of`` decided it)."""
    if not func._schema.name.startswith("aten::"):
        return "it is not one of torch's own ops, whose side effects safeview knows"
    if set(schema.written) != schema.outs:
        return "it also writes an input, which a second run would write again"
    return "it draws random numbers or takes a storage: it cannot be run twice"


def _first_line(error: BaseException, limit: int = 120) -> str:
    text = str(error).strip()
    line = text.splitlines()[0] if text else "no message"
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _unproven(func: Any, written: list[tuple[str, int, Any]], schema: _Schema, reason: str) -> Op:
    """The op as one whose effect on a shared ``out=`` tensor could not be worked out."""
    name, index, tensor = next(item for item in written if item[0] in schema.outs)
    byte_offset, shape, strides, itemsize = geometry(tensor)
    site, internal = _site()
    return Op(
        f"{_name(func)} ({_argument(name, index)}=)",
        storage_facts(tensor.untyped_storage()),
        byte_offset,
        shape,
        strides,
        itemsize,
        dtype_name(tensor.dtype),
        site,
        growth=True,
        explicit=not internal,
        unproven=reason,
    )


def _returned_views(func: Any, result: Any, source: Any) -> list[Op]:
    """The views a view op returned that reach past their storage (a non-empty view only: an
    empty one that torch derives itself, as ``chunk`` of an empty tensor, is torch's own
    bookkeeping)."""
    tensors = result if isinstance(result, (list, tuple)) else (result,)
    found = []
    for tensor in tensors:
        if not _is_plain(tensor) or not tensor.numel():
            continue
        byte_offset, shape, strides, itemsize = geometry(tensor)
        storage = tensor.untyped_storage()
        last = 0
        for size, stride in zip(shape, strides):
            last += (size - 1) * stride
        if byte_offset + itemsize * (last + 1) <= storage.nbytes():
            continue
        site, _ = _site()
        found.append(
            Op(
                _name(func),
                storage_facts(storage),
                byte_offset,
                shape,
                strides,
                itemsize,
                dtype_name(tensor.dtype),
                site,
                explicit=False,
                source=source,
            )
        )
    return found


_NAMES: dict[Any, str] = {}


def _name(func: Any) -> str:
    name = _NAMES.get(func)
    if name is None:
        name = _NAMES[func] = func._schema.name  # "aten::set_": the overload is in the numbers
    return name


_RESIZE = {_aten.resize_.default}
_SET_TENSOR = {_aten.set_.source_Tensor}
_BEFORE: dict[str, Callable[[Any, _Schema, dict[str, Any]], Op | None]] = {
    "place": _placed,
    "strided": _strided,
    "resize": _resize,
    "set_tensor": _set_tensor,
}


class ViewGuard(TorchDispatchMode):  # type: ignore[no-untyped-call,unused-ignore]
    """Sees every aten op of this thread while it is installed. ``active()`` says whether anyone
    wants this op judged now (a sanitizer open in the current context); if so, the views an op
    places or returns and the growths it would make are handed to ``on_view`` (before the op runs
    for placements and growths, before the caller gets the result for returned views), which may
    raise to refuse the op. ``on_alias(source, result)`` hears of every view op whose input was a
    tensor, when ``tracks()`` is true. A failure of safeview's own is handed to ``on_error`` and
    the op runs."""

    def __init__(
        self,
        active: Callable[[], bool],
        on_view: Callable[[Op], None],
        on_error: Callable[[BaseException], None],
        on_alias: Callable[[Any, Any], None] | None = None,
        tracks: Callable[[], bool] | None = None,
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call,unused-ignore]
        self.active = active
        self.on_view = on_view
        self.on_error = on_error
        self.on_alias = on_alias
        self.tracks = tracks


def _dispatch(
    self: ViewGuard,
    func: Any,
    types: Any,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
) -> Any:
    kwargs = kwargs or {}
    if not self.active():
        return func(*args, **kwargs)
    schema = _SCHEMAS.get(func)
    try:
        if schema is None:
            schema = _schema_of(func)
        kind = schema.kind
        op = growth = None
        if kind and kind != "view":
            bound = _bind(schema, args, kwargs)
            describe = _BEFORE.get(kind)
            if describe is not None:
                op = describe(func, schema, bound)
            if schema.written:
                growth = _writes(func, schema, bound, args, kwargs)
    except Exception as error:  # our own failure must not stop the host
        self.on_error(error)
        kind, op, growth = "", None, None
    if op is not None:
        self.on_view(op)
    if growth is not None:
        self.on_view(growth)
    result = func(*args, **kwargs)
    if kind == "view":
        try:
            assert schema is not None
            index = schema.aliased_index
            source = args[index] if index < len(args) else kwargs.get(schema.aliased or "")
            returned = _returned_views(func, result, source)
            if self.on_alias is not None and self.tracks is not None and self.tracks():
                self.on_alias(source, result)
        except Exception as error:
            self.on_error(error)
            returned = []
        for view in returned:
            self.on_view(view)
    return result


# Set after the class is made, so that TorchDispatchMode.__init_subclass__ does not wrap it in
# torch._disable_dynamo: that wrapper costs about as much per op as the whole check, and the
# guard neither traces nor compiles anything.
ViewGuard.__torch_dispatch__ = _dispatch  # type: ignore[method-assign,assignment,unused-ignore]


def is_current(guard: ViewGuard) -> bool:
    """Whether ``guard`` is the top of this thread's dispatch mode stack, the only mode that can be
    popped."""
    return _get_current_dispatch_mode() is guard
