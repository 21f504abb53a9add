"""What the manifest on the wire adds to vLLM 0.33's own NIXL handshake, on CPU (issue 28).

Two processes on vLLM's CPU platform (``VLLM_TARGET_DEVICE=cpu``), one with safeview's plugin
off (``SAFEVIEW_VLLM=0``: vLLM alone) and one with it on; each holds a prefill worker (P) and a
decode worker (D) of a Llama of 100 layers (4 KV heads of 64 values, fp16, blocks of 32 tokens,
10 blocks), planned, allocated and registered by vLLM's own code (tests/vllm_nixl_harness.py),
every connector made through ``KVConnectorFactory.create_connector`` so that the plugin, when
loaded, wraps it as in an engine. P's scheduler-side connector serves P's payload on vLLM's side
channel (ZMQ over TCP on 127.0.0.1), as P's engine core does.

One round, in one process (the other waits), times one full first handshake:

- P's part: what P does to serve it: ``set_xfer_handshake_metadata`` with the worker's
  ``get_handshake_metadata`` (vLLM encodes the payload; the plugin keeps the request token);
  with the plugin on, also the worker's manifest put on the wire (``to_wire``, which the plugin
  does once at registration: counted here at every round, so the figure errs high);
- D's part: ``_nixl_handshake`` of a fresh D worker (made and registered before, not timed), as
  its handshake thread runs it: the request on the side channel, P's listener thread answering,
  the payload decoded, the compatibility hash checked, ``add_remote_agent`` (NIXL loads P's
  agent, vLLM prepares P's 100 layers' descriptors); with the plugin on, P's manifest judged
  against D's before that (``from_wire``, ``judge_peer``, its event, logged as vLLM and the
  plugin set logging up).

Three variants, each round in turn first: vLLM alone (the plugin off); safeview, with its
per-process cache of page-layout comparisons emptied before the round (not timed), so that D's
judgement is a first one, as where D meets the first P of a model; safeview warm, the cache
kept, as where D meets a further P of the same layout. The figure judged against the target
(at most 1.05x) is the first: the median of the per-round ratios safeview / vLLM alone of the
two parts together; the spread is their interquartile range, and the two medians after it are
of the first and the second half of the rounds. The payload's size with and without the
manifest is printed. Each round checks what it timed: D added P's agent, and, with the plugin,
judged P against its handshake manifest and did not refuse it under strict (or the run stops).
UCX may crash an interpreter at exit, so every process ends with ``os._exit``.

Run (needs vLLM and NIXL): .venv-vllm/bin/python benchmarks/bench_handshake.py [--rounds 11]
    [--layers 100] [--blocks 10]
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
TESTS = HERE.parent.parent / "tests"
PREFIX = "SAFEVIEW-BENCH-HANDSHAKE "
TARGET = 1.05


# --------------------------------------------------------------------------------------------
# The child: P and D in one process, the plugin on or off
# --------------------------------------------------------------------------------------------


def _answer(data: dict[str, Any]) -> None:
    sys.stdout.write(PREFIX + json.dumps(data) + "\n")
    sys.stdout.flush()


def _child(layers: int, blocks: int) -> None:
    sys.path.insert(0, str(TESTS))
    import vllm_nixl_harness as harness  # type: ignore[import-not-found,unused-ignore]

    harness.NUM_BLOCKS = blocks  # read by the harness's VllmConfig (num_gpu_blocks_override)
    # vLLM's plugins (safeview's, unless SAFEVIEW_VLLM=0), one rank; logging left as vLLM and
    # the plugin set it up: vLLM's handshake logs at INFO, and safeview's verdict is an event
    child = harness._Child()

    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

    from safeview.manifest import diff

    name = f"llama{layers}"
    folder = Path(child.folder) / name
    folder.mkdir(exist_ok=True)
    config = {**harness._LLAMA, "num_hidden_layers": layers}
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    child.models[name] = folder
    case = harness.Case(name, "LBHNC", (4,) * layers, 32)
    p = harness._allocate(child, case, "bench-P")
    d = harness._allocate(child, case, "bench-D")

    def worker(side: Any) -> Any:
        with set_current_vllm_config(side.config):
            try:
                connector = KVConnectorFactory.create_connector(
                    config=side.config,
                    role=KVConnectorRole.WORKER,
                    kv_cache_config=side.kv_cache_config,
                )
            finally:
                child.restore_affinity()  # the NIXL worker pins the process to one core
            connector.register_kv_caches(side.kv_caches)
        return connector

    p.connector = worker(p)
    port = harness._free_port()
    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(port)
    os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
    with set_current_vllm_config(p.config):
        scheduler = KVConnectorFactory.create_connector(
            config=p.config, role=KVConnectorRole.SCHEDULER, kv_cache_config=p.kv_cache_config
        )
    layout = getattr(p.worker, "_safeview_layout", None)  # the plugin's, on P's worker

    def serve() -> None:
        """P's part: its manifest on the wire (the plugin), vLLM's payload encoded and kept
        for its side channel's listener (started by the first call)."""
        if layout is not None:
            layout.serve()
        with set_current_vllm_config(p.config):
            # what the engine core does with the workers' metadata (core.py)
            metadata = {(0, 0): p.connector.get_handshake_metadata()}
            scheduler.set_xfer_handshake_metadata_pp_aware(metadata)

    serve()
    payload = scheduler.connector_scheduler._handshake_data[(0, 0)]
    _answer({"ready": True, "payload_bytes": len(payload), "plugin": layout is not None,
             "safeview_level": logging.getLogger("safeview").getEffectiveLevel()})  # fmt: skip

    for line in sys.stdin:
        command = json.loads(line)
        if command.get("op") != "round":
            break
        connector = worker(d)  # a fresh D: its first handshake with P
        if command["cold"]:
            # safeview's comparisons of two page layouts, kept per process: emptied, D's
            # judgement is a first one, as where D meets its first P of a model (not timed)
            diff._CACHE.clear()
        gc.collect()
        with set_current_vllm_config(d.config):
            started = time.perf_counter()
            serve()
            served = time.perf_counter()
            agents, _ = connector.connector_worker._nixl_handshake("127.0.0.1", port, 1, "bench-P")
            done = time.perf_counter()
        # what D concluded of P (the plugin's verdict per P engine), looked at after the clock
        judge = getattr(connector.connector_worker, "_safeview_layout", None)
        judged = None
        if judge is not None:  # (what it judged against, ...), and the error if it refused
            judged = {"policy": judge.policy.value, "verdicts": {
                k: {"against": str(v[0][0]), "refused": v[1] is not None}
                for k, v in judge.verdicts.items()}}  # fmt: skip
        connector.shutdown()
        child.restore_affinity()
        # the agent sits in reference cycles: left to the collector, its UCX threads outlive it
        # and slow every later round down (bench_vllm_nixl.py says the same)
        del connector
        gc.collect()
        _answer({"p": served - started, "d": done - served, "agents": len(agents),
                 "judged": judged})  # fmt: skip
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # UCX may crash the interpreter at exit


# --------------------------------------------------------------------------------------------
# The parent: two children, rounds interleaved
# --------------------------------------------------------------------------------------------


class _Process:
    def __init__(self, plugin: bool, args: argparse.Namespace) -> None:
        environ = {k: v for k, v in os.environ.items() if not k.startswith("SAFEVIEW_")}
        if not plugin:
            environ["SAFEVIEW_VLLM"] = "0"
        environ["VLLM_TARGET_DEVICE"] = "cpu"  # vLLM's CPU platform, before vLLM is imported
        self.plugin = plugin
        self.log: list[str] = []
        command = [sys.executable, str(HERE), "--child", "--layers", str(args.layers),
                   "--blocks", str(args.blocks)]  # fmt: skip
        self.process = subprocess.Popen(
            command, env=environ, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, bufsize=1,
        )  # fmt: skip

    def answer(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith(PREFIX):
                return json.loads(line[len(PREFIX) :])  # type: ignore[no-any-return]
            self.log.append(line)
        raise SystemExit(
            f"the child with the plugin {'on' if self.plugin else 'off'} died:\n"
            + "".join(self.log[-40:])
        )

    def round(self, cold: bool) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"op": "round", "cold": cold}) + "\n")
        self.process.stdin.flush()
        return self.answer()

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()


def _spread(values: list[float]) -> str:
    low, _, high = statistics.quantiles(values, n=4)
    half = len(values) // 2
    first, second = statistics.median(values[:half]), statistics.median(values[half:])
    return f"IQR {low:.3f}-{high:.3f}, halves {first:.3f}/{second:.3f}"


def _ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:11.2f} ms"


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--layers", type=int, default=100)
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.layers, args.blocks)
    off, on = _Process(False, args), _Process(True, args)  # both start at once
    try:
        ready = {"off": off.answer(), "on": on.answer()}
        if ready["off"]["plugin"] or not ready["on"]["plugin"]:
            raise SystemExit(f"the plugin is not loaded as asked: {ready}")
        print(
            f"vLLM 0.33's NIXL connector on CPU, P and D in one process each, {args.layers} "
            f"layers, {args.blocks} blocks; {args.rounds} rounds (+{args.warmup} not counted)"
        )
        variants = {_OFF: (off, False), _COLD: (on, True), _WARM: (on, False)}
        times: dict[str, dict[str, list[float]]] = {key: {"p": [], "d": []} for key in variants}
        for index in range(args.warmup + args.rounds):
            order = list(variants.items())
            order = order[index % 3 :] + order[: index % 3]  # each variant first, in turn
            for key, (process, cold) in order:
                found = process.round(cold)
                _check(key, found)
                if index >= args.warmup:
                    times[key]["p"].append(found["p"])
                    times[key]["d"].append(found["d"])
    finally:
        off.close()
        on.close()

    plain, grown = ready["off"]["payload_bytes"], ready["on"]["payload_bytes"]
    print(f"P's handshake payload: {plain:,} bytes vLLM alone, {grown:,} with the manifest "
          f"(+{grown - plain:,} bytes)")  # fmt: skip
    print(f"medians, wall clock: {'':9s}{_OFF:>14s}{_COLD:>14s}{_WARM:>14s}")
    total = {key: [p + d for p, d in zip(t["p"], t["d"])] for key, t in times.items()}
    rows = (
        ("P serves", {k: t["p"] for k, t in times.items()}),
        ("D's handshake", {k: t["d"] for k, t in times.items()}),
        ("together", total),
    )
    for label, values in rows:
        print(f"  {label:26s}" + "".join(_ms(values[key]) for key in variants))
    figures = {}
    for key in (_COLD, _WARM):
        extra = statistics.median(b - a for a, b in zip(total[_OFF], total[key]))
        ratios = [b / a for a, b in zip(total[_OFF], total[key])]
        figures[key] = statistics.median(ratios)
        print(f"{key} / {_OFF} = {figures[key]:.3f}x ({_spread(ratios)}), "
              f"{extra * 1e3:+.2f} ms (median per round)")  # fmt: skip
    figure = figures[_COLD]
    verdict = "PASS" if figure <= TARGET else "FAIL"
    print(f"P's handshake and D's first judgement of it = {figure:.3f}x vLLM's own, "
          f"target <= {TARGET}x: {verdict}")  # fmt: skip
    return 0 if figure <= TARGET else 1


_OFF, _COLD, _WARM = "vLLM alone", "safeview", "safeview warm"


def _check(key: str, found: dict[str, Any]) -> None:
    """What a round did: D added P's agent, and with the plugin judged P compatible."""
    if found["agents"] != 1:
        raise SystemExit(f"{key}: D added {found['agents']} agents of P, not 1")
    judged = found["judged"]
    if key == _OFF:
        if judged is not None:
            raise SystemExit(f"{key}: the plugin judged P: {judged}")
        return
    expected = {"policy": "strict",
                "verdicts": {"bench-P": {"against": "handshake", "refused": False}}}  # fmt: skip
    if judged != expected:  # under strict, a P not compatible is refused
        raise SystemExit(f"{key}: D's verdict on P was {judged}, not {expected}")


if __name__ == "__main__":
    try:
        code = main()
    except SystemExit as stop:  # a check that failed: say why
        print(stop.code, file=sys.stderr)
        code = 2
    except Exception:  # still leave through os._exit
        import traceback

        traceback.print_exc()
        code = 2
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
