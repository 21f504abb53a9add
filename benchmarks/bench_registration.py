"""Cost of whole-registration checks.

1. ``find_overlaps`` on 1,000 and 10,000 views of one block stride (a packed group): the 10,000
   case should cost at most 15x the 1,000 case (near-linear, not quadratic).
2. ``block_views`` on the 101-layer GLM-5.2-FP8 packed cache on the meta device, against the
   unchecked loop vLLM runs per layer (the two-step ``set_`` + ``as_strided``), interleaved in one
   process: at most 2x.

Run: python benchmarks/bench_registration.py [--rounds 15]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections.abc import Callable

import torch

from safeview import find_overlaps, packed_layouts
from safeview.kv import block_views

GLM_NUM_BLOCKS, GLM_STRIDE = 42_072, 3_098_112


def seconds(fn: Callable[[], object], rounds: int) -> list[float]:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def overlap_scaling(rounds: int) -> float:
    layouts = {
        n: packed_layouts({f"layer.{i}": 64 + i % 7 for i in range(n)}, num_blocks=1_000)
        for n in (1_000, 10_000)
    }
    small: list[float] = []
    large: list[float] = []
    for _ in range(rounds):  # interleaved, so that drift hits both
        small += seconds(lambda: find_overlaps(layouts[1_000]), 1)
        large += seconds(lambda: find_overlaps(layouts[10_000]), 1)
    small_s, large_s = statistics.median(small), statistics.median(large)
    print(f"find_overlaps, one block stride:  1,000 views {small_s * 1e3:8.2f} ms")
    print(f"                                 10,000 views {large_s * 1e3:8.2f} ms")
    ratio = large_s / small_s
    print(f"  10,000 / 1,000 = {ratio:.1f}x (target <= 15x)")
    return ratio


def glm_cache() -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    pages = {}
    for layer in range(79):
        pages[f"model.layers.{layer}.self_attn"] = 36_864
        if layer < 22:
            pages[f"model.layers.{layer}.indexer"] = 8_448
    raw = torch.empty(GLM_NUM_BLOCKS * GLM_STRIDE, dtype=torch.int8, device="meta")
    caches, offset = {}, 0
    for name, page in pages.items():
        caches[name] = torch.as_strided(raw, (GLM_NUM_BLOCKS, page), (GLM_STRIDE, 1), offset)
        offset += page
    return caches, pages


def registration_ratio(rounds: int) -> float:
    caches, pages = glm_cache()

    def unchecked() -> dict[str, torch.Tensor]:
        views = {}
        for name, tensor in caches.items():
            size = tensor.element_size()
            storage = tensor.untyped_storage()
            raw = torch.empty(0, dtype=torch.int8, device=tensor.device).set_(storage)
            views[name] = torch.as_strided(
                raw,
                (GLM_NUM_BLOCKS, pages[name]),
                (tensor.stride(0) * size, 1),
                tensor.storage_offset() * size,
            )
        return views

    def checked() -> object:
        return block_views(caches, pages, num_blocks=GLM_NUM_BLOCKS, packed=pages)

    for fn in (unchecked, checked):
        seconds(fn, 3)
    ratios, base_times, checked_times = [], [], []
    for _ in range(rounds):
        [base] = seconds(unchecked, 1)
        [mine] = seconds(checked, 1)
        base_times.append(base)
        checked_times.append(mine)
        ratios.append(mine / base)
    ratio = statistics.median(ratios)
    base_ms = statistics.median(base_times) * 1e3
    checked_ms = statistics.median(checked_times) * 1e3
    print(f"GLM-5.2-FP8, 101 layers on meta: unchecked loop {base_ms:.2f} ms")
    print(f"                                 block_views    {checked_ms:.2f} ms")
    print(f"  block_views / unchecked = {ratio:.2f}x (target <= 2x)")
    return ratio


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    logging.getLogger("safeview").setLevel(logging.WARNING)
    print(f"torch {torch.__version__}, median of {args.rounds} interleaved rounds")
    scaling = overlap_scaling(args.rounds)
    ratio = registration_ratio(args.rounds * 4)
    return 0 if scaling <= 15 and ratio <= 2 else 1


if __name__ == "__main__":
    raise SystemExit(main())
