"""Real KV caches from vLLM 0.33's own planner and allocator, and its real offloading worker.

This module drives vLLM's own code, not a copy of it:

- ``build(case, device, **fault)`` plans a KV cache with
  ``vllm.v1.core.kv_cache_planning.get_kv_cache_groups`` and ``get_kv_cache_config_from_groups``
  (``num_blocks`` forced through ``cache_config.num_gpu_blocks_override``), or takes the
  hand-built ``KVCacheConfig`` of vLLM's own unit test, and allocates it with
  ``vllm.v1.worker.utils.allocate_kv_cache(kv_cache_config, device, layout, kernel_block_sizes)``:
  ``kv_caches`` is exactly the dict the model runner hands to ``register_kv_caches``.
- ``run_real_worker(built)`` runs ``OffloadingConnectorWorker.register_kv_caches``
  (``vllm/distributed/kv_transfer/kv_connector/v1/offloading/worker.py``) through its real
  constructor; only the ``OffloadingSpec`` it is given is a stub (it records what the worker hands
  to ``spec.get_worker``). The worker keeps its per-layer int8 views in a local variable,
  ``tensors_per_block``; they are read from the worker's own frame when the method returns.
- ``run_via_connector(built)`` reaches the same worker the way a vLLM worker process does:
  ``ensure_kv_transfer_initialized`` -> ``KVConnectorFactory.create_connector`` (looked up at call
  time, so a plugin that wraps it is honoured) -> ``get_kv_transfer_group().register_kv_caches``.
  The connector is :class:`HarnessOffloadingConnector`, vLLM's ``OffloadingConnector`` with only
  its constructor simplified.

Only ``vllm_config`` is stubbed (``VllmConfig()`` cannot be built without a device): a
namespace holding vLLM's real ``CacheConfig``, ``SchedulerConfig``, ``AttentionConfig`` and
``ParallelConfig``, a ``model_config`` that only answers ``get_total_num_kv_heads()``, and
``kv_transfer_config`` (vLLM's real ``KVTransferConfig``) for the connector path.

Importable only where vLLM is installed; elsewhere (pytest collecting ``tests/`` with
``--doctest-modules`` in a virtualenv without vLLM) the module is skipped at import.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import traceback
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from torch.utils._python_dispatch import TorchDispatchMode

try:
    import vllm  # type: ignore[import-not-found,unused-ignore]
except ImportError:  # pragma: no cover - only where vLLM is not installed
    import pytest  # type: ignore[import-not-found,unused-ignore]

    pytest.skip("vllm is not installed in this environment", allow_module_level=True)

from vllm.config import (  # type: ignore[import-not-found,unused-ignore]
    AttentionConfig,
    CacheConfig,
    ParallelConfig,
    SchedulerConfig,
)
from vllm.config.kv_transfer import (  # type: ignore[import-not-found,unused-ignore]
    KVTransferConfig,
)
from vllm.distributed.kv_transfer import (  # type: ignore[import-not-found,unused-ignore]
    kv_transfer_state,
)
from vllm.distributed.kv_transfer.kv_connector.v1 import (  # type: ignore[import-not-found,unused-ignore]
    KVConnectorBase_V1,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (  # type: ignore[import-not-found,unused-ignore]
    get_offloading_group_ids,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (  # type: ignore[import-not-found,unused-ignore]
    OffloadingConnectorWorker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (  # type: ignore[import-not-found,unused-ignore]
    OffloadingConnector,
)
from vllm.v1.attention.backends.utils import (  # type: ignore[import-not-found,unused-ignore]
    record_kv_cache_layout,
)
from vllm.v1.core.kv_cache_planning import (  # type: ignore[import-not-found,unused-ignore]
    get_kv_cache_config_from_groups,
    get_kv_cache_groups,
)
from vllm.v1.kv_cache_interface import (  # type: ignore[import-not-found,unused-ignore]
    AttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    KVQuantMode,
    MambaSpec,
    MLAAttentionSpec,
    SparseCacheRole,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.kv_cache_layout import (  # type: ignore[import-not-found,unused-ignore]
    KVCacheLayout,
)
from vllm.v1.worker.utils import allocate_kv_cache  # type: ignore[import-not-found,unused-ignore]

VLLM_VERSION: str = str(vllm.__version__)

#: The cases ``build`` knows, in the order the self-check runs them.
CASES: tuple[str, ...] = (
    "full_attention_lbnhc",
    "full_attention_blhnc",
    "kernel_block_8",
    "mla_indexer_packed",
    "glm_packed",
    "attention_mamba",
    "two_page_sizes",
    "vllm_test_worker",
    "vllm_test_worker_uniform",
)

#: Keyword arguments of ``build`` that inject a fault (each ``True`` or ``False``).
FAULTS: tuple[str, ...] = (
    "worker_page_too_big",
    "num_blocks_plus_one",
    "kernel_stride_as_manager",
    "alias_two_layers",
    "element_major",
)

# vLLM's own offloading worker test (tests/v1/kv_connector/unit/offloading_connector/
# test_worker.py): fp16, 16 tokens per block, 4 KV heads, head size 64, 10 blocks.
_T_BLOCK_SIZE = 16
_T_NUM_KV_HEADS = 4
_T_HEAD_SIZE = 64
_T_DTYPE = torch.float16
_T_NUM_BLOCKS = 10
_T_PAGE = 2 * _T_BLOCK_SIZE * _T_NUM_KV_HEADS * _T_HEAD_SIZE * 2  # 16,384 bytes

# DeepSeek-V3.2: 61 layers, 64 tokens per block, fp8_ds_mla MLA 656 B/token (page 41,984),
# indexer 128 + 128 // 128 * 4 = 132 B/token (page 8,448).
_DSV32_LAYERS = 61
_DSV32_BLOCK_SIZE = 64

_WORKER_FILE_SUFFIX = os.path.join(
    "kv_connector", "v1", "offloading", "worker.py"
)  # the frame whose locals hold tensors_per_block


# --------------------------------------------------------------------------------------------
# Built caches
# --------------------------------------------------------------------------------------------


@dataclass
class Built:
    """A KV cache planned and allocated by vLLM, plus what its worker needs to register it."""

    case: str
    device: str
    #: layer name -> cache tensor, exactly what the model runner hands to register_kv_caches
    #: (faults ``kernel_stride_as_manager`` and ``alias_two_layers`` change this dict).
    kv_caches: dict[str, torch.Tensor]
    #: the KVCacheConfig the caches were allocated from (vLLM's planner, or vLLM's test's)
    kv_cache_config: Any
    #: the KVCacheConfig the worker is given: ``kv_cache_config`` unless a fault changed it
    worker_kv_cache_config: Any
    #: num_blocks the caches were allocated with
    num_blocks: int
    #: the layout the planner and the allocator used (vllm.v1.kv_cache_interface.KVCacheLayout)
    layout: Any
    #: kernel block size per KV cache group, as passed to allocate_kv_cache
    kernel_block_sizes: list[int]
    #: the stubbed VllmConfig (a namespace of vLLM's real sub-configs)
    vllm_config: Any
    #: the fault injected, if any
    fault: str | None = None
    #: nbytes of the single backing allocation (torch.zeros(size, int8)) right after allocation
    storage_nbytes: int = 0
    #: its data_ptr right after allocation (0 on meta)
    storage_data_ptr: int = 0
    #: what the fault changed, in words
    fault_note: str = ""

    @property
    def storage(self) -> torch.UntypedStorage:
        """The backing storage shared by every layer."""
        return next(iter(self.kv_caches.values())).untyped_storage()


def stub_vllm_config(
    layout: str,
    *,
    num_gpu_blocks_override: int | None = None,
    total_kv_heads: int = _T_NUM_KV_HEADS,
    kv_transfer_config: Any = None,
) -> types.SimpleNamespace:
    """The few VllmConfig fields the planner, the allocator and the offloading worker read.

    Real vLLM configs for ``cache_config`` (its layout recorded with vLLM's own
    ``record_kv_cache_layout``, as a worker adopts the engine core's), ``scheduler_config``
    (``SchedulerConfig.default_factory()``; ``disable_hybrid_kv_cache_manager`` stays ``None``,
    which the planner and the factory read as "hybrid manager on"), ``attention_config`` and
    ``parallel_config`` (world size 1, rank 0). ``model_config`` only answers
    ``get_total_num_kv_heads()`` (read by the worker's ``derive_canonical_mappings``).
    """
    cache_config = CacheConfig(num_gpu_blocks_override=num_gpu_blocks_override)
    record_kv_cache_layout(cache_config, layout)
    return types.SimpleNamespace(
        cache_config=cache_config,
        scheduler_config=SchedulerConfig.default_factory(),  # type: ignore[no-untyped-call,unused-ignore]
        attention_config=AttentionConfig(),
        parallel_config=ParallelConfig(),
        model_config=types.SimpleNamespace(get_total_num_kv_heads=lambda: total_kv_heads),
        kv_transfer_config=kv_transfer_config,
    )


def _attn_spec(num_kv_heads: int = _T_NUM_KV_HEADS) -> Any:
    return FullAttentionSpec(
        block_size=_T_BLOCK_SIZE,
        num_kv_heads=num_kv_heads,
        head_size=_T_HEAD_SIZE,
        dtype=_T_DTYPE,
    )


def _planned(
    specs: Mapping[str, Any], layout: str, num_blocks: int, total_kv_heads: int
) -> tuple[Any, Any]:
    """vLLM's planner: groups, then the KVCacheConfig with num_blocks forced by the override."""
    vllm_config: Any = stub_vllm_config(
        layout, num_gpu_blocks_override=num_blocks, total_kv_heads=total_kv_heads
    )
    groups = get_kv_cache_groups(vllm_config, dict(specs))
    # available_memory is irrelevant: num_gpu_blocks_override replaces the computed count.
    config = get_kv_cache_config_from_groups(vllm_config, groups, 0)
    # What EngineCore does right after planning (vllm/v1/engine/core.py).
    config.kv_cache_layout = vllm_config.cache_config.kv_cache_layout
    return vllm_config, config


def _glm_specs() -> dict[str, Any]:
    """GLM-5.2-FP8 on one rank: 79 MLA layers (576 B/token, fp8) and 22 indexers (132 B/token),
    64 tokens a block, in one packed group: pages of 36,864 and 8,448, block stride 3,098,112."""
    mla = MLAAttentionSpec(
        block_size=64,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=576,
        dtype=torch.uint8,
        is_index_group_leader=True,
    )
    indexer = MLAAttentionSpec(
        block_size=64,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=132,
        dtype=torch.uint8,
        cache_role=SparseCacheRole.INDEXER,
    )
    specs: dict[str, Any] = {}
    for i in range(79):
        specs[f"model.layers.{i}.self_attn.attn"] = mla
        if i < 22:
            specs[f"model.layers.{i}.self_attn.indexer.k_cache"] = indexer
    return specs


def _dsv32_specs() -> dict[str, Any]:
    mla = MLAAttentionSpec(
        block_size=_DSV32_BLOCK_SIZE,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=576,
        dtype=torch.uint8,
        cache_dtype_str="fp8_ds_mla",
        kv_quant_mode=KVQuantMode.FP8_PER_TENSOR,
        state_content_bytes=656,
        is_index_group_leader=True,
    )
    indexer = MLAAttentionSpec(
        block_size=_DSV32_BLOCK_SIZE,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=132,
        dtype=torch.uint8,
        cache_role=SparseCacheRole.INDEXER,
    )
    specs: dict[str, Any] = {}
    for i in range(_DSV32_LAYERS):
        specs[f"model.layers.{i}.self_attn.attn"] = mla
        specs[f"model.layers.{i}.self_attn.indexer.k_cache"] = indexer
    return specs


def _mamba_spec(ssm_rows: int) -> Any:
    """Mamba state of 8,192 + ssm_rows * 128 bytes, padded to the attention page (16,384)."""
    return MambaSpec(
        block_size=_T_BLOCK_SIZE,
        shapes=((_T_BLOCK_SIZE * _T_NUM_KV_HEADS, _T_HEAD_SIZE), (ssm_rows, _T_HEAD_SIZE)),
        dtypes=(_T_DTYPE, _T_DTYPE),
        page_size_padded=_T_PAGE,
    )


def _vllm_test_worker_config() -> Any:
    """The hand-built KVCacheConfig of vLLM's test_register_kv_caches, verbatim.

    Four groups (3 full attention, 3 MLA, 3 Mamba padded 16,256 -> 16,384, 2 Mamba filling the
    page), one KVCacheTensor per group, all at offset 0 of one 491,520-byte buffer: layer i of
    every group aliases the same bytes.
    """
    mla = MLAAttentionSpec(
        block_size=_T_BLOCK_SIZE,
        num_kv_heads=1,
        head_size=_T_NUM_KV_HEADS * _T_HEAD_SIZE * 2,
        dtype=_T_DTYPE,
    )
    group_size = 3
    names: list[list[str]] = []
    index = 0
    for count, suffix in (
        (group_size, "self_attn"),
        (group_size, "self_attn"),
        (group_size, "mamba_unpadded"),
        (group_size - 1, "mamba_padded"),
    ):
        names.append([f"model.layers.{index + k}.{suffix}" for k in range(count)])
        index += count
    specs = [_attn_spec(), mla, _mamba_spec(_T_BLOCK_SIZE * _T_NUM_KV_HEADS - 1)]
    specs.append(_mamba_spec(_T_BLOCK_SIZE * _T_NUM_KV_HEADS))
    return KVCacheConfig(
        num_blocks=_T_NUM_BLOCKS,
        kv_cache_tensors=[
            KVCacheTensor(
                size=_T_PAGE * _T_NUM_BLOCKS * group_size,
                layers=layer_names,
                layer_stride=_T_PAGE * _T_NUM_BLOCKS,
                block_stride=_T_PAGE,
            )
            for layer_names in names
        ],
        kv_cache_groups=[
            KVCacheGroupSpec(layer_names=layer_names, kv_cache_spec=spec)
            for layer_names, spec in zip(names, specs)
        ],
    )


def _vllm_test_worker_uniform_config() -> Any:
    """The hand-built KVCacheConfig of vLLM's test_register_kv_caches_uniform_type, verbatim."""
    layer_a = "model.layers.0.self_attn"
    layer_b = "model.layers.1.self_attn"
    spec_a = _attn_spec(_T_NUM_KV_HEADS)
    spec_b = _attn_spec(_T_NUM_KV_HEADS * 2)
    window = spec_a.page_size_bytes + spec_b.page_size_bytes
    return KVCacheConfig(
        num_blocks=_T_NUM_BLOCKS,
        kv_cache_tensors=[
            KVCacheTensor(
                size=window * _T_NUM_BLOCKS,
                layers=[layer_a],
                layer_stride=spec_a.page_size_bytes * _T_NUM_BLOCKS,
                block_stride=spec_a.page_size_bytes,
            ),
            KVCacheTensor(
                size=window * _T_NUM_BLOCKS,
                layers=[layer_b],
                layer_stride=spec_b.page_size_bytes * _T_NUM_BLOCKS,
                block_stride=spec_b.page_size_bytes,
                offset=spec_a.page_size_bytes * _T_NUM_BLOCKS,
            ),
        ],
        kv_cache_groups=[
            KVCacheGroupSpec(
                layer_names=[layer_a, layer_b],
                kv_cache_spec=UniformTypeKVCacheSpecs(
                    block_size=_T_BLOCK_SIZE,
                    kv_cache_specs={layer_a: spec_a, layer_b: spec_b},
                ),
            )
        ],
    )


def default_num_blocks(case: str, device: str) -> int:
    """Blocks per case: small on cpu (at most ~6 MB), realistic on meta where that is free."""
    if case == "glm_packed":
        # cpu: 2 x 3,098,112 = 6.2 MB; meta: 42,072 blocks, 130,343,768,064 bytes (FACTS.md).
        return 2 if device != "meta" else 42_072
    if case == "mla_indexer_packed":
        # cpu: 2 x 3,076,352 = 6.2 MB; meta: the 42,072 blocks of a real GLM-5.2 report.
        return 2 if device != "meta" else 42_072
    if case == "kernel_block_8":
        return 8
    if case in ("attention_mamba", "two_page_sizes"):
        return 8 if device != "meta" else 100_000
    return _T_NUM_BLOCKS  # 10, the numbers of vLLM's own test and of FACTS.md


def _plan_case(case: str, num_blocks: int) -> tuple[Any, Any, str, list[int]]:
    """(vllm_config, kv_cache_config, layout name, kernel block sizes) for a case."""
    if case in ("full_attention_lbnhc", "full_attention_blhnc", "full_attention_lhbnc"):
        layout = case.rsplit("_", 1)[1].upper()
        specs = {f"model.layers.{i}.self_attn.attn": _attn_spec() for i in range(3)}
        vllm_config, config = _planned(specs, layout, num_blocks, _T_NUM_KV_HEADS)
        return vllm_config, config, layout, [_T_BLOCK_SIZE]
    if case == "kernel_block_8":
        specs = {f"model.layers.{i}.self_attn.attn": _attn_spec() for i in range(3)}
        vllm_config, config = _planned(specs, "LBNHC", num_blocks, _T_NUM_KV_HEADS)
        return vllm_config, config, "LBNHC", [8]
    if case == "mla_indexer_packed":
        vllm_config, config = _planned(_dsv32_specs(), "BLHNC", num_blocks, 1)
        return vllm_config, config, "BLHNC", [_DSV32_BLOCK_SIZE] * len(config.kv_cache_groups)
    if case == "glm_packed":
        vllm_config, config = _planned(_glm_specs(), "BLHNC", num_blocks, 1)
        return vllm_config, config, "BLHNC", [64] * len(config.kv_cache_groups)
    if case == "attention_mamba":
        specs = {
            "model.layers.0.self_attn.attn": _attn_spec(),
            "model.layers.1.mixer": _mamba_spec(_T_BLOCK_SIZE * _T_NUM_KV_HEADS - 1),
            "model.layers.2.self_attn.attn": _attn_spec(),
            "model.layers.3.mixer": _mamba_spec(_T_BLOCK_SIZE * _T_NUM_KV_HEADS - 1),
        }
        vllm_config, config = _planned(specs, "LBNHC", num_blocks, _T_NUM_KV_HEADS)
        return vllm_config, config, "LBNHC", [_T_BLOCK_SIZE] * len(config.kv_cache_groups)
    if case == "two_page_sizes":
        specs = {
            "model.layers.0.self_attn.attn": _attn_spec(_T_NUM_KV_HEADS),
            "model.layers.1.self_attn.attn": _attn_spec(_T_NUM_KV_HEADS * 2),
        }
        vllm_config, config = _planned(specs, "LBNHC", num_blocks, _T_NUM_KV_HEADS)
        return vllm_config, config, "LBNHC", [_T_BLOCK_SIZE] * len(config.kv_cache_groups)
    if case == "mla":  # not in CASES: the canonical_layout tests build it
        spec = MLAAttentionSpec(
            block_size=_T_BLOCK_SIZE, num_kv_heads=1, head_size=_T_HEAD_SIZE, dtype=_T_DTYPE
        )
        specs = {f"model.layers.{i}.self_attn.attn": spec for i in range(2)}
        vllm_config, config = _planned(specs, "LBNHC", num_blocks, 1)
        return vllm_config, config, "LBNHC", [_T_BLOCK_SIZE]
    if case in ("vllm_test_worker", "vllm_test_worker_uniform"):
        if num_blocks != _T_NUM_BLOCKS:
            raise ValueError(f"{case} is vLLM's own test layout: {_T_NUM_BLOCKS} blocks only")
        config = (
            _vllm_test_worker_config()
            if case == "vllm_test_worker"
            else _vllm_test_worker_uniform_config()
        )
        vllm_config = stub_vllm_config("LBNHC", total_kv_heads=_T_NUM_KV_HEADS)
        # vLLM's test allocates with KVCacheLayout.LBNHC and [BLOCK_SIZE] * len(groups).
        return vllm_config, config, "LBNHC", [_T_BLOCK_SIZE] * len(config.kv_cache_groups)
    raise ValueError(f"unknown case {case!r}; known: {', '.join(CASES)}")


def _double_kv_heads(spec: Any) -> Any:
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return UniformTypeKVCacheSpecs(
            block_size=spec.block_size,
            kv_cache_specs={n: _double_kv_heads(s) for n, s in spec.kv_cache_specs.items()},
        )
    if isinstance(spec, AttentionSpec):
        return dataclasses.replace(spec, num_kv_heads=spec.num_kv_heads * 2)
    return spec


def build(case: str, device: str = "cpu", *, num_blocks: int | None = None, **fault: bool) -> Built:
    """Plan and allocate ``case`` with vLLM's own code on ``device`` ("cpu", "meta", "cuda").

    At most one fault keyword may be true:

    - ``worker_page_too_big``: the worker's KVCacheConfig says twice the KV heads of every
      attention spec (8 instead of 4); the caches were allocated for the real spec.
    - ``num_blocks_plus_one``: the worker's KVCacheConfig says one block more than allocated.
    - ``kernel_stride_as_manager``: every layer's kernel-block cache ``(2 * num_blocks, ...)`` is
      cut to its first ``num_blocks`` kernel blocks, so ``stride(0)`` is a kernel block where a
      manager block is expected (only for cases with kernel blocks, i.e. ``kernel_block_8``).
    - ``alias_two_layers``: the second layer of the first group with two layers or more is
      handed the first layer's cache tensor (two layers of one group on the same bytes).
    - ``element_major``: every 4-d cache ``[B, H, N, C]`` is handed as the same bytes read
      element-major within each block (``C`` the outer, ``N`` the inner axis: strides
      ``(H*N*C, N*C, 1, N)`` for one head): a kernel that stores its pages that way. Shape,
      storage and offset are unchanged.
    """
    unknown = set(fault) - set(FAULTS)
    if unknown:
        raise TypeError(f"unknown fault(s) {sorted(unknown)}; known: {', '.join(FAULTS)}")
    chosen = [name for name, on in fault.items() if on]
    if len(chosen) > 1:
        raise ValueError(f"one fault at a time, got {chosen}")
    fault_name = chosen[0] if chosen else None

    blocks = default_num_blocks(case, device) if num_blocks is None else num_blocks
    vllm_config, config, layout_name, kernel_block_sizes = _plan_case(case, blocks)
    layout = KVCacheLayout[layout_name]
    kv_caches: dict[str, torch.Tensor] = allocate_kv_cache(
        config, torch.device(device), layout, kernel_block_sizes
    )
    storage = next(iter(kv_caches.values())).untyped_storage()
    built = Built(
        case=case,
        device=device,
        kv_caches=kv_caches,
        kv_cache_config=config,
        worker_kv_cache_config=config,
        num_blocks=config.num_blocks,
        layout=layout,
        kernel_block_sizes=kernel_block_sizes,
        vllm_config=vllm_config,
        fault=fault_name,
        storage_nbytes=storage.nbytes(),
        storage_data_ptr=storage.data_ptr(),
    )
    if fault_name is not None:
        _inject(built, fault_name)
    return built


def _inject(built: Built, fault_name: str) -> None:
    config = built.kv_cache_config
    if fault_name == "worker_page_too_big":
        groups = [
            dataclasses.replace(g, kv_cache_spec=_double_kv_heads(g.kv_cache_spec))
            for g in config.kv_cache_groups
        ]
        built.worker_kv_cache_config = dataclasses.replace(config, kv_cache_groups=groups)
        built.fault_note = "worker spec: num_kv_heads x 2 for every AttentionSpec"
    elif fault_name == "element_major":
        for name, cache in list(built.kv_caches.items()):
            _, heads, tokens, row = cache.shape
            built.kv_caches[name] = cache.as_strided(
                cache.shape, (heads * tokens * row, tokens * row, 1, tokens)
            )
        built.fault_note = "every cache read element-major within its block"
    elif fault_name == "num_blocks_plus_one":
        built.worker_kv_cache_config = dataclasses.replace(config, num_blocks=config.num_blocks + 1)
        built.fault_note = (
            f"worker num_blocks {config.num_blocks + 1}, allocated {config.num_blocks}"
        )
    elif fault_name == "kernel_stride_as_manager":
        if all(
            k >= g.kv_cache_spec.block_size
            for k, g in zip(built.kernel_block_sizes, config.kv_cache_groups)
        ):
            raise ValueError(f"{built.case} has no kernel blocks; use kernel_block_8")
        before = next(iter(built.kv_caches.values())).shape
        built.kv_caches = {n: t[: config.num_blocks] for n, t in built.kv_caches.items()}
        after = next(iter(built.kv_caches.values())).shape
        built.fault_note = f"caches cut {tuple(before)} -> {tuple(after)}"
    elif fault_name == "alias_two_layers":
        group = next(g for g in config.kv_cache_groups if len(g.layer_names) >= 2)
        first, second = group.layer_names[0], group.layer_names[1]
        built.kv_caches = dict(built.kv_caches)
        built.kv_caches[second] = built.kv_caches[first]
        built.fault_note = f"{second} handed {first}'s tensor"
    else:  # pragma: no cover - checked in build
        raise AssertionError(fault_name)


# --------------------------------------------------------------------------------------------
# Running the real worker
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OpRecord:
    """One ``aten.set_`` (4-argument) or ``aten.as_strided`` call seen during registration."""

    op: str
    device: str
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    itemsize: int
    storage_nbytes_before: int
    storage_nbytes_after: int

    @property
    def extent_bytes(self) -> int:
        """Exclusive end in bytes (torch's own formula); the offset alone when a size is 0."""
        if any(n == 0 for n in self.size):
            return self.storage_offset * self.itemsize
        last = self.storage_offset + sum((n - 1) * s for n, s in zip(self.size, self.stride))
        return (last + 1) * self.itemsize


class _OpRecorder(TorchDispatchMode):  # type: ignore[no-untyped-call,unused-ignore]
    """Records the view-making ops of the worker; changes nothing."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call,unused-ignore]
        self.ops: list[OpRecord] = []

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten.set_.source_Storage_storage_offset:
            storage = args[1]
            before = storage.nbytes()
            out = func(*args, **kwargs)
            self.ops.append(
                OpRecord(
                    "set_",
                    str(args[0].device),
                    tuple(int(n) for n in args[3]),
                    tuple(int(s) for s in args[4]),
                    int(args[2]),
                    args[0].element_size(),
                    before,
                    storage.nbytes(),
                )
            )
            return out
        if func is torch.ops.aten.as_strided.default:
            base = args[0]
            offset = args[3] if len(args) > 3 else kwargs.get("storage_offset")
            nbytes = base.untyped_storage().nbytes()
            out = func(*args, **kwargs)
            self.ops.append(
                OpRecord(
                    "as_strided",
                    str(base.device),
                    tuple(int(n) for n in args[1]),
                    tuple(int(s) for s in args[2]),
                    base.storage_offset() if offset is None else int(offset),
                    base.element_size(),
                    nbytes,
                    base.untyped_storage().nbytes(),
                )
            )
            return out
        return func(*args, **kwargs)


class _NullOffloadingWorker:
    """Stands in for the OffloadingWorker the spec would build (transfers are not run)."""

    def shutdown(self) -> None:
        return None


#: CanonicalKVCaches received by any RecordingSpec during the current run (also on the
#: connector path, where the spec is created inside the connector); emptied after each run
RECEIVED: list[Any] = []


class RecordingSpec:
    """A stand-in ``OffloadingSpec``: just the attributes the worker reads.

    ``OffloadingConnectorWorker.__init__`` reads ``spec.replicated_layout``,
    ``spec.config.canonical_layout`` and ``spec.config.parallel.rank``; ``register_kv_caches``
    calls ``spec.get_worker(CanonicalKVCaches)`` once, at the end.
    """

    replicated_layout: bool = False

    def __init__(self) -> None:
        self.config = types.SimpleNamespace(
            canonical_layout=False, parallel=types.SimpleNamespace(rank=0)
        )
        self.received: Any = None

    def get_worker(self, kv_caches: Any) -> _NullOffloadingWorker:
        self.received = kv_caches
        RECEIVED.append(kv_caches)
        return _NullOffloadingWorker()


@dataclass
class WorkerRun:
    """What vLLM's real ``register_kv_caches`` did with a Built."""

    #: layer name -> the int8 views the worker built with its 4-argument set_
    #: (``tensors_per_block`` in worker.py; one view per layer in 0.33)
    views: dict[str, list[torch.Tensor]]
    #: the CanonicalKVCaches handed to spec.get_worker: ``.tensors`` (after the alias merge, or
    #: the single packed tensor) and ``.group_data_refs``; None if the worker raised first
    canonical: Any
    #: the whole-block ``as_strided`` tensor on the "packed" path, else None
    packed_tensor: torch.Tensor | None
    #: the exception the worker raised, if ``raise_errors=False``
    error: BaseException | None
    #: "file:line in function" of the innermost frame of ``error``
    error_where: str
    storage_nbytes_before: int
    storage_nbytes_after: int
    storage_data_ptr_before: int
    storage_data_ptr_after: int
    #: set_/as_strided calls seen during registration (``record_ops=True`` only)
    ops: list[OpRecord] = field(default_factory=list)
    #: the connector object on the ``run_via_connector`` path
    connector: Any = None
    #: the KVCacheConfig the worker was given
    kv_cache_config: Any = None

    @property
    def reallocated(self) -> bool:
        """The backing storage changed size or moved during registration."""
        return (
            self.storage_nbytes_after != self.storage_nbytes_before
            or self.storage_data_ptr_after != self.storage_data_ptr_before
        )

    @property
    def packed(self) -> bool:
        return self.packed_tensor is not None

    def region_tensors(self) -> list[torch.Tensor]:
        """The transfer regions the worker registered (``canonical.tensors[i].tensor``)."""
        if self.canonical is None:
            return []
        return [t.tensor for t in self.canonical.tensors]

    def layer_regions(self) -> dict[str, list[int]]:
        """Layer name -> indexes into ``region_tensors()``, read from ``group_data_refs``.

        The worker appends, for each offloaded group in order, one ref per view of each of its
        layers in ``layer_names`` order, so refs and layers zip. On the packed path every group
        gets a single ref to the one packed tensor instead: this returns ``{}`` there.
        """
        if self.canonical is None or self.packed or self.kv_cache_config is None:
            return {}
        config = self.kv_cache_config
        out: dict[str, list[int]] = {}
        group_ids = offloaded_group_ids(config)
        for group_id, refs in zip(group_ids, self.canonical.group_data_refs):
            ref_iter = iter(refs)
            for name in config.kv_cache_groups[group_id].layer_names:
                count = len(self.views.get(name, ()))
                out[name] = [next(ref_iter).tensor_idx for _ in range(count)]
        return out


def describe_view(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], int, int, str]:
    """(shape, stride, storage_offset, untyped_storage().data_ptr(), dtype) of a view."""
    return (
        tuple(t.shape),
        tuple(t.stride()),
        int(t.storage_offset()),
        t.untyped_storage().data_ptr(),
        str(t.dtype),
    )


@contextlib.contextmanager
def _capture_register_locals(sink: dict[str, Any]) -> Iterator[None]:
    """Copy the locals of the offloading worker's register_kv_caches when it returns or raises."""
    previous = sys.getprofile()

    def profiler(frame: types.FrameType, event: str, arg: Any) -> None:
        code = frame.f_code
        if (
            event == "return"
            and code.co_name == "register_kv_caches"
            and code.co_filename.endswith(_WORKER_FILE_SUFFIX)
        ):
            sink.clear()
            sink.update(frame.f_locals)
        if previous is not None:
            cast(Any, previous)(frame, event, arg)

    sys.setprofile(profiler)
    try:
        yield
    finally:
        sys.setprofile(previous)


def _error_where(error: BaseException) -> str:
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return ""
    last = frames[-1]
    return f"{last.filename}:{last.lineno} in {last.name}"


def _run(
    built: Built,
    call: Callable[[], Any],
    *,
    record_ops: bool,
    raise_errors: bool,
) -> WorkerRun:
    storage = built.storage
    nbytes_before, ptr_before = storage.nbytes(), storage.data_ptr()
    received_before = len(RECEIVED)
    sink: dict[str, Any] = {}
    recorder = _OpRecorder() if record_ops else None
    error: BaseException | None = None
    connector: Any = None
    try:
        with _capture_register_locals(sink), recorder or contextlib.nullcontext():
            connector = call()
    except Exception as exc:
        if raise_errors:
            raise
        error = exc
    tensors_per_block = sink.get("tensors_per_block") or {}
    canonical = RECEIVED[-1] if len(RECEIVED) > received_before else None
    del RECEIVED[received_before:]  # keep no storage alive past this run
    return WorkerRun(
        views={name: list(views) for name, views in tensors_per_block.items()},
        canonical=canonical,
        packed_tensor=sink.get("packed_tensor"),
        error=error,
        error_where=_error_where(error) if error is not None else "",
        storage_nbytes_before=nbytes_before,
        storage_nbytes_after=storage.nbytes(),
        storage_data_ptr_before=ptr_before,
        storage_data_ptr_after=storage.data_ptr(),
        ops=recorder.ops if recorder is not None else [],
        connector=connector,
        kv_cache_config=built.worker_kv_cache_config,
    )


def offloaded_group_ids(kv_cache_config: Any) -> tuple[int, ...]:
    """The groups the worker registers: vLLM's own ``get_offloading_group_ids`` (the
    prefix-cacheable transfer groups, or the HiSparse indexer groups when HiSparse is on)."""
    return tuple(get_offloading_group_ids(kv_cache_config))


def make_worker(built: Built) -> Any:
    """vLLM's real ``OffloadingConnectorWorker``, through its real constructor, given a
    :class:`RecordingSpec`, the stubbed vllm_config and the worker's KVCacheConfig."""
    spec: Any = RecordingSpec()
    return OffloadingConnectorWorker(spec, built.vllm_config, built.worker_kv_cache_config)


def run_real_worker(
    built: Built, *, record_ops: bool = False, raise_errors: bool = True
) -> WorkerRun:
    """Run vLLM's real ``OffloadingConnectorWorker.register_kv_caches(built.kv_caches)``."""

    def call() -> None:
        make_worker(built).register_kv_caches(built.kv_caches)

    return _run(built, call, record_ops=record_ops, raise_errors=raise_errors)


# --------------------------------------------------------------------------------------------
# The connector path: ensure_kv_transfer_initialized -> KVConnectorFactory.create_connector
# --------------------------------------------------------------------------------------------


class HarnessOffloadingConnector(OffloadingConnector):  # type: ignore[misc,unused-ignore]
    """vLLM's ``OffloadingConnector`` with only its constructor simplified.

    The real constructor calls ``build_offloading_config`` and
    ``OffloadingSpecFactory.create_spec`` (CPU offloading buffers, a full VllmConfig). This one
    keeps ``KVConnectorBase_V1.__init__`` and builds the real ``OffloadingConnectorWorker`` with
    a :class:`RecordingSpec`. Every other method, ``register_kv_caches`` included, is
    ``OffloadingConnector``'s own.
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        KVConnectorBase_V1.__init__(self, vllm_config, role, kv_cache_config)
        self._canonical_layout = False
        self.connector_scheduler = None
        self.connector_worker = None
        if role != KVConnectorRole.WORKER:
            raise ValueError("HarnessOffloadingConnector is worker-side only")
        spec: Any = RecordingSpec()
        self.connector_worker = OffloadingConnectorWorker(spec, vllm_config, kv_cache_config)


class HarnessCanonicalOffloadingConnector(HarnessOffloadingConnector):  # type: ignore[misc,unused-ignore]
    """:class:`HarnessOffloadingConnector` configured as ``kv_connector_extra_config:
    {"canonical_layout": true}`` makes it: its worker's spec says ``canonical_layout``, and the
    worker puts ``derive_canonical_mappings``' mapping on every ref it hands on."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._canonical_layout = True
        worker: Any = self.connector_worker
        worker.spec.config.canonical_layout = True


@dataclass
class ConnectorEnv:
    """Everything ``ensure_kv_transfer_initialized`` needs, for one Built."""

    vllm_config: Any
    kv_cache_config: Any
    kv_caches: dict[str, torch.Tensor]


class _SingleRankGroup:
    """Stands in for vLLM's TP/PP group coordinator: one rank, so broadcast is the identity."""

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj


def make_connector_env(
    built: Built,
    *,
    connector: str = "HarnessOffloadingConnector",
    module_path: str | None = None,
) -> ConnectorEnv:
    """A stubbed VllmConfig whose ``kv_transfer_config`` names ``connector``.

    ``kv_transfer_config`` is vLLM's real ``KVTransferConfig(kv_connector=connector,
    kv_role="kv_both", kv_connector_module_path=module_path)``; the module path defaults to
    this module (``KVConnectorFactory.get_connector_class`` imports it with
    ``importlib.import_module`` and takes the class by name). An empty module path is
    rejected by vLLM (``ValueError``).
    """
    config = KVTransferConfig(
        kv_connector=connector,
        kv_role="kv_both",
        kv_connector_module_path=__name__ if module_path is None else module_path,
        engine_id="safeview-vllm-harness",
    )
    vllm_config = types.SimpleNamespace(**vars(built.vllm_config))
    vllm_config.kv_transfer_config = config
    return ConnectorEnv(vllm_config, built.worker_kv_cache_config, built.kv_caches)


@contextlib.contextmanager
def connector_env(built: Built, **kwargs: Any) -> Iterator[ConnectorEnv]:
    """``make_connector_env`` plus the one patch the connector path needs, undone on exit.

    ``ensure_kv_transfer_initialized`` first calls ``_sync_engine_id_across_tp``, which imports
    ``get_tp_group`` from ``vllm.distributed.parallel_state`` at call time and broadcasts the
    engine id (``get_pp_group`` too when pipeline_parallel_size > 1): both are patched to a
    one-rank group. On exit the global connector is shut down and cleared with vLLM's own
    ``ensure_kv_transfer_shutdown``.
    """
    from vllm.distributed import parallel_state  # type: ignore[import-not-found,unused-ignore]

    env = make_connector_env(built, **kwargs)
    saved = parallel_state.get_tp_group, parallel_state.get_pp_group
    group = _SingleRankGroup()
    setattr(parallel_state, "get_tp_group", lambda: group)  # noqa: B010
    setattr(parallel_state, "get_pp_group", lambda: group)  # noqa: B010
    try:
        yield env
    finally:
        try:
            kv_transfer_state.ensure_kv_transfer_shutdown()
        finally:
            kv_transfer_state._KV_CONNECTOR_AGENT = None
            setattr(parallel_state, "get_tp_group", saved[0])  # noqa: B010
            setattr(parallel_state, "get_pp_group", saved[1])  # noqa: B010


def run_via_connector(
    built: Built,
    *,
    record_ops: bool = False,
    raise_errors: bool = True,
    **env_kwargs: Any,
) -> WorkerRun:
    """What a vLLM worker does: ``ensure_kv_transfer_initialized(vllm_config, kv_cache_config)``
    (gpu_worker.py), then ``get_kv_transfer_group().register_kv_caches(kv_caches)``
    (gpu_model_runner.py). ``WorkerRun.connector`` is the object the factory returned."""
    with connector_env(built, **env_kwargs) as env:

        def call() -> Any:
            kv_transfer_state.ensure_kv_transfer_initialized(env.vllm_config, env.kv_cache_config)
            group = kv_transfer_state.get_kv_transfer_group()
            group.register_kv_caches(env.kv_caches)
            return group

        return _run(built, call, record_ops=record_ops, raise_errors=raise_errors)


# --------------------------------------------------------------------------------------------
# Plugins: vllm.plugins.load_general_plugins()
# --------------------------------------------------------------------------------------------

#: entry-point group read by vllm.plugins.load_general_plugins (vllm/plugins/__init__.py)
GENERAL_PLUGINS_GROUP = "vllm.general_plugins"


def write_plugin_distribution(
    directory: str | os.PathLike[str],
    *,
    name: str,
    value: str,
    dist_name: str = "safeview_vllm_harness_plugin",
) -> Path:
    """Write a minimal installed distribution declaring one ``vllm.general_plugins`` entry point.

    ``importlib.metadata.entry_points(group=...)`` finds ``*.dist-info/entry_points.txt`` in
    every ``sys.path`` entry, so a subprocess with ``PYTHONPATH=directory`` discovers the plugin
    ``name = value`` ("module:function"). ``load_general_plugins`` then loads and calls it once
    per process (module-level flag ``vllm.plugins.plugins_loaded``; ``VLLM_PLUGINS``, a
    comma-separated list of names, filters when set). Returns the dist-info folder.
    """
    dist_info = Path(directory) / f"{dist_name}-0.0.0.dist-info"
    dist_info.mkdir(parents=True, exist_ok=True)
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: 0.0.0\n", encoding="utf-8"
    )
    (dist_info / "entry_points.txt").write_text(
        f"[{GENERAL_PLUGINS_GROUP}]\n{name} = {value}\n", encoding="utf-8"
    )
    return dist_info


def reset_general_plugins() -> None:
    """Let ``vllm.plugins.load_general_plugins()`` run again in this process (it only runs once
    per process: ``global plugins_loaded; if plugins_loaded: return``)."""
    import vllm.plugins  # type: ignore[import-not-found,unused-ignore]

    vllm.plugins.plugins_loaded = False
