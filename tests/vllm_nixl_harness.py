"""vLLM 0.33's real NIXL connector, on CPU: two workers, vLLM's own handshake, one READ, the bytes
compared.

``run(scenarios, env=...)`` starts one Python process on vLLM's CPU platform
(``VLLM_TARGET_DEVICE=cpu``) that runs every scenario in turn and returns one result per scenario.
In that process, for each scenario:

- a real ``VllmConfig`` is built by ``EngineArgs.create_engine_config`` from a small model
  ``config.json`` written to a temporary folder (no weights, no network): a Llama for attention, a
  DeepSeek-V2 for MLA; the KV-cache layout is recorded on it as the engine core does
  (``record_kv_cache_layout``);
- vLLM's planner (``get_kv_cache_groups``, ``get_kv_cache_config_from_groups``, 10 blocks through
  ``num_gpu_blocks_override``) and allocator (``allocate_kv_cache``) make the caches of a prefill
  worker (P) and of a decode worker (D);
- each worker's connector is created by ``KVConnectorFactory.create_connector(config=...,
  role=KVConnectorRole.WORKER, kv_cache_config=...)``, as ``ensure_kv_transfer_initialized`` does,
  so a plugin that wraps the factory (safeview's, loaded by vLLM's own ``load_general_plugins``) is
  in the path; then ``register_kv_caches(kv_caches)``, vLLM's ``NixlPullConnector`` all the way
  down to NIXL;
- P's pages are filled with random non-zero bytes, D's stay zero; P's scheduler-side connector
  serves P's handshake metadata on vLLM's ZMQ side channel; D is handed a request to read P's
  blocks 1, 2, 3 into its blocks 4, 5, 6 (``NixlConnectorMetadata.add_new_req_to_recv``,
  ``start_load_kv``, ``get_finished`` until it is done), which makes vLLM do the handshake and the
  READ itself;
- the result says, per layer and block, how many bytes of each page arrived, whether any other
  byte of D changed, the local descriptor rows NIXL received (``prep_xfer_dlist`` with
  ``"NIXL_INIT_AGENT"``, relative to the storage's address; recorded on the agent before the
  worker registers, so a guard installed later checks them before they are recorded), whether
  each worker's agent was guarded, the error that stopped the scenario if any (with its stage),
  and the safeview events emitted.

The faults a scenario can inject, each on both workers (so that vLLM's handshake accepts them):

- ``shared_block_len``, the class of vLLM issue 57661: region 1 (layer 1) takes the block length
  of region 0, just before each worker prepares its local descriptors
  (``register_local_xfer_handler``), so both the local rows and the handshake metadata carry it.
  NIXL accepts such rows: they lie inside the registered memory.
- ``skip_layer``: the worker loses layer 1's spec before it registers (as a worker that skips a
  layer it should transfer: ROCm/ATOM PR 2154's state pool, GLM's index buffers), so it registers
  and prepares every layer but layer 1; the READ succeeds and layer 1 stays zero on D.
- ``region_of_layer_0``: region 1 takes region 0's base address just before the local
  descriptors are prepared (regions paired by address, vLLM issue 57661's other half): layer 0's
  pages are moved twice and layer 1's never.
- ``kv_sharing_layer`` (legitimate, not a fault): the caches handed to the connector also hold a
  fourth layer that shares layer 0's cache and is in no KV-cache group, as vLLM's cross-layer KV
  sharing hands it; the worker skips it on purpose (it has no spec).

The worker pins the process's CPU affinity to one core when it is built; the harness restores it.
UCX may crash the interpreter at exit, so the process prints its results as one JSON line and
ends with ``os._exit``. Importing this module imports neither vLLM nor NIXL.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

#: the prefix of the line that carries the results on the child's stdout
RESULT_PREFIX = "SAFEVIEW-NIXL-RESULTS "

NUM_BLOCKS = 10
REMOTE_BLOCKS = (1, 2, 3)  # P's blocks that D reads ...
LOCAL_BLOCKS = (4, 5, 6)  # ... into these blocks of its own

_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "num_hidden_layers": 3,
    "vocab_size": 1000,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "torch_dtype": "float16",
}
_DEEPSEEK_V2 = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 3,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "vocab_size": 1000,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "torch_dtype": "float16",
}


@dataclass(frozen=True)
class Case:
    """A model and a KV-cache layout: ``heads[i]`` is layer i's KV heads (attention, head size
    64), or ``None`` for an MLA layer (one latent of 576 values); ``block_size`` in tokens, one
    that vLLM's CPU backend for the layers takes as its kernel block (CPU_ATTN: multiples of 32;
    CPU_MLA, named in the config so that a CPU with AMX does not pick AMX_MLA's multiples of 32:
    16), so that the worker's blocks are the allocator's. ``permute_local_kv``: the engine's
    ``kv_transfer_config`` says ``enable_permute_local_kv`` (a decode engine of ``LBNHC`` that
    reads a prefill engine of ``LBHNC`` and permutes the pages on receipt)."""

    model: str  # "llama" or "deepseek_v2"
    layout: str  # a vllm.v1.kv_cache_layout.KVCacheLayout name
    heads: tuple[int | None, ...]
    block_size: int
    permute_local_kv: bool = False

    def page_bytes(self, layer: int) -> int:
        """Bytes of one block of layer ``layer`` (fp16)."""
        heads = self.heads[layer]
        per_token = 576 if heads is None else 2 * heads * 64
        return self.block_size * per_token * 2


#: the layouts, by name. Attention pages are 32,768 bytes (4 heads) or 65,536 (8 heads); MLA pages
#: 18,432. ``BLHNC`` is block-major: every block holds one page of each layer, back to back.
CASES: dict[str, Case] = {
    "attention_lbhnc": Case("llama", "LBHNC", (4, 4, 4), 32),
    "attention_lbnhc": Case("llama", "LBNHC", (4, 4, 4), 32),
    "attention_blhnc": Case("llama", "BLHNC", (4, 4, 4), 32),
    "attention_two_pages": Case("llama", "LBHNC", (4, 8, 4), 32),
    "mla_lbnhc": Case("deepseek_v2", "LBNHC", (None, None, None), 16),
    "mla_blhnc": Case("deepseek_v2", "BLHNC", (None, None, None), 16),
}

#: the faults a scenario can inject (see the module docstring)
FAULTS = ("shared_block_len", "skip_layer", "region_of_layer_0", "kv_sharing_layer")


@dataclass(frozen=True)
class Scenario:
    """One P/D pair: ``case`` of ``CASES``, an optional ``fault`` of ``FAULTS``, and the safeview
    policy in force (``None``: the environment's)."""

    case: str
    fault: str | None = None
    policy: str | None = None


def layer_name(index: int) -> str:
    """The name vLLM gives layer ``index``'s attention."""
    return f"model.layers.{index}.self_attn.attn"


# --------------------------------------------------------------------------------------------
# The parent side: one child process for many scenarios
# --------------------------------------------------------------------------------------------


@dataclass
class Run:
    """What a child process returned: one result dict per scenario, and its whole output (vLLM's
    log lines, with safeview's events where vLLM's handler prints them)."""

    results: list[dict[str, Any]]
    output: str
    returncode: int
    seconds: float


def run(
    scenarios: Sequence[Scenario],
    *,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 600,
) -> Run:
    """Run ``scenarios`` in one fresh process of this interpreter (the one vLLM is installed in).

    The child inherits this environment without any ``SAFEVIEW_*`` variable, plus ``env``;
    ``VLLM_TARGET_DEVICE=cpu`` is always set. Raises ``RuntimeError`` with the tail of the output
    when the child prints no results.
    """
    payload = [asdict(scenario) for scenario in scenarios]
    return spawn(Path(__file__), payload, RESULT_PREFIX, env=env, timeout_s=timeout_s)


def spawn(
    script: Path,
    payload: Any,
    prefix: str,
    *,
    env: Mapping[str, str] | None = None,
    timeout_s: float,
) -> Run:
    """Run ``script`` with ``payload`` (as JSON, its one argument) in a fresh process of this
    interpreter, on vLLM's CPU platform, without any ``SAFEVIEW_*`` variable of this process
    (plus ``env``), this folder on its path; its results are the JSON after ``prefix`` on the
    last line that starts with it."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SAFEVIEW_")}
    environ.update(env or {})
    environ["VLLM_TARGET_DEVICE"] = "cpu"
    environ["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parent), environ.get("PYTHONPATH", "")]
    )
    started = time.perf_counter()
    child = subprocess.run(
        [sys.executable, str(script.resolve()), json.dumps(payload)],
        env=environ,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    seconds = time.perf_counter() - started
    output = child.stdout + child.stderr
    lines = [line for line in child.stdout.splitlines() if line.startswith(prefix)]
    if not lines:
        raise RuntimeError(
            f"{script.name} printed no results (exit status {child.returncode}):\n" + output[-8000:]
        )
    return Run(json.loads(lines[-1][len(prefix) :]), output, child.returncode, seconds)


# --------------------------------------------------------------------------------------------
# The child side: vLLM on its CPU platform
# --------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class _Child:
    """Everything one child process sets up once: vLLM's plugins, its distributed state (one
    rank, gloo), the model folders."""

    def __init__(self) -> None:
        self.affinity = os.sched_getaffinity(0)
        self.folder = Path(tempfile.mkdtemp(prefix="safeview-nixl-"))
        self.models: dict[str, Path] = {}
        for name, config in (("llama", _LLAMA), ("deepseek_v2", _DEEPSEEK_V2)):
            path = self.folder / name
            path.mkdir()
            (path / "config.json").write_text(json.dumps(config), encoding="utf-8")
            self.models[name] = path

        import vllm.plugins
        from vllm.config import set_current_vllm_config
        from vllm.distributed import parallel_state

        # what a vLLM worker process does first (worker_base.py, init_worker)
        vllm.plugins.load_general_plugins()
        config = self.vllm_config(CASES["attention_lbhnc"], "setup")
        with set_current_vllm_config(config):
            parallel_state.init_distributed_environment(
                world_size=1,
                rank=0,
                distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
                local_rank=0,
                backend="gloo",
            )
            parallel_state.ensure_model_parallel_initialized(1, 1)

    def vllm_config(self, case: Case, engine_id: str) -> Any:
        """A real VllmConfig for ``case``, with a NixlConnector of ``engine_id``."""
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
        from vllm.v1.attention.backends.utils import record_kv_cache_layout

        # vLLM's CPU platform picks AMX_MLA for MLA where the CPU has AMX tiles (blocks a
        # multiple of 32) and CPU_MLA elsewhere (blocks of exactly 16, forced): naming CPU_MLA
        # makes an MLA engine the same 16-token engine on every machine, with or without AMX
        backend = AttentionBackendEnum.CPU_MLA if case.model == "deepseek_v2" else None
        transfer: dict[str, Any] = {
            "kv_connector": "NixlConnector",
            "kv_role": "kv_both",
            "engine_id": engine_id,
        }
        if case.permute_local_kv:
            transfer["enable_permute_local_kv"] = True
        config = EngineArgs(
            model=str(self.models[case.model]),
            skip_tokenizer_init=True,
            dtype="float16",
            block_size=case.block_size,
            attention_backend=backend,
            max_model_len=512,
            num_gpu_blocks_override=NUM_BLOCKS,
            kv_transfer_config=transfer,
        ).create_engine_config()
        # what a worker does with the layout the engine core resolved
        record_kv_cache_layout(config.cache_config, case.layout)
        return config

    def restore_affinity(self) -> None:
        """Undo the CPU pinning a NIXL worker does when it is built (base_worker.py)."""
        os.sched_setaffinity(0, self.affinity)


def _specs(case: Case) -> dict[str, Any]:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    specs: dict[str, Any] = {}
    for index, heads in enumerate(case.heads):
        if heads is None:
            specs[layer_name(index)] = MLAAttentionSpec(
                block_size=case.block_size, num_kv_heads=1, head_size=576, dtype=torch.float16
            )
        else:
            specs[layer_name(index)] = FullAttentionSpec(
                block_size=case.block_size,
                num_kv_heads=heads,
                head_size=64,
                dtype=torch.float16,
            )
    return specs


@dataclass
class _Side:
    """One worker: its config, caches, connector, and what it handed NIXL."""

    name: str
    config: Any
    kv_cache_config: Any
    kv_caches: dict[str, Any]
    connector: Any = None
    agent: Any = None  # the nixl_agent vLLM made
    recorder: Any = None  # what records the rows, set on the agent before registration
    local_rows: list[list[int]] | None = None
    remote_rows: list[list[int]] | None = None

    @property
    def storage(self) -> Any:
        return next(iter(self.kv_caches.values())).untyped_storage()

    @property
    def worker(self) -> Any:
        return self.connector.connector_worker


def _allocate(child: _Child, case: Case, name: str) -> _Side:
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.v1.core.kv_cache_planning import (
        get_kv_cache_config_from_groups,
        get_kv_cache_groups,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    config = child.vllm_config(case, name)
    with set_current_vllm_config(config):
        groups = get_kv_cache_groups(config, _specs(case))
        # available memory is irrelevant: num_gpu_blocks_override decides
        kv_cache_config = get_kv_cache_config_from_groups(config, groups, 0)
        kv_cache_config.kv_cache_layout = config.cache_config.kv_cache_layout
        kv_caches = allocate_kv_cache(
            kv_cache_config,
            torch.device("cpu"),
            KVCacheLayout[case.layout],
            [case.block_size] * len(kv_cache_config.kv_cache_groups),
        )
    return _Side(name, config, kv_cache_config, kv_caches)


def _record_rows(side: _Side) -> None:
    """Record the descriptor rows the agent vLLM made is handed by ``prep_xfer_dlist`` (local:
    ``"NIXL_INIT_AGENT"``), relative to the address of the storage, on the agent itself: whatever
    wraps the agent later (a guard) sits in front of this record, so the rows recorded are the
    rows NIXL received."""
    import numpy as np

    agent = side.agent
    original = agent.prep_xfer_dlist
    side.local_rows, side.remote_rows = [], []

    def prep_xfer_dlist(agent_name: str, xfer_list: Any, *args: Any, **kwargs: Any) -> Any:
        rows = np.asarray(xfer_list, dtype=np.uint64).reshape(-1, 5).tolist()
        local = agent_name in ("NIXL_INIT_AGENT", "")
        if local:
            base = side.storage.data_ptr()
            rows = [[row[0] - base, *row[1:]] for row in rows]
        (side.local_rows if local else side.remote_rows).extend(rows)  # type: ignore[union-attr]
        return original(agent_name, xfer_list, *args, **kwargs)

    agent.prep_xfer_dlist = side.recorder = prep_xfer_dlist


def _share_block_len(worker: Any) -> None:
    """The class of vLLM issue 57661: region 1 takes region 0's block length, just before the
    worker prepares its local descriptors (and publishes the lengths to its peers)."""
    prepare = worker.register_local_xfer_handler

    def register_local_xfer_handler(*args: Any, **kwargs: Any) -> Any:
        worker.block_len_per_layer[1] = worker.block_len_per_layer[0]
        return prepare(*args, **kwargs)

    worker.register_local_xfer_handler = register_local_xfer_handler


def _skip_layer(worker: Any) -> None:
    """The worker forgets layer 1's spec, so its ``register_kv_caches`` skips the layer."""
    worker._layer_specs.pop(layer_name(1))


def _region_of_layer_0(worker: Any) -> None:
    """Region 1 takes region 0's base address, just before the local descriptors are built."""
    prepare = worker.register_local_xfer_handler

    def register_local_xfer_handler(*args: Any, **kwargs: Any) -> Any:
        bases = worker.kv_caches_base_addr[worker.engine_id][worker.tp_rank]
        bases[1] = bases[0]
        return prepare(*args, **kwargs)

    worker.register_local_xfer_handler = register_local_xfer_handler


def _connect(child: _Child, side: _Side, fault: str | None) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

    with set_current_vllm_config(side.config):
        try:
            # as ensure_kv_transfer_initialized creates it (kv_transfer_state.py)
            side.connector = KVConnectorFactory.create_connector(
                config=side.config,
                role=KVConnectorRole.WORKER,
                kv_cache_config=side.kv_cache_config,
            )
        finally:
            child.restore_affinity()
        side.agent = side.worker.nixl_wrapper
        _record_rows(side)
        if fault == "shared_block_len":
            _share_block_len(side.worker)
        elif fault == "skip_layer":
            _skip_layer(side.worker)
        elif fault == "region_of_layer_0":
            _region_of_layer_0(side.worker)
        caches = side.kv_caches
        if fault == "kv_sharing_layer":
            caches = {**caches, layer_name(3): caches[layer_name(0)]}
        # as the model runner does once the caches are allocated (gpu_model_runner.py)
        side.connector.register_kv_caches(caches)


def _fill(side: _Side, seed: int) -> None:
    """Random bytes, none of them zero, over the whole storage: a byte of D equal to P's came
    from P."""
    import torch

    raw = torch.empty(0, dtype=torch.uint8).set_(side.storage)
    generator = torch.Generator().manual_seed(seed)
    raw.copy_(torch.randint(1, 256, (raw.numel(),), dtype=torch.uint8, generator=generator))


def _storage_bytes(storage: Any) -> Any:
    """The bytes of a storage, as a numpy uint8 array over the same memory."""
    import torch

    return torch.empty(0, dtype=torch.uint8).set_(storage).numpy()


def _page_bytes(cache: Any, block: int) -> Any:
    """The bytes of one block of a layer's cache (one run of memory in every layout here)."""
    page = cache[block]
    start = page.data_ptr() - cache.untyped_storage().data_ptr()
    return _storage_bytes(cache.untyped_storage())[start : start + page.nbytes]


def _read(p: _Side, d: _Side, request: str, timeout_s: float = 60) -> dict[str, Any]:
    """P serves its handshake metadata; D reads P's REMOTE_BLOCKS into its LOCAL_BLOCKS."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnectorMetadata

    port = _free_port()
    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(port)
    with set_current_vllm_config(p.config):
        scheduler = KVConnectorFactory.create_connector(
            config=p.config, role=KVConnectorRole.SCHEDULER, kv_cache_config=p.kv_cache_config
        )
        # what the engine core does with the workers' metadata (core.py)
        scheduler.set_xfer_handshake_metadata_pp_aware(
            {(0, 0): p.connector.get_handshake_metadata()}
        )
    groups = len(d.kv_cache_config.kv_cache_groups)
    metadata = NixlConnectorMetadata()
    metadata.add_new_req_to_recv(
        request,
        tuple(list(LOCAL_BLOCKS) for _ in range(groups)),
        {
            "remote_block_ids": tuple(list(REMOTE_BLOCKS) for _ in range(groups)),
            "remote_engine_id": p.name,
            "remote_request_id": request,
            "remote_host": "127.0.0.1",
            "remote_port": port,
            "tp_size": 1,
        },
    )
    started = time.perf_counter()
    done = failed = False
    try:
        with set_current_vllm_config(d.config):
            while time.perf_counter() - started < timeout_s:
                d.connector.bind_connector_metadata(metadata)
                d.connector.start_load_kv(None)
                d.connector.clear_connector_metadata()
                metadata = NixlConnectorMetadata()
                _, received = d.connector.get_finished(set())
                if request in received:
                    done = True
                    break
                time.sleep(0.02)
            failed = bool(d.connector.get_block_ids_with_load_errors()) or bool(
                d.worker._recv_failures
            )
    finally:
        scheduler.shutdown()
    return {"done": done, "failed": failed, "seconds": round(time.perf_counter() - started, 3)}


def _compare(case: Case, p: _Side, d: _Side) -> dict[str, Any]:
    """Per layer, how many bytes of each read page arrived; whether D changed anywhere else."""
    import numpy as np

    layers: dict[str, Any] = {}
    d_all = _storage_bytes(d.storage)
    touched = np.zeros(d_all.shape, dtype=bool)
    base = d.storage.data_ptr()
    for index in range(len(case.heads)):
        name = layer_name(index)
        delivered = []
        for remote, local in zip(REMOTE_BLOCKS, LOCAL_BLOCKS):
            sent = _page_bytes(p.kv_caches[name], remote)
            got = _page_bytes(d.kv_caches[name], local)
            delivered.append(int(np.count_nonzero(sent == got)))
            start = d.kv_caches[name][local].data_ptr() - base
            touched[start : start + got.size] = True
        layers[name] = {"page_bytes": case.page_bytes(index), "delivered_bytes": delivered}
    return {"layers": layers, "untouched_elsewhere": bool(not d_all[~touched].any())}


def _error(stage: str, error: BaseException) -> dict[str, Any]:
    """An exception as plain data: its type, message, stage, and its public attributes."""
    attributes = {}
    for key, value in vars(error).items():
        if key.startswith("_"):
            continue
        attributes[key] = (
            value if isinstance(value, (int, str, float, bool, type(None))) else repr(value)
        )
    return {
        "stage": stage,
        "type": type(error).__name__,
        "module": type(error).__module__,
        "message": str(error),
        "attributes": attributes,
        "traceback": traceback.format_exception(error)[-3:],
    }


def _json_safe(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, (int, str, float, bool, type(None))):
        return value
    return repr(value)


@contextlib.contextmanager
def _policy(policy: str | None) -> Iterator[None]:
    if policy is None:
        yield
        return
    import safeview

    with safeview.policy_scope(policy):
        yield


def _describe(side: _Side) -> dict[str, Any]:
    """What one worker handed NIXL, and whether its agent was guarded: a guard wraps the agent's
    ``prep_xfer_dlist`` (the harness's recorder) with a checked one."""
    if side.connector is None:
        return {"local_rows": None, "remote_rows": None, "guarded": False}
    agent = side.worker.nixl_wrapper
    return {
        "local_rows": side.local_rows,
        "remote_rows": side.remote_rows,
        "guarded": agent.prep_xfer_dlist is not side.recorder,
        "same_agent": agent is side.agent,
        "agent_type": type(agent).__name__,
        "block_len_per_layer": list(side.worker.block_len_per_layer),
    }


def _run_scenario(child: _Child, index: int, scenario: Scenario) -> dict[str, Any]:
    from safeview.testing import capture_events

    case = CASES[scenario.case]
    result: dict[str, Any] = {"scenario": asdict(scenario), "error": None, "transfer": None}
    sides: list[_Side] = []
    stage = "allocate"
    with capture_events() as events, _policy(scenario.policy):
        try:
            p = _allocate(child, case, f"{index}-{scenario.case}-P")
            d = _allocate(child, case, f"{index}-{scenario.case}-D")
            sides = [p, d]
            _fill(p, seed=index)
            stage = "P.register_kv_caches"
            _connect(child, p, scenario.fault)
            stage = "D.register_kv_caches"
            _connect(child, d, scenario.fault)
            stage = "READ"
            result["transfer"] = _read(p, d, f"request-{index}")
            result.update(_compare(case, p, d))
        except Exception as error:
            result["error"] = _error(stage, error)
            if sides and "layers" not in result:
                result["d_untouched"] = bool(not _storage_bytes(sides[1].storage).any())
        finally:
            for side in sides:
                result.setdefault("sides", {})[side.name[-1]] = _describe(side)
                if side.connector is not None:
                    with contextlib.suppress(Exception):
                        side.connector.shutdown()
            child.restore_affinity()
    result["events"] = _json_safe(events)
    return result


def _main(argv: list[str]) -> None:
    scenarios = [Scenario(**item) for item in json.loads(argv[1])]
    child = _Child()
    results = [_run_scenario(child, index, scenario) for index, scenario in enumerate(scenarios)]
    sys.stdout.write(RESULT_PREFIX + json.dumps(results) + "\n")
    sys.stdout.flush()
    sys.stderr.flush()
    # UCX may crash the interpreter at exit: the results are out, leave now
    os._exit(0)


if __name__ == "__main__":
    _main(sys.argv)
