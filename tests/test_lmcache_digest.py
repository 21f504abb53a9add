"""safeview.digest over LMCache 0.5.6's own CPU store and retrieve (issue 29, point 4).

Engine A holds one request in one layout; LMCache stores it through its real CPU code into its
own memory objects and retrieves it into engine B, which holds it in another layout, block size
and block ids. Each side digests the request through its own manifest (``safeview.describe``
of the tensors it holds); LMCache's objects are digested too, through a manifest described from
the objects' own addresses and strides. What is equal or different is decided by a byte oracle
(the request's positions, read through each holder's logical view by torch indexing, compared
with the values A wrote), never by the digest.

Two CPU paths, as LMCache 0.5.6 runs them:

- **the multiprocess server's** (``lmcache bench kvcache --mode cpu``, engine CPU
  integrations): the engine's pages moved onto POSIX shared memory
  (``migrate_to_shm_and_wrap``), the server mapping them from the wrapper's wire form, its
  layout detection and kernel groups (``normalize_and_discover_per_layer_formats``,
  ``KVLayerGroupsManager``, ``get_group_data_ptrs``: what ``CPUCacheContext`` builds), chunk
  objects from LMCache's ``TensorMemoryAllocator.batched_allocate`` in the shape
  ``CPUCacheContext.get_kernel_group_shape_dtype`` gives, filled and read by
  ``device_ops.multi_layer_block_kv_transfer`` (the pure-torch kernel). A is vLLM 0.33's
  ``LBNHC`` with 16-token blocks, B vLLM 0.33's ``LBHNC`` (HND) with 8-token blocks.
  ``CPUCacheContext`` itself and ``object_group_transfer`` import LMCache's storage
  configuration, which needs ``cryptography`` (not a CPU-path dependency, not installed
  here), so the few lines between them are written out here;
- **the in-process connector's kernel** (``device_ops.multi_layer_kv_transfer``, the one
  tests/test_lmcache.py drives, with the arguments ``VLLMPagedMemGPUConnectorV2`` passes; the
  connector object asserts CUDA): slot-wise into one ``KV_2LTD`` object. A is
  ``[2, blocks, 16 tokens, heads, head size]`` (``NL_X_TWO_NB_BS_NH_HS``), B
  ``[blocks, 2, 8 tokens, heads, head size]`` (``NL_X_NB_TWO_BS_NH_HS``). Fed vLLM 0.33's fused
  ``LBNHC`` pages (``NL_X_NB_BS_NH_CS``), this kernel reads each layer as
  ``[2, page buffer, heads x head size]`` (K plane, then V plane), not as the
  ``[blocks, tokens, heads, 2 x head size]`` its own format spec gives
  (``paged_layer_shape``), so the object does not hold the request: the digest names exactly
  the layers and heads the oracle says differ.

Faults: one byte of LMCache's stored object flipped between store and retrieve (named by layer
and head, in the object and in B), and B's blocks handed to the retrieve in another order than
B reads them (every layer named). Everything runs in a child process (this file run as a
script) so that importing LMCache (its logging, device registry, stats singletons, shared
memory) leaves the test process as it was; the digests come back on the wire
(``Digest.to_wire``) and are verified here. Install as tests/test_lmcache.py says; without
LMCache the tests skip, and with ``SAFEVIEW_REQUIRE_ENGINES=1`` (CI) a missing LMCache is a
failure.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from functools import cache
from typing import Any, NamedTuple

import pytest
import torch

import safeview
from safeview.manifest import vllm_axes
from safeview.manifest.digest import Digest

REPORT = "SAFEVIEW-LMCACHE-DIGEST "
LMCACHE_MISSING = importlib.util.find_spec("lmcache") is None
if LMCACHE_MISSING and os.environ.get("SAFEVIEW_REQUIRE_ENGINES") == "1":
    raise ImportError(
        "SAFEVIEW_REQUIRE_ENGINES=1 but LMCache is not installed "
        "(pip install --no-deps lmcache==0.5.6; see docs/process.md)"
    )

LAYERS, HEADS, HEAD_SIZE, TOKENS, CHUNK = 3, 4, 8, 48, 16
NAMES = [f"model.layers.{layer}.self_attn.attn" for layer in range(LAYERS)]
# engine A: the request's blocks, tokens a block, blocks in the cache; engine B the same
# (block 0 is vLLM's null block: in neither request)
A = ([5, 2, 7], 16, 8)
B = ([9, 1, 4, 6, 3, 8], 8, 10)
# the byte flipped in LMCache's stored object: K/V, layer, position, head, byte of K or V
FLIP = {"kv": 1, "layer": 2, "position": 21, "head": 3, "byte": 5}
LAYOUTS = {
    # name: LMCache's layout hint, safeview's axes of the tensor the engine holds
    "LBNHC": ("NHD", vllm_axes()),
    "LBHNC": ("HND", vllm_axes()),
    "NHD": ("NHD", ("kv", "block", "token", "head", "element")),
    "KV_INNER": ("NHD", ("block", "kv", "token", "head", "element")),
}
KV_ELEMENT = ("block", "token", "head", "kv|element")


# -- the child: LMCache's CPU store and retrieve between two engines -----------------------------


class Engine(NamedTuple):
    """One engine: per layer its contiguous pages (what LMCache moves onto shared memory),
    the tensor it hands a connector, and the same memory as ``[block, kv, token, head,
    element]``."""

    layout: str
    pages: list[torch.Tensor]
    caches: dict[str, torch.Tensor]
    logical: dict[str, torch.Tensor]


def _pages(layout: str, count: int, tokens: int) -> torch.Tensor:
    shape = {
        "LBNHC": (count, tokens, HEADS, 2 * HEAD_SIZE),
        "LBHNC": (count, HEADS, tokens, 2 * HEAD_SIZE),
        "NHD": (2, count, tokens, HEADS, HEAD_SIZE),
        "KV_INNER": (count, 2, tokens, HEADS, HEAD_SIZE),
    }[layout]
    return torch.empty(shape, dtype=torch.float16)


def _views(layout: str, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The tensor the engine hands a connector and the ``[block, kv, token, head, element]``
    view, both over ``pages``."""
    if layout == "LBNHC":  # vLLM 0.33: a [B, H, N, K|V] view of token-major pages
        count, tokens = pages.shape[:2]
        split = pages.view(count, tokens, HEADS, 2, HEAD_SIZE)
        return pages.permute(0, 2, 1, 3), split.permute(0, 3, 1, 2, 4)
    if layout == "LBHNC":
        count, _, tokens = pages.shape[:3]
        split = pages.view(count, HEADS, tokens, 2, HEAD_SIZE)
        return pages, split.permute(0, 3, 2, 1, 4)
    if layout == "NHD":
        return pages, pages.permute(1, 0, 2, 3, 4)
    return pages, pages


def _engine(
    layout: str,
    pages: list[torch.Tensor],
    spec: tuple[list[int], int, int],
    content: torch.Tensor | None,
    seed: int,
) -> Engine:
    """Every byte of ``pages`` random, then (unless ``content`` is None) the request's
    positions (``spec``'s blocks in token order) written with ``content`` (``[layer, kv,
    position, head, element]``) through the logical view (torch indexing, no safeview)."""
    blocks, tokens, _ = spec
    generator = torch.Generator().manual_seed(seed)
    caches, logical = {}, {}
    for layer, (name, page) in enumerate(zip(NAMES, pages)):
        noise = torch.randint(0, 256, (page.numel() * page.element_size(),), generator=generator)
        page.view(-1).view(torch.uint8).copy_(noise)
        caches[name], logical[name] = _views(layout, page)
        for at, block in enumerate(blocks):
            if content is None:
                break
            n = min(tokens, TOKENS - at * tokens)
            logical[name][block, :, :n] = content[layer, :, at * tokens : at * tokens + n]
    return Engine(layout, pages, caches, logical)


def _digest(engine: Engine, blocks: list[int]) -> Digest:
    manifest = safeview.describe(engine.caches, axes=LAYOUTS[engine.layout][1])
    return safeview.digest(manifest, engine.caches, blocks, num_tokens=TOKENS)


def _differs(
    logical: dict[str, torch.Tensor], blocks: list[int], tokens: int, content: torch.Tensor
) -> list[list[Any]]:
    """The byte oracle: the [layer, head] pairs whose request bytes in ``logical`` are not
    the values A wrote."""
    found: list[list[Any]] = []
    for layer, name in enumerate(NAMES):
        held = torch.cat(
            [
                logical[name][block, :, : min(tokens, TOKENS - at * tokens)]
                for at, block in enumerate(blocks)
            ],
            dim=1,
        )  # [kv, position, head, element]
        for head in range(HEADS):
            got = held[:, :, head].contiguous().view(torch.uint8)
            if not torch.equal(got, content[layer, :, :, head].contiguous().view(torch.uint8)):
                found.append([name, head])
    return found


def _server(pages: list[torch.Tensor], hint: str) -> tuple[Any, Any, torch.Tensor]:
    """What LMCache's multiprocess server holds for an engine's caches on CPU: the pages moved
    onto shared memory, mapped again from the wrappers' wire form, detected and grouped; its
    format, kernel group and pointers. ``migrate_to_shm_and_wrap`` re-points the very tensor
    it is handed (``set_``) with that tensor's contiguous order: handed vLLM 0.33's
    ``[B, H, N, C]`` view of token-major pages, it leaves it ``[B, N, H, C]``. So the engines
    here hand their contiguous pages and make their views over the moved pages afterwards."""
    from lmcache.utils import EngineType
    from lmcache.v1.gpu_connector.utils import (
        get_group_data_ptrs,
        normalize_and_discover_per_layer_formats,
    )
    from lmcache.v1.kv_layer_groups import KVLayerGroupsManager
    from lmcache.v1.platform.devices.cpu.shm import CpuShmTensorWrapper, migrate_to_shm_and_wrap

    wrappers = [migrate_to_shm_and_wrap(page) for page in pages]
    mapped = [CpuShmTensorWrapper.from_wire(w.to_wire()).to_tensor() for w in wrappers]
    normalized, formats = normalize_and_discover_per_layer_formats(
        mapped, [], EngineType.VLLM, {"kv_layout": hint}
    )
    manager = KVLayerGroupsManager(
        list(normalized), engine_kv_formats=formats, engine_group_infos=(),
        lmcache_tokens_per_chunk=CHUNK, separate_object_groups=False,
    )  # fmt: skip
    group = manager.kernel_groups[0]
    pointers = get_group_data_ptrs(list(normalized), formats[0], group.layer_indices)
    return formats[0], group, torch.tensor(pointers, dtype=torch.long)


def _chunk_view(objects: list[Any]) -> dict[str, torch.Tensor]:
    """LMCache's chunk objects (each ``[1, layers, CHUNK, heads x 2 x head size]``, one after
    another in its allocator's buffer) as one ``[chunks, CHUNK, heads, 2 x head size]`` view
    a layer: a chunk is a block of the manifest. The stride is read off the objects' own
    addresses."""
    first = objects[0].tensor
    starts = [o.tensor.data_ptr() - first.data_ptr() for o in objects]
    step = starts[1] // first.element_size()
    assert starts == [at * starts[1] for at in range(len(objects))], starts
    row = HEADS * 2 * HEAD_SIZE
    return {
        name: torch.as_strided(
            first,
            (len(objects), CHUNK, HEADS, 2 * HEAD_SIZE),
            (step, row, 2 * HEAD_SIZE, 1),
            first.storage_offset() + layer * CHUNK * row,
        )
        for layer, name in enumerate(NAMES)
    }


def _multiprocess(case: str, content: torch.Tensor) -> dict[str, Any]:
    """Store from A (LBNHC, 16-token blocks) and retrieve into B (LBHNC, 8-token blocks)
    through LMCache's multiprocess server's CPU path."""
    from lmcache import device_ops
    from lmcache.lmcache_native import TransferDirection
    from lmcache.v1.memory_allocators.tensor_memory_allocator import TensorMemoryAllocator

    cpu = torch.device("cpu")
    a_pages = [_pages("LBNHC", A[2], A[1]) for _ in NAMES]
    a_format, a_group, a_pointers = _server(a_pages, "NHD")
    a = _engine("LBNHC", a_pages, A, content, seed=2)  # views made over the moved pages
    sent = _digest(a, A[0])

    allocator = TensorMemoryAllocator(torch.zeros(1 << 20, dtype=torch.uint8))
    desc = a_group.shape_desc
    shape = torch.Size((desc.kv_size, a_group.num_layers, CHUNK, a_group.hidden_dim_size))
    objects = allocator.batched_allocate(shape, a_group.dtype, TOKENS // CHUNK)
    pointers = [o.tensor.data_ptr() for o in objects]
    device_ops.multi_layer_block_kv_transfer(
        a_pointers, pointers, torch.tensor(A[0]), cpu, TransferDirection.D2H, desc, CHUNK,
        a_format, 0,
    )  # fmt: skip
    if case == "flipped":
        chunk, token = divmod(FLIP["position"], CHUNK)
        row = objects[chunk].tensor[0, FLIP["layer"], token].view(torch.uint8)
        row[(FLIP["head"] * 2 + FLIP["kv"]) * HEAD_SIZE * 2 + FLIP["byte"]] ^= 0x10
    chunks = _chunk_view(objects)
    blocks = list(range(len(objects)))
    manifest = safeview.describe(chunks, axes=KV_ELEMENT)
    stored = safeview.digest(manifest, chunks, blocks, num_tokens=TOKENS)
    split = {
        n: v.view(*v.shape[:3], 2, HEAD_SIZE).permute(0, 3, 1, 2, 4) for n, v in chunks.items()
    }

    b_pages = [_pages("LBHNC", B[2], B[1]) for _ in NAMES]
    b_format, b_group, b_pointers = _server(b_pages, "HND")
    b = _engine("LBHNC", b_pages, B, None, seed=3)
    written = B[0][1::-1] + B[0][2:] if case == "wrong_blocks" else B[0]
    device_ops.multi_layer_block_kv_transfer(
        b_pointers, pointers, torch.tensor(written), cpu, TransferDirection.H2D,
        b_group.shape_desc, CHUNK, b_format, 0,
    )  # fmt: skip
    allocator.batched_free(objects)
    return {
        "formats": [a_format.name, b_format.name],
        "block_sizes": [desc.bs, b_group.shape_desc.bs],
        "sent": sent.to_wire().hex(),
        "object": stored.to_wire().hex(),
        "received": _digest(b, B[0]).to_wire().hex(),
        "object_oracle": _differs(split, blocks, CHUNK, content),
        "received_oracle": _differs(b.logical, B[0], B[1], content),
    }


def _connector_kernel(case: str, content: torch.Tensor) -> dict[str, Any]:
    """Store from A into one ``KV_2LTD`` object and retrieve into B through the kernel of
    LMCache's in-process connector, with the arguments its ``from_gpu``/``to_gpu`` pass."""
    from lmcache import device_ops
    from lmcache.lmcache_native import TransferDirection
    from lmcache.utils import EngineType
    from lmcache.v1.gpu_connector.utils import (
        get_block_size,
        get_head_size,
        get_num_blocks,
        normalize_kv_and_discover_format,
    )
    from lmcache.v1.memory_allocators.tensor_memory_allocator import TensorMemoryAllocator
    from lmcache.v1.memory_management import MemoryFormat

    def transfer(engine: Engine, spec: list[int], tokens: int, direction: Any) -> str:
        hint = {"kv_layout": LAYOUTS[engine.layout][0]}
        engine_format, kv = normalize_kv_and_discover_format(
            list(engine.caches.values()), EngineType.VLLM, layout_hints=hint
        )
        pointers = torch.tensor([t.data_ptr() for t in kv], dtype=torch.int64)
        slots = torch.tensor([spec[p // tokens] * tokens + p % tokens for p in range(TOKENS)])
        count, size = get_num_blocks(kv, engine_format), get_block_size(kv, engine_format)
        device_ops.multi_layer_kv_transfer(
            stored.tensor, pointers, slots, torch.device("cpu"), count * size, direction,
            engine_format, block_size=size, head_size=get_head_size(kv, engine_format),
        )  # fmt: skip
        return str(engine_format.name)

    a_layout = "LBNHC" if case == "fused" else "NHD"
    a = _engine(a_layout, [_pages(a_layout, A[2], A[1]) for _ in NAMES], A, content, seed=2)
    allocator = TensorMemoryAllocator(torch.zeros(1 << 20, dtype=torch.uint8))
    shape = torch.Size([2, LAYERS, TOKENS, HEADS * HEAD_SIZE])
    stored = allocator.allocate(shape, torch.float16, MemoryFormat.KV_2LTD)
    a_format = transfer(a, A[0], A[1], TransferDirection.D2H)
    # the object, per layer: [2, 1 block of TOKENS, heads, head size], K/V a plane over all
    # layers (safeview.manifest.assumed has no format for a K/V axis outside the layers)
    objects = {
        name: stored.tensor[:, layer].view(2, 1, TOKENS, HEADS, HEAD_SIZE)
        for layer, name in enumerate(NAMES)
    }
    manifest = safeview.describe(objects, axes=LAYOUTS["NHD"][1])
    object_digest = safeview.digest(manifest, objects, [0], num_tokens=TOKENS)
    split = {n: v.permute(1, 0, 2, 3, 4) for n, v in objects.items()}
    # what the kernel read instead: each of A's layers as [2, page buffer, heads x head
    # size] (K plane, V plane), at the request's slots
    slots = torch.tensor([A[0][p // A[1]] * A[1] + p % A[1] for p in range(TOKENS)])
    planes = torch.stack(
        [page.reshape(2, A[2] * A[1], HEADS * HEAD_SIZE)[:, slots] for page in a.pages], dim=1
    )
    as_planes = torch.equal(planes.view(torch.uint8), stored.tensor.view(torch.uint8))
    b = _engine("KV_INNER", [_pages("KV_INNER", B[2], B[1]) for _ in NAMES], B, None, seed=3)
    b_format = transfer(b, B[0], B[1], TransferDirection.H2D)
    stored.ref_count_down()  # back to LMCache's allocator
    return {
        "formats": [a_format, b_format],
        "as_planes": as_planes,
        "sent": _digest(a, A[0]).to_wire().hex(),
        "object": object_digest.to_wire().hex(),
        "received": _digest(b, B[0]).to_wire().hex(),
        "object_oracle": _differs(split, [0], TOKENS, content),
        "received_oracle": _differs(b.logical, B[0], B[1], content),
    }


def _child(case: str) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(1)
    shape = (LAYERS, 2, TOKENS, HEADS, 2 * HEAD_SIZE)  # [layer, kv, position, head, bytes]
    content = torch.randint(0, 256, shape, generator=generator).to(torch.uint8)
    path, _, fault = case.partition(":")
    run = _multiprocess if path == "multiprocess" else _connector_kernel
    return run(fault, content.view(torch.float16))


# -- the tests ------------------------------------------------------------------------------------

pytestmark = pytest.mark.skipif(LMCACHE_MISSING, reason="LMCache is not installed")


@cache
def _run(case: str) -> dict[str, Any]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("SAFEVIEW_")}
    result = subprocess.run(
        [sys.executable, __file__, case], env=environment, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    lines = [line for line in result.stdout.splitlines() if line.startswith(REPORT)]
    assert result.returncode == 0, result.stdout + result.stderr
    assert lines, result.stdout + result.stderr
    found: dict[str, Any] = json.loads(lines[-1][len(REPORT) :])
    return found


def _digests(report: dict[str, Any]) -> tuple[Digest, Digest, Digest]:
    sent, stored, received = (
        Digest.from_wire(bytes.fromhex(report[side]), peer=side)
        for side in ("sent", "object", "received")
    )
    return sent, stored, received


def _named(findings: list[Any]) -> list[list[Any]]:
    return [[f.layer, head] for f in findings for head in f.heads]


@pytest.mark.parametrize(
    ("case", "formats"),
    [
        ("multiprocess:clean", ["NL_X_NB_BS_NH_CS", "NL_X_NB_NH_BS_CS"]),
        ("connector:clean", ["NL_X_TWO_NB_BS_NH_HS", "NL_X_NB_TWO_BS_NH_HS"]),
    ],
)
def test_a_clean_store_and_retrieve_digests_alike_in_three_layouts(
    case: str, formats: list[str]
) -> None:
    report = _run(case)
    assert report["formats"] == formats
    assert report["object_oracle"] == report["received_oracle"] == []  # every byte arrived
    sent, stored, received = _digests(report)
    assert safeview.verify(sent, stored) == []
    assert safeview.verify(sent, received) == []
    assert sent.values == stored.values == received.values
    assert list(sent.values) == NAMES
    assert all(sorted(heads) == list(range(HEADS)) for heads in sent.values.values())


def test_the_multiprocess_path_moves_between_block_sizes() -> None:
    assert _run("multiprocess:clean")["block_sizes"] == [A[1], B[1]]


def test_one_byte_flipped_in_lmcache_s_object_is_named_by_layer_and_head() -> None:
    report = _run("multiprocess:flipped")
    where = [[NAMES[FLIP["layer"]], FLIP["head"]]]
    # the oracle: that byte is the only one that differs, in the object and then in B
    assert report["object_oracle"] == report["received_oracle"] == where
    sent, stored, received = _digests(report)
    for side in (stored, received):
        findings = safeview.verify(sent, side)
        assert [f.kind for f in findings] == ["digest"]
        assert _named(findings) == where
        assert f"head {FLIP['head']}" in findings[0].message


def test_a_retrieve_into_blocks_in_another_order_names_every_layer() -> None:
    report = _run("multiprocess:wrong_blocks")
    assert report["object_oracle"] == []  # the store was right
    oracle = report["received_oracle"]
    assert {name for name, _ in oracle} == set(NAMES)
    sent, stored, received = _digests(report)
    assert safeview.verify(sent, stored) == []
    findings = safeview.verify(sent, received)
    assert {f.kind for f in findings} == {"digest"}
    assert _named(findings) == oracle


def test_vllm_0_33_fused_pages_through_the_connector_kernel_are_caught() -> None:
    # the kernel reads NL_X_NB_BS_NH_CS as K plane then V plane: what it stores is not the
    # request; the oracle says which (layer, head) differ, the digest names the same
    report = _run("connector:fused")
    assert report["formats"] == ["NL_X_NB_BS_NH_CS", "NL_X_NB_TWO_BS_NH_HS"]
    # the object is A's layers read as two planes: the reading that is right for a TWO-major
    # layer (the clean case), applied to fused pages
    assert report["as_planes"] is True
    assert _run("connector:clean")["as_planes"] is True
    sent, stored, received = _digests(report)
    for oracle, side in ((report["object_oracle"], stored), (report["received_oracle"], received)):
        assert {name for name, _ in oracle} == set(NAMES)
        assert _named(safeview.verify(sent, side)) == oracle


if __name__ == "__main__":
    print(REPORT + json.dumps(_child(sys.argv[1])), flush=True)
