"""What writing the layout manifest costs vLLM 0.33's real NIXL connector registration, on CPU.

A Llama of 100 layers (4 KV heads of 64 values, fp16, blocks of 32 tokens: 32,768-byte pages,
10 blocks: 32,768,000 bytes of real CPU memory), planned and allocated by vLLM's own planner and
allocator (tests/vllm_nixl_harness.py), in vLLM's CPU platform (``VLLM_TARGET_DEVICE=cpu``).
Each round creates fresh connectors through ``KVConnectorFactory.create_connector`` (so safeview's
plugin wraps them, as in an engine; not timed) and times their ``register_kv_caches``: vLLM's
``NixlPullConnector`` registering the caches with NIXL/UCX, in three variants:

1. the plugin's guarded registration, ``SAFEVIEW_MANIFEST_DIR`` unset;
2. the same with ``SAFEVIEW_MANIFEST_DIR`` set (a fresh empty folder each round): the worker's
   layout manifest derived and written, one JSON file; target: at most 1.05x the first;
3. for scale, unguarded: the same connector under ``safeview.policy_scope("off")`` (the plugin
   passes the call on untouched).

The variants run in reversed order every other round; each connector is shut down after (its
memory deregistered). The figure is the median of the per-round ratios of wall-clock times; the
spread is their interquartile range; the two medians after it are of the first and second half of
the rounds: their gap is about what a repeated run moves the figure by. The same ratio of the
registering thread's CPU time follows, as a cross-check that leaves out what other processes take
of a shared machine (the target is judged on the wall clock). The NIXL worker pins the process to
one core when it is built; the affinity is restored after each. A connector shut down is
collected at once (``gc.collect()``, not timed): its agent sits in reference cycles, and agents
left for the collector keep their UCX threads, which slow every later round down (by 10x after
a few rounds on 2 cores). UCX may crash the interpreter at exit, so the script ends with
``os._exit``.

Run (needs vLLM and NIXL): .venv-vllm/bin/python benchmarks/bench_vllm_nixl.py [--rounds 21]
    [--layers 100] [--blocks 10]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
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

# vLLM's CPU platform, chosen before vLLM is first imported (the harness's child does the same)
os.environ["VLLM_TARGET_DEVICE"] = "cpu"
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))

import vllm_nixl_harness as harness  # type: ignore[import-not-found,unused-ignore]

import safeview
from safeview.manifest import Manifest
from safeview.vllm._layout import ENV_MANIFEST_DIR

_GUARDED = "guarded register_kv_caches"
_WRITING = "the same, writing its manifest"
_UNGUARDED = "unguarded (policy off)"


def _model(child: Any, layers: int) -> str:
    """A Llama ``config.json`` of ``layers`` layers in the child's model folder; its name."""
    name = f"llama{layers}"
    path = Path(child.folder) / name
    path.mkdir(exist_ok=True)
    config = {**harness._LLAMA, "num_hidden_layers": layers}
    (path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    child.models[name] = path
    return name


def _spread(values: list[float], rounds: int) -> str:
    low, _, high = statistics.quantiles(values, n=4)
    half = rounds // 2
    first, second = statistics.median(values[:half]), statistics.median(values[half:])
    return f"IQR {low:.3f}-{high:.3f}, halves {first:.3f}/{second:.3f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--layers", type=int, default=100)
    parser.add_argument("--blocks", type=int, default=harness.NUM_BLOCKS)
    args = parser.parse_args()
    os.environ.pop(ENV_MANIFEST_DIR, None)

    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

    from safeview.vllm import _PATCHED

    harness.NUM_BLOCKS = args.blocks  # read by the harness's VllmConfig (num_gpu_blocks_override)
    child = harness._Child()  # vLLM's plugins (safeview's among them), one gloo rank
    # after vLLM's import, which sets its logger up
    logging.getLogger("vllm").setLevel(logging.ERROR)
    logging.getLogger("safeview").setLevel(logging.WARNING)
    logging.getLogger("nixl").setLevel(logging.WARNING)
    case = harness.Case(_model(child, args.layers), "LBHNC", (4,) * args.layers, 32)
    side = harness._allocate(child, case, "bench")
    storages = {
        c.untyped_storage().data_ptr(): c.untyped_storage() for c in side.kv_caches.values()
    }
    nbytes = sum(storage.nbytes() for storage in storages.values())
    print(
        f"vLLM {_vllm()}, NIXL "
        f"connector on CPU: {len(side.kv_caches)} layers, {args.blocks} blocks, "
        f"{nbytes:,} bytes in {len(storages)} storage(s)"
    )
    parent = Path(tempfile.mkdtemp(prefix="safeview-bench-nixl-"))

    def register(policy: str | None, folder: Path | None) -> tuple[float, float]:
        """A fresh connector (not timed), its register_kv_caches (timed: wall clock, and this
        thread's CPU time), its shutdown."""
        with set_current_vllm_config(side.config):
            try:
                connector = KVConnectorFactory.create_connector(
                    config=side.config,
                    role=KVConnectorRole.WORKER,
                    kv_cache_config=side.kv_cache_config,
                )
            finally:
                child.restore_affinity()
            if not getattr(connector.register_kv_caches, _PATCHED, False):
                raise SystemExit("safeview's vLLM plugin did not wrap the connector")
            if folder is not None:
                os.environ[ENV_MANIFEST_DIR] = str(folder)
            try:
                with safeview.policy_scope(policy) if policy else contextlib.nullcontext():
                    start, start_cpu = time.perf_counter(), time.thread_time()
                    connector.register_kv_caches(side.kv_caches)
                    spent = time.perf_counter() - start, time.thread_time() - start_cpu
            finally:
                os.environ.pop(ENV_MANIFEST_DIR, None)
                connector.shutdown()
                child.restore_affinity()
        # the agent sits in reference cycles: left to the collector, its UCX threads outlive it
        # and each further round runs slower (an engine has one agent for its whole life)
        del connector
        gc.collect()
        return spent

    written: list[Path] = []

    def writing() -> tuple[float, float]:
        folder = Path(tempfile.mkdtemp(dir=parent))
        spent = register(None, folder)
        files = sorted(folder.glob("*/*.manifest.json"))
        if len(files) != 1:
            raise SystemExit(f"expected one manifest in {folder}, found {files}")
        written.append(files[0])
        return spent

    variants: dict[str, Callable[[], tuple[float, float]]] = {
        _GUARDED: lambda: register(None, None),
        _WRITING: writing,
        _UNGUARDED: lambda: register("off", None),
    }
    for fn in variants.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    for round_index in range(args.rounds):
        order = list(variants.items())
        if round_index % 2:
            order.reverse()
        for name, fn in order:
            wall, thread = fn()
            times[name].append(wall)
            cpu[name].append(thread)
    manifest = Manifest.from_json(written[-1].read_bytes(), source=str(written[-1]))
    if len(manifest.layers) != args.layers:
        raise SystemExit(f"the manifest names {len(manifest.layers)} layers, not {args.layers}")
    print(f"manifest written each round: {written[-1].stat().st_size:,} bytes, "
          f"{len(manifest.layers)} layers")  # fmt: skip
    shutil.rmtree(parent, ignore_errors=True)
    shutil.rmtree(child.folder, ignore_errors=True)  # the model's config.json

    print("medians, wall clock (this thread's CPU time):")
    for name, values in times.items():
        print(
            f"  {name:34s} {statistics.median(values) * 1e3:8.2f} ms "
            f"({statistics.median(cpu[name]) * 1e3:.2f} ms)"
        )
    guard = [g / u for g, u in zip(times[_GUARDED], times[_UNGUARDED])]
    print(f"guarded / unguarded = {statistics.median(guard):.3f}x ({_spread(guard, args.rounds)})")
    ratios = [w / g for w, g in zip(times[_WRITING], times[_GUARDED])]
    figure = statistics.median(ratios)
    extra = statistics.median(w - g for w, g in zip(times[_WRITING], times[_GUARDED]))
    print(f"writing - not writing = {extra * 1e3:+.2f} ms (median of the per-round differences)")
    print(f"writing / not writing = {figure:.3f}x ({_spread(ratios, args.rounds)})")
    # CPU time leaves out what other processes on the machine take of the wall clock
    on_cpu = [w / g for w, g in zip(cpu[_WRITING], cpu[_GUARDED])]
    print(
        f"the same in this thread's CPU time = {statistics.median(on_cpu):.3f}x "
        f"({_spread(on_cpu, args.rounds)})"
    )
    verdict = "met" if figure <= 1.05 else f"MISSED by {figure - 1.05:.4f}"
    print(f"the plugin writing its manifest / not = {figure:.3f}x, target <= 1.05x: {verdict}")
    return 0 if figure <= 1.05 else 1


def _vllm() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


if __name__ == "__main__":
    try:
        code = main()
    except SystemExit as stop:  # a check that failed: say why, and still leave through os._exit
        print(stop.code, file=sys.stderr)
        code = 2
    sys.stdout.flush()
    sys.stderr.flush()
    # UCX may crash the interpreter at exit: the figures are out, leave now
    os._exit(code)
