"""The Mooncake guard against the real engine: two transfer engines over TCP on 127.0.0.1, with
the ``P2PHANDSHAKE`` metadata mode, in this process, transferring for real.

Without Mooncake installed (``mooncake-transfer-engine-non-cuda``, which needs Debian's
``libibverbs1``) the tests skip, saying so; with ``SAFEVIEW_REQUIRE_ENGINES=1`` (as CI sets it)
a missing engine is a failure instead.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from itertools import pairwise
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import safeview
from safeview import AddressError
from safeview.kv import block_views
from safeview.testing import capture_events
from safeview.transfer import MemoryMap, StorageSpan, ViewSpan
from safeview.transfer import mooncake as guard_module

if os.environ.get("SAFEVIEW_REQUIRE_ENGINES") == "1":
    from mooncake.engine import TransferEngine  # an ImportError fails the run, as in CI
else:
    engine_module = pytest.importorskip(
        "mooncake.engine",
        reason="Mooncake is not installed here (apt-get install libibverbs1; "
        "pip install mooncake-transfer-engine-non-cuda==0.3.13.post1)",
    )
    TransferEngine = engine_module.TransferEngine

PAGE = 256
BLOCKS = 8
LAYERS = 2


class Pair:
    """Two engines, a KV cache of two contiguous layers on the first, a destination on the
    second, and the guard of the first."""

    def __init__(self) -> None:
        self.local, self.remote = TransferEngine(), TransferEngine()
        for engine in (self.local, self.remote):
            assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        self.kv = (torch.arange(LAYERS * BLOCKS * PAGE) % 251 + 1).to(torch.int8)
        layer_bytes = BLOCKS * PAGE
        caches = {
            f"layers.{n}": self.kv[n * layer_bytes : (n + 1) * layer_bytes].view(BLOCKS, PAGE)
            for n in range(LAYERS)
        }
        self.registration = block_views(caches, dict.fromkeys(caches, PAGE), num_blocks=BLOCKS)
        self.destination = torch.zeros(LAYERS * BLOCKS * PAGE, dtype=torch.int8)
        self.base, self.target = self.kv.data_ptr(), self.destination.data_ptr()
        self.guarded = guard_module.guard(self.local, self.registration)
        assert self.guarded.register_memory(self.base, self.kv.numel()) == 0
        assert self.remote.register_memory(self.target, self.destination.numel()) == 0
        self.peer = f"127.0.0.1:{self.remote.get_rpc_port()}"
        # A third engine, for reads that fail: Mooncake rejects a peer address outside the peer's
        # registration, and then (measured, 0.3.13) often fails the next transfer to that peer
        # too, so failures are provoked on this one and the transfers to `peer` stay clean.
        self.elsewhere = TransferEngine()
        assert self.elsewhere.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        self.elsewhere_bytes = torch.zeros(PAGE, dtype=torch.int8)
        assert self.elsewhere.register_memory(self.elsewhere_bytes.data_ptr(), PAGE) == 0
        self.rejecting = f"127.0.0.1:{self.elsewhere.get_rpc_port()}"
        self.nowhere = self.elsewhere_bytes.data_ptr() + PAGE  # no registered byte of its there

    def moved(self) -> list[int]:
        """The first and last byte of the destination that is no longer zero."""
        changed = torch.nonzero(self.destination).flatten().tolist()
        return [changed[0], changed[-1]] if changed else []


@pytest.fixture(scope="module")
def engines() -> Pair:
    return Pair()


@pytest.fixture
def pair(engines: Pair) -> Iterator[Pair]:
    engines.destination.zero_()
    yield engines
    engines.destination.zero_()


def test_the_guard_is_a_proxy_that_passes_every_other_call_on(pair: Pair) -> None:
    assert isinstance(pair.guarded, guard_module.GuardedEngine)
    assert pair.guarded.engine is pair.local
    assert pair.guarded.get_rpc_port() == pair.local.get_rpc_port()


def test_a_clean_write_moves_the_bytes(pair: Pair) -> None:
    with capture_events() as events:
        status = pair.guarded.transfer_sync_write(
            pair.peer, pair.base + PAGE, pair.target + PAGE, PAGE
        )
    assert status == 0
    assert pair.moved() == [PAGE, 2 * PAGE - 1]
    assert pair.destination[PAGE : 2 * PAGE].tolist() == pair.kv[PAGE : 2 * PAGE].tolist()
    assert [e for e in events if e["event"] == "address_violation"] == []


def test_a_clean_batch_of_whole_pages_moves_the_bytes(pair: Pair) -> None:
    buffers = [pair.base, pair.base + BLOCKS * PAGE + 3 * PAGE]
    peers = [pair.target, pair.target + PAGE]
    assert pair.guarded.batch_transfer_sync_write(pair.peer, buffers, peers, [PAGE, PAGE]) == 0
    assert pair.moved() == [0, 2 * PAGE - 1]


def test_a_clean_read_of_a_run_of_pages_moves_the_bytes(pair: Pair) -> None:
    pair.destination.copy_(pair.kv)  # the peer holds the cache; we read pages back into ours
    pair.kv[: 2 * PAGE] = 0
    status = pair.guarded.transfer_sync_read(pair.peer, pair.base, pair.target, 2 * PAGE)
    assert status == 0
    assert pair.kv[: 2 * PAGE].tolist() == pair.destination[: 2 * PAGE].tolist()


@pytest.mark.parametrize(
    ("rows", "kind", "words"),
    [
        ([(PAGE // 2, PAGE)], "outside_view", "pages 0 and 1 of view 'layers.0'"),
        (
            [(BLOCKS * PAGE - PAGE // 2, PAGE)],
            "outside_view",
            "view 'layers.0' (page 7) and view 'layers.1' (page 0)",
        ),
        ([(BLOCKS * PAGE, 200)], "partial_page", "200 of the 256 bytes of page 0"),
        ([(0, PAGE), (PAGE // 2, PAGE)], "outside_view", "pages 0 and 1 of view 'layers.0'"),
    ],
    ids=["across_two_pages", "on_another_layer", "short_of_a_page", "kernel_block_stride"],
)
def test_strict_refuses_a_wrong_local_row_before_the_engine_sees_it(
    pair: Pair, rows: list[tuple[int, int]], kind: str, words: str
) -> None:
    buffers = [pair.base + offset for offset, _ in rows]
    lengths = [length for _, length in rows]
    peers = [pair.target + n * 2 * PAGE for n in range(len(rows))]
    with pytest.raises(AddressError) as caught:
        pair.guarded.batch_transfer_sync_write(pair.peer, buffers, peers, lengths)
    assert caught.value.kind == kind
    assert words in str(caught.value)
    assert caught.value.source == "mooncake.batch_transfer_sync_write"
    assert pair.moved() == []  # the destination is unchanged


def test_under_warn_the_transfer_goes_ahead_with_the_event(pair: Pair) -> None:
    with safeview.policy_scope("warn"), capture_events() as events:
        status = pair.guarded.transfer_sync_write(
            pair.peer, pair.base + PAGE // 2, pair.target, PAGE
        )
    assert status == 0
    assert pair.moved() == [0, PAGE - 1]  # the straddling bytes arrived
    [event] = [e for e in events if e["event"] == "address_violation"]
    assert event["level"] == "warning"
    assert event["kind"] == "outside_view"
    assert event["source"] == "mooncake.transfer_sync_write"
    assert event["address"] == pair.base + PAGE // 2


def test_a_read_into_local_memory_outside_the_registration_is_refused(pair: Pair) -> None:
    outside = torch.ones(PAGE, dtype=torch.int8)
    with pytest.raises(AddressError) as caught:
        pair.guarded.transfer_sync_read(pair.peer, outside.data_ptr(), pair.target, PAGE)
    assert caught.value.kind == "outside_memory"
    assert outside.tolist() == [1] * PAGE


def test_mooncake_itself_reads_into_unregistered_local_memory(pair: Pair) -> None:
    # measured on 0.3.13: over TCP only the peer's address is looked up
    outside = torch.ones(PAGE, dtype=torch.int8)
    pair.destination[:PAGE] = 7
    assert pair.local.transfer_sync_read(pair.peer, outside.data_ptr(), pair.target, PAGE) == 0
    assert outside.tolist() == [7] * PAGE


def test_mooncake_itself_refuses_a_peer_address_past_its_registration(pair: Pair) -> None:
    end = pair.target + pair.destination.numel()
    assert pair.local.transfer_sync_write(pair.peer, pair.base, end - PAGE + 1, PAGE) != 0


def test_peer_rows_of_one_batch_that_share_a_byte_are_refused(pair: Pair) -> None:
    buffers = [pair.base, pair.base + PAGE]
    peers = [pair.target, pair.target + PAGE // 2]
    with pytest.raises(AddressError) as caught:
        pair.guarded.batch_transfer_sync_write(pair.peer, buffers, peers, [PAGE, PAGE])
    assert caught.value.kind == "overlapping_writes"
    assert caught.value.source == "mooncake.batch_transfer_sync_write (peer addresses)"
    assert pair.moved() == []


def test_local_rows_of_one_batch_read_that_share_a_byte_are_refused(pair: Pair) -> None:
    buffers = [pair.base, pair.base]
    with pytest.raises(AddressError) as caught:
        pair.guarded.batch_transfer_sync_read(
            pair.peer, buffers, [pair.target, pair.target + PAGE], [PAGE, PAGE]
        )
    assert caught.value.kind == "overlapping_writes"
    assert caught.value.finding.rows == (0, 1)
    assert caught.value.layers == ("layers.0",)


def test_mooncake_itself_writes_two_peer_rows_on_the_same_bytes(pair: Pair) -> None:
    buffers = [pair.base, pair.base + PAGE]
    peers = [pair.target, pair.target + PAGE // 2]
    assert pair.local.batch_transfer_sync_write(pair.peer, buffers, peers, [PAGE, PAGE]) == 0
    assert pair.moved() == [0, PAGE + PAGE // 2 - 1]


def test_under_warn_a_row_short_of_a_page_goes_ahead_with_the_event(pair: Pair) -> None:
    with safeview.policy_scope("warn"), capture_events() as events:
        status = pair.guarded.transfer_sync_write(pair.peer, pair.base, pair.target, 200)
    assert status == 0
    assert pair.moved() == [0, 199]
    [event] = [e for e in events if e["event"] == "address_violation"]
    assert event["kind"] == "partial_page"


def test_a_second_overlapping_registration_is_refused(pair: Pair) -> None:
    with pytest.raises(AddressError) as caught:
        pair.guarded.register_memory(pair.base + 100, 200)
    assert caught.value.kind == "duplicate_registration"
    with pytest.raises(AddressError):
        pair.guarded.batch_register_memory([pair.base + 8], [8])
    # Mooncake refuses this one itself (-7: "does not support overlapped memory region")
    assert pair.local.register_memory(pair.base + 100, 200) != 0


def test_a_region_registered_and_unregistered_through_the_guard_is_forgotten(pair: Pair) -> None:
    spare = torch.zeros(PAGE, dtype=torch.int8)
    assert pair.guarded.register_memory(spare.data_ptr(), PAGE) == 0
    assert pair.guarded.unregister_memory(spare.data_ptr()) == 0
    assert pair.guarded.register_memory(spare.data_ptr(), PAGE) == 0
    assert pair.guarded.unregister_memory(spare.data_ptr()) == 0


def test_off_checks_nothing(pair: Pair) -> None:
    with safeview.policy_scope("off"), capture_events() as events:
        status = pair.guarded.transfer_sync_write(pair.peer, pair.base + 1, pair.target, PAGE)
    assert status == 0
    assert pair.moved() == [0, PAGE - 1]
    assert events == []


def test_submit_and_async_variants_are_checked(pair: Pair) -> None:
    with pytest.raises(AddressError):
        pair.guarded.transfer_submit_write(pair.peer, pair.base + 1, pair.target, PAGE)
    with pytest.raises(AddressError):
        pair.guarded.batch_transfer_async_write(pair.peer, [pair.base + 1], [pair.target], [PAGE])
    with pytest.raises(AddressError):
        pair.guarded.batch_transfer_async_read(pair.peer, [pair.base + 1], [pair.target], [PAGE])
    opcode = TransferEngine.TransferOpcode.Read
    with pytest.raises(AddressError) as caught:
        pair.guarded.batch_transfer_sync(
            pair.peer, [pair.base, pair.base], [pair.target, pair.target + PAGE], [PAGE, PAGE],
            opcode,
        )  # fmt: skip
    assert caught.value.kind == "overlapping_writes"
    assert pair.moved() == []


def test_an_engine_with_another_api_is_returned_as_it_is_with_one_event() -> None:
    class OtherEngine:
        def transfer(self, *args: Any) -> int:
            return 0

    memory = MemoryMap((StorageSpan("kv", 0x1000, 64),), (ViewSpan("x", "kv", 0, 16, 16, 4),))
    engine = OtherEngine()
    with capture_events() as events:
        with pytest.warns(RuntimeWarning, match="left the engine unguarded"):
            assert guard_module.guard(engine, memory) is engine
        assert guard_module.guard(OtherEngine(), memory) is not None
    [unavailable] = [e for e in events if e["event"] == "integration_unavailable"]  # once
    assert unavailable["integration"] == "mooncake"
    assert unavailable["reason"].startswith("the engine (OtherEngine) has no register_memory")


# -- failures the engine reports by its return codes ---------------------------------------------


def _failures(events: list[dict[str, Any]]) -> list[tuple[str, str, Any, list[str]]]:
    return [
        (e["event"], e["source"], e.get("status"), e["layers"])
        for e in events
        if e["event"] in ("registration_failed", "transfer_failed", "failure_ignored")
    ]


def test_a_failed_read_is_an_event_and_a_write_of_its_bytes_is_refused_under_strict(
    pair: Pair,
) -> None:
    page = pair.base + BLOCKS * PAGE  # page 0 of layer 1
    kept = pair.kv.clone()
    past = pair.target + pair.destination.numel()  # no registered byte of the peer's there
    try:
        with capture_events() as events:
            status = pair.guarded.transfer_sync_read(pair.peer, page, past, PAGE)
            assert status == -1  # the engine's status, unchanged
            # the caller goes on as if the read had happened, and sends those bytes on
            with pytest.raises(safeview.FailureIgnoredError) as refused:
                pair.guarded.transfer_sync_write(pair.peer, page, pair.target, PAGE)
        assert pair.moved() == []  # refused before the engine moved a byte
        assert refused.value.failed == "mooncake.transfer_sync_read"
        assert (refused.value.status, refused.value.layers) == (-1, ("layers.1",))
        assert _failures(events) == [
            ("transfer_failed", "mooncake.transfer_sync_read", -1, ["layers.1"]),
            ("failure_ignored", "mooncake.transfer_sync_write", -1, ["layers.1"]),
        ]
        with safeview.policy_scope("warn"), capture_events() as warned:
            assert pair.guarded.transfer_sync_write(pair.peer, page, pair.target, PAGE) == 0
        assert [e["level"] for e in warned if e["event"] == "failure_ignored"] == ["warning"]
        assert pair.moved() != []  # under warn it goes ahead, as without safeview
        # a read that succeeds makes the bytes good again
        pair.destination.zero_()
        assert pair.guarded.transfer_sync_read(pair.peer, page, pair.target, PAGE) == 0
        with capture_events() as after:
            assert pair.guarded.transfer_sync_write(pair.peer, page, pair.target, PAGE) == 0
        assert _failures(after) == []
    finally:
        pair.kv.copy_(kept)


def test_mooncake_itself_sends_bytes_a_failed_read_never_filled(pair: Pair) -> None:
    page = pair.base + BLOCKS * PAGE
    past = pair.target + pair.destination.numel()
    with safeview.policy_scope("off"):
        assert pair.guarded.transfer_sync_read(pair.peer, page, past, PAGE) == -1
        assert pair.guarded.transfer_sync_write(pair.peer, page, pair.target, PAGE) == 0
    assert pair.moved() != []  # success, with whatever the page held before


def test_a_failed_registration_is_an_event_and_a_transfer_from_its_memory_is_refused() -> None:
    engine, remote = TransferEngine(), TransferEngine()
    for each in (engine, remote):
        assert each.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    kv = (torch.arange(LAYERS * BLOCKS * PAGE) % 251 + 1).to(torch.int8)
    layer_bytes = BLOCKS * PAGE
    caches = {
        f"layers.{n}": kv[n * layer_bytes : (n + 1) * layer_bytes].view(BLOCKS, PAGE)
        for n in range(LAYERS)
    }
    guarded = guard_module.guard(
        engine, block_views(caches, dict.fromkeys(caches, PAGE), num_blocks=BLOCKS)
    )
    destination = torch.zeros(PAGE, dtype=torch.int8)
    assert remote.register_memory(destination.data_ptr(), PAGE) == 0
    peer = f"127.0.0.1:{remote.get_rpc_port()}"
    base = kv.data_ptr()
    assert guarded.register_memory(base, layer_bytes) == 0  # layer 0
    with safeview.policy_scope("warn"), capture_events() as events:
        # meant to register layer 1 and overlapping layer 0's: Mooncake refuses it (-7)
        status = guarded.register_memory(base + layer_bytes // 2, layer_bytes + layer_bytes // 2)
    assert status == -7
    [failed] = [e for e in events if e["event"] == "registration_failed"]
    assert (failed["status"], failed["layers"]) == (-7, ["layers.0", "layers.1"])
    with pytest.raises(safeview.FailureIgnoredError) as refused:
        guarded.transfer_sync_write(peer, base + layer_bytes, destination.data_ptr(), PAGE)
    assert refused.value.failed == "mooncake.register_memory"
    assert refused.value.layers == ("layers.1",)
    assert not destination.any()
    # layer 0's memory was registered: its transfers are not refused
    assert guarded.transfer_sync_write(peer, base, destination.data_ptr(), PAGE) == 0
    assert destination.tolist() == kv[:PAGE].tolist()


# -- asynchronous calls: the batch id, and the outcome the engine reports later ------------------


def test_a_failed_async_read_is_an_event_and_a_write_of_its_bytes_is_refused_under_strict(
    pair: Pair,
) -> None:
    row = BLOCKS * PAGE  # page 0 of layer 1
    page = pair.base + row
    kept = pair.kv.clone()
    try:
        with capture_events() as events:
            batch = pair.guarded.batch_transfer_async_read(
                pair.rejecting, [page], [pair.nowhere], [PAGE]
            )
            assert batch != 0  # submitted: Mooncake reports the failure when asked
            assert pair.guarded.get_batch_transfer_status([batch]) == -1  # the engine's, unchanged
            with pytest.raises(safeview.FailureIgnoredError) as refused:
                pair.guarded.batch_transfer_sync_write(pair.peer, [page], [pair.target], [PAGE])
        assert pair.moved() == []  # refused before the engine moved a byte
        assert (refused.value.failed, refused.value.status) == (
            "mooncake.batch_transfer_async_read",
            -1,
        )
        assert _failures(events) == [
            ("transfer_failed", "mooncake.get_batch_transfer_status", -1, ["layers.1"]),
            ("failure_ignored", "mooncake.batch_transfer_sync_write", -1, ["layers.1"]),
        ]
        [failed] = [e for e in events if e["event"] == "transfer_failed"]
        assert failed["regions"] == [[page, PAGE]]
        with safeview.policy_scope("warn"), capture_events() as warned:
            assert pair.guarded.transfer_sync_write(pair.peer, page, pair.target, PAGE) == 0
        assert [(e["level"], e["failed"]) for e in warned if e["event"] == "failure_ignored"] == [
            ("warning", "mooncake.batch_transfer_async_read")
        ]
        assert pair.moved() == [0, PAGE - 1]  # under warn it goes ahead, as without safeview
        pair.destination.zero_()
        assert (
            pair.guarded.transfer_sync_read(pair.peer, page, pair.target, PAGE) == 0
        )  # clears the mark
        assert not pair.kv[row : row + PAGE].any()  # (it read the zeros back)
    finally:
        pair.kv.copy_(kept)


def test_a_confirmed_async_read_makes_bytes_a_failed_read_left_good_again(pair: Pair) -> None:
    page = pair.base + PAGE
    kept = pair.kv.clone()
    try:
        assert pair.guarded.transfer_sync_read(pair.rejecting, page, pair.nowhere, PAGE) == -1
        pair.destination[:PAGE] = 7
        with capture_events() as events:
            batch = pair.guarded.batch_transfer_async_read(pair.peer, [page], [pair.target], [PAGE])
            assert pair.guarded.get_batch_transfer_status([batch]) == 0
            assert pair.kv[PAGE : 2 * PAGE].tolist() == [7] * PAGE  # the read happened
            status = pair.guarded.batch_transfer_sync_write(
                pair.peer, [page], [pair.target + PAGE], [PAGE]
            )
        assert status == 0
        assert pair.destination[PAGE : 2 * PAGE].tolist() == [7] * PAGE
        assert _failures(events) == []
    finally:
        pair.kv.copy_(kept)


def test_a_write_of_bytes_whose_async_read_is_not_confirmed_is_refused_under_strict(
    pair: Pair,
) -> None:
    page = pair.base + 2 * PAGE
    kept = pair.kv.clone()
    try:
        batch = pair.guarded.batch_transfer_async_read(pair.peer, [page], [pair.target], [PAGE])
        assert batch != 0
        with capture_events() as events:
            with pytest.raises(safeview.FailureIgnoredError) as refused:
                pair.guarded.transfer_sync_write(pair.peer, page, pair.target + PAGE, PAGE)
            with safeview.policy_scope("warn"):
                opcode = TransferEngine.TransferOpcode.Write
                assert pair.guarded.transfer_sync(
                    pair.peer, page, pair.target + PAGE, PAGE, opcode
                ) == 0  # fmt: skip
        assert refused.value.failed.startswith("mooncake.batch_transfer_async_read (")
        assert refused.value.status == batch  # what the engine returned: the batch id
        assert "not confirmed" in str(refused.value)
        assert "no get_batch_transfer_status of it has returned 0" in str(refused.value)
        ignored = [e for e in events if e["event"] == "failure_ignored"]
        assert [(e["level"], e["status"]) for e in ignored] == [
            ("error", batch),
            ("warning", batch),
        ]
        assert all("not confirmed" in e["message"] for e in ignored)
        # once the engine says the read succeeded, the bytes are good
        assert pair.guarded.get_batch_transfer_status([batch]) == 0
        with capture_events() as after:
            assert pair.guarded.transfer_sync_write(pair.peer, page, pair.target, PAGE) == 0
            # under off nothing is tracked: a batch submitted then is unknown later, too
            with safeview.policy_scope("off"):
                batch = pair.guarded.batch_transfer_async_read(
                    pair.peer, [page], [pair.target], [PAGE]
                )
            assert pair.guarded.transfer_sync_write(pair.peer, page, pair.target, PAGE) == 0
            assert pair.guarded.get_batch_transfer_status([batch]) == 0
        assert _failures(after) == []
    finally:
        pair.kv.copy_(kept)


def test_an_async_submit_the_engine_refuses_is_a_failed_transfer(pair: Pair) -> None:
    page = pair.base + 3 * PAGE
    unreachable = "127.0.0.1:1"  # nothing listens there: the handshake is refused
    kept = pair.kv.clone()
    try:
        with capture_events() as events:
            assert (
                pair.guarded.batch_transfer_async_read(unreachable, [page], [pair.target], [PAGE])
                == 0
            )
            other = pair.base + 4 * PAGE  # a write of other bytes: no failed read of them
            assert (
                pair.guarded.batch_transfer_async_write(unreachable, [other], [pair.target], [PAGE])
                == 0
            )
            with pytest.raises(safeview.FailureIgnoredError) as refused:
                pair.guarded.transfer_sync_write(pair.peer, page, pair.target, PAGE)
        assert (refused.value.failed, refused.value.status) == (
            "mooncake.batch_transfer_async_read",
            0,
        )
        assert _failures(events) == [
            ("transfer_failed", "mooncake.batch_transfer_async_read", 0, ["layers.0"]),
            ("transfer_failed", "mooncake.batch_transfer_async_write", 0, ["layers.0"]),
            ("failure_ignored", "mooncake.transfer_sync_write", 0, ["layers.0"]),
        ]
        assert pair.moved() == []
        assert (
            pair.guarded.transfer_sync_read(pair.peer, page, pair.target, PAGE) == 0
        )  # clears the mark
    finally:
        pair.kv.copy_(kept)


def test_a_submitted_write_the_engine_reports_failed_is_an_event(pair: Pair) -> None:
    with capture_events() as events:
        batch = pair.guarded.transfer_submit_write(pair.rejecting, pair.base, pair.nowhere, PAGE)
        assert batch != 0
        statuses = [pair.guarded.transfer_check_status(batch)]
        deadline = time.monotonic() + 10
        while statuses[-1] == 0 and time.monotonic() < deadline:  # 0: still running
            time.sleep(0.01)
            statuses.append(pair.guarded.transfer_check_status(batch))
    assert statuses[-1] == -1  # the engine's, unchanged
    assert _failures(events) == [
        ("transfer_failed", "mooncake.transfer_check_status", -1, ["layers.0"])
    ]


def test_the_guard_remembers_a_bounded_number_of_batches(pair: Pair) -> None:
    page = pair.base + 5 * PAGE
    kept = pair.kv.clone()
    try:
        read = pair.guarded.batch_transfer_async_read(pair.peer, [page], [pair.target], [PAGE])
        assert read != 0
        with pytest.raises(safeview.FailureIgnoredError):  # not confirmed yet
            pair.guarded.transfer_sync_write(pair.peer, page, pair.target, PAGE)
        # a caller that never asks about its batches: after 256 newer ones the read is forgotten
        other = pair.base + 6 * PAGE
        writes = [
            pair.guarded.batch_transfer_async_write(pair.peer, [other], [pair.target], [PAGE])
            for _ in range(guard_module._MAX_BATCHES)
        ]
        assert 0 not in writes
        assert len(pair.guarded._safeview_batches) == guard_module._MAX_BATCHES
        with capture_events() as events:
            assert pair.guarded.transfer_sync_write(pair.peer, page, pair.target, PAGE) == 0
        assert _failures(events) == []
        assert pair.guarded.get_batch_transfer_status(list(set(writes))) == 0
        assert len(pair.guarded._safeview_batches) == 0
    finally:
        pair.kv.copy_(kept)


# -- a retry that reads the bytes again, in other rows -------------------------------------------


def test_a_page_by_page_retry_of_a_failed_two_page_read_makes_its_bytes_good(pair: Pair) -> None:
    run = pair.base + BLOCKS * PAGE  # pages 0 and 1 of layer 1
    kept = pair.kv.clone()
    try:
        # the engine fails the two-page read (the rejecting peer holds no such bytes) ...
        assert pair.guarded.transfer_sync_read(pair.rejecting, run, pair.nowhere, 2 * PAGE) < 0
        pair.destination[: 2 * PAGE] = 9
        # ... the caller retries page by page from a peer that has them: both succeed
        for page in range(2):
            assert (
                pair.guarded.transfer_sync_read(
                    pair.peer, run + page * PAGE, pair.target + page * PAGE, PAGE
                )
                == 0
            )
        assert pair.kv[BLOCKS * PAGE : BLOCKS * PAGE + 2 * PAGE].tolist() == [9] * 2 * PAGE
        with capture_events() as events:
            # those bytes were read: a write of them, as one row or two, is no failure ignored
            assert pair.guarded.transfer_sync_write(pair.peer, run, pair.target, 2 * PAGE) == 0
            assert (
                pair.guarded.batch_transfer_sync_write(
                    pair.peer, [run, run + PAGE], [pair.target, pair.target + PAGE], [PAGE, PAGE]
                )
                == 0
            )
        assert _failures(events) == []
    finally:
        pair.kv.copy_(kept)


def test_a_retry_that_reads_part_of_the_failed_bytes_clears_only_that_part(pair: Pair) -> None:
    run = pair.base + BLOCKS * PAGE + 2 * PAGE  # pages 2 and 3 of layer 1
    kept = pair.kv.clone()
    try:
        assert pair.guarded.transfer_sync_read(pair.rejecting, run, pair.nowhere, 2 * PAGE) < 0
        # only the second page is read again
        pair.destination[:PAGE] = 9
        assert pair.guarded.transfer_sync_read(pair.peer, run + PAGE, pair.target, PAGE) == 0
        pair.destination.zero_()
        assert pair.guarded.transfer_sync_write(pair.peer, run + PAGE, pair.target, PAGE) == 0
        # the first page was never read: a write of it, or of both pages, is refused
        for address, length in ((run, PAGE), (run, 2 * PAGE)):
            with pytest.raises(safeview.FailureIgnoredError) as refused:
                pair.guarded.transfer_sync_write(pair.peer, address, pair.target, length)
            assert (refused.value.address, refused.value.length) == (address, length)
            assert refused.value.failed == "mooncake.transfer_sync_read"
            assert refused.value.layers == ("layers.1",)
        with pytest.raises(safeview.FailureIgnoredError) as refused:  # the page read, then not
            pair.guarded.batch_transfer_sync_write(
                pair.peer, [run + PAGE, run], [pair.target, pair.target + PAGE], [PAGE, PAGE]
            )
        assert refused.value.address == run
        assert pair.moved() == [0, PAGE - 1]  # only the page that was read again went out
        # a write that only touches the byte after the failed run is not refused
        with capture_events() as events:
            assert (
                pair.guarded.transfer_sync_write(pair.peer, run + 2 * PAGE, pair.target, PAGE) == 0
            )
        assert _failures(events) == []
        # the retry of the first page clears the rest
        assert pair.guarded.transfer_sync_read(pair.peer, run, pair.target, PAGE) == 0
        assert pair.guarded.transfer_sync_write(pair.peer, run, pair.target, 2 * PAGE) == 0
    finally:
        pair.kv.copy_(kept)


_spans = st.lists(st.tuples(st.integers(0, 64), st.integers(0, 24)), max_size=8)


@given(marked=_spans, read=_spans)
def test_the_bytes_left_marked_after_a_read_are_the_marked_bytes_it_did_not_read(
    marked: list[tuple[int, int]], read: list[tuple[int, int]]
) -> None:
    # oracle: sets of byte addresses
    runs = guard_module._merged(read)
    read_bytes = {b for a, n in read for b in range(a, a + n)}
    for address, length in marked:
        pieces = guard_module._uncovered(address, length, runs)
        left = [b for a, n in pieces for b in range(a, a + n)]
        assert left == sorted(set(range(address, address + length)) - read_bytes)
        assert all(n > 0 for _, n in pieces)
        assert all(a + n < b for (a, n), (b, _) in pairwise(pieces))  # disjoint, in order


def test_memory_of_a_failed_registration_registered_later_in_pieces_is_usable() -> None:
    engine, remote = TransferEngine(), TransferEngine()
    for each in (engine, remote):
        assert each.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    kv = (torch.arange(3 * BLOCKS * PAGE) % 251 + 1).to(torch.int8)
    layer_bytes = BLOCKS * PAGE
    caches = {
        f"layers.{n}": kv[n * layer_bytes : (n + 1) * layer_bytes].view(BLOCKS, PAGE)
        for n in range(3)
    }
    guarded = guard_module.guard(
        engine, block_views(caches, dict.fromkeys(caches, PAGE), num_blocks=BLOCKS)
    )
    destination = torch.zeros(PAGE, dtype=torch.int8)
    assert remote.register_memory(destination.data_ptr(), PAGE) == 0
    peer = f"127.0.0.1:{remote.get_rpc_port()}"
    base = kv.data_ptr()
    assert guarded.register_memory(base, layer_bytes) == 0  # layer 0
    with safeview.policy_scope("warn"):
        # layers 1 and 2 meant, layer 0's half overlapped: Mooncake refuses it (-7)
        assert (
            guarded.register_memory(base + layer_bytes // 2, 2 * layer_bytes + layer_bytes // 2) < 0
        )
    # the caller registers layer 1 alone: its memory is usable, layer 2's still is not
    assert guarded.register_memory(base + layer_bytes, layer_bytes) == 0
    with capture_events() as events:
        assert (
            guarded.transfer_sync_write(peer, base + layer_bytes, destination.data_ptr(), PAGE) == 0
        )
    assert _failures(events) == []
    assert destination.tolist() == kv[layer_bytes : layer_bytes + PAGE].tolist()
    with pytest.raises(safeview.FailureIgnoredError) as refused:
        guarded.transfer_sync_write(peer, base + 2 * layer_bytes, destination.data_ptr(), PAGE)
    assert refused.value.layers == ("layers.2",)
    # and once layer 2 is registered too, nothing of the failure is left
    assert guarded.register_memory(base + 2 * layer_bytes, layer_bytes) == 0
    assert (
        guarded.transfer_sync_write(peer, base + 2 * layer_bytes, destination.data_ptr(), PAGE) == 0
    )
