"""A child process for tests/test_nixl_rules_vllm.py: vLLM 0.33's real NIXL connector on CPU
(tests/vllm_nixl_harness.py's workers, handshake and READ) moves a prefill worker's pages into a
decode worker, and the bytes that arrived are judged against ``safeview.diff`` of the two
workers' derived manifests.

The oracle is logical, through each side's own tensors: decode block ``b``'s token
``j * N_P + t`` must hold what prefill block ``remote[b * r + j]``'s token ``t`` holds, for
every head and every element of C (K|V), with ``r = N_D / N_P``. P's pages are random non-zero
bytes. Prints one JSON line (``RESULT_PREFIX``) and ends with ``os._exit`` (UCX may crash at
exit).

Scenarios: ``identical_lbhnc``, ``identical_lbnhc``; ``blocks_32_to_64`` (D's blocks hold two of
P's: vLLM's receive-side reorder runs); ``same_string_layer_1_nhd`` (both report LBHNC, D's layer
1 is read through an NHD view of its own bytes: vLLM cannot see it); ``tp2_to_tp4`` and
``tp4_to_tp2`` (one worker per TP rank in this process, each told its rank the way vLLM's
parallel state would: P's ranks serve their metadata through one side channel, each D rank
does vLLM's own handshake with the P ranks it needs and reads its heads);
``tp2_to_tp4_p_layer_1_nhd`` (P's layer 1 holds its bytes NHD under the LBHNC string: each D
rank's slice of P's page is cut by heads, and gets tokens).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
from collections.abc import Iterator
from typing import Any

import vllm_nixl_harness as harness  # type: ignore[import-not-found,unused-ignore]

RESULT_PREFIX = "SAFEVIEW-LAYOUT-RESULTS "
SCENARIOS = (
    "identical_lbhnc",
    "identical_lbnhc",
    "blocks_32_to_64",
    "same_string_layer_1_nhd",
    "tp2_to_tp4",
    "tp4_to_tp2",
    "tp2_to_tp4_p_layer_1_nhd",
)
HEADS = 4  # the Llama of tests/vllm_nixl_harness.py


def _cases(scenario: str) -> tuple[Any, Any]:
    case = harness.Case
    if scenario == "identical_lbnhc":
        both = case("llama", "LBNHC", (4, 4, 4), 32)
        return both, both
    if scenario == "blocks_32_to_64":
        return case("llama", "LBHNC", (4, 4, 4), 32), case("llama", "LBHNC", (4, 4, 4), 64)
    both = case("llama", "LBHNC", (4, 4, 4), 32)
    return both, both


def _read(
    p: Any,
    d: Any,
    request: str,
    local: list[int],
    remote: list[int],
    p_ranks: list[Any] | None = None,
) -> dict[str, Any]:
    """harness._read with the blocks given: P serves its metadata, D reads ``remote`` into
    ``local`` through vLLM's own start_load_kv / get_finished."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnectorMetadata

    port = harness._free_port()
    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(port)
    with set_current_vllm_config(p.config):
        scheduler = KVConnectorFactory.create_connector(
            config=p.config, role=KVConnectorRole.SCHEDULER, kv_cache_config=p.kv_cache_config
        )
        ranks = p_ranks or [p]
        scheduler.set_xfer_handshake_metadata_pp_aware(
            {(0, rank): side.connector.get_handshake_metadata() for rank, side in enumerate(ranks)}
        )
    groups = len(d.kv_cache_config.kv_cache_groups)
    metadata = NixlConnectorMetadata()
    metadata.add_new_req_to_recv(
        request,
        tuple(list(local) for _ in range(groups)),
        {
            "remote_block_ids": tuple(list(remote) for _ in range(groups)),
            "remote_engine_id": p.name,
            "remote_request_id": request,
            "remote_host": "127.0.0.1",
            "remote_port": port,
            "tp_size": len(p_ranks or [p]),
            "remote_block_size": p.config.cache_config.block_size,
        },
    )
    started, done = time.perf_counter(), False
    try:
        with set_current_vllm_config(d.config):
            while time.perf_counter() - started < 60:
                d.connector.bind_connector_metadata(metadata)
                d.connector.start_load_kv(None)
                d.connector.clear_connector_metadata()
                metadata = NixlConnectorMetadata()
                _, received = d.connector.get_finished(set())
                if request in received:
                    done = True
                    break
                time.sleep(0.02)
    finally:
        scheduler.shutdown()
    return {"done": done}


def _oracle(p: Any, d: Any, local: list[int], remote: list[int], ratio: int) -> dict[str, Any]:
    """Per layer: whether every element arrived where D's own view expects it, and the first
    byte of D's first block's page (in address order) that holds something else."""
    import torch

    wrong: dict[str, int | None] = {}
    for name, cache in d.kv_caches.items():
        sent = p.kv_caches[name]
        n_p = sent.shape[2]
        first: int | None = None
        for position, block in enumerate(local):
            got = cache[block]
            want = got.clone()
            for j in range(ratio):
                want[:, j * n_p : (j + 1) * n_p, :] = sent[remote[position * ratio + j]]
            # compared as bits: random bytes hold NaNs, which are never equal as floats
            mismatch = got.view(torch.int16).ne(want.view(torch.int16)).nonzero().tolist()
            if mismatch and position == 0:
                strides = got.stride()
                first = min(sum(i * s for i, s in zip(index, strides)) for index in mismatch)
                first *= got.element_size()
            if mismatch and first is None:
                first = -1
        wrong[f"0:{name}"] = first
    return {"wrong": wrong, "ok": all(value is None for value in wrong.values())}


def _manifest(side: Any, layout: str) -> Any:
    import safeview
    from safeview.manifest import vllm_axes

    topology = {"tp_rank": 0, "tp_size": 1, "total_kv_heads": 4, "layout": layout}
    return safeview.describe(side.kv_caches, axes=vllm_axes(), topology=topology)


def _scenario(child: Any, index: int, scenario: str) -> dict[str, Any]:

    import safeview

    p_case, d_case = _cases(scenario)
    p = harness._allocate(child, p_case, f"{index}-{scenario}-P")
    d = harness._allocate(child, d_case, f"{index}-{scenario}-D")
    if scenario == "same_string_layer_1_nhd":
        # the same bytes, read with tokens outside heads: what a mis-declared layer does
        name = harness.layer_name(1)
        d.kv_caches[name] = _nhd(d.kv_caches[name])
    harness._fill(p, seed=index)
    harness._connect(child, p, None)
    harness._connect(child, d, None)
    ratio = d_case.block_size // p_case.block_size
    local = [4, 5]
    remote = list(range(1, 1 + len(local) * ratio))
    transfer = _read(p, d, f"request-{index}", local, remote)
    oracle = _oracle(p, d, local, remote, ratio)
    report = safeview.diff(
        _manifest(p, p_case.layout), _manifest(d, d_case.layout), rule="vllm_nixl"
    )
    return {
        "scenario": scenario,
        "transfer": transfer,
        **oracle,
        "compatible": report.compatible,
        "findings": [
            [f.kind, f"{f.receiver_rank}:{f.layer}", f.byte, f.message] for f in report.findings
        ],
    }


@contextlib.contextmanager
def _as_rank(rank: int, size: int) -> Iterator[None]:
    """The worker reads its TP rank and size from vLLM's parallel state when it is built."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    saved = (
        base_worker.get_tensor_model_parallel_rank,
        base_worker.get_tensor_model_parallel_world_size,
    )
    base_worker.get_tensor_model_parallel_rank = lambda: rank
    base_worker.get_tensor_model_parallel_world_size = lambda: size
    try:
        yield
    finally:
        (
            base_worker.get_tensor_model_parallel_rank,
            base_worker.get_tensor_model_parallel_world_size,
        ) = saved


def _held(rank: int, size: int) -> list[int]:
    per = max(1, HEADS // size)
    return list(range(rank * per, rank * per + per)) if size <= HEADS else [rank * HEADS // size]


def _nhd(cache: Any) -> Any:
    """The same bytes read with tokens outside heads."""
    import torch

    heads, width = cache.shape[1], cache.shape[3]
    strides = (cache.stride(0), width, heads * width, 1)
    return torch.as_strided(cache, cache.shape, strides, cache.storage_offset())


def _tp_scenario(child: Any, index: int, scenario: str) -> dict[str, Any]:
    import safeview

    p_tp, d_tp = (4, 2) if scenario == "tp4_to_tp2" else (2, 4)
    engines: dict[str, list[Any]] = {}
    for name, tp in (("P", p_tp), ("D", d_tp)):
        case = harness.Case("llama", "LBHNC", (max(1, HEADS // tp),) * 3, 32)
        engines[name] = []
        for rank in range(tp):
            side = harness._allocate(child, case, f"{index}-{scenario}-{name}")
            if name == "P":
                harness._fill(side, seed=100 * index + rank)
                if scenario.endswith("p_layer_1_nhd"):
                    layer = harness.layer_name(1)
                    side.kv_caches[layer] = _nhd(side.kv_caches[layer])
            with _as_rank(rank, tp):
                harness._connect(child, side, None)
            engines[name].append(side)
    local, remote = [4, 5], [1, 2]
    transfers, wrong = [], {}
    for rank, d in enumerate(engines["D"]):
        transfers.append(
            _read(engines["P"][0], d, f"request-{index}-{rank}", local, remote, engines["P"])
        )
        for name, cache in d.kv_caches.items():
            first = None
            for position, block in enumerate(local):
                got, want = cache[block], cache[block].clone()
                for h, head in enumerate(_held(rank, d_tp)):
                    owner = next(p for p in range(p_tp) if head in _held(p, p_tp))
                    source = engines["P"][owner].kv_caches[name][remote[position]]
                    want[h] = source[_held(owner, p_tp).index(head)]
                import torch

                mismatch = got.view(torch.int16).ne(want.view(torch.int16)).nonzero().tolist()
                if mismatch and first is None:
                    first = (
                        -1
                        if position
                        else min(
                            sum(i * s for i, s in zip(index_, got.stride())) for index_ in mismatch
                        )
                        * got.element_size()
                    )
            if first is not None:
                wrong[f"{rank}:{name}"] = first

    def manifests(name: str, tp: int) -> list[Any]:
        from safeview.manifest import vllm_axes

        return [
            safeview.describe(
                side.kv_caches,
                axes=vllm_axes(),
                topology={"tp_rank": rank, "tp_size": tp, "total_kv_heads": HEADS,
                          "layout": "LBHNC"},
            )
            for rank, side in enumerate(engines[name])
        ]  # fmt: skip

    report = safeview.diff(manifests("P", p_tp), manifests("D", d_tp), rule="vllm_nixl")
    return {
        "scenario": scenario,
        "transfer": {"done": all(t["done"] for t in transfers)},
        "wrong": wrong,
        "ok": not wrong,
        "compatible": report.compatible,
        "findings": [
            [f.kind, f"{f.receiver_rank}:{f.layer}", f.byte, f.message] for f in report.findings
        ],
    }


def main() -> None:
    child = harness._Child()
    results = []
    for index, scenario in enumerate(sys.argv[1:] or SCENARIOS):
        try:
            run = _tp_scenario if scenario.startswith("tp") else _scenario
            results.append(run(child, index, scenario))
        except Exception as error:  # reported, so that the parent shows it
            results.append({"scenario": scenario, "error": traceback.format_exception(error)})
    print(RESULT_PREFIX + json.dumps(results), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
