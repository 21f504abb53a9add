"""What a manifest on the wire costs (issue 28), with verdicts.

For a 100-layer model as vLLM 0.33 holds it (``[B, H, N, K|V]`` bf16 views of one buffer, 8 KV
heads of 128, 16 tokens, TP 2; derived on meta as the plugin derives it at registration):

1. bytes: the manifest on the wire (``to_wire``; target: a few KB on top of vLLM's handshake
   payload) and the request token in ``kv_transfer_params`` (target: at most 100 bytes);
2. P's side, once per handshake served: ``to_wire`` of its ``Derived``;
3. D's side, once per P rank met: ``from_wire`` (parse, rebuild, fingerprint checked) and
   ``judge_peer`` (the diff and its event), against the same work's ratio to ``to_wire``;
4. D's side, per request once the fingerprint is judged: ``parse_request_token`` of a token as it
   arrives (a new ``str`` each time, as a request's JSON brings it) and ``token_matches`` against
   the judged manifest (target: under 10 us).

What (2) and (3) add to vLLM's own handshake is measured on vLLM's real NIXL connector by
``benchmarks/bench_handshake.py``; here the wire alone. Each figure is a median over rounds.
Run: python benchmarks/bench_wire.py [--rounds 31]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections.abc import Callable

import torch

from safeview.manifest import Derived, derive, vllm_axes
from safeview.manifest.peer import judge_peer
from safeview.manifest.wire import (
    from_wire,
    parse_request_token,
    request_token,
    to_wire,
    token_matches,
)

LAYERS, HEADS, TOKENS, HEAD_SIZE, BLOCKS, TP = 100, 8, 16, 128, 1000, 2
TOKEN_LIMIT_BYTES = 100
WIRE_LIMIT_BYTES = 8 * 1024  # "a few KB"
CHECK_LIMIT_S = 10e-6


def _derived(rank: int) -> Derived:
    heads = HEADS // TP
    page = 2 * heads * TOKENS * HEAD_SIZE * 2
    raw = torch.empty(LAYERS * BLOCKS * page, dtype=torch.int8, device="meta").view(torch.bfloat16)
    per_layer = BLOCKS * page // 2
    caches = {
        f"model.layers.{i}.self_attn.attn": raw[i * per_layer : (i + 1) * per_layer].view(
            BLOCKS, heads, TOKENS, 2 * HEAD_SIZE
        )
        for i in range(LAYERS)
    }
    topology = {"tp_rank": rank, "tp_size": TP, "total_kv_heads": HEADS, "engine": "prefill"}
    return derive(caches, axes=vllm_axes(), topology=topology)


def median_s(fn: Callable[[], object], rounds: int, inner: int = 1) -> float:
    fn()
    times = []
    for _ in range(rounds):
        began = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - began) / inner)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=31)
    rounds = parser.parse_args().rounds
    # the events of a judgement are built as a server with INFO logging builds them
    logging.getLogger("safeview").setLevel(logging.INFO)
    logging.getLogger("safeview").addHandler(logging.NullHandler())

    sender = _derived(0)
    receiver = _derived(0).manifest()
    wire = to_wire(sender)
    token = request_token(sender)
    fields = {"engine": "decode", "remote_engine": "prefill", "when": "handshake"}

    encode = median_s(lambda: to_wire(sender), rounds)

    def receive() -> None:
        judge_peer(receiver, [from_wire(wire, peer="prefill")], against="handshake",
                   fields=fields, policy="warn")  # fmt: skip

    decode = median_s(receive, rounds)

    def check() -> bool:
        arrived = "".join(token)  # a new str each request, as its JSON brings it
        return token_matches(parse_request_token(arrived, peer="prefill"), receiver)

    assert check()
    per_request = median_s(check, rounds, inner=1000)

    verdicts = [
        ("wire bytes, 100 layers", f"{len(wire):,} B", len(wire) <= WIRE_LIMIT_BYTES,
         f"<= {WIRE_LIMIT_BYTES:,} B"),
        ("request token", f"{len(token.encode())} B", len(token.encode()) <= TOKEN_LIMIT_BYTES,
         f"<= {TOKEN_LIMIT_BYTES} B"),
        ("P: to_wire per handshake", f"{encode * 1e3:.3f} ms", True, "none"),
        ("D: from_wire + judge_peer per P rank", f"{decode * 1e3:.3f} ms "
         f"({decode / encode:.1f}x to_wire)", True, "none (see bench_vllm_nixl.py)"),
        ("D: per-request token check", f"{per_request * 1e6:.2f} us",
         per_request <= CHECK_LIMIT_S, f"<= {CHECK_LIMIT_S * 1e6:.0f} us"),
    ]  # fmt: skip
    for name, figure, ok, target in verdicts:
        verdict = (
            "n/a" if target == "none" or target.startswith("none") else "PASS" if ok else "FAIL"
        )
        print(f"{name:40s} {figure:30s} target {target:28s} {verdict}")
    return 0 if all(ok for _, _, ok, _ in verdicts) else 1


if __name__ == "__main__":
    raise SystemExit(main())
