"""The process guard's memory model: which memory it knows and where that memory ends.

Raw pointers reach torch through a few constructors (a buffer, a numpy array, a DLPack capsule),
however they were wrapped; memory torch did not allocate (a Python buffer, a numpy array, a
mapping of a file or of shared memory) is known with its owner's bounds; the byte after a known
allocation is "one too far" only when it belongs to no other allocation. Real subprocesses with
``SAFEVIEW_GUARD=strict`` where the start-up hook matters, the guard started in this process
otherwise."""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from safeview import AddressError, BoundsError
from safeview.guard import process
from safeview.guard._memory import block_after, mapping_at, owner_extent

PAGE = mmap.PAGESIZE
RW = mmap.PROT_READ | mmap.PROT_WRITE
MAP_FIXED = 0x10
HOOK_INSTALLED = any(
    (Path(path) / "safeview-guard.pth").exists() for path in sys.path if path.endswith("packages")
)
LINUX = os.path.exists("/proc/self/maps")


def _environment(**variables: str) -> dict[str, str]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("SAFEVIEW_")}
    environment.update(variables)
    return environment


def _python(code: str, **variables: str) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", textwrap.dedent(code)],
        env=_environment(**variables),
        capture_output=True,
        text=True,
        timeout=300,
        cwd="/",
    )
    assert result.returncode == 0, result.stderr
    found: dict[str, Any] = json.loads(result.stdout.splitlines()[-1])
    return found


@pytest.fixture
def guard() -> Iterator[None]:
    process.start("strict")
    try:
        yield
    finally:
        process.stop()
        process._memory.clear()


def _raw(address: int, nbytes: int) -> torch.Tensor:
    """LMCache's idiom: a tensor over ``nbytes`` at ``address``, sized by what it is told."""
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(address), dtype=torch.uint8)


# -- every way of wrapping a raw pointer ----------------------------------------------------------

# A 256-byte cache the guard knows (a view was made of it), wrapped from its raw address with
# 320 and with 256 bytes by each idiom; prints what each made (the bytes' sum) or refused.
IDIOMS = """
    import ctypes, json
    import numpy as np, torch
    kv = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    torch.as_strided(kv, (16, 16), (16, 1))  # a view of it: known memory
    p = kv.data_ptr()

    def array(n):
        return np.ctypeslib.as_array(ctypes.cast(p, ctypes.POINTER(ctypes.c_uint8)), shape=(n,))

    idioms = {
        "from_address": lambda n: torch.frombuffer(
            (ctypes.c_uint8 * n).from_address(p), dtype=torch.uint8),
        "cast_contents": lambda n: torch.frombuffer(
            ctypes.cast(p, ctypes.POINTER(ctypes.c_uint8 * n)).contents, dtype=torch.uint8),
        "memoryview": lambda n: torch.frombuffer(
            memoryview((ctypes.c_uint8 * n).from_address(p)), dtype=torch.uint8),
        "storage_from_buffer": lambda n: torch.tensor(torch.UntypedStorage.from_buffer(
            (ctypes.c_uint8 * n).from_address(p), dtype=torch.uint8).tolist()),
        "from_numpy": lambda n: torch.from_numpy(array(n)),
        "from_dlpack": lambda n: torch.from_dlpack(array(n)),
        "as_tensor": lambda n: torch.as_tensor(array(n)),
        "asarray": lambda n: torch.asarray(
            memoryview((ctypes.c_uint8 * n).from_address(p)), dtype=torch.uint8),
        "tensor (a copy)": lambda n: torch.tensor(array(n)),
    }
    out = {}
    for name, wrap in idioms.items():
        fits = int(wrap(256).to(torch.int64).sum())
        try:
            wrap(320)
            out[name] = [fits, "made"]
        except Exception as error:
            out[name] = [fits, type(error).__name__ + ": " + str(error)]
    print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.skipif(not HOOK_INSTALLED, reason="safeview-guard.pth is not installed here")
def test_every_idiom_that_wraps_a_raw_pointer_is_judged_against_the_known_memory() -> None:
    plain = _python(IDIOMS)
    guarded = _python(IDIOMS, SAFEVIEW_GUARD="strict")
    assert set(plain) == set(guarded)
    expected = sum(range(256))
    for name, (fits, outcome) in guarded.items():
        assert fits == plain[name][0] == expected, name  # the bytes that fit: as without it
        assert plain[name][1] == "made", name  # unguarded, torch makes 320 bytes of 256
        assert outcome.startswith("BoundsError: "), (name, outcome)
        assert "needs bytes [0, 320) but storage 'storage0' has 256 bytes" in outcome, name
        assert "(64 bytes past the end)" in outcome, name


def test_the_owner_of_a_buffer_is_found_through_views_and_ctypes() -> None:
    data = bytearray(256)
    address = ctypes.addressof((ctypes.c_char * 256).from_buffer(data))
    assert owner_extent(memoryview(data)[64:128]) == (address, 256)
    assert owner_extent((ctypes.c_uint8 * 64).from_buffer(data, 64)) == (address, 256)
    owned = (ctypes.c_uint8 * 128)()
    assert owner_extent(memoryview(owned)) == (ctypes.addressof(owned), 128)
    array = np.zeros(100, dtype=np.uint16)
    assert owner_extent(array[10:20].view(np.uint8)) == (array.ctypes.data, 200)
    # memory reached by address owns nothing: a raw pointer
    assert owner_extent((ctypes.c_uint8 * 64).from_address(address)) is None
    pointer = ctypes.cast(address, ctypes.POINTER(ctypes.c_uint8 * 64))
    assert owner_extent(pointer.contents) is None
    assert owner_extent(np.ctypeslib.as_array(pointer.contents)) is None


# -- memory torch did not allocate is known, with its owner's bounds ------------------------------


def test_a_python_buffer_is_known_to_its_end_not_to_the_windows_end(guard: None) -> None:
    data = bytearray(256)
    window = torch.frombuffer(data, dtype=torch.uint8, count=64, offset=64)
    start = window.data_ptr() - 64
    before = process.counts()
    assert _raw(start + 64, 192).numel() == 192  # past the window, inside the buffer: fine
    assert _raw(start + 128, 128).numel() == 128  # starts where the window ends: the buffer's
    with pytest.raises(BoundsError) as caught:
        _raw(start + 64, 256)
    assert (caught.value.byte_offset, caught.value.extent_bytes) == (64, 320)
    assert caught.value.storage_nbytes == 256
    after = process.counts()
    assert after.unknown_addresses == before.unknown_addresses
    assert after.refused == before.refused + 1


def test_a_numpy_window_is_known_to_the_end_of_the_array_that_owns_it(guard: None) -> None:
    array = np.zeros(512, dtype=np.uint8)
    window = torch.from_numpy(array[100:200])  # known while a storage over it lives
    address = array.ctypes.data
    assert _raw(address + 100, 412).numel() == 412
    with pytest.raises(BoundsError) as caught:
        _raw(address + 100, 413)
    assert caught.value.overflow_bytes == 1
    # numpy's own as_strided past the array's memory: refused before torch aliases it
    past = np.lib.stride_tricks.as_strided(array, shape=(600,), strides=(1,))
    with pytest.raises(BoundsError) as caught:
        torch.from_numpy(past)
    assert caught.value.overflow_bytes == 88
    assert "the memory of the ndarray" in str(caught.value)
    assert window.numel() == 100


def test_an_mmap_is_known_to_the_end_of_its_mapping(guard: None) -> None:
    mapped = mmap.mmap(-1, 2 * PAGE)
    start = torch.frombuffer(mapped, dtype=torch.uint8).data_ptr()
    assert _raw(start + PAGE, PAGE).numel() == PAGE
    with pytest.raises(BoundsError) as caught:
        _raw(start + PAGE, PAGE + 1)
    assert caught.value.overflow_bytes == 1


def test_copies_past_an_owned_buffer_are_refused_too(guard: None) -> None:
    owned = (ctypes.c_uint8 * 64)()
    inside = (ctypes.c_uint8 * 32).from_buffer(owned, 32)
    assert torch.UntypedStorage.from_buffer(inside, dtype=torch.uint8).nbytes() == 32
    array = np.arange(64, dtype=np.uint8)
    past = np.lib.stride_tricks.as_strided(array, shape=(80,), strides=(1,))
    with pytest.raises(BoundsError) as caught:
        torch.tensor(past)
    assert caught.value.overflow_bytes == 16


@pytest.mark.skipif(not LINUX, reason="mappings are read from /proc/self/maps")
def test_raw_pointers_into_a_shared_mapping_are_judged_against_it(guard: None) -> None:
    # memory nobody told the guard of, reached by address only: its mapping bounds it
    with tempfile.NamedTemporaryFile() as file:
        file.truncate(3 * PAGE - 512)  # the file ends inside its mapping's last page
        mapped = mmap.mmap(file.fileno(), 0)
        start = ctypes.addressof((ctypes.c_char * 1).from_buffer(mapped))
        before = process.counts()
        assert _raw(start + PAGE, PAGE).numel() == PAGE
        with pytest.raises(BoundsError) as caught:
            _raw(start + 2 * PAGE, PAGE)
        assert f"storage '{file.name}' has" in str(caught.value)
        assert caught.value.storage_nbytes == 3 * PAGE - 512
        assert caught.value.overflow_bytes == 512
        with pytest.raises(AddressError):  # the same mapping bounds a transfer engine's rows
            process._judge_rows("test", [(start + 2 * PAGE, PAGE)])
        assert process.counts().unknown_addresses == before.unknown_addresses
        del mapped


# -- the byte after a known allocation --------------------------------------------------------


class _Libc:
    def __init__(self) -> None:
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.mmap.restype = ctypes.c_void_p
        self.libc.mmap.argtypes = (
            ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
            ctypes.c_long,
        )  # fmt: skip
        self.libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)

    def mmap(self, address: int | None, nbytes: int, flags: int, fd: int = -1) -> int:
        placed = self.libc.mmap(address, nbytes, RW, flags, fd, 0)
        assert placed not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
        return int(placed)

    def munmap(self, address: int, nbytes: int) -> None:
        assert self.libc.munmap(address, nbytes) == 0


@pytest.fixture
def file_cache_then_other_mapping() -> Iterator[tuple[int, torch.Tensor]]:
    """A file-backed cache (one page, a file mapped shared) and right after it, in another
    mapping, private anonymous memory: two pages reserved, the file mapped over the first."""
    libc = _Libc()
    reserved = libc.mmap(None, 2 * PAGE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with tempfile.TemporaryFile() as file:
        file.truncate(PAGE)
        assert libc.mmap(reserved, PAGE, mmap.MAP_SHARED | MAP_FIXED, file.fileno()) == reserved
        assert mapping_at(reserved, fresh=True) != mapping_at(reserved + PAGE)
        try:
            yield reserved, _raw(reserved, PAGE)
        finally:
            process._memory.clear()
            libc.munmap(reserved, 2 * PAGE)


@pytest.mark.skipif(not LINUX, reason="mappings are read from /proc/self/maps")
def test_a_mapping_that_starts_where_a_known_cache_ends_is_not_the_bytes_after_it(
    guard: None, file_cache_then_other_mapping: tuple[int, torch.Tensor]
) -> None:
    start, cache = file_cache_then_other_mapping
    process.know({"cache": cache.view(4, PAGE // 4)})
    before = process.counts()
    assert _raw(start + PAGE, 256).numel() == 256  # another allocation: let through, counted
    assert process.counts().unknown_addresses == before.unknown_addresses + 1
    process._judge_rows("test", [(start + PAGE, 256)])  # the same for a transfer engine's row
    with pytest.raises(BoundsError) as caught:  # a span that runs out of the cache still is
        _raw(start + PAGE - 64, 128)
    assert caught.value.name == "cache"
    assert caught.value.overflow_bytes == 64
    # with nothing mapped after it, the same pointer is one layer too far
    _Libc().munmap(start + PAGE, PAGE)
    with pytest.raises(BoundsError) as caught:
        _raw(start + PAGE, 256)
    assert caught.value.name == "cache (the bytes after it)"


@pytest.mark.skipif(not LINUX, reason="mappings are read from /proc/self/maps")
def test_the_byte_after_a_torch_allocation_is_still_one_too_far(guard: None) -> None:
    # torch's CPU allocator (glibc's posix_memalign) keeps a header between two allocations:
    # the byte after one is never another's first
    kv = torch.zeros(256, dtype=torch.uint8)
    torch.as_strided(kv, (256,), (1,))
    after = kv.data_ptr() + 256
    # what the guard decides by, named when it decides otherwise
    known = process._memory.at(kv.data_ptr())
    seen = (mapping_at(kv.data_ptr(), fresh=True), mapping_at(after, fresh=True))
    try:
        _raw(after, 64)
    except BoundsError as error:
        assert error.byte_offset == 256
    else:
        pytest.fail(
            f"let through: the allocation known as {known and (known.name, known.source)}; "
            f"its mapping and the next byte's: {seen}"
        )


def test_a_storage_is_known_again_after_the_known_memory_is_cleared(guard: None) -> None:
    # the entry guard keeps which storages it looked at by their handle; a clear that left that
    # record made the storage (and any later one at the same handle) unseen for good
    kv = torch.zeros(256, dtype=torch.uint8)
    torch.as_strided(kv, (256,), (1,))
    process._memory.clear()
    assert process._memory.at(kv.data_ptr()) is None
    torch.as_strided(kv, (256,), (1,))
    with pytest.raises(BoundsError) as caught:
        _raw(kv.data_ptr() + 256, 64)
    assert caught.value.byte_offset == 256


def test_two_windows_of_one_buffer_are_one_allocation(guard: None) -> None:
    data = bytearray(512)
    first = torch.frombuffer(data, dtype=torch.uint8, count=256)
    second = torch.frombuffer(data, dtype=torch.uint8, offset=256)
    assert second.data_ptr() == first.data_ptr() + 256
    assert _raw(first.data_ptr() + 256, 256).numel() == 256
    with pytest.raises(BoundsError):
        _raw(first.data_ptr() + 256, 257)


def test_the_caching_allocators_blocks_tell_the_byte_after_an_allocation() -> None:
    # torch.cuda.memory_snapshot()'s shape: a segment carved into blocks back to back
    segments = [
        {
            "address": 1 << 20,
            "total_size": 4096,
            "blocks": [
                {"size": 1024, "state": "active_allocated"},  # the known allocation (1000 B)
                {"size": 512, "state": "active_allocated"},  # another tensor
                {"size": 512, "state": "inactive"},  # free, cached
                {"size": 2048, "state": "active_allocated"},
            ],
        }
    ]
    base = 1 << 20
    assert block_after(segments, base + 1000) == "same"  # the rounding after 1,000 bytes
    assert block_after(segments, base + 1024) == "allocation"
    assert block_after(segments, base + 1536) == "free"
    assert block_after(segments, base + 4096) == "outside"  # another segment may follow
    assert block_after(segments, 5) == "outside"


@pytest.mark.skipif(not LINUX, reason="mappings are read from /proc/self/maps")
def test_a_mapping_replaced_since_it_was_read_is_read_again_before_a_refusal(guard: None) -> None:
    libc = _Libc()
    with tempfile.TemporaryFile() as small, tempfile.TemporaryFile() as large:
        small.truncate(2 * PAGE)
        large.truncate(4 * PAGE)
        # four pages reserved first, so that the space is never free between the two mappings:
        # unmapped for a moment, another thread's allocation could land there and MAP_FIXED
        # would then map over it (a crash of the test process, now and then)
        start = libc.mmap(None, 4 * PAGE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        assert libc.mmap(start, 2 * PAGE, mmap.MAP_SHARED | MAP_FIXED, small.fileno()) == start
        assert _raw(start, 2 * PAGE).numel() == 2 * PAGE  # known now: two pages
        # four pages of another file where the two were (over them and the reserved rest)
        assert libc.mmap(start, 4 * PAGE, mmap.MAP_SHARED | MAP_FIXED, large.fileno()) == start
        try:
            assert _raw(start + 2 * PAGE, 2 * PAGE).numel() == 2 * PAGE
            process._judge_rows("test", [(start + PAGE, 3 * PAGE)])
            with pytest.raises(BoundsError) as caught:
                _raw(start + 2 * PAGE, 2 * PAGE + 1)
            assert caught.value.storage_nbytes == 4 * PAGE
        finally:
            process._memory.clear()
            libc.munmap(start, 4 * PAGE)
