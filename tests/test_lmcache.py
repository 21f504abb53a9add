"""LMCache 0.5.6's own CPU code, run for real under the process guard.

LMCache's CPU path rebuilds tensors from raw pointers and assumed shapes:
``CpuDeviceOps.tensor_from_ptr`` (``torch.frombuffer`` over ``ctypes`` memory at an address,
sized by the shape it is told), ``migrate_to_shm_and_wrap`` (the four-argument ``set_`` that moves
the engine's KV tensors onto shared memory) with ``CpuShmTensorWrapper.to_tensor`` (``as_strided``
over the mapped segment), and the pure-torch ``multi_layer_kv_transfer`` (one pointer and an
assumed ``layer_shape`` per layer). Here they run over KV caches laid out as vLLM 0.33 lays them
(one ``torch.zeros`` int8 buffer, each layer a ``[blocks, heads, tokens, 2 * head_size]`` view,
layer-major and tokens before heads: ``LBNHC``), in a child process (this file run as a script)
with ``SAFEVIEW_GUARD=strict`` and without it:

- clean runs give byte-identical results with and without the guard;
- faults (a layer shape larger than the allocation, a wrong offset into the shared-memory
  storage, a pointer list shifted by one layer) are refused before a byte outside the allocation
  is read or written, with the layer and the numbers;
- the same faults over the layers moved onto LMCache's POSIX shared-memory segment (memory
  torch did not allocate, known by its mapping) are refused at the segment's end, and the clean
  runs over it are byte-identical and leave no raw address unknown;
- LMCache's resolved format (its ``kv_layout`` hint and its detector), as a layout manifest,
  diffed against the manifest vLLM's strides give: an HND cache read as NHD is named.

Install (CPU): ``pip install --no-deps lmcache==0.5.6`` and ``pip install numba msgspec
cachetools pyyaml prometheus_client py-cpuinfo psutil``. Without LMCache the tests skip; with
``SAFEVIEW_REQUIRE_ENGINES=1`` (CI) a missing LMCache is a failure.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable
from functools import cache
from typing import Any

import pytest

REPORT = "SAFEVIEW-LMCACHE-REPORT "
LMCACHE_MISSING = importlib.util.find_spec("lmcache") is None
if LMCACHE_MISSING and os.environ.get("SAFEVIEW_REQUIRE_ENGINES") == "1":
    raise ImportError(
        "SAFEVIEW_REQUIRE_ENGINES=1 but LMCache is not installed "
        "(pip install --no-deps lmcache==0.5.6; see docs/process.md)"
    )

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE = 3, 4, 16, 2, 8
ITEMSIZE = 2  # float16
PAGE = BLOCK_SIZE * HEADS * 2 * HEAD_SIZE * ITEMSIZE  # bytes of one block of one layer
LAYER_BYTES = BLOCKS * PAGE
TOKENS = 20


# -- the child: LMCache's own functions over a vLLM 0.33 cache ------------------------------------


def _vllm_kv_caches(blocks: int = BLOCKS) -> tuple[Any, dict[str, Any]]:
    """One int8 buffer, each layer a ``[B, H, N, C]`` float16 view of it with vLLM 0.33's
    ``LBNHC`` strides (``create_kv_cache_views``), filled with the same numbers every run."""
    import torch

    layer_bytes = blocks * PAGE
    raw = torch.zeros(LAYERS * layer_bytes, dtype=torch.int8)
    content = 2 * HEAD_SIZE * ITEMSIZE  # bytes of one head of one token: K then V
    caches = {}
    for layer in range(LAYERS):
        view = torch.as_strided(
            raw,
            (blocks, HEADS, BLOCK_SIZE, content),
            (BLOCK_SIZE * HEADS * content, content, HEADS * content, 1),
            layer * layer_bytes,
        )
        caches[f"model.layers.{layer}"] = view.view(torch.float16)
    numbers = torch.Generator().manual_seed(0)
    for cache_ in caches.values():
        cache_.copy_(torch.randn(cache_.shape, generator=numbers).to(torch.float16))
    return raw, caches


def _digest(tensor: Any) -> str:
    return hashlib.sha256(tensor.detach().contiguous().numpy().tobytes()).hexdigest()


def _outcome(call: Callable[[], Any]) -> dict[str, Any]:
    try:
        call()
    except Exception as error:
        found: dict[str, Any] = {"error": type(error).__name__, "message": str(error)}
        for name in ("name", "byte_offset", "extent_bytes", "limit_bytes", "overflow_bytes", "op"):
            if hasattr(error, name):
                found[name] = getattr(error, name)
        return found
    return {"error": None}


def _child(case: str) -> dict[str, Any]:
    import torch
    from lmcache.lmcache_native import TransferDirection
    from lmcache.v1.gpu_connector.kv_format.detectors.vllm import VLLM_Detector
    from lmcache.v1.platform.devices.cpu.device_ops import CpuDeviceOps
    from lmcache.v1.platform.devices.cpu.shm import migrate_to_shm_and_wrap
    from lmcache.v1.platform.torch_ops.mem_kernels import multi_layer_kv_transfer

    if case.startswith("shm_"):
        return _shm_child(case)
    raw, caches = _vllm_kv_caches()
    layers = list(caches.values())
    guarded = bool(os.environ.get("SAFEVIEW_GUARD"))
    if guarded and case != "fault_shape_unknown_layers":
        # what the vLLM plugin does with the caches handed to a connector's register_kv_caches
        from safeview.guard import process

        process.know(caches)
    # LMCache's own reading of vLLM's rank-4 caches, with the hint vLLM gives for LBNHC
    engine_format, _ = VLLM_Detector().discover(layers, {"kv_layout": "NHD"})
    cpu = torch.device("cpu")
    ops = CpuDeviceOps()
    pointers = torch.tensor([cache_.data_ptr() for cache_ in layers], dtype=torch.int64)
    slots = torch.arange(TOKENS, dtype=torch.long) * 3 % (BLOCKS * BLOCK_SIZE)
    report: dict[str, Any] = {"format": engine_format.name}

    if case == "clean":
        shape = (BLOCKS, BLOCK_SIZE, HEADS, 2 * HEAD_SIZE)
        report["tensor_from_ptr"] = [
            _digest(ops.tensor_from_ptr(cache_.data_ptr(), shape, torch.float16, cpu))
            for cache_ in layers
        ]
        key_value = torch.zeros(2, LAYERS, TOKENS, HEADS * HEAD_SIZE, dtype=torch.float16)
        multi_layer_kv_transfer(
            key_value, pointers, slots, cpu, BLOCKS * BLOCK_SIZE, TransferDirection.D2H,
            engine_format,
        )  # fmt: skip
        report["read"] = _digest(key_value)
        multi_layer_kv_transfer(
            key_value + 1, pointers, slots, cpu, BLOCKS * BLOCK_SIZE, TransferDirection.H2D,
            engine_format,
        )  # fmt: skip
        report["written"] = _digest(raw)
        wrappers = [migrate_to_shm_and_wrap(cache_) for cache_ in layers]
        rebuilt = [wrapper.to_tensor() for wrapper in wrappers]
        report["shm"] = [_digest(tensor) for tensor in rebuilt]
        report["shm_same"] = all(torch.equal(a, b) for a, b in zip(rebuilt, layers))
        report["shm_metadata"] = [
            [wrapper.storage_offset, list(wrapper.shape), list(wrapper.stride), wrapper.nbytes]
            for wrapper in wrappers
        ]
    elif case in ("fault_shape", "fault_shape_unknown_layers"):
        # LMCache told one more block than vLLM allocated: the assumed layer shape is larger
        before = _digest(raw)
        key_value = torch.ones(2, LAYERS, TOKENS, HEADS * HEAD_SIZE, dtype=torch.float16)
        report["transfer"] = _outcome(
            lambda: multi_layer_kv_transfer(
                key_value, pointers, slots, cpu, (BLOCKS + 1) * BLOCK_SIZE,
                TransferDirection.H2D, engine_format,
            )
        )  # fmt: skip
        report["unchanged"] = _digest(raw) == before
        report["layers_written"] = [
            _digest(cache_) != _digest(_vllm_kv_caches()[1][name])
            for name, cache_ in caches.items()
        ]
        shape = (BLOCKS + 1, BLOCK_SIZE, HEADS, 2 * HEAD_SIZE)
        report["tensor_from_ptr"] = _outcome(
            lambda: ops.tensor_from_ptr(layers[-1].data_ptr(), shape, torch.float16, cpu)
        )
    elif case == "fault_shifted_pointers":
        shifted = pointers + LAYER_BYTES  # each layer's pointer is the next layer's
        key_value = torch.zeros(2, LAYERS, TOKENS, HEADS * HEAD_SIZE, dtype=torch.float16)
        report["transfer"] = _outcome(
            lambda: multi_layer_kv_transfer(
                key_value, shifted, slots, cpu, BLOCKS * BLOCK_SIZE, TransferDirection.D2H,
                engine_format,
            )
        )  # fmt: skip
        report["copied"] = [bool(key_value[:, layer].any()) for layer in range(LAYERS)]
    elif case == "fault_shm_offset":
        wrappers = [migrate_to_shm_and_wrap(cache_) for cache_ in layers]
        wrapper = wrappers[-1]
        # the offset sent in bytes where LMCache reads elements of float16
        wrapper.storage_offset *= ITEMSIZE
        report["to_tensor"] = _outcome(wrapper.to_tensor)
        report["other_layers"] = all(
            torch.equal(w.to_tensor(), cache_) for w, cache_ in zip(wrappers[:-1], layers[:-1])
        )
    if guarded:
        from safeview.guard import process

        report["counts"] = process.counts()._asdict()
    return report


# The shared-memory segments: layers of five blocks (15,360 bytes in all, not a whole number of
# 4 KiB pages), so the byte after the segment is in its own mapping's last page, whatever the
# kernel placed after that mapping
SHM_BLOCKS = 5
SHM_LAYER_BYTES = SHM_BLOCKS * PAGE


def _shm_child(case: str) -> dict[str, Any]:
    """LMCache's CPU shared-memory path: the engine's layers moved onto a POSIX segment
    (``migrate_to_shm_and_wrap``), the "server" mapping the same segment (``to_tensor``), and
    LMCache's raw-pointer code over both. No layer is told to the guard: the segment is memory
    torch did not allocate, known by its mapping."""
    import torch
    from lmcache.lmcache_native import TransferDirection
    from lmcache.v1.gpu_connector.kv_format.detectors.vllm import VLLM_Detector
    from lmcache.v1.platform.devices.cpu.device_ops import CpuDeviceOps
    from lmcache.v1.platform.devices.cpu.shm import migrate_to_shm_and_wrap
    from lmcache.v1.platform.torch_ops.mem_kernels import multi_layer_kv_transfer

    _, caches = _vllm_kv_caches(SHM_BLOCKS)
    layers = list(caches.values())
    wrappers = [migrate_to_shm_and_wrap(cache_) for cache_ in layers]
    server = [wrapper.to_tensor() for wrapper in wrappers]
    engine_format, _ = VLLM_Detector().discover(layers, {"kv_layout": "NHD"})
    cpu = torch.device("cpu")
    ops = CpuDeviceOps()
    pointers = torch.tensor([cache_.data_ptr() for cache_ in layers], dtype=torch.int64)
    slots = torch.arange(TOKENS, dtype=torch.long) * 3 % (SHM_BLOCKS * BLOCK_SIZE)
    segment = layers[0].untyped_storage()
    report: dict[str, Any] = {"segment_nbytes": segment.nbytes()}

    def segment_digest() -> str:
        flat = torch.empty(0, dtype=torch.uint8).set_(segment)
        return _digest(flat)

    if case == "shm_clean":
        shape = (SHM_BLOCKS, BLOCK_SIZE, HEADS, 2 * HEAD_SIZE)
        report["tensor_from_ptr"] = [
            _digest(ops.tensor_from_ptr(tensor.data_ptr(), shape, torch.float16, cpu))
            for tensor in server
        ]
        key_value = torch.zeros(2, LAYERS, TOKENS, HEADS * HEAD_SIZE, dtype=torch.float16)
        multi_layer_kv_transfer(
            key_value, pointers, slots, cpu, SHM_BLOCKS * BLOCK_SIZE, TransferDirection.D2H,
            engine_format,
        )  # fmt: skip
        report["read"] = _digest(key_value)
        multi_layer_kv_transfer(
            key_value + 1, pointers, slots, cpu, SHM_BLOCKS * BLOCK_SIZE,
            TransferDirection.H2D, engine_format,
        )  # fmt: skip
        report["written"] = segment_digest()
        report["server_sees_it"] = all(torch.equal(a, b) for a, b in zip(server, layers))
    elif case == "shm_fault_shape":
        # one block more than the segment holds per layer, written from LMCache
        key_value = torch.ones(2, LAYERS, TOKENS, HEADS * HEAD_SIZE, dtype=torch.float16)
        report["transfer"] = _outcome(
            lambda: multi_layer_kv_transfer(
                key_value, pointers, slots, cpu, (SHM_BLOCKS + 1) * BLOCK_SIZE,
                TransferDirection.H2D, engine_format,
            )
        )  # fmt: skip
        # the server's own mapping of the segment, read with a shape one block too large
        shape = (SHM_BLOCKS + 1, BLOCK_SIZE, HEADS, 2 * HEAD_SIZE)
        report["tensor_from_ptr"] = _outcome(
            lambda: ops.tensor_from_ptr(server[-1].data_ptr(), shape, torch.float16, cpu)
        )
    elif case == "shm_fault_shifted_pointers":
        shifted = pointers + SHM_LAYER_BYTES
        key_value = torch.zeros(2, LAYERS, TOKENS, HEADS * HEAD_SIZE, dtype=torch.float16)
        report["transfer"] = _outcome(
            lambda: multi_layer_kv_transfer(
                key_value, shifted, slots, cpu, SHM_BLOCKS * BLOCK_SIZE, TransferDirection.D2H,
                engine_format,
            )
        )  # fmt: skip
        report["copied"] = [bool(key_value[:, layer].any()) for layer in range(LAYERS)]
    if os.environ.get("SAFEVIEW_GUARD"):
        from safeview.guard import process

        report["counts"] = process.counts()._asdict()
    return report


def _manifest_diff() -> dict[str, Any]:
    """LMCache's resolved format (its ``kv_layout`` hint, then its detector) as a manifest,
    diffed against what vLLM 0.33's strides say its ``LBHNC`` (HND) caches hold. 16 heads and
    16 tokens a block: the shapes cannot tell the two readings apart (LMCache#4463)."""
    import torch
    from lmcache.v1.gpu_connector.kv_format.detectors.vllm import VLLM_Detector
    from lmcache.v1.gpu_connector.kv_format.specs.registry import get_spec_class

    from safeview import describe, diff
    from safeview.manifest import assumed, vllm_axes

    blocks, heads, tokens, head_size = 4, 16, 16, 8
    content = 2 * head_size * ITEMSIZE
    layer_bytes = blocks * heads * tokens * content
    raw = torch.zeros(2 * layer_bytes, dtype=torch.int8)
    caches = {
        f"model.layers.{layer}": torch.as_strided(
            raw,
            (blocks, heads, tokens, content),
            (heads * tokens * content, tokens * content, content, 1),
            layer * layer_bytes,
        ).view(torch.float16)
        for layer in range(2)
    }
    engine = describe(caches, axes=vllm_axes())
    found: dict[str, Any] = {}
    for hint in ("HND", "NHD"):
        engine_format, kv = VLLM_Detector().discover(list(caches.values()), {"kv_layout": hint})
        spec = get_spec_class(engine_format)(kv)
        reads = assumed(
            engine_format.name.replace("_CS", "_2HS"),  # CS: K|V of one head (2 x head size)
            layers=list(caches),
            num_blocks=spec.num_blocks(),
            block_tokens=spec.block_size(),
            num_heads=spec.num_heads(),
            head_size=spec.head_size() // 2,
            dtype="float16",
        )
        report = diff(engine, reads)
        found[hint] = {
            "format": engine_format.name,
            "compatible": report.compatible,
            "findings": [finding.to_json() for finding in report.findings],
        }
    return found


# -- the tests ------------------------------------------------------------------------------------

pytestmark = pytest.mark.skipif(LMCACHE_MISSING, reason="LMCache is not installed")


@cache
def _run(case: str, policy: str | None) -> dict[str, Any]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("SAFEVIEW_")}
    if policy is not None:
        environment["SAFEVIEW_GUARD"] = policy
    result = subprocess.run(
        [sys.executable, __file__, case],
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith(REPORT)]
    assert result.returncode == 0, result.stdout + result.stderr
    assert lines, result.stdout + result.stderr
    found: dict[str, Any] = json.loads(lines[-1][len(REPORT) :])
    return found


def test_clean_runs_are_byte_identical_with_and_without_the_guard() -> None:
    plain = _run("clean", None)
    guarded = _run("clean", "strict")
    counts = guarded.pop("counts")
    assert guarded == plain
    assert plain["format"] == "NL_X_NB_BS_NH_CS"
    assert plain["shm_same"] is True
    assert len(set(plain["tensor_from_ptr"])) == LAYERS
    # the guard looked at LMCache's views and refused none
    assert counts["judged"] >= 3 * LAYERS
    assert counts["refused"] == counts["warned"] == counts["internal_errors"] == 0


def test_assumed_layer_shape_larger_than_the_allocation_is_refused_at_the_first_layer() -> None:
    report = _run("fault_shape", "strict")
    transfer = report["transfer"]
    assert transfer["error"] == "BoundsError"
    assert transfer["name"] == "model.layers.0"
    # layer 0's view, K and V planes of 80 tokens (5 blocks) each, runs a page into layer 1
    assert (transfer["byte_offset"], transfer["extent_bytes"]) == (0, LAYER_BYTES + PAGE)
    assert transfer["limit_bytes"] == LAYER_BYTES
    assert "by torch.frombuffer" in transfer["message"]
    assert "tensor_from_ptr" in transfer["message"]
    assert report["unchanged"] is True  # not one byte written, in any layer
    assert report["layers_written"] == [False] * LAYERS
    last = report["tensor_from_ptr"]
    assert last["error"] == "BoundsError"
    assert last["name"] == f"model.layers.{LAYERS - 1}"
    assert last["overflow_bytes"] == PAGE


def test_assumed_layer_shape_refused_at_the_end_of_the_allocation_without_layers() -> None:
    # layers unknown (no plugin): LMCache writes into the next layer's bytes, which are inside
    # the allocation and cannot be told apart; the last layer, past the end, is refused
    report = _run("fault_shape_unknown_layers", "strict")
    transfer = report["transfer"]
    assert transfer["error"] == "BoundsError"
    assert transfer["name"] is None
    start = (LAYERS - 1) * LAYER_BYTES
    assert transfer["byte_offset"] == start
    assert transfer["extent_bytes"] == start + LAYER_BYTES + PAGE
    assert transfer["limit_bytes"] == LAYERS * LAYER_BYTES
    assert transfer["overflow_bytes"] == PAGE


def test_pointer_list_shifted_by_one_layer_is_refused_before_the_copy_past_the_end() -> None:
    report = _run("fault_shifted_pointers", "strict")
    transfer = report["transfer"]
    assert transfer["error"] == "BoundsError"
    end = LAYERS * LAYER_BYTES
    assert (transfer["byte_offset"], transfer["extent_bytes"]) == (end, end + LAYER_BYTES)
    assert transfer["overflow_bytes"] == LAYER_BYTES
    assert transfer["name"] == f"model.layers.{LAYERS - 1} (the bytes after it)"
    # the first layers were read (from the wrong layers: inside the allocation, undetectable by
    # bounds); the last copy never happened
    assert report["copied"] == [True] * (LAYERS - 1) + [False]


def test_wrong_offset_into_the_shared_memory_storage_is_refused_before_the_view() -> None:
    report = _run("fault_shm_offset", "strict")
    rebuilt = report["to_tensor"]
    assert rebuilt["error"] == "BoundsError"  # safeview's, before torch's own RuntimeError
    assert rebuilt["op"] == "torch.as_strided"
    assert "cpu/shm.py" in rebuilt["message"]
    assert "in to_tensor" in rebuilt["message"]
    start = (LAYERS - 1) * LAYER_BYTES * ITEMSIZE
    assert (rebuilt["byte_offset"], rebuilt["extent_bytes"]) == (start, start + LAYER_BYTES)
    assert rebuilt["limit_bytes"] == LAYERS * LAYER_BYTES
    assert report["other_layers"] is True


def test_shared_memory_clean_runs_are_byte_identical_and_the_segment_is_known_memory() -> None:
    plain = _run("shm_clean", None)
    guarded = _run("shm_clean", "strict")
    counts = guarded.pop("counts")
    assert guarded == plain
    assert plain["segment_nbytes"] == LAYERS * SHM_LAYER_BYTES
    assert plain["server_sees_it"] is True
    assert len(set(plain["tensor_from_ptr"])) == LAYERS
    assert counts["refused"] == counts["warned"] == counts["internal_errors"] == 0
    # every raw pointer LMCache wrapped lies in the segment, judged against its mapping
    assert counts["unknown_addresses"] == 0
    assert counts["judged"] >= 3 * LAYERS


def _past_the_segment(outcome: dict[str, Any], start: int, overflow: int) -> None:
    assert outcome["error"] == "BoundsError", outcome
    assert (outcome["byte_offset"], outcome["limit_bytes"]) == (start, LAYERS * SHM_LAYER_BYTES)
    assert outcome["overflow_bytes"] == overflow
    assert "but storage '/dev/shm/lmcache_kv_" in outcome["message"]
    assert "in tensor_from_ptr" in outcome["message"]


def test_shared_memory_layer_shape_one_block_larger_is_refused_at_the_segment_end() -> None:
    # unknown layers (no plugin): the first layers run into their neighbours inside the
    # segment, which no bound can tell; the last, past the segment, is refused
    report = _run("shm_fault_shape", "strict")
    last = (LAYERS - 1) * SHM_LAYER_BYTES
    _past_the_segment(report["transfer"], last, PAGE)
    assert report["transfer"]["extent_bytes"] == last + SHM_LAYER_BYTES + PAGE
    # the server's own mapping of the segment, read one block too far: refused the same way
    _past_the_segment(report["tensor_from_ptr"], last, PAGE)
    assert report["counts"]["refused"] == 2
    assert report["counts"]["unknown_addresses"] == 0


def test_shared_memory_pointer_list_shifted_by_one_layer_is_refused_at_the_segment_end() -> None:
    report = _run("shm_fault_shifted_pointers", "strict")
    end = LAYERS * SHM_LAYER_BYTES
    _past_the_segment(report["transfer"], end, SHM_LAYER_BYTES)
    assert report["transfer"]["extent_bytes"] == end + SHM_LAYER_BYTES
    assert report["copied"] == [True] * (LAYERS - 1) + [False]


def test_hnd_cache_read_as_nhd_is_named_by_the_manifest_diff() -> None:
    found = _run("manifest", None)
    right, wrong = found["HND"], found["NHD"]
    assert right["format"] == "NL_X_NB_NH_BS_CS"
    assert right["compatible"] is True
    assert wrong["format"] == "NL_X_NB_BS_NH_CS"  # the same shapes, read with the wrong hint
    assert wrong["compatible"] is False
    assert {finding["layer"] for finding in wrong["findings"]} == {
        "model.layers.0",
        "model.layers.1",
    }
    first = wrong["findings"][0]
    assert first["byte"] == 32
    assert first["message"] == (
        "model.layers.0: receiver page byte 32 reads K token 0 head 1 element 0, "
        "the sender wrote K token 1 head 0 element 0 there"
    )


if __name__ == "__main__":
    found = _manifest_diff() if sys.argv[1] == "manifest" else _child(sys.argv[1])
    print(REPORT + json.dumps(found), flush=True)
