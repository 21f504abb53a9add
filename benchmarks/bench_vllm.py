"""Cost of guarding vLLM 0.33's real registration, in vLLM's own environment.

GLM-5.2-FP8's KV cache on one rank (101 layers, 130,343,768,064 bytes on the meta device),
planned and allocated by vLLM's own code (tests/vllm_harness.py), registered by vLLM's real
``OffloadingConnectorWorker.register_kv_caches``:

1. under ``sanitize()`` / without it: at most 3x (it runs once, at start-up);
2. what the vLLM plugin costs in all (its guarded ``register_kv_caches``: the offloading
   worker's views judged first, then the worker under ``sanitize()`` told the layers) / the
   worker alone;
3. for scale, a dispatch mode that does nothing but pass every op on / the worker alone: the
   floor any dispatch-level guard pays in this torch (built as safeview's guard is:
   ``__torch_dispatch__`` set after the class is made, so torch does not wrap it);
4. the plugin with ``SAFEVIEW_MANIFEST_DIR`` set / without: the layout manifest derived and
   written (target 5%). On meta the registration touches no memory, so this is the manifest
   against bookkeeping alone; ``bench_vllm_nixl.py`` measures it against vLLM's NIXL
   connector registering real memory, as users pay it.

Each round runs the worker alone and then each variant (in reversed order every other round);
the figure is the median of the per-round ratios to the worker alone in that round. The spread
is the interquartile range of those ratios; the two medians after it are of the first and second
half of the rounds: their gap is about what a repeated run moves the figure by.

Run (needs vLLM): .venv-vllm/bin/python benchmarks/bench_vllm.py [--rounds 101]
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))

import vllm_harness as harness  # type: ignore[import-not-found,unused-ignore]
from torch.utils._python_dispatch import TorchDispatchMode

from safeview import sanitize
from safeview.vllm import _guarded as guard_connector
from safeview.vllm._layout import ENV_MANIFEST_DIR


class _PassOn(TorchDispatchMode):  # type: ignore[no-untyped-call,unused-ignore]
    """A dispatch mode that only passes each op on: the floor of a dispatch-level guard."""


def _pass_on(self: _PassOn, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
    return func(*args, **(kwargs or {}))


# As safeview.guard._torch_dispatch does for its guard: set after the class is made, so that
# TorchDispatchMode.__init_subclass__ does not wrap it in torch._disable_dynamo.
_PassOn.__torch_dispatch__ = _pass_on  # type: ignore[method-assign,assignment,unused-ignore]


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--rounds", type=int, default=101)
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
        # what the plugin does to the connector vLLM's factory returns, and then vLLM's call
        connector: Any = object.__new__(harness.HarnessOffloadingConnector)
        connector.connector_worker = harness.make_worker(built)
        connector._vllm_config = built.vllm_config
        guard_connector(connector, built.kv_cache_config)
        connector.register_kv_caches(built.kv_caches)

    folder = tempfile.mkdtemp(prefix="safeview-bench-manifests-")

    def plugin_writing_manifests() -> None:
        # the same, with SAFEVIEW_MANIFEST_DIR set: the worker's manifest derived and written
        os.environ[ENV_MANIFEST_DIR] = folder
        try:
            plugin()
        finally:
            del os.environ[ENV_MANIFEST_DIR]

    def passing_on() -> None:
        with _PassOn():  # type: ignore[no-untyped-call,unused-ignore]
            worker()

    variants: dict[str, Callable[[], None]] = {
        "worker under sanitize()": sanitized,
        "the plugin's guarded register_kv_caches": plugin,
        "the same, writing its manifest": plugin_writing_manifests,
        "worker under a do-nothing dispatch mode": passing_on,
    }
    for fn in (worker, *variants.values()):
        fn()
    ratios: dict[str, list[float]] = {name: [] for name in variants}
    times: dict[str, list[float]] = {name: [] for name in variants}
    base_times = []
    for round_index in range(args.rounds):
        start = time.perf_counter()
        worker()
        base = time.perf_counter() - start
        base_times.append(base)
        order = list(variants.items())
        if round_index % 2:
            order.reverse()
        for name, fn in order:
            start = time.perf_counter()
            fn()
            spent = time.perf_counter() - start
            times[name].append(spent)
            ratios[name].append(spent / base)
    print(f"the worker alone: {statistics.median(base_times) * 1e3:.2f} ms (median)")
    figure = statistics.median(ratios["worker under sanitize()"])
    half = args.rounds // 2
    for name, values in ratios.items():
        low, _, high = statistics.quantiles(values, n=4)
        first, second = statistics.median(values[:half]), statistics.median(values[half:])
        print(
            f"  {name:48s} {statistics.median(values):5.2f}x "
            f"(IQR {low:.2f}-{high:.2f}, halves {first:.2f}/{second:.2f})"
        )
    verdict = "met" if figure <= 3 else f"MISSED by {figure - 3:.2f}"
    print(f"worker under sanitize() / alone = {figure:.2f}x, target <= 3x: {verdict}")
    shutil.rmtree(folder, ignore_errors=True)
    manifest = statistics.median(
        writing / guarded
        for writing, guarded in zip(
            times["the same, writing its manifest"],
            times["the plugin's guarded register_kv_caches"],
        )
    )
    written = "met" if manifest <= 1.05 else f"MISSED by {manifest - 1.05:.2f}"
    print(f"the plugin writing its manifest / not = {manifest:.3f}x, target <= 1.05x: {written}")
    return 0 if figure <= 3 and manifest <= 1.05 else 1


if __name__ == "__main__":
    raise SystemExit(main())
