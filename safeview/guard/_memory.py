"""Where memory the process guard did not see torch allocate really begins and ends.

A raw pointer carries no size, so the guard judges one against memory whose bounds it knows.
torch's own allocations say their size; the rest is memory torch was handed:

- a Python buffer (``bytes``, ``bytearray``, ``array``, ``mmap``, a ``ctypes`` object that owns
  its bytes, a numpy array that owns its data): ``owner_extent`` walks from the object torch is
  handed (a ``memoryview``, a numpy view, a ``ctypes`` object over another) to the object that
  owns the memory, and gives that memory's bounds, so a window onto a larger buffer never makes
  the rest of it "past the end". ``ctypes`` memory reached by address (``from_address``, a
  pointer's ``contents``), and a numpy array built over such memory, owns nothing: a raw pointer,
  whose bounds only the memory around it can say;
- a mapping (a file, shared memory, ``mmap``): ``/proc/self/maps`` says where it begins and
  ends; a mapping of a file ends where the file does, when the file can be looked at.

``other_allocation`` says whether the first byte after a known allocation belongs to another
allocation (so a span starting there is not "one too far"): another mapping than the
allocation's own (not a loaded library's, not unmapped), on CUDA another block of the caching
allocator's segment that is in use. Standard library only; torch is asked about CUDA alone.
"""

from __future__ import annotations

import array
import bisect
import ctypes
import mmap
import os
import sys
import threading
from typing import Any, NamedTuple

__all__ = ["BUFFERS", "Mapping", "buffer_span", "mapping_at", "other_allocation", "owner_extent"]

_CTYPES = (ctypes._SimpleCData, ctypes.Array, ctypes.Structure, ctypes.Union)
_OWNING = (bytes, bytearray, array.array, mmap.mmap)
BUFFERS = (memoryview, *_OWNING, *_CTYPES)
"""The kinds of buffer ``owner_extent`` knows the owner of (or knows to own nothing)."""


class _PyBuffer(ctypes.Structure):
    """CPython's ``Py_buffer``: where a buffer's bytes are and how many, for any exporter
    (read-only ones too, which ``ctypes.from_buffer`` refuses)."""

    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = (ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int)
_get_buffer.restype = ctypes.c_int
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = (ctypes.POINTER(_PyBuffer),)
_release_buffer.restype = None


def buffer_span(obj: Any) -> tuple[int, int]:
    """``(address, nbytes)`` of the contiguous bytes ``obj`` exports (the buffer protocol, as
    ``torch.frombuffer`` reads it). Raises ``BufferError`` or ``TypeError`` as the protocol does."""
    if isinstance(obj, _CTYPES):  # the common raw-pointer case, without a buffer request
        return ctypes.addressof(obj), ctypes.sizeof(obj)
    view = _PyBuffer()
    _get_buffer(obj, ctypes.byref(view), 0)  # PyBUF_SIMPLE: contiguous bytes
    try:
        return int(view.buf or 0), int(view.len)
    finally:
        _release_buffer(ctypes.byref(view))


def _ndarray_type() -> Any:
    numpy = sys.modules.get("numpy")
    return getattr(numpy, "ndarray", None)


def owner_extent(obj: Any) -> tuple[int, int] | None:
    """``(address, nbytes)`` of the whole memory the object that owns ``obj``'s bytes holds, or
    ``None`` when nothing owns them (a raw pointer: ``ctypes`` memory at an address, a numpy
    array over it) or the owner is of a kind not known here."""
    ndarray = _ndarray_type()
    for _ in range(64):  # a chain of views is short; a cycle is not followed forever
        if isinstance(obj, memoryview):
            obj = obj.obj
            if obj is None:
                return None
        elif isinstance(obj, _OWNING):
            return buffer_span(obj)
        elif isinstance(obj, _CTYPES):
            if obj._b_needsfree_:
                return ctypes.addressof(obj), ctypes.sizeof(obj)
            start = ctypes.addressof(obj)
            base = obj._b_base_
            if isinstance(base, _CTYPES) and not isinstance(base, ctypes._Pointer):
                # a field or slice of a larger ctypes object: that one's memory
                if ctypes.addressof(base) <= start < ctypes.addressof(base) + ctypes.sizeof(base):
                    obj = base
                    continue
                return None
            # from_buffer: the exporter's memoryview is kept in _objects
            held = obj._objects
            views = (
                [v for v in held.values() if isinstance(v, memoryview)]
                if isinstance(held, dict)
                else []
            )
            if len(views) == 1:
                obj = views[0]
                continue
            return None  # from_address, a pointer's contents: a raw pointer
        elif ndarray is not None and isinstance(obj, ndarray):
            if obj.flags.owndata:
                return int(obj.__array_interface__["data"][0]), int(obj.nbytes)
            if obj.base is None:
                return None
            obj = obj.base
        elif hasattr(obj, "__array_interface__") and hasattr(obj, "base"):
            obj = obj.base  # numpy's as_strided hands its array over such an object
        else:
            return None
    return None


# -- mappings (Linux: /proc/self/maps) -----------------------------------------------------------


class Mapping(NamedTuple):
    """One line of ``/proc/self/maps``: ``[start, end)``, and what it holds."""

    start: int
    end: int
    shared: bool
    path: str
    inode: int
    offset: int
    library: bool  # a file some mapping of which is executable: code, not data

    @property
    def data(self) -> bool:
        """Memory a program keeps data in as one allocation: shared memory, or a mapped file
        that is not a loaded library (private anonymous memory is the allocator's, cut up)."""
        if self.library:
            return False
        return self.shared or (bool(self.path) and not self.path.startswith("["))

    def data_end(self) -> int:
        """Where its bytes end: the file's end for a mapped file that can be looked at (the
        rest of the last page reads zeros), the mapping's end otherwise."""
        if self.inode and self.path.startswith("/") and not self.path.endswith(" (deleted)"):
            try:
                size = os.stat(self.path).st_size
            except OSError:
                return self.end
            if size > self.offset:
                return min(self.end, self.start + size - self.offset)
        return self.end


_MAPS = "/proc/self/maps"
_maps_lock = threading.Lock()
# (starts, mappings) as last read; re-read when an address is in none of them, or to confirm
_maps: list[tuple[list[int], list[Mapping]]] = [([], [])]


def _read_maps() -> tuple[list[int], list[Mapping]]:
    mappings: list[Mapping] = []
    executable: set[tuple[str, int]] = set()
    with open(_MAPS, encoding="utf-8", errors="replace") as lines:
        rows = lines.read().splitlines()
    for row in rows:
        fields = row.split(None, 5)
        if len(fields) < 5:
            continue
        span, perms, offset, device, inode = fields[:5]
        if "x" in perms and inode != "0":
            executable.add((device, int(inode)))
    for row in rows:
        fields = row.split(None, 5)
        if len(fields) < 5:
            continue
        span, perms, offset, device, inode = fields[:5]
        start, end = (int(part, 16) for part in span.split("-"))
        path = fields[5].strip() if len(fields) > 5 else ""
        mappings.append(
            Mapping(start, end, perms[3:4] == "s", path, int(inode), int(offset, 16),
                    (device, int(inode)) in executable)
        )  # fmt: skip
    return [m.start for m in mappings], mappings


def maps_available() -> bool:
    return os.path.exists(_MAPS)


def mapping_at(address: int, *, fresh: bool = False) -> Mapping | None:
    """The mapping that holds ``address`` (``None``: unmapped, or no ``/proc`` here). The
    mappings read before are used unless ``fresh`` or none of them holds it."""
    for attempt in (False, True):
        if attempt or fresh or not _maps[0][0]:
            try:
                read = _read_maps()
            except OSError:
                return None
            with _maps_lock:
                _maps[0] = read
            fresh = True
        starts, mappings = _maps[0]
        at = bisect.bisect_right(starts, address) - 1
        if at >= 0 and mappings[at].start <= address < mappings[at].end:
            return mappings[at]
        if fresh:
            return None
    return None


def current_mappings() -> list[Mapping]:
    """The mappings as last read."""
    return list(_maps[0][1])


# -- is the byte after an allocation another allocation's? ----------------------------------------

_packing: list[bool] = []


def _allocator_packs() -> bool:
    """Whether ``posix_memalign`` (torch's CPU allocator) is another allocator than glibc's
    (jemalloc, tcmalloc, through ``LD_PRELOAD`` or linked in): those place allocations of one
    size class back to back, where glibc keeps a chunk header between any two."""
    if not _packing:
        try:
            process = ctypes.cast(ctypes.CDLL(None).posix_memalign, ctypes.c_void_p).value
            libc = ctypes.cast(ctypes.CDLL("libc.so.6").posix_memalign, ctypes.c_void_p).value
            _packing.append(process != libc)
        except (OSError, AttributeError):
            _packing.append(False)
    return _packing[0]


def block_after(segments: Any, address: int) -> str:
    """On a caching allocator's ``segments`` (``torch.cuda.memory_snapshot()``: each with its
    ``address``, ``total_size`` and ``blocks``, each block with a ``size`` and a ``state``,
    carved back to back), what ``address`` (the byte after an allocation) is: ``"allocation"``
    (the first byte of a block in use: another allocation), ``"free"`` (of a free block: no
    one's), ``"same"`` (inside a block: the rounding after the allocation, still its block), or
    ``"outside"`` (no segment's, or a segment's end: memory the allocator cannot speak for)."""
    for segment in segments:
        start = int(segment["address"])
        if not start <= address < start + int(segment["total_size"]):
            continue
        first = start
        for block in segment["blocks"]:
            first = int(block.get("address", first))
            size = int(block["size"])
            if first == address:
                return "free" if block["state"] == "inactive" else "allocation"
            if first < address < first + size:
                return "same"
            first += size
        return "outside"
    return "outside"


def other_allocation(device: str, last_byte: int, address: int) -> bool:
    """Whether ``address``, the first byte after an allocation whose last byte is
    ``last_byte``, belongs to another allocation: then a span starting there is no pointer one
    too far. On CPU ``/proc/self/maps`` decides (read afresh: this decides a refusal): unmapped,
    a loaded library's code or data, or the same mapping of a file are not another allocation;
    another mapping is; inside private anonymous memory (the allocator's heap), another
    allocation can start there only with an allocator that packs allocations. On CUDA the
    caching allocator's segments decide. Elsewhere (no ``/proc``, another device): no."""
    if device.startswith("cuda"):
        import torch

        index = device.partition(":")[2]
        try:
            segments = torch.cuda.memory_snapshot()  # type: ignore[no-untyped-call]
        except Exception:
            return False
        if index:
            segments = [s for s in segments if int(s.get("device", index)) == int(index)]
        return block_after(segments, address) in ("allocation", "outside")
    if device != "cpu" or not maps_available():
        return False
    after = mapping_at(address, fresh=True)
    if after is None or after.library:
        return False
    if after.start <= last_byte < after.end:  # the same mapping
        return not after.data and after.path in ("", "[heap]") and _allocator_packs()
    return after.path not in ("[stack]", "[vvar]", "[vdso]", "[vsyscall]")
