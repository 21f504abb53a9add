"""Bytes verified in flight on SGLang 0.5.23's Mooncake P/D pair (issue 39, point 3): with
``SAFEVIEW_DIGEST`` set on both sides (``off``, ``all``, ``sample:N``; as on vLLM), P digests a
sampled room's pages after they moved and before it reports the room done, the digest travels
on SGLang's own ZMQ channel, and D compares what its pages hold with it before SGLang's
receiver reports the room ``Success``.

A room is sampled by its number (``DigestSampling.wants(bootstrap_room)``): SGLang draws
bootstrap rooms at random, and P and D, each reading its own ``SAFEVIEW_DIGEST``, pick the same
rooms without telling each other which. An unsampled room costs one such test on each hook,
and on D's ``poll`` one dict lookup.

Where each step runs (``sglang/srt/disaggregation/mooncake/conn.py`` and ``common/conn.py``),
and why there:

- **D, ``MooncakeKVManager.build_receiver_registration_message``**, and P,
  ``KVArgsRegisterInfo.from_zmq``: D's registration carries one more frame after safeview's
  manifest, ``DIGEST_FRAME``: this D takes digest messages (SGLang reads frames 0 to 19 by
  position). A D without safeview, or with a safeview that knows no digests on SGLang, does not
  ask, and P sends it nothing of the digest's.
- **P, ``MooncakeKVManager._publish_peer_registration``** (P's bootstrap thread, when a D
  registers): after safeview's manifest, to a D that asked for digests, one message
  ``[DIGEST_FRAME, b"sampling", P's sampling, P's ip:port]``. P sends it before it reads that D's
  first transfer request, on the socket every later status of P goes on: D knows before any
  room whether P digests, and does not wait for a digest that will not come.
- **P, ``MooncakeKVManager.add_transfer_request``** (the scheduler thread, once per chunk
  ``MooncakeKVSender.send`` hands over): for a sampled room, the chunk's page indices (kept by
  reference: the transfer worker reads them only after their copy event) and token count. The
  only place P's room and its pages meet; nothing is read here.
- **P, ``MooncakeKVManager.send_aux``** (the transfer worker, once per room and D rank, on the
  last chunk): SGLang calls it after every KV row of the room went through Mooncake's
  synchronous batches (after the chunk's ``wait_event``: the prefill's KV is complete) and
  before ``conclude_transfer`` sends D the room's status; P still holds the pages (the sender
  frees them only once the room concludes), so they are the bytes that moved. P digests the
  room once (``safeview.manifest.digest.digest`` through P's manifest) and sends each D rank
  that asked for digests ``[DIGEST_FRAME, room, P's ip:port, digest wire, reason]`` (the reason
  instead of a digest when P could not make one) on SGLang's socket to that D, ahead of the
  status message: D has every P rank's digest when its last P rank's ``Success`` arrives.
- **D, ``MooncakeKVManager.handle_chunk_ready``** (the first handler D's decode thread offers
  each message, after ``AUX_DATA``): takes the digest messages (they are not SGLang's) and notes
  which P ranks sent a manifest.
- **D, ``MooncakeKVReceiver.send_metadata``** (the scheduler, when D asks P for a room): notes a
  sampled room's destination pages, the ``kv_indices`` SGLang pairs with P's index by index.
- **D, ``MooncakeKVReceiver.poll``** (the scheduler's question "is this room's KV here?"): when
  SGLang would answer ``Success`` for a noted room, D digests its pages through D's manifest,
  holds the room back (``Transferring``) until every P rank's digest is there (at most
  ``WAIT_S``), and ``judge``s: the same meaning, ``Success``; another meaning, a
  ``digest_mismatch`` event (warn), or under strict the room fails as SGLang fails a transfer
  (``record_failure`` with the reason, ``update_status(room, KVPoll.Failed)``), the reason
  naming safeview's first finding: layer, heads, first tokens that differ. A P rank without
  safeview, one that digests nothing of the room, or a digest that did not come:
  ``digest_checked`` with ``not_judged``, and the room goes on. Each D rank compares its own
  heads with P's ranks' digests combined, so other attention-TP splits are judged by meaning.

safeview's own failure never stops SGLang: one ``integration_unavailable`` event
(``step_aside``), and the room goes on as SGLang alone would take it.
"""

from __future__ import annotations

import collections
import functools
import threading
import time
from typing import Any

from safeview.manifest.digest import (
    Digest,
    DigestSampling,
    digest,
    digest_sampling,
    judge,
    not_judged,
    parse_sampling,
)
from safeview.policy import Policy
from safeview.sglang import pool_buffers, step_aside
from safeview.sglang._mooncake import MANIFEST_FRAME, _side

__all__ = ["DIGEST_FRAME", "WAIT_S", "install_digest"]

DIGEST_FRAME = b"safeview.digest:"
"""The first frame of P's digest messages to a D that runs safeview (never to another)."""

SAMPLING_FRAME = b"sampling"
WAIT_S = 5.0  # how long D holds a room back for P's digests once SGLang reports it done
KEPT = 4096  # rooms each side keeps notes of (the oldest go first)
_PATCHED = "__safeview_digest__"
_STATE = "_safeview_digest_state"
_AWAITED = "_safeview_digest"  # on a receiver: its room's _Awaited, when sampled
_REGISTRATION = 20  # frames of SGLang's own in D's registration (KVArgsRegisterInfo.from_zmq)

_SAMPLING: DigestSampling = DigestSampling("off")
_SUCCESS, _FAILED, _TRANSFERRING = 4, 0, 3  # SGLang's KVPoll (plain ints in 0.5.23)


class _Awaited:
    """D: one sampled room, from ``send_metadata`` until judged."""

    __slots__ = ("deadline", "found", "pages")

    def __init__(self, pages: list[int]) -> None:
        self.pages = pages
        self.deadline: float | None = None  # set when SGLang first says Success
        self.found: dict[str, tuple[bytes | None, str]] = {}  # P's ip:port -> (wire, reason)


class _State:
    """One manager's digest notes (made on first use)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # the tables below; held for dict operations only
        self.digesting = threading.Lock()  # P: one digest at a time among transfer workers
        # P: room -> its chunks so far [(first index, page indices)], tokens (None: unknown)
        self.noted: collections.OrderedDict[int, tuple[list[tuple[int, Any]], list[int | None]]]
        self.noted = collections.OrderedDict()
        self.made: collections.OrderedDict[int, tuple[bytes, str]] = collections.OrderedDict()
        # D: sampled rooms awaited; P's ranks that sent a manifest -> their sampling (None:
        # a safeview that did not say, so digests nothing on SGLang)
        self.awaited: collections.OrderedDict[int, _Awaited] = collections.OrderedDict()
        self.prefills: dict[str, DigestSampling | None] = {}
        self.tensors: dict[str, Any] | None = None


def _state(manager: Any) -> _State:
    known: _State | None = manager.__dict__.get(_STATE)
    if known is None:
        known = manager.__dict__.setdefault(_STATE, _State())
    return known


def _keep(table: collections.OrderedDict[int, Any], room: int, value: Any) -> None:
    table[room] = value
    table.move_to_end(room)
    while len(table) > KEPT:
        table.popitem(last=False)


def pool_tensors(pool: Any, names: Any) -> dict[str, Any]:
    """A tensor of each manifest layer's storage, by layer name, for ``digest`` (which reads a
    layer through its manifest from the storage of the tensor given): ``layers.3`` (K and V of
    one allocation, or an MLA layer) its first buffer, ``layers.3.k`` and ``.v`` their own."""
    buffers = {buffer.name: buffer.tensor for buffer in pool_buffers(pool)}
    return {name: buffers[name] if name in buffers else buffers[f"{name}.k"] for name in names}


# -- P ------------------------------------------------------------------------------------------


def _note_chunk(manager: Any, room: int, pages: Any, index_slice: Any, tokens: Any) -> None:
    state = _state(manager)
    start = int(getattr(index_slice, "start", 0) or 0)
    with state.lock:
        known = state.noted.get(room)
        if known is None or start == 0:  # a new room (or a room number used again)
            known = ([], [])
            _keep(state.noted, room, known)
            state.made.pop(room, None)
        known[0].append((start, pages))
        known[1].append(None if tokens is None else int(tokens))


def _page_list(pages: Any) -> list[int]:
    if hasattr(pages, "numpy"):  # a pinned host tensor, its copy event waited on by now
        pages = pages.numpy()
    return [int(p) for p in pages]


def _made(manager: Any, side: Any, room: int) -> tuple[bytes, str]:
    """P's digest of ``room`` as wire bytes, or why there is none; made once a room."""
    state = _state(manager)
    with state.digesting:  # the scheduler thread, noting chunks, never waits for a digest
        with state.lock:
            done = state.made.get(room)
            known = state.noted.pop(room, None)
        if done is not None:
            return done
        if known is None:
            done = (b"", "P noted none of the room's pages")
        else:
            done = _digest_room(side, state, known)
        with state.lock:
            _keep(state.made, room, done)
        return done


def _digest_room(
    side: Any, state: _State, known: tuple[list[tuple[int, Any]], list[int | None]]
) -> tuple[bytes, str]:
    chunks, counts = known
    pages: list[int] = []
    for start, chunk in sorted(chunks, key=lambda item: item[0]):
        if start != len(pages):
            return b"", (
                f"P's chunks of the room are not one run of pages (a chunk starts at page "
                f"{start:,}, after {len(pages):,}): not digested"
            )
        pages.extend(_page_list(chunk))
    manifest = side.manifest
    page_size = int(side.pool.page_size)
    tokens = sum(c for c in counts if c is not None)
    if any(c is None for c in counts) or not 0 < tokens <= len(pages) * page_size:
        tokens = len(pages) * page_size  # every slot of the pages moved
    if state.tensors is None:
        state.tensors = pool_tensors(side.pool, manifest.layers)
    made = digest(manifest, state.tensors, pages, num_tokens=tokens)
    return made.to_wire(), ""


def _takes_digests(info: Any) -> bool:
    """Whether the D that registered as ``info`` takes digest messages: it sent safeview's
    manifest and said so (``DIGEST_FRAME``, a frame of its registration). A D without safeview,
    or with a safeview that knows no digests on SGLang, never gets a frame it does not know."""
    return (
        getattr(info, "_safeview_manifest", None) is not None
        and getattr(info, "_safeview_digests", False) is True
    )


def send_digest(manager: Any, request: Any) -> None:
    """P's digest of ``request``'s room (SGLang's ``TransferInfo``: one D rank) to that D rank,
    if it takes digests."""
    info = manager.decode_kv_args_table.get(request.mooncake_session_id)
    if not _takes_digests(info):
        state = _state(manager)
        with state.lock:
            state.noted.pop(int(request.room), None)  # no D of this room asked for one
        return
    side = _side(manager)
    if side.manifest is None or side.pool is None or side.policy is Policy.OFF:
        return  # P sent D no manifest: D takes P for one without safeview
    wire, reason = _made(manager, side, int(request.room))
    _send(manager, request.endpoint, int(request.dst_port), [
        DIGEST_FRAME,
        str(int(request.room)).encode("ascii"),
        f"{manager.local_ip}:{manager.rank_port}".encode("ascii"),
        wire,
        reason.encode("utf-8"),
    ])  # fmt: skip


def _send(manager: Any, host: str, port: int, frames: list[bytes]) -> None:
    from sglang.srt.disaggregation.mooncake.conn import (  # type: ignore[import-not-found,unused-ignore]
        NetworkAddress,
    )

    address = NetworkAddress(host, port)
    manager._send_multipart_locked(address.to_tcp(), frames, is_ipv6=address.is_ipv6)


def send_sampling(manager: Any, info: Any) -> None:
    """P's ``SAFEVIEW_DIGEST`` to the D that registered as ``info``, if it takes digests."""
    if not _takes_digests(info):
        return
    side = _side(manager)
    if side.manifest is None or side.policy is Policy.OFF:
        return
    sampling = _SAMPLING if side.pool is not None else DigestSampling("off")
    _send(manager, info.endpoint, int(info.dst_port), [
        DIGEST_FRAME,
        SAMPLING_FRAME,
        str(sampling).encode("ascii"),
        f"{manager.local_ip}:{manager.rank_port}".encode("ascii"),
    ])  # fmt: skip


# -- D ------------------------------------------------------------------------------------------


def take_message(manager: Any, msg: list[bytes]) -> None:
    """D's decode thread: one of P's digest messages."""
    state = _state(manager)
    if msg[1] == SAMPLING_FRAME:
        sampling: DigestSampling | None
        try:
            sampling = parse_sampling(msg[2].decode("ascii"))
        except Exception:  # a sampling this safeview does not know: it digests nothing known
            sampling = None
        state.prefills[msg[3].decode("ascii")] = sampling
        return
    room = int(msg[1].decode("ascii"))
    with state.lock:
        awaited = state.awaited.get(room)
        if awaited is not None:  # else: a room D does not sample, or judged already
            awaited.found[msg[2].decode("ascii")] = (msg[3] or None, msg[4].decode("utf-8"))


def await_room(receiver: Any, pages: Any) -> None:
    """D: note a sampled room's destination pages, as ``send_metadata`` hands them to P."""
    manager = receiver.kv_mgr
    side = _side(manager)
    if side.manifest is None or side.pool is None or side.policy is Policy.OFF:
        return
    awaited = _Awaited([int(p) for p in pages])
    state = _state(manager)
    with state.lock:
        _keep(state.awaited, int(receiver.bootstrap_room), awaited)
    receiver.__dict__[_AWAITED] = awaited


def _drop(receiver: Any) -> None:
    receiver.__dict__.pop(_AWAITED, None)
    state = _state(receiver.kv_mgr)
    with state.lock:
        state.awaited.pop(int(receiver.bootstrap_room), None)


def _endpoints(receiver: Any) -> list[str]:
    """The P ranks that send this room's KV (SGLang's non-dummy bootstrap infos)."""
    return [
        f"{info.get('rank_ip')}:{info.get('rank_port')}"
        for info in receiver.bootstrap_infos or ()
        if not info.get("is_dummy")
    ]


def settle(receiver: Any, awaited: _Awaited, status: int) -> int:
    """D: the status the scheduler gets for a sampled room (see the module's docstring)."""
    if status == _FAILED:
        _drop(receiver)
        return status
    if status != _SUCCESS:
        return status
    manager = receiver.kv_mgr
    side = _side(manager)
    state = _state(manager)
    room = int(receiver.bootstrap_room)
    endpoints = _endpoints(receiver)
    fields = _fields(side, endpoints, room)
    if getattr(receiver, "require_staging", False) is True:
        _drop(receiver)  # SGLANG_DISAGG_STAGING_BUFFER: D scatters after it reports Success
        why = (
            "the room moves through SGLang's staging buffer, scattered into D's pages after "
            "SGLang reports it done: not modelled"
        )
        not_judged(why, policy=side.policy, **fields)
        return status
    unknown = [e for e in endpoints if e not in state.prefills]
    if unknown or not endpoints:
        _drop(receiver)
        not_judged(
            f"prefill rank {', '.join(unknown) or '(none)'} sent no manifest (no safeview "
            "there): nothing digested",
            policy=side.policy, **fields,
        )  # fmt: skip
        return status
    silent = [e for e in endpoints if not (state.prefills[e] or DigestSampling()).wants(room)]
    if silent:
        _drop(receiver)
        said = "; ".join(_why_silent(e, state.prefills[e]) for e in silent)
        not_judged(said, policy=side.policy, **fields)
        return status
    if awaited.deadline is None:
        awaited.deadline = time.monotonic() + WAIT_S
    with state.lock:
        found = {e: awaited.found[e] for e in endpoints if e in awaited.found}
    if len(found) < len(endpoints):
        if time.monotonic() < awaited.deadline:
            return _TRANSFERRING  # held back: asked again at the scheduler's next poll
        _drop(receiver)
        missing = ", ".join(e for e in endpoints if e not in found)
        not_judged(f"P's digest of prefill rank {missing} did not come within {WAIT_S:g} s",
                   policy=side.policy, **fields)  # fmt: skip
        return status
    _drop(receiver)
    error = _judge(receiver, side, state, awaited, found, fields)
    if error is None:
        return status
    manager.record_failure(room, f"safeview: {error}")
    manager.update_status(room, _FAILED)
    receiver.conclude_state = _FAILED
    return _FAILED


def _why_silent(endpoint: str, sampling: DigestSampling | None) -> str:
    if sampling is None:
        return f"prefill rank {endpoint} runs a safeview that sends no digests on SGLang"
    return f"prefill rank {endpoint} does not digest this room (its SAFEVIEW_DIGEST is {sampling})"


def _fields(side: Any, endpoints: list[str], room: int) -> dict[str, Any]:
    topology = side.manifest.topology
    return {
        "request": str(room),
        "engine": topology.engine,
        "tp_rank": topology.tp_rank,
        "tp_size": topology.tp_size,
        "remote_engine": ", ".join(f"sglang-prefill@{e}" for e in endpoints) or None,
    }


def _judge(
    receiver: Any,
    side: Any,
    state: _State,
    awaited: _Awaited,
    found: dict[str, tuple[bytes | None, str]],
    fields: dict[str, Any],
) -> Exception | None:
    """Digest D's pages and judge them against P's digests (all of them here)."""
    room = fields["request"]
    reasons = [f"{e}: {reason}" for e, (wire, reason) in found.items() if wire is None]
    if reasons:
        not_judged(f"P could not digest the room ({'; '.join(reasons)})", policy=side.policy,
                   **fields)  # fmt: skip
        return None
    try:
        sent = [
            Digest.from_wire(wire, peer=f"sglang prefill {e} (room {room})")
            for e, (wire, _) in found.items()
            if wire is not None
        ]
    except Exception as error:  # ManifestError: cut short, another scheme, forged
        not_judged(str(error), policy=side.policy, **fields)
        return None
    positions = len(awaited.pages) * int(side.pool.page_size)
    tokens = min(sent[0].num_tokens, positions)  # fewer pages here: judge says which differ
    if state.tensors is None:
        state.tensors = pool_tensors(side.pool, side.manifest.layers)
    mine = digest(side.manifest, state.tensors, awaited.pages, num_tokens=tokens)
    return judge(sent, mine, policy=side.policy, remote_tp_size=sent[0].tp_size, **fields)


# -- the hooks ----------------------------------------------------------------------------------


def _on_top(cls: type, name: str, make: Any) -> None:
    """``cls.name`` (its own or inherited, safeview's hooks included) replaced by
    ``make(original)``, once."""
    original = getattr(cls, name)
    if getattr(original, _PATCHED, False):
        return
    wrapper = make(original)
    setattr(wrapper, _PATCHED, True)
    setattr(cls, name, wrapper)


def _build_receiver_registration_message(original: Any) -> Any:
    @functools.wraps(original)
    def build_receiver_registration_message(self: Any) -> Any:
        message = original(self)
        try:  # after safeview's manifest: this D takes P's digest messages
            side = _side(self)
            if side.manifest is not None and side.policy is not Policy.OFF:
                message = [*message, DIGEST_FRAME]
        except Exception as failure:
            step_aside("digests not asked for", f"{type(failure).__name__}: {failure}")
        return message

    return build_receiver_registration_message


def _wrap_from_zmq(cls: type) -> None:
    """``KVArgsRegisterInfo.from_zmq`` (a classmethod, safeview's hook included) also notes
    whether D's registration says it takes digests; SGLang reads frames 0 to 19 only."""
    function = cls.__dict__["from_zmq"].__func__
    if getattr(function, _PATCHED, False):
        return

    @functools.wraps(function)
    def from_zmq(owner: type, msg: Any) -> Any:
        info = function(owner, msg)
        try:
            info._safeview_digests = any(frame == DIGEST_FRAME for frame in msg[_REGISTRATION:])
        except Exception as failure:
            step_aside("peer digests not read", f"{type(failure).__name__}: {failure}")
        return info

    setattr(from_zmq, _PATCHED, True)
    setattr(cls, "from_zmq", classmethod(from_zmq))  # noqa: B010


def _publish_peer_registration(original: Any) -> Any:
    @functools.wraps(original)
    def _publish(self: Any, mooncake_session_id: str, decode_kv_args: Any) -> Any:
        reason = original(self, mooncake_session_id, decode_kv_args)
        try:
            send_sampling(self, decode_kv_args)
        except Exception as failure:
            step_aside("digest sampling not sent", f"{type(failure).__name__}: {failure}")
        return reason

    return _publish


def _handle_chunk_ready(original: Any) -> Any:
    @functools.wraps(original)
    def handle_chunk_ready(self: Any, msg: Any) -> Any:
        first = msg[0] if msg else None
        if first == DIGEST_FRAME:
            try:
                take_message(self, list(msg))
            except Exception as failure:
                step_aside("prefill digest not read", f"{type(failure).__name__}: {failure}")
            return True  # consumed: not one of SGLang's messages
        if isinstance(first, bytes) and first.startswith(MANIFEST_FRAME) and len(msg) > 1:
            try:  # this P rank runs safeview; its sampling follows in a message of its own
                _state(self).prefills.setdefault(msg[1].decode("ascii"), None)
            except Exception as failure:
                step_aside("prefill digest not read", f"{type(failure).__name__}: {failure}")
        return original(self, msg)

    return handle_chunk_ready


def _add_transfer_request(original: Any) -> Any:
    @functools.wraps(original)
    def add_transfer_request(
        self: Any, bootstrap_room: int, kv_indices: Any, index_slice: Any, *args: Any,
        **kwargs: Any,
    ) -> Any:  # fmt: skip
        if _SAMPLING.wants(int(bootstrap_room)):
            try:
                tokens = kwargs.get("num_kv_tokens", args[3] if len(args) > 3 else None)
                _note_chunk(self, int(bootstrap_room), kv_indices, index_slice, tokens)
            except Exception as failure:
                step_aside("room not digested", f"{type(failure).__name__}: {failure}")
        return original(self, bootstrap_room, kv_indices, index_slice, *args, **kwargs)

    return add_transfer_request


def _send_aux(original: Any) -> Any:
    @functools.wraps(original)
    def send_aux(self: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
        if _SAMPLING.wants(int(req.room)):
            try:
                send_digest(self, req)
            except Exception as failure:  # D says not judged when its wait ends
                step_aside("room not digested", f"{type(failure).__name__}: {failure}")
        return original(self, req, *args, **kwargs)

    return send_aux


def _send_metadata(original: Any) -> Any:
    @functools.wraps(original)
    def send_metadata(self: Any, kv_indices: Any, *args: Any, **kwargs: Any) -> Any:
        room = self.bootstrap_room
        if room is not None and _SAMPLING.wants(int(room)):
            try:
                await_room(self, kv_indices)
            except Exception as failure:
                step_aside("room not judged", f"{type(failure).__name__}: {failure}")
        return original(self, kv_indices, *args, **kwargs)

    return send_metadata


def _poll(original: Any) -> Any:
    @functools.wraps(original)
    def poll(self: Any) -> Any:
        status = original(self)
        awaited = self.__dict__.get(_AWAITED)
        if awaited is None:
            return status
        try:
            return settle(self, awaited, int(status))
        except Exception as failure:  # the room goes on as SGLang alone takes it
            self.__dict__.pop(_AWAITED, None)
            step_aside("room not judged", f"{type(failure).__name__}: {failure}")
            return status

    return poll


def install_digest() -> None:
    """The digest's hooks on SGLang 0.5.23's Mooncake classes, on top of safeview's own: the
    messages always (a D takes P's digests, a P says whether it digests), the per-room hooks
    only where this process's ``SAFEVIEW_DIGEST`` samples rooms."""
    global _SAMPLING
    from sglang.srt.disaggregation.mooncake.conn import (  # type: ignore[import-not-found,unused-ignore]
        KVArgsRegisterInfo,
        MooncakeKVManager,
        MooncakeKVReceiver,
    )

    for name in ("add_transfer_request", "send_aux", "record_failure", "update_status"):
        if not callable(getattr(MooncakeKVManager, name, None)):
            raise AttributeError(f"MooncakeKVManager.{name} is not SGLang 0.5.23's")
    if not callable(getattr(MooncakeKVReceiver, "send_metadata", None)):
        raise AttributeError("MooncakeKVReceiver.send_metadata is not SGLang 0.5.23's")
    _SAMPLING = digest_sampling()
    _on_top(
        MooncakeKVManager,
        "build_receiver_registration_message",
        _build_receiver_registration_message,
    )
    _wrap_from_zmq(KVArgsRegisterInfo)
    _on_top(MooncakeKVManager, "_publish_peer_registration", _publish_peer_registration)
    _on_top(MooncakeKVManager, "handle_chunk_ready", _handle_chunk_ready)
    if _SAMPLING.mode == "off":
        return
    _on_top(MooncakeKVManager, "add_transfer_request", _add_transfer_request)
    _on_top(MooncakeKVManager, "send_aux", _send_aux)
    _on_top(MooncakeKVReceiver, "send_metadata", _send_metadata)
    _on_top(MooncakeKVReceiver, "poll", _poll)
