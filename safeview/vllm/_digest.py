"""Bytes verified in flight on vLLM 0.33's NIXL connector (issue 29): with ``SAFEVIEW_DIGEST``
set on both sides, P digests a sampled request's blocks before D reads them, and D compares
what arrived with it before the request decodes.

Where each step runs, and why there:

- **P's scheduler**, ``request_finished`` (the prefill is complete; vLLM returns the request's
  ``kv_transfer_params`` for the proxy to relay to D): it samples the request, notes its blocks
  and token count, and marks its ``kv_transfer_params`` (``safeview_digest``). The digest
  cannot ride those params: the workers hold the KV, and in the step a prefill finishes vLLM
  calls ``request_finished`` before ``update_connector_output``, so nothing a worker computes
  in that step reaches that request's params.
- **P's workers**, ``start_load_kv`` of the next step (the scheduler's metadata of that step
  carries the noted requests; the KV of the finished step is complete, and D has not been told
  of the request's blocks before): each rank digests its heads, and hands the digest back to
  the scheduler as KV-connector worker metadata (``build_connector_worker_meta``, which vLLM
  aggregates over the ranks and gives to ``update_connector_output``).
- **P's side channel**: the scheduler's listener, which serves the handshake, also answers one
  more message (``safeview_digest``, the request id): the digests of every rank of P it holds
  (none yet: an empty answer, asked again). A handshake is answered byte for byte as vLLM's
  own listener answers it; what vLLM's listener would die of (a rank P does not hold, a
  message it cannot read) is answered with an error, and the listener goes on. D asks only a
  P that marked the request, so a P without safeview is never sent a message it does not know.
- **D's worker**: ``start_load_kv`` notes a marked request and starts fetching P's digests
  (``DigestFetcher``: one daemon thread per process asks for every awaited request at once,
  each on its own socket and against its own deadline); ``get_transfer_results``, once vLLM
  reports the READ done (after its own post-processing: block-size and layout conversion),
  digests D's blocks and holds the request back until P's digests are there (at most
  ``WAIT_S``), then ``safeview.manifest.digest.judge`` decides: the same meaning, the request
  goes on; another meaning, a ``digest_mismatch`` event (warn), or under strict the request
  fails as vLLM fails a KV load (its blocks reported invalid: ``kv_load_failure_policy``
  recomputes or fails it). P's digests that cannot be had: ``digest_checked`` with
  ``not_judged``, and the request goes on. D itself is never stopped.

Imported by ``safeview.vllm`` only, when ``SAFEVIEW_DIGEST`` is not ``off``.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

from safeview.manifest import Manifest
from safeview.manifest.digest import Digest, DigestSampling, digest, judge, not_judged
from safeview.policy import Policy

__all__ = [
    "DIGEST_MSG",
    "MARK_KEY",
    "guard_digest_scheduler",
    "guard_digest_worker",
]

MARK_KEY = "safeview_digest"  # kv_transfer_params: P digested this request
MARK_ATTRIBUTE = "safeview_digest"  # where D's ReqMeta keeps the mark
DIGEST_MSG = "safeview_digest"  # the side-channel message: (DIGEST_MSG, request id, 0)
_NOTED = "safeview_digests"  # on NixlConnectorMetadata: {request: (block ids, tokens)}
_PATCHED = "__safeview_digest__"
KEPT = 4096  # digests P's scheduler keeps (the oldest go first)
WAIT_S = 5.0  # how long D holds a request back for P's digests
ASK_EVERY_S = 0.02  # how often D asks again while P has no digest yet
MAX_ASKING = 256  # requests D asks P's side channels about at once (a socket each)


# -- the worker metadata that carries P's digests to its scheduler -------------------------------


def _meta_class() -> type:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata

    class SafeviewDigests(KVConnectorWorkerMetadata):  # type: ignore[misc]
        """P's digests of this step: ``{request: {tp_rank: wire}}``."""

        def __init__(self, digests: dict[str, dict[int, bytes]]) -> None:
            self.digests = digests

        def aggregate(self, other: Any) -> Any:
            for request, ranks in getattr(other, "digests", {}).items():
                self.digests.setdefault(request, {}).update(ranks)
            return self

    SafeviewDigests.__module__ = __name__
    SafeviewDigests.__qualname__ = "SafeviewDigests"
    return SafeviewDigests


_META: type | None = None


def meta_class() -> type:
    global _META
    if _META is None:
        _META = _meta_class()
    return _META


def __getattr__(name: str) -> Any:
    # pickle finds the class by name (vLLM's executor pickles what workers return)
    if name == "SafeviewDigests":
        return meta_class()
    raise AttributeError(name)


# -- P: the scheduler ---------------------------------------------------------------------------


class _Kept:
    """P's digests by request, the newest ``KEPT``, shared by the scheduler's thread (which
    adds) and its side-channel listener (which reads)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.digests: collections.OrderedDict[str, dict[int, bytes]] = collections.OrderedDict()

    def add(self, found: Mapping[str, Mapping[int, bytes]]) -> None:
        with self.lock:
            for request, ranks in found.items():
                self.digests.setdefault(request, {}).update(ranks)
                self.digests.move_to_end(request)
            while len(self.digests) > KEPT:
                self.digests.popitem(last=False)

    def get(self, request: str) -> dict[int, bytes]:
        with self.lock:
            return dict(self.digests.get(request, {}))


def guard_digest_scheduler(connector: Any, sampling: DigestSampling) -> None:
    """On P's scheduler-side NIXL connector: answer D's questions on the side channel (always,
    so that a D that asks a P with the plugin gets an answer, an empty one when P digests
    nothing), and with ``sampling`` on, sample finished requests, carry them to the workers
    and keep the workers' digests."""
    for part in [connector, *getattr(connector, "_connectors", ())]:
        scheduler = getattr(part, "connector_scheduler", None)
        needed = ("request_finished", "build_connector_meta", "update_connector_output")
        if scheduler is None or not all(hasattr(scheduler, name) for name in needed):
            continue
        if "_safeview_digests" in vars(scheduler):
            continue  # guarded already
        if not hasattr(type(scheduler), "_nixl_handshake_listener"):
            continue  # a scheduler that serves its side channel otherwise: D is never told
        _guard_one_scheduler(scheduler, sampling)


def _guard_one_scheduler(scheduler: Any, sampling: DigestSampling) -> None:
    kept = _Kept()
    # an attribute of the instance is looked up before the class's static method, when
    # set_xfer_handshake_metadata starts the listener's thread
    engine = getattr(scheduler, "engine_id", None)
    scheduler._nixl_handshake_listener = _listener(kept, None if engine is None else str(engine))
    scheduler._safeview_digests = kept  # for a look from outside
    _say_listening(scheduler)
    if sampling.mode == "off":
        return
    finished = scheduler.request_finished
    build = scheduler.build_connector_meta
    update = scheduler.update_connector_output
    noted: dict[str, tuple[Any, int]] = {}
    count = [0]

    @functools.wraps(finished)
    def request_finished(request: Any, block_ids: Any, *args: Any, **kwargs: Any) -> Any:
        result = finished(request, block_ids, *args, **kwargs)
        try:
            delay, params = result
            if delay and isinstance(params, dict) and params.get("do_remote_prefill"):
                count[0] += 1
                if sampling.wants(count[0] - 1):
                    tokens = int(params.get("remote_num_tokens") or request.num_computed_tokens)
                    noted[str(request.request_id)] = (params["remote_block_ids"], tokens)
                    params[MARK_KEY] = 1
        except Exception:  # never in vLLM's way: this request is not digested
            noted.pop(str(getattr(request, "request_id", "")), None)
        return result

    @functools.wraps(build)
    def build_connector_meta(*args: Any, **kwargs: Any) -> Any:
        meta = build(*args, **kwargs)
        if noted:
            try:
                setattr(meta, _NOTED, dict(noted))
            finally:
                noted.clear()
        return meta

    @functools.wraps(update)
    def update_connector_output(output: Any, *args: Any, **kwargs: Any) -> Any:
        found = getattr(getattr(output, "kv_connector_worker_meta", None), "digests", None)
        if isinstance(found, dict):
            kept.add(found)
        return update(output, *args, **kwargs)

    for wrapper in (request_finished, build_connector_meta, update_connector_output):
        setattr(wrapper, _PATCHED, True)
    scheduler.request_finished = request_finished
    scheduler.build_connector_meta = build_connector_meta
    scheduler.update_connector_output = update_connector_output


def _say_listening(scheduler: Any) -> None:
    """The payloads this scheduler serves say that its side channel answers D's verdicts
    (``safeview.vllm._nixl.mark_listening``), before vLLM encodes them."""
    from safeview.vllm._nixl import mark_listening

    original = getattr(scheduler, "set_xfer_handshake_metadata", None)
    if original is None:  # a scheduler of another shape: D just does not tell P
        return

    @functools.wraps(original)
    def set_xfer_handshake_metadata(metadata: Any, *args: Any, **kwargs: Any) -> Any:
        with contextlib.suppress(Exception):  # never in vLLM's way: D just does not tell P
            mark_listening(metadata)
        return original(metadata, *args, **kwargs)

    scheduler.set_xfer_handshake_metadata = set_xfer_handshake_metadata


def _heard(engine: str | None, said: Any) -> None:
    """P: what a D found of their pair at its handshake (``VERDICT_MSG``), in P's log."""
    from safeview import log

    if not isinstance(said, dict):
        return
    fingerprints = said.get("remote_fingerprints")
    log.layout_judged(
        engine=engine,
        remote_engine=str(said.get("engine")),
        remote_tp_rank=said.get("tp_rank"),
        remote_tp_size=said.get("tp_size"),
        verdict=str(said.get("verdict")),
        fingerprints=[str(f) for f in fingerprints] if isinstance(fingerprints, list) else [],
        remote_fingerprint=str(said.get("fingerprint")),
        policy=str(said.get("policy")),
    )


def _listener(kept: _Kept, engine: str | None = None) -> Callable[..., None]:
    """vLLM 0.33's side-channel listener (``NixlConnectorScheduler._nixl_handshake_listener``:
    a ZMQ ROUTER that answers ``(GET_META_MSG, pp_rank, tp_rank)`` with that rank's encoded
    payload and the scheduler's clock), answering as it does, plus ``(DIGEST_MSG, request,
    0)`` with the msgpack map of P's digests of ``request`` by rank, and ``(VERDICT_MSG, what
    D found, 0)`` (D's verdict on the pair at its handshake, logged as ``layout_judged``) with
    ``ok``.

    Unlike vLLM's own, it outlives what it cannot serve: a rank P does not hold (vLLM's raises
    ``KeyError`` and its thread ends, and every later handshake to P times out) or a message it
    cannot read is answered, in place of the payload, with a msgpack string that says why
    (``SideChannelError`` for safeview's D, a payload vLLM's D fails to decode at once), and the
    listener goes on; a message without a REQ socket's envelope is dropped."""
    import logging

    import msgspec
    import zmq  # type: ignore[import-not-found,unused-ignore]  # vLLM's dependency
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import GET_META_MSG
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import zmq_ctx
    from vllm.utils.network_utils import make_zmq_path

    from safeview.vllm._nixl import VERDICT_MSG

    logger = logging.getLogger("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler")

    def answer(frames: list[bytes], encoded_data: Mapping[Any, Any]) -> list[bytes] | None:
        if len(frames) != 3 or frames[1] != b"":
            logger.warning(
                "safeview: side-channel listener dropped a message of %d frames without a "
                "REQ socket's envelope (3 frames, the second empty)",
                len(frames),
            )
            return None
        identity, _, msg = frames
        clock = msgspec.msgpack.encode(time.perf_counter())
        try:
            kind, first, second = msgspec.msgpack.decode(msg)
        except Exception as error:  # not the 3-item array every peer sends
            said = f"safeview: P's side channel cannot read the message ({error})"
            logger.warning("%s", said)
            return [identity, b"", msgspec.msgpack.encode(said), clock]
        if kind == DIGEST_MSG:
            return [identity, b"", msgspec.msgpack.encode(kept.get(str(first)))]
        if kind == VERDICT_MSG:
            _heard(engine, first)
            return [identity, b"", msgspec.msgpack.encode("ok")]
        if kind != GET_META_MSG:
            logger.warning("Connection listener got unexpected message %s", kind)
        try:
            payload = encoded_data[(first, second)]
        except (KeyError, TypeError):  # a rank P does not hold, or no rank at all
            held = ", ".join(f"({pp}, {tp})" for pp, tp in sorted(encoded_data))
            said = (
                f"safeview: P's side channel serves no handshake of (pp_rank, tp_rank) "
                f"({first!r}, {second!r}); it serves {held or 'none'}"
            )
            logger.warning("%s", said)
            payload = msgspec.msgpack.encode(said)
        return [identity, b"", payload, clock]

    def listen(
        encoded_data: dict[tuple[int, int], Any],
        ready_event: threading.Event,
        stop_event: threading.Event,
        host: str,
        port: int,
    ) -> None:
        with zmq_ctx(zmq.ROUTER, make_zmq_path("tcp", host, port)) as sock:
            sock.setsockopt(zmq.RCVTIMEO, 1000)
            ready_event.set()
            while True:
                try:
                    frames = sock.recv_multipart()
                except zmq.Again:
                    if stop_event.is_set():
                        break
                    continue
                try:
                    reply = answer(frames, encoded_data)
                    if reply is not None:
                        sock.send_multipart(reply)
                except Exception as error:  # the listener serves every later handshake
                    logger.warning("safeview: side-channel listener left a message: %r", error)

    return listen


# -- both sides: the worker ---------------------------------------------------------------------


def _kernel_ids(worker: Any, groups: Sequence[Sequence[int]]) -> list[list[int]]:
    """A request's logical block ids per KV-cache group as the worker's kernel blocks (vLLM's
    own conversion where the kernel block is smaller)."""
    ratio = int(getattr(worker, "_physical_blocks_per_logical_kv_block", 1) or 1)
    convert = getattr(worker, "_logical_to_kernel_block_ids", None)
    if ratio == 1 or convert is None:
        return [list(group) for group in groups]
    return [list(group) for group in convert(groups, ratio)]


def _digest_blocks(
    manifest: Manifest, kv_caches: Mapping[str, Any], groups: Sequence[Sequence[int]], tokens: int
) -> Digest:
    """One rank's digest of a request: each layer over the blocks of its KV-cache group (group 0
    where it names none); Mamba state layers are left out (their pages hold no tokens)."""
    by_group: dict[int, list[str]] = {}
    for name, layer in manifest.layers.items():
        if layer.kind == "state":
            continue
        group = layer.group if isinstance(layer.group, int) and layer.group >= 0 else 0
        by_group.setdefault(group, []).append(name)
    values: dict[str, dict[int, int]] = {}
    dtypes: dict[str, str] = {}
    for group, names in by_group.items():
        ids = groups[group] if group < len(groups) else []
        if not ids:
            continue
        part = digest(manifest, kv_caches, ids, layers=names, num_tokens=tokens)
        values.update({name: dict(per) for name, per in part.values.items()})
        dtypes.update(part.dtypes)  # so that a finding names both sides' element types
    topology = manifest.topology
    return Digest(
        tokens, values, topology.tp_rank, topology.tp_size, manifest.fingerprint, dtypes=dtypes
    )


class DigestWorker:
    """One NIXL worker's side of the digests: P's digests made this step, D's requests awaited
    and held."""

    def __init__(
        self, worker: Any, manifest: Callable[[], Manifest], policy: Policy, engine: str | None
    ) -> None:
        self.worker = worker
        self.manifest = manifest
        self.policy = policy
        self.engine = engine
        self.made: dict[str, dict[int, bytes]] = {}  # P: this step's digests
        self.awaited: dict[str, Any] = {}  # D: marked requests being read (their ReqMeta)
        self.asked: dict[str, Future[dict[int, bytes] | None]] = {}
        self.held: dict[str, tuple[Any, Digest, float]] = {}  # D: read, judged when P's come

    # P
    def digest_noted(self, metadata: Any) -> None:
        noted = getattr(metadata, _NOTED, None)
        if not noted:
            return
        manifest = self.manifest()
        rank = manifest.topology.tp_rank
        for request, (groups, tokens) in noted.items():
            try:
                ids = _kernel_ids(self.worker, groups)
                made = _digest_blocks(manifest, self.worker.device_kv_caches, ids, int(tokens))
                self.made.setdefault(str(request), {})[rank] = made.to_wire()
            except Exception as error:  # this request goes undigested; D says not judged
                from safeview import log

                log.internal_error(where=f"digest of request {request} on P", error=error)

    def worker_meta(self) -> Any:
        if not self.made:
            return None
        made, self.made = self.made, {}
        return meta_class()(made)

    # D
    def note_reads(self, metadata: Any) -> None:
        for request, meta in getattr(metadata, "reqs_to_recv", {}).items():
            if getattr(meta, MARK_ATTRIBUTE, False) and getattr(meta, "remote", None) is not None:
                self.awaited[str(request)] = meta
                # a P met before: its digests are asked for while the READ runs (a P met
                # for the first time is asked once its handshake says it runs safeview)
                self._ask(str(request), meta)

    def _ask(self, request: str, meta: Any) -> bool:
        """Start fetching P's digests of ``request``; ``False`` when P's handshake carried no
        manifest of safeview's (a P without the plugin: its side channel is not asked)."""
        remote = meta.remote
        layout = getattr(self.worker, "_safeview_layout", None)
        if str(remote.engine_id) not in getattr(layout, "carried", ()):
            return False
        self.asked[request] = _FETCHER.submit(
            str(remote.host), int(remote.port), str(remote.request_id), WAIT_S
        )
        return True

    def settle(self, results: Any) -> Any:
        """After vLLM's ``get_transfer_results``: digest each marked request it reports read,
        hold it back until P's digests are there, judge it; ``results`` as vLLM reads it."""
        done = getattr(results, "finished_recving", None)
        failed = getattr(results, "failed_recving", None)
        if done is None or failed is None:
            return results
        for request in [r for r in done if r in self.awaited]:
            meta = self.awaited.pop(request)
            if request in failed:  # vLLM fails it already: nothing to compare
                self.asked.pop(request, None)
                continue
            if any(getattr(meta, "local_num_computed_blocks", ()) or ()):
                self.asked.pop(request, None)
                self._not_judged(request, meta, "D's own prefix cache held part of the request")
                continue
            try:
                ids = [list(g) for g in meta.local_physical_block_ids]
                tokens = int(meta.remote.num_tokens or 0)
                mine = _digest_blocks(self.manifest(), self.worker.device_kv_caches, ids, tokens)
            except Exception as error:
                self.asked.pop(request, None)
                self._not_judged(request, meta, f"D's digest failed: {error}")
                continue
            if request not in self.asked and not self._ask(request, meta):
                self._not_judged(
                    request, meta, "P's handshake carried no safeview manifest: P is not asked"
                )
                continue
            self.held[request] = (meta, mine, time.monotonic() + WAIT_S)
            done.discard(request)
        for request, (meta, mine, deadline) in list(self.held.items()):
            # the common case: P's digests came while the READ ran, and the request is judged
            # in the step its READ is reported done
            asked = self.asked.get(request)
            if asked is not None and not asked.done() and time.monotonic() < deadline:
                continue  # still held: reported done in a later step
            del self.held[request]
            self.asked.pop(request, None)
            done.add(request)
            found, why = None, f"P's digests did not come within {WAIT_S:g} s"
            if asked is not None and asked.done():
                try:
                    found = asked.result()
                except Exception as error:  # the side channel's own failure
                    why = f"P's side channel: {type(error).__name__}: {error}"
            if not found:
                self._not_judged(request, meta, why)
                continue
            refusal = self._judge(request, meta, found, mine)
            if refusal is not None:  # as vLLM fails a KV load: kv_load_failure_policy decides
                failed.add(request)
                with contextlib.suppress(Exception):
                    self.worker._invalid_block_ids.put(set(meta.local_block_ids[0]))
        return results

    def _fields(self, meta: Any) -> dict[str, Any]:
        topology = self.manifest().topology
        return {
            "engine": self.engine,
            "tp_rank": topology.tp_rank,
            "tp_size": topology.tp_size,
            "remote_engine": str(meta.remote.engine_id),
            "remote_tp_size": int(getattr(meta, "tp_size", 1)),
        }

    def _judge(
        self, request: str, meta: Any, found: Mapping[int, bytes], mine: Digest
    ) -> Exception | None:
        remote = str(meta.remote.engine_id)
        try:
            sent = [
                Digest.from_wire(wire, peer=f"P {remote} rank {rank} (request {request})")
                for rank, wire in sorted(found.items())
            ]
        except Exception as error:
            self._not_judged(request, meta, str(error))
            return None
        splits = {(d.cp_size, d.cp_interleave) for d in sent}
        if mine.cp_size > 1 and splits != {(mine.cp_size, mine.cp_interleave)}:
            # this rank holds some of the request's tokens, and P's ranks hold others: only
            # all of D's context-parallel ranks together are the request
            self._not_judged(
                request,
                meta,
                f"D's rank holds context-parallel part {mine.cp_rank} of {mine.cp_size} of the "
                "request's tokens and P's ranks split them otherwise: one D rank alone is not "
                "compared",
            )
            return None
        return judge(sent, mine, policy=self.policy, request=request, **self._fields(meta))

    def _not_judged(self, request: str, meta: Any, reason: str) -> None:
        not_judged(reason, policy=self.policy, request=request, **self._fields(meta))


class _Ask:
    """One request's fetch: asked on a socket of its own until its own deadline."""

    __slots__ = ("answered", "deadline", "future", "host", "next_at", "port", "request", "socket",
                 "wait_s")  # fmt: skip

    def __init__(self, host: str, port: int, request: str, wait_s: float) -> None:
        self.future: Future[dict[int, bytes] | None] = Future()
        self.host, self.port, self.request, self.wait_s = host, port, request, wait_s
        self.deadline = time.monotonic() + wait_s  # counted from this request's own fetch
        self.next_at = 0.0
        self.answered = False  # P answered at least once (with no digest yet)
        self.socket: Any = None


class DigestFetcher:
    """D's fetches of P's digests, all on one daemon thread, none waiting behind another: each
    request asks P's side channel on a socket of its own, again every ``ASK_EVERY_S`` while P
    has no digest yet, until its own deadline; one poller waits for all their answers. A
    request P never digested, or a P that never answers, holds back no other request.

    At most ``MAX_ASKING`` requests are asked at once (one socket each); the rest wait their
    turn, their deadlines running. While nothing is asked the thread holds no socket and no ZMQ
    context, and nothing of a finished fetch: its answer is in its ``Future``."""

    def __init__(self, name: str = "safeview-digest") -> None:
        self.name = name
        self.new: queue.SimpleQueue[_Ask] = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()

    def submit(
        self, host: str, port: int, request: str, wait_s: float
    ) -> Future[dict[int, bytes] | None]:
        """P's digests of ``request`` from the side channel at ``host:port``, in a ``Future``:
        ``{rank: wire}``; ``None`` when P answered with none within ``wait_s``;
        ``TimeoutError`` when P did not answer at all, ``SideChannelError`` when it answered
        with an error, what ZMQ or msgpack raise otherwise."""
        ask = _Ask(host, port, request, wait_s)
        self.new.put(ask)
        if self.thread is None:
            with self.lock:
                if self.thread is None:
                    self.thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                    self.thread.start()
        return ask.future

    def _run(self) -> None:
        while True:
            first = self.new.get()  # idle: nothing held
            with contextlib.suppress(Exception):  # each fetch has its outcome already
                self._serve(first)
            del first

    def _serve(self, first: _Ask) -> None:
        """Ask until every request taken is answered or out of time."""
        import zmq  # type: ignore[import-not-found,unused-ignore]  # vLLM's dependency

        context = zmq.Context()
        poller = zmq.Poller()
        waiting: collections.deque[_Ask] = collections.deque([first])  # not asked yet
        asking: dict[Any, _Ask] = {}  # by socket: asked, P's answer awaited
        resting: list[_Ask] = []  # P had no digest yet: asked again at ``next_at``
        try:
            while waiting or asking or resting:
                with contextlib.suppress(queue.Empty):
                    while True:
                        waiting.append(self.new.get_nowait())
                now = time.monotonic()
                for ask in [a for a in (*waiting, *asking.values(), *resting) if now >= a.deadline]:
                    self._end(ask, poller, waiting, asking, resting)
                while waiting and len(asking) + len(resting) < MAX_ASKING:
                    ask = waiting.popleft()
                    try:
                        ask.socket = _socket(context, ask.host, ask.port)
                        poller.register(ask.socket, zmq.POLLIN)
                        self._send(ask, asking)
                    except Exception as error:
                        self._end(ask, poller, waiting, asking, resting, error=error)
                for ask in [a for a in resting if now >= a.next_at]:
                    resting.remove(ask)
                    try:
                        self._send(ask, asking)
                    except Exception as error:
                        self._end(ask, poller, waiting, asking, resting, error=error)
                times = [a.deadline for a in (*asking.values(), *resting)]
                times += [a.next_at for a in resting]
                pause = min([ASK_EVERY_S, *(t - time.monotonic() for t in times)])
                for sock, _ in poller.poll(max(0, int(pause * 1000))):
                    ask = asking.pop(sock)
                    try:
                        found = _read_answer(ask, sock.recv_multipart(zmq.NOBLOCK))
                    except Exception as error:
                        self._end(ask, poller, waiting, asking, resting, error=error)
                        continue
                    if found:
                        self._end(ask, poller, waiting, asking, resting, found=found)
                    else:
                        ask.answered = True
                        ask.next_at = time.monotonic() + ASK_EVERY_S
                        resting.append(ask)
        except BaseException as error:  # safeview's own failure: every fetch taken learns it
            for ask in [*waiting, *asking.values(), *resting]:
                self._end(ask, poller, waiting, asking, resting, error=error)
        finally:
            context.destroy(linger=0)

    @staticmethod
    def _send(ask: _Ask, asking: dict[Any, _Ask]) -> None:
        import msgspec

        ask.socket.send(msgspec.msgpack.encode((DIGEST_MSG, ask.request, 0)))
        asking[ask.socket] = ask

    @staticmethod
    def _end(
        ask: _Ask, poller: Any, waiting: collections.deque[_Ask], asking: dict[Any, _Ask],
        resting: list[_Ask], *, found: dict[int, bytes] | None = None,
        error: BaseException | None = None,
    ) -> None:  # fmt: skip
        """``ask`` done: its socket closed, its outcome in its future, nothing of it kept."""
        with contextlib.suppress(ValueError):
            waiting.remove(ask)
        with contextlib.suppress(ValueError):
            resting.remove(ask)
        if ask.socket is not None:
            asking.pop(ask.socket, None)
            with contextlib.suppress(Exception):
                poller.unregister(ask.socket)
            with contextlib.suppress(Exception):
                ask.socket.close(linger=0)
            ask.socket = None
        if ask.future.done():
            return
        if error is None and found is None and not ask.answered:
            error = TimeoutError(f"no answer from {ask.host}:{ask.port} within {ask.wait_s:g} s")
        if error is not None:
            ask.future.set_exception(error)
        else:
            ask.future.set_result(found)


def _socket(context: Any, host: str, port: int) -> Any:
    import zmq  # type: ignore[import-not-found,unused-ignore]
    from vllm.utils.network_utils import make_zmq_path, make_zmq_socket

    return make_zmq_socket(
        ctx=context, path=make_zmq_path("tcp", host, port), socket_type=zmq.REQ, bind=False,
        linger=0,
    )  # fmt: skip


def _read_answer(ask: _Ask, frames: list[bytes]) -> dict[int, bytes]:
    """P's answer to a digest question: ``{rank: wire}``, empty while P has none yet."""
    import msgspec

    from safeview.vllm._nixl import SideChannelError

    found = msgspec.msgpack.decode(frames[0])
    asked = f"digests of request {ask.request}"
    peer = f"P's side channel at {ask.host}:{ask.port}"
    if isinstance(found, str):  # P's listener says why it cannot answer
        raise SideChannelError(peer, asked, found)
    if not isinstance(found, dict):
        raise SideChannelError(peer, asked, f"a {type(found).__name__}, not a map of ranks")
    return {int(rank): bytes(wire) for rank, wire in found.items()}


#: one per process: every D worker's fetches share its thread
_FETCHER = DigestFetcher()


def guard_digest_worker(
    connector: Any, worker: Any, manifest: Callable[[], Manifest], policy: Policy
) -> None:
    """Wrap, on the instances: ``worker.start_load_kv`` (P digests the requests its scheduler
    noted; D notes its marked reads), ``worker.get_transfer_results`` (D judges what arrived)
    and ``connector.build_connector_worker_meta`` (P's digests to its scheduler)."""
    start = worker.start_load_kv
    results = worker.get_transfer_results
    if getattr(start, _PATCHED, False):
        return
    engine = getattr(worker, "engine_id", None)
    state = DigestWorker(worker, manifest, policy, None if engine is None else str(engine))
    build = connector.build_connector_worker_meta

    @functools.wraps(start)
    def start_load_kv(metadata: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            state.digest_noted(metadata)
            state.note_reads(metadata)
        except Exception as error:
            from safeview import log

            log.internal_error(where="digest start_load_kv", error=error)
        return start(metadata, *args, **kwargs)

    @functools.wraps(results)
    def get_transfer_results(*args: Any, **kwargs: Any) -> Any:
        found = results(*args, **kwargs)
        try:
            return state.settle(found)
        except Exception as error:
            from safeview import log

            log.internal_error(where="digest get_transfer_results", error=error)
            return found

    @functools.wraps(build)
    def build_connector_worker_meta(*args: Any, **kwargs: Any) -> Any:
        own = build(*args, **kwargs)
        if own is not None:  # a connector with worker metadata of its own: left alone
            return own
        return state.worker_meta()

    for wrapper in (start_load_kv, get_transfer_results, build_connector_worker_meta):
        setattr(wrapper, _PATCHED, True)
    worker.start_load_kv = start_load_kv
    worker.get_transfer_results = get_transfer_results
    connector.build_connector_worker_meta = build_connector_worker_meta
    worker._safeview_digest = state
