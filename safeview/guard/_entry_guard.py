"""The process guard's torch side: a closed list of doors, each judged before torch runs it.

``install(policy)`` guards, for every thread at once, what makes a view over existing memory or
changes a storage's size; each door works out the bytes the call needs, asks the one checker
(``safeview.check.bounds``, through ``safeview.guard.process``) and only then calls torch's own:

- ``aten::set_`` (four arguments) and ``aten::resize_`` at torch's dispatcher (a kernel of ours
  at the BackendSelect key): every way into them meets there, ``torch.ops``, ``torch._C``,
  ``resize_as_``, Tensor subclasses, ``inference_mode`` and C++ callers included; a growth of a
  storage with bytes that others may hold;
- ``torch._C.StorageBase.resize_`` (so ``UntypedStorage.resize_``): a growth as above, or a
  shrink below a known layer or a live tensor over the storage;

and these Python entry points, patched in place:

- ``torch.as_strided``, ``Tensor.as_strided``, ``Tensor.as_strided_``;
- the constructors through which memory torch did not allocate becomes a tensor:
  ``torch.frombuffer``, ``UntypedStorage.from_buffer`` (a copy), ``torch.from_numpy``,
  ``torch.as_tensor``, ``torch.asarray``, ``torch.tensor`` (a copy) of a numpy array or a
  buffer: its bytes judged against the memory its owner holds, or as a raw address (``ctypes``
  memory at an address, however wrapped) against the memory the guard knows
  (``safeview.guard.process``); a tensor over owned memory makes that memory known;
- ``torch.from_dlpack`` (and ``torch.utils.dlpack.from_dlpack``): a numpy array as above; the
  tensor any other capsule gives aliases memory torch did not allocate, judged like a raw
  address before the caller gets it.

No other op is touched, so no other op pays anything, and ``torch.compile`` traces what it traced
before. C++ that bypasses the dispatcher (``at::native::resize_output`` for a CPU ``out=``, a
CUDA graph replay) is not seen, and code that took a reference to a patched Python function
before the guard went on (``from torch import as_strided`` at import time) keeps it
(docs/process.md lists what stays unseen). A failure inside the guard is reported
(``internal_error``) and the call goes on unjudged.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils.dlpack

from safeview import _torch
from safeview.errors import BoundsError
from safeview.guard import _memory

__all__ = ["WATCHED", "describe_tensor", "install", "installed", "live", "uninstall"]

Tensor = torch.Tensor
UntypedStorage = torch.UntypedStorage
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_use_count = torch._C._storage_Use_Count
_STRIDED = torch.strided

WATCHED = (
    "torch.as_strided",
    "Tensor.as_strided",
    "Tensor.as_strided_",
    "Tensor.set_",
    "Tensor.resize_",
    "UntypedStorage.resize_",
    "torch.frombuffer",
    "torch.from_dlpack",
    "UntypedStorage.from_buffer",
    "torch.from_numpy",
    "torch.as_tensor",
    "torch.asarray",
    "torch.tensor",
)
"""What the guard watches, as its start-up event names them: ``Tensor.set_`` and
``Tensor.resize_`` are the ops (``aten::set_``, ``aten::resize_``) at the dispatcher, whichever
door reaches them; ``UntypedStorage.resize_`` is ``torch._C.StorageBase.resize_``."""

_MISSING = object()
# (owner, attribute, what was there before: the owner's own value, or _MISSING when inherited)
_saved: list[tuple[Any, str, Any]] = []
_lock = threading.Lock()
# One flag per thread: the guard's own torch calls (while it judges) are not judged again.
_local = threading.local()

# the originals, bound once
_as_strided = torch.as_strided
_t_as_strided = Tensor.as_strided
_t_as_strided_ = Tensor.as_strided_
_frombuffer = torch.frombuffer
_from_dlpack = torch.from_dlpack  # type: ignore[attr-defined]
_utils_from_dlpack = torch.utils.dlpack.from_dlpack
_from_numpy = torch.from_numpy
_as_tensor = torch.as_tensor
_asarray = torch.asarray
_tensor = torch.tensor
_s_from_buffer = torch._C.StorageBase.__dict__["from_buffer"]


_module: list[Any] = []
# safeview.guard.process's counters (judged first), bound at install: the hot path adds to a slot
_COUNTS: list[int] = [0]


def _process() -> Any:
    """The judge ``install`` was handed (``safeview.guard.process``, which imports this module: it
    is handed over, never imported back up)."""
    return _module[0]


# -- numbers ---------------------------------------------------------------------------------


def _extent_elements(offset: int, shape: Sequence[int], strides: Sequence[int]) -> int:
    """Exclusive end in elements (the offset for an empty view); -1 for a negative stride or
    size, which torch refuses itself, and for symbolic sizes (``SymInt``, while torch.compile
    traces), which are not numbers to judge (comparing them would add guards to the graph)."""
    if type(offset) is not int:
        return -1
    last = offset
    for size, stride in zip(shape, strides):
        if type(size) is not int or type(stride) is not int:
            return -1
        if size <= 0:
            return -1 if size < 0 else offset
        if stride < 0:
            return -1
        last += (size - 1) * stride
    return last + 1


def _as_int(value: Any) -> Any:
    """An integer argument as an ``int`` (numpy integers included); a symbolic one (``SymInt``)
    as it is, never specialized."""
    if type(value) is int or isinstance(value, torch.SymInt):
        return value
    return operator.index(value)


def _contiguous(shape: Sequence[int]) -> tuple[int, ...]:
    strides = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(int(size), 1)
    return tuple(reversed(strides))


def _seen(storage: torch.UntypedStorage) -> None:
    """A storage torch allocated (resizable: it owns its bytes, exactly ``nbytes``) that a view
    was made of becomes known memory; windows onto other memory (``frombuffer``, ``from_numpy``)
    say nothing about where that memory ends, and are not."""
    key = storage._cdata
    if key in _known_keys:
        return
    process = _process()
    if not storage.resizable() or storage.device.type == "meta":
        _known_keys[key] = False
        weakref.finalize(storage, _known_keys.pop, key, None)
        return
    address = storage.data_ptr()
    if not address:
        return
    _known_keys[key] = True
    ref = weakref.ref(storage)
    weakref.finalize(storage, _forget, key)
    process._memory.add(key, address, storage.nbytes(), str(storage.device), ref, source="view")


def _forgotten_storage(key: int, _: object) -> None:
    """A weak reference's callback: the storage ``key`` is gone."""
    _forget(key)


def _forget(key: int) -> None:
    _known_keys.pop(key, None)
    process = _process()
    process._memory.remove(key)


# storage key -> whether it was added to the known memory (False: looked at, not memory to know)
_known_keys: dict[int, bool] = {}


def forget_all() -> None:
    """Forget which storages were looked at (the known memory was cleared). The same dict is
    emptied, not replaced: the finalizers of storages alive now pop from it."""
    _known_keys.clear()


def live(ref: Any) -> tuple[int, int] | None:
    """Where a known storage is now (its address and size: a resize moves it), or ``None`` once
    it is gone."""
    storage = ref() if ref is not None else None
    if storage is None:
        return None
    return storage.data_ptr(), storage.nbytes()


def describe_tensor(tensor: Any) -> tuple[int, int, int, str, Any, int, int] | None:
    """``(key, address, nbytes, device, ref, first byte, exclusive end)`` of a strided tensor's
    storage and of the bytes it spans in it, or ``None`` for anything else or memory without an
    address. (``block_geometry`` says how its first axis cuts it in pages.)"""
    if not _torch.is_strided_tensor(tensor):
        return None
    storage = tensor.untyped_storage()
    address = storage.data_ptr() if storage.device.type != "meta" else 0
    if not address:
        return None
    byte_offset, shape, strides, itemsize = _torch.geometry(tensor)
    end = _extent_elements(byte_offset // itemsize, shape, strides)
    return (
        storage._cdata,
        address,
        storage.nbytes(),
        str(storage.device),
        weakref.ref(storage),
        byte_offset,
        max(end, 0) * itemsize,
    )


def pages_of(tensor: Any) -> tuple[int, int, int]:
    """A layer's cache as a transfer engine counts it: ``(page_bytes, block_stride_bytes,
    num_blocks)`` along its first axis (the whole tensor one page when it has one axis)."""
    _, shape, strides, itemsize = _torch.geometry(tensor)
    if len(shape) < 2:
        span = max(_extent_elements(0, shape, strides), 0) * itemsize
        return span, span, 1
    page = max(_extent_elements(0, shape[1:], strides[1:]), 0) * itemsize
    return page, strides[0] * itemsize, shape[0]


# -- judging ---------------------------------------------------------------------------------


def _busy() -> bool:
    return getattr(_local, "busy", False)


def _placed(
    op: str,
    tensor: Any,
    storage: torch.UntypedStorage,
    offset: int,
    shape: Sequence[int],
    strides: Sequence[int],
    itemsize: int,
    growth: bool = False,
) -> None:
    """A view ``op`` is about to place on ``storage``: judged when it reaches past the end
    (the caller checked that cheaply first)."""
    _local.busy = True
    try:
        facts = _torch.storage_facts(storage)
        _process()._judge_view(
            op,
            facts,
            offset * itemsize,
            tuple(int(s) for s in shape),
            tuple(int(s) for s in strides),
            itemsize,
            _torch.dtype_name(tensor.dtype),
            _torch._site(),
            growth,
        )
    finally:
        _local.busy = False


def _error(where: str, error: BaseException) -> None:
    with contextlib.suppress(Exception):
        _process()._internal_error(where, error)


def _strided(
    op: str,
    tensor: Any,
    size: Sequence[int],
    stride: Sequence[int],
    storage_offset: int | None,
) -> None:
    if type(tensor) not in _PLAIN or _busy():
        return
    try:
        _COUNTS[0] += 1
        storage = tensor.untyped_storage()
        offset = tensor.storage_offset() if storage_offset is None else _as_int(storage_offset)
        itemsize = tensor.element_size()
        end = _extent_elements(offset, size, stride)
        if storage._cdata not in _known_keys:
            _seen(storage)
        if end < 0:
            return  # negative sizes or strides (torch refuses them itself), or symbolic ones
        if end * itemsize <= storage.nbytes():
            return
    except Exception as error:
        _error(op, error)
        return
    _placed(op, tensor, storage, offset, size, stride, itemsize)


def as_strided(
    input: Tensor, size: Sequence[int], stride: Sequence[int], storage_offset: int | None = None
) -> Tensor:
    try:
        _strided("torch.as_strided", input, size, stride, storage_offset)
    except BoundsError as refused:
        raise refused.with_traceback(None) from None  # see _aten_guard._set_kernel
    return _as_strided(input, size, stride, storage_offset)


def tensor_as_strided(
    self: Tensor, size: Sequence[int], stride: Sequence[int], storage_offset: int | None = None
) -> Tensor:
    try:
        _strided("Tensor.as_strided", self, size, stride, storage_offset)
    except BoundsError as refused:
        raise refused.with_traceback(None) from None  # see _aten_guard._set_kernel
    return _t_as_strided(self, size, stride, storage_offset)


def tensor_as_strided_(
    self: Tensor, size: Sequence[int], stride: Sequence[int], storage_offset: int | None = None
) -> Tensor:
    try:
        _strided("Tensor.as_strided_", self, size, stride, storage_offset)
    except BoundsError as refused:
        raise refused.with_traceback(None) from None  # see _aten_guard._set_kernel
    return _t_as_strided_(self, size, stride, storage_offset)


# -- raw memory entering torch -------------------------------------------------------------------
#
# Every way memory torch did not allocate becomes a tensor passes one of a few constructors: a
# buffer (``frombuffer``, ``UntypedStorage.from_buffer``, ``asarray``), a numpy array
# (``from_numpy``, ``as_tensor``, ``asarray``, ``tensor``), a DLPack capsule (``from_dlpack``).
# ``ctypes`` memory at an address, a pointer's ``contents``, a ``memoryview`` of either, a numpy
# array over it: all arrive here as a buffer or an array. Each is judged by where its bytes are
# (the buffer protocol, the array interface), against the memory the object's owner holds when
# something owns it (``safeview.guard._memory.owner_extent``), else as a raw pointer against the
# known memory. A storage that aliases owned memory becomes known memory with the owner's bounds.


def _owner_of(obj: Any) -> tuple[int, int, str] | None:
    extent = _memory.owner_extent(obj)
    return None if extent is None else (*extent, f"the memory of the {type(obj).__name__}")


def _judge_span(op: str, address: int, length: int, owner: tuple[int, int, str] | None) -> None:
    if length <= 0:
        return
    if owner is not None and owner[0] <= address <= address + length <= owner[0] + owner[1]:
        return  # inside its owner's memory: nothing to judge
    _local.busy = True
    try:
        _process()._judge_raw(op, address, length, _torch._site, owner)
    finally:
        _local.busy = False


def _array_span(array: Any) -> tuple[int, int]:
    """``(address, nbytes)`` of the bytes a numpy array's elements lie in."""
    address = int(array.__array_interface__["data"][0])
    low = high = 0
    for size, stride in zip(array.shape, array.strides):
        if size == 0:
            return address, 0
        if stride < 0:
            low += (size - 1) * stride
        else:
            high += (size - 1) * stride
    return address + low, high - low + array.itemsize


def _is_ndarray(obj: Any) -> bool:
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(obj, numpy.ndarray)


def _judge_array(op: str, array: Any) -> tuple[int, int, str] | None:
    """A numpy array torch is about to alias or copy: its bytes against its owner's memory, or
    as a raw pointer. The owner's bounds (to know the result by), or ``None``."""
    if _busy():
        return None
    try:
        _COUNTS[0] += 1
        address, length = _array_span(array)
        owner = _owner_of(array)
    except Exception as error:
        _error(op, error)
        return None
    _judge_span(op, address, length, owner)
    return owner


def _judge_buffer(
    op: str, buffer: Any, dtype: Any, count: Any, offset: Any
) -> tuple[int, int, str] | None:
    """A buffer torch is about to alias or copy ``count`` items of ``dtype`` from, at byte
    ``offset``: judged as ``_judge_array``."""
    if _busy():
        return None
    try:
        address, size = _memory.buffer_span(buffer)
    except (TypeError, BufferError, ValueError):
        return None  # not a buffer torch takes: torch says so itself
    try:
        _COUNTS[0] += 1
        itemsize = dtype.itemsize if isinstance(dtype, torch.dtype) else 1
        count, offset = int(count), int(offset)
        length = count * itemsize if count >= 0 else size - offset
        owner = _owner_of(buffer)
    except Exception as error:
        _error(op, error)
        return None
    _judge_span(op, address + offset, length, owner)
    return owner


def _know_result(op: str, result: Any, owner: tuple[int, int, str] | None) -> None:
    """A tensor over memory an object owns: its storage known with the owner's bounds, while it
    lives (it keeps its owner alive)."""
    if owner is None or type(result) not in _PLAIN or _busy():
        return
    try:
        storage = result.untyped_storage()
        key = storage._cdata
        address = storage.data_ptr()
        start, nbytes, _ = owner
        inside = start <= address <= address + storage.nbytes() <= start + nbytes
        if key in _known_keys or not inside:
            return  # a copy (torch's own memory), or a storage known already
        _known_keys[key] = True
        # the reference's callback forgets it (the known memory holds the reference: cheaper
        # than a finalizer, on a path a data loader takes per sample)
        ref = weakref.ref(storage, functools.partial(_forgotten_storage, key))
        _process()._memory.add(
            key, start, nbytes, str(storage.device), ref, source="buffer", fixed=True
        )
    except Exception as error:
        _error(op, error)


def frombuffer(
    buffer: Any, *, dtype: Any, count: int = -1, offset: int = 0, requires_grad: bool = False
) -> Tensor:
    owner = _judge_buffer("torch.frombuffer", buffer, dtype, count, offset)
    result = _frombuffer(
        buffer, dtype=dtype, count=count, offset=offset, requires_grad=requires_grad
    )
    _know_result("torch.frombuffer", result, owner)
    return result


def storage_from_buffer(cls: Any, buffer: Any, *args: Any, **kwargs: Any) -> Any:
    # a copy: bytes read past the buffer's memory are a fault as much as a view of them
    # (torch's own arguments, in its order: byte_order, count, offset, dtype)
    given = dict(zip(("byte_order", "count", "offset", "dtype"), args), **kwargs)
    if isinstance(cls, type) and issubclass(cls, UntypedStorage):
        _judge_buffer(
            "UntypedStorage.from_buffer", buffer, given.get("dtype"), given.get("count", -1),
            given.get("offset", 0),
        )  # fmt: skip
    return _s_from_buffer.__get__(None, cls)(buffer, *args, **kwargs)


_storage_from_buffer: Any = classmethod(storage_from_buffer)


def from_numpy(array: Any) -> Tensor:
    owner = _judge_array("torch.from_numpy", array) if _is_ndarray(array) else None
    result = _from_numpy(array)
    _know_result("torch.from_numpy", result, owner)
    return result


def as_tensor(data: Any, *args: Any, **kwargs: Any) -> Tensor:
    if not _is_ndarray(data):
        return _as_tensor(data, *args, **kwargs)
    owner = _judge_array("torch.as_tensor", data)
    result = _as_tensor(data, *args, **kwargs)
    _know_result("torch.as_tensor", result, owner)
    return result


def asarray(obj: Any, *args: Any, **kwargs: Any) -> Tensor:
    if _is_ndarray(obj):
        owner = _judge_array("torch.asarray", obj)
    elif isinstance(obj, _memory.BUFFERS):
        owner = _judge_buffer("torch.asarray", obj, None, -1, 0)
    else:
        return _asarray(obj, *args, **kwargs)
    result = _asarray(obj, *args, **kwargs)
    _know_result("torch.asarray", result, owner)
    return result


def tensor(data: Any, *args: Any, **kwargs: Any) -> Tensor:
    if _is_ndarray(data):  # a copy of the array's bytes: read past its memory is a fault too
        _judge_array("torch.tensor", data)
    return _tensor(data, *args, **kwargs)


def _judge_dlpack(op: str, result: Any) -> None:
    if type(result) not in _PLAIN or _busy() or result.device.type != "cpu":
        return
    try:
        _COUNTS[0] += 1
        described = describe_tensor(result)
        if described is None:
            return
        key, address, _, _, _, first, end = described
        if end <= first or key in _known_keys:
            return  # empty, or a storage the guard knows itself: torch's own bytes
    except Exception as error:
        _error(op, error)
        return
    _local.busy = True
    try:
        _process()._judge_raw(op, address + first, end - first, _torch._site)
    finally:
        _local.busy = False


def _dlpack(op: str, original: Any, ext_tensor: Any, args: Any, kwargs: Any) -> Tensor:
    if _is_ndarray(ext_tensor):  # judged as from_numpy: against what owns the array's bytes
        owner = _judge_array(op, ext_tensor)
        result: Tensor = original(ext_tensor, *args, **kwargs)
        _know_result(op, result, owner)
        return result
    result = original(ext_tensor, *args, **kwargs)
    _judge_dlpack(op, result)
    return result


def from_dlpack(ext_tensor: Any, *args: Any, **kwargs: Any) -> Tensor:
    return _dlpack("torch.from_dlpack", _from_dlpack, ext_tensor, args, kwargs)


def utils_from_dlpack(ext_tensor: Any, *args: Any, **kwargs: Any) -> Tensor:
    return _dlpack("torch.utils.dlpack.from_dlpack", _utils_from_dlpack, ext_tensor, args, kwargs)


# -- installing ------------------------------------------------------------------------------

_PATCHES: tuple[tuple[Any, str, Callable[..., Any]], ...] = (
    (torch, "as_strided", as_strided),
    (Tensor, "as_strided", tensor_as_strided),
    (Tensor, "as_strided_", tensor_as_strided_),
    (torch, "frombuffer", frombuffer),
    (torch, "from_dlpack", from_dlpack),
    (torch.utils.dlpack, "from_dlpack", utils_from_dlpack),
    (UntypedStorage, "from_buffer", _storage_from_buffer),
    (torch, "from_numpy", from_numpy),
    (torch, "as_tensor", as_tensor),
    (torch, "asarray", asarray),
    (torch, "tensor", tensor),
)


def installed() -> bool:
    return bool(_saved)


def install(judge: Any) -> None:
    """Patch the entry points (once; again is a no-op), each call judged by ``judge``
    (``safeview.guard.process``: its ``_judge_view``, ``_judge_raw``, ``_memory``, ``_counts``)."""
    global _COUNTS
    with _lock:
        _module[:] = [judge]
        if _saved:
            return
        _COUNTS = judge._counts
        for owner, name, replacement in _PATCHES:
            before = owner.__dict__.get(name, _MISSING)
            if getattr(replacement, "__name__", None) != name:
                replacement.__name__ = name
            replacement.__qualname__ = name
            _saved.append((owner, name, before))
            setattr(owner, name, replacement)


def uninstall() -> None:
    """Put torch's own entry points back."""
    with _lock:
        while _saved:
            owner, name, before = _saved.pop()
            if before is _MISSING:
                with contextlib.suppress(AttributeError):
                    delattr(owner, name)
            else:
                setattr(owner, name, before)
