"""The torch boundary, first half: tensors and storages in plain numbers, and views made of them.

What storage and memory a tensor lives in (``storage_of``, ``storage_facts``), its byte geometry
(``geometry``, ``block_geometry``), the ``as_strided`` that makes a view (``view_of``,
``strided_view``) and the call site of an op (``_site``). The other half is
``safeview.guard._torch_dispatch``, the dispatch-level guard under ``sanitize()``; the process-wide
guard's entry-point patches are ``safeview.guard._entry_guard``. Only these modules import torch;
the rest of the package works on integers. Importing this module is how the package asks for torch:
without it, the ``ImportError`` says what to install.

safeview calls the four-argument ``Tensor.set_`` (which reallocates a resizable storage that is
too small) only once a view is proven to fit its storage (``view_of``) and on meta copies of its
own (``_torch_dispatch._meta_like``); it never copies and never resizes.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Hashable, Sequence
from typing import NamedTuple

try:
    import torch
except ImportError as missing:  # pragma: no cover - exercised in a subprocess without torch
    raise ImportError(
        "safeview's views, registrations and sanitizer need torch, which is not installed; "
        "safeview is on no package index yet: from a checkout of it, pip install -e '.[torch]', "
        "else pip install '/path/to/safeview[torch]' (safeview check needs no torch)"
    ) from missing

from safeview.errors import ArgumentError

__all__ = [
    "Geometry",
    "StorageFacts",
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


def byte_offset(tensor: torch.Tensor) -> int:
    """Where a tensor starts in its untyped storage, in bytes: ``storage_offset * itemsize``.
    The one place safeview reads it (``safeview.describe``; ``geometry`` and ``block_geometry``
    inline the same product)."""
    return int(tensor.storage_offset()) * tensor.element_size()


def geometry(tensor: torch.Tensor) -> Geometry:
    itemsize = tensor.element_size()
    return Geometry(
        int(tensor.storage_offset()) * itemsize,  # byte_offset's product, inlined: a hot path
        tuple(map(int, tensor.shape)),
        tuple(map(int, tensor.stride())),
        itemsize,
    )


def block_geometry(tensor: torch.Tensor) -> tuple[torch.UntypedStorage, int, int, int]:
    """What a block view of a layer's cache is made from: its untyped storage, its first byte,
    its block stride in bytes (``stride(0)``) and its number of blocks (``shape[0]``); both 0 for
    a 0-d tensor."""
    itemsize = tensor.element_size()
    # byte_offset's product inlined: this runs once per layer in block_views' loop
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
