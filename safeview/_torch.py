"""The torch boundary: every torch call safeview makes is in this module.

What storage and memory a tensor lives in, a tensor's byte geometry, the ``as_strided`` that makes
a view, and the dispatch-level guard under ``sanitize()``. The rest of the package works on
integers. safeview calls the four-argument ``Tensor.set_`` (which reallocates a resizable storage
that is too small) only once a view is proven to fit its storage (``view_of``) and on meta
copies of its own (``_meta_like``); it never copies and never resizes.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

try:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
except ImportError as missing:  # pragma: no cover - exercised in a subprocess without torch
    raise ImportError(
        "safeview's views, registrations and sanitizer need torch, which is not installed; "
        "install it with: pip install 'safeview[torch]' (safeview check needs no torch)"
    ) from missing

from safeview.errors import ArgumentError

__all__ = [
    "Geometry",
    "Op",
    "StorageFacts",
    "ViewGuard",
    "base_tensor",
    "block_geometry",
    "geometry",
    "is_strided_tensor",
    "storage_facts",
    "storage_of",
    "strided_view",
    "view_of",
]

Tensor = torch.Tensor
UntypedStorage = torch.UntypedStorage
_STRIDED = torch.strided
_DTYPES: dict[str, torch.dtype] = {}


def dtype(name: str) -> torch.dtype:
    """The torch dtype of a canonical name (``"float16"``)."""
    found = _DTYPES.get(name)
    if found is None:
        found = _DTYPES[name] = getattr(torch, name)
    return found


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def dtype_name(value: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(value)
    if name is None:
        name = _DTYPE_NAMES[value] = str(value).removeprefix("torch.")
    return name


def is_strided_tensor(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.layout is _STRIDED


def storage_of(target: object) -> torch.UntypedStorage:
    """The untyped storage a target's offsets count from; ``ArgumentError`` for anything else."""
    if isinstance(target, torch.Tensor):
        if target.layout is not torch.strided:
            raise ArgumentError(
                f"target must be a strided tensor; got a tensor with layout {target.layout}"
            )
        return target.untyped_storage()
    if isinstance(target, torch.UntypedStorage):
        return target
    hint = " (pass its .untyped())" if isinstance(target, torch.TypedStorage) else ""
    raise ArgumentError(
        "target must be a torch.Tensor or a torch.UntypedStorage; "
        f"got {type(target).__name__}{hint}"
    )


class StorageFacts(NamedTuple):
    """What the checker needs of a storage: a key for the allocation, its size, its device, and
    where its bytes lie: storages with the same ``memory`` are one address space, byte 0 of this
    one at ``base`` (its address). On ``meta``, and for a storage without an address, each
    allocation is a memory of its own."""

    key: int
    nbytes: int
    device: str
    memory: Hashable
    base: int


# device -> (its name, whether it has addresses); devices are few, storages many
_DEVICES: dict[torch.device, tuple[str, bool]] = {}


def storage_facts(storage: torch.UntypedStorage) -> StorageFacts:
    key = storage._cdata  # the StorageImpl: one per allocation, also on meta
    device = storage.device
    known = _DEVICES.get(device)
    if known is None:
        known = _DEVICES[device] = (str(device), device.type != "meta")
    name, addressed = known
    address = storage.data_ptr() if addressed else 0
    if address:
        return StorageFacts(key, storage.nbytes(), name, name, address)
    return StorageFacts(key, storage.nbytes(), name, key, 0)


class Geometry(NamedTuple):
    """A tensor's place in its untyped storage: first byte, shape and strides in elements, and
    the item size in bytes."""

    byte_offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    itemsize: int


def geometry(tensor: torch.Tensor) -> Geometry:
    itemsize = tensor.element_size()
    return Geometry(
        int(tensor.storage_offset()) * itemsize,
        tuple(int(size) for size in tensor.shape),
        tuple(int(stride) for stride in tensor.stride()),
        itemsize,
    )


def block_geometry(tensor: torch.Tensor) -> tuple[torch.UntypedStorage, int, int, int]:
    """What a block view of a layer's cache is made from: its untyped storage, its first byte,
    its block stride in bytes (``stride(0)``) and its number of blocks (``shape[0]``); both 0 for
    a 0-d tensor."""
    itemsize = tensor.element_size()
    offset: int = tensor.storage_offset() * itemsize  # type: ignore[assignment]
    if not tensor.dim():
        return tensor.untyped_storage(), offset, 0, 0
    return tensor.untyped_storage(), offset, tensor.stride(0) * itemsize, tensor.shape[0]


def base_tensor(
    tensor: torch.Tensor | None, storage: torch.UntypedStorage, dtype_: torch.dtype
) -> torch.Tensor:
    """A tensor of ``dtype_`` over ``storage`` that a view can be made from: ``tensor`` itself
    when it has that dtype and reads the storage's bytes as they are (no lazy conjugate or
    negative bit), else a one-argument ``set_`` of the storage, which views it whole and never
    resizes it."""
    if (
        tensor is not None
        and tensor.dtype is dtype_
        and not tensor.is_conj()
        and not tensor.is_neg()
        and type(tensor) is torch.Tensor
    ):
        return tensor
    return torch.empty(0, dtype=dtype_, device=storage.device).set_(storage)


def view_of(
    tensor: torch.Tensor | None,
    storage: torch.UntypedStorage,
    dtype_name_: str,
    shape: Sequence[int],
    strides: Sequence[int],
    element_offset: int,
    fits: bool = False,
) -> torch.Tensor:
    """``make_view``'s one call into torch.

    ``as_strided`` of ``tensor`` itself when it can be the base (``base_tensor``). Otherwise,
    when the caller has proven that the view fits (``fits``: its extent is at most
    ``storage.nbytes()``), the four-argument ``set_`` on a new empty tensor, which places it on
    the storage in one call: torch grows a storage only for a view that needs more bytes than it
    has, so on a view that fits (an empty one included) it changes nothing: not the size, not
    the address, not the other tensors over it (tests/test_view.py shows it on cpu and meta, for
    every policy). A view that does not fit is made by ``as_strided`` on the one-argument
    ``set_``, which never grows anything: torch refuses it on cpu and cuda and makes it on meta.
    """
    dtype_ = _DTYPES.get(dtype_name_) or dtype(dtype_name_)
    if (
        tensor is not None
        and tensor.dtype is dtype_
        and type(tensor) is torch.Tensor
        and not tensor.is_conj()
        and not tensor.is_neg()
    ):
        return torch.as_strided(tensor, shape, strides, element_offset)
    empty = torch.empty(0, dtype=dtype_, device=storage.device)
    if fits:
        return empty.set_(storage, element_offset, shape, strides)
    return torch.as_strided(empty.set_(storage), shape, strides, element_offset)


# ``torch.as_strided`` over a base tensor's storage: the call that makes every view of a
# registration (one int8 base per storage). It checks nothing itself, and it is torch's own
# function, not a wrapper: a registration of 10,000 layers calls it 10,000 times.
strided_view: Callable[
    [torch.Tensor, Sequence[int], Sequence[int], int], torch.Tensor
] = torch.as_strided  # fmt: skip


# -- the dispatch-level guard ----------------------------------------------------------------
#
# What an aten op does to memory is read from its schema, not from a list of names, so that an op
# torch adds later is judged the same way:
#
# - "place": an op with a ``source`` and a ``storage_offset``, ``size`` (and ``stride``): the
#   ``set_`` / ``set`` / ``set.out`` family. It puts a tensor on a storage with the geometry it is
#   given, and grows a resizable storage that is too small: judged before it runs.
# - "strided": ``as_strided`` and its in-place form (``size``, ``stride`` and ``storage_offset`` of
#   ``self``'s storage): judged before it runs.
# - "resize": ``resize_`` grows ``self``'s storage when the new size needs more bytes: judged
#   before it runs when other tensors use that storage.
# - "writes": any other op with a written tensor argument (``out=``, an in-place ``self``:
#   ``Tensor(a!)`` in the schema) may resize it (``out=`` tensors of the wrong size are resized
#   by the kernel itself, below the dispatcher). When a written tensor's storage is used by
#   other tensors, the op is first run on meta copies of its arguments (the same sizes, strides,
#   offsets and storage sizes, no data) and refused if that grows the storage.
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


_aten = torch.ops.aten
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_SAFEVIEW_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _site() -> tuple[tuple[str, int, str], bool]:
    """The call site (the first frame outside torch and safeview) and whether the op was issued
    by torch's own Python code (``copy.deepcopy``, ``torch.load``, autograd) rather than by the
    caller."""
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_SAFEVIEW_DIR):
        frame = frame.f_back
    internal = frame.f_code.co_filename.startswith(_TORCH_DIR)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_TORCH_DIR):
        frame = frame.f_back
    return (frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name), internal


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


def _shared(storage: torch.UntypedStorage) -> bool:
    # The tensor the op writes holds one reference and this Python wrapper another: more means
    # other tensors (views, the cache itself) use the same bytes.
    return bool(torch._C._storage_Use_Count(storage._cdata) > 2)


class _Schema(NamedTuple):
    """What an op's schema says it does to memory, worked out once per op."""

    kind: str  # "place", "strided", "resize", "set_tensor", "writes", "view" or "" (nothing)
    names: tuple[str, ...]  # argument names, in order
    defaults: dict[str, Any]
    written: tuple[str, ...]  # names of the written tensor arguments
    aliased: str | None  # the argument a returned alias is a view of
    aliased_index: int  # its position


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
    written = tuple(
        argument.name
        for argument in schema.arguments
        if argument.alias_info is not None
        and argument.alias_info.is_write
        and "Tensor" in str(argument.type)
    )
    returned_sets = {
        alias for ret in schema.returns if ret.alias_info is not None
        for alias in ret.alias_info.before_set
    }  # fmt: skip
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
    elif {"size", "stride", "storage_offset"} <= set(names) and (written or aliased):
        kind = "strided"
    elif func in _RESIZE:
        kind = "resize"
    elif func in _SET_TENSOR:
        kind = "set_tensor"
    elif written:
        kind = "writes"
    elif aliased is not None:
        kind = "view"
    index = names.index(aliased) if aliased is not None else len(names)
    found = _SCHEMAS[func] = _Schema(kind, names, defaults, written, aliased, index)
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
        if not _is_plain(value):
            raise _CannotTellError
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
        raise _CannotTellError
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


def _writes(
    func: Any, schema: _Schema, bound: dict[str, Any], args: Sequence[Any], kwargs: dict[str, Any]
) -> Op | None:
    """The growth of a shared storage that the op would make to one of its written tensors, found
    by running the op on meta copies first; ``None`` when it grows none."""
    written = [
        item
        for item in _written_tensors(schema, bound)
        if _is_plain(item[2]) and _shared(item[2].untyped_storage())
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
    except Exception:  # no meta kernel, a data-dependent shape, a generator: cannot tell
        return None
    for name, index, tensor in written:
        meta = meta_written.get((name, index))
        if meta is None:
            continue
        storage = tensor.untyped_storage()
        if meta.untyped_storage().nbytes() <= storage.nbytes():
            continue
        site, internal = _site()
        return Op(
            f"{_name(func)} ({name}=)",
            storage_facts(storage),
            int(meta.storage_offset()) * meta.element_size(),
            _ints(meta.shape),
            _ints(meta.stride()),
            meta.element_size(),
            dtype_name(meta.dtype),
            site,
            growth=True,
            explicit=not internal,
        )
    return None


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
        op = None
        if kind and kind != "view":
            bound = _bind(schema, args, kwargs)
            describe = _BEFORE.get(kind)
            if describe is not None:
                op = describe(func, schema, bound)
            elif kind == "writes":
                op = _writes(func, schema, bound, args, kwargs)
    except Exception as error:  # our own failure must not stop the host
        self.on_error(error)
        kind, op = "", None
    if op is not None:
        self.on_view(op)
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
