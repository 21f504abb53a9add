"""The process guard's doors where every way in meets: torch's dispatcher, for the two ops that
place a tensor on a storage or grow one (``aten::set_`` with four arguments, ``aten::resize_``),
and ``torch._C.StorageBase.resize_``, the storage's own method (which also shrinks one).

``install()`` registers a kernel of ours for each op at the BackendSelect key and replaces the
storage method; ``uninstall()`` removes the kernels (the ``torch.library.Library`` holding them is
destroyed) and puts the method back. ``safeview.guard.process`` calls both, beside
``safeview.guard._entry_guard`` (the Python entry points: views and raw addresses), whose judging
helpers these doors share. What stays unseen is listed in docs/process.md.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import operator
import threading
from typing import Any

import torch

from safeview import _torch
from safeview.errors import BoundsError
from safeview.guard import _entry_guard as entry

__all__ = ["install", "installed", "uninstall"]

# -- the doors where every path meets: torch's dispatcher, and the storage's own method ----------
#
# ``Tensor.set_``, ``torch.ops.aten.set_``, ``torch._C.TensorBase.set_``, the same on any Tensor
# subclass (``nn.Parameter``'s included) and C++ code that calls the op all reach ``aten::set_``
# through torch's dispatcher; so do ``resize_`` and ``resize_as_`` (``Tensor.``, ``torch.``,
# ``torch.ops.aten.``, ``torch._C.TensorBase.``: ``resize_as_`` runs ``resize_``). A Python kernel
# of ours at the BackendSelect key sees them all, in every thread: that key is in every
# dispatch, inference_mode's included (which leaves out ADInplaceOrView and the Autograd keys);
# it lies below autograd (the version counter is bumped as before) and below the Python key, so
# a subclass with its own ``__torch_dispatch__`` or a dispatch mode runs first and what it runs
# on real tensors comes through here. Only these two ops pay; the kernel calls torch's own below
# BackendSelect. A storage's ``resize_`` is a method of ``torch._C.StorageBase``, no op: that
# method itself is replaced, so ``UntypedStorage.resize_``, ``TypedStorage._resize_`` and
# ``torch._C.StorageBase.resize_`` all come to it.

_BELOW_SELECT = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.BackendSelect)
_SET = torch.ops.aten.set_.source_Storage_storage_offset
_RESIZE = torch.ops.aten.resize_.default
_has_storage = torch._C._has_storage
_StorageBase = torch._C.StorageBase
_s_resize_ = _StorageBase.__dict__["resize_"]
_library: list[Any] = []  # the Library that holds the kernels while the guard is on


def _holds_layers(storage: torch.UntypedStorage) -> tuple[tuple[int, int, str], ...]:
    """The layers given to ``know`` (and ``block_views``, ``check_tensors``, the vLLM plugin)
    that lie in ``storage``: bytes a transfer engine may hold the address of."""
    known = entry._process()._memory.storages.get(storage._cdata)
    return tuple(getattr(known, "layers", ())) if known is not None else ()


def _others(storage: torch.UntypedStorage, own: int) -> bool:
    """Whether anyone but the caller may hold ``storage``'s bytes: more uses than the caller's
    ``own`` (another tensor, another storage object over it), or layers the guard was told of."""
    return entry._use_count(storage._cdata) > own or bool(_holds_layers(storage))


# The one rule of the doors that grow a storage (set_ past its end, resize_ beyond it): torch
# reallocates it, under every tensor over it and every address taken of it. A storage with no
# bytes (empty, or on meta) has no address to leave dangling: it grows freely through every
# door. One with bytes is judged when someone else may hold them: through ``set_`` always (the
# storage is handed in from outside the tensor; torch's own references to it along the way
# differ by door, so no count tells a private one apart), through ``resize_`` when ``_others``.


def _set_kernel(
    keyset: Any, self: torch.Tensor, source: Any, *args: Any, **kwargs: Any
) -> torch.Tensor:
    if not entry._busy():
        try:
            _judge_set(self, source, *args, **kwargs)
        except BoundsError as refused:
            # the traceback shows the caller's line and this one, not the five frames of
            # safeview's own that found it (the message names the op and the call site)
            raise refused.with_traceback(None) from None
    result: torch.Tensor = _SET.redispatch(keyset & _BELOW_SELECT, self, source, *args, **kwargs)
    return result


def _judge_set(
    self: torch.Tensor, source: Any, storage_offset: Any, size: Any, stride: Any = (), **_: Any
) -> None:
    try:
        entry._COUNTS[0] += 1
        offset = storage_offset
        size = tuple(size)
        strides = tuple(stride) if stride else entry._contiguous(size)
        if not all(type(value) is int for value in (offset, *size, *strides)):
            return  # symbolic sizes (torch.compile tracing): not numbers to judge
        nbytes = source.nbytes()
        if type(nbytes) is not int or nbytes == 0 or source.device.type == "meta":
            return  # no bytes: nothing to leave dangling
        itemsize = self.element_size()
        end = entry._extent_elements(offset, size, strides)
        if end < 0 or end * itemsize <= nbytes:
            return
    except Exception as error:
        entry._error("Tensor.set_", error)
        return
    entry._placed("Tensor.set_", self, source, offset, size, strides, itemsize)


def _resize_kernel(
    keyset: Any, self: torch.Tensor, size: Any, *args: Any, **kwargs: Any
) -> torch.Tensor:
    if not entry._busy():
        try:
            _judge_resize(self, size)
        except BoundsError as refused:
            raise refused.with_traceback(None) from None  # see _set_kernel
    result: torch.Tensor = _RESIZE.redispatch(keyset & _BELOW_SELECT, self, size, *args, **kwargs)
    return result


def _judge_resize(self: torch.Tensor, size: Any) -> None:
    try:
        entry._COUNTS[0] += 1
        if self.layout is not entry._STRIDED or not _has_storage(self):
            return  # sparse, or a tensor with no storage: torch says what it supports
        shape = tuple(size)
        offset = self.storage_offset()
        if not isinstance(offset, int) or not all(type(value) is int for value in shape):
            return  # symbolic sizes (torch.compile tracing): not numbers to judge
        count = 1
        for length in shape:
            count *= length
        storage = self.untyped_storage()
        nbytes = storage.nbytes()
        itemsize = self.element_size()
        if count < 0 or (offset + count) * itemsize <= nbytes:
            return  # no growth (negative sizes torch refuses itself)
        if nbytes == 0 or storage.device.type == "meta":
            return
        # the tensor itself and the storage object just made hold two uses
        if not _others(storage, 2):
            return
    except Exception as error:
        entry._error("Tensor.resize_", error)
        return
    entry._placed(
        "Tensor.resize_", self, storage, offset, shape, entry._contiguous(shape), itemsize, True
    )


def storage_resize_(self: torch.UntypedStorage, size: int) -> torch.UntypedStorage:
    if not entry._busy():
        try:
            _judge_storage_resize(self, size)
        except BoundsError as refused:
            raise refused.with_traceback(None) from None  # see _set_kernel
    resized: torch.UntypedStorage = _s_resize_(self, size)
    return resized


def _judge_storage_resize(storage: torch.UntypedStorage, size: Any) -> None:
    """A growth of a storage with bytes that others may hold (``self`` holds one use), or a
    shrink that leaves a known layer's bytes, or a live tensor's, past the new end."""
    try:
        entry._COUNTS[0] += 1
        new = operator.index(size)
        nbytes = storage.nbytes()
        if new == nbytes or storage.device.type == "meta":
            return
        layers = _holds_layers(storage)
        if new < nbytes:
            cut: list[tuple[int, int, str | None]] = [layer for layer in layers if layer[1] > new]
            if not cut:
                reached = _live_reach(storage, new)
                if reached is None:
                    return
                cut = [(*reached, None)]
            growth = False
        else:
            if nbytes == 0 or not _others(storage, 1):
                return
            growth = True
    except Exception as error:
        entry._error("UntypedStorage.resize_", error)
        return
    entry._local.busy = True
    try:
        facts = _torch.storage_facts(storage)
        if growth:
            entry._process()._judge_view(
                "UntypedStorage.resize_", facts, 0, (new,), (1,), 1, "uint8", _torch._site(), True
            )
        else:
            _shrunk(storage, facts, new, min(cut, key=lambda layer: layer[:2]))
    finally:
        entry._local.busy = False


# -- a shrink under live tensors -------------------------------------------------------------
#
# A storage that shrinks is reallocated smaller: every tensor over it keeps its offset and shape,
# so one that reached past the new end now reads and writes freed memory. The tensors over a
# storage are not listed anywhere torch can be asked, so the guard counts them (the storage's
# use count: one per tensor, and one for the storage object being resized) and, when some may
# reach past the new end, finds them among the objects Python's garbage collector tracks (every
# tensor a Python object holds, in any thread; a view's ``_base`` too), without keeping them
# alive. It stops once it has seen as many as the count says. Tensors that only C++ holds (an
# autograd graph's saved tensors, an extension's) are counted but not found: what they reach
# stays unjudged. A shrink to no bytes is a free (FSDP frees a parameter's storage with
# ``resize_(0)`` while the parameter lives, and grows it back before use): its tensors point at
# no memory, and a read of one faults rather than reads another allocation's bytes.

_tensor_types: dict[type, bool] = {}


def _live_reach(storage: torch.UntypedStorage, new: int) -> tuple[int, int] | None:
    """``(first byte, exclusive end)`` of the live tensor over ``storage`` that reaches farthest
    past ``new`` bytes, or ``None`` when none does (or none is found)."""
    key = storage._cdata
    users = entry._use_count(key) - 1  # the storage object being resized holds one use
    if new <= 0 or users <= 0 or not storage.resizable():
        return None  # a free, no tensor over it, or a resize torch refuses itself
    base = storage.data_ptr()
    end = base + storage.nbytes()
    found: dict[int, torch.Tensor] = {}
    farthest: tuple[int, int] | None = None
    pointer = torch._C.TensorBase.data_ptr
    # the youngest objects first (a collection between two lists only moves objects to an
    # older one: seen twice, never missed)
    with torch._C.DisableTorchFunctionSubclass():
        for generation in (0, 1, 2):
            for candidate in gc.get_objects(generation):
                kind = type(candidate)
                is_tensor = _tensor_types.get(kind)
                if is_tensor is None:
                    is_tensor = _tensor_types[kind] = issubclass(kind, torch.Tensor)
                if not is_tensor or id(candidate) in found:
                    continue
                try:
                    if not _has_storage(candidate) or not base <= pointer(candidate) <= end:
                        continue
                    for tensor in (candidate, candidate._base):
                        if tensor is None or id(tensor) in found or not _has_storage(tensor):
                            continue
                        if tensor.untyped_storage()._cdata == key:
                            found[id(tensor)] = tensor
                            farthest = _farther(tensor, new, farthest)
                except Exception:
                    continue  # a tensor that cannot say where it lies (a subclass): not judged
                if len(found) >= users:
                    return farthest
    return farthest


def _farther(
    tensor: torch.Tensor, new: int, farthest: tuple[int, int] | None
) -> tuple[int, int] | None:
    """``farthest``, or ``tensor``'s bytes when they reach farther past ``new`` bytes."""
    offset = tensor.storage_offset()
    if tensor.layout is not entry._STRIDED or not isinstance(offset, int):
        return farthest  # sparse, or symbolic sizes: not numbers to judge
    itemsize = tensor.element_size()
    end = entry._extent_elements(offset, tuple(tensor.shape), tuple(tensor.stride())) * itemsize
    first = offset * itemsize
    if end <= new or end <= first:
        return farthest  # inside the new size, empty, or sizes torch refuses itself
    if farthest is None or (end, first) > farthest[::-1]:
        return first, end
    return farthest


def _shrunk(
    storage: torch.UntypedStorage, facts: Any, new: int, layer: tuple[int, int, str | None]
) -> None:
    """A shrink of ``storage`` to ``new`` bytes, which ``layer`` (a known one, or a live tensor
    with no name) reaches past: reported as those bytes past the storage's new end; refused
    under strict."""
    judge = entry._process()
    first, end, name = layer
    try:
        from safeview.check import bounds

        known = judge._memory.storages.get(facts.key)
        found = bounds(
            name,
            storage=known.name if known is not None else None,
            byte_offset=first,
            extent_bytes=end,
            storage_nbytes=new,
        )
        geometry = judge._geometry(first, (end - first,), (1,), 1, "uint8")
    except Exception as error:
        entry._error("UntypedStorage.resize_", error)
        return
    for finding in found[:1]:
        judge._violation(
            finding,
            "UntypedStorage.resize_",
            device=facts.device,
            storage_nbytes=new,
            geometry=geometry,
            site=_torch._site()[0],
        )


def _storage_namespace() -> dict[str, Any] | None:
    """``torch._C.StorageBase``'s own dict: a type torch defines in C, closed to ``setattr``."""
    found = [item for item in gc.get_referents(_StorageBase.__dict__) if isinstance(item, dict)]
    return found[0] if len(found) == 1 and "resize_" in found[0] else None


def _put_storage_method(function: Any) -> None:
    """Put ``function`` as ``StorageBase.resize_`` as ``type.__setattr__`` would: the dict entry,
    then ``PyType_Modified`` (no lookup cached in the type or its subclasses keeps the old one).
    Where that dict cannot be reached, ``UntypedStorage.resize_`` (a Python class) instead."""
    namespace = _storage_namespace()
    if namespace is None:
        if function is _s_resize_:
            with contextlib.suppress(AttributeError):
                delattr(torch.UntypedStorage, "resize_")
        else:
            torch.UntypedStorage.resize_ = function  # type: ignore[method-assign]
        return
    namespace["resize_"] = function
    ctypes.pythonapi.PyType_Modified(ctypes.py_object(_StorageBase))


def _open_doors() -> None:
    """The kernels registered and the storage method replaced (by ``install``)."""
    library: Any = torch.library.Library("aten", "IMPL")  # type: ignore[no-untyped-call]
    _library.append(library)
    library.impl("set_.source_Storage_storage_offset", _set_kernel, "BackendSelect",
                 with_keyset=True)  # fmt: skip
    library.impl("resize_", _resize_kernel, "BackendSelect", with_keyset=True)
    storage_resize_.__name__ = storage_resize_.__qualname__ = "resize_"
    _put_storage_method(storage_resize_)


def _close_doors() -> None:
    """torch's own kernels and storage method back (by ``uninstall``)."""
    _put_storage_method(_s_resize_)
    while _library:
        _library.pop()._destroy()


_lock = threading.Lock()


def installed() -> bool:
    return bool(_library)


def install() -> None:
    """The kernels registered and the storage method replaced (once; again is a no-op). A
    failure is an ``internal_error``: the Python entry points stay guarded."""
    with _lock:
        if _library:
            return
        try:
            _open_doors()
        except Exception as error:
            entry._error("the dispatcher kernels", error)


def uninstall() -> None:
    """torch's own kernels and storage method back."""
    with _lock:
        try:
            _close_doors()
        except Exception as error:
            entry._error("the dispatcher kernels", error)
