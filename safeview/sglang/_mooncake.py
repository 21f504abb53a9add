"""SGLang 0.5.23's Mooncake manager (``sglang.srt.disaggregation.mooncake.conn``), guarded.

Four places, patched on the classes (every manager of the process), none changing what SGLang
does when safeview is off or has nothing to say:

- ``MooncakeKVManager.register_buffer_to_engine``: before Mooncake's ``batch_register``, every
  KV region SGLang hands it (``kv_args.kv_data_ptrs`` and ``kv_data_lens``) must lie inside the
  buffer of the pool it came from (``safeview.transfer.check_descriptors`` over the pool's
  buffers). Under strict an ``AddressError`` stops the manager's start-up.
- ``MooncakeKVManager.build_receiver_registration_message`` (D): the registration D sends P
  on SGLang's own ZMQ channel carries one more frame, ``safeview.manifest:`` and D's manifest
  (``safeview.manifest.wire``). ``KVArgsRegisterInfo.from_zmq`` reads SGLang's frames by
  position and never this one: a P without safeview ignores it.
- ``MooncakeKVManager._publish_peer_registration`` (P): after SGLang's own verdict, P judges
  D's manifest against its own (``safeview.manifest.peer.judge_peer``, rule ``page_copy``: page
  ``b`` of each region into page ``b`` of D's). Under strict a mismatch is returned as the
  rejection reason, which SGLang already keeps per decode session and with which it fails every
  transfer to that session, before a byte moves. Under warn: a ``layout_mismatch`` event, and
  SGLang goes on as it would.
- ``MooncakeKVManager._transfer_data`` (P; every batch of ``_send_kvcache_generic``, and the
  metadata and state batches, which it leaves alone): each KV row's source must be whole pages
  of P's pool and its destination whole pages of D's, D's pages placed at the pointers D
  registered with the lengths of D's manifest (``safeview.transfer.check_descriptors``). Under
  strict a batch with a finding is not run: SGLang gets the failure code Mooncake would give
  and fails the request; under warn, an ``address_violation`` event and the batch runs.

Pairs not judged (an event says why): D sent no manifest (no safeview there), another
attention-TP size (SGLang slices heads in ``send_kvcache_slice``; not modelled yet), DCP.
safeview's own failure never stops SGLang: one ``integration_unavailable`` event.
"""

from __future__ import annotations

import functools
from typing import Any

from safeview.errors import AddressError, LayoutMismatchError
from safeview.manifest import Layer, Manifest, Topology
from safeview.manifest.peer import judge_peer
from safeview.manifest.wire import from_wire, to_wire
from safeview.policy import Policy, current_policy
from safeview.sglang import (
    describe_pool,
    pool_buffers,
    pool_memory_map,
    pool_of,
    step_aside,
)
from safeview.transfer import MemoryMap, StorageSpan, ViewSpan, check_descriptors

__all__ = ["MANIFEST_FRAME", "install_manager"]

MANIFEST_FRAME = b"safeview.manifest:"
"""The prefix of the frame that carries D's manifest in SGLang's registration message."""

_PATCHED = "__safeview_guarded__"
_STATE = "_safeview_state"
_SGLANG_FRAMES = 20  # KVArgsRegisterInfo.from_zmq reads msg[0] to msg[19]


class _Side:
    """What safeview knows of one manager: the policy in force when it registered, its pool and
    its manifest (``None`` when its pool is not one safeview read)."""

    __slots__ = ("local", "manifest", "peers", "policy", "pool")

    def __init__(self, policy: Policy, pool: Any, manifest: Manifest | None) -> None:
        self.policy = policy
        self.pool = pool
        self.manifest = manifest
        self.local: MemoryMap | None = None  # the pool's pages, once P first transfers
        # decode session -> its KV pages (its pointers, its manifest's lengths), once judged
        self.peers: dict[str, MemoryMap] = {}


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
    if pool is None:
        step_aside("manager left unchecked", "its KV regions are of no pool safeview read")
    elif policy is not Policy.OFF:
        try:
            manifest = describe_pool(pool, topology=_topology(manager))
        except Exception as error:  # a pool safeview cannot read: judged as SGLang judges it
            step_aside("pool not described", f"{type(error).__name__}: {error}")
    known = _Side(policy, pool, manifest)
    setattr(manager, _STATE, known)
    return known


def check_registration(manager: Any, side: _Side) -> None:
    """Every KV region the manager is about to register lies inside the pool buffer it came
    from, in the order ``get_contiguous_buf_infos`` gave them. Raises ``AddressError`` under
    strict; logs under warn."""
    buffers = pool_buffers(side.pool)
    kv_args = manager.kv_args
    rows = list(zip(kv_args.kv_data_ptrs, kv_args.kv_data_lens))[: len(buffers)]
    names: list[str | None] = [buffer.name for buffer in buffers[: len(rows)]]
    check_descriptors(
        rows,
        pool_memory_map(side.pool, whole_buffers=True),
        layers=names,
        whole_pages=False,
        policy=side.policy,
    )


def _wrap(cls: type, name: str, make: Any) -> None:
    original = cls.__dict__[name]
    function = getattr(original, "__func__", original)  # a classmethod's function
    if getattr(function, _PATCHED, False):
        return
    wrapper = make(original)
    setattr(getattr(wrapper, "__func__", wrapper), _PATCHED, True)
    setattr(cls, name, wrapper)


def _register_buffer_to_engine(original: Any) -> Any:
    @functools.wraps(original)
    def register_buffer_to_engine(self: Any) -> Any:
        try:
            side = _side(self)
            if side.pool is not None and side.policy is not Policy.OFF:
                check_registration(self, side)
        except AddressError:
            raise  # a finding, under strict: the start-up stops with its numbers
        except Exception as error:  # safeview's own failure, or an SGLang it does not know
            step_aside("registration left unchecked", f"{type(error).__name__}: {error}")
        return original(self)

    return register_buffer_to_engine


def _build_receiver_registration_message(original: Any) -> Any:
    @functools.wraps(original)
    def build_receiver_registration_message(self: Any) -> Any:
        message = original(self)
        try:
            side = _side(self)
            if side.manifest is not None and side.policy is not Policy.OFF:
                message = [*message, MANIFEST_FRAME + to_wire(side.manifest)]
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
        except Exception as error:
            step_aside("peer manifest not read", f"{type(error).__name__}: {error}")
        return info

    return classmethod(from_zmq)


def judge_decode_peer(manager: Any, session: str, info: Any) -> LayoutMismatchError | None:
    """P's verdict on the decode peer that registered as ``info`` (SGLang's
    ``KVArgsRegisterInfo``): one event, and the error under strict."""
    side = _side(manager)
    if side.policy is Policy.OFF or side.manifest is None:
        return None
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
    elif int(info.dst_attn_tp_size) != mine.topology.tp_size:
        reason = (
            f"attention TP differs (prefill {mine.topology.tp_size}, decode "
            f"{info.dst_attn_tp_size}): SGLang slices heads (send_kvcache_slice), which "
            "safeview does not model yet"
        )
    elif int(getattr(info, "dst_dcp_size", 1) or 1) > 1 or int(manager.dcp_size or 1) > 1:
        reason = "decode context parallelism: not modelled yet"
    if reason is not None or raw is None:
        side.peers.pop(session, None)
        return judge_peer(mine, None, against=None, fields=fields, reason=reason,
                          policy=side.policy)  # fmt: skip
    theirs = from_wire(raw, peer=f"sglang decode session {session}")
    peer = peer_memory_map(theirs, [int(p) for p in info.dst_kv_ptrs])
    if peer is not None:
        side.peers[session] = peer
    else:
        side.peers.pop(session, None)
    return judge_peer(
        theirs,
        [mine],
        against="handshake",
        fields={**fields, "engine": theirs.topology.engine, "fingerprint": theirs.fingerprint,
                "remote_engine": mine.topology.engine, "remote_tp_size": mine.topology.tp_size,
                "tp_rank": theirs.topology.tp_rank, "tp_size": theirs.topology.tp_size},
        rule="page_copy",
        policy=side.policy,
    )  # fmt: skip


def peer_memory_map(manifest: Manifest, pointers: list[int]) -> MemoryMap | None:
    """D's KV pages as P's writes must hit them: each buffer at the pointer D registered
    (SGLang's order: every K, then every V; an MLA pool's one per layer), its pages as long
    and as far apart as D's manifest says (SGLang sends no region lengths). ``None`` when the
    manifest and the pointers do not pair up."""
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
    for index, ((name, layer), pointer) in enumerate(zip(buffers, pointers)):
        storage = f"decode{index}"
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
    """The KV rows of one of SGLang's Mooncake batches (``(src, dst, length)``, as
    ``_transfer_data`` gets them) judged before Mooncake moves a byte: each source row whole
    pages of P's pool, each destination row whole pages of D's (its pointers, its manifest's
    lengths). Rows whose source is not in P's pool (metadata, state) are left to SGLang.
    Returns whether the batch may go (under warn, always); logs an ``address_violation`` per
    finding."""
    peer = side.peers.get(session)
    if peer is None or side.pool is None:
        return True
    local = side.local
    if local is None:
        local = side.local = pool_memory_map(side.pool)
    spans = [(s.address, s.address + s.nbytes) for s in local.storages]
    kv_rows = [
        (int(src), int(dst), int(length))
        for src, dst, length in blocks
        if any(start <= int(src) < end for start, end in spans)
    ]
    if not kv_rows:
        return True
    try:  # under strict, the first finding is logged and raised: the batch does not go
        check_descriptors([(src, n) for src, _, n in kv_rows], local, policy=side.policy)
        check_descriptors([(dst, n) for _, dst, n in kv_rows], peer, policy=side.policy)
    except AddressError:
        return False
    return True


def _transfer_data(original: Any) -> Any:
    @functools.wraps(original)
    def transfer_data(self: Any, mooncake_session_id: str, transfer_blocks: Any) -> Any:
        try:
            side = getattr(self, _STATE, None)
            allowed = (
                side is None
                or side.policy is Policy.OFF
                or not transfer_blocks
                or check_transfer(self, side, mooncake_session_id, transfer_blocks)
            )
        except Exception as error:  # safeview's own failure: the batch goes as SGLang sends it
            step_aside("transfers left unjudged", f"{type(error).__name__}: {error}")
            allowed = True
        if not allowed:
            return -1  # SGLang's failed batch: it fails the request, before a byte moved
        return original(self, mooncake_session_id, transfer_blocks)

    return transfer_data


def _publish_peer_registration(original: Any) -> Any:
    @functools.wraps(original)
    def _publish(self: Any, mooncake_session_id: str, decode_kv_args: Any) -> Any:
        reason = original(self, mooncake_session_id, decode_kv_args)
        if reason is not None:
            return reason  # SGLang refused it already
        try:
            error = judge_decode_peer(self, mooncake_session_id, decode_kv_args)
        except Exception as failure:  # safeview's own failure: the pair goes on unjudged
            step_aside("peer left unjudged", f"{type(failure).__name__}: {failure}")
            return None
        if error is None:
            return None
        text = f"safeview: {error}"
        # SGLang's own rejection, as it records one: every transfer to the session fails
        with self.session_lock:
            self.state_layout_rejections[mooncake_session_id] = text
            self.state_strides_validated.discard(mooncake_session_id)
        return text

    return _publish


def install_manager() -> None:
    """Patch SGLang 0.5.23's ``MooncakeKVManager`` and ``KVArgsRegisterInfo`` (once)."""
    from sglang.srt.disaggregation.mooncake.conn import (  # type: ignore[import-not-found,unused-ignore]
        KVArgsRegisterInfo,
        MooncakeKVManager,
    )

    for name in (
        "register_buffer_to_engine",
        "build_receiver_registration_message",
        "_publish_peer_registration",
        "_transfer_data",
    ):
        if name not in MooncakeKVManager.__dict__:
            raise AttributeError(f"MooncakeKVManager.{name} is not SGLang 0.5.23's")
    if not isinstance(KVArgsRegisterInfo.__dict__.get("from_zmq"), classmethod):
        raise AttributeError("KVArgsRegisterInfo.from_zmq is not a classmethod")
    _wrap(MooncakeKVManager, "register_buffer_to_engine", _register_buffer_to_engine)
    _wrap(
        MooncakeKVManager,
        "build_receiver_registration_message",
        _build_receiver_registration_message,
    )
    _wrap(MooncakeKVManager, "_publish_peer_registration", _publish_peer_registration)
    _wrap(MooncakeKVManager, "_transfer_data", _transfer_data)
    _wrap(KVArgsRegisterInfo, "from_zmq", _from_zmq)
