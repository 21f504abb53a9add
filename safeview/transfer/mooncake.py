"""A guard around a Mooncake transfer engine: the local address of every transfer is checked
against a registration before the engine moves a byte.

Over TCP, Mooncake's transfer engine checks the peer's address against the peer's registered
buffers and nothing on the local side: a write from, or a read into, local memory outside every
registration succeeds, and so does a row on another layer's page or across two pages.
``guard(engine, registration)`` returns a proxy (the engine is a pybind object whose methods
cannot be replaced) that checks, before the engine runs:

- ``transfer_sync_write``, ``transfer_sync_read``, ``transfer_sync``, ``transfer_submit_write``:
  the local row ``(buffer, length)`` against the registration;
- ``batch_transfer_sync_write`` / ``_read``, ``batch_transfer_async_write`` / ``_read``,
  ``batch_transfer_sync``, ``batch_transfer_async``: every local row, and the rows written (the
  peer's for a write, the local ones for a read) against each other (``overlapping_writes``);
- ``register_memory``, ``batch_register_memory``: a region overlapping one registered before
  through the guard is a ``duplicate_registration``; ``unregister_memory`` and
  ``batch_unregister_memory`` forget it.

After the engine ran, its return code is judged: a failure is a ``transfer_failed`` (or
``registration_failed``) event and reaches the caller unchanged, and a later call that depends on
it (a write of bytes whose read failed) is refused under strict. An asynchronous call returns a
batch id (0: the submit failed); the guard remembers the id with its local rows until
``get_batch_transfer_status`` (or ``transfer_check_status``) reports its outcome, and until then
the bytes of an asynchronous read count as not yet read.

Across machines (``manifest=``): the guard publishes the layout manifest of its engine's KV
cache in the metadata store the engine already uses, under a key of its own next to the
engine's segment (``store_key``), and, before the first transfer from or to another segment,
reads that segment's manifest from the store and judges the pair with
``safeview.manifest.peer.judge_peer(..., against="store")``; the verdict is kept per segment, so
every later transfer costs a dictionary lookup. Under strict a pair that does not match, or that
cannot be judged (the peer published nothing, its manifest is truncated, forged, over the cap or
of another schema, the store cannot be read, a store safeview does not read), is refused before
the engine moves a byte; under warn it is an event and the transfer goes ahead. Only Mooncake's
HTTP metadata server (``http://...``) is read and written, each exchange whole within
``STORE_TIMEOUT_S``, never through a proxy, a redirect never followed (the pair is then not
judged, naming where it pointed): with ``P2PHANDSHAKE`` there is no store (the segment
descriptors travel in Mooncake's own RPC handshake, which safeview cannot extend), and etcd and
redis need clients safeview does not ship; those pairs are not judged, and say why.

Every other attribute is the engine's own. Mooncake is never imported here. An engine without
the methods this guard knows (Mooncake 0.3.13) gets one ``integration_unavailable`` event and is
returned as it is.
"""

from __future__ import annotations

import http.client
import io
import socket
import time
import urllib.parse
import warnings
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from importlib import metadata
from itertools import accumulate
from typing import TYPE_CHECKING, Any, NamedTuple, cast
from urllib.parse import quote

from safeview import log
from safeview.errors import FailureIgnoredError, LayoutMismatchError, ManifestError
from safeview.findings import Descriptor
from safeview.policy import Policy, PolicyArg, current_policy
from safeview.transfer import (
    Intent,
    MemoryMap,
    _check,
    _enforce,
    _intended,
    _Registered,
    memory_map,
)
from safeview.transfer.coverage import layers_in

if TYPE_CHECKING:
    from safeview.manifest import Derived, Manifest

__all__ = ["STORE_PREFIX", "GuardedEngine", "StoreAnswer", "guard", "store_key", "store_request"]

_NEEDS = (
    "register_memory",
    "unregister_memory",
    "transfer_sync_write",
    "transfer_sync_read",
    "batch_transfer_sync_write",
    "batch_transfer_sync_read",
)
_HOST = "DRAM"  # Mooncake's buffers are addresses of one process: one memory
_reported: set[str] = set()


def _version() -> str | None:
    for name in ("mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


#: where a guard keeps its engine's manifest in the metadata store: a sibling of Mooncake's own
#: ``mooncake/ram/<segment>`` and ``mooncake/rpc_meta/<segment>`` keys
STORE_PREFIX = "mooncake/safeview/"
#: a store that has not answered in whole within this long (connecting, headers and body: a
#: store sending a byte at a time is cut off too) leaves the pair not judged; it never holds a
#: transfer for longer (the first one to a segment only: the verdict is kept)
STORE_TIMEOUT_S = 3.0


def store_key(segment: str) -> str:
    """The key of the manifest of Mooncake segment ``segment`` (the local host name its engine
    was initialized with, ``"10.0.0.5:17001"``: the name a peer transfers to) in the metadata
    store: ``mooncake/safeview/<segment>``; its value is ``safeview.manifest.wire.to_wire``'s."""
    return STORE_PREFIX + segment


def _store_url(metadata_server: str, segment: str) -> str:
    """The URL of ``segment``'s manifest on Mooncake's HTTP metadata server, whose URL is the
    engine's metadata server string (``http://host:port/metadata``)."""
    joint = "&" if "?" in metadata_server else "?"
    return f"{metadata_server}{joint}key={quote(store_key(segment), safe='')}"


def _unread_store(metadata_server: str | None) -> str | None:
    """Why the manifests of ``metadata_server``'s segments cannot be read or written; ``None``
    for Mooncake's HTTP metadata server, the one store safeview reads."""
    if metadata_server is None:
        return (
            "the guard does not know the engine's metadata store: initialize the engine through "
            "the guard, or pass guard(..., metadata_server=..., segment=...)"
        )
    if metadata_server.startswith(("http://", "https://")):
        return None
    if metadata_server.upper().startswith("P2PHANDSHAKE"):
        return (
            "Mooncake's P2PHANDSHAKE mode keeps no metadata store: segment descriptors travel in "
            "its own RPC handshake, which safeview cannot extend"
        )
    scheme = metadata_server.split("://", 1)[0] if "://" in metadata_server else "etcd"
    return (
        f"the metadata store {metadata_server!r} ({scheme}) is not read by safeview: only "
        "Mooncake's HTTP metadata server (http://...) is"
    )


class StoreAnswer(NamedTuple):
    """A metadata store's answer: its status, its reason phrase, where a redirect points
    (``None`` for any other answer; a redirect is never followed) and its body (at most
    ``max_bytes + 1`` bytes of it: one past the caller's limit says there was more)."""

    status: int
    reason: str
    location: str | None
    body: bytes


class _Deadline:
    """A connected socket whose every send and receive waits at most for what is left of one
    deadline: the bound is the whole exchange's, not each read's."""

    def __init__(self, sock: socket.socket, deadline: float, timeout_s: float) -> None:
        self.sock, self.deadline, self.timeout_s = sock, deadline, timeout_s

    def arm(self) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no whole answer within {self.timeout_s:g} s")
        self.sock.settimeout(left)

    def sendall(self, data: bytes) -> None:
        self.arm()
        self.sock.sendall(data)

    def makefile(self, mode: str) -> io.BufferedReader:
        return io.BufferedReader(_DeadlineReader(self))

    def close(self) -> None:
        pass  # http.client closes its connection before its answer is read: store_request
        # closes the socket once it is done with both


class _DeadlineReader(io.RawIOBase):
    def __init__(self, owner: _Deadline) -> None:
        self.owner = owner

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        self.owner.arm()
        return self.owner.sock.recv_into(buffer)


class _Connection(http.client.HTTPConnection):
    """``http.client``'s connection over a ``_Deadline`` socket (TLS for ``https``)."""

    def __init__(self, parts: urllib.parse.SplitResult, deadline: float, timeout_s: float):
        tls = parts.scheme == "https"
        super().__init__(parts.hostname or "", parts.port or (443 if tls else 80), timeout_s)
        self.tls, self.deadline, self.timeout_s = tls, deadline, timeout_s
        self.connected: socket.socket | None = None

    def connect(self) -> None:
        left = max(self.deadline - time.monotonic(), 0.001)
        sock = socket.create_connection((self.host, self.port), left)
        if self.tls:
            import ssl

            sock = ssl.create_default_context().wrap_socket(sock, server_hostname=self.host)
        self.connected = sock
        self.sock = cast(socket.socket, _Deadline(sock, self.deadline, self.timeout_s))


def store_request(
    url: str,
    *,
    timeout_s: float,
    max_bytes: int,
    method: str = "GET",
    body: bytes | None = None,
) -> StoreAnswer:
    """One HTTP exchange with a metadata store at ``url`` (``http://`` or ``https://``), whole
    within ``timeout_s``: connecting, sending, the status line, the headers and the body all
    wait on one deadline, so a store that answers a byte at a time holds the caller no longer
    (urllib's timeout bounds each read, and a byte every half second renews it). Straight to
    the store: no proxy named in the environment (the engine reaches its store on the
    cluster's network), and a redirect is returned, never followed. ``TimeoutError`` past the
    deadline, another ``OSError`` when the store cannot be reached or does not answer HTTP,
    ``ValueError`` for a URL that is not one. Looking up a host name is the system resolver's
    work, which the deadline counts but cannot cut short (an address costs no lookup)."""
    parts = urllib.parse.urlsplit(url)
    parts.port  # noqa: B018 - raises ValueError for a port that is not one
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not an http:// or https:// URL")
    target = urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))
    connection = _Connection(parts, time.monotonic() + timeout_s, timeout_s)
    try:
        connection.request(method, target, body=body)
        with connection.getresponse() as answer:
            location = answer.getheader("Location") if 300 <= answer.status < 400 else None
            data = b"" if location is not None else answer.read(max_bytes + 1)
            return StoreAnswer(answer.status, answer.reason, location, data)
    except TimeoutError:  # the socket's own ("timed out") or the deadline's: one sentence
        raise TimeoutError(f"no whole answer within {timeout_s:g} s") from None
    except http.client.HTTPException as error:  # not HTTP: a bad status line, a cut answer
        raise ConnectionError(f"no whole HTTP answer ({type(error).__name__}: {error})") from None
    finally:
        if connection.connected is not None:
            connection.connected.close()


def _refused_answer(answer: StoreAnswer) -> str:
    """Why an answer other than 200 gives no manifest, in words."""
    if answer.location is not None:
        return (
            f"HTTP {answer.status}, a redirect to {answer.location!r}: not followed (a store "
            "answers where it is asked; a redirect could lead anywhere)"
        )
    return f"HTTP {answer.status} ({answer.reason})"


def _publish(metadata_server: str, segment: str, manifest: Manifest | Derived) -> None:
    """Put ``manifest``'s wire form under ``segment``'s key; a failure is an event (the engine
    works on: a peer that finds nothing says the pair was not judged)."""
    from safeview.manifest import wire

    if _unread_store(metadata_server) is not None:
        return  # its peers' guards say why the pair is not judged
    url = _store_url(metadata_server, segment)
    try:
        answer = store_request(
            url, timeout_s=STORE_TIMEOUT_S, max_bytes=0, method="PUT", body=wire.to_wire(manifest)
        )
        if not 200 <= answer.status < 300:
            raise OSError(_refused_answer(answer))
    except (OSError, ValueError, ManifestError) as error:
        log.integration(
            "integration_unavailable",
            integration="mooncake",
            reason=f"the manifest of segment {segment!r} was not published at {url}: {error}",
            version=_version(),
        )


def _fetch(metadata_server: str, segment: str) -> bytes | None:
    """The bytes under ``segment``'s key (at most one past the cap: ``from_wire`` refuses what
    is larger without the rest being read), ``None`` when the store holds none; ``OSError``
    when the store cannot be read within ``STORE_TIMEOUT_S``, or answers otherwise (a redirect
    included: it is not followed)."""
    from safeview.manifest.wire import WIRE_CAP_BYTES

    url = _store_url(metadata_server, segment)
    answer = store_request(url, timeout_s=STORE_TIMEOUT_S, max_bytes=WIRE_CAP_BYTES)
    if answer.status == 404:
        return None
    if answer.status != 200:
        raise OSError(_refused_answer(answer))
    return answer.body


def guard(
    engine: Any,
    registration: object,
    *,
    policy: PolicyArg | None = None,
    whole_pages: bool = True,
    layers: Intent = None,
    manifest: Manifest | Derived | None = None,
    metadata_server: str | None = None,
    segment: str | None = None,
) -> Any:
    """A proxy of ``engine`` (a Mooncake ``TransferEngine``) that checks each transfer's local
    rows against ``registration`` (what ``safeview.kv.block_views`` or
    ``safeview.vllm.check_registration`` returned, or a ``safeview.transfer.MemoryMap``) before
    the engine moves a byte; use it in the engine's place.

    Under strict a wrong row raises ``safeview.AddressError`` and the engine is not called;
    under warn each finding is an ``address_violation`` event and the call goes ahead; ``off``
    checks nothing. The policy is looked up at each call unless given here.
    ``whole_pages=False`` lets rows be slices of one page. ``layers``: which layer each local
    row of a batch is meant for, as for ``safeview.transfer.nixl.guard``.

    ``manifest`` (``safeview.describe`` or ``derive`` of the KV cache the registration holds,
    with its topology): published in the engine's metadata store under ``store_key(segment)``,
    and each peer segment judged against it before the first transfer from or to it (see the
    module's docstring). ``metadata_server`` and ``segment`` are the first two arguments the
    engine's ``initialize`` was given (its local host name and its metadata server string);
    an engine initialized through the guard needs neither.
    """
    memory = memory_map(registration)
    if isinstance(engine, GuardedEngine):
        engine._safeview_memory = memory
        engine._safeview_policy = policy
        engine._safeview_whole_pages = whole_pages
        engine._safeview_layers = layers
        engine._safeview_across(manifest, metadata_server, segment)
        return engine
    missing = [name for name in _NEEDS if not callable(getattr(engine, name, None))]
    if missing:
        reason = f"the engine ({type(engine).__name__}) has no {', '.join(missing)}"
        if reason not in _reported:
            _reported.add(reason)
            log.integration(
                "integration_unavailable",
                integration="mooncake",
                reason=reason,
                version=_version(),
            )
            warnings.warn(
                f"safeview.transfer.mooncake.guard left the engine unguarded: {reason}",
                RuntimeWarning,
                stacklevel=2,
            )
        return engine
    guarded = GuardedEngine(engine, memory, policy, whole_pages, layers)
    guarded._safeview_across(manifest, metadata_server, segment)
    return guarded


#: what a pair's verdict refuses under strict: the layouts differ, or it could not be judged
_Refusal = LayoutMismatchError | ManifestError


def _whole(manifest: Manifest | Derived) -> Manifest:
    """A ``Derived`` built into its ``Manifest`` (the judge compares manifests)."""
    from safeview.manifest import Derived

    return manifest.manifest() if isinstance(manifest, Derived) else manifest


def _argument(args: tuple[Any, ...], kwargs: dict[str, Any], position: int, name: str) -> Any:
    return args[position] if len(args) > position else kwargs[name]


#: batches remembered at most: a caller that never asks about its batches (it waits for the
#: peer's notification instead) costs a bounded memory and a bounded check per write
_MAX_BATCHES = 256
_UNCONFIRMED = (
    "(batch not confirmed: the engine returned its id and no get_batch_transfer_status of it "
    "has returned 0 yet)"
)


def _code(value: Any) -> int | None:
    """``value`` as a return code of the engine, or None where it is not an integer."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _merged(rows: Sequence[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """``rows`` ``(address, length)`` as sorted disjoint runs of bytes: their starts, their ends."""
    starts: list[int] = []
    ends: list[int] = []
    for address, length in sorted(rows):
        if length <= 0:
            continue
        if ends and address <= ends[-1]:  # overlapping or touching the run before: one run
            ends[-1] = max(ends[-1], address + length)
        else:
            starts.append(address)
            ends.append(address + length)
    return starts, ends


def _uncovered(
    address: int, length: int, runs: tuple[list[int], list[int]]
) -> list[tuple[int, int]]:
    """The bytes of ``[address, address + length)`` outside ``runs`` (from ``_merged``), as
    ``(address, length)`` pieces in order: found by bisection, a batch of thousands of rows
    against many marks stays cheap."""
    starts, ends = runs
    end = address + length
    pieces: list[tuple[int, int]] = []
    at = address
    index = bisect_right(ends, address)  # the first run that ends past the span's start
    while index < len(starts) and starts[index] < end:
        if starts[index] > at:
            pieces.append((at, starts[index] - at))
        at = max(at, ends[index])
        index += 1
    if at < end:
        pieces.append((at, end - at))
    return pieces


def _reads(opcode: Any) -> bool:
    """Whether a ``TransferOpcode`` is a read (its name is ``Read``)."""
    return str(getattr(opcode, "name", opcode)).lower().endswith("read")


class GuardedEngine:
    """A Mooncake transfer engine whose transfers are checked first; everything else is the
    engine's own (``engine`` is the engine itself)."""

    def __init__(
        self,
        engine: Any,
        memory: MemoryMap,
        policy: PolicyArg | None,
        whole_pages: bool,
        layers: Intent = None,
    ) -> None:
        self.engine = engine
        self._safeview_layers = layers
        self._safeview_memory = memory
        self._safeview_policy = policy
        self._safeview_whole_pages = whole_pages
        self._safeview_registered = _Registered("Mooncake transfer engine")
        # (address, length, the call, the status it returned) of failed registrations and reads
        self._safeview_failed_registrations: list[tuple[int, int, str, Any]] = []
        self._safeview_failed_reads: list[tuple[int, int, str, Any]] = []
        # batch id -> (the call that submitted it, its local rows, whether it reads), until the
        # engine reports its outcome (the engine frees the id then, and may hand it out again)
        self._safeview_batches: dict[int, tuple[str, list[tuple[int, int]], bool]] = {}
        # across machines: this engine's manifest, its store and segment, and the verdict on
        # each peer segment (target, reading, policy) -> the error strict raises, or None
        self._safeview_manifest: Manifest | None = None
        self._safeview_store: str | None = None
        self._safeview_segment: str | None = None
        self._safeview_peers: dict[tuple[str, bool, Policy], _Refusal | None] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def __repr__(self) -> str:
        return f"<safeview guard of {self.engine!r}>"

    # -- across machines: the peer's manifest, from the metadata store ----------------------

    def _safeview_across(
        self, manifest: Manifest | Derived | None, metadata_server: str | None, segment: str | None
    ) -> None:
        """Take this engine's manifest and where it lives; publish it when both are known."""
        if manifest is not None and not hasattr(manifest, "fingerprint"):
            raise ManifestError(
                "manifest", type(manifest).__name__, "is not a Manifest or Derived (describe)"
            )
        self._safeview_manifest = None if manifest is None else _whole(manifest)
        self._safeview_store = metadata_server or self._safeview_store
        self._safeview_segment = segment or self._safeview_segment
        self._safeview_peers.clear()
        self._safeview_publish()

    def _safeview_publish(self) -> None:
        mine, store, segment = (
            self._safeview_manifest, self._safeview_store, self._safeview_segment
        )  # fmt: skip
        if mine is not None and store is not None and segment is not None:
            _publish(store, segment, mine)

    def _initialized(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The engine's ``initialize`` (or ``_ext``): on success its local host name is the
        segment's name and its metadata server the store the manifest goes to."""
        result = getattr(self.engine, name)(*args, **kwargs)
        if result == 0:
            try:
                self._safeview_segment = str(_argument(args, kwargs, 0, "arg0"))
                self._safeview_store = str(_argument(args, kwargs, 1, "arg1"))
                self._safeview_peers.clear()
                self._safeview_publish()
            except Exception as error:  # safeview's own failure: the engine is initialized
                log.internal_error(where=f"safeview.transfer.mooncake guard, {name}", error=error)
        return result

    def initialize(self, *args: Any, **kwargs: Any) -> Any:
        return self._initialized("initialize", args, kwargs)

    def initialize_ext(self, *args: Any, **kwargs: Any) -> Any:
        return self._initialized("initialize_ext", args, kwargs)

    def _peer(self, args: tuple[Any, ...], kwargs: dict[str, Any], reading: bool) -> None:
        """Before a transfer with a peer segment: the pair's verdict (judged at the first
        transfer, then looked up); under strict a refusal is raised before the engine runs."""
        if self._safeview_manifest is None:
            return
        active = self._active()
        if active is Policy.OFF:
            return
        target = str(_argument(args, kwargs, 0, "target_hostname"))
        key = (target, reading, active)
        try:
            refusal = self._safeview_peers[key]
        except KeyError:
            try:
                refusal = self._judge_peer(target, reading, active)
            except Exception as error:  # safeview's own failure: the transfer goes on unjudged
                log.internal_error(where="safeview.transfer.mooncake guard, peer", error=error)
                refusal = None
            self._safeview_peers[key] = refusal
        if refusal is not None and active is Policy.STRICT:
            raise refusal

    def _judge_peer(self, target: str, reading: bool, active: Policy) -> _Refusal | None:
        """Read ``target``'s manifest from the store and judge the pair: one event; the error
        strict raises at each transfer with it (a mismatch, or why it could not be judged)."""
        from safeview.manifest import wire
        from safeview.manifest.peer import judge_peer

        mine = self._safeview_manifest
        assert mine is not None  # _peer judges only with a manifest
        store = self._safeview_store
        topology = mine.topology
        fields: dict[str, Any] = {
            "engine": topology.engine or self._safeview_segment,
            "tp_rank": topology.tp_rank,
            "tp_size": topology.tp_size,
            "remote_engine": target,
            "remote_tp_size": None,
            "when": "transfer",
            "fingerprint": mine.fingerprint,
            "manifests": [],
        }
        where = f"{target}: {store_key(target)}"
        reason = _unread_store(store)
        theirs: Manifest | None = None
        refusal: _Refusal | None = None
        if reason is None:
            assert store is not None  # _unread_store says why when it is None
            fields["manifests"] = [_store_url(store, target)]
            try:
                data = _fetch(store, target)
            except (OSError, ValueError) as error:
                reason = f"the metadata store could not be read ({error})"
            else:
                if data is None:
                    reason = (
                        "the peer published no manifest in the metadata store (safeview is "
                        "not on it, or its guard was given no manifest)"
                    )
                else:
                    try:
                        theirs = wire.from_wire(data, peer=where)
                    except ManifestError as error:
                        reason, refusal = str(error), error
        if theirs is not None:
            fields["remote_tp_size"] = theirs.topology.tp_size
            # the bytes go from the sender to the receiver: a read brings the peer's in
            sender, receiver = (theirs, mine) if reading else (mine, theirs)
            return judge_peer(receiver, [sender], against="store", fields=fields,
                              policy=active.value)  # fmt: skip
        judge_peer(mine, None, against="store", fields=fields, reason=reason, policy=active.value)
        if refusal is None:
            refusal = ManifestError(
                where, None, f"cannot be judged: {reason}; under strict such a pair is refused"
            )
        return refusal

    # -- checks ----------------------------------------------------------------------------

    def _active(self) -> Policy:
        return current_policy(self._safeview_policy)

    def _local(
        self, rows: Sequence[tuple[int, int]], active: Policy, source: str, writes: bool
    ) -> None:
        memory = self._safeview_memory
        _check(
            rows,
            memory,
            layers=_intended(self._safeview_layers, memory, len(rows)),
            whole_pages=self._safeview_whole_pages,
            writes=writes,
            active=active,
            source=source,
        )

    def _one(self, source: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        active = self._active()
        if active is not Policy.OFF:
            buffer = _argument(args, kwargs, 1, "buffer")
            length = _argument(args, kwargs, 3, "length")
            self._local([(buffer, length)], active, source, writes=False)

    def _batch(
        self, source: str, args: tuple[Any, ...], kwargs: dict[str, Any], reading: bool
    ) -> None:
        active = self._active()
        if active is Policy.OFF:
            return
        buffers = _argument(args, kwargs, 1, "buffers")
        peers = _argument(args, kwargs, 2, "peer_buffer_addresses")
        lengths = _argument(args, kwargs, 3, "lengths")
        local = list(zip(buffers, lengths))
        self._local(local, active, source, writes=reading)
        if not reading:
            _check(
                list(zip(peers, lengths)),
                None,
                writes=True,
                active=active,
                source=source + " (peer addresses)",
            )

    def _register(self, source: str, regions: list[Descriptor]) -> None:
        active = self._active()
        if active is not Policy.OFF:
            found = self._safeview_registered.overlapping([(_HOST, r) for r in regions])
            _enforce(found, active, source)

    # -- failures the engine reports by its return codes -----------------------------------

    def _local_rows(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], batch: bool
    ) -> list[tuple[int, int]]:
        if batch:
            buffers = _argument(args, kwargs, 1, "buffers")
            lengths = _argument(args, kwargs, 3, "lengths")
            return [(int(b), int(n)) for b, n in zip(buffers, lengths)]
        return [
            (int(_argument(args, kwargs, 1, "buffer")), int(_argument(args, kwargs, 3, "length")))
        ]

    def _depends(
        self, source: str, rows: list[tuple[int, int]], reading: bool, active: Policy
    ) -> None:
        """Refuse (strict) or report (warn) a call whose local bytes an earlier failure left
        unusable: memory whose registration failed (and no later one succeeded), or, for a
        write, bytes whose read failed (and no later read of those bytes succeeded) or whose
        asynchronous read was never confirmed (``failed`` says so, ``status`` is the batch id)."""
        failures = self._unregistered()
        if not reading:
            failures += self._safeview_failed_reads
            failures += [
                (address, length, f"{call} {_UNCONFIRMED}", batch_id)
                for batch_id, (call, spans, reads) in list(self._safeview_batches.items())
                if reads
                for address, length in spans
            ]
        if not failures:
            return
        # many batches may be in flight: find a row's overlap by bisection, not pair by pair
        failures.sort(key=lambda failure: failure[0])
        starts = [failure[0] for failure in failures]
        reach = list(accumulate((low + size for low, size, _, _ in failures), max))
        for address, length in rows:
            last = bisect_left(starts, address + length) - 1  # the failures starting before its end
            if last < 0 or reach[last] <= address:
                continue
            for low, size, failed, status in reversed(failures[: last + 1]):
                if address < low + size:
                    layers = layers_in(self._safeview_memory, [(address, length)])
                    strict = active is Policy.STRICT
                    log.failure_ignored(
                        source=source, failed=failed, status=status, address=address,
                        length=length, layers=layers, strict=strict, policy=active.value,
                    )  # fmt: skip
                    if strict:
                        raise FailureIgnoredError(
                            source=source, failed=failed, status=status, address=address,
                            length=length, layers=layers, policy=active.value,
                        )  # fmt: skip
                    return

    def _unregistered(self) -> list[tuple[int, int, str, Any]]:
        """The bytes of failed registrations that no registration made since holds: one later
        registration of the whole, or several of its parts (a layer at a time), clear them."""
        failed = self._safeview_failed_registrations
        if not failed:
            return []
        registered = _merged(
            [
                (region.address, region.length_bytes)
                for _, region in self._safeview_registered.regions
            ]
        )
        return [
            (low, size, call, status)
            for address, length, call, status in failed
            for low, size in _uncovered(address, length, registered)
        ]

    def _outcome(self, source: str, rows: list[tuple[int, int]], reading: bool, status: Any) -> Any:
        """After the engine returned ``status``: a failure is a ``transfer_failed`` event (the
        status reaches the caller unchanged); a read's outcome marks or clears its bytes."""
        active = self._active()
        if active is Policy.OFF:
            return status
        code = _code(status)
        failed = code is not None and code < 0
        if failed:
            self._failed(source, rows, status, active)
        if reading:
            self._read(source, rows, status, failed)
        return status

    def _failed(
        self, source: str, rows: list[tuple[int, int]], status: Any, active: Policy
    ) -> None:
        log.engine_failed(
            "transfer_failed", source=source, engine="Mooncake transfer engine", status=status,
            layers=layers_in(self._safeview_memory, rows), regions=rows, policy=active.value,
        )  # fmt: skip

    def _read(self, call: str, rows: list[tuple[int, int]], status: Any, failed: bool) -> None:
        """How a read of ``rows`` by ``call`` ended: the latest word on its bytes, it clears
        earlier marks (failed or unconfirmed) byte by byte, whatever rows they were read in (a
        retry page by page of a failed run of pages clears the run; one of part of it, that
        part), and marks them failed if it failed."""
        read = _merged(rows)
        self._safeview_failed_reads = [
            (low, size, earlier, code)
            for address, length, earlier, code in self._safeview_failed_reads
            for low, size in _uncovered(address, length, read)
        ]
        for batch_id, (submitted, pending, reads) in list(self._safeview_batches.items()):
            if reads:
                kept = [piece for a, n in pending for piece in _uncovered(a, n, read)]
                if kept != pending:
                    self._safeview_batches[batch_id] = (submitted, kept, reads)
        if failed:
            self._safeview_failed_reads += [(a, n, call, status) for a, n in rows]

    def _submitted(
        self, source: str, rows: list[tuple[int, int]], reading: bool, batch_id: Any
    ) -> None:
        """After an asynchronous submit: 0 is a failure (judged as a failed transfer); any other
        id is remembered, its outcome unknown until the engine reports it."""
        active = self._active()
        if active is Policy.OFF or _code(batch_id) is None:
            return
        if batch_id == 0:
            self._failed(source, rows, batch_id, active)
            if reading:
                self._read(source, rows, batch_id, failed=True)
        else:
            batches = self._safeview_batches
            batches.pop(int(batch_id), None)  # an id the engine handed out again: the newest
            batches[int(batch_id)] = (source, rows, reading)
            if len(batches) > _MAX_BATCHES:  # never asked about: the oldest is forgotten
                del batches[next(iter(batches))]

    def _reported(self, source: str, batch_ids: list[Any], status: Any) -> None:
        """The engine reported, by ``source``, that ``batch_ids`` ended with ``status``: negative,
        all of them failed (Mooncake does not say which); otherwise all succeeded."""
        known = {b for b in (_code(b) for b in batch_ids) if b is not None}
        batches = [
            self._safeview_batches.pop(b) for b in sorted(known & set(self._safeview_batches))
        ]
        active = self._active()
        if not batches or active is Policy.OFF:
            return
        code = _code(status)
        failed = code is not None and code < 0
        if failed:
            self._failed(source, [row for _, rows, _ in batches for row in rows], status, active)
        for call, rows, reads in batches:
            if reads:
                self._read(call, rows, status, failed)

    def _status(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Call the engine's ``name`` (a query of batches), then learn what it reported."""
        result = getattr(self.engine, name)(*args, **kwargs)
        code = _code(result)
        try:
            ids = _argument(args, kwargs, 0, "arg0")
            if name == "get_batch_transfer_status":  # 0: all succeeded; negative: one failed
                if code is not None and code <= 0:
                    self._reported(f"mooncake.{name}", list(ids), result)
            elif code:  # transfer_check_status: 1 succeeded, negative failed, 0 still running
                self._reported(f"mooncake.{name}", [ids], result)
        except Exception as error:  # safeview's own failure: the engine's result stands
            log.internal_error(
                where=f"safeview.transfer.mooncake guard, mooncake.{name}", error=error
            )
        return result

    def _transfer(
        self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], *, batch: bool,
        reading: bool | None = None, status: bool = True,
    ) -> Any:  # fmt: skip
        """Check, call the engine's ``name``, and judge what it returned (``status=False``: an
        asynchronous call, whose return value is a batch id, not a status)."""
        source = f"mooncake.{name}"
        if reading is None:
            reading = _reads(_argument(args, kwargs, 4, "opcode"))
        self._peer(args, kwargs, reading)
        if batch:
            self._batch(source, args, kwargs, reading=reading)
        else:
            self._one(source, args, kwargs)
        active = self._active()
        rows: list[tuple[int, int]] = []
        if active is not Policy.OFF:
            rows = self._local_rows(args, kwargs, batch)
            self._depends(source, rows, reading, active)
        result = getattr(self.engine, name)(*args, **kwargs)
        if rows:
            try:
                if status:
                    self._outcome(source, rows, reading, result)
                else:
                    self._submitted(source, rows, reading, result)
            except Exception as error:  # safeview's own failure: the engine's result stands
                log.internal_error(where=f"safeview.transfer.mooncake guard, {source}", error=error)
        return result

    # -- the engine's methods, checked ----------------------------------------------------

    def transfer_sync_write(self, *args: Any, **kwargs: Any) -> Any:
        return self._transfer("transfer_sync_write", args, kwargs, batch=False, reading=False)

    def transfer_sync_read(self, *args: Any, **kwargs: Any) -> Any:
        return self._transfer("transfer_sync_read", args, kwargs, batch=False, reading=True)

    def transfer_sync(self, *args: Any, **kwargs: Any) -> Any:
        return self._transfer("transfer_sync", args, kwargs, batch=False)

    def transfer_submit_write(self, *args: Any, **kwargs: Any) -> Any:
        return self._transfer(
            "transfer_submit_write", args, kwargs, batch=False, reading=False, status=False
        )

    def batch_transfer_sync_write(self, *args: Any, **kwargs: Any) -> Any:
        return self._transfer("batch_transfer_sync_write", args, kwargs, batch=True, reading=False)

    def batch_transfer_sync_read(self, *args: Any, **kwargs: Any) -> Any:
        return self._transfer("batch_transfer_sync_read", args, kwargs, batch=True, reading=True)

    def batch_transfer_async_write(self, *args: Any, **kwargs: Any) -> Any:
        return self._transfer(
            "batch_transfer_async_write", args, kwargs, batch=True, reading=False, status=False
        )

    def batch_transfer_async_read(self, *args: Any, **kwargs: Any) -> Any:
        return self._transfer(
            "batch_transfer_async_read", args, kwargs, batch=True, reading=True, status=False
        )

    def batch_transfer_sync(self, *args: Any, **kwargs: Any) -> Any:
        return self._transfer("batch_transfer_sync", args, kwargs, batch=True)

    def batch_transfer_async(self, *args: Any, **kwargs: Any) -> Any:
        return self._transfer("batch_transfer_async", args, kwargs, batch=True, status=False)

    # the outcome of asynchronous calls: the engine's answer reaches the caller unchanged
    def get_batch_transfer_status(self, *args: Any, **kwargs: Any) -> Any:
        return self._status("get_batch_transfer_status", args, kwargs)

    def transfer_check_status(self, *args: Any, **kwargs: Any) -> Any:
        return self._status("transfer_check_status", args, kwargs)

    def _registration(self, source: str, regions: list[Descriptor], status: Any) -> None:
        """After a registration: on success remember its regions; on a failure status, an event
        and the regions as failed (a later transfer from them depends on it)."""
        if status == 0:
            self._safeview_registered.add((_HOST, r) for r in regions)
            return
        active = self._active()
        if active is Policy.OFF:
            return
        spans = [(r.address, r.length_bytes) for r in regions]
        log.engine_failed(
            "registration_failed", source=source, engine="Mooncake transfer engine",
            status=status, layers=layers_in(self._safeview_memory, spans), regions=spans,
            policy=active.value,
        )  # fmt: skip
        self._safeview_failed_registrations += [(a, n, source, status) for a, n in spans if n]

    def register_memory(self, *args: Any, **kwargs: Any) -> Any:
        address = _argument(args, kwargs, 0, "buffer_addr")
        capacity = _argument(args, kwargs, 1, "capacity")
        regions = [Descriptor(0, int(address), int(capacity))]
        self._register("mooncake.register_memory", regions)
        result = self.engine.register_memory(*args, **kwargs)
        self._registration("mooncake.register_memory", regions, result)
        return result

    def batch_register_memory(self, *args: Any, **kwargs: Any) -> Any:
        addresses = _argument(args, kwargs, 0, "buffer_addresses")
        capacities = _argument(args, kwargs, 1, "capacities")
        regions = [
            Descriptor(index, int(address), int(capacity))
            for index, (address, capacity) in enumerate(zip(addresses, capacities))
        ]
        self._register("mooncake.batch_register_memory", regions)
        result = self.engine.batch_register_memory(*args, **kwargs)
        self._registration("mooncake.batch_register_memory", regions, result)
        return result

    def unregister_memory(self, *args: Any, **kwargs: Any) -> Any:
        address = _argument(args, kwargs, 0, "arg0")
        result = self.engine.unregister_memory(*args, **kwargs)
        if result == 0:
            self._safeview_registered.remove(_HOST, Descriptor(0, int(address), 0), any_length=True)
        return result

    def batch_unregister_memory(self, *args: Any, **kwargs: Any) -> Any:
        addresses = _argument(args, kwargs, 0, "arg0")
        result = self.engine.batch_unregister_memory(*args, **kwargs)
        if result == 0:
            for address in addresses:
                self._safeview_registered.remove(
                    _HOST, Descriptor(0, int(address), 0), any_length=True
                )
        return result
