"""Cost of guarding vLLM 0.33's real registration, in vLLM's own environment.

GLM-5.2-FP8's KV cache on one rank (101 layers, 130,343,768,064 bytes on the meta device),
planned and allocated by vLLM's own code (tests/vllm_harness.py), registered by vLLM's real
``OffloadingConnectorWorker.register_kv_caches``:

1. under ``sanitize()`` / without it: at most 3x (it runs once, at start-up);
2. what the vLLM plugin adds in all (``check_registration`` first, then the worker under
   ``sanitize()``) / the worker alone;
3. for scale, a dispatch mode that does nothing but pass every op on / the worker alone: the
   floor any dispatch-level guard pays in this torch.

Each pair runs interleaved round by round; the figure is the median of the per-round ratios.

Run (needs vLLM): .venv-vllm/bin/python benchmarks/bench_vllm.py [--rounds 30]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))

import vllm_harness as harness  # type: ignore[import-not-found,unused-ignore]
from torch.utils._python_dispatch import TorchDispatchMode

from safeview import sanitize
from safeview.vllm import check_registration


class _PassOn(TorchDispatchMode):  # type: ignore[no-untyped-call,unused-ignore]
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    logging.getLogger("vllm").setLevel(logging.ERROR)
    logging.getLogger("safeview").setLevel(logging.WARNING)
    built = harness.build("glm_packed", "meta")
    print(f"vLLM {harness.VLLM_VERSION}, GLM-5.2-FP8: {len(built.kv_caches)} layers, "
          f"{built.storage_nbytes:,} bytes on meta")  # fmt: skip

    def worker() -> None:
        harness.make_worker(built).register_kv_caches(built.kv_caches)

    def sanitized() -> None:
        with sanitize():
            worker()

    def plugin() -> None:
        check_registration(built.kv_caches, built.kv_cache_config)
        sanitized()

    def passing_on() -> None:
        with _PassOn():  # type: ignore[no-untyped-call,unused-ignore]
            worker()

    variants: dict[str, Callable[[], None]] = {
        "worker under sanitize()": sanitized,
        "check_registration + worker under sanitize()": plugin,
        "worker under a do-nothing dispatch mode": passing_on,
    }
    for fn in (worker, *variants.values()):
        fn()
    ratios: dict[str, list[float]] = {name: [] for name in variants}
    base_times = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        worker()
        base = time.perf_counter() - start
        base_times.append(base)
        for name, fn in variants.items():
            start = time.perf_counter()
            fn()
            ratios[name].append((time.perf_counter() - start) / base)
    print(f"the worker alone: {statistics.median(base_times) * 1e3:.2f} ms (median)")
    figure = statistics.median(ratios["worker under sanitize()"])
    for name, values in ratios.items():
        print(f"  {name:48s} {statistics.median(values):5.2f}x")
    verdict = "met" if figure <= 3 else f"MISSED by {figure - 3:.2f}"
    print(f"worker under sanitize() / alone = {figure:.2f}x, target <= 3x: {verdict}")
    return 0 if figure <= 3 else 1


if __name__ == "__main__":
    raise SystemExit(main())
