"""Per-call cost of ``make_view`` against the unchecked calls vLLM runs today.

Baseline (what vLLM's offloading worker runs per layer, unchecked)::

    raw = torch.empty(0, dtype=torch.int8).set_(storage)
    torch.as_strided(raw, (num_blocks, page_bytes), (block_stride_bytes, 1), byte_offset)

Every variant runs in the same process, interleaved round by round, and each is reported as the
median over rounds of (its per-call time / the baseline's per-call time in that round), so machine
noise that hits a whole round cancels out. Absolute times are printed for orientation only.

Run: python benchmarks/bench_make_view.py [--rounds 60] [--calls 2000]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections.abc import Callable

import torch

import safeview
from safeview import BlockLayout, make_view

TARGETS = {
    "strict": 1.25,
    "off": 1.05,
    "strict, BlockLayout built per call": 1.6,
    "strict, UntypedStorage target": 1.1,
    "off, UntypedStorage target": 1.02,
}


def variants() -> dict[str, Callable[[], object]]:
    num_blocks, page, stride, offset = 1_000, 512, 2_048, 1_024
    kv = torch.zeros(num_blocks * stride, dtype=torch.int8)
    storage = kv.untyped_storage()
    layout = BlockLayout(
        num_blocks=num_blocks, page_bytes=page, block_stride_bytes=stride, byte_offset=offset
    )
    shape, strides = (num_blocks, page), (stride, 1)
    device = storage.device

    def baseline() -> object:
        raw = torch.empty(0, dtype=torch.int8).set_(storage)
        return torch.as_strided(raw, shape, strides, offset)

    def built_per_call() -> object:
        spec = BlockLayout(
            num_blocks=num_blocks, page_bytes=page, block_stride_bytes=stride, byte_offset=offset
        )
        return make_view(kv, spec, name="layer", policy="strict")

    return {
        "baseline (empty(0).set_(storage) + as_strided)": baseline,
        "strict": lambda: make_view(kv, layout, name="layer", policy="strict"),
        "warn": lambda: make_view(kv, layout, name="layer", policy="warn"),
        "off": lambda: make_view(kv, layout, name="layer", policy="off"),
        "strict, BlockLayout built per call": built_per_call,
        "strict, UntypedStorage target": lambda: make_view(storage, layout, policy="strict"),
        "off, UntypedStorage target": lambda: make_view(storage, layout, policy="off"),
        "empty(0, device=...).set_(storage) + as_strided (for scale)": lambda: torch.as_strided(
            torch.empty(0, dtype=torch.int8, device=device).set_(storage), shape, strides, offset
        ),
        "four-argument set_, were it checked first (for scale)": lambda: torch.empty(
            0, dtype=torch.int8
        ).set_(storage, offset, shape, strides),
        "strict, policy from scope and env": lambda: make_view(kv, layout, name="layer"),
        "bare torch.as_strided(kv, ...) (for scale)": lambda: torch.as_strided(
            kv, shape, strides, offset
        ),
    }


def measure(rounds: int, calls: int) -> dict[str, tuple[float, float]]:
    logging.getLogger("safeview").setLevel(logging.WARNING)  # view_created filtered out
    runs = variants()
    per_call: dict[str, list[float]] = {name: [] for name in runs}
    for fn in runs.values():
        for _ in range(200):
            fn()
    for round_index in range(rounds):
        order = list(runs.items())
        if round_index % 2:
            order.reverse()
        for name, fn in order:
            start = time.perf_counter_ns()
            for _ in range(calls):
                fn()
            per_call[name].append((time.perf_counter_ns() - start) / calls / 1_000)
    baseline = per_call[next(iter(runs))]
    return {
        name: (
            statistics.median(times),
            statistics.median(t / b for t, b in zip(times, baseline)),
        )
        for name, times in per_call.items()
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--calls", type=int, default=2_000)
    args = parser.parse_args()
    results = measure(args.rounds, args.calls)
    print(
        f"torch {torch.__version__}, safeview {safeview.__version__}, "
        f"{args.rounds} rounds x {args.calls} calls, median per call"
    )
    print(f"{'variant':48} {'us/call':>8} {'ratio':>6} {'target':>7}")
    missed = []
    for name, (micros, ratio) in results.items():
        target = TARGETS.get(name)
        verdict = "" if target is None else f"<={target:.2f}"
        if target is not None and ratio > target:
            missed.append(name)
            verdict += " MISSED"
        print(f"{name:48} {micros:8.2f} {ratio:6.2f} {verdict:>7}")
    # Building the layout in the loop, against the prebuilt case (target 1.2x): the same-round
    # ratio of the two medians is enough here, both being per-call medians over the same rounds.
    built = results["strict, BlockLayout built per call"][1] / results["strict"][1]
    verdict = "met" if built <= 1.2 else f"MISSED by {built - 1.2:.2f}"
    print(f"\nBlockLayout built per call / prebuilt: {built:.2f}x, target <= 1.2x: {verdict}")
    return 1 if missed or built > 1.2 else 0


if __name__ == "__main__":
    raise SystemExit(main())
