"""Cost of whole-registration checks, as ratios against unchecked torch calls in the same run.

1. ``find_overlaps`` on 1,000 and 10,000 views of one block stride (a packed group), and of three
   block strides that divide one another interleaved over the same bytes (kernel blocks, manager
   blocks, whole packed blocks): the 10,000 case should cost at most 15x the 1,000 case
   (near-linear, not quadratic). Measured as a user's process runs it: torch imported (its
   objects on the collector's lists) and the cyclic collector on.
2. ``block_views`` on the GLM-5.2-FP8 packed cache on the meta device (101 layers, and the same
   group repeated to 1,010 and 10,100 layers), with the full report, against vLLM 0.33's
   unchecked loop (one four-argument ``set_`` per layer): at most 1.15x at every size, with
   ``packed`` given as a set and as the tuple of layer names a user writes. As users pay it:
   each call (the loop's and ``block_views``') gets new tensors, a new dict of page sizes and a
   new collection of names, made before its timer starts; a connector registers once, so
   nothing a previous call saw can be reused.
3. For scale, the same unchecked loop under ``sanitize()``, and under a dispatch mode that only
   passes each op on, built as safeview's guard is (``__torch_dispatch__`` set after the class
   is made, so torch does not wrap it): the floor of any dispatch-level guard. The loop makes one
   view per layer and nothing else, so it shows the per-op cost at its worst; the 3x target is
   measured on vLLM's real registration by ``benchmarks/bench_vllm.py``. Outside a sanitizer
   nothing is installed: no dispatch mode is active.

Each pair runs interleaved round by round (the order swapped every other round), and the figure
is the median of the per-round ratios, so noise that hits a whole round cancels. The spread is
the interquartile range of those ratios; the two medians after it are of the first and second
half of the rounds: their gap is about what a repeated run moves the figure by. Where the
cyclic collector ran a full collection (it scans torch's ~175,000 objects, about 100 ms here)
inside a timed call, the line says in how many rounds it fell into the baseline / the checked
call: those rounds are the slow tail of the spread.

Run: python benchmarks/bench_registration.py [--rounds 41] [--part block_views]
(``--part`` runs one of find_overlaps, block_views, scale alone)
"""

from __future__ import annotations

import argparse
import gc
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

from safeview import BlockLayout, find_overlaps, packed_layouts, sanitize
from safeview.kv import block_views

GLM_NUM_BLOCKS = 42_072

Caches = dict[str, torch.Tensor]


class _FullCollections:
    """Counts the cyclic collector's full (generation 2) collections, only watching: the
    benchmark, like the library, leaves the collector as the process has it."""

    def __init__(self) -> None:
        self.count = 0
        gc.callbacks.append(self._seen)

    def _seen(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] == 2:
            self.count += 1


_FULL = _FullCollections()


def ratio(
    name: str,
    baseline: Callable[..., object],
    checked: Callable[..., object],
    rounds: int,
    fresh: Callable[[], tuple[Any, ...]] | None = None,
) -> float:
    """Median over interleaved rounds of checked / baseline; prints times and the spread, and in
    how many rounds a full collection of the collector fell into each side. With ``fresh``,
    each call gets arguments of its own, made by ``fresh()`` before its timer starts (new values
    each call, as a user's one registration per process has them)."""

    def arguments() -> tuple[Any, ...]:
        return fresh() if fresh is not None else ()

    for fn in (baseline, checked):
        fn(*arguments())
    ratios, base_times, checked_times = [], [], []
    collected = {baseline: 0, checked: 0}
    for round_index in range(rounds):
        order = (baseline, checked) if round_index % 2 == 0 else (checked, baseline)
        times = {}
        for fn in order:
            given = arguments()
            before = _FULL.count
            start = time.perf_counter()
            fn(*given)
            times[fn] = time.perf_counter() - start
            collected[fn] += _FULL.count > before
        base_times.append(times[baseline])
        checked_times.append(times[checked])
        ratios.append(times[checked] / times[baseline])
    low, _, high = statistics.quantiles(ratios, n=4)
    half = len(ratios) // 2
    first, second = statistics.median(ratios[:half]), statistics.median(ratios[half:])
    base_ms = statistics.median(base_times) * 1e3
    checked_ms = statistics.median(checked_times) * 1e3
    figure = statistics.median(ratios)
    print(
        f"  {name}: {base_ms:8.2f} ms -> {checked_ms:8.2f} ms = {figure:5.2f}x "
        f"(IQR {low:.2f}-{high:.2f}, halves {first:.2f}/{second:.2f}, {rounds} rounds"
        + (
            f"; full collections in {collected[baseline]} / {collected[checked]} rounds)"
            if collected[baseline] or collected[checked]
            else ")"
        )
    )
    return figure


def glm_cache(repeat: int) -> tuple[Caches, dict[str, int]]:
    """GLM-5.2-FP8's packed group (79 MLA pages of 36,864 and 22 indexer pages of 8,448 bytes
    per block), ``repeat`` times over in one block, on meta."""
    pages = {}
    for copy in range(repeat):
        for layer in range(79):
            pages[f"{copy}.model.layers.{layer}.self_attn"] = 36_864
            if layer < 22:
                pages[f"{copy}.model.layers.{layer}.indexer"] = 8_448
    stride = sum(pages.values())
    raw = torch.empty(GLM_NUM_BLOCKS * stride, dtype=torch.int8, device="meta")
    caches, offset = {}, 0
    for name, page in pages.items():
        caches[name] = torch.as_strided(raw, (GLM_NUM_BLOCKS, page), (stride, 1), offset)
        offset += page
    return caches, pages


def vllm_loop(caches: Caches, pages: dict[str, int]) -> Caches:
    """What vLLM 0.33's offloading worker runs per layer, unchecked."""
    views = {}
    for name, ref in caches.items():
        elem = ref.element_size()
        views[name] = torch.tensor([], dtype=torch.int8, device=ref.device).set_(
            ref.untyped_storage(),
            ref.storage_offset() * elem,
            (GLM_NUM_BLOCKS, pages[name]),
            (ref.stride(0) * elem, 1),
        )
    return views


def mixed(count: int) -> dict[str, BlockLayout]:
    """View i holds byte i of each of its blocks; a third each at strides of 16,384, 32,768 and
    65,536 bytes: interleaved over the same bytes, and disjoint."""

    def stride(i: int) -> int:
        return 16_384 if i < count // 3 else 32_768 if i < 2 * count // 3 else 65_536

    return {
        f"layer.{i}": BlockLayout(
            num_blocks=1_000, page_bytes=1, block_stride_bytes=stride(i), byte_offset=i
        )
        for i in range(count)
    }


class PassOn(TorchDispatchMode):  # type: ignore[no-untyped-call,unused-ignore]
    """A dispatch mode that only passes each op on: the floor of a dispatch-level guard."""


def _pass_on(self: PassOn, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
    return func(*args, **(kwargs or {}))


# As safeview.guard._torch_dispatch does for its guard: set after the class is made, so that
# TorchDispatchMode.__init_subclass__ does not wrap it in torch._disable_dynamo.
PassOn.__torch_dispatch__ = _pass_on  # type: ignore[method-assign,assignment,unused-ignore]


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument(
        "--part",
        choices=("all", "find_overlaps", "block_views", "scale"),
        default="all",
        help="run one part only (a short run)",
    )
    args = parser.parse_args()
    logging.getLogger("safeview").setLevel(logging.WARNING)
    print(
        f"torch {torch.__version__}; medians of interleaved rounds; collector "
        f"{'on' if gc.isenabled() else 'off'}, {len(gc.get_objects()):,} objects tracked"
    )
    verdicts: list[tuple[str, float, float]] = []
    if args.part in ("all", "find_overlaps"):
        overlaps_part(args.rounds, verdicts)
    if args.part in ("all", "block_views"):
        block_views_part(args.rounds, verdicts)
    outside = None
    if args.part in ("all", "scale"):
        outside = scale_part(args.rounds)

    print()
    failed = False
    for name, value, target in verdicts:
        verdict = "met" if value <= target else f"MISSED by {value - target:.2f}"
        failed |= value > target
        print(f"{name:45s} {value:6.2f}x  target <= {target:g}x  {verdict}")
    return 1 if failed or outside is not None else 0


def overlaps_part(rounds: int, verdicts: list[tuple[str, float, float]]) -> None:
    layouts = {
        n: packed_layouts({f"layer.{i}": 64 + i % 7 for i in range(n)}, num_blocks=1_000)
        for n in (1_000, 10_000)
    }
    scaling = ratio(
        "find_overlaps 1,000 -> 10,000 views, one stride",
        lambda: find_overlaps(layouts[1_000]),
        lambda: find_overlaps(layouts[10_000]),
        rounds * 3,
    )
    verdicts.append(("find_overlaps, one stride, 10,000 / 1,000", scaling, 15.0))
    mixed_layouts = {n: mixed(n) for n in (1_000, 10_000)}
    mixed_scaling = ratio(
        "find_overlaps 1,000 -> 10,000 views, 3 dividing strides",
        lambda: find_overlaps(mixed_layouts[1_000]),
        lambda: find_overlaps(mixed_layouts[10_000]),
        rounds * 3,
    )
    verdicts.append(("find_overlaps, 3 strides, 10,000 / 1,000", mixed_scaling, 15.0))


def block_views_part(rounds: int, verdicts: list[tuple[str, float, float]]) -> None:
    for repeat, count in ((1, rounds * 4), (10, rounds), (100, rounds)):
        layers = 101 * repeat
        for kind, collection in (("a set", set), ("a tuple", tuple)):

            def users(repeat: int = repeat, collection: type = collection) -> tuple[Any, ...]:
                # what a connector has at its one registration: new tensors, a new dict of
                # page sizes, the packed layers' names as it collected them
                caches, pages = glm_cache(repeat)
                return caches, pages, collection(pages)

            figure = ratio(
                f"GLM packed, {layers:,} layers, packed as {kind}, new values each call: "
                "vLLM loop -> block_views",
                lambda caches, pages, _: vllm_loop(caches, pages),
                lambda caches, pages, packed: block_views(
                    caches, pages, num_blocks=GLM_NUM_BLOCKS, packed=packed
                ),
                count,
                fresh=users,
            )
            verdicts.append((f"block_views / vLLM loop, {layers:,}, {kind}", figure, 1.15))


def scale_part(rounds: int) -> object:
    """The unchecked loop under ``sanitize()`` and under a pass-on mode; returns the dispatch
    mode active outside a sanitizer (None: nothing runs there)."""
    caches, pages = glm_cache(1)

    def sanitized() -> object:
        with sanitize():
            return vllm_loop(caches, pages)

    def passed_on() -> object:
        with PassOn():  # type: ignore[no-untyped-call,unused-ignore]
            return vllm_loop(caches, pages)

    for name, fn in (("under sanitize()", sanitized), ("under a pass-on mode", passed_on)):
        ratio(
            f"GLM packed, 101 layers: vLLM loop -> {name} (for scale; no target)",
            lambda: vllm_loop(caches, pages),
            fn,
            rounds * 4,
        )
    outside = _get_current_dispatch_mode()
    print(f"  outside a sanitizer the dispatch mode is {outside!r}: nothing runs there")
    return outside


if __name__ == "__main__":
    raise SystemExit(main())
