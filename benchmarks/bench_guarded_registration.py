"""Cost per layer of a registration under ``sanitize(layers=..., groups=...)``, at 100 and 1,000
layers (more with ``--layers``): does judging each view against every known layer of its group
grow with the number of layers?

Each layer of one KV-cache group makes one view of its own cache with ``torch.as_strided``, as a
connector's ``register_kv_caches`` does under ``guard_registration``. Two layouts on one CPU
buffer: each layer's blocks a region of its own ("separate"), and every block holding one page of
each layer ("packed", so every layer's blocks span the whole buffer). The figure is the median
over rounds of the whole block (entering the sanitizer, which reads the layers, and one view per
layer), divided by the number of layers; "growth" is the per-layer cost at the largest size over
that at the smallest (1.0: linear in the number of layers; 10: quadratic from 100 to 1,000).
The same loop with no sanitizer is shown for scale.

Run: python benchmarks/bench_guarded_registration.py [--rounds 15] [--layers 100 1000]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch

from safeview import sanitize

NUM_BLOCKS = 16
PAGE = 256

Caches = dict[str, torch.Tensor]


def caches(count: int, packed: bool) -> Caches:
    raw = torch.zeros(count * NUM_BLOCKS * PAGE, dtype=torch.int8)
    if packed:
        return {
            f"layers.{i}": torch.as_strided(raw, (NUM_BLOCKS, PAGE), (count * PAGE, 1), i * PAGE)
            for i in range(count)
        }
    return {
        f"layers.{i}": torch.as_strided(raw, (NUM_BLOCKS, PAGE), (PAGE, 1), i * NUM_BLOCKS * PAGE)
        for i in range(count)
    }


def one_view_each(kv_caches: Caches) -> None:
    for cache in kv_caches.values():
        torch.as_strided(cache, cache.shape, cache.stride(), cache.storage_offset())


def guarded(kv_caches: Caches) -> Callable[[], object]:
    groups = dict.fromkeys(kv_caches, 0)

    def run() -> object:
        with sanitize("strict", layers=kv_caches, groups=groups) as seen:
            one_view_each(kv_caches)
        assert not seen.findings
        return seen

    return run


def median_seconds(fn: Callable[[], object], rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--layers", type=int, nargs="+", default=[100, 1000])
    args = parser.parse_args()
    for packed in (False, True):
        name = "packed" if packed else "separate"
        per_layer = {}
        for count in args.layers:
            kv_caches = caches(count, packed)
            checked = median_seconds(guarded(kv_caches), args.rounds)
            alone = median_seconds(functools.partial(one_view_each, kv_caches), args.rounds)
            per_layer[count] = checked / count
            print(
                f"{name:8} {count:6,} layers: {checked * 1e3:9.1f} ms under sanitize(layers=, "
                f"groups=), {checked / count * 1e6:7.1f} us per layer "
                f"(the loop alone: {alone / count * 1e6:5.1f} us per layer)",
                flush=True,
            )
        low, high = min(args.layers), max(args.layers)
        print(f"{name:8} growth per layer, {high:,} / {low:,} layers: "
              f"{per_layer[high] / per_layer[low]:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
