"""The same guarantees on a CUDA device, where one is present (skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch

from safeview import BlockLayout, BoundsError, Policy, make_view, sanitize
from safeview.kv import block_views

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TOO_LONG = BlockLayout(num_blocks=5, page_bytes=16, block_stride_bytes=16)


def test_cuda_view_shares_the_cache_and_keeps_its_device() -> None:
    kv = torch.zeros(8 * 4096, dtype=torch.int8, device="cuda")
    layout = BlockLayout(num_blocks=8, page_bytes=1024, block_stride_bytes=4096, byte_offset=1024)
    view = make_view(kv, layout, name="layer.1")
    assert view.device == kv.device
    assert view.data_ptr() == kv.data_ptr() + 1024
    view.fill_(3)
    torch.cuda.synchronize()
    assert int(kv.view(8, 4096)[:, 1024:2048].sum()) == 3 * 8 * 1024
    assert int(kv.sum()) == 3 * 8 * 1024


@pytest.mark.parametrize("policy", list(Policy))
def test_cuda_storage_is_never_moved_or_grown(policy: Policy) -> None:
    kv = torch.zeros(64, dtype=torch.int8, device="cuda")
    storage = kv.untyped_storage()
    before = (storage.data_ptr(), storage.nbytes())
    expected: type[Exception] = RuntimeError if policy is Policy.OFF else BoundsError
    with pytest.raises(expected) as caught:
        make_view(kv, TOO_LONG, policy=policy)
    if policy is Policy.WARN:
        assert isinstance(caught.value.__cause__, RuntimeError)
    assert (storage.data_ptr(), storage.nbytes()) == before


def test_cuda_sanitizer_stops_the_reallocating_set_that_runs_without_it() -> None:
    victim = torch.zeros(64, dtype=torch.int8, device="cuda")
    storage = victim.untyped_storage()
    pointer = storage.data_ptr()
    with pytest.raises(BoundsError) as caught, sanitize():
        torch.empty(0, dtype=torch.int8, device="cuda").set_(storage, 0, (5, 16), (16, 1))
    assert (storage.data_ptr(), storage.nbytes()) == (pointer, 64)
    assert caught.value.op == "aten::set_"
    assert caught.value.device.startswith("cuda")
    torch.empty(0, dtype=torch.int8, device="cuda").set_(storage, 0, (5, 16), (16, 1))
    assert storage.nbytes() == 80  # what it stopped
    assert storage.data_ptr() != pointer


def test_cuda_sanitizer_returns_the_views_torch_makes_and_records_them() -> None:
    kv = torch.zeros(8 * 4096, dtype=torch.int8, device="cuda")
    plain = torch.as_strided(kv, (8, 1024), (4096, 1), 1024)
    with sanitize() as seen:
        guarded = torch.as_strided(kv, (8, 1024), (4096, 1), 1024)
    assert guarded.data_ptr() == plain.data_ptr()
    assert guarded.stride() == plain.stride()
    [view] = seen.views
    assert (view.byte_offset, view.extent_bytes) == (1024, 7 * 4096 + 2048)
    assert view.device.startswith("cuda")


def test_cuda_two_storages_over_one_allocation_are_compared_by_address() -> None:
    from safeview.kv import check_tensors

    kv = torch.zeros(1024, dtype=torch.int8, device="cuda")
    alias = torch.utils.dlpack.from_dlpack(kv)  # the same memory through DLPack
    caches = {"a": kv[:512], "b": alias[256:768]}
    report = check_tensors(caches, policy="warn")
    assert [f.kind for f in report.findings] == ["overlap"]


def test_cuda_block_views_of_a_packed_cache() -> None:
    pages = {"a": 256, "b": 256}
    raw = torch.zeros(16 * 512, dtype=torch.int8, device="cuda")
    caches = {
        "a": torch.as_strided(raw, (16, 256), (512, 1), 0),
        "b": torch.as_strided(raw, (16, 256), (512, 1), 256),
    }
    registration = block_views(caches, pages, num_blocks=16, packed=pages)
    assert registration.report.ok
    assert all(v.device == raw.device for (v,) in registration.tensors_per_block.values())
