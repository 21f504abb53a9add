"""SGLang 0.5.23's Mooncake manager (``sglang.srt.disaggregation.mooncake.conn``), guarded.

Patched on the classes (every manager of the process), none changing what SGLang does when
safeview is off or has nothing to say:

- ``MooncakeKVManager.register_buffer_to_engine``: before Mooncake's ``batch_register``, every
  KV region SGLang hands it (``kv_args.kv_data_ptrs`` and ``kv_data_lens``) must lie inside the
  buffer of the pool it came from (``safeview.transfer.check_descriptors`` over the pool's
  buffers). Under strict an ``AddressError`` stops the manager's start-up.
- ``MooncakeKVManager.build_receiver_registration_message`` (D): the registration D sends P
  on SGLang's own ZMQ channel carries one more frame, ``safeview.manifest:`` and D's manifest
  (``safeview.manifest.wire``). ``KVArgsRegisterInfo.from_zmq`` reads SGLang's frames by
  position and never this one: a P without safeview ignores it.
- ``MooncakeKVManager._publish_peer_registration`` (P): after SGLang's own verdict, P judges
  D's manifest against its own (``safeview.manifest.peer.judge_peer``): rule ``page_copy``
  (page ``b`` of each region into page ``b`` of D's) at equal attention TP; at another
  attention-TP size, the run of heads SGLang's ``send_kvcache_slice`` copies per token slot
  (``safeview.sglang._slices``), by the same rule. Under strict a mismatch, or a manifest that
  cannot be read, is returned as the rejection reason, which SGLang already keeps per decode
  session and with which it fails every transfer to that session, before a byte moves. Under
  warn: the event, and SGLang goes on as it would. Then, to a D that sent a manifest (so runs
  safeview), P sends its own on the ZMQ channel P already uses for D's status messages:
  frames ``safeview.manifest:`` + P's manifest, P's ``ip:port``, item length, attention-TP rank
  and size.
- ``MooncakeKVManager.handle_chunk_ready`` (D; the first handler SGLang's decode thread offers
  every message): P's manifest frame is taken there and judged the same way, receiver D. Under
  strict a mismatch fails every receiver of that P (``MooncakeKVReceiver.poll``), as SGLang
  fails a transfer, with the reason. P sends its manifest before it reads D's first transfer
  request, so D's verdict is in before P's status for any request of that P.
- P's transfer engine (``manager.engine``, wrapped once the manager registered): every Mooncake
  batch SGLang's sender builds (``_transfer_data``: ``_send_kvcache_generic``, the state slices,
  staging; and ``send_kvcache_slice``, which calls ``batch_transfer_sync`` itself): each KV row's
  source must lie in P's pool pages and its destination in D's, D's pages placed at the pointers
  D registered with the lengths of D's manifest (``safeview.transfer.check_descriptors``; whole
  pages at equal attention TP, slices inside one page otherwise). Under strict a batch with a
  finding is not run: SGLang gets the failure code Mooncake would give and fails the request;
  under warn, an ``address_violation`` event and the batch runs. Rows of no pool safeview read
  (metadata, DSA and other state) are left to SGLang.
- A state component that is the buffers of a pool safeview read (an ``SWAKVPool``'s window KV,
  SGLang's ``swa`` state; a Mamba hybrid's ``MambaPool``, its ``mamba`` state: ``_State``) is
  checked at registration, described into a manifest of its own (layers ``swa.layers.N``,
  ``mamba.conv.layers.N``) that travels beside the KV manifest both ways (frame
  ``safeview.state:<kind>:``) and is judged by the KV's rule, and its rows are judged in
  transfer in the state pages of both sides (D's at the state pointers D registered). Mamba
  state at another attention-TP size (``_send_mamba_state_slice``) is ``not_judged`` for its
  meaning; its rows are still checked inside one of D's slots.

Pairs not judged (an event says why): D sent no manifest (no safeview there), DCP.
safeview's own failure never stops SGLang: one ``integration_unavailable`` event.
"""

from __future__ import annotations

import bisect
import functools
import itertools
from typing import Any

from safeview import _arith
from safeview.errors import AddressError, ManifestError, SafeViewError
from safeview.manifest import Layer, Manifest, Topology
from safeview.manifest.peer import judge_peer
from safeview.manifest.wire import from_wire, to_wire
from safeview.policy import Policy, current_policy
from safeview.sglang import (
    Buffer,
    describe_pool,
    pool_buffers,
    pool_memory_map,
    pool_of,
    step_aside,
)
from safeview.sglang._slices import SliceCopy, slice_copy, slice_manifests
from safeview.transfer import MemoryMap, StorageSpan, ViewSpan, check_descriptors

__all__ = ["MANIFEST_FRAME", "install_manager"]

MANIFEST_FRAME = b"safeview.manifest:"
"""The prefix of the frame that carries a manifest: D's in SGLang's registration message, P's
in the message P sends back to a D that sent one."""
STATE_FRAME = b"safeview.state:"
"""The prefix of a frame beside the manifest's that carries a state component's manifest (an
``SWAKVPool``'s window KV, a ``MambaPool``'s states): ``safeview.state:<state type>:`` and the
manifest's wire form."""

_PATCHED = "__safeview_guarded__"
_STATE = "_safeview_state"
_SGLANG_FRAMES = 20  # KVArgsRegisterInfo.from_zmq reads msg[0] to msg[19]


class _State:
    """One state component of a manager that is the buffers of a pool safeview read, in order
    (an ``SWAKVPool``'s window KV, SGLang's ``StateType.SWA``; a ``MambaPool``'s states,
    ``StateType.MAMBA``): its place in SGLang's
    ``state_types``, its kind (``swa``), its pool, its buffers as read at registration (named
    ``swa.layers.0.k``; forgotten once that registration is checked), its manifest (layers
    ``swa.layers.0``; ``None`` under off) and that manifest's wire form, made once."""

    __slots__ = ("index", "kind", "listed", "manifest", "pool", "wire")

    def __init__(
        self, index: int, kind: str, pool: Any, listed: list[Buffer], manifest: Manifest | None
    ) -> None:
        self.index = index
        self.kind = kind
        self.pool = pool
        self.listed: list[Buffer] | None = listed
        self.manifest = manifest
        self.wire: bytes | None = None


class _Side:
    """What safeview knows of one manager: the policy in force when it registered, its pool and
    its manifest (``None`` when its pool is not one safeview read), and its state components
    that are pools safeview read (``states``, by kind)."""

    __slots__ = (
        "buffers", "kinds", "listed", "local", "manifest", "peers", "policy", "pool", "refusals",
        "states", "tables", "wire",
    )  # fmt: skip

    def __init__(self, policy: Policy, pool: Any, manifest: Manifest | None) -> None:
        self.policy = policy
        self.pool = pool
        self.manifest = manifest
        # P's pages, once P first transfers: the pool's, with those of the state kinds named
        # (the kinds a session's manifests describe on both sides), by those kinds
        self.local: dict[frozenset[str], MemoryMap] = {}
        # those pages' buffers' bytes (start, end, name) by start, and their starts, by kinds
        self.buffers: dict[frozenset[str], tuple[list[int], list[tuple[int, int, str | None]]]]
        self.buffers = {}
        # P: decode session -> its KV pages (its pointers, its manifest's lengths), and whether
        # SGLang moves whole pages to it (equal attention TP) or slices of them
        self.peers: dict[str, tuple[MemoryMap, bool]] = {}
        # P: decode session -> the state kinds whose pages its map holds (none: KV only)
        self.kinds: dict[str, frozenset[str]] = {}
        self.states: dict[str, _State] = {}
        # D: a prefill rank's "ip:port" -> why its transfers are refused (strict only)
        self.refusals: dict[str, str] = {}
        # P: its own pages (key ``(None, kinds)``) and each session's, as sorted columns
        # (_Pages), with the map each was made from
        self.tables: dict[Any, tuple[MemoryMap, _Pages]] = {}
        self.wire: bytes | None = None  # the manifest's wire form, made once
        # the pool's buffers as read when the side was made (at registration), for that
        # registration's check, which then forgets them (a later one reads them anew)
        self.listed: list[Buffer] | None = None


def _topology(manager: Any) -> Topology:
    """What an SGLang manager says of itself: attention-TP rank and size, the model's total KV
    heads (``kv_args.total_kv_head_num``, where SGLang sets it), its role and address."""
    kv_args = manager.kv_args
    total = getattr(kv_args, "total_kv_head_num", None)
    mode = str(getattr(manager.disaggregation_mode, "value", manager.disaggregation_mode))
    return Topology(
        tp_rank=int(manager.attn_tp_rank),
        tp_size=int(manager.attn_tp_size),
        total_kv_heads=int(total) if total else None,
        engine=f"sglang-{mode}@{manager.local_ip}:{manager.rank_port}",
        connector="MooncakeKVManager",
    )


def _side(manager: Any) -> _Side:
    """The manager's ``_Side``, made on first use (at its registration)."""
    known: _Side | None = getattr(manager, _STATE, None)
    if known is not None:
        return known
    policy = current_policy()
    pool = pool_of(list(getattr(manager.kv_args, "kv_data_ptrs", ()) or ()))
    manifest = None
    listed = None
    if pool is not None:
        try:  # each buffer read once, for the manifest and the registration's check
            listed = pool_buffers(pool)
        except Exception as error:  # a pool safeview cannot read: judged as SGLang judges it
            step_aside("pool not described", f"{type(error).__name__}: {error}")
            pool = None
    if pool is None:
        step_aside("manager left unchecked", "its KV regions are of no pool safeview read")
    elif policy is not Policy.OFF:
        try:
            manifest = describe_pool(pool, topology=_topology(manager), buffers=listed)
        except Exception as error:  # a pool safeview cannot read: judged as SGLang judges it
            step_aside("pool not described", f"{type(error).__name__}: {error}")
    known = _Side(policy, pool, manifest)
    known.listed = listed
    if pool is not None:
        known.states = _states(manager, pool, policy)
    setattr(manager, _STATE, known)
    return known


def _states(manager: Any, kv_pool: Any, policy: Policy) -> dict[str, _State]:
    """The state components SGLang registers (``kv_args.state_data_ptrs`` and
    ``state_data_lens``, one list per ``state_types`` entry) that are the buffers of a pool
    safeview read, all of them in their order, none empty (an ``SWAKVPool``'s sliding-window
    pool, a ``HybridLinearKVPool``'s ``MambaPool``: ``get_state_buf_infos`` hands SGLang that
    pool's ``get_contiguous_buf_infos``), each read once, its buffers named
    ``<state type>.<buffer>`` (``swa.layers.0.k``, ``mamba.conv.layers.0``) and, unless policy
    is off, described (layers ``swa.layers.0``). Any other component (DSA, block scales, a list
    that is not such a pool's buffers in order, an empty region, which SGLang does not
    register) is left as SGLang leaves it alone, said once per process and kind with an
    ``integration_unavailable`` event."""
    kv_args = manager.kv_args
    kinds = list(getattr(kv_args, "state_types", None) or ())
    lengths_of = list(getattr(kv_args, "state_data_lens", None) or ())
    found: dict[str, _State] = {}
    for index, pointers in enumerate(getattr(kv_args, "state_data_ptrs", None) or ()):
        kind = kinds[index] if index < len(kinds) else f"state{index}"
        kind = str(getattr(kind, "value", kind))
        lengths = list(lengths_of[index]) if index < len(lengths_of) else []
        rows = list(zip(pointers or (), lengths))
        pool = pool_of([int(rows[0][0])]) if rows else None
        listed: list[Buffer] = []
        if pool is not None and pool is not kv_pool and kind not in found:
            try:  # a state pool safeview cannot list: its regions are SGLang's, the KV's are not
                listed = pool_buffers(pool, prefix=f"{kind}.")
            except Exception as error:
                step_aside(f"{kind} state not read", f"{type(error).__name__}: {error}")
                continue
        pointers_of = [int(b.tensor.data_ptr()) for b in listed]
        if not rows or pointers_of != [int(r[0]) for r in rows] or min(r[1] for r in rows) <= 0:
            step_aside(
                f"{kind} state regions left unchecked",
                "they are not the buffers of a pool safeview read, in order (an SWA pool's "
                "window KV and a Mamba pool's states are): SGLang registers and moves them as "
                "it would alone",
            )
            continue
        manifest = None
        if policy is not Policy.OFF:
            try:
                manifest = describe_pool(pool, topology=_topology(manager), buffers=listed)
            except Exception as error:  # checked at registration all the same, not judged
                step_aside(f"{kind} state not described", f"{type(error).__name__}: {error}")
        found[kind] = _State(index, kind, pool, listed, manifest)
    return found


def check_registration(manager: Any, side: _Side) -> None:
    """Every KV region the manager is about to register lies inside the pool buffer it came
    from, in the order ``get_contiguous_buf_infos`` gave them; so does every region of a state
    component that is a pool safeview read, buffer for buffer (``_check_state``). Raises
    ``AddressError`` under strict; logs under warn. Regions proven inside their buffers in one
    sorted sweep over integers (``_inside_buffers``) need nothing more; any other registration
    is judged by ``check_descriptors``, which names what is wrong. The buffers are those read
    when the side was made, at this registration, else read now."""
    buffers, side.listed = side.listed or pool_buffers(side.pool), None
    kv_args = manager.kv_args
    rows = list(zip(kv_args.kv_data_ptrs, kv_args.kv_data_lens))[: len(buffers)]
    _check_regions(rows, buffers, side.pool, side.policy)
    _check_state(kv_args, side)


def _check_regions(
    rows: list[tuple[Any, Any]], buffers: list[Buffer], pool: Any, policy: Policy
) -> None:
    """Region ``i`` of ``rows`` inside buffer ``i`` of ``pool`` (``buffers``, as listed, names
    included), or the first finding raised under strict."""
    if _inside_buffers(rows, buffers):
        return
    names: list[str | None] = [buffer.name for buffer in buffers[: len(rows)]]
    check_descriptors(
        rows,
        pool_memory_map(pool, whole_buffers=True, buffers=buffers),
        layers=names,
        whole_pages=False,
        policy=policy,
    )


def _check_state(kv_args: Any, side: _Side) -> None:
    """The regions of each state component that is a pool safeview read (``_states``) checked
    inside its buffers as the KV regions are, the buffers named ``<state type>.<buffer>``
    (``swa.layers.0.k``); the buffers are those read when the side was made, else read now."""
    lengths_of = list(getattr(kv_args, "state_data_lens", None) or ())
    for state in side.states.values():
        listed, state.listed = state.listed, None  # read for this registration only
        buffers = listed or pool_buffers(state.pool, prefix=f"{state.kind}.")
        rows = list(zip(kv_args.state_data_ptrs[state.index], lengths_of[state.index]))
        _check_regions(rows, buffers, state.pool, side.policy)


def _inside_buffers(rows: list[tuple[Any, Any]], buffers: list[Buffer]) -> bool:
    """Whether each region ``(address, length)`` lies inside the buffer beside it, every
    buffer inside its storage and no two buffers sharing a byte: what ``check_descriptors``
    finds no fault in (a region inside one whole-buffer page of its own layer's view). ``False``
    says only that the proof failed (an address not a plain int, a buffer on ``meta``)."""
    spans = []
    for (address, length), buffer in zip(rows, buffers):
        if type(address) is not int or type(length) is not int or length <= 0:
            return False
        facts, geometry = buffer.facts, buffer.geometry
        extent = _arith.extent_bytes(0, geometry.shape, geometry.strides, geometry.itemsize)
        start = facts.base + geometry.byte_offset
        if (
            not facts.base
            or geometry.byte_offset + extent > facts.nbytes
            or not start <= address <= address + length <= start + extent
        ):
            return False
        spans.append((start, start + extent))
    spans.sort()
    return all(end <= following for (_, end), (following, _) in itertools.pairwise(spans))


def _wrap(cls: type, name: str, make: Any, *, inherited: bool = False) -> None:
    """``cls.name`` replaced by ``make(original)``, once; ``inherited``: the method may come
    from a base class (it is set on ``cls`` itself)."""
    original = getattr(cls, name) if inherited else cls.__dict__[name]
    function = getattr(original, "__func__", original)  # a classmethod's function
    if getattr(function, _PATCHED, False):
        return
    wrapper = make(original)
    setattr(getattr(wrapper, "__func__", wrapper), _PATCHED, True)
    setattr(cls, name, wrapper)


def _is_prefill(manager: Any) -> bool:
    mode = manager.disaggregation_mode
    return str(getattr(mode, "value", mode)) == "prefill"


def _register_buffer_to_engine(original: Any) -> Any:
    @functools.wraps(original)
    def register_buffer_to_engine(self: Any) -> Any:
        side = None
        try:
            side = _side(self)
            if side.pool is not None and side.policy is not Policy.OFF:
                check_registration(self, side)
            side.listed = None  # read for this registration only
            for state in side.states.values():
                state.listed = None
        except AddressError:
            raise  # a finding, under strict: the start-up stops with its numbers
        except Exception as error:  # safeview's own failure, or an SGLang it does not know
            step_aside("registration left unchecked", f"{type(error).__name__}: {error}")
        done = original(self)
        try:  # P's sends, every path of them, go through its engine's batch_transfer_sync
            judged = side is not None and side.pool is not None and side.policy is not Policy.OFF
            if judged and _is_prefill(self) and not isinstance(self.engine, JudgedEngine):
                self.engine = JudgedEngine(self.engine, self)
        except Exception as error:
            step_aside("transfers left unjudged", f"{type(error).__name__}: {error}")
        return done

    return register_buffer_to_engine


def _build_receiver_registration_message(original: Any) -> Any:
    @functools.wraps(original)
    def build_receiver_registration_message(self: Any) -> Any:
        message = original(self)
        try:
            side = _side(self)
            if side.manifest is not None and side.policy is not Policy.OFF:
                message = [*message, MANIFEST_FRAME + _own_wire(side, side.manifest)]
                message += _state_frames(side)
        except Exception as error:
            step_aside("manifest not sent", f"{type(error).__name__}: {error}")
        return message

    return build_receiver_registration_message


def _from_zmq(original: Any) -> Any:
    function = original.__func__

    @functools.wraps(function)
    def from_zmq(cls: type, msg: Any) -> Any:
        info = function(cls, msg)
        try:
            carried = [
                frame[len(MANIFEST_FRAME) :]
                for frame in msg[_SGLANG_FRAMES:]
                if isinstance(frame, bytes) and frame.startswith(MANIFEST_FRAME)
            ]
            info._safeview_manifest = carried[-1] if carried else None
            info._safeview_states = _carried_states(msg[_SGLANG_FRAMES:])
        except Exception as error:
            step_aside("peer manifest not read", f"{type(error).__name__}: {error}")
        return info

    return classmethod(from_zmq)


def _state_frames(side: _Side) -> list[bytes]:
    """A frame per state component the side described: ``safeview.state:<kind>:`` and its
    manifest's wire form (made once)."""
    frames = []
    for state in side.states.values():
        if state.manifest is not None:
            if state.wire is None:
                state.wire = to_wire(state.manifest)
            frames.append(STATE_FRAME + state.kind.encode("ascii") + b":" + state.wire)
    return frames


def _carried_states(frames: Any) -> dict[str, bytes]:
    """The state manifests ``frames`` carry (``_state_frames``), by kind, as wire bytes."""
    carried: dict[str, bytes] = {}
    for frame in frames:
        if isinstance(frame, bytes) and frame.startswith(STATE_FRAME):
            kind, _, wire = frame[len(STATE_FRAME) :].partition(b":")
            carried[kind.decode("ascii", "replace")] = wire
    return carried


def refusal_text(
    error: Exception,
    *,
    prefill_item_bytes: int | None,
    decode_item_bytes: int | None,
    copy: SliceCopy | None = None,
) -> str:
    """The reason SGLang keeps for a refused pair: safeview's first finding; the first byte
    that differs when that finding is another kind (a page length, a dtype); SGLang's own item
    lengths when they differ (sglang#19398: bf16 into fp8 moves the prefill's item length into
    pages half as long); at another attention TP (``copy``), what a "page" is there."""
    text = f"safeview: {error}"
    if copy is not None:
        text += (
            f" (a page here is the run SGLang's send_kvcache_slice copies per token slot: "
            f"{copy.length:,} bytes from slot byte {copy.sender_offset:,} of the prefill's "
            f"into slot byte {copy.receiver_offset:,} of the decode's)"
        )
    findings = getattr(error, "findings", ())
    if findings and getattr(findings[0], "receiver_reads", None) is None:
        byte = next((f for f in findings if getattr(f, "receiver_reads", None) is not None), None)
        if byte is not None:
            text += f"; the first byte that differs: {byte.message}"
    if copy is None and prefill_item_bytes and decode_item_bytes != prefill_item_bytes:
        text += (
            f"; SGLang's item lengths differ: the prefill's {prefill_item_bytes:,} bytes an "
            f"item, the decode's {decode_item_bytes:,} (SGLang moves the prefill's)"
        )
    return text


def judge_pair(
    sender: Manifest,
    receiver: Manifest,
    *,
    sender_tp: tuple[int, int],
    receiver_tp: tuple[int, int],
    total_heads: int | None,
    page_size: int,
    receiver_item_bytes: int,
    fields: dict[str, Any],
    policy: Policy,
) -> tuple[SafeViewError | None, SliceCopy | None]:
    """One verdict on P's manifest into D's, as SGLang 0.5.23 moves the bytes: page by page at
    equal attention TP (rule ``page_copy``); at another attention-TP size, each token slot's
    run of heads ``send_kvcache_slice`` copies (``safeview.sglang._slices``), by the same rule.
    One event; the error under strict, and the run judged (``None`` at equal TP)."""
    if sender_tp[1] == receiver_tp[1]:
        return judge_peer(
            receiver, [sender], against="handshake", fields=fields, rule="page_copy",
            policy=policy,
        ), None  # fmt: skip
    heads = total_heads or sender.topology.total_kv_heads or receiver.topology.total_kv_heads
    if not heads:
        reason = "attention TP differs and neither side says the model's total KV heads"
        return judge_peer(receiver, None, against="handshake", fields=fields, reason=reason,
                          policy=policy), None  # fmt: skip
    copy = slice_copy(
        sender_tp=sender_tp,
        receiver_tp=receiver_tp,
        total_heads=heads,
        page_size=page_size,
        receiver_item_bytes=receiver_item_bytes,
    )
    runs_sent, runs_read = slice_manifests(sender, receiver, copy)
    return judge_peer(
        runs_read, [runs_sent], against="handshake",
        fields={"fingerprint": receiver.fingerprint, **fields}, rule="page_copy", policy=policy,
    ), copy  # fmt: skip


def judge_decode_peer(
    manager: Any, session: str, info: Any
) -> tuple[SafeViewError | None, SliceCopy | None]:
    """P's verdict on the decode peer that registered as ``info`` (SGLang's
    ``KVArgsRegisterInfo``): one event, and the error under strict (a manifest that cannot be
    read included), with the run judged at another attention TP."""
    side = _side(manager)
    if side.policy is Policy.OFF or side.manifest is None:
        return None, None
    mine = side.manifest
    fields = {
        "engine": mine.topology.engine,
        "tp_rank": mine.topology.tp_rank,
        "tp_size": mine.topology.tp_size,
        "remote_engine": f"sglang-decode session {session}",
        "remote_tp_size": int(info.dst_attn_tp_size),
        "when": "handshake",
        "fingerprint": mine.fingerprint,
    }
    reason = None
    raw: bytes | None = getattr(info, "_safeview_manifest", None)
    if raw is None:
        reason = "the decode peer sent no manifest (no safeview there)"
    elif int(getattr(info, "dst_dcp_size", 1) or 1) > 1 or int(manager.dcp_size or 1) > 1:
        reason = "decode context parallelism: not modelled yet"
    side.peers.pop(session, None)
    side.kinds.pop(session, None)
    if reason is not None or raw is None:
        return judge_peer(mine, None, against=None, fields=fields, reason=reason,
                          policy=side.policy), None  # fmt: skip
    try:
        theirs = from_wire(raw, peer=f"sglang decode session {session}")
    except ManifestError as bad:  # truncated, forged, another schema: refused under strict
        judge_peer(mine, None, against="handshake", fields=fields, policy=side.policy,
                   reason=f"the decode peer's manifest cannot be judged: {bad}")  # fmt: skip
        return (bad if side.policy is Policy.STRICT else None), None
    same_tp = int(info.dst_attn_tp_size) == mine.topology.tp_size
    verdict = _decode_verdict(manager, side, mine, theirs, info, fields, int(info.dst_kv_item_len))
    peer = peer_memory_map(theirs, [int(p) for p in info.dst_kv_ptrs])
    maps, kinds = [peer], []
    for state in side.states.values():
        error, copy, pages = _judge_decode_state(manager, side, state, session, info, fields)
        if verdict[0] is None and error is not None:
            verdict = error, copy
        if pages is not None:
            maps.append(pages)
            kinds.append(state.kind)
    if peer is not None:
        side.peers[session] = (merged_maps([("", m) for m in maps]) if kinds else peer, same_tp)
        side.kinds[session] = frozenset(kinds)
    return verdict


def _decode_verdict(
    manager: Any,
    side: _Side,
    mine: Manifest,
    theirs: Manifest,
    info: Any,
    fields: dict[str, Any],
    item: int,
) -> tuple[SafeViewError | None, SliceCopy | None]:
    """``judge_pair`` of P's manifest (``mine``) into the decode peer's (``theirs``, whose
    registration is ``info``; ``item``: D's item length of what they describe), its event
    said from D's side as D's own verdict would say it."""
    return judge_pair(
        mine,
        theirs,
        sender_tp=(mine.topology.tp_rank, mine.topology.tp_size),
        receiver_tp=(int(info.dst_tp_rank), int(info.dst_attn_tp_size)),
        total_heads=mine.topology.total_kv_heads,
        page_size=int(manager.kv_args.page_size),
        receiver_item_bytes=item,
        fields={**fields, "engine": theirs.topology.engine, "fingerprint": theirs.fingerprint,
                "remote_engine": mine.topology.engine, "remote_tp_size": mine.topology.tp_size,
                "tp_rank": theirs.topology.tp_rank, "tp_size": theirs.topology.tp_size},
        policy=side.policy,
    )  # fmt: skip


def _judge_decode_state(
    manager: Any, side: _Side, state: _State, session: str, info: Any, fields: dict[str, Any]
) -> tuple[SafeViewError | None, SliceCopy | None, MemoryMap | None]:
    """P's verdict on the decode peer's manifest of one state component against P's (as
    ``judge_pair`` judges the KV: SGLang moves the window KV page by page at equal attention TP,
    by ``_send_swa_state_slice``'s head runs otherwise), and D's pages of it as P's writes must
    hit them: at the pointers D registered for the component SGLang pairs with P's (the same
    place in ``state_types``), with the lengths of D's manifest. A D that described no such
    state is ``not_judged`` (its rows then go as SGLang sends them); so is one whose pointers
    do not pair with its manifest. Mamba state at another attention-TP size is ``not_judged``
    for its meaning (``_send_mamba_state_slice``'s per-tensor slices are not modelled), and its
    D slots are still mapped: each of its rows must lie inside one slot of the D buffer named
    as the P buffer it comes from."""
    mine = state.manifest
    if mine is None:
        return None, None, None
    kind, index = state.kind, state.index
    fields = {**fields, "fingerprint": mine.fingerprint}
    raw = (getattr(info, "_safeview_states", None) or {}).get(kind)
    peer = f"sglang decode session {session}"
    theirs, error = _read_peer_state(side, mine, raw, kind, peer, "decode", fields)
    if theirs is None:
        return error, None, None
    registered, lengths = info.dst_state_data_ptrs, info.dst_state_item_lens
    pointers = list(registered[index]) if index < len(registered) else []
    pages = peer_memory_map(theirs, [int(p) for p in pointers], storage=f"decode.{kind}")
    if _sliced_state(mine, mine.topology.tp_size, int(info.dst_attn_tp_size)):
        reason = _SLICED_STATE.format(kind=kind)
        judge_peer(mine, None, against=None, fields=fields, policy=side.policy, reason=reason)
        return None, None, pages
    items = list(lengths[index]) if index < len(lengths) else []
    item = int(items[0]) if items else int(manager.kv_args.state_item_lens[index][0])
    error, copy = _decode_verdict(manager, side, mine, theirs, info, fields, item)
    return error, copy, pages


def _read_peer_state(
    side: _Side,
    mine: Manifest,
    raw: bytes | None,
    kind: str,
    peer: str,
    role: str,
    fields: dict[str, Any],
) -> tuple[Manifest | None, SafeViewError | None]:
    """The ``role`` peer's manifest of state ``kind`` off the wire (``raw``), or ``None`` and
    one ``not_judged`` event saying why: it sent none; it cannot be read (then the error too,
    under strict)."""
    if raw is None:
        reason = f"the {role} peer described no {kind} state"
        judge_peer(mine, None, against=None, fields=fields, policy=side.policy, reason=reason)
        return None, None
    try:
        return from_wire(raw, peer=f"{peer} ({kind} state)"), None
    except ManifestError as bad:
        reason = f"the {role} peer's {kind} state manifest cannot be judged: {bad}"
        judge_peer(mine, None, against="handshake", fields=fields, policy=side.policy,
                   reason=reason)  # fmt: skip
        return None, (bad if side.policy is Policy.STRICT else None)


_SLICED_STATE = (
    "{kind} state at another attention-TP size moves by _send_mamba_state_slice's per-tensor "
    "slices, whose meaning safeview does not model (each row is still checked inside one slot "
    "of the decode's buffer it is meant for)"
)


def _sliced_state(manifest: Manifest, mine: int, theirs: int) -> bool:
    """Whether ``manifest`` is of request states (Mamba: ``state`` layers) that SGLang moves in
    per-tensor slices because the two sides' attention-TP sizes differ."""
    return mine != theirs and any(layer.kind == "state" for layer in manifest.layers.values())


def merged_maps(maps: list[tuple[str, MemoryMap | None]]) -> MemoryMap:
    """One memory map of several (the KV pages and those of state components), each given
    with what its storages' names start with there (``swa.`` makes ``swa.storage0``)."""
    storages: list[StorageSpan] = []
    views: list[ViewSpan] = []
    for prefix, memory in maps:
        if memory is None:
            continue
        names = {storage.name: f"{prefix}{storage.name}" for storage in memory.storages}
        storages += [storage._replace(name=names[storage.name]) for storage in memory.storages]
        views += [view._replace(storage=names[view.storage]) for view in memory.views]
    return MemoryMap(tuple(storages), tuple(views))


def judge_prefill_peer(manager: Any, msg: list[bytes]) -> None:
    """D's verdict on the prefill rank whose manifest ``msg`` carries (see the module's
    docstring): one event; under strict a refusal every receiver of that rank fails with."""
    side = _side(manager)
    if side.policy is Policy.OFF or side.manifest is None:
        return
    mine = side.manifest
    endpoint = msg[1].decode("ascii")
    prefill_item = int(msg[2].decode("ascii"))
    prefill_tp = (int(msg[3].decode("ascii")), int(msg[4].decode("ascii")))
    fields = {
        "engine": mine.topology.engine,
        "tp_rank": mine.topology.tp_rank,
        "tp_size": mine.topology.tp_size,
        "remote_engine": f"sglang-prefill@{endpoint}",
        "remote_tp_size": prefill_tp[1],
        "when": "handshake",
        "fingerprint": mine.fingerprint,
    }
    error: SafeViewError | None
    copy = None
    if int(manager.dcp_size or 1) > 1:
        judge_peer(mine, None, against="handshake", fields=fields, policy=side.policy,
                   reason="decode context parallelism: not modelled yet")  # fmt: skip
        return
    try:
        theirs = from_wire(msg[0][len(MANIFEST_FRAME) :], peer=f"sglang prefill {endpoint}")
    except ManifestError as bad:
        judge_peer(mine, None, against="handshake", fields=fields, policy=side.policy,
                   reason=f"the prefill peer's manifest cannot be judged: {bad}")  # fmt: skip
        error = bad if side.policy is Policy.STRICT else None
    else:
        item = int(manager.kv_args.kv_item_lens[0])
        error, copy = _prefill_verdict(manager, side, theirs, mine, prefill_tp, fields, item)
    carried = _carried_states(msg[5:])
    for state in side.states.values():
        if state.manifest is None:
            continue
        state_error, state_copy = _judge_prefill_state(
            manager, side, state, carried.get(state.kind), endpoint, prefill_tp, fields
        )
        if error is None and state_error is not None:
            error, copy = state_error, state_copy
    if error is None:
        side.refusals.pop(endpoint, None)
        return
    side.refusals[endpoint] = refusal_text(
        error,
        prefill_item_bytes=prefill_item,
        decode_item_bytes=int(manager.kv_args.kv_item_lens[0]),
        copy=copy,
    )


def _judge_prefill_state(
    manager: Any,
    side: _Side,
    state: _State,
    raw: bytes | None,
    endpoint: str,
    prefill_tp: tuple[int, int],
    fields: dict[str, Any],
) -> tuple[SafeViewError | None, SliceCopy | None]:
    """D's verdict on the prefill rank's manifest of one state component (``raw``, ``None``
    when P described none: ``not_judged``) against D's own, as P judges it."""
    mine = state.manifest
    if mine is None:  # described nothing (policy off): nothing to judge
        return None, None
    fields = {**fields, "fingerprint": mine.fingerprint}
    peer = f"sglang prefill {endpoint}"
    theirs, error = _read_peer_state(side, mine, raw, state.kind, peer, "prefill", fields)
    if theirs is None:
        return error, None
    if _sliced_state(mine, mine.topology.tp_size, prefill_tp[1]):
        reason = _SLICED_STATE.format(kind=state.kind)
        judge_peer(mine, None, against=None, fields=fields, policy=side.policy, reason=reason)
        return None, None
    item = int(manager.kv_args.state_item_lens[state.index][0])
    return _prefill_verdict(manager, side, theirs, mine, prefill_tp, fields, item)


def _prefill_verdict(
    manager: Any,
    side: _Side,
    theirs: Manifest,
    mine: Manifest,
    prefill_tp: tuple[int, int],
    fields: dict[str, Any],
    item: int,
) -> tuple[SafeViewError | None, SliceCopy | None]:
    """``judge_pair`` of the prefill rank's manifest (``theirs``, of attention-TP rank and size
    ``prefill_tp``) into D's (``mine``; ``item``: D's item length of what they describe)."""
    return judge_pair(
        theirs,
        mine,
        sender_tp=prefill_tp,
        receiver_tp=(mine.topology.tp_rank, mine.topology.tp_size),
        total_heads=theirs.topology.total_kv_heads,
        page_size=int(manager.kv_args.page_size),
        receiver_item_bytes=item,
        fields=fields,
        policy=side.policy,
    )


def _own_wire(side: _Side, manifest: Manifest) -> bytes:
    """The side's manifest on the wire, made at its first handshake and kept (the same bytes
    go to every peer)."""
    if side.wire is None:
        side.wire = to_wire(manifest)
    return side.wire


def send_manifest_to_decode(manager: Any, info: Any) -> None:
    """P's manifest to the D that registered as ``info``, on the ZMQ channel P sends D's status
    messages on (SGLang's own socket for that endpoint)."""
    from sglang.srt.disaggregation.mooncake.conn import (  # type: ignore[import-not-found,unused-ignore]
        NetworkAddress,
    )

    side = _side(manager)
    if side.manifest is None:
        return
    address = NetworkAddress(info.endpoint, int(info.dst_port))
    frames = [
        MANIFEST_FRAME + _own_wire(side, side.manifest),
        f"{manager.local_ip}:{manager.rank_port}".encode("ascii"),
        str(int(manager.kv_args.kv_item_lens[0])).encode("ascii"),
        str(int(manager.attn_tp_rank)).encode("ascii"),
        str(int(manager.attn_tp_size)).encode("ascii"),
        *_state_frames(side),
    ]
    manager._send_multipart_locked(address.to_tcp(), frames, is_ipv6=address.is_ipv6)


def peer_memory_map(
    manifest: Manifest, pointers: list[int], *, storage: str = "decode"
) -> MemoryMap | None:
    """D's KV pages as P's writes must hit them: each buffer at the pointer D registered
    (SGLang's order: every K, then every V; an MLA pool's one per layer), its pages as long
    and as far apart as D's manifest says (SGLang sends no region lengths). ``None`` when the
    manifest and the pointers do not pair up. ``storage``: what the storages' names start
    with."""
    keys: list[tuple[str, Layer]] = []
    values: list[tuple[str, Layer]] = []
    for name, layer in manifest.layers.items():
        if layer.kind == "attention" and any(axis.outer for axis in layer.axes):
            keys.append((f"{name}.k", layer))
            values.append((f"{name}.v", layer))
        elif name.endswith(".v"):
            values.append((name, layer))
        else:
            keys.append((name, layer))
    buffers = keys + values
    if len(buffers) > len(pointers):
        return None
    storages, views = [], []
    prefix = storage
    for index, ((name, layer), pointer) in enumerate(zip(buffers, pointers)):
        storage = f"{prefix}{index}"
        extent = layer.num_blocks * layer.block_stride_bytes
        storages.append(StorageSpan(storage, int(pointer), extent, "peer"))
        views.append(
            ViewSpan(
                name, storage, 0, layer.chunk_bytes, layer.block_stride_bytes,
                layer.num_blocks, name,
            )
        )  # fmt: skip
    return MemoryMap(tuple(storages), tuple(views))


def check_transfer(manager: Any, side: _Side, session: str, blocks: Any) -> bool:
    """The KV rows of one Mooncake batch SGLang's sender built (``(src, dst, length)``) judged
    before Mooncake moves a byte: each source row in P's pool pages, each destination row in
    D's (its pointers, its manifest's lengths): whole pages at equal attention TP, inside one
    page otherwise (``send_kvcache_slice``'s token-slot runs); the state pages the session's
    map holds count as the pool's. Rows whose source is in neither (metadata, state safeview
    did not map) are left to SGLang. Returns whether the batch may go (under warn, always);
    logs an ``address_violation`` per finding."""
    known = side.peers.get(session)
    if known is None or side.pool is None:
        return True
    peer, whole_pages = known
    kinds = side.kinds.get(session, frozenset())
    local = _local_map(side, kinds)
    starts, spans = side.buffers[kinds]
    spans_of_storages = [(s.address, s.address + s.nbytes) for s in local.storages]
    kv_rows = [
        (int(src), int(dst), int(length))
        for src, dst, length in blocks
        if any(start <= int(src) < end for start, end in spans_of_storages)
    ]
    if not kv_rows:
        return True
    # the D buffer each row is meant for: the one named as the P buffer its source lies in
    # (a row of K's page past D's K buffer must not land in D's V buffer behind it)
    meant: list[str | None] = []
    for src, _, _ in kv_rows:
        at = bisect.bisect_right(starts, src) - 1
        meant.append(spans[at][2] if at >= 0 and src < spans[at][1] else None)
    try:  # under strict, the first finding is logged and raised: the batch does not go
        check_descriptors([(src, n) for src, _, n in kv_rows], local,
                          whole_pages=whole_pages, policy=side.policy)  # fmt: skip
        check_descriptors([(dst, n) for _, dst, n in kv_rows], peer, layers=meant,
                          whole_pages=whole_pages, policy=side.policy)  # fmt: skip
    except AddressError:
        return False
    return True


def _local_map(side: _Side, kinds: frozenset[str] = frozenset()) -> MemoryMap:
    """P's pool pages as a memory map, with those of the state components ``kinds`` (their
    buffers named ``swa.layers.0.k``, as D's manifest names D's), made at the first transfer
    that needs it and kept."""
    local = side.local.get(kinds)
    if local is None:
        local = pool_memory_map(side.pool)
        if kinds:
            maps: list[tuple[str, MemoryMap | None]] = [("", local)]
            for kind in sorted(kinds):
                pool = side.states[kind].pool
                buffers = pool_buffers(pool, prefix=f"{kind}.")
                maps.append((f"{kind}.", pool_memory_map(pool, buffers=buffers)))
            local = merged_maps(maps)
        side.local[kinds] = local
        side.buffers[kinds] = _buffer_spans(local)
    return local


def _table(side: _Side, key: Any, memory: MemoryMap) -> _Pages:
    """``memory`` as ``_Pages``, made once per map (``key``: the session, or the state kinds
    P's own map holds, as a tuple ``(None, kinds)``)."""
    known = side.tables.get(key)
    if known is None or known[0] is not memory:
        known = side.tables[key] = (memory, _Pages(memory))
    return known[1]


class _Pages:
    """A memory map's views as sorted numpy columns, to prove a whole batch right at once:
    each row whole pages of the view it starts in (one page, or a run of pages of a view whose
    pages abut), or with ``whole_pages=False`` a slice inside one page, which
    ``check_descriptors`` finds no fault in. ``usable`` is false where two views or two
    storages share a byte (every batch then goes to ``check_descriptors``)."""

    def __init__(self, memory: MemoryMap) -> None:
        import numpy as np

        address = {storage.name: storage.address for storage in memory.storages}
        views = sorted(
            (address[view.storage] + view.byte_offset, view.block_stride_bytes, view.page_bytes,
             view.num_blocks, view.layer or view.name)
            for view in memory.views
        )  # fmt: skip
        storages = sorted((s.address, s.address + s.nbytes) for s in memory.storages)
        ends = [start + max(0, n - 1) * stride + page for start, stride, page, n, _ in views]
        self.names = list(dict.fromkeys(view[4] for view in views))
        self.usable = (
            bool(views)
            and all(page > 0 and n > 0 and stride >= page for _, stride, page, n, _ in views)
            and all(end <= view[0] for end, view in zip(ends, views[1:], strict=False))
            and all(end <= start for (_, end), (start, _) in itertools.pairwise(storages))
            and max(ends + [end for _, end in storages]) < 2**64
        )
        number = {name: index for index, name in enumerate(self.names)}
        unsigned = np.uint64
        self.starts = np.array([view[0] for view in views], dtype=unsigned)
        self.strides = np.array([view[1] for view in views], dtype=unsigned)
        self.pages = np.array([view[2] for view in views], dtype=unsigned)
        self.blocks = np.array([view[3] for view in views], dtype=unsigned)
        self.ends = np.array(ends, dtype=unsigned) if self.usable else self.starts
        self.layers = np.array([number[view[4]] for view in views], dtype=np.int64)
        self.storage_starts = np.array([start for start, _ in storages], dtype=unsigned)
        self.storage_ends = np.array([end for _, end in storages], dtype=unsigned)

    def in_storages(self, addresses: Any) -> Any:
        """Which addresses lie in one of the map's storages."""
        import numpy as np

        at = np.searchsorted(self.storage_starts, addresses, side="right").astype(np.int64) - 1
        inside = at >= 0
        return inside & (addresses < self.storage_ends[np.maximum(at, 0)])

    def proven(self, addresses: Any, lengths: Any, whole_pages: bool) -> Any:
        """The index of each row's layer in ``names``, or ``None`` unless every row is proven."""
        import numpy as np

        at = np.searchsorted(self.starts, addresses, side="right").astype(np.int64) - 1
        if not self.usable or not len(at) or at.min() < 0:
            return None
        offset = addresses - self.starts[at]
        stride, page = self.strides[at], self.pages[at]
        block = offset // stride
        within = offset - block * stride
        ends = addresses + lengths
        right = (lengths > 0) & (ends > addresses) & (ends <= self.ends[at])
        right &= block < self.blocks[at]
        if whole_pages:
            right &= (within == 0) & (
                (lengths == page) | ((stride == page) & (lengths % page == 0))
            )
        else:
            right &= within + lengths <= page
        return self.layers[at] if bool(right.all()) else None


def _proven_batch(side: _Side, session: str, sources: Any, destinations: Any, lengths: Any) -> bool:
    """Whether every KV row of a batch is proven right at once (``_Pages``): ``check_transfer``
    would find nothing. ``False`` says only that the proof failed: the batch goes to
    ``check_transfer``, which judges and names each row."""
    try:
        return _proven_rows(side, session, sources, destinations, lengths)
    except Exception:  # numbers the proof cannot hold (past 2**64): check_transfer judges them
        return False


def _proven_rows(side: _Side, session: str, sources: Any, destinations: Any, lengths: Any) -> bool:
    import numpy as np

    known = side.peers.get(session)
    if known is None or side.pool is None:
        return True
    peer, whole_pages = known
    sent = np.array(sources, dtype=np.uint64)
    received = np.array(destinations, dtype=np.uint64)
    counts = np.array(lengths, dtype=np.uint64)
    if not sent.ndim == received.ndim == counts.ndim == 1 or not (
        len(sent) == len(received) == len(counts)
    ):
        return False
    kinds = side.kinds.get(session, frozenset())
    mine = _table(side, (None, kinds), _local_map(side, kinds))
    kv = mine.in_storages(sent)
    if not kv.any():
        return True  # rows of no pool safeview read (metadata, state): SGLang's
    sent, received, counts = sent[kv], received[kv], counts[kv]
    theirs = _table(side, session, peer)
    from_layers = mine.proven(sent, counts, whole_pages)
    if from_layers is None:
        return False
    into_layers = theirs.proven(received, counts, whole_pages)
    if into_layers is None:
        return False
    # each row lands in D's buffer named as the P buffer it comes from
    number = {name: index for index, name in enumerate(theirs.names)}
    meant = np.array([number.get(name, -1) for name in mine.names], dtype=np.int64)
    return bool((meant[from_layers] == into_layers).all())


def _buffer_spans(memory: MemoryMap) -> tuple[list[int], list[tuple[int, int, str | None]]]:
    """Each view's bytes ``(start, end, layer)``, by start, and the starts alone (bisect)."""
    address = {storage.name: storage.address for storage in memory.storages}
    spans = sorted(
        (
            address[view.storage] + view.byte_offset,
            address[view.storage] + view.byte_offset
            + max(0, view.num_blocks - 1) * view.block_stride_bytes + view.page_bytes,
            view.layer,
        )
        for view in memory.views
    )  # fmt: skip
    return [span[0] for span in spans], spans


class JudgedEngine:
    """P's Mooncake transfer engine (SGLang's ``MooncakeTransferEngine``) with every
    ``batch_transfer_sync`` judged first (``check_transfer``); everything else is the engine's."""

    def __init__(self, engine: Any, manager: Any) -> None:
        object.__setattr__(self, "_engine", engine)
        object.__setattr__(self, "_manager", manager)

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_engine"), name)

    def batch_transfer_sync(
        self, session_id: str, buffers: Any, peer_buffer_addresses: Any, lengths: Any
    ) -> Any:
        engine = object.__getattribute__(self, "_engine")
        manager = object.__getattribute__(self, "_manager")
        try:
            side = getattr(manager, _STATE, None)
            allowed = (
                side is None
                or side.policy is Policy.OFF
                or not buffers
                or _proven_batch(side, session_id, buffers, peer_buffer_addresses, lengths)
                or check_transfer(
                    manager, side, session_id, zip(buffers, peer_buffer_addresses, lengths)
                )
            )
        except Exception as error:  # safeview's own failure: the batch goes as SGLang sends it
            step_aside("transfers left unjudged", f"{type(error).__name__}: {error}")
            allowed = True
        if not allowed:
            return -1  # Mooncake's failed batch: SGLang fails the request, before a byte moved
        return engine.batch_transfer_sync(session_id, buffers, peer_buffer_addresses, lengths)


def _publish_peer_registration(original: Any) -> Any:
    @functools.wraps(original)
    def _publish(self: Any, mooncake_session_id: str, decode_kv_args: Any) -> Any:
        reason = original(self, mooncake_session_id, decode_kv_args)
        try:  # a D that sent its manifest runs safeview: it gets P's, before any request
            side = _side(self)
            if side.policy is not Policy.OFF and (
                getattr(decode_kv_args, "_safeview_manifest", None) is not None
            ):
                send_manifest_to_decode(self, decode_kv_args)
        except Exception as failure:
            step_aside("manifest not sent", f"{type(failure).__name__}: {failure}")
        if reason is not None:
            return reason  # SGLang refused it already
        try:
            error, copy = judge_decode_peer(self, mooncake_session_id, decode_kv_args)
        except Exception as failure:  # safeview's own failure: the pair goes on unjudged
            step_aside("peer left unjudged", f"{type(failure).__name__}: {failure}")
            return None
        if error is None:
            return None
        text = refusal_text(
            error,
            prefill_item_bytes=int(self.kv_args.kv_item_lens[0]),
            decode_item_bytes=int(decode_kv_args.dst_kv_item_len),
            copy=copy,
        )
        # SGLang's own rejection, as it records one: every transfer to the session fails
        with self.session_lock:
            self.state_layout_rejections[mooncake_session_id] = text
            self.state_strides_validated.discard(mooncake_session_id)
        return text

    return _publish


def _handle_chunk_ready(original: Any) -> Any:
    @functools.wraps(original)
    def handle_chunk_ready(self: Any, msg: Any) -> Any:
        if msg and isinstance(msg[0], bytes) and msg[0].startswith(MANIFEST_FRAME):
            try:
                judge_prefill_peer(self, list(msg))
            except Exception as failure:  # safeview's own failure: the pair goes on unjudged
                step_aside("prefill peer left unjudged", f"{type(failure).__name__}: {failure}")
            return True  # consumed: not one of SGLang's messages
        return original(self, msg)

    return handle_chunk_ready


def _receiver_poll(original: Any) -> Any:
    @functools.wraps(original)
    def poll(self: Any) -> Any:
        try:
            side = getattr(self.kv_mgr, _STATE, None)
            if side is not None and side.refusals and self.conclude_state is None:
                for info in self.bootstrap_infos or ():
                    text = side.refusals.get(f"{info.get('rank_ip')}:{info.get('rank_port')}")
                    if text is not None:
                        from sglang.srt.disaggregation.base.conn import (  # type: ignore[import-not-found,unused-ignore]
                            KVPoll,
                        )

                        self.kv_mgr.record_failure(self.bootstrap_room, text)
                        self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
                        break
        except Exception as failure:
            step_aside("prefill refusal not applied", f"{type(failure).__name__}: {failure}")
        return original(self)

    return poll


def install_manager() -> None:
    """Patch SGLang 0.5.23's ``MooncakeKVManager``, ``MooncakeKVReceiver`` and
    ``KVArgsRegisterInfo`` (once)."""
    from sglang.srt.disaggregation.mooncake.conn import (  # type: ignore[import-not-found,unused-ignore]
        KVArgsRegisterInfo,
        MooncakeKVManager,
        MooncakeKVReceiver,
    )

    for name in (
        "register_buffer_to_engine",
        "build_receiver_registration_message",
        "_publish_peer_registration",
        "_transfer_data",
        "send_kvcache_slice",
    ):
        if name not in MooncakeKVManager.__dict__:
            raise AttributeError(f"MooncakeKVManager.{name} is not SGLang 0.5.23's")
    for name in ("handle_chunk_ready", "_send_multipart_locked"):
        if not callable(getattr(MooncakeKVManager, name, None)):
            raise AttributeError(f"MooncakeKVManager.{name} is not SGLang 0.5.23's")
    if not callable(getattr(MooncakeKVReceiver, "poll", None)):
        raise AttributeError("MooncakeKVReceiver.poll is not SGLang 0.5.23's")
    if not isinstance(KVArgsRegisterInfo.__dict__.get("from_zmq"), classmethod):
        raise AttributeError("KVArgsRegisterInfo.from_zmq is not a classmethod")
    _wrap(MooncakeKVManager, "register_buffer_to_engine", _register_buffer_to_engine)
    _wrap(
        MooncakeKVManager,
        "build_receiver_registration_message",
        _build_receiver_registration_message,
    )
    _wrap(MooncakeKVManager, "_publish_peer_registration", _publish_peer_registration)
    _wrap(MooncakeKVManager, "handle_chunk_ready", _handle_chunk_ready, inherited=True)
    _wrap(MooncakeKVReceiver, "poll", _receiver_poll, inherited=True)
    _wrap(KVArgsRegisterInfo, "from_zmq", _from_zmq)
