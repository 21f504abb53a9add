"""Per-call cost of ``make_view`` against the unchecked calls a user would write instead.

The unchecked two-step (vLLM PR #48530's form, what a connector runs per layer)::

    raw = torch.empty(0, dtype=torch.int8).set_(storage)
    torch.as_strided(raw, (num_blocks, page_bytes), (block_stride_bytes, 1), byte_offset)

Each row is measured against the call it replaces: ``make_view`` given a tensor or a storage
against the two-step from that tensor's storage (``.untyped_storage()`` included when the user
holds a tensor); a layout built inside the loop against the same loop with the layout built
before it, with the values a loop rebuilds (the same every call) and with new values every call
(a per-layer loop: each layer's offset is new), and, for scale, the floor of any constructor: a
class call with the same four keywords that returns at once. All rows run in one process,
interleaved round by round (odd rounds in reverse order), and each figure is the median over
rounds of (its time per call / its baseline's time per call in that round), so noise that hits
a whole round cancels. The spread is the interquartile range of those per-round ratios; the two
medians after it are of the first and second half of the rounds: their gap is about what a
repeated run moves the figure by. Absolute times are for orientation only. ``--cpu-time`` times
rounds by the thread's CPU time instead of the wall clock, for a machine shared with other work.

Run: python benchmarks/bench_make_view.py [--rounds 101] [--calls 1000] [--cpu-time]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch

import safeview
from safeview import BlockLayout, make_view

NUM_BLOCKS, PAGE, STRIDE, OFFSET = 1_000, 512, 2_048, 1_024
SHAPE, STRIDES = (NUM_BLOCKS, PAGE), (STRIDE, 1)


class Row(NamedTuple):
    fn: Callable[[], object]
    baseline: str | None  # the row it is divided by; None: a baseline
    target: float | None


def rows(calls: int, rounds: int) -> dict[str, Row]:
    # room for a new offset on every call of every round and of the warm-up
    fresh = 2 * ((2 * rounds * calls + 1_000) // 2)  # two rows take new values
    fresh_offsets = iter(range(OFFSET, OFFSET + fresh))
    kv = torch.zeros(NUM_BLOCKS * STRIDE + fresh, dtype=torch.int8)
    kv16 = kv.view(torch.float16)
    storage = kv.untyped_storage()
    layout = BlockLayout(
        num_blocks=NUM_BLOCKS, page_bytes=PAGE, block_stride_bytes=STRIDE, byte_offset=OFFSET
    )
    int8 = torch.int8

    def two_step_storage() -> object:
        raw = torch.empty(0, dtype=int8).set_(storage)
        return torch.as_strided(raw, SHAPE, STRIDES, OFFSET)

    def two_step_tensor() -> object:  # what a holder of the fp16 cache writes
        raw = torch.empty(0, dtype=int8).set_(kv16.untyped_storage())
        return torch.as_strided(raw, SHAPE, STRIDES, OFFSET)

    # a loop's own variables, as a per-layer loop has them
    num_blocks, page, stride, offset = NUM_BLOCKS, PAGE, STRIDE, OFFSET

    def repeated_values() -> object:
        built = BlockLayout(
            num_blocks=num_blocks, page_bytes=page, block_stride_bytes=stride, byte_offset=offset
        )
        return make_view(kv, built, name="layer", policy="strict")

    def new_values() -> object:
        built = BlockLayout(
            num_blocks=num_blocks,
            page_bytes=page,
            block_stride_bytes=stride,
            byte_offset=next(fresh_offsets),
        )
        return make_view(kv, built, name="layer", policy="strict")

    class _Returns(type):
        # a class call with four keywords that returns at once: what CPython charges for
        # BlockLayout(...) before any of its own work (a metaclass __call__, as BlockLayout's)
        def __call__(cls, num_blocks: int, page_bytes: int, block_stride_bytes: int,
                     byte_offset: int) -> object:  # fmt: skip
            return layout

    class Floor(metaclass=_Returns):
        pass

    def floor_then_view() -> object:
        built = Floor(  # type: ignore[call-arg]
            num_blocks=num_blocks, page_bytes=page, block_stride_bytes=stride, byte_offset=offset
        )
        return make_view(kv, built, name="layer", policy="strict")  # type: ignore[arg-type]

    base, prebuilt = "two-step from the storage", "strict, int8 cache tensor"
    return {
        base: Row(two_step_storage, None, None),
        "two-step from the fp16 tensor": Row(two_step_tensor, None, None),
        prebuilt: Row(lambda: make_view(kv, layout, name="layer", policy="strict"), base, 1.25),
        "warn, int8 cache tensor": Row(
            lambda: make_view(kv, layout, name="layer", policy="warn"), base, None
        ),
        "off, int8 cache tensor": Row(
            lambda: make_view(kv, layout, name="layer", policy="off"), base, 1.05
        ),
        "strict, policy from scope and environment": Row(
            lambda: make_view(kv, layout, name="layer"), base, None
        ),
        "strict, fp16 cache tensor": Row(
            lambda: make_view(kv16, layout, name="layer", policy="strict"),
            "two-step from the fp16 tensor",
            1.1,
        ),
        "strict, UntypedStorage": Row(
            lambda: make_view(storage, layout, name="layer", policy="strict"), base, 1.1
        ),
        "off, UntypedStorage": Row(
            lambda: make_view(storage, layout, name="layer", policy="off"), base, 1.02
        ),
        "strict, layout built per call, same values": Row(repeated_values, prebuilt, 1.2),
        "strict, layout built per call, new values": Row(new_values, prebuilt, 2.0),
        "an empty class call per call, then make_view (floor)": Row(
            floor_then_view, prebuilt, None
        ),
        "same, new values, against the two-step": Row(new_values, base, None),
        "bare torch.as_strided(int8 cache) (for scale)": Row(
            lambda: torch.as_strided(kv, SHAPE, STRIDES, OFFSET), base, None
        ),
        "empty(0).set_(storage, offset, ...) (for scale)": Row(
            lambda: torch.empty(0, dtype=int8, device=storage.device).set_(
                storage, OFFSET, SHAPE, STRIDES
            ),
            base,
            None,
        ),
    }


def _quartiles(values: list[float]) -> tuple[float, float]:
    low, _, high = statistics.quantiles(values, n=4)
    return low, high


def measure(
    rounds: int, calls: int, clock: Callable[[], int] = time.perf_counter_ns
) -> Iterator[tuple[str, float, float, tuple[float, ...]]]:
    """Per row: its median time per call (us), then its figure and spread against its baseline
    (or 1.0 and its time spread, for a baseline)."""
    logging.getLogger("safeview").setLevel(logging.WARNING)  # view_created filtered out
    table = rows(calls, rounds)
    per_call: dict[str, list[float]] = {name: [] for name in table}
    for row in table.values():
        for _ in range(200):
            row.fn()
    for round_index in range(rounds):
        order = list(table.items())
        if round_index % 2:
            order.reverse()
        for name, row in order:
            fn = row.fn
            start = clock()
            for _ in range(calls):
                fn()
            per_call[name].append((clock() - start) / calls / 1_000)
    for name, row in table.items():
        micros = statistics.median(per_call[name])
        if row.baseline is None:
            yield name, micros, 1.0, ()
            continue
        ratios = [t / b for t, b in zip(per_call[name], per_call[row.baseline])]
        half = len(ratios) // 2
        yield (
            name,
            micros,
            statistics.median(ratios),
            (
                *_quartiles(ratios),
                statistics.median(ratios[:half]),
                statistics.median(ratios[half:]),
            ),
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--rounds", type=int, default=101)
    parser.add_argument("--calls", type=int, default=1_000)
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time each round by this thread's CPU time, not the wall clock: on a machine shared "
        "with other work, the time the thread waits for a core is left out",
    )
    args = parser.parse_args()
    clock = time.thread_time_ns if args.cpu_time else time.perf_counter_ns
    table = rows(1, 1)
    print(
        f"torch {torch.__version__}, safeview {safeview.__version__}, {args.rounds} rounds x "
        f"{args.calls} calls ({'CPU time' if args.cpu_time else 'wall clock'}); figure = median "
        "of per-round ratios to the baseline"
    )
    print(f"{'row':48} {'us/call':>7} {'figure':>6}  {'IQR':>11}  {'halves':>11}  baseline")
    verdicts = []
    for name, micros, figure, spread in measure(args.rounds, args.calls, clock):
        row = table[name]
        if row.baseline is None:
            print(f"{name:48} {micros:7.2f} {'(base)':>6}")
            continue
        low, high, first, second = spread
        print(
            f"{name:48} {micros:7.2f} {figure:6.2f}  {low:5.2f}-{high:5.2f}  "
            f"{first:5.2f}/{second:5.2f}  {row.baseline}"
        )
        if row.target is not None:
            verdicts.append((name, figure, row.target))
    print()
    missed = False
    for name, figure, target in verdicts:
        verdict = "met" if figure <= target else f"MISSED by {figure - target:.2f}"
        missed |= figure > target
        print(f"{name:48} {figure:5.2f}x  target <= {target:g}x  {verdict}")
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
