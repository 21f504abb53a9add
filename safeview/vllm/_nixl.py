"""What the vLLM plugin knows of vLLM 0.33's NIXL connector worker
(``kv_connector/v1/nixl/base_worker.py``), beyond where it keeps its agent: which layer each
region it registers belongs to (the intent of its local descriptor rows).

The worker lists one region per layer (``region_names[i]`` is region ``i``'s layer; a layer
sharing another's base address joins that region) and builds its local rows region by region
(``_build_fa_local``), so a local list of ``k`` rows per region is ``k`` consecutive rows per
layer. Rows of a packed region (whole blocks of every layer) and the Mamba and mixed-memory
lists, which are laid out otherwise, carry no intent.

It also carries the layout on the connector's own channels (see "the manifest on vLLM's own
channels" below): P's manifest in its handshake payload, and a short token in each request's
``kv_transfer_params``. Imported by ``safeview.vllm`` only.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from safeview.errors import SafeViewError
from safeview.policy import Policy
from safeview.transfer.nixl import _install

__all__ = [
    "TOKEN_KEY",
    "WIRE_KEY",
    "check_worker_coverage",
    "fetch_payloads",
    "guard_scheduler",
    "guard_worker",
    "install_channels",
    "layers_to_transfer",
    "region_intent",
    "serve_manifest",
    "take_decoded",
    "take_listens",
    "tell_verdict",
]


def region_intent(worker: Any) -> Callable[[int], Sequence[str | None] | None]:
    """The layer each row of a local list of ``worker`` is meant for, read from the worker's
    own regions when the list is prepared (they exist only once it registers)."""

    def names(count: int) -> list[str | None] | None:
        if getattr(worker, "_has_mamba", False) or getattr(worker, "_mixed_mem_types", False):
            return None
        region_names = list(getattr(worker, "region_names", None) or ())
        indices = list(getattr(worker, "_transfer_layer_region_indices", None) or ())
        if not indices:
            indices = list(range(len(region_names)))
        packed = getattr(worker, "_packed_member_layouts", None) or {}
        try:
            per_region = [None if region_names[i] in packed else region_names[i] for i in indices]
        except (IndexError, TypeError):
            return None
        if not per_region or count % len(per_region):
            return None
        repeat = count // len(per_region)
        return [name for name in per_region for _ in range(repeat)]

    return names


def guard_worker(
    worker: Any, agent: Any, allocation: Any, policy: Policy, whole_pages: bool
) -> Any:
    """``safeview.transfer.nixl.guard`` of ``worker``'s ``agent`` against ``allocation``, told the
    layer of each region; a step-aside is an event only (the plugin's own warning says it)."""
    return _install(agent, allocation, policy, whole_pages, region_intent(worker), warn=False)


def layers_to_transfer(
    worker: Any, kv_caches: Mapping[str, Any], kv_cache_config: Any
) -> tuple[list[str], set[str]]:
    """The layers vLLM 0.33's NIXL worker is to transfer, by its own rules
    (``register_kv_caches``): the layers of ``kv_cache_config.transfer_groups`` among
    ``kv_caches`` (a ``kv_caches`` entry with no spec there shares another layer's cache and is
    skipped on purpose), less the host-memory layers of a TP rank other than 0 when a HiSparse
    host pool is shared (``_skip_dram_xfer``: rank 0 transfers them). The second set holds the
    layers whose pages are padded state (not attention), judged by the pages they reach."""
    groups = getattr(kv_cache_config, "transfer_groups", None)
    if groups is None:
        groups = kv_cache_config.kv_cache_groups
    try:
        from vllm.v1.kv_cache_interface import AttentionSpec
    except ImportError:  # pragma: no cover - only where vLLM is not importable
        attention: tuple[type, ...] = ()
    else:
        attention = (AttentionSpec,)
    skip_host = bool(getattr(worker, "_skip_dram_xfer", False))
    layers: list[str] = []
    padded: set[str] = set()
    for group in groups:
        group_spec = group.kv_cache_spec
        specs = getattr(group_spec, "kv_cache_specs", None) or {}
        for layer in group.layer_names:
            cache = kv_caches.get(layer)
            if cache is None:
                continue
            if skip_host and getattr(getattr(cache, "device", None), "type", None) == "cpu":
                continue
            spec = specs.get(layer, group_spec)
            if attention and not isinstance(spec, attention):
                padded.add(layer)
            layers.append(layer)
    return layers, padded


def check_worker_coverage(
    worker: Any,
    agent: Any,
    allocation: Any,
    kv_caches: Mapping[str, Any],
    kv_cache_config: Any,
    policy: Policy,
) -> None:
    """After the worker registered: every layer it is to transfer lies in the local lists it
    prepared (``safeview.transfer.coverage``); under strict ``CoverageError`` stops the start-up
    before any transfer, under warn one ``coverage_violation`` per layer left out."""
    from safeview.transfer.coverage import enforce, uncovered
    from safeview.transfer.nixl import _STATE

    state = getattr(agent, "__dict__", {}).get(_STATE)
    if state is None or kv_cache_config is None or policy is Policy.OFF:
        return
    layers, padded = layers_to_transfer(worker, kv_caches, kv_cache_config)
    known = {view.layer or view.name for view in allocation.views}
    layers = [layer for layer in layers if layer in known]  # no address (meta): no descriptor
    prepared, state.prepared = list(state.prepared), []
    if not layers:
        return
    found = uncovered(prepared, allocation, layers, padded)
    enforce(found, policy, "vllm.nixl")


# -- the manifest on vLLM's own channels -------------------------------------------------------
#
# vLLM 0.33's NIXL connector already has two channels that cross machines (see docs/vllm.md,
# "Across machines"):
#
# - the handshake: P's scheduler serves, per (pp_rank, tp_rank), ``msgspec.msgpack.encode`` of
#   the worker's ``NixlHandshakePayload`` (a dataclass, so a msgpack map of its field names); D's
#   worker decodes it with ``msgspec.msgpack.Decoder(NixlHandshakePayload)``, which ignores map
#   keys it does not know. P's payload gets one more key, ``safeview_manifest`` (the rank's
#   manifest in ``safeview.manifest.wire``'s form); a D without safeview never sees it, and with
#   nothing to send the key is left out (``msgspec.UNSET``), so the bytes are vLLM's own.
# - the request: P's scheduler-side ``request_finished`` returns ``kv_transfer_params``, which the
#   proxy relays to D's scheduler, whose ``NixlConnectorMetadata.add_new_req_to_recv`` keeps only
#   the keys vLLM knows in the ``ReqMeta`` its workers get. The token (``TOKEN_KEY``) is carried
#   onto that ``ReqMeta`` as an attribute of its own (``TOKEN_ATTRIBUTE``).

WIRE_KEY = "safeview_manifest"  # the extra key of P's handshake payload
TOKEN_KEY = "safeview"  # the extra key of a request's kv_transfer_params
TOKEN_ATTRIBUTE = "safeview_token"  # where D's ReqMeta keeps it
DIGEST_MARK_KEY = "safeview_digest"  # P digested the request (safeview.vllm._digest's MARK_KEY)
_CHANNELS_PATCHED = "__safeview_channels__"
_decoded = threading.local()  # the wire manifest of the payload this thread decoded last


def _payload_class() -> type:
    """A ``NixlHandshakePayload`` with one more field, ``safeview_manifest``: encoded only when
    set, decoded from any msgpack value (a peer's junk there is safeview's to judge, never a
    decoding error of vLLM's), and handed to the thread that decoded it (``take_decoded``),
    which is the handshake thread that calls ``add_remote_agent`` right after."""
    import dataclasses

    import msgspec
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlHandshakePayload

    @dataclasses.dataclass
    class SafeviewHandshakePayload(NixlHandshakePayload):  # type: ignore[misc]
        safeview_manifest: Any = msgspec.UNSET
        # set by P's scheduler whose side channel answers VERDICT_MSG (safeview's listener)
        safeview_listens: Any = msgspec.UNSET

        def __post_init__(self) -> None:
            _decoded.wire = self.safeview_manifest
            _decoded.listens = self.safeview_listens

    SafeviewHandshakePayload.__module__ = __name__
    SafeviewHandshakePayload.__qualname__ = "SafeviewHandshakePayload"
    return SafeviewHandshakePayload


_PAYLOAD: type | None = None


def payload_class() -> type:
    """The one ``SafeviewHandshakePayload`` class of this process (made on first use)."""
    global _PAYLOAD
    if _PAYLOAD is None:
        _PAYLOAD = _payload_class()
    return _PAYLOAD


def __getattr__(name: str) -> Any:
    # pickle finds the payload class by name (vLLM's executor pickles what workers return)
    if name == "SafeviewHandshakePayload":
        return payload_class()
    raise AttributeError(name)


def take_decoded() -> bytes | None:
    """The ``safeview_manifest`` of the payload this thread decoded last, once; ``None`` when
    the peer sent none. Anything but bytes is handed on as it came, for the judge to refuse."""
    wire = getattr(_decoded, "wire", None)
    _decoded.wire = None
    import msgspec

    found: Any = wire
    return None if found is None or found is msgspec.UNSET else found


def take_listens() -> bool:
    """Whether the payload this thread decoded last says P's side channel answers
    ``VERDICT_MSG`` (once). vLLM's own listener dies of a message it does not know: only a P
    that says so is told."""
    listens = getattr(_decoded, "listens", None)
    _decoded.listens = None
    return listens is True or (isinstance(listens, int) and listens == 1)


VERDICT_MSG = "safeview_verdict"  # the side-channel message: (VERDICT_MSG, the verdict, 0)


def tell_verdict(host: str, port: int, verdict: Mapping[str, Any], timeout_ms: int = 2000) -> None:
    """Tell P's side channel what D found of their pair (``verdict``: a map of strings, numbers
    and lists), for P to log it beside its own fingerprint; P answers ``ok``. Raises what the
    socket raises (the caller lets it go)."""
    import msgspec
    import zmq  # type: ignore[import-not-found,unused-ignore]  # vLLM's dependency
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import zmq_ctx
    from vllm.utils.network_utils import make_zmq_path

    with zmq_ctx(zmq.REQ, make_zmq_path("tcp", host, port)) as sock:
        sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
        sock.setsockopt(zmq.LINGER, 0)
        sock.send(msgspec.msgpack.encode((VERDICT_MSG, dict(verdict), 0)))
        sock.recv_multipart()


def mark_listening(metadata: Any) -> None:
    """P's scheduler, whose side channel is safeview's listener: each payload it serves says
    so (``safeview_listens``), before vLLM encodes it."""
    if not isinstance(metadata, dict):
        return
    cls = payload_class()
    for payload in metadata.values():
        if isinstance(payload, cls):
            found: Any = payload
            found.safeview_listens = 1


def install_channels() -> None:
    """Once per process (the plugin's entry point): D's worker decodes P's payload with the
    class above (vLLM's worker module looks its name up at each handshake), and D's scheduler
    carries a request's token onto the ``ReqMeta`` its workers get."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker, metadata

    cls = metadata.NixlConnectorMetadata
    add = cls.__dict__["add_new_req_to_recv"]
    if getattr(add, _CHANNELS_PATCHED, False):
        return
    base_worker.NixlHandshakePayload = payload_class()

    @functools.wraps(add)
    def add_new_req_to_recv(
        self: Any, request_id: Any, local_block_ids: Any, kv_transfer_params: Any,
        *args: Any, **kwargs: Any,
    ) -> Any:  # fmt: skip
        added = add(self, request_id, local_block_ids, kv_transfer_params, *args, **kwargs)
        params = kv_transfer_params if isinstance(kv_transfer_params, dict) else {}
        token = params.get(TOKEN_KEY)
        if token is not None:
            with contextlib.suppress(Exception):  # a ReqMeta of another vLLM: nothing carried
                setattr(self.reqs_to_recv[request_id], TOKEN_ATTRIBUTE, token)
        if params.get(DIGEST_MARK_KEY):  # P digested it: D compares what arrives
            with contextlib.suppress(Exception):
                setattr(self.reqs_to_recv[request_id], DIGEST_MARK_KEY, True)
        return added

    setattr(add_new_req_to_recv, _CHANNELS_PATCHED, True)
    setattr(cls, "add_new_req_to_recv", add_new_req_to_recv)  # noqa: B010


def serve_manifest(worker: Any, wire: bytes) -> bool:
    """Put ``wire`` into what ``worker`` serves at the handshake (its
    ``xfer_handshake_metadata``, made by its ``register_kv_caches``); whether it could."""
    payload: Any = getattr(worker, "xfer_handshake_metadata", None)
    if payload is None:
        return False
    cls = payload_class()
    if not isinstance(payload, cls):
        payload = cls(
            compatibility_hash=payload.compatibility_hash,
            agent_metadata_bytes=payload.agent_metadata_bytes,
        )
    payload.safeview_manifest = wire
    worker.xfer_handshake_metadata = payload
    return True


class SideChannelError(SafeViewError, LookupError):
    """P's side channel answered a question with an error in place of what was asked: a
    handshake of a rank P does not hold, a message it could not read (safeview's listener
    answers so, ``safeview.vllm._digest``, where vLLM's own listener ends). ``peer`` is P's
    side channel, ``asked`` what D asked, ``said`` P's answer. D reads it as P's silence: the
    pair is judged without it, a digest is ``not_judged``."""

    def __init__(self, peer: str, asked: str, said: str) -> None:
        self.peer = peer
        self.asked = asked
        self.said = said
        super().__init__(f"{peer}: {asked}: P answered {said!r}")


def fetch_payloads(
    host: str, port: int, ranks: Sequence[int], *, pp_rank: int = 0, timeout_ms: int = 5000
) -> dict[int, dict[str, Any]]:
    """P's current handshake payloads of ``ranks``, read from P's side channel as vLLM's own
    handshake reads them (``GET_META_MSG``): each a dict of the payload's map. Raises
    ``SideChannelError`` for a rank P answers it does not hold, what the socket or decoder
    raises otherwise (the caller says the pair cannot be judged)."""
    import msgspec
    import zmq  # type: ignore[import-not-found,unused-ignore]  # vLLM's dependency
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import GET_META_MSG
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import zmq_ctx
    from vllm.utils.network_utils import make_zmq_path

    found: dict[int, dict[str, Any]] = {}
    with zmq_ctx(zmq.REQ, make_zmq_path("tcp", host, port)) as sock:
        sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
        for rank in ranks:
            sock.send(msgspec.msgpack.encode((GET_META_MSG, pp_rank, rank)))
            reply = sock.recv_multipart()
            payload = msgspec.msgpack.decode(reply[0])
            if isinstance(payload, str):  # safeview's listener: P cannot serve that rank
                raise SideChannelError(
                    f"P's side channel at {host}:{port}", f"handshake of rank {rank}", payload
                )
            if not isinstance(payload, dict):
                raise TypeError(f"P's payload of rank {rank} is a {type(payload).__name__}")
            found[rank] = payload
    return found


def guard_scheduler(connector: Any, token_of: Callable[[Any], str | None]) -> None:
    """On P's scheduler-side NIXL connector (vLLM 0.33: ``connector.connector_scheduler``): when
    the engine core hands it the workers' handshake payloads (``set_xfer_handshake_metadata``,
    at start-up, before any request), keep the token of rank 0's manifest (``token_of``); each
    ``request_finished`` that sends blocks to a D adds it to ``kv_transfer_params``. The
    scheduler learns it from the payloads, not from a worker's per-step metadata, which in the
    step a prefill finishes reaches the scheduler only after ``request_finished``."""
    parts = [connector, *getattr(connector, "_connectors", ())]
    for part in parts:
        scheduler = getattr(part, "connector_scheduler", None)
        if scheduler is None or not hasattr(scheduler, "set_xfer_handshake_metadata"):
            continue
        if getattr(scheduler.request_finished, _CHANNELS_PATCHED, False):
            continue
        _guard_one_scheduler(scheduler, token_of)


def _guard_one_scheduler(scheduler: Any, token_of: Callable[[Any], str | None]) -> None:
    set_metadata = scheduler.set_xfer_handshake_metadata
    finished = scheduler.request_finished
    held: dict[str, str | None] = {"token": None}

    @functools.wraps(set_metadata)
    def set_xfer_handshake_metadata(metadata: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            first = metadata.get((0, 0)) if isinstance(metadata, dict) else None
            held["token"] = None if first is None else token_of(first)
        except Exception:  # never in vLLM's way: no token, D judges from the handshake
            held["token"] = None
        return set_metadata(metadata, *args, **kwargs)

    @functools.wraps(finished)
    def request_finished(*args: Any, **kwargs: Any) -> Any:
        result = finished(*args, **kwargs)
        token = held["token"]
        if token is not None and isinstance(result, tuple) and len(result) == 2:
            params = result[1]
            if isinstance(params, dict) and params.get("do_remote_prefill"):
                params[TOKEN_KEY] = token
        return result

    setattr(request_finished, _CHANNELS_PATCHED, True)
    scheduler.set_xfer_handshake_metadata = set_xfer_handshake_metadata
    scheduler.request_finished = request_finished
