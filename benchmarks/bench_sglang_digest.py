"""What ``SAFEVIEW_DIGEST`` costs a sampled room on SGLang 0.5.23's Mooncake P/D path, on CPU
(issue 39, point 3), against the room's transfer alone.

One process with the test harness's import stand-ins (tests/sglang_harness.py), SGLang's real
``MooncakeKVManager`` for P and for D over real CPU ``MHATokenToKVPool``s (``--layers`` layers,
8 KV heads of 128 values, bf16, pages of 64 tokens), Mooncake over TCP loopback. Timed, in
turn each round:

- the transfer: one room of ``--request-pages`` pages sent by SGLang's ``_send_kvcache_generic``
  from P's pool into D's (SGLang alone: P's plain engine);
- P's digest of the room (``safeview.sglang._digest``: the pages through P's manifest, to wire
  bytes), what P's ``send_aux`` hook adds once per sampled room;
- D's side: the wire read, D's pages digested through D's manifest, ``judge`` (its event
  included), what D's ``poll`` hook adds once per sampled room.

The figures are the best of the rounds (the least disturbed on a noisy machine) and medians, in
ms, and each digest over the transfer; with ``SAFEVIEW_DIGEST=sample:N`` a room pays it once in
N. Each round checks what it timed: D's digest of what arrived agrees with P's (``judge``:
``agree``), which it does only if every byte of the room means what P's meant.

Run (needs SGLang 0.5.23 and Mooncake): .venv-sglang/bin/python benchmarks/bench_sglang_digest.py
    [--rounds 15] [--layers 16] [--pages 32] [--request-pages 8]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import sglang_harness  # the import stand-ins, named in its docstring
from bench_sglang import HEAD_DIM, HEADS, PAGE, _pool  # the same pools as the hooks' benchmark


def _ms(values: list[float]) -> dict[str, float]:
    return {
        "best_ms": round(min(values) * 1e3, 3),
        "median_ms": round(statistics.median(values) * 1e3, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--pages", type=int, default=32)
    parser.add_argument("--request-pages", type=int, default=8)
    options = parser.parse_args()
    sglang_harness._stand_ins()
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np
    import torch
    from sglang.srt.disaggregation.mooncake.conn import (  # type: ignore[import-not-found,unused-ignore]
        KVArgsRegisterInfo,
        MooncakeKVBootstrapServer,
    )

    from safeview.manifest.digest import Digest, digest, judge
    from safeview.sglang import describe_pool
    from safeview.sglang._digest import pool_tensors
    from safeview.testing import capture_events

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    MooncakeKVBootstrapServer("127.0.0.1", port)
    sglang_harness.PAGE_SIZE = PAGE
    sglang_harness.LAYERS = options.layers
    server_args = sglang_harness._server_args("prefill", port)
    decode_args = sglang_harness._server_args("decode", port)
    prefill_pool = _pool(options.layers, options.pages, HEADS)
    decode_pool = _pool(options.layers, options.pages, HEADS)
    prefill = sglang_harness._manager(prefill_pool, "prefill", server_args, HEADS)
    decode = sglang_harness._manager(decode_pool, "decode", decode_args, HEADS)
    session = decode.get_session_id()
    info = KVArgsRegisterInfo.from_zmq(decode.build_receiver_registration_message())
    assert prefill._publish_peer_registration(session, info) is None
    src_pages = np.arange(0, 2 * options.request_pages, 2, dtype=np.int32)
    dst_pages = src_pages + 1
    gen = torch.Generator().manual_seed(0)
    for buffer in [*prefill_pool.k_buffer, *prefill_pool.v_buffer]:
        buffer.view(torch.int16).copy_(torch.randint(-(2**15), 2**15, buffer.shape,
                                                     dtype=torch.int16, generator=gen))  # fmt: skip
    topology = {"tp_size": 1, "total_kv_heads": HEADS}
    sides = {}
    for name, pool in (("prefill", prefill_pool), ("decode", decode_pool)):
        manifest = describe_pool(pool, topology=topology)
        sides[name] = (manifest, pool_tensors(pool, manifest.layers))
    tokens = len(src_pages) * PAGE
    executor = ThreadPoolExecutor(4)
    times: dict[str, list[float]] = {"transfer": [], "prefill_digest": [], "decode_judge": []}

    def transfer() -> None:
        for buffer in [*decode_pool.k_buffer, *decode_pool.v_buffer]:
            buffer.zero_()
        start = time.perf_counter()
        status = prefill._send_kvcache_generic(
            mooncake_session_id=session, src_data_ptrs=prefill.kv_args.kv_data_ptrs,
            dst_data_ptrs=info.dst_kv_ptrs, item_lens=prefill.kv_args.kv_item_lens,
            prefill_data_indices=src_pages, dst_data_indices=dst_pages, executor=executor,
        )  # fmt: skip
        times["transfer"].append(time.perf_counter() - start)
        assert status == 0, status

    def prefill_digest() -> bytes:
        manifest, tensors = sides["prefill"]
        start = time.perf_counter()
        wire = digest(manifest, tensors, src_pages.tolist(), num_tokens=tokens).to_wire()
        times["prefill_digest"].append(time.perf_counter() - start)
        return wire

    def decode_judge(wire: bytes) -> None:
        manifest, tensors = sides["decode"]
        with capture_events() as events:
            start = time.perf_counter()
            sent = Digest.from_wire(wire, peer="prefill")
            mine = digest(manifest, tensors, dst_pages.tolist(), num_tokens=sent.num_tokens)
            error = judge(sent, mine, policy="strict", request="room")
            times["decode_judge"].append(time.perf_counter() - start)
        assert error is None, error
        assert [e["verdict"] for e in events if e["event"] == "digest_checked"] == ["agree"]

    transfer()  # warm: Mooncake's session, the digest's kernel choice
    decode_judge(prefill_digest())
    for values in times.values():
        values.clear()
    for round_ in range(options.rounds):
        if round_ % 2:
            transfer()
            wire = prefill_digest()
        else:
            wire = prefill_digest()
            transfer()
        decode_judge(wire)
    room_bytes = len(src_pages) * sum(prefill.kv_args.kv_item_lens)
    best = {name: min(values) for name, values in times.items()}
    print(json.dumps({
        "layers": options.layers, "heads": HEADS, "head_dim": HEAD_DIM, "page_tokens": PAGE,
        "request_pages": len(src_pages), "room_bytes": room_bytes, "rounds": options.rounds,
        **{name: _ms(values) for name, values in times.items()},
        "prefill_digest_over_transfer": round(best["prefill_digest"] / best["transfer"], 3),
        "decode_judge_over_transfer": round(best["decode_judge"] / best["transfer"], 3),
    }, indent=1), flush=True)  # fmt: skip
    os._exit(0)  # SGLang 0.5.23's teardown aborts in libzmq


if __name__ == "__main__":
    main()
