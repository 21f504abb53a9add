"""What ``sanitize()`` costs per aten op, on the loops it must not wrap.

``sanitize()`` sees every aten op of its thread and judges each in Python: made for a
registration (a few hundred ops, once per worker), not for the model's hot loops. This
measures the cost on two loops over a small CPU cache, alone and under ``sanitize()``:

1. A decode step: one new token written into each of 32 layer caches, all views of one CPU
   buffer (``cache[block, slot].copy_(token)``: two ``select`` and a ``copy_`` per layer).
2. View-making alone: one ``torch.as_strided`` of each layer's block view (what a registration
   does), 32 per step.

Each step runs alone and under ``sanitize()``, interleaved round by round (the order swapped
every other round); the ratio is the median of the per-round ratios, and the per-op cost is the
median of (time under ``sanitize()`` - time alone) / ops, where ops is the number of aten ops a
step issues, counted by a dispatch mode that only counts. Absolute times are for orientation.

Run: python benchmarks/bench_sanitize.py [--rounds 41] [--steps 200] [--cpu-time]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import safeview
from safeview import sanitize

LAYERS, NUM_BLOCKS, TOKENS, HEADS, HEAD_DIM = 32, 64, 16, 8, 64
PAGE = TOKENS * HEADS * HEAD_DIM * 2  # bytes of one block of one layer (fp16, K or V)


class _Counting(TorchDispatchMode):
    """Counts the aten ops a step issues; changes nothing."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ops = 0

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


def steps() -> dict[str, Callable[[], object]]:
    buffer = torch.zeros(LAYERS * NUM_BLOCKS * PAGE, dtype=torch.int8)
    halves = buffer.view(torch.float16)
    per_layer = NUM_BLOCKS * PAGE // 2
    caches = [
        halves[i * per_layer : (i + 1) * per_layer].view(NUM_BLOCKS, TOKENS, HEADS, HEAD_DIM)
        for i in range(LAYERS)
    ]
    token = torch.ones(HEADS, HEAD_DIM, dtype=torch.float16)
    position = [0]

    def decode() -> object:
        block, slot = divmod(position[0] % (NUM_BLOCKS * TOKENS), TOKENS)
        position[0] += 1
        for cache in caches:
            cache[block, slot].copy_(token)
        return None

    def make_views() -> object:
        for index in range(LAYERS):
            torch.as_strided(buffer, (NUM_BLOCKS, PAGE), (PAGE, 1), index * NUM_BLOCKS * PAGE)
        return None

    return {"decode step, 32 layers": decode, "32 block views": make_views}


def _ops(step: Callable[[], object]) -> int:
    counting = _Counting()
    with counting:
        step()
    return counting.ops


def measure(rounds: int, count: int, clock: Callable[[], int] = time.perf_counter_ns) -> None:
    logging.getLogger("safeview").setLevel(logging.WARNING)
    for name, step in steps().items():

        def alone(step: Callable[[], object] = step) -> object:
            for _ in range(count):
                step()
            return None

        def guarded(step: Callable[[], object] = step) -> object:
            with sanitize():
                for _ in range(count):
                    step()
            return None

        ops = _ops(step)
        for fn in (alone, guarded):
            fn()  # warm-up
        times: dict[str, list[float]] = {"alone": [], "sanitized": []}
        for round_index in range(rounds):
            order = [("alone", alone), ("sanitized", guarded)]
            if round_index % 2:
                order.reverse()
            for label, fn in order:
                start = clock()
                fn()
                times[label].append((clock() - start) / count / 1_000)
        ratios = [s / a for s, a in zip(times["sanitized"], times["alone"])]
        per_op = [(s - a) / ops for s, a in zip(times["sanitized"], times["alone"])]
        low, _, high = statistics.quantiles(ratios, n=4)
        print(
            f"{name:24} {ops:4} ops/step  alone {statistics.median(times['alone']):8.1f} us  "
            f"sanitized {statistics.median(times['sanitized']):8.1f} us  "
            f"{statistics.median(ratios):5.1f}x ({low:.1f}-{high:.1f})  "
            f"+{statistics.median(per_op):5.1f} us per op"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time by this thread's CPU time, not the wall clock (for a shared machine)",
    )
    args = parser.parse_args()
    print(
        f"torch {torch.__version__}, safeview {safeview.__version__}, {args.rounds} rounds x "
        f"{args.steps} steps; {LAYERS} layers of {NUM_BLOCKS} blocks of {PAGE:,} bytes (CPU)"
    )
    measure(args.rounds, args.steps, time.thread_time_ns if args.cpu_time else time.perf_counter_ns)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
