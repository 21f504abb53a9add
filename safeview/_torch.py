"""The torch boundary: every torch call safeview makes is in this module.

What storage and memory a tensor lives in, a tensor's byte geometry, the ``as_strided`` that makes
a view, and the dispatch-level guard under ``sanitize()``. The rest of the package works on
integers. safeview never calls the four-argument ``Tensor.set_`` (which reallocates a resizable
storage that is too small), never copies and never resizes.
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
) -> torch.Tensor:
    """``make_view``'s one call into torch: ``base_tensor`` then ``as_strided``."""
    dtype_ = _DTYPES.get(dtype_name_) or dtype(dtype_name_)
    return torch.as_strided(base_tensor(tensor, storage, dtype_), shape, strides, element_offset)


def strided_view(
    base: torch.Tensor, shape: Sequence[int], strides: Sequence[int], element_offset: int
) -> torch.Tensor:
    """``torch.as_strided`` over ``base``'s storage; the one call that makes every view. Checks
    nothing itself."""
    return torch.as_strided(base, shape, strides, element_offset)


# -- the dispatch-level guard ----------------------------------------------------------------


class Op(NamedTuple):
    """A view (or a growth) an aten op is about to make, in plain numbers: ``op`` is its aten
    name, the view starts at ``byte_offset`` of the storage ``storage`` with ``shape`` and
    ``strides`` in elements of ``itemsize`` bytes; ``site`` is the file, line and function of
    the first frame outside torch and safeview."""

    op: str
    storage: StorageFacts
    byte_offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    itemsize: int
    dtype: str
    site: tuple[str, int, str]
    growth: bool = False


_aten = torch.ops.aten
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_SAFEVIEW_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _site() -> tuple[str, int, str]:
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(
        (_TORCH_DIR, _SAFEVIEW_DIR)
    ):
        frame = frame.f_back
    return frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name


def _ints(values: Sequence[Any]) -> tuple[int, ...]:
    return tuple(map(int, values))


def _set_with_geometry(args: Sequence[Any], kwargs: dict[str, Any]) -> Op | None:
    # set_(self, source, storage_offset, size, stride=()), source a storage or a tensor: the
    # offset and strides count elements of self's dtype, from byte 0 of the source's storage.
    self, source = args[0], args[1]
    offset, size = args[2], args[3]
    stride = args[4] if len(args) > 4 else kwargs.get("stride", ())
    if isinstance(source, torch.Tensor):
        source = source.untyped_storage()
    itemsize = self.element_size()
    shape = _ints(size)
    strides = _ints(stride) if len(stride) else _contiguous(shape)
    return Op(
        "aten::set_",
        storage_facts(source),
        int(offset) * itemsize,
        shape,
        strides,
        itemsize,
        dtype_name(self.dtype),
        _site(),
    )


def _set_tensor(args: Sequence[Any], kwargs: dict[str, Any]) -> Op | None:
    source = args[1]
    byte_offset, shape, strides, itemsize = geometry(source)
    return Op(
        "aten::set_",
        storage_facts(source.untyped_storage()),
        byte_offset,
        shape,
        strides,
        itemsize,
        dtype_name(source.dtype),
        _site(),
    )


def _as_strided(args: Sequence[Any], kwargs: dict[str, Any]) -> Op | None:
    # as_strided(self, size, stride, storage_offset=None): the offset counts elements from the
    # start of the storage; None keeps self's.
    self, size, stride = args[0], args[1], args[2]
    offset = args[3] if len(args) > 3 else kwargs.get("storage_offset")
    if offset is None:
        offset = self.storage_offset()
    itemsize = self.element_size()
    return Op(
        "aten::as_strided",
        storage_facts(self.untyped_storage()),
        int(offset) * itemsize,
        _ints(size),
        _ints(stride),
        itemsize,
        dtype_name(self.dtype),
        _site(),
    )


def _as_strided_(args: Sequence[Any], kwargs: dict[str, Any]) -> Op | None:
    found = _as_strided(args, kwargs)
    return found._replace(op="aten::as_strided_") if found is not None else None


def _resize(args: Sequence[Any], kwargs: dict[str, Any]) -> Op | None:
    # resize_ grows the storage when the new size needs more bytes. Growing one that other
    # tensors use reallocates it under them, as the four-argument set_ does.
    self, size = args[0], args[1]
    storage = self.untyped_storage()
    itemsize = self.element_size()
    shape = _ints(size)
    needed = (self.storage_offset() + _numel(shape)) * itemsize
    nbytes = storage.nbytes()
    # our `storage` wrapper and `self` hold one reference each; more means other users
    if needed <= nbytes or nbytes == 0 or torch._C._storage_Use_Count(storage._cdata) <= 2:
        return None
    return Op(
        "aten::resize_",
        storage_facts(storage),
        self.storage_offset() * itemsize,
        shape,
        _contiguous(shape),
        itemsize,
        dtype_name(self.dtype),
        _site(),
        growth=True,
    )


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


_WATCHED: dict[Any, Callable[[Sequence[Any], dict[str, Any]], Op | None]] = {
    _aten.set_.source_Storage_storage_offset: _set_with_geometry,
    _aten.set_.source_Tensor_storage_offset: _set_with_geometry,
    _aten.set_.source_Tensor: _set_tensor,
    _aten.as_strided.default: _as_strided,
    _aten.as_strided_.default: _as_strided_,
    _aten.resize_.default: _resize,
}


class ViewGuard(TorchDispatchMode):  # type: ignore[no-untyped-call,unused-ignore]
    """Sees every aten op of this thread; for the ops that place a view on a storage (``set_``
    with a storage and geometry, ``as_strided``, ``as_strided_``, and a ``resize_`` that grows a
    shared storage) it hands the view's numbers to ``on_view`` before the op runs. ``on_view`` may
    raise to refuse the op; a failure of safeview's own is handed to ``on_error`` and the op runs.
    """

    def __init__(
        self,
        on_view: Callable[[Op], None],
        on_error: Callable[[BaseException], None],
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call,unused-ignore]
        self.on_view = on_view
        self.on_error = on_error


def _dispatch(
    self: ViewGuard,
    func: Any,
    types: Any,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
) -> Any:
    kwargs = kwargs or {}
    describe = _WATCHED.get(func)
    if describe is not None:
        try:
            op = describe(args, kwargs)
        except Exception as error:  # our own failure must not stop the host
            self.on_error(error)
            op = None
        if op is not None:
            self.on_view(op)
    return func(*args, **kwargs)


# Set after the class is made, so that TorchDispatchMode.__init_subclass__ does not wrap it in
# torch._disable_dynamo: that wrapper costs about as much per op as the whole check, and the
# guard neither traces nor compiles anything.
ViewGuard.__torch_dispatch__ = _dispatch  # type: ignore[method-assign,assignment,unused-ignore]
