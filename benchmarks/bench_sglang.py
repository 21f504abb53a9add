"""What safeview adds to SGLang 0.5.23's Mooncake P/D path, on CPU (issue 39).

One process with the test harness's import stand-ins (tests/sglang_harness.py: SGLang's own
triton stub, an empty torchvision for ``sglang.*``, ``pp_group=None``), SGLang's real
``MooncakeKVManager`` for P and for D over real CPU ``MHATokenToKVPool``s (``--layers`` layers,
8 KV heads of 128 values, bf16, pages of 64 tokens, ``--pages`` pages), Mooncake over TCP.
Each variant is timed where the user pays it, against what SGLang does there alone:

- registration: ``register_buffer_to_engine`` (Mooncake's ``batch_register`` of every KV
  region), deregistered before each round (not timed); with safeview, the same call wrapped
  (the pool's manifest read, every region checked inside its buffer).
- handshake: P taking D's registration, ``_publish_peer_registration`` (SGLang's own state-layout
  check and bookkeeping); with safeview, the same call wrapped (D's manifest read off the wire,
  judged against P's, P's manifest sent back to D on SGLang's socket), the page-layout cache
  emptied before each round, so each judgement is a first one.
- per transfer: one request of ``--request-pages`` pages (every other page, so no two merge)
  sent by SGLang's ``_send_kvcache_generic`` from P's pool into D's over Mooncake (P and D share
  the process's one Mooncake engine, so the session is a loopback over TCP); with safeview,
  through P's judged engine (every row checked against P's and D's pages).

Rounds alternate the variants (each first in turn); the figure is the median with safeview over
the median alone, at most 1.05x to pass. Each round checks what it timed: the request arrived
byte for byte; with safeview, the pair was judged compatible.

Run (needs SGLang 0.5.23 and Mooncake): .venv-sglang/bin/python benchmarks/bench_sglang.py
    [--rounds 21] [--layers 16] [--pages 32] [--request-pages 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import sglang_harness  # the import stand-ins, named in its docstring

PAGE = 64
HEADS, HEAD_DIM = 8, 128


def _pool(layers: int, pages: int) -> Any:
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # type: ignore[import-not-found,unused-ignore]

    return MHATokenToKVPool(
        size=pages * PAGE, page_size=PAGE, dtype=torch.bfloat16, head_num=HEADS,
        head_dim=HEAD_DIM, layer_num=layers, device="cpu", enable_memory_saver=False,
    )  # fmt: skip


def _manager(pool: Any, mode: str, server_args: Any, layers: int) -> Any:
    sglang_harness.PAGE_SIZE = PAGE
    sglang_harness.LAYERS = layers
    return sglang_harness._manager(pool, mode, server_args, HEADS)


def _median(values: list[float]) -> float:
    return statistics.median(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--pages", type=int, default=32)
    parser.add_argument("--request-pages", type=int, default=8)
    options = parser.parse_args()
    sglang_harness._stand_ins()
    import socket

    import numpy as np
    import torch
    from sglang.srt.disaggregation.mooncake.conn import (  # type: ignore[import-not-found,unused-ignore]
        KVArgsRegisterInfo,
        MooncakeKVBootstrapServer,
        MooncakeKVManager,
    )

    import safeview.manifest.diff as diff_module
    import safeview.sglang
    from safeview.sglang import _mooncake

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    MooncakeKVBootstrapServer("127.0.0.1", port)
    server_args = sglang_harness._server_args("prefill", port)

    alone = {name: MooncakeKVManager.__dict__[name] for name in (
        "register_buffer_to_engine", "_publish_peer_registration",
        "build_receiver_registration_message")}  # fmt: skip
    alone_from_zmq = KVArgsRegisterInfo.__dict__["from_zmq"]
    layers = options.layers
    prefill_pool, decode_pool = _pool(layers, options.pages), _pool(layers, options.pages)
    prefill = _manager(prefill_pool, "prefill", server_args, layers)
    decode = _manager(decode_pool, "decode", sglang_harness._server_args("decode", port), layers)
    plain_engine = prefill.engine
    safeview.sglang.install()  # patches the classes; the managers above were made alone
    guarded = {name: MooncakeKVManager.__dict__[name] for name in alone}
    guarded_from_zmq = KVArgsRegisterInfo.__dict__["from_zmq"]

    def use(variant: str) -> None:
        for name in alone:
            setattr(MooncakeKVManager, name, (alone if variant == "alone" else guarded)[name])
        KVArgsRegisterInfo.from_zmq = alone_from_zmq if variant == "alone" else guarded_from_zmq

    # D's registration as P gets it (SGLang's own message, safeview's frame when installed)
    use("safeview")
    safeview.sglang.remember_pool(prefill_pool)
    safeview.sglang.remember_pool(decode_pool)
    for manager in (prefill, decode):
        manager.deregister_buffer_to_engine()
        manager.register_buffer_to_engine()  # the sides made, the regions checked, P's engine
    judged_engine = prefill.engine
    message_safeview = [bytes(f) for f in decode.build_receiver_registration_message()]
    use("alone")
    message_alone = [bytes(f) for f in decode.build_receiver_registration_message()]
    session = decode.get_session_id()
    src_pages = np.arange(0, 2 * options.request_pages, 2, dtype=np.int32)
    dst_pages = src_pages + 1
    gen = torch.Generator().manual_seed(0)
    for buffer in [*prefill_pool.k_buffer, *prefill_pool.v_buffer]:
        buffer.view(torch.int16).copy_(torch.randint(-(2**15), 2**15, buffer.shape,
                                                     dtype=torch.int16, generator=gen))  # fmt: skip

    def sent_right() -> bool:
        rows = slice(int(dst_pages[0]) * PAGE, int(dst_pages[0] + 1) * PAGE)
        back = slice(int(src_pages[0]) * PAGE, int(src_pages[0] + 1) * PAGE)
        return all(
            torch.equal(d[rows].view(torch.int16), p[back].view(torch.int16))  # NaN patterns
            for d, p in zip([*decode_pool.k_buffer, *decode_pool.v_buffer],
                            [*prefill_pool.k_buffer, *prefill_pool.v_buffer])
        )  # fmt: skip

    times: dict[str, dict[str, list[float]]] = {
        what: {"alone": [], "safeview": []} for what in ("registration", "handshake", "transfer")
    }
    from concurrent.futures import ThreadPoolExecutor

    executor = ThreadPoolExecutor(4)
    for round_ in range(options.rounds):
        order = ("alone", "safeview") if round_ % 2 == 0 else ("safeview", "alone")
        for variant in order:
            use(variant)
            # registration
            prefill.deregister_buffer_to_engine()
            if variant == "safeview":
                prefill.__dict__.pop(_mooncake._STATE, None)
                prefill.engine = plain_engine  # so the wrapped call wraps it again
            start = time.perf_counter()
            prefill.register_buffer_to_engine()
            times["registration"][variant].append(time.perf_counter() - start)
            if variant == "alone":
                prefill.engine = plain_engine
            # handshake
            diff_module._CACHE.clear()  # each judgement a first one
            message = message_safeview if variant == "safeview" else message_alone
            info = KVArgsRegisterInfo.from_zmq(message)
            start = time.perf_counter()
            rejected = prefill._publish_peer_registration(session, info)
            times["handshake"][variant].append(time.perf_counter() - start)
            assert rejected is None, rejected
            # per transfer
            for buffer in [*decode_pool.k_buffer, *decode_pool.v_buffer]:
                buffer.zero_()
            start = time.perf_counter()
            status = prefill._send_kvcache_generic(
                mooncake_session_id=session, src_data_ptrs=prefill.kv_args.kv_data_ptrs,
                dst_data_ptrs=info.dst_kv_ptrs, item_lens=prefill.kv_args.kv_item_lens,
                prefill_data_indices=src_pages, dst_data_indices=dst_pages, executor=executor,
            )  # fmt: skip
            times["transfer"][variant].append(time.perf_counter() - start)
            assert status == 0, (variant, status)
            if not sent_right():
                nonzero = [int((b != 0).sum()) for b in decode_pool.k_buffer[:2]]
                raise AssertionError((variant, nonzero, src_pages.tolist(), dst_pages.tolist()))
            if variant == "safeview":
                assert isinstance(prefill.engine, type(judged_engine)), "not judged"
    result = {}
    for what, by_variant in times.items():
        ratio = _median(by_variant["safeview"]) / _median(by_variant["alone"])
        result[what] = {
            "alone_ms": round(_median(by_variant["alone"]) * 1e3, 3),
            "safeview_ms": round(_median(by_variant["safeview"]) * 1e3, 3),
            "ratio": round(ratio, 3),
            "verdict": "pass" if ratio <= 1.05 else "fail",
        }
    print(json.dumps({"layers": layers, "pages": options.pages,
                      "request_pages": options.request_pages, "rounds": options.rounds,
                      **result}, indent=1), flush=True)  # fmt: skip
    os._exit(0)  # SGLang 0.5.23's teardown aborts in libzmq


if __name__ == "__main__":
    main()
