"""The process guard's torch side: a closed list of Python entry points, patched in place.

``install(policy)`` replaces, for every thread at once, the Python entry points that make a view
over existing memory or change a storage's size, each by a function that works out the bytes the
call needs, asks the one checker (``safeview.check.bounds``, through ``safeview.process``) and
only then calls torch's own:

- ``torch.as_strided``, ``Tensor.as_strided``, ``Tensor.as_strided_``;
- ``Tensor.set_`` in all its forms (only the four-argument one places a view; the others are
  views of a whole tensor or storage and pass as they are);
- ``torch.frombuffer`` over memory ``ctypes`` reaches by address (``from_address``): a raw
  address, judged against the memory the guard knows (``safeview.process``);
- ``Tensor.resize_``, ``Tensor.resize_as_`` and ``UntypedStorage.resize_`` that would grow a
  storage other tensors use (torch reallocates it under them);
- ``torch.from_dlpack`` (and ``torch.utils.dlpack.from_dlpack``): the tensor it returns aliases
  memory torch did not allocate, judged like a raw address before the caller gets it.

No other op is touched, so no other op pays anything, and ``torch.compile`` traces what it traced
before. Calls from C++ (a kernel, a CUDA graph replay) never pass through these entry points, and
code that took a reference to the original function before the guard went on (``from torch
import as_strided`` at import time) keeps it. A failure inside the guard is reported
(``internal_error``) and the call goes on unjudged.
"""

from __future__ import annotations

import contextlib
import ctypes
import operator
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils.dlpack

from safeview import _torch

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
    "torch.frombuffer",
    "Tensor.resize_",
    "Tensor.resize_as_",
    "UntypedStorage.resize_",
    "torch.from_dlpack",
)
"""The entry points the guard watches, as its start-up event names them."""

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
_t_set_ = Tensor.set_
_frombuffer = torch.frombuffer
_t_resize_ = Tensor.resize_
_t_resize_as_ = Tensor.resize_as_
_s_resize_ = UntypedStorage.resize_
_from_dlpack = torch.from_dlpack  # type: ignore[attr-defined]
_utils_from_dlpack = torch.utils.dlpack.from_dlpack


_module: list[Any] = []
# safeview.process's counters (judged first), bound at install: the hot path adds to a slot
_COUNTS: list[int] = [0]


def _process() -> Any:
    """The judge ``install`` was handed (``safeview.process``, which imports this module: it is
    handed over, never imported back up)."""
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


def _sizes(args: tuple[Any, ...]) -> tuple[int, ...]:
    """``resize_(2, 3)`` and ``resize_((2, 3))`` alike."""
    if len(args) == 1 and not isinstance(args[0], (int, torch.SymInt)):
        return tuple(_as_int(size) for size in args[0])
    return tuple(_as_int(size) for size in args)


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


def _forget(key: int) -> None:
    _known_keys.pop(key, None)
    process = _process()
    process._memory.remove(key)


# storage key -> whether it was added to the known memory (False: looked at, not memory to know)
_known_keys: dict[int, bool] = {}


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
    _strided("torch.as_strided", input, size, stride, storage_offset)
    return _as_strided(input, size, stride, storage_offset)


def tensor_as_strided(
    self: Tensor, size: Sequence[int], stride: Sequence[int], storage_offset: int | None = None
) -> Tensor:
    _strided("Tensor.as_strided", self, size, stride, storage_offset)
    return _t_as_strided(self, size, stride, storage_offset)


def tensor_as_strided_(
    self: Tensor, size: Sequence[int], stride: Sequence[int], storage_offset: int | None = None
) -> Tensor:
    _strided("Tensor.as_strided_", self, size, stride, storage_offset)
    return _t_as_strided_(self, size, stride, storage_offset)


def tensor_set_(self: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    if (len(args) + len(kwargs) >= 3) and type(self) in _PLAIN and not _busy():
        try:
            _COUNTS[0] += 1
            source = args[0] if args else kwargs["source"]
            offset = _as_int(args[1] if len(args) > 1 else kwargs["storage_offset"])
            size = args[2] if len(args) > 2 else kwargs["size"]
            stride = args[3] if len(args) > 3 else kwargs.get("stride")
            if isinstance(source, torch.Tensor):
                storage = source.untyped_storage()
            elif isinstance(source, torch.TypedStorage):
                storage = source.untyped()  # type: ignore[no-untyped-call]
            else:
                storage = source
            size = tuple(map(_as_int, size))
            stride = tuple(map(_as_int, stride)) if stride is not None else ()
            judge = False
            if all(type(value) is int for value in (offset, *size, *stride)):
                strides = stride if stride else _contiguous(size)
                itemsize = self.element_size()
                end = _extent_elements(offset, size, strides)
                nbytes = storage.nbytes()
                judge = type(nbytes) is int and end >= 0 and end * itemsize > nbytes
        except Exception as error:
            _error("Tensor.set_", error)
            judge = False
        if judge:
            _placed("Tensor.set_", self, storage, offset, size, strides, itemsize)
    return _t_set_(self, *args, **kwargs)


def _grows(op: str, tensor: Any, shape: tuple[int, ...]) -> None:
    """``resize_`` of ``tensor`` to ``shape``: judged when it would grow a storage that other
    tensors use."""
    if type(tensor) not in _PLAIN or _busy():
        return
    try:
        _COUNTS[0] += 1
        storage = tensor.untyped_storage()
        itemsize = tensor.element_size()
        offset = tensor.storage_offset()
        if type(offset) is not int or any(type(size) is not int for size in shape):
            return  # symbolic sizes (torch.compile tracing): nothing to judge
        count = 1
        for size in shape:
            count *= size
        nbytes = storage.nbytes()
        # the tensor itself and the storage object above hold two uses: more are other tensors
        if (offset + count) * itemsize <= nbytes or nbytes == 0 or _use_count(storage._cdata) <= 2:
            return
    except Exception as error:
        _error(op, error)
        return
    _placed(op, tensor, storage, offset, shape, _contiguous(shape), itemsize, growth=True)


def tensor_resize_(self: Tensor, *sizes: Any, **kwargs: Any) -> Tensor:
    if sizes:
        try:
            shape = _sizes(sizes)
        except Exception:  # not sizes torch takes: torch says so itself
            shape = ()
        if shape:
            _grows("Tensor.resize_", self, shape)
    return _t_resize_(self, *sizes, **kwargs)


def tensor_resize_as_(self: Tensor, the_template: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    if isinstance(the_template, torch.Tensor):
        _grows("Tensor.resize_as_", self, tuple(the_template.shape))
    return _t_resize_as_(self, the_template, *args, **kwargs)


def storage_resize_(self: torch.UntypedStorage, size: int) -> torch.UntypedStorage:
    if not _busy():
        judge = False
        try:
            _COUNTS[0] += 1
            nbytes = self.nbytes()
            # this storage object holds one use: any more are tensors over it
            judge = int(size) > nbytes > 0 and _use_count(self._cdata) > 1
        except Exception as error:
            _error("UntypedStorage.resize_", error)
        if judge:
            _local.busy = True
            try:
                facts = _torch.storage_facts(self)
                _process()._judge_view(
                    "UntypedStorage.resize_", facts, 0, (int(size),), (1,), 1, "uint8",
                    _torch._site(), True,
                )  # fmt: skip
            finally:
                _local.busy = False
    resized: torch.UntypedStorage = _s_resize_(self, size)
    return resized


_CTYPES = (ctypes._SimpleCData, ctypes.Array, ctypes.Structure, ctypes.Union)


def _buffer_address(buffer: Any) -> tuple[int, int] | None:
    """Address and size of a ``ctypes`` object over memory it does not own (``from_address``):
    a raw address. Other buffers (``bytearray``, numpy arrays, a ``ctypes`` array that owns its
    memory) know their own length, and torch checks ``offset`` and ``count`` against it."""
    if not isinstance(buffer, _CTYPES):
        return None
    if getattr(buffer, "_b_needsfree_", 1) or getattr(buffer, "_b_base_", None) is not None:
        return None
    return ctypes.addressof(buffer), ctypes.sizeof(buffer)


def frombuffer(buffer: Any, *args: Any, **kwargs: Any) -> Tensor:
    if not _busy():
        try:
            raw = _buffer_address(buffer)
            if raw is not None:
                _COUNTS[0] += 1
                address, size = raw
                dtype = kwargs.get("dtype", args[0] if args else None)
                count = int(kwargs.get("count", -1))
                offset = int(kwargs.get("offset", 0))
                itemsize = dtype.itemsize if isinstance(dtype, torch.dtype) else 1
                length = count * itemsize if count >= 0 else size - offset
                judge = True
            else:
                judge = False
        except Exception as error:
            _error("torch.frombuffer", error)
            judge = False
        if judge:
            _local.busy = True
            try:
                _process()._judge_raw("torch.frombuffer", address + offset, length, _torch._site)
            finally:
                _local.busy = False
    return _frombuffer(buffer, *args, **kwargs)


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


def from_dlpack(ext_tensor: Any, *args: Any, **kwargs: Any) -> Tensor:
    result = _from_dlpack(ext_tensor, *args, **kwargs)
    _judge_dlpack("torch.from_dlpack", result)
    return result


def utils_from_dlpack(ext_tensor: Any, *args: Any, **kwargs: Any) -> Tensor:
    result = _utils_from_dlpack(ext_tensor, *args, **kwargs)
    _judge_dlpack("torch.utils.dlpack.from_dlpack", result)
    return result


# -- installing ------------------------------------------------------------------------------

_PATCHES: tuple[tuple[Any, str, Callable[..., Any]], ...] = (
    (torch, "as_strided", as_strided),
    (Tensor, "as_strided", tensor_as_strided),
    (Tensor, "as_strided_", tensor_as_strided_),
    (Tensor, "set_", tensor_set_),
    (torch, "frombuffer", frombuffer),
    (Tensor, "resize_", tensor_resize_),
    (Tensor, "resize_as_", tensor_resize_as_),
    (UntypedStorage, "resize_", storage_resize_),
    (torch, "from_dlpack", from_dlpack),
    (torch.utils.dlpack, "from_dlpack", utils_from_dlpack),
)


def installed() -> bool:
    return bool(_saved)


def install(judge: Any) -> None:
    """Patch the entry points (once; again is a no-op), each call judged by ``judge``
    (``safeview.process``: its ``_judge_view``, ``_judge_raw``, ``_memory``, ``_counts``)."""
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
