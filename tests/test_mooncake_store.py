"""Across machines with Mooncake: the sender's layout manifest travels in the metadata store its
transfer engine already uses, and the receiver's guard judges the pair before its first transfer.

Real engines only: Mooncake's own HTTP metadata server (``mooncake.http_metadata_server``, from
its wheel) in a process of its own, a sender engine in another process (it publishes its
manifest through the guard, or, without safeview, nothing), and the receiver engine in this
one, over TCP on 127.0.0.1. The store is a separate process because the engine's ``initialize``
holds the interpreter while it writes to the store (measured: a server thread in the same
process never answers, and the engine gives up after 3 s).

Without Mooncake installed the tests skip, saying so; with ``SAFEVIEW_REQUIRE_ENGINES=1`` (as CI
sets it) a missing engine is a failure instead.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import math
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import pytest
import torch

from safeview import LayoutMismatchError, ManifestError
from safeview.kv import block_views
from safeview.manifest import describe
from safeview.manifest.wire import WIRE_CAP_BYTES, WIRE_SCHEMA, from_wire
from safeview.testing import capture_events
from safeview.transfer import mooncake

INSTALL = (
    "Mooncake is not installed here (apt-get install libibverbs1; "
    "pip install mooncake-transfer-engine-non-cuda==0.3.13.post1)"
)

BLOCKS, HEADS, TOKENS, DIM = 8, 4, 16, 8
PAGE = HEADS * TOKENS * DIM  # int8: bytes
LAYERS = 2
NBYTES = LAYERS * BLOCKS * PAGE
AXES = ("block", "head", "token", "element")
PolicyName = Literal["strict", "warn"]


def _caches(flat: torch.Tensor, page_shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """Two contiguous layers of ``flat``, each ``(blocks, *page_shape)``: as many blocks as
    pages of that shape fill a layer."""
    layer = NBYTES // LAYERS
    return {
        f"layers.{n}": flat[n * layer : (n + 1) * layer].view(-1, *page_shape)
        for n in range(LAYERS)
    }


def _sent_bytes() -> torch.Tensor:
    return (torch.arange(NBYTES) % 251 + 1).to(torch.int8)


def _sender(url: str, segment: str, mode: str) -> None:
    """A sender engine in its own process: initialized (through the guard, which publishes its
    manifest, unless ``mode`` is ``plain``), its KV cache registered; prints its address, then
    serves until its standard input closes."""
    from mooncake.engine import TransferEngine

    kv = _sent_bytes()
    caches = _caches(kv, (HEADS, TOKENS, DIM))
    engine: Any = TransferEngine()
    if mode == "safeview":
        registration = block_views(caches, dict.fromkeys(caches, PAGE), num_blocks=BLOCKS)
        manifest = describe(caches, axes=AXES, topology={"engine": "prefill"})
        engine = mooncake.guard(engine, registration, manifest=manifest)
    assert engine.initialize(segment, url, "tcp", "") == 0
    assert engine.register_memory(kv.data_ptr(), NBYTES) == 0
    print("READY", kv.data_ptr(), flush=True)
    sys.stdin.read()
    os._exit(0)  # the engine's threads are not joined at exit: end here


if __name__ == "__main__":
    _sender(*sys.argv[1:])

if os.environ.get("SAFEVIEW_REQUIRE_ENGINES") == "1":
    from mooncake.engine import TransferEngine  # an ImportError fails the run, as in CI
else:
    TransferEngine = pytest.importorskip("mooncake.engine", reason=INSTALL).TransferEngine


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _key_url(url: str, segment: str) -> str:
    return f"{url}?key={mooncake.store_key(segment)}"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Mooncake's HTTP metadata server, from its wheel, in a process of its own."""
    port = _free_port()
    log = tmp_path_factory.mktemp("store") / "server.log"
    with log.open("wb") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "mooncake.http_metadata_server", "--host", "127.0.0.1",
             "--port", str(port), "--log-level", "WARNING"],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}/metadata"
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(f"{url}?key=probe", timeout=1).close()
        except urllib.error.HTTPError as answer:
            answer.close()
            break  # 404 for a key nobody put: it answers
        except OSError:
            assert server.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the metadata server did not start in 30 s"
            time.sleep(0.1)
    yield url
    server.terminate()
    server.wait(timeout=10)


class Sender:
    """A sender engine in another process, named ``segment`` in the store."""

    def __init__(self, url: str, mode: str, folder: Path) -> None:
        self.segment = f"127.0.0.1:{_free_port()}"
        self.log = folder / f"sender-{mode}.log"
        with self.log.open("wb") as errors:
            self.process = subprocess.Popen(
                [sys.executable, __file__, url, self.segment, mode],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors, text=True,
            )  # fmt: skip

    def ready(self) -> int:
        """The address of the sender's KV cache, once it serves."""
        assert self.process.stdout is not None
        line = self.process.stdout.readline().split()
        assert line[:1] == ["READY"], self.log.read_text()[-3000:]
        return int(line[1])

    def stop(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(timeout=30)
        if self.process.stdout is not None:
            self.process.stdout.close()


@pytest.fixture(scope="module")
def senders(store: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """One sender with safeview (it published its manifest) and one without (it published
    nothing), started side by side."""
    folder = tmp_path_factory.mktemp("senders")
    started = {mode: Sender(store, mode, folder) for mode in ("safeview", "plain")}
    try:
        found = {mode: (sender.segment, sender.ready()) for mode, sender in started.items()}
        yield found
    finally:
        for sender in started.values():
            sender.stop()


class Receiver:
    """A receiver engine in this process with its own manifest: ``page_shape`` is how it lays
    out (or assumes) a page; its guard reads peers' manifests from ``store``."""

    def __init__(
        self,
        store: str,
        page_shape: tuple[int, ...] = (HEADS, TOKENS, DIM),
        axes: tuple[str, ...] = AXES,
        policy: PolicyName = "strict",
        guard_store: str | None = None,
    ) -> None:
        self.engine = TransferEngine()
        self.segment = f"127.0.0.1:{_free_port()}"
        assert self.engine.initialize(self.segment, store, "tcp", "") == 0
        self.destination = torch.zeros(NBYTES, dtype=torch.int8)
        caches = _caches(self.destination, page_shape)
        page = math.prod(page_shape)  # int8: bytes
        blocks = NBYTES // LAYERS // page
        registration = block_views(caches, dict.fromkeys(caches, page), num_blocks=blocks)
        self.manifest = describe(caches, axes=axes, topology={"engine": "decode"})
        # initialized before it was guarded: the guard is told the store and the segment
        self.guarded = mooncake.guard(
            self.engine, registration, policy=policy, manifest=self.manifest,
            metadata_server=guard_store or store, segment=self.segment,
        )  # fmt: skip
        assert self.engine.register_memory(self.destination.data_ptr(), NBYTES) == 0

    def read(self, segment: str, address: int) -> Any:
        return _read_all(self.guarded, segment, self.destination, address)


def _read_all(engine: Any, segment: str, destination: torch.Tensor, address: int) -> Any:
    """Read the sender's whole cache at ``address`` into ``destination``, a row per layer."""
    layer = NBYTES // LAYERS
    at = [n * layer for n in range(LAYERS)]
    base = destination.data_ptr()
    return engine.batch_transfer_sync_read(
        segment, [base + a for a in at], [address + a for a in at], [layer] * LAYERS
    )


def _layout_events(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] in ("layout_checked", "layout_mismatch")]


def test_the_sender_publishes_its_manifest_next_to_its_segment(store: str, senders: Any) -> None:
    segment, _ = senders["safeview"]
    with urllib.request.urlopen(_key_url(store, segment), timeout=5) as answer:
        published = answer.read()
    manifest = from_wire(published, peer=segment)
    expected = describe(
        _caches(_sent_bytes(), (HEADS, TOKENS, DIM)), axes=AXES, topology={"engine": "prefill"}
    )
    assert manifest.fingerprint == expected.fingerprint
    assert json.loads(published)["$schema"] == WIRE_SCHEMA
    # Mooncake's own segment descriptor is its sibling in the same store
    ram = f"{store}?key=mooncake/ram/{segment}"
    with urllib.request.urlopen(ram, timeout=5) as answer:
        assert json.loads(answer.read())["name"] == segment
    # without safeview: nothing under the key
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(_key_url(store, senders["plain"][0]), timeout=5)
    missing.value.close()
    assert missing.value.code == 404


def test_a_matching_pair_is_judged_from_the_store_and_moves_byte_identical(
    store: str, senders: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    segment, address = senders["safeview"]
    receiver = Receiver(store)
    reads: list[str] = []
    fetch = mooncake._fetch

    def counted(server: str, peer: str) -> bytes | None:
        reads.append(peer)
        return fetch(server, peer)

    monkeypatch.setattr(mooncake, "_fetch", counted)
    with capture_events() as events:
        assert receiver.read(segment, address) == 0
        assert receiver.read(segment, address) == 0
    assert torch.equal(receiver.destination, _sent_bytes())
    # judged once, before the first transfer; the second is a lookup (the store is not read)
    assert reads == [segment]
    (checked,) = _layout_events(events)
    assert checked["event"] == "layout_checked"
    assert checked["verdict"] == "compatible"
    assert checked["against"] == "store"
    assert checked["remote_engine"] == segment
    assert checked["engine"] == "decode"
    assert checked["fingerprint"] == receiver.manifest.fingerprint
    assert checked["when"] == "transfer"
    assert checked["remote_fingerprints"] == [
        from_wire(urllib.request.urlopen(_key_url(store, segment)).read(), peer="x").fingerprint
    ]


@pytest.mark.parametrize(
    ("what", "page_shape", "axes"),
    [
        ("another head order", (TOKENS, HEADS, DIM), ("block", "token", "head", "element")),
        ("another page size", (HEADS, TOKENS // 2, DIM), AXES),
    ],
)
def test_a_mismatching_layout_is_refused_under_strict_before_the_first_transfer(
    store: str, senders: Any, what: str, page_shape: tuple[int, ...], axes: tuple[str, ...]
) -> None:
    segment, address = senders["safeview"]
    receiver = Receiver(store, page_shape, axes)
    with capture_events() as events:
        with pytest.raises(LayoutMismatchError) as refused:
            receiver.read(segment, address)
        with pytest.raises(LayoutMismatchError):  # and every transfer after it
            receiver.read(segment, address)
    assert not receiver.destination.any(), "a byte moved"
    assert refused.value.layer == "layers.0"
    (mismatch,) = _layout_events(events)
    assert mismatch["event"] == "layout_mismatch"
    assert mismatch["action"] == "refused"
    assert mismatch["against"] == "store"
    assert mismatch["remote_engine"] == segment
    assert mismatch["verdict"] == "mismatch"


def test_a_mismatching_layout_is_reported_under_warn_and_moves(store: str, senders: Any) -> None:
    segment, address = senders["safeview"]
    receiver = Receiver(
        store, (TOKENS, HEADS, DIM), ("block", "token", "head", "element"), policy="warn"
    )
    with capture_events() as events:
        assert receiver.read(segment, address) == 0
        assert receiver.read(segment, address) == 0
    assert torch.equal(receiver.destination, _sent_bytes())  # moved, as without safeview
    (mismatch,) = _layout_events(events)  # one event per pair, not per transfer
    assert mismatch["event"] == "layout_mismatch"
    assert mismatch["action"] == "none"
    assert mismatch["against"] == "store"
    assert mismatch["level"] == "warning"
    assert "token" in mismatch["message"]


def _forged(published: bytes) -> bytes:
    """The sender's manifest with one layer renamed and its fingerprint kept."""
    document = json.loads(published)
    document["layers"][0][0] = document["layers"][0][0].replace("0", "7")
    return json.dumps(document).encode()


def _other_schema(published: bytes) -> bytes:
    document = json.loads(published)
    document["$schema"] = WIRE_SCHEMA.replace(":1", ":2")
    return json.dumps(document).encode()


BAD: dict[str, tuple[Callable[[bytes], bytes], str]] = {
    "truncated": (lambda published: published[: len(published) // 2], "is not JSON"),
    "forged": (_forged, "fingerprint"),
    "over the cap": (lambda published: b" " * (WIRE_CAP_BYTES + 1) + published, "WIRE_CAP"),
    "another schema": (_other_schema, "$schema"),
}


@pytest.mark.parametrize("bad", sorted(BAD))
def test_a_bad_manifest_in_the_store_is_a_typed_refusal(store: str, senders: Any, bad: str) -> None:
    """The plain sender's key is given a bad manifest (what a broken or hostile writer of the
    store could put there): a ``ManifestError`` naming the peer and the field, never a
    traceback of another kind, never compatible."""
    good, _ = senders["safeview"]
    segment, address = senders["plain"]
    published = urllib.request.urlopen(_key_url(store, good), timeout=5).read()
    make, field = BAD[bad]
    put = urllib.request.Request(_key_url(store, segment), data=make(published), method="PUT")
    urllib.request.urlopen(put, timeout=5).read()
    try:
        receiver = Receiver(store)
        with capture_events() as events, pytest.raises(ManifestError) as refused:
            receiver.read(segment, address)
        assert not receiver.destination.any(), "a byte moved"
        assert segment in str(refused.value)
        assert field in str(refused.value)
        (checked,) = _layout_events(events)
        assert checked["verdict"] == "not_judged"
        assert checked["against"] == "store"
        assert segment in checked["reason"]
        assert field in checked["reason"]
        # under warn: the event, and the transfer goes ahead as without safeview
        warned = Receiver(store, policy="warn")
        with capture_events() as events:
            assert warned.read(segment, address) == 0
        assert torch.equal(warned.destination, _sent_bytes())
        assert [e["verdict"] for e in _layout_events(events)] == ["not_judged"]
    finally:
        delete = urllib.request.Request(_key_url(store, segment), method="DELETE")
        urllib.request.urlopen(delete, timeout=5).read()


def test_a_sender_without_safeview_is_not_judged(store: str, senders: Any) -> None:
    segment, address = senders["plain"]
    warned = Receiver(store, policy="warn")
    with capture_events() as events:
        assert warned.read(segment, address) == 0
    assert torch.equal(warned.destination, _sent_bytes())  # works as without safeview
    (checked,) = _layout_events(events)
    assert checked["verdict"] == "not_judged"
    assert checked["against"] == "store"
    assert "published no manifest" in checked["reason"]
    # under strict a pair that cannot be judged is refused, before a byte moves
    strict = Receiver(store)
    with pytest.raises(ManifestError, match="published no manifest") as refused:
        strict.read(segment, address)
    assert segment in str(refused.value)
    assert not strict.destination.any()


def test_a_receiver_without_a_manifest_reads_nothing_from_the_store(
    store: str, senders: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The guard without ``manifest=`` is the 0.4 guard (no store read, no layout event), and
    an engine without safeview reads from a sender that published its manifest as from any:
    safeview's key does not disturb Mooncake."""
    engine = TransferEngine()
    assert engine.initialize(f"127.0.0.1:{_free_port()}", store, "tcp", "") == 0
    destination = torch.zeros(NBYTES, dtype=torch.int8)
    caches = _caches(destination, (HEADS, TOKENS, DIM))
    guarded = mooncake.guard(
        engine, block_views(caches, dict.fromkeys(caches, PAGE), num_blocks=BLOCKS),
        policy="strict",
    )  # fmt: skip
    assert engine.register_memory(destination.data_ptr(), NBYTES) == 0
    monkeypatch.setattr(mooncake, "_fetch", lambda *_: pytest.fail("the store was read"))
    for mode, reader in (("plain", guarded), ("safeview", guarded), ("safeview", engine)):
        segment, address = senders[mode]
        destination.zero_()
        with capture_events() as events:
            assert _read_all(reader, segment, destination, address) == 0
        assert torch.equal(destination, _sent_bytes())
        assert not _layout_events(events)


def test_p2phandshake_has_no_store_the_pair_is_not_judged_and_says_why() -> None:
    """With ``P2PHANDSHAKE`` Mooncake keeps no store: nothing to publish to or read from."""
    local, remote = TransferEngine(), TransferEngine()
    for engine in (local, remote):
        assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    kv = _sent_bytes()
    destination = torch.zeros(NBYTES, dtype=torch.int8)
    caches = _caches(destination, (HEADS, TOKENS, DIM))
    manifest = describe(caches, axes=AXES)
    registration = block_views(caches, dict.fromkeys(caches, PAGE), num_blocks=BLOCKS)
    peer = f"127.0.0.1:{remote.get_rpc_port()}"
    assert remote.register_memory(kv.data_ptr(), NBYTES) == 0
    policies: tuple[PolicyName, ...] = ("warn", "strict")
    for policy in policies:
        guarded = mooncake.guard(
            local, registration, policy=policy, manifest=manifest,
            metadata_server="P2PHANDSHAKE", segment="127.0.0.1",
        )  # fmt: skip
        with capture_events() as events:
            if policy == "strict":
                with pytest.raises(ManifestError, match="P2PHANDSHAKE"):
                    _read_all(guarded, peer, destination, kv.data_ptr())
                assert not destination.any()
            else:
                assert local.register_memory(destination.data_ptr(), NBYTES) == 0
                assert _read_all(guarded, peer, destination, kv.data_ptr()) == 0
                assert torch.equal(destination, kv)
                destination.zero_()
        (checked,) = _layout_events(events)
        assert checked["verdict"] == "not_judged"
        assert "P2PHANDSHAKE" in checked["reason"]


class _Store(http.server.BaseHTTPRequestHandler):
    """A store's stand-in on 127.0.0.1 that takes every PUT (the receiver's own manifest) and
    answers a GET as its server's ``answer`` says: ``trickle``, a byte every half second of a
    megabyte it promises, for 20 s; ``redirect``, a 302 to ``location``."""

    server: Any

    def do_PUT(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self) -> None:
        if self.server.answer == "redirect":
            self.send_response(302)
            self.send_header("Location", self.server.location)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Length", str(1 << 20))
        self.end_headers()
        ends = time.monotonic() + 20  # a read that is not bounded fails the test, never hangs
        while not self.server.stopping.wait(0.5) and time.monotonic() < ends:
            try:
                self.wfile.write(b"{")
                self.wfile.flush()
            except OSError:  # the reader gave up, as a bounded read does
                return

    def log_message(self, *args: Any) -> None:
        pass


@contextlib.contextmanager
def _store_that(answer: str, location: str = "") -> Iterator[str]:
    """The ``/metadata`` URL of a ``_Store`` that answers GETs as ``answer`` says."""
    server: Any = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Store)
    server.answer, server.location, server.stopping = answer, location, threading.Event()
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/metadata"
    finally:
        server.stopping.set()
        server.shutdown()
        server.server_close()


def test_a_store_that_trickles_its_answer_is_given_up_within_store_timeout_s(
    store: str, senders: Any
) -> None:
    """``STORE_TIMEOUT_S`` bounds the whole read, not each of its reads: a store that sends a
    byte every half second (each renewing a per-read timeout) holds the first transfer no
    longer, and the pair is not judged, saying why; under strict, no byte moves."""
    segment, address = senders["safeview"]
    with _store_that("trickle") as slow:
        receiver = Receiver(store, guard_store=slow)
        started = time.monotonic()
        with capture_events() as events, pytest.raises(ManifestError) as refused:
            receiver.read(segment, address)
        elapsed = time.monotonic() - started
    assert mooncake.STORE_TIMEOUT_S <= elapsed < mooncake.STORE_TIMEOUT_S + 2, elapsed
    assert not receiver.destination.any(), "a byte moved"
    assert "no whole answer within 3 s" in str(refused.value)
    (checked,) = _layout_events(events)
    assert checked["verdict"] == "not_judged"
    assert "could not be read (no whole answer within 3 s)" in checked["reason"]


def test_a_store_that_redirects_is_not_followed(store: str, senders: Any) -> None:
    """A redirect, even to the very key on the real store (where the sender's manifest is, and
    a matching pair would be judged compatible), is not followed: the pair is not judged, the
    reason names the redirect, and strict refuses the transfer."""
    segment, address = senders["safeview"]
    with _store_that("redirect", _key_url(store, segment)) as moved:
        receiver = Receiver(store, guard_store=moved)
        with capture_events() as events, pytest.raises(ManifestError) as refused:
            receiver.read(segment, address)
    assert not receiver.destination.any(), "a byte moved"
    (checked,) = _layout_events(events)
    assert checked["verdict"] == "not_judged"
    assert (
        f"HTTP 302, a redirect to {_key_url(store, segment)!r}: not followed" in (checked["reason"])
    )
    assert "redirect" in str(refused.value)
