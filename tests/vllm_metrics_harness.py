"""What an operator sees (issue 38): P and D of tests/vllm_across_harness.py, plus what vLLM's
front end does with a connector's stats.

A child here is an across child (``vllm_across_harness``: ``serve``, ``finish``, ``flip``,
``stop`` on P; ``start``, ``read`` on D) with two more commands:

- ``unread`` (P): one more request finished on a served engine, as vLLM runs a prefill whose
  KV a D is to read (``update_state_after_alloc``, ``request_finished``, P's next step), under
  the engine's lease (``kv_lease_duration``: ``METRICS_KV_LEASE_S``); no D reads it; once the
  lease has run out, each rank's ``get_transfer_results`` (P's next step: its lease reaper);
- ``metrics`` (both): what vLLM does with connector stats after a step, by its own classes:
  every connector of the process (each worker's, then the scheduler's) asked for
  ``get_kv_connector_stats()``, the workers' aggregated as vLLM's ``KVOutputAggregator`` does
  and the scheduler's added as its ``Scheduler.update_from_output`` does; the result pickled and
  unpickled (the executor's way from a worker process), then ``to_dict()`` and a msgpack round
  trip (the engine core's ``SchedulerStats`` to the front end); there, vLLM's own
  ``KVConnectorProm`` (made once per process, on ``prometheus_client``'s global registry, as
  ``PrometheusStatLogger`` makes it) and ``KVConnectorLogging`` observe it, and
  ``KVConnectorLogging.log()`` writes the periodic line through vLLM's logger. It answers the
  registry's text exposition (what a scraper of ``/metrics`` reads), the lines vLLM logged,
  and the dict.

``METRICS_KV_LOAD_FAILURE_POLICY`` and ``METRICS_KV_LEASE_S`` in a child's environment set
every engine's ``kv_load_failure_policy`` and ``kv_lease_duration`` there. Importing this
module imports neither vLLM nor NIXL.
"""

from __future__ import annotations

import logging
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import vllm_across_harness as across  # type: ignore[import-not-found,unused-ignore]
import vllm_nixl_harness as base  # type: ignore[import-not-found,unused-ignore]

Engine = across.Engine
free_port = across.free_port
write_models = across.write_models
LABELS = ["model_name", "engine"]  # vLLM's PrometheusStatLogger's label names


class Child(across.Child):
    """An across child running this module's commands (same environment rules)."""

    def __init__(self, role: str, models: Path, env: Mapping[str, str] | None = None) -> None:
        self.role = role
        self.folder = Path(tempfile.mkdtemp(prefix=f"safeview-metrics-{role}-"))
        environ = {k: v for k, v in os.environ.items() if not k.startswith("SAFEVIEW_")}
        environ.update(env or {})
        environ["ACROSS_MODELS_DIR"] = str(models)
        environ["VLLM_TARGET_DEVICE"] = "cpu"
        environ["TMPDIR"] = str(self.folder)
        here = str(Path(__file__).resolve().parent)
        environ["PYTHONPATH"] = os.pathsep.join([here, environ.get("PYTHONPATH", "")])
        self.log = (self.folder / "output.log").open("w", encoding="utf-8")
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), role],
            env=environ,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            bufsize=1,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()


# --------------------------------------------------------------------------------------------
# The child side
# --------------------------------------------------------------------------------------------


class _Front:
    """vLLM's front end of this process: its Prometheus and logging stat loggers' connector
    parts, made from the first engine's config."""

    def __init__(self, config: Any) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
            KVConnectorLogging,
            KVConnectorProm,
        )

        self.prom = KVConnectorProm(config, LABELS, {0: ["metrics-model", "0"]})
        self.logging = KVConnectorLogging(config.kv_transfer_config)


_FRONT: list[_Front] = []


def _metrics(connectors: list[Any], scheduler: Any, config: Any) -> dict[str, Any]:
    import pickle

    import msgspec
    from prometheus_client import REGISTRY, generate_latest

    aggregated = None
    for connector in connectors:  # the workers, as KVOutputAggregator aggregates them
        stats = connector.get_kv_connector_stats()
        if stats is None:
            continue
        stats = pickle.loads(pickle.dumps(stats))  # from a worker process to the engine core
        if aggregated is None:
            aggregated = stats
        else:
            assert isinstance(aggregated, type(stats)), (type(aggregated), type(stats))
            aggregated = aggregated.aggregate(stats)
    if scheduler is not None:  # Scheduler.update_from_output
        own = scheduler.get_kv_connector_stats()
        if own is not None and not own.is_empty():
            aggregated = own if aggregated is None else aggregated.aggregate(own)
    payload = aggregated.to_dict() if aggregated is not None else None
    if payload is not None:  # SchedulerStats, engine core -> front end
        payload = msgspec.msgpack.decode(msgspec.msgpack.encode(payload))
    if not _FRONT:
        _FRONT.append(_Front(config))
    front = _FRONT[0]
    lines: list[str] = []

    class _Lines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler = _Lines()
    vllm_logger = logging.getLogger("vllm")
    vllm_logger.addHandler(handler)
    try:
        if payload:
            front.logging.observe(payload)
            front.prom.observe(payload, 0)
        front.logging.log()  # the periodic line, through vLLM's own logger
    finally:
        vllm_logger.removeHandler(handler)
    return {
        "payload": payload,
        "stats_class": None if aggregated is None else type(aggregated).__name__,
        "exposition": generate_latest(REGISTRY).decode(),
        "lines": [line for line in lines if line.startswith("KV Transfer metrics")],
    }


class _Serve(across._Serve):  # type: ignore[misc,unused-ignore]
    def unread(self, command: dict[str, Any]) -> dict[str, Any]:
        from vllm.config import set_current_vllm_config

        sides, scheduler = self.engines[command["name"]]
        engine = across._engine(command["engine"])
        blocks = [int(b) for b in command["remote_blocks"]]
        lease_s = int(scheduler.connector_scheduler._kv_lease_duration)  # METRICS_KV_LEASE_S
        request = across._FinishedRequest(f"{command['name']}-unread",
                                          len(blocks) * engine.block_size)  # fmt: skip
        with set_current_vllm_config(sides[0].config):
            # the prefill was scheduled: P's workers are to hold its blocks for a D
            scheduler.update_state_after_alloc(request, None, 0)
            _, params = scheduler.request_finished(request, blocks)
        across._p_step(sides, scheduler)
        held = [sorted(side.worker._reqs_to_send) for side in sides]
        time.sleep(lease_s + 0.5)
        with set_current_vllm_config(sides[0].config):
            freed = [sorted(side.connector.get_transfer_results(set()).finished_sending)
                     for side in sides]  # fmt: skip
        return {"kv_transfer_params": base._json_safe(params), "held": held,
                "freed": freed}  # fmt: skip

    def metrics(self, command: dict[str, Any]) -> dict[str, Any]:
        sides, scheduler = self.engines[command["name"]]
        connectors = [side.connector for side in sides]
        return _metrics(connectors, scheduler, sides[0].config)


class _Read(across._Read):  # type: ignore[misc,unused-ignore]
    def metrics(self, command: dict[str, Any]) -> dict[str, Any]:
        connectors, config = [], None
        for _, sides, _ in self.engines.values():
            connectors += [side.connector for side in sides]
            config = config or sides[0].config
        return _metrics(connectors, None, config)


def _configured() -> None:
    """Every engine of this child with ``METRICS_KV_LOAD_FAILURE_POLICY`` (its
    ``kv_load_failure_policy``) and ``METRICS_KV_LEASE_S`` (its ``kv_connector_extra_config``
    ``kv_lease_duration``), when set."""
    policy = os.environ.get("METRICS_KV_LOAD_FAILURE_POLICY")
    lease = os.environ.get("METRICS_KV_LEASE_S")
    if not policy and not lease:
        return
    made = base._Child.vllm_config

    def vllm_config(self: Any, case: Any, engine_id: str) -> Any:
        config = made(self, case, engine_id)
        if policy:
            config.kv_transfer_config.kv_load_failure_policy = policy
        if lease:
            config.kv_transfer_config.kv_connector_extra_config["kv_lease_duration"] = int(lease)
        return config

    base._Child.vllm_config = vllm_config  # type: ignore[method-assign,unused-ignore]


if __name__ == "__main__":
    _configured()
    across._Serve = _Serve  # type: ignore[misc,unused-ignore]
    across._Read = _Read  # type: ignore[misc,unused-ignore]
    across._main(sys.argv[1])
