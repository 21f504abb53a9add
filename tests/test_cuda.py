"""The same guarantees on every device present: the CPU everywhere, and a CUDA device where one
is (those cases skip elsewhere), so the file runs in every test run and its CUDA half is the same
code with another device."""

from __future__ import annotations

import pytest
import torch

from safeview import BlockLayout, BoundsError, Policy, make_view, sanitize
from safeview.kv import block_views

# the outs of the wrong size are the point of two tests: torch's own deprecation note about them
pytestmark = pytest.mark.filterwarnings("ignore:An output with one or more elements was resized")

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    ),
]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _synchronize(device: str) -> None:
    if device == "cuda":
        _synchronize(device)


TOO_LONG = BlockLayout(num_blocks=5, page_bytes=16, block_stride_bytes=16)


def test_view_shares_the_cache_and_keeps_its_device(device: str) -> None:
    kv = torch.zeros(8 * 4096, dtype=torch.int8, device=device)
    layout = BlockLayout(num_blocks=8, page_bytes=1024, block_stride_bytes=4096, byte_offset=1024)
    view = make_view(kv, layout, name="layer.1")
    assert view.device == kv.device
    assert view.data_ptr() == kv.data_ptr() + 1024
    view.fill_(3)
    _synchronize(device)
    assert int(kv.view(8, 4096)[:, 1024:2048].sum()) == 3 * 8 * 1024
    assert int(kv.sum()) == 3 * 8 * 1024


@pytest.mark.parametrize("policy", list(Policy))
def test_storage_is_never_moved_or_grown(policy: Policy, device: str) -> None:
    kv = torch.zeros(64, dtype=torch.int8, device=device)
    storage = kv.untyped_storage()
    before = (storage.data_ptr(), storage.nbytes())
    expected: type[Exception] = RuntimeError if policy is Policy.OFF else BoundsError
    with pytest.raises(expected) as caught:
        make_view(kv, TOO_LONG, policy=policy)
    if policy is Policy.WARN:
        assert isinstance(caught.value.__cause__, RuntimeError)
    assert (storage.data_ptr(), storage.nbytes()) == before


def test_sanitizer_stops_the_reallocating_set_that_runs_without_it(device: str) -> None:
    victim = torch.zeros(64, dtype=torch.int8, device=device)
    storage = victim.untyped_storage()
    pointer = storage.data_ptr()
    with pytest.raises(BoundsError) as caught, sanitize():
        torch.empty(0, dtype=torch.int8, device=device).set_(storage, 0, (5, 16), (16, 1))
    assert (storage.data_ptr(), storage.nbytes()) == (pointer, 64)
    assert caught.value.op == "aten::set_"
    assert caught.value.device.startswith(device)
    torch.empty(0, dtype=torch.int8, device=device).set_(storage, 0, (5, 16), (16, 1))
    assert storage.nbytes() == 80  # what it stopped
    assert storage.data_ptr() != pointer


def test_sanitizer_returns_the_views_torch_makes_and_records_them(device: str) -> None:
    kv = torch.zeros(8 * 4096, dtype=torch.int8, device=device)
    plain = torch.as_strided(kv, (8, 1024), (4096, 1), 1024)
    with sanitize() as seen:
        guarded = torch.as_strided(kv, (8, 1024), (4096, 1), 1024)
    assert guarded.data_ptr() == plain.data_ptr()
    assert guarded.stride() == plain.stride()
    [view] = seen.views
    assert (view.byte_offset, view.extent_bytes) == (1024, 7 * 4096 + 2048)
    assert view.device.startswith(device)


def test_two_storages_over_one_allocation_are_compared_by_address(device: str) -> None:
    from safeview.kv import check_tensors

    kv = torch.zeros(1024, dtype=torch.int8, device=device)
    alias = torch.utils.dlpack.from_dlpack(kv)  # the same memory through DLPack
    caches = {"a": kv[:512], "b": alias[256:768]}
    report = check_tensors(caches, policy="warn")
    assert [f.kind for f in report.findings] == ["overlap"]


def test_block_views_of_a_packed_cache(device: str) -> None:
    pages = {"a": 256, "b": 256}
    raw = torch.zeros(16 * 512, dtype=torch.int8, device=device)
    caches = {
        "a": torch.as_strided(raw, (16, 256), (512, 1), 0),
        "b": torch.as_strided(raw, (16, 256), (512, 1), 256),
    }
    registration = block_views(caches, pages, num_blocks=16, packed=pages)
    assert registration.report.ok
    assert all(v.device == raw.device for (v,) in registration.tensors_per_block.values())


def test_sanitizer_refuses_an_out_that_would_grow_a_shared_cache(device: str) -> None:
    kv = torch.zeros(64, device=device)
    storage = kv.untyped_storage()
    before = (storage.data_ptr(), storage.nbytes())
    x = torch.ones(8, 4, device=device)
    weight = torch.nn.Parameter(torch.ones(4, 16, device=device), requires_grad=False)  # a subclass
    with pytest.raises(BoundsError), sanitize():
        torch.mm(x, weight, out=kv[:16])  # 128 floats into a storage of 64
    assert (storage.data_ptr(), storage.nbytes()) == before
    with sanitize():  # the right size is left alone, and written where it belongs
        torch.mm(x[:2], weight[:, :8], out=kv[16:32].view(2, 8))
    _synchronize(device)
    assert int(kv[16:32].sum()) == 16 * 4
    assert (storage.data_ptr(), storage.nbytes()) == before


def test_sanitizer_judges_a_data_dependent_out_by_its_real_size(device: str) -> None:
    kv = torch.zeros(64, dtype=torch.int64, device=device)
    storage = kv.untyped_storage()
    before = (storage.data_ptr(), storage.nbytes())
    many = torch.ones(100, device=device)  # 100 indices: 800 bytes into a 512-byte storage
    with pytest.raises(BoundsError), sanitize():
        torch.nonzero(many, out=kv[:4])
    assert (storage.data_ptr(), storage.nbytes()) == before
    few = torch.zeros(100, device=device)
    few[[3, 50]] = 1
    with sanitize():
        torch.nonzero(few, out=kv[:4])
    _synchronize(device)
    assert kv[:2].tolist() == [3, 50]
    assert (storage.data_ptr(), storage.nbytes()) == before


def test_process_guard_refuses_an_out_of_bounds_set_on_another_thread(device: str) -> None:
    import threading

    from safeview.guard import process

    victim = torch.zeros(64, dtype=torch.int8, device=device)
    storage = victim.untyped_storage()
    before = (storage.data_ptr(), storage.nbytes())
    caught: list[BaseException] = []

    def worker() -> None:
        try:
            torch.empty(0, dtype=torch.int8, device=device).set_(storage, 0, (5, 16), (16, 1))
        except BaseException as error:  # the test asserts what it was
            caught.append(error)

    process.start("strict")
    try:
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
        view = torch.as_strided(victim, (4, 16), (16, 1), 0)  # in bounds: made as usual
    finally:
        process.stop()
    assert [type(error) for error in caught] == [BoundsError]
    assert (storage.data_ptr(), storage.nbytes()) == before
    assert view.data_ptr() == victim.data_ptr()


def test_manifest_is_the_one_of_the_same_layout_on_meta(device: str) -> None:
    import safeview
    from safeview.manifest import vllm_axes

    topology = {"tp_rank": 0, "tp_size": 1, "total_kv_heads": 4}
    manifests = []
    for on in (device, "meta"):
        nhd = torch.zeros(8, 16, 4, 2 * 64, dtype=torch.bfloat16, device=on)
        hnd = nhd.permute(0, 2, 1, 3)  # the same shape, tokens outside heads
        caches = {"layers.0": hnd, "layers.1": hnd.contiguous()}
        manifests.append(safeview.describe(caches, axes=vllm_axes(), topology=topology))
    real, meta = manifests
    assert real.fingerprint == meta.fingerprint
    assert safeview.diff(real, meta).compatible


def test_block_views_past_the_end_under_warn_raise_and_leave_the_cache(device: str) -> None:
    kv = torch.zeros(16 * 256, dtype=torch.int8, device=device)
    storage = kv.untyped_storage()
    before = (storage.data_ptr(), storage.nbytes())
    caches = {"layer.0": kv.view(16, 256)}
    with pytest.raises(BoundsError) as caught:
        block_views(caches, {"layer.0": 256}, num_blocks=17, policy="warn")
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert (storage.data_ptr(), storage.nbytes()) == before
