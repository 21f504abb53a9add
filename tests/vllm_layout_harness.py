"""Two engines, one layout: vLLM 0.33's real NIXL connector on CPU, prefill (P) and decode (D)
engines of any tensor-parallel size, block size and block count, vLLM's own handshake and READ,
and the bytes D received decoded through D's own layout.

It reuses the pieces of ``vllm_nixl_harness`` (the child process on vLLM's CPU platform, the model
folders, vLLM's planner and allocator, the scheduler-side connector that serves P's handshake
metadata) and adds what a pair of engines needs:

- each engine has ``tp`` ranks; a rank is a real ``NixlPullConnector`` worker created through
  ``KVConnectorFactory.create_connector`` (so safeview's plugin is in the path), told its rank and
  the engine's size before it registers (one process has one real tensor-parallel group of one:
  the worker's ``tp_rank``, ``world_size`` and ``transfer_tp_*`` are set as a rank of that size
  would have them), with its share of the KV heads (``heads // tp`` per layer);
- P serves every rank's metadata on one side channel, as P's engine core does;
- each D rank is handed a request for P's ``REMOTE_BLOCKS`` into its ``LOCAL_BLOCKS`` with
  ``tp_size`` of P, and vLLM does the handshake, the READ and its receive-side post-processing
  (``kv_postprocess_blksize_on_receive`` when D's blocks hold several of P's);
- the oracle: for every element of D's local blocks that the request fills, the value D reads
  through its own cache tensor (its strides) must be the value P meant at the same layer, K/V
  half, global head, token of the request and element, read through P's cache tensor. The
  result names the first element that differs, per layer.

A fault can give P's layer 1 a physical layout of its own (``permuted_layer``: token-major
``[N, H, C]`` pages behind the same ``[B, H, N, C]`` shape, the same bytes, and the same layout
string in P's metadata): vLLM cannot see it; the READ moves the bytes and D reads them wrong.

``SAFEVIEW_MANIFEST_DIR`` is set per engine as a scenario says (one folder shared by both,
one each, or none) just before that engine's workers register. Importing this module imports
neither vLLM nor NIXL.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import vllm_nixl_harness as base  # type: ignore[import-not-found,unused-ignore]

RESULT_PREFIX = "SAFEVIEW-LAYOUT-RESULTS "
REMOTE_BLOCKS = (1, 2, 3)  # P's blocks that D reads (each a request's worth of P blocks) ...
LOCAL_BLOCKS = (4, 5, 6)  # ... into these blocks of D's own
PEER_BLOCKS = (7, 8, 9)  # where D reads a second, healthy P's blocks
TOTAL_HEADS = 4  # the Llama of vllm_nixl_harness has 4 KV heads of 64 values (K|V: 128)
LAYERS = 3


@dataclass(frozen=True)
class Engine:
    """One engine: its KV-cache ``layout`` name, tensor-parallel size, block size (tokens; a
    multiple of 32, which vLLM's CPU attention takes as its kernel block, or 16 for MLA, which
    CPU_MLA takes, named by ``vllm_nixl_harness`` on every machine, AMX or not), block
    count, and model (``llama``: 4 KV heads of 64 values; ``deepseek_v2``: MLA, one latent of
    576 values per token, the same on every rank)."""

    layout: str = "LBHNC"
    tp: int = 1
    block_size: int = 32
    num_blocks: int = 10
    model: str = "llama"
    # each layer's own KV heads (a model whose layers hold different numbers: two page sizes
    # in one cache), the model's config still saying TOTAL_HEADS; None: TOTAL_HEADS each
    layer_heads: tuple[int, ...] | None = None
    # the engine's kv_transfer_config says enable_permute_local_kv: a decode engine of LBNHC
    # reads a prefill engine of LBHNC, and vLLM permutes the pages HND -> NHD on receipt
    permute_local_kv: bool = False

    @property
    def mla(self) -> bool:
        return self.model == "deepseek_v2"

    def total_heads(self, layer: int = 0) -> int:
        return TOTAL_HEADS if self.layer_heads is None else self.layer_heads[layer]

    def heads(self, layer: int = 0) -> int:
        """KV heads per rank of ``layer``: ``max(1, H // TP)`` (1 for MLA: one latent)."""
        return 1 if self.mla else max(1, self.total_heads(layer) // self.tp)

    def first_head(self, rank: int, layer: int = 0) -> int:
        """The global KV head a rank's first head of ``layer`` is (vLLM's sharding; with more
        ranks than heads, ``TP // H`` ranks hold each head)."""
        if self.mla:
            return 0
        if self.tp <= self.total_heads(layer):
            return rank * self.heads(layer)
        return rank * self.total_heads(layer) // self.tp

    def case(self) -> Any:
        heads = tuple(None if self.mla else self.heads(layer) for layer in range(LAYERS))
        return base.Case(self.model, self.layout, heads, self.block_size, self.permute_local_kv)


@dataclass(frozen=True)
class Pair:
    """A P/D pair. ``manifests``: ``"shared"`` (both engines write to and read from one
    ``SAFEVIEW_MANIFEST_DIR``), ``"separate"`` (one folder each), ``None`` (unset).
    ``fault``: ``None``, ``"permuted_layer"`` (on P) or ``"permuted_layer_on_d"`` (the same
    on D: D reads layer 1's bytes token-major under the same layout string). ``policy``:
    safeview's, or ``None`` for the environment's. ``peers``: also read from a second, healthy
    P engine (same layout as D) in the same D worker, to show a refused peer does not hold up a
    healthy one."""

    name: str
    p: Engine = field(default_factory=Engine)
    d: Engine = field(default_factory=Engine)
    manifests: str | None = "shared"
    fault: str | None = None
    policy: str | None = None
    healthy_peer: bool = False


Run = base.Run


def run(
    pairs: Sequence[Pair], *, env: Mapping[str, str] | None = None, timeout_s: float = 900
) -> Run:
    """Run ``pairs`` in one fresh process of this interpreter; one result dict per pair."""
    payload = [_pair_json(pair) for pair in pairs]
    return base.spawn(Path(__file__), payload, RESULT_PREFIX, env=env, timeout_s=timeout_s)


def _pair_json(pair: Pair) -> dict[str, Any]:
    return asdict(pair)


def _pair_of(data: dict[str, Any]) -> Pair:
    return Pair(**{**data, "p": Engine(**data["p"]), "d": Engine(**data["d"])})


# --------------------------------------------------------------------------------------------
# The child side
# --------------------------------------------------------------------------------------------


def _allocate(child: Any, engine: Engine, name: str, rank: int, fault: str | None) -> Any:
    """One rank's caches, by vLLM's planner and allocator, with ``engine.num_blocks`` blocks."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.v1.core.kv_cache_planning import (
        get_kv_cache_config_from_groups,
        get_kv_cache_groups,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    case = engine.case()
    config = child.vllm_config(case, name)
    config.cache_config.num_gpu_blocks_override = engine.num_blocks
    with set_current_vllm_config(config):
        groups = get_kv_cache_groups(config, base._specs(case))
        kv_cache_config = get_kv_cache_config_from_groups(config, groups, 0)
        kv_cache_config.kv_cache_layout = config.cache_config.kv_cache_layout
        kv_caches = allocate_kv_cache(
            kv_cache_config,
            torch.device("cpu"),
            KVCacheLayout[case.layout],
            [case.block_size] * len(kv_cache_config.kv_cache_groups),
        )
    if fault == "permuted_layer":
        # layer 1's pages token-major behind the same logical shape and the same bytes
        layer = base.layer_name(1)
        cache = kv_caches[layer]
        blocks, heads, tokens, content = cache.shape
        kv_caches[layer] = torch.as_strided(
            cache,
            (blocks, heads, tokens, content),
            (cache.stride(0), content, heads * content, 1),
            cache.storage_offset(),
        )
    return base._Side(name, config, kv_cache_config, kv_caches)  # name: the engine id


def _set_rank(worker: Any, rank: int, size: int) -> None:
    """What a worker of rank ``rank`` in a tensor-parallel group of ``size`` holds."""
    worker.tp_rank = worker.transfer_tp_rank = rank
    worker.world_size = worker.transfer_tp_size = size
    worker.dcp_rank = rank % worker.dcp_size


def _connect(child: Any, side: Any, rank: int, size: int, errors: list[Any]) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

    with set_current_vllm_config(side.config):
        try:
            side.connector = KVConnectorFactory.create_connector(
                config=side.config,
                role=KVConnectorRole.WORKER,
                kv_cache_config=side.kv_cache_config,
            )
        finally:
            child.restore_affinity()
        worker = side.worker
        _set_rank(worker, rank, size)
        side.agent = worker.nixl_wrapper
        _record_handshake_errors(worker, errors)
        side.connector.register_kv_caches(side.kv_caches)


def _record_handshake_errors(worker: Any, errors: list[Any]) -> None:
    """Record what stops a handshake (it runs in a thread; vLLM logs it and fails the request)."""
    handshake = worker._nixl_handshake

    def _nixl_handshake(*args: Any, **kwargs: Any) -> Any:
        try:
            return handshake(*args, **kwargs)
        except BaseException as error:
            errors.append(_error("handshake", error))
            raise

    worker._nixl_handshake = _nixl_handshake


def _error(stage: str, error: BaseException) -> dict[str, Any]:
    described = base._error(stage, error)
    described["is_safeview_error"] = any(
        cls.__name__ == "SafeViewError" for cls in type(error).__mro__
    )
    described["traceback"] = traceback.format_exception(error)[-4:]
    return described


def _serve(engine_sides: list[Any]) -> tuple[Any, int]:
    """P's scheduler-side connector serves every rank's handshake metadata on a free port."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

    port = base._free_port()
    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(port)
    first = engine_sides[0]
    with set_current_vllm_config(first.config):
        scheduler = KVConnectorFactory.create_connector(
            config=first.config,
            role=KVConnectorRole.SCHEDULER,
            kv_cache_config=first.kv_cache_config,
        )
        scheduler.set_xfer_handshake_metadata_pp_aware(
            {
                (0, rank): side.connector.get_handshake_metadata()
                for rank, side in enumerate(engine_sides)
            }
        )
    return scheduler, port


def _read(d: Any, requests: list[dict[str, Any]], timeout_s: float = 60) -> dict[str, Any]:
    """D rank ``d`` is handed one request per entry of ``requests`` (``engine_id``, ``port``,
    ``tp_size``, ``remote_blocks``, ``local_blocks``) and vLLM does the rest; returns, per
    engine, whether the request finished and whether it failed."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnectorMetadata

    groups = len(d.kv_cache_config.kv_cache_groups)
    metadata = NixlConnectorMetadata()
    pending = {}
    for entry in requests:
        request_id = f"request-{entry['engine_id']}-{d.worker.tp_rank}"
        pending[request_id] = entry["engine_id"]
        metadata.add_new_req_to_recv(
            request_id,
            tuple(list(entry["local_blocks"]) for _ in range(groups)),
            {
                "remote_block_ids": tuple(list(entry["remote_blocks"]) for _ in range(groups)),
                "remote_engine_id": entry["engine_id"],
                "remote_request_id": request_id,
                "remote_host": "127.0.0.1",
                "remote_port": entry["port"],
                "tp_size": entry["tp_size"],
            },
        )
    outcome: dict[str, Any] = {}
    started = time.perf_counter()
    with set_current_vllm_config(d.config):
        while pending and time.perf_counter() - started < timeout_s:
            d.connector.bind_connector_metadata(metadata)
            d.connector.start_load_kv(None)
            d.connector.clear_connector_metadata()
            metadata = NixlConnectorMetadata()
            results = d.connector.get_transfer_results(set())
            for request_id in sorted(results.finished_recving & set(pending)):
                outcome[pending.pop(request_id)] = {
                    "done": True,
                    "failed": request_id in results.failed_recving,
                }
            time.sleep(0.02)
    for engine_id in pending.values():
        outcome[engine_id] = {"done": False, "failed": None}
    outcome["seconds"] = round(time.perf_counter() - started, 3)
    return outcome


def _oracle(
    p: Engine, d_engine: Engine, p_sides: list[Any], d: Any, d_rank: int,
    remote_blocks: Sequence[int], local_blocks: Sequence[int],
) -> dict[str, Any]:  # fmt: skip
    """Per layer: how many elements of D's filled blocks hold what P meant there, and the first
    one that does not, as (local block, head, token, element). Heads: D's head ``h`` of rank
    ``d_rank`` is global head ``first_head(d_rank) + h``, held by the first P rank whose heads
    include it (ranks holding the same heads, replicated KV or MLA, hold the same bytes).
    Tokens: the request's token ``i * N_D + t`` is P's block
    ``remote_blocks[(i * N_D + t) // N_P]``, token ``(i * N_D + t) % N_P``. Every value is read
    through the engine's own cache tensor, so through its own strides. ``first_wrong_byte``:
    the lowest byte of D's page in its first filled block that holds something else (the byte
    ``safeview.diff`` must name), -1 when only later blocks are wrong, else None."""
    import torch

    n_d, n_p = d_engine.block_size, p.block_size
    tokens = len(remote_blocks) * n_p
    layers: dict[str, Any] = {}
    for index in range(LAYERS):
        name = base.layer_name(index)
        heads_d, heads_p = d_engine.heads(index), p.heads(index)
        got_cache = d.kv_caches[name].view(torch.int16)
        total = wrong = 0
        first = None
        lowest: int | None = None  # in D's first filled block's page, in bytes
        for i, local in enumerate(local_blocks):
            for h in range(heads_d):
                g = d_engine.first_head(d_rank, index) + h
                # the first P rank that holds head g (replicas hold the same bytes)
                rank = next(r for r in range(p.tp) if p.first_head(r, index) + heads_p > g)
                source = p_sides[rank].kv_caches[name].view(torch.int16)
                g -= p.first_head(rank, index)  # P's local head
                for t in range(n_d):
                    flat = i * n_d + t
                    if flat >= tokens:
                        continue
                    got = got_cache[local, h, t]
                    meant = source[remote_blocks[flat // n_p], g, flat % n_p]
                    differs = (got != meant).nonzero()
                    total += int(got.numel())
                    wrong += int(differs.numel())
                    if i == 0 and differs.numel():
                        _, s_head, s_token, s_element = got_cache.stride()
                        at = h * s_head + t * s_token + int(differs[0, 0]) * s_element
                        at *= got_cache.element_size()
                        lowest = at if lowest is None else min(lowest, at)
                    if first is None and differs.numel():
                        element = int(differs[0, 0])
                        half = int(got.numel()) // 2
                        first = {
                            "local_block": local,
                            "head": h,
                            "global_head": d_engine.first_head(d_rank, index) + h,
                            "token": t,
                            "kv": "K" if element < half else "V",
                            "element": element % half,
                        }
        byte = lowest if lowest is not None else (-1 if wrong else None)
        layers[name] = {
            "elements": total, "wrong": wrong, "first_wrong": first, "first_wrong_byte": byte,
        }  # fmt: skip
    return {"layers": layers, "ok": all(v["wrong"] == 0 for v in layers.values())}


def _untouched(d: Any, blocks: Sequence[int]) -> bool:
    """Whether ``blocks`` of every layer of D are still all zero (nothing was written there)."""
    return all(not bool(cache[list(blocks)].any()) for cache in d.kv_caches.values())


def _listing(folder: Path | None) -> list[str]:
    if folder is None or not folder.exists():
        return []
    return sorted(str(path.relative_to(folder)) for path in folder.rglob("*") if path.is_file())


def _run_pair(child: Any, index: int, pair: Pair) -> dict[str, Any]:
    from safeview.testing import capture_events

    folder = Path(tempfile.mkdtemp(prefix="safeview-manifests-"))
    dirs: dict[str, Path | None] = {"P": None, "D": None}
    if pair.manifests == "shared":
        dirs = {"P": folder, "D": folder}
    elif pair.manifests == "separate":
        dirs = {"P": folder / "p", "D": folder / "d"}
    result: dict[str, Any] = {"pair": asdict(pair), "error": None, "handshake_errors": []}
    sides: list[Any] = []
    stage = "allocate"
    p_id, d_id, peer_id = f"{index}-{pair.name}-P", f"{index}-{pair.name}-D", f"{index}-peer-P"
    schedulers = []
    with capture_events() as events, base._policy(pair.policy):
        try:
            p_fault = "permuted_layer" if pair.fault == "permuted_layer" else None
            d_fault = "permuted_layer" if pair.fault == "permuted_layer_on_d" else None
            p_sides = [_allocate(child, pair.p, p_id, r, p_fault) for r in range(pair.p.tp)]
            d_sides = [_allocate(child, pair.d, d_id, r, d_fault) for r in range(pair.d.tp)]
            peer_sides: list[Any] = []
            peer = Engine(pair.d.layout, pair.d.tp, pair.d.block_size, pair.d.num_blocks,
                          pair.d.model, pair.d.layer_heads)  # fmt: skip
            if pair.healthy_peer:
                peer_sides = [_allocate(child, peer, peer_id, r, None) for r in range(peer.tp)]
            sides = [*p_sides, *peer_sides, *d_sides]
            # ranks that hold the same heads (replicated KV, MLA) hold the same bytes
            for rank, side in enumerate(p_sides):
                base._fill(side, seed=100 * index + pair.p.first_head(rank))
            for rank, side in enumerate(peer_sides):
                base._fill(side, seed=100 * index + 50 + peer.first_head(rank))
            errors: list[Any] = result["handshake_errors"]
            for label, group, tp in (("P", p_sides, pair.p.tp), ("peer", peer_sides, pair.d.tp),
                                     ("D", d_sides, pair.d.tp)):  # fmt: skip
                where = dirs["P" if label == "peer" else label]
                if where is None:
                    os.environ.pop("SAFEVIEW_MANIFEST_DIR", None)
                else:
                    os.environ["SAFEVIEW_MANIFEST_DIR"] = str(where)
                for rank, side in enumerate(group):
                    stage = f"{label}{rank}.register_kv_caches"
                    _connect(child, side, rank, tp, errors)
            os.environ.pop("SAFEVIEW_MANIFEST_DIR", None)
            stage = "serve"
            scheduler, port = _serve(p_sides)
            schedulers.append(scheduler)
            remote_blocks = _remote_blocks(pair)
            requests = [
                {"engine_id": p_id, "port": port, "tp_size": pair.p.tp,
                 "remote_blocks": remote_blocks, "local_blocks": LOCAL_BLOCKS},
            ]  # fmt: skip
            if peer_sides:
                scheduler, port = _serve(peer_sides)
                schedulers.append(scheduler)
                requests.append(
                    {"engine_id": peer_id, "port": port, "tp_size": pair.d.tp,
                     "remote_blocks": list(REMOTE_BLOCKS), "local_blocks": PEER_BLOCKS}
                )  # fmt: skip
            result["reads"] = []
            for rank, d in enumerate(d_sides):
                stage = f"D{rank}.READ"
                read = _read(d, requests)
                read["oracle"] = _oracle(pair.p, pair.d, p_sides, d, rank, remote_blocks,
                                         LOCAL_BLOCKS)  # fmt: skip
                read["untouched"] = _untouched(d, LOCAL_BLOCKS)
                if peer_sides:
                    read["peer_oracle"] = _oracle(peer, pair.d, peer_sides, d, rank,
                                                  REMOTE_BLOCKS, PEER_BLOCKS)  # fmt: skip
                result["reads"].append(read)
        except Exception as error:
            result["error"] = _error(stage, error)
        finally:
            for scheduler in schedulers:
                with contextlib.suppress(Exception):
                    scheduler.shutdown()
            for side in sides:
                if side.connector is not None:
                    with contextlib.suppress(Exception):
                        side.connector.shutdown()
            child.restore_affinity()
            os.environ.pop("SAFEVIEW_MANIFEST_DIR", None)
    result["events"] = base._json_safe(events)
    result["manifest_files"] = {
        label: _listing(where) for label, where in dirs.items() if where is not None
    }
    result["manifest_dir"] = {label: str(where) if where else None for label, where in dirs.items()}
    result["manifest_root"] = str(folder)  # everything the pair wrote is under it
    result["manifests"] = {
        name: json.loads((folder / name).read_text(encoding="utf-8"))
        for name in _listing(folder)
        if name.endswith(".json")
    }
    return result


def _remote_blocks(pair: Pair) -> list[int]:
    """P's blocks one request reads: REMOTE_BLOCKS, or as many of P's smaller blocks as fill
    D's LOCAL_BLOCKS when D's blocks hold several of P's (``N_D = r * N_P``)."""
    ratio = max(1, pair.d.block_size // pair.p.block_size)
    if ratio == 1:
        return list(REMOTE_BLOCKS)
    return list(range(1, 1 + len(LOCAL_BLOCKS) * ratio))


def _main(argv: list[str]) -> None:
    pairs = [_pair_of(item) for item in json.loads(argv[1])]
    child = base._Child()
    results = [_run_pair(child, index, pair) for index, pair in enumerate(pairs)]
    sys.stdout.write(RESULT_PREFIX + json.dumps(results) + "\n")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # UCX may crash the interpreter at exit: the results are out, leave now


if __name__ == "__main__":
    _main(sys.argv)
