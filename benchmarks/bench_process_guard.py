"""What the process guard (``SAFEVIEW_GUARD``, ``safeview.guard.process.start``) costs, with
verdicts.

- ordinary torch ops (an add, a slice, a view, a reduction: none of them a watched entry point),
  1,000,000 of them with the guard off and 1,000,000 with it on, in one process, side by side:
  the rounds alternate off and on, and the figure is the median over rounds of on / off. Target:
  within 2%.
- ``torch.as_strided`` (a watched entry point, a view that fits) with the guard on against torch's
  own call. Target: at most 3x.
- the four-argument ``Tensor.set_`` and ``torch.frombuffer`` over ``ctypes`` memory at an address
  inside known memory, for orientation (no target).
- a storage's ``resize_`` to fewer bytes under a tensor that fits (the guard finds the tensors
  over it among Python's objects), the tensor young and old, for orientation (no target).
- ``torch.compile`` of a function that uses no watched entry point: the number of graphs it
  compiles with the guard on and off (a counting backend, no compiler needed). Target: the same.

Run: python benchmarks/bench_process_guard.py [--rounds 20] [--ops 1000000]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from safeview.guard import process


def _per_call(fn: Callable[[], object], calls: int) -> float:
    began = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - began) / calls


def _side_by_side(
    plain: Callable[[], object], guarded: Callable[[], object], calls: int, rounds: int
) -> tuple[float, float, float, float]:
    """Median over rounds of guarded / plain per-call time (the guard on only for the guarded
    half of each round; odd rounds in reverse order), its interquartile spread, and the median
    per-call times."""
    ratios, plains, guardeds = [], [], []
    for index in range(rounds):
        order = ("off", "on") if index % 2 == 0 else ("on", "off")
        times = {}
        for state in order:
            if state == "on":
                process.start("strict")
                try:
                    times[state] = _per_call(guarded, calls)
                finally:
                    process.stop()
            else:
                times[state] = _per_call(plain, calls)
        ratios.append(times["on"] / times["off"])
        plains.append(times["off"])
        guardeds.append(times["on"])
    quartiles = statistics.quantiles(ratios, n=4)
    return (
        statistics.median(ratios),
        quartiles[2] - quartiles[0],
        statistics.median(plains),
        statistics.median(guardeds),
    )


def _graphs(guarded: bool) -> int:
    import torch._dynamo

    torch._dynamo.reset()
    graphs: list[Any] = []

    def backend(graph: Any, inputs: Any) -> Any:
        graphs.append(graph)
        return graph.forward

    @torch.compile(backend=backend)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (x * 2 + y).relu()[:, 1:].reshape(-1).sum()

    if guarded:
        process.start("strict")
    try:
        for size in (8, 8, 16, 32):
            step(torch.randn(4, size), torch.randn(4, size))
    finally:
        if guarded:
            process.stop()
    return len(graphs)


def _shrinks(rounds: int) -> None:
    """A storage's ``resize_`` to fewer bytes under the one tensor over it, which fits (allowed):
    the guard finds that tensor among the objects Python tracks, youngest first. Young: made
    just before; old: after a collection moved it to the oldest generation (a walk of all).
    CPU time of this thread (a busy machine stretches the wall time)."""
    import gc

    times: dict[str, list[float]] = {"young": [], "old": [], "torch": []}
    process.start("strict")
    try:
        for _ in range(rounds):
            for age in ("young", "old"):
                tensor = torch.zeros(1_024)
                tensor.resize_(256)  # its only tensor reaches 1,024 bytes of 4,096
                if age == "old":
                    gc.collect()
                began = time.thread_time()
                tensor.untyped_storage().resize_(1_024)
                times[age].append(time.thread_time() - began)
    finally:
        process.stop()
    for _ in range(rounds):
        tensor = torch.zeros(1_024)
        tensor.resize_(256)
        began = time.thread_time()
        tensor.untyped_storage().resize_(1_024)
        times["torch"].append(time.thread_time() - began)
    young, old, own = (statistics.median(times[key]) * 1e3 for key in ("young", "old", "torch"))
    print(
        f"UntypedStorage.resize_ to fewer bytes under a tensor that fits (CPU): torch's own "
        f"{own:.3f} ms; guarded, the tensor young {young:.3f} ms, old {old:.1f} ms "
        f"({len(gc.get_objects()):,} objects tracked; no target)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--ops", type=int, default=1_000_000)
    options = parser.parse_args()
    rounds = options.rounds

    x, y = torch.randn(64), torch.randn(64)

    def ordinary() -> object:  # four ops: add, slice, view, sum
        return (x + y)[1:].view(-1).sum()

    iterations = max(1, options.ops // 4 // rounds)
    verdicts: list[tuple[str, float, float, str]] = []
    ratio, spread, plain, guarded = _side_by_side(ordinary, ordinary, iterations, rounds)
    ops = iterations * 4 * rounds
    print(
        f"ordinary ops ({ops:,} off, {ops:,} on): {plain / 4 * 1e6:.3f} us -> "
        f"{guarded / 4 * 1e6:.3f} us per op, ratio {ratio:.4f} (spread {spread:.4f})"
    )
    verdicts.append(("ordinary ops, guard on / off", ratio, 1.02, "x"))

    kv = torch.zeros(1_000 * 2_048, dtype=torch.int8)
    storage = kv.untyped_storage()
    shape, strides = (1_000, 512), (2_048, 1)
    calls = 20_000

    def bare() -> object:
        return torch.as_strided(kv, shape, strides, 1_024)

    ratio, spread, plain, guarded = _side_by_side(bare, bare, calls, rounds)
    print(
        f"torch.as_strided: {plain * 1e6:.2f} us -> {guarded * 1e6:.2f} us, "
        f"ratio {ratio:.2f} (spread {spread:.2f})"
    )
    verdicts.append(("torch.as_strided, guard on / torch's own", ratio, 3.0, "x"))

    empty = torch.empty(0, dtype=torch.int8)

    def placed() -> object:
        return empty.set_(storage, 1_024, shape, strides)

    ratio, spread, plain, guarded = _side_by_side(placed, placed, calls, rounds)
    print(
        f"Tensor.set_ (4 arguments): {plain * 1e6:.2f} us -> {guarded * 1e6:.2f} us, "
        f"ratio {ratio:.2f} (spread {spread:.2f}; no target)"
    )

    torch.as_strided(kv, shape, strides)  # kv's storage becomes known memory
    window = (ctypes.c_uint8 * 4_096).from_address(kv.data_ptr() + 8_192)

    def raw() -> object:
        return torch.frombuffer(window, dtype=torch.uint8)

    process.start("strict")
    torch.as_strided(kv, shape, strides)
    process.stop()
    ratio, spread, plain, guarded = _side_by_side(raw, raw, calls, rounds)
    print(
        f"torch.frombuffer at a known address: {plain * 1e6:.2f} us -> {guarded * 1e6:.2f} us, "
        f"ratio {ratio:.2f} (spread {spread:.2f}; no target)"
    )

    _shrinks(rounds)

    without, under = _graphs(False), _graphs(True)
    print(f"torch.compile graphs: {without} without the guard, {under} with it")
    verdicts.append(("torch.compile graphs, guard on - off", float(under - without), 0.0, ""))

    print()
    for name, figure, target, unit in verdicts:
        met = figure <= target if unit else figure == target
        verdict = "met" if met else f"MISSED by {figure - target:.4g}"
        print(f"{name:44} {figure:7.4g}{unit}  target {'<=' if unit else '=='} {target:g}{unit}  "
              f"{verdict}")  # fmt: skip


if __name__ == "__main__":
    main()
