"""Cost of checking a prepared descriptor list, against building that list in Python.

A connector prepares its local descriptors once: one row per layer and block. For the
GLM-5.2-FP8 cache of one rank (101 layers packed block-major, 79 MLA pages of 36,864 bytes and
22 indexer pages of 8,448 in each 3,098,112-byte block, 42,072 blocks) that is 4.2 million rows.
The baseline builds them as vLLM's NIXL worker did before strided rows (a Python loop over
regions and blocks appending ``(address, length, device)`` tuples); the figure is
``check_descriptors`` on that prepared list (list in, findings out, strict policy, the memory
map's index made afresh each round), divided by the build. Target: at most 1.0.

For scale, also timed in the same rounds: the same rows as an ``N x 3`` uint64 array, and as
vLLM 0.33 prepares them, 101 strided rows ``(address, length, device, stride, count)``.

Rounds run interleaved (the order swapped every other round) and the figure is the median of
the per-round ratios, so noise that hits a whole round cancels; the spread is the
interquartile range of those ratios. The cyclic collector stays on, as in a serving process.

Run: python benchmarks/bench_transfer.py [--rounds 9]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np

from safeview.transfer import MemoryMap, StorageSpan, ViewSpan, check_descriptors

NUM_BLOCKS = 42_072
MLA_PAGE_BYTES = 36_864
INDEXER_PAGE_BYTES = 8_448
BASE_ADDRESS = 0x7F00_0000_0000
# 22 layers with an indexer (MLA page, then indexer page), then 57 MLA-only layers
PAGES = [MLA_PAGE_BYTES, INDEXER_PAGE_BYTES] * 22 + [MLA_PAGE_BYTES] * 57
BLOCK_STRIDE_BYTES = sum(PAGES)
assert len(PAGES) == 101
assert BLOCK_STRIDE_BYTES == 3_098_112


def glm_map() -> MemoryMap:
    """The cache as plain integers: one storage, one view per layer, packed block-major."""
    views, offset = [], 0
    for layer, page in enumerate(PAGES):
        views.append(
            ViewSpan(f"model.layers.{layer}", "kv", offset, page, BLOCK_STRIDE_BYTES, NUM_BLOCKS)
        )
        offset += page
    storage = StorageSpan("kv", BASE_ADDRESS, NUM_BLOCKS * BLOCK_STRIDE_BYTES, "cuda:0")
    return MemoryMap((storage,), tuple(views))


def build_rows() -> list[tuple[int, int, int]]:
    """One (address, length, device) tuple per layer and block, built as a connector's Python
    loop builds its local descriptor list."""
    rows = []
    device = 0
    offsets = [sum(PAGES[:layer]) for layer in range(len(PAGES))]
    for layer, page in enumerate(PAGES):
        base = BASE_ADDRESS + offsets[layer]
        for block in range(NUM_BLOCKS):
            rows.append((base + block * BLOCK_STRIDE_BYTES, page, device))
    return rows


def strided_rows() -> np.ndarray:
    """vLLM 0.33's local rows: one strided row per layer."""
    offsets = [sum(PAGES[:layer]) for layer in range(len(PAGES))]
    return np.array(
        [
            (BASE_ADDRESS + offsets[layer], page, 0, BLOCK_STRIDE_BYTES, NUM_BLOCKS)
            for layer, page in enumerate(PAGES)
        ],
        dtype=np.uint64,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()

    prepared = build_rows()
    as_array = np.array(prepared, dtype=np.uint64)
    strided = strided_rows()

    def check(rows: object) -> Callable[[], object]:
        def run() -> object:
            found = check_descriptors(rows, glm_map(), policy="strict")
            assert found == []
            return found

        return run

    timed: dict[str, Callable[[], object]] = {
        "build the list in Python": build_rows,
        "check the list of tuples": check(prepared),
        "check it as an N x 3 uint64 array": check(as_array),
        "check vLLM 0.33's 101 strided rows": check(strided),
    }
    for fn in timed.values():  # warm up
        fn()
    times: dict[str, list[float]] = {name: [] for name in timed}
    ratios = []
    names = list(timed)
    for round_index in range(args.rounds):
        order = names if round_index % 2 == 0 else names[::-1]
        for name in order:
            start = time.perf_counter()
            timed[name]()
            times[name].append(time.perf_counter() - start)
        ratios.append(times["check the list of tuples"][-1] / times["build the list in Python"][-1])

    rows = len(prepared)
    print(
        f"GLM-5.2-FP8, one rank: {len(PAGES)} layers x {NUM_BLOCKS:,} blocks = {rows:,} rows; "
        f"{args.rounds} rounds, median (fastest-slowest)"
    )
    for name in names:
        values = times[name]
        print(
            f"  {name:36s} {statistics.median(values) * 1e3:9.1f} ms "
            f"({min(values) * 1e3:.1f}-{max(values) * 1e3:.1f})"
        )
    figure = statistics.median(ratios)
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [figure] * 3
    verdict = "met" if figure <= 1.0 else f"MISSED by {figure - 1.0:.2f}"
    print(
        f"check / build (list of tuples): {figure:.2f} "
        f"(interquartile {quartiles[0]:.2f}-{quartiles[2]:.2f})  target <= 1.0  {verdict}"
    )
    return 0 if figure <= 1.0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
