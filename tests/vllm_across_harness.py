"""P and D on two machines: vLLM 0.33's real NIXL connector on CPU, the prefill engine (P) and the
decode engine (D) in separate processes, with separate temporary folders and no
``SAFEVIEW_MANIFEST_DIR``; what crosses between them is what crosses between two machines: P's
handshake on its side channel (ZMQ, TCP), the READ (NIXL, UCX), and each request's
``kv_transfer_params``, which the test relays from P's ``request_finished`` to D itself, as a P/D
proxy does (vLLM's toy proxy, llm-d's sidecar, Dynamo relay the dict verbatim).

A child process (``Child``) is one engine side, driven by JSON commands on its standard input,
one per line; it answers each with one line that starts with ``RESULT_PREFIX``. Both sides use
the pieces of ``vllm_layout_harness`` and ``vllm_nixl_harness`` (vLLM's planner and allocator, a
real ``NixlPullConnector`` worker per rank created through ``KVConnectorFactory`` so that the
plugin, when loaded, is in the path, the oracle that decodes D's bytes through D's own strides).

P's commands:

- ``serve``: allocate and register every rank of an engine (``vllm_layout_harness.Engine``; a
  ``fault`` of ``permuted_layer`` gives layer 1 token-major pages behind the same shape and
  layout string), fill its pages with random bytes, serve every rank's handshake payload (or
  those of ``handshake_ranks`` only) on the given side-channel port with vLLM's scheduler-side
  connector (as P's engine core does), then
  finish a request on that scheduler (``request_finished`` with P's blocks ``remote_blocks``,
  a request that asked for a remote decode) and answer its ``kv_transfer_params``, the raw
  handshake payload of rank 0 as P's side channel serves it, and the files holding each rank's
  caches (for D's oracle);
- ``stop``: shut an engine's workers and scheduler down and drop them (see ``_stop``);
- ``exit``: leave at once (``os._exit``: as a crashed or restarted P would).

D's commands:

- ``start``: allocate and register every rank of an engine under a policy;
- ``read``: hand every D rank (or those of ``ranks``) one request whose ``kv_transfer_params``
  are P's, relayed verbatim, through ``NixlConnectorMetadata.add_new_req_to_recv`` (what D's
  scheduler does with a request's params) into D's ``LOCAL_BLOCKS`` (zeroed first), let vLLM do
  the handshake and the READ, and answer per rank whether the request finished or failed, the
  oracle, whether D's blocks stayed untouched, whether vLLM's handshake with P made the rank permute
  P's pages on receipt (``enable_permute_local_kv``), and which of P's agents (``p_agents``,
  the names ``serve`` answered) D's NIXL agent holds after it; with the events safeview emitted
  meanwhile;
- ``read_together``: several requests handed to D's rank 0 in one step, each into blocks of its
  own, vLLM and the plugin stepping them together; per request, whether and when it finished,
  and whether it failed;
- ``stop``: as P's;
- ``exit``.

Importing this module imports neither vLLM nor NIXL.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import vllm_layout_harness as layout  # type: ignore[import-not-found,unused-ignore]
import vllm_nixl_harness as base  # type: ignore[import-not-found,unused-ignore]

RESULT_PREFIX = "SAFEVIEW-ACROSS "
LOCAL_BLOCKS = layout.LOCAL_BLOCKS
Engine = layout.Engine


# --------------------------------------------------------------------------------------------
# The parent side
# --------------------------------------------------------------------------------------------


class Child:
    """One engine side in a process of its own: its own temporary folder (``TMPDIR``), no
    ``SAFEVIEW_*`` variable of this process, plus ``env``; safeview's plugin is loaded by
    vLLM's own ``load_general_plugins`` unless ``env`` says ``SAFEVIEW_VLLM=0``."""

    def __init__(self, role: str, models: Path, env: Mapping[str, str] | None = None) -> None:
        self.role = role
        self.folder = Path(tempfile.mkdtemp(prefix=f"safeview-across-{role}-"))
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

    def _pump(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def call(self, command: dict[str, Any], timeout_s: float = 300) -> dict[str, Any]:
        """Send one command; its answer (``RuntimeError`` with the output's tail when the
        child dies or does not answer in time)."""
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                line = ""
            if line is None or (line == "" and time.monotonic() >= deadline):
                raise RuntimeError(
                    f"the {self.role} child gave no answer to {command['op']}:\n" + self.tail()
                )
            if line.startswith(RESULT_PREFIX):
                return json.loads(line[len(RESULT_PREFIX) :])  # type: ignore[no-any-return]
            self.output.append(line)

    def tail(self) -> str:
        with contextlib.suppress(ValueError):  # closed once the child left
            self.log.flush()
        text = "".join(self.output[-50:])
        with contextlib.suppress(OSError):
            text += (self.folder / "output.log").read_text(encoding="utf-8")[-6000:]
        return text

    def exit(self) -> None:
        """Ask the child to leave; kill it if it does not."""
        with contextlib.suppress(Exception):
            assert self.process.stdin is not None
            self.process.stdin.write(json.dumps({"op": "exit"}) + "\n")
            self.process.stdin.flush()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


#: a Llama of 8 KV heads (vllm#45330's class, H=8 TP8->16): vLLM's NIXL worker tells sharded
#: from replicated heads by the model config's total, so the config must say 8 (engines of it
#: name each layer's heads: ``Engine(model="llama8", layer_heads=(8, 8, 8))``)
LLAMA_8 = {**base._LLAMA, "num_attention_heads": 8, "num_key_value_heads": 8}


def free_port() -> int:
    """A free port below the kernel's ephemeral range: the side channels are bound minutes after
    the ports are chosen, and a port the kernel handed out once (bind to 0) it may hand to
    another socket (UCX's, torch's, another child's ZMQ) in between."""
    import random
    import socket

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(1000):
        port = random.randrange(max(1024, low - 12_000), low)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def remote_blocks(p: Engine, d: Engine, blocks: list[int]) -> list[int]:
    """The P blocks a request of ``blocks`` sends to D: as many more as D's blocks hold P's."""
    ratio = max(1, d.block_size // p.block_size)
    return blocks if ratio == 1 else list(range(1, 1 + len(blocks) * ratio))


def write_models(folder: Path) -> Path:
    """The models' ``config.json`` files (``vllm_nixl_harness``'s, and ``LLAMA_8``), in
    ``folder``, for both sides: the one place P and D share, as two machines share a model's
    name."""
    models = (("llama", base._LLAMA), ("llama8", LLAMA_8), ("deepseek_v2", base._DEEPSEEK_V2))
    for name, config in models:
        (folder / name).mkdir(parents=True, exist_ok=True)
        (folder / name / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


# --------------------------------------------------------------------------------------------
# The child side
# --------------------------------------------------------------------------------------------


def _engine(data: Mapping[str, Any]) -> Any:
    fields = dict(data)
    if fields.get("layer_heads") is not None:
        fields["layer_heads"] = tuple(fields["layer_heads"])
    return Engine(**fields)


class _Serve:
    """P's side: engines served, by name (their workers and scheduler stay up)."""

    def __init__(self, child: Any) -> None:
        self.child = child
        self.engines: dict[str, tuple[list[Any], Any]] = {}

    def serve(self, command: dict[str, Any]) -> dict[str, Any]:
        import torch

        engine = _engine(command["engine"])
        name, port, seed = command["name"], int(command["port"]), int(command.get("seed", 1))
        fault = command.get("fault")
        sides = [layout._allocate(self.child, engine, name, r, fault) for r in range(engine.tp)]
        for rank, side in enumerate(sides):
            # ranks that hold the same heads hold the same bytes
            base._fill(side, seed=seed * 100 + engine.first_head(rank))
        errors: list[Any] = []
        with base._policy(command.get("policy")):
            for rank, side in enumerate(sides):
                layout._connect(self.child, side, rank, engine.tp, errors)
            scheduler = self._scheduler(sides, port, engine.tp, command.get("handshake_ranks"))
            blocks = [int(b) for b in command["remote_blocks"]]
            request = _FinishedRequest(f"{name}-request", len(blocks) * engine.block_size)
            _, params = scheduler.request_finished(request, blocks)
            digests = _p_step(sides, scheduler) if params.get("safeview_digest") else {}
        self.engines[name] = (sides, scheduler)
        caches = []
        for rank, side in enumerate(sides):
            path = self.child.folder / f"{name}.rank{rank}.pt"
            torch.save({k: v for k, v in side.kv_caches.items()}, path)
            caches.append(str(path))
        served = scheduler.connector_scheduler._handshake_data
        payload = served.get((0, 0), next(iter(served.values())))
        saved = self.child.folder / f"{name}.rank0.payload"  # as an operator would save it
        saved.write_bytes(payload)
        return {
            "payload_file": str(saved),
            "kv_transfer_params": base._json_safe(params),
            "caches": caches,
            "payload": base._json_safe(_decoded_payload(payload)),
            "payload_bytes": len(payload),
            "errors": errors,
            "digests": digests,
            # each rank's NIXL agent name: a D that loaded P's agent knows it by that name
            "agents": [str(side.worker.nixl_wrapper.name) for side in sides],
        }

    def finish(self, command: dict[str, Any]) -> dict[str, Any]:
        """``count`` more requests finished on a served engine (``request_finished`` over
            ``remote_blocks``, then P's next engine step, as vLLM runs them): each one's
            ``kv_transfer_params``, and P's seconds for the two, per request (wall clock, and this
        thread's CPU time)."""
        sides, scheduler = self.engines[command["name"]]
        engine = _engine(command["engine"])
        blocks = [int(b) for b in command["remote_blocks"]]
        found, seconds, cpu = [], [], []
        for at in range(int(command["count"])):
            request = _FinishedRequest(
                f"{command['name']}-{command.get('prefix', 'more')}-{at}",
                len(blocks) * engine.block_size,
            )
            started, started_cpu = time.perf_counter(), time.thread_time()
            _, params = scheduler.request_finished(request, blocks)
            _p_step(sides, scheduler)
            seconds.append(time.perf_counter() - started)
            cpu.append(time.thread_time() - started_cpu)
            found.append(base._json_safe(params))
        return {"kv_transfer_params": found, "seconds": seconds, "cpu_seconds": cpu}

    def flip(self, command: dict[str, Any]) -> dict[str, Any]:
        """One byte of one P rank's page changed (its bits inverted): in ``block`` of
        ``layer``, head ``head``, token ``token``, byte ``byte`` of the K|V row; after P's
        digest, before any READ."""
        import torch

        sides, _ = self.engines[command["name"]]
        cache = sides[int(command["rank"])].kv_caches[command["layer"]]  # [B, H, N, K|V]
        row = cache[int(command["block"]), int(command["head"]), int(command["token"])]
        row.view(torch.uint8)[int(command["byte"])] ^= 0xFF
        return {}

    def stop(self, command: dict[str, Any]) -> dict[str, Any]:
        sides, scheduler = self.engines.pop(command["name"])
        scheduler.shutdown()  # its side channel's listener thread
        return _stop(sides)

    def _scheduler(
        self, sides: list[Any], port: int, tp: int, ranks: list[int] | None = None
    ) -> Any:
        from vllm.config import set_current_vllm_config
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

        os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(port)
        os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
        first = sides[0]
        with set_current_vllm_config(first.config):
            scheduler = KVConnectorFactory.create_connector(
                config=first.config,
                role=KVConnectorRole.SCHEDULER,
                kv_cache_config=first.kv_cache_config,
            )
            # one process stands for P's TP ranks (vllm_layout_harness does the same to each
            # worker): the scheduler of an engine of that size
            scheduler.connector_scheduler.transfer_tp_size = tp
            # what the engine core does with the workers' metadata (core.py)
            # (a P whose side channel holds only ``ranks``' handshakes, when given)
            scheduler.set_xfer_handshake_metadata_pp_aware(
                {
                    (0, rank): side.connector.get_handshake_metadata()
                    for rank, side in enumerate(sides)
                    if ranks is None or rank in ranks
                }
            )
        return scheduler


class _FinishedRequest:
    """What vLLM 0.33's ``request_finished`` reads of a request: a prefill that asked for a
    remote decode, finished by its length cap (what a P/D proxy's prefill request is)."""

    def __init__(self, request_id: str, tokens: int) -> None:
        from vllm.v1.request import RequestStatus

        self.request_id = request_id
        self.status = RequestStatus.FINISHED_LENGTH_CAPPED
        self.kv_transfer_params: dict[str, Any] = {"do_remote_decode": True}
        self.num_computed_tokens = tokens


def _decoded_payload(payload: bytes) -> dict[str, Any]:
    """The keys of P's handshake payload, as any msgpack reader sees them."""
    import msgspec

    found = msgspec.msgpack.decode(payload)
    return {
        key: (value.decode() if key == "safeview_manifest" else len(value))
        if isinstance(value, bytes)
        else value
        for key, value in found.items()
    }


class _Read:
    """D's side: engines started, by name."""

    def __init__(self, child: Any) -> None:
        self.child = child
        self.engines: dict[str, tuple[Any, list[Any], list[Any]]] = {}

    def start(self, command: dict[str, Any]) -> dict[str, Any]:
        engine = _engine(command["engine"])
        name = command["name"]
        sides = [layout._allocate(self.child, engine, name, r, None) for r in range(engine.tp)]
        errors: list[Any] = []
        with base._policy(command.get("policy")):
            for rank, side in enumerate(sides):
                layout._connect(self.child, side, rank, engine.tp, errors)
        self.engines[name] = (engine, sides, errors)
        return {"ranks": len(sides)}

    def read(self, command: dict[str, Any]) -> dict[str, Any]:
        import torch

        engine, sides, errors = self.engines[command["name"]]
        p_engine = _engine(command["p"])
        params = command["kv_transfer_params"]
        p_sides = [_Loaded(torch.load(path, weights_only=True)) for path in command["caches"]]
        # what the oracle expects D to hold: P's blocks of the request (a test that relays
        # other block ids, as a proxy bug would, says which were meant)
        remote_blocks = list(command.get("oracle_blocks") or params["remote_block_ids"][0])
        errors.clear()
        reads = []
        for rank, d in enumerate(sides):
            if command.get("ranks") is not None and rank not in command["ranks"]:
                continue
            for cache in d.kv_caches.values():
                cache[list(LOCAL_BLOCKS)] = 0  # a second read starts from zero too
            with _fault_after_read(d, command.get("fault")), _timed(d) as own:
                outcome = _request(d, f"{command['tag']}-{rank}", params)
            # the time D spent in the plugin's digest steps for this read (benchmarks): wall
            # clock, and the thread's CPU time
            outcome["safeview_seconds"], outcome["safeview_cpu_seconds"] = own
            outcome["oracle"] = layout._oracle(p_engine, engine, p_sides, d, rank, remote_blocks,
                                               LOCAL_BLOCKS)  # fmt: skip
            outcome["untouched"] = layout._untouched(d, LOCAL_BLOCKS)
            # whether vLLM's handshake with P made this rank permute P's pages on receipt
            outcome["permute_local_kv"] = bool(getattr(d.worker, "enable_permute_local_kv", False))
            # which of P's agents D's NIXL agent holds after the read (a refused P's: none)
            outcome["p_agents_loaded"] = [
                bool(d.worker.nixl_wrapper.check_remote_metadata(agent))
                for agent in command.get("p_agents", [])
            ]
            reads.append(outcome)
        return {"reads": reads, "handshake_errors": list(errors)}

    def read_together(self, command: dict[str, Any]) -> dict[str, Any]:
        """Several requests handed to D's rank 0 in one step (``requests``: each a ``tag``, P's
        ``kv_transfer_params`` relayed verbatim, and D's ``local_blocks``), vLLM and the
        plugin stepping them together; per request, whether and when (seconds from the step
        they were handed on) it finished, and whether it failed."""
        _, sides, errors = self.engines[command["name"]]
        errors.clear()
        d = sides[0]
        wanted = [(r["tag"], r["kv_transfer_params"], list(r["local_blocks"]))
                  for r in command["requests"]]  # fmt: skip
        return {"requests": _requests(d, wanted), "handshake_errors": list(errors)}

    def stop(self, command: dict[str, Any]) -> dict[str, Any]:
        _, sides, _ = self.engines.pop(command["name"])
        return _stop(sides)

    def check_cost(self, command: dict[str, Any]) -> dict[str, Any]:
        """Seconds per call of safeview's per-request check on D's rank 0, for a request whose
        token was judged (``kv_transfer_params`` of a read already done), over ``calls``."""
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnectorMetadata

        _, sides, _ = self.engines[command["name"]]
        worker = sides[0].worker
        judge = worker._safeview_layout  # the plugin's WorkerLayout of this worker
        metadata = NixlConnectorMetadata()
        metadata.add_new_req_to_recv("cost", ([4],), dict(command["kv_transfer_params"]))
        meta = metadata.reqs_to_recv["cost"]
        token = meta.safeview_token
        calls = int(command.get("calls", 20000))
        started = time.perf_counter()
        for _ in range(calls):
            judge.check_request("cost", token, meta)
        seconds = (time.perf_counter() - started) / calls
        return {
            "seconds_per_check": seconds,
            "verdict": repr(judge.check_request("cost", token, meta)),
        }


def _stop(sides: list[Any]) -> dict[str, Any]:
    """Shut ``sides``' connectors down and collect them at once: a NIXL agent's UCX threads poll
    even when idle (on CPU about two thirds of a core per process), and an agent sits in
    reference cycles, so one left for the collector keeps its threads; a large engine kept
    would slow every later step of the process. The threads the process has left, after."""
    import gc

    while sides:
        side = sides.pop()
        with contextlib.suppress(Exception):
            side.connector.shutdown()
        del side
    gc.collect()
    return {"threads": len(os.listdir("/proc/self/task"))}


def _p_step(sides: list[Any], scheduler: Any) -> dict[str, Any]:
    """P's engine step after a request finished, as vLLM's engine core runs it: the
    scheduler's metadata (``build_connector_meta``) to every rank (``bind_connector_metadata``,
    ``start_load_kv``), each rank's worker metadata (``build_connector_worker_meta``),
    aggregated over the ranks as vLLM's executor aggregates it, to the scheduler
    (``update_connector_output``). With safeview's digests on, P's ranks digest the request
    here, and the scheduler keeps what they made. What it keeps, by request: the ranks."""
    from types import SimpleNamespace

    from vllm.config import set_current_vllm_config
    from vllm.v1.outputs import KVConnectorOutput

    with set_current_vllm_config(sides[0].config):
        metadata = scheduler.build_connector_meta(SimpleNamespace())
        made = None
        for side in sides:
            side.connector.bind_connector_metadata(metadata)
            side.connector.start_load_kv(None)
            mine = side.connector.build_connector_worker_meta()
            side.connector.clear_connector_metadata()
            if mine is not None:
                made = mine if made is None else made.aggregate(mine)
        scheduler.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=made))
    kept = getattr(scheduler.connector_scheduler, "_safeview_digests", None)
    return {} if kept is None else {k: sorted(v) for k, v in kept.digests.items()}


class _Loaded:
    """P's caches as D's oracle reads them (``kv_caches`` by layer name)."""

    def __init__(self, kv_caches: dict[str, Any]) -> None:
        self.kv_caches = kv_caches


@contextlib.contextmanager
def _fault_after_read(d: Any, fault: Mapping[str, Any] | None) -> Any:
    """A fault in D's pages once NIXL reports the READ done and before vLLM's worker hands the
    request on (its ``_pop_done_transfers``, inside ``get_transfer_results``): ``unwritten``,
    one layer's blocks of the request back to zero, as if the READ never wrote that layer;
    ``overwritten``, one block of one layer filled with other bytes, as a writer of D's own
    would after the READ and before decode."""
    import torch

    worker = d.worker
    original = worker._pop_done_transfers
    if not fault:
        yield
        return
    generator = torch.Generator().manual_seed(7)
    layer = str(fault["layer"])

    def pop_done(transfers: Any) -> Any:
        done, failed = original(transfers)
        if done:
            cache = d.kv_caches[layer]
            if fault["kind"] == "unwritten":
                cache[list(LOCAL_BLOCKS)] = 0
            else:
                block = cache[LOCAL_BLOCKS[int(fault.get("block", 0))]]
                noise = torch.randint(0, 256, (block.numel() * block.element_size(),),
                                      generator=generator, dtype=torch.uint8)  # fmt: skip
                block.copy_(noise.view(block.dtype).view(block.shape))
        return done, failed

    worker._pop_done_transfers = pop_done
    try:
        yield
    finally:
        worker._pop_done_transfers = original


@contextlib.contextmanager
def _timed(d: Any) -> Iterator[list[float]]:
    """The seconds D's worker spends in the plugin's digest steps (noting the reads, settling
    what vLLM reports read: D's digest, the judgement) while the block runs: wall clock, and
    the thread's CPU time."""
    own = [0.0, 0.0]
    state = getattr(d.worker, "_safeview_digest", None)
    if state is None:
        yield own
        return

    def timed(method: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            started, started_cpu = time.perf_counter(), time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                own[0] += time.perf_counter() - started
                own[1] += time.thread_time() - started_cpu

        return run

    for name in ("note_reads", "settle"):
        setattr(state, name, timed(getattr(state, name)))
    try:
        yield own
    finally:
        for name in ("note_reads", "settle"):
            delattr(state, name)


def _request(d: Any, request_id: str, params: dict[str, Any], timeout_s: float = 60) -> Any:
    """D's scheduler hands the request, with P's ``kv_transfer_params`` relayed verbatim, to
    its worker (``add_new_req_to_recv``: what ``build_connector_meta`` does); vLLM does the
    rest. Whether it finished, and whether it failed."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnectorMetadata

    groups = len(d.kv_cache_config.kv_cache_groups)
    metadata = NixlConnectorMetadata()
    metadata.add_new_req_to_recv(
        request_id, tuple(list(LOCAL_BLOCKS) for _ in range(groups)), dict(params)
    )
    started = time.perf_counter()
    outcome: dict[str, Any] = {"done": False, "failed": None}
    with set_current_vllm_config(d.config):
        while time.perf_counter() - started < timeout_s:
            d.connector.bind_connector_metadata(metadata)
            d.connector.start_load_kv(None)
            d.connector.clear_connector_metadata()
            metadata = NixlConnectorMetadata()
            results = d.connector.get_transfer_results(set())
            if request_id in results.finished_recving:
                outcome = {"done": True, "failed": request_id in results.failed_recving}
                break
            time.sleep(0.02)
    outcome["seconds"] = round(time.perf_counter() - started, 3)
    return outcome


def _requests(
    d: Any, wanted: list[tuple[str, dict[str, Any], list[int]]], timeout_s: float = 60
) -> dict[str, Any]:
    """``_request`` for several requests at once, each into its own blocks of D's: by request,
    whether it finished, whether it failed, and the seconds from the step they were handed on
    to the step that reported it finished."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnectorMetadata

    groups = len(d.kv_cache_config.kv_cache_groups)
    metadata = NixlConnectorMetadata()
    outcome: dict[str, Any] = {}
    for request_id, params, blocks in wanted:
        for cache in d.kv_caches.values():
            cache[blocks] = 0
        metadata.add_new_req_to_recv(
            request_id, tuple(list(blocks) for _ in range(groups)), dict(params)
        )
        outcome[request_id] = {"done": False, "failed": None, "seconds": None}
    started = time.perf_counter()
    with set_current_vllm_config(d.config):
        while time.perf_counter() - started < timeout_s:
            d.connector.bind_connector_metadata(metadata)
            d.connector.start_load_kv(None)
            d.connector.clear_connector_metadata()
            metadata = NixlConnectorMetadata()
            results = d.connector.get_transfer_results(set())
            for request_id in outcome.keys() & results.finished_recving:
                outcome[request_id] = {
                    "done": True,
                    "failed": request_id in results.failed_recving,
                    "seconds": round(time.perf_counter() - started, 3),
                }
            if all(found["done"] for found in outcome.values()):
                break
            time.sleep(0.02)
    return outcome


def _main(role: str) -> None:
    from safeview.testing import capture_events

    child = base._Child()
    # one model, as two machines serving it name it alike: vLLM's compatibility hash holds the
    # model's name (here the folder of its config.json), so both sides use the test's folder
    models = Path(os.environ["ACROSS_MODELS_DIR"])
    child.models = {path.name: path for path in models.iterdir() if path.is_dir()}
    side = _Serve(child) if role == "P" else _Read(child)
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        if op == "exit":
            break
        answer: dict[str, Any] = {"op": op, "error": None}
        with capture_events() as events:
            try:
                answer.update(getattr(side, op)(command))
            except Exception as error:
                answer["error"] = {**base._error(op, error),
                                   "traceback": traceback.format_exception(error)[-6:]}  # fmt: skip
            finally:
                child.restore_affinity()
        answer["events"] = base._json_safe(events)
        sys.stdout.write(RESULT_PREFIX + json.dumps(answer) + "\n")
        sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # UCX may crash the interpreter at exit; a P that leaves so is a P that died


if __name__ == "__main__":
    _main(sys.argv[1])


__all__ = [
    "LOCAL_BLOCKS", "RESULT_PREFIX", "Child", "Engine", "asdict", "free_port", "remote_blocks",
]  # fmt: skip
