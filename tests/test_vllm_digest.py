"""Bytes verified in flight (issue 29): vLLM 0.33's real NIXL connectors on CPU, P and D in
separate processes, both with ``SAFEVIEW_DIGEST=all``. P's workers digest a request in the
engine step after ``request_finished`` (the harness runs that step as vLLM's engine core does:
``build_connector_meta``, each rank's ``start_load_kv`` and ``build_connector_worker_meta``,
``update_connector_output``); D fetches P's digests from P's side channel once its READ is done
and judges them before the request is handed on. The test relays ``kv_transfer_params`` from P
to D itself, as a proxy does.

Every verdict is decided by the byte oracle of ``tests/vllm_layout_harness.py`` (the values P
wrote, read through D's own cache tensors): clean pairs agree and arrive byte-identical (the
same engines; TP 1 to 2 and 2 to 1; D's blocks holding two of P's; MLA; replicated heads, TP 4
to 8; P's ``LBHNC`` into D's ``LBNHC``, which vLLM permutes on receipt where D's
``kv_transfer_config`` says ``enable_permute_local_kv``: safeview leaves that pair's layouts,
and its requests' tokens, to vLLM, and the digest, taken after vLLM's permutation, agrees);
each fault (D reads the wrong remote block ids; one byte of P's page changed after P's digest
and before the READ; one layer of D's never written by the READ; D's page overwritten after
the READ) is one the geometry checks all pass, and the digest names the layers the oracle finds
wrong, and the head of the first wrong value. Skipped without vLLM and NIXL, a failure with
``SAFEVIEW_REQUIRE_VLLM=1``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("SAFEVIEW_REQUIRE_VLLM") == "1":
    import nixl  # type: ignore[import-untyped,unused-ignore]  # noqa: F401  (CI: must import)
    import vllm  # noqa: F401
elif importlib.util.find_spec("vllm") is None or importlib.util.find_spec("nixl") is None:
    pytest.skip(
        "vLLM and NIXL are not both installed here; .ci/run tests against them",
        allow_module_level=True,
    )

import vllm_across_harness as harness  # type: ignore[import-not-found,unused-ignore]

E = harness.Engine
MLA: dict[str, Any] = {"model": "deepseek_v2", "block_size": 16}
LAYER = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
BLOCKS = [1, 2, 3]
DIGEST = {"SAFEVIEW_DIGEST": "all"}

P_ENGINES: dict[str, Any] = {
    "A": E(),
    "B": E(tp=2),
    "H": E(tp=4),  # one KV head per rank
    "M": E("LBNHC", tp=2, **MLA),
    "F": E(),  # the one whose page is changed after its digest
}
D_ENGINES: dict[str, tuple[Any, str]] = {
    "D1": (E(), "strict"),
    "D2": (E(tp=2), "strict"),
    "Dx2": (E(block_size=64), "strict"),  # D's blocks hold two of P's: vLLM reorders on receipt
    "DM": (E("LBNHC", tp=1, **MLA), "strict"),
    "D8": (E(tp=8), "strict"),  # more ranks than KV heads
    "Dr": (E(tp=2), "strict"),  # the first to read a P that serves rank 1's handshake only
    # LBNHC reading P's LBHNC: vLLM permutes HND -> NHD on receipt (enable_permute_local_kv)
    "Dp": (E("LBNHC", permute_local_kv=True), "strict"),
    "Dw": (E(), "warn"),
}
VALID = {
    "identical": ("A", "D1"),
    "tp1_to_tp2": ("A", "D2"),
    "tp2_to_tp1": ("B", "D1"),
    "blocks_x2_reordered": ("Ax2", "Dx2"),
    "mla_tp2_to_tp1": ("M", "DM"),
    "replicated_tp4_to_tp8": ("H", "D8"),
    "lbhnc_to_lbnhc_permuted_on_receipt": ("A", "Dp"),
}


@pytest.fixture(scope="module")
def flight() -> Iterator[dict[str, Any]]:
    models = harness.write_models(Path(tempfile.mkdtemp(prefix="safeview-models-")))
    p_sv = harness.Child("P", models, DIGEST)
    d_sv = harness.Child("D", models, DIGEST)
    d_plain = harness.Child("D", models, {"SAFEVIEW_VLLM": "0"})
    p_off = harness.Child("P", models)  # safeview, digests off: marks nothing
    children = [p_sv, d_sv, d_plain, p_off]
    out: dict[str, Any] = {"served": {}, "reads": {}}

    def serve(child: Any, name: str, engine: Any, d: Any, **extra: Any) -> Any:
        port = harness.free_port()
        answer = child.call(
            {"op": "serve", "name": name, "engine": asdict(engine), "port": port,
             "remote_blocks": harness.remote_blocks(engine, d, BLOCKS),
             "seed": len(out["served"]) + 1, **extra}
        )  # fmt: skip
        assert answer["error"] is None, (answer["error"], child.tail())
        answer["port"] = port
        out["served"][name] = answer
        return answer

    def read(child: Any, d_name: str, p_engine: Any, served: Any, tag: str, **extra: Any) -> Any:
        answer = child.call(
            {"op": "read", "name": d_name, "p": asdict(p_engine), "tag": tag,
             "kv_transfer_params": served["kv_transfer_params"], "caches": served["caches"],
             **extra}
        )  # fmt: skip
        assert answer["error"] is None, (answer["error"], child.tail())
        out["reads"][tag] = answer
        return answer

    try:
        for name, (engine, policy) in D_ENGINES.items():
            answer = d_sv.call({"op": "start", "name": name, "engine": asdict(engine),
                                "policy": policy})  # fmt: skip
            assert answer["error"] is None, (answer["error"], d_sv.tail())
        answer = d_plain.call({"op": "start", "name": "Dplain", "engine": asdict(E())})
        assert answer["error"] is None, (answer["error"], d_plain.tail())
        readers = {"A": "D1", "B": "D1", "H": "D8", "M": "DM", "F": "D1"}
        for name, engine in P_ENGINES.items():
            serve(p_sv, name, engine, D_ENGINES[readers[name]][0])
        serve(p_sv, "Ax2", E(), D_ENGINES["Dx2"][0])
        for tag, (p, d) in VALID.items():
            read(d_sv, d, P_ENGINES.get(p, E()), out["served"][p], tag)
        # the faults, each on a request whose geometry every check passes
        a = out["served"]["A"]
        wrong = {**a, "kv_transfer_params": {**a["kv_transfer_params"],
                                             "remote_block_ids": [[2, 3, 4]]}}  # fmt: skip
        read(d_sv, "D1", E(), wrong, "wrong_block_ids", oracle_blocks=BLOCKS)
        changed = p_sv.call({"op": "flip", "name": "F", "rank": 0, "layer": LAYER[1],
                             "block": BLOCKS[2], "head": 2, "token": 5, "byte": 9})  # fmt: skip
        assert changed["error"] is None, changed
        read(d_sv, "D1", E(), out["served"]["F"], "p_changed_after_digest")
        read(d_sv, "D1", E(), a, "layer_never_written",
             fault={"kind": "unwritten", "layer": LAYER[2]})  # fmt: skip
        read(d_sv, "D1", E(), a, "d_overwritten_after_read",
             fault={"kind": "overwritten", "layer": LAYER[0], "block": 1})  # fmt: skip
        read(d_sv, "Dw", E(), a, "d_overwritten_warn",
             fault={"kind": "overwritten", "layer": LAYER[0], "block": 1})  # fmt: skip
        read(d_sv, "D1", E(), a, "after_the_faults")
        # mixed: a D without safeview reads a request P digested; a P whose digests are off
        read(d_plain, "Dplain", E(), a, "d_without_safeview")
        off = serve(p_off, "O", E(), E())
        read(d_sv, "D1", E(), off, "p_digests_off")
        # a mark a proxy added to a request P never digested: not judged, the request goes on
        forged = {**off, "kv_transfer_params": {**off["kv_transfer_params"],
                                                "safeview_digest": 1}}  # fmt: skip
        read(d_sv, "D1", E(), forged, "forged_mark")
        # issue 35: two requests stepped together, the first one P never digested, the second
        # one P digested and changed after (both P engines met before: fetched while READ runs)
        flipped = out["served"]["F"]["kv_transfer_params"]
        together = d_sv.call({"op": "read_together", "name": "D1", "requests": [
            {"tag": "never_digested", "kv_transfer_params": forged["kv_transfer_params"],
             "local_blocks": [4, 5, 6]},
            {"tag": "digested_disagreeing", "kv_transfer_params": flipped,
             "local_blocks": [7, 8, 9]},
        ]})  # fmt: skip
        assert together["error"] is None, (together["error"], d_sv.tail())
        out["together"] = together
        # issue 35: a P whose side channel holds rank 1's handshake only; D's rank 1 reads it
        # (vLLM asks for rank 1, safeview also for rank 0, for the request token), then
        # malformed messages, then another D engine's first handshake with that P
        partial = serve(p_sv, "Pr", E(tp=2), E(tp=2), handshake_ranks=[1])
        read(d_sv, "Dr", E(tp=2), partial, "p_holds_rank_1_only", ranks=[1])
        out["raw"] = _ask_raw(partial["port"])
        read(d_sv, "D2", E(tp=2), partial, "p_holds_rank_1_only_later", ranks=[1])
        yield out
    finally:
        for child in children:
            child.exit()


def _ask_raw(port: int) -> dict[str, Any]:
    """Messages sent to P's side channel at ``port`` as no peer of vLLM's sends them, and one
    vLLM's D sends for a rank P does not hold; P's answer to each (``None``: none within 2 s)."""
    import msgspec
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import GET_META_MSG

    encode = msgspec.msgpack.encode
    asked = {
        "not_msgpack": [b"\xc1"],
        "not_three_items": [encode("x")],
        "rank_not_an_integer": [encode((GET_META_MSG, [0], 1))],
        "rank_not_held": [encode((GET_META_MSG, 0, 0))],
        "rank_held": [encode((GET_META_MSG, 0, 1))],
    }
    found: dict[str, Any] = {name: _ask(port, frames) for name, frames in asked.items()}
    # without a REQ socket's envelope (no empty frame): nothing to answer by
    found["no_envelope"] = _ask(port, [b"junk"], dealer=True)
    found["after"] = _ask(port, [encode((GET_META_MSG, 0, 1))])
    return found


def _ask(port: int, frames: list[bytes], dealer: bool = False) -> list[Any] | None:
    """One message to P's side channel on a socket of its own; P's answer, its first frame
    decoded (``None``: no answer within 2 s)."""
    import msgspec
    import zmq  # type: ignore[import-not-found,unused-ignore]  # vLLM's dependency

    context = zmq.Context()
    try:
        sock = context.socket(zmq.DEALER if dealer else zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send_multipart(frames)
        if not sock.poll(2000):
            return None
        reply = sock.recv_multipart()
        return [msgspec.msgpack.decode(reply[0]), len(reply)]
    finally:
        context.destroy(linger=0)


def _digest_events(answer: dict[str, Any], name: str | None = None) -> list[dict[str, Any]]:
    names = (name,) if name else ("digest_checked", "digest_mismatch")
    return [e for e in answer["events"] if e["event"] in names]


def _wrong_layers(read: dict[str, Any]) -> list[str]:
    return [name for name, layer in read["oracle"]["layers"].items() if layer["wrong"]]


# -- P digests, D agrees ------------------------------------------------------------------------


def test_p_marks_each_sampled_request_and_every_rank_digests_it_in_the_next_step(
    flight: dict[str, Any],
) -> None:
    for name, engine in P_ENGINES.items():
        served = flight["served"][name]
        assert served["kv_transfer_params"]["safeview_digest"] == 1
        assert served["digests"][f"{name}-request"] == list(range(engine.tp)), name
    off = flight["served"]["O"]
    assert "safeview_digest" not in off["kv_transfer_params"]
    assert off["digests"] == {}


@pytest.mark.parametrize("tag", VALID)
def test_a_valid_pair_agrees_and_arrives_byte_identical(flight: dict[str, Any], tag: str) -> None:
    answer = flight["reads"][tag]
    for read in answer["reads"]:
        assert (read["done"], read["failed"]) == (True, False), read
        assert read["oracle"]["ok"], read["oracle"]
    events = _digest_events(answer)
    # one verdict per D rank, each on the heads that rank holds
    assert [e["verdict"] for e in events] == ["agree"] * len(answer["reads"]), events
    assert all(e["layers"] == 3 and e["num_tokens"] > 0 for e in events)


def test_vllm_permutes_the_pair_and_safeview_leaves_its_layouts_to_it(
    flight: dict[str, Any],
) -> None:
    answer = flight["reads"]["lbhnc_to_lbnhc_permuted_on_receipt"]
    # vLLM's handshake with P (LBHNC) made D (LBNHC) permute P's pages on receipt
    assert [read["permute_local_kv"] for read in answer["reads"]] == [True]
    # and for no other pair
    others = [r for tag, a in flight["reads"].items() if tag != "lbhnc_to_lbnhc_permuted_on_receipt"
              for r in a["reads"]]  # fmt: skip
    assert not any(read["permute_local_kv"] for read in others)
    [event] = [e for e in answer["events"]
               if e["event"] == "layout_checked" and e["when"] == "handshake"]  # fmt: skip
    assert event["verdict"] == "not_judged", event
    assert "enable_permute_local_kv" in event["reason"]
    assert not answer["handshake_errors"]
    # nor is the request's token judged: no layout event at the request, the read went on
    assert [e for e in answer["events"] if e["event"].startswith("layout_") and
            e["when"] == "request"] == []  # fmt: skip


# -- faults the geometry passes, caught and named -----------------------------------------------


FAULTS = [
    "wrong_block_ids",
    "p_changed_after_digest",
    "layer_never_written",
    "d_overwritten_after_read",
]


@pytest.mark.parametrize("tag", FAULTS)
def test_a_fault_is_caught_named_and_fails_only_that_request_under_strict(
    flight: dict[str, Any], tag: str
) -> None:
    [read] = flight["reads"][tag]["reads"]
    wrong = _wrong_layers(read)
    assert wrong, read["oracle"]  # the oracle: the bytes are wrong
    assert (read["done"], read["failed"]) == (True, True)
    [event] = _digest_events(flight["reads"][tag], "digest_mismatch")
    assert event["level"] == "error"
    assert event["action"] == "refused"
    assert event["layer"] == wrong[0]  # the first layer the oracle finds wrong
    first = read["oracle"]["layers"][wrong[0]]["first_wrong"]
    assert first["global_head"] in event["layer_heads"]
    assert event["findings"] >= len(wrong)
    assert event["request"] == f"{tag}-0"
    # D goes on: the next request reads and agrees
    [after] = flight["reads"]["after_the_faults"]["reads"]
    assert (after["done"], after["failed"]) == (True, False)
    assert after["oracle"]["ok"]


def test_the_layer_p_changed_is_the_only_one_named(flight: dict[str, Any]) -> None:
    [event] = _digest_events(flight["reads"]["p_changed_after_digest"], "digest_mismatch")
    assert (event["layer"], event["layer_heads"], event["findings"]) == (LAYER[1], [2], 1)


def test_under_warn_an_overwritten_page_is_an_event_and_the_request_goes_on(
    flight: dict[str, Any],
) -> None:
    [read] = flight["reads"]["d_overwritten_warn"]["reads"]
    assert _wrong_layers(read) == [LAYER[0]]
    assert (read["done"], read["failed"]) == (True, False)
    [event] = _digest_events(flight["reads"]["d_overwritten_warn"], "digest_mismatch")
    assert (event["level"], event["action"], event["layer"]) == ("warning", "none", LAYER[0])


# -- peers without it ---------------------------------------------------------------------------


def test_a_d_without_safeview_reads_a_digested_request_byte_identical(
    flight: dict[str, Any],
) -> None:
    [read] = flight["reads"]["d_without_safeview"]["reads"]
    assert (read["done"], read["failed"]) == (True, False)
    assert read["oracle"]["ok"]
    assert not _digest_events(flight["reads"]["d_without_safeview"])


def test_a_request_p_did_not_digest_is_read_as_before(flight: dict[str, Any]) -> None:
    [read] = flight["reads"]["p_digests_off"]["reads"]
    assert (read["done"], read["failed"]) == (True, False)
    assert read["oracle"]["ok"]
    assert not _digest_events(flight["reads"]["p_digests_off"])


def test_a_forged_mark_is_not_judged_and_the_request_goes_on(flight: dict[str, Any]) -> None:
    [read] = flight["reads"]["forged_mark"]["reads"]
    assert (read["done"], read["failed"]) == (True, False)
    [event] = _digest_events(flight["reads"]["forged_mark"])
    assert (event["event"], event["verdict"]) == ("digest_checked", "not_judged")
    assert "did not come" in event["reason"]


# -- issue 35: no verdict lost behind another's fetch; a side channel that outlives a bad ask ----


def test_a_disagreeing_digest_is_refused_at_once_beside_a_request_p_never_digested(
    flight: dict[str, Any],
) -> None:
    """The first request's digests never come (P never digested it): it waits its 5 s and goes
    on not judged; the second's came at once and disagree: failed under strict, well before
    the first's wait is over (one fetch thread that asked in turn held it back 5 s)."""
    answer = flight["together"]
    never = answer["requests"]["never_digested"]
    digested = answer["requests"]["digested_disagreeing"]
    assert (digested["done"], digested["failed"]) == (True, True), answer
    assert digested["seconds"] < 2.5, answer
    [mismatch] = _digest_events(answer, "digest_mismatch")
    assert (mismatch["request"], mismatch["action"]) == ("digested_disagreeing", "refused")
    assert (mismatch["layer"], mismatch["layer_heads"]) == (LAYER[1], [2])
    assert (never["done"], never["failed"]) == (True, False), answer
    assert never["seconds"] >= 4.5, answer  # its own wait, counted from its own fetch
    [checked] = _digest_events(answer, "digest_checked")
    assert (checked["request"], checked["verdict"]) == ("never_digested", "not_judged")
    assert "did not come within 5 s" in checked["reason"]


def test_p_answers_a_rank_it_does_not_hold_with_an_error_and_d_reads_on(
    flight: dict[str, Any],
) -> None:
    first = flight["reads"]["p_holds_rank_1_only"]
    [read] = first["reads"]
    assert (read["done"], read["failed"]) == (True, False), read
    assert read["oracle"]["ok"], read["oracle"]
    # safeview's D asked P for rank 0 too: P said at once that it holds no such rank (not a
    # 5 s timeout), and D judged P from vLLM's own handshake metadata
    [note] = [e for e in first["events"] if e["event"] == "integration_unavailable"]
    assert "SideChannelError" in note["reason"], note
    assert "serves no handshake of (pp_rank, tp_rank) (0, 0); it serves (0, 1)" in note["reason"]
    # and the listener still answered the digest question after it
    assert [e["verdict"] for e in _digest_events(first)] == ["agree"]


def test_p_side_channel_answers_malformed_messages_and_serves_the_next_handshake(
    flight: dict[str, Any],
) -> None:
    raw = flight["raw"]
    for name in ("not_msgpack", "not_three_items", "rank_not_an_integer", "rank_not_held"):
        said, frames = raw[name]
        assert isinstance(said, str), (name, said)
        assert said.startswith("safeview: "), (name, said)
        assert frames == 2, name  # the payload's place and P's clock, as vLLM's D reads them
    assert "cannot read the message" in raw["not_msgpack"][0]
    assert "([0], 1)" in raw["rank_not_an_integer"][0]
    assert raw["no_envelope"] is None  # dropped: no REQ envelope to answer by
    for name in ("rank_held", "after"):
        payload, frames = raw[name]
        assert isinstance(payload, dict), (name, payload)
        assert "safeview_manifest" in payload, (name, payload)
    # a D engine that never met P: vLLM's own handshake with it, after all of the above
    later = flight["reads"]["p_holds_rank_1_only_later"]
    [read] = later["reads"]
    assert (read["done"], read["failed"]) == (True, False), (read, later["handshake_errors"])
    assert read["oracle"]["ok"], read["oracle"]
    assert not later["handshake_errors"]
    assert [e["verdict"] for e in _digest_events(later)] == ["agree"]


# -- the two pieces on their own, over real ZMQ sockets on 127.0.0.1 -----------------------------


@contextlib.contextmanager
def _p_side_channel(kept: Any, encoded_data: dict[tuple[int, int], bytes]) -> Iterator[int]:
    """safeview's listener of P's side channel, started as vLLM's scheduler starts its own (a
    daemon thread, the payloads, a ready and a stop event, host and port); its port."""
    from safeview.vllm._digest import _listener

    port = harness.free_port()
    ready, stop = threading.Event(), threading.Event()
    thread = threading.Thread(
        target=_listener(kept), args=(encoded_data, ready, stop, "127.0.0.1", port), daemon=True
    )
    thread.start()
    assert ready.wait(30)
    try:
        yield port
    finally:
        stop.set()
        thread.join(10)


def test_one_fetch_thread_asks_for_every_awaited_request_against_its_own_deadline() -> None:
    from safeview.vllm._digest import DigestFetcher, _Kept

    kept = _Kept()
    kept.add({"digested": {0: b"zero", 1: b"one"}})
    fetcher = DigestFetcher("safeview-digest-under-test")
    with _p_side_channel(kept, {}) as port:
        started = time.monotonic()
        never = fetcher.submit("127.0.0.1", port, "never-digested", 3.0)
        silent = fetcher.submit("127.0.0.1", harness.free_port(), "nobody-listens", 3.0)
        late = fetcher.submit("127.0.0.1", port, "digested-late", 3.0)
        digested = fetcher.submit("127.0.0.1", port, "digested", 3.0)
        assert digested.result(timeout=10) == {0: b"zero", 1: b"one"}
        # served before the first request's 3 s wait ends (behind it, it would take >= 3 s)
        assert time.monotonic() - started < 2.5
        assert not never.done()
        assert not silent.done()
        assert not late.done()
        kept.add({"digested-late": {0: b"late"}})  # P digests it while D asks again
        assert late.result(timeout=10) == {0: b"late"}
        assert never.result(timeout=10) is None  # P answered, with no digest, until the end
        assert time.monotonic() - started >= 2.9
        with pytest.raises(TimeoutError, match=r"no answer from 127\.0\.0\.1:\d+ within 3 s"):
            silent.result(timeout=10)
        # one thread for all of them, a daemon
        threads = [t for t in threading.enumerate() if t.name == "safeview-digest-under-test"]
        assert threads == [fetcher.thread]
        assert threads[0].daemon
        # a request asked later has a deadline of its own, not the first ones'
        again = fetcher.submit("127.0.0.1", port, "never-digested", 0.5)
        assert again.result(timeout=10) is None


def test_p_side_channel_listener_answers_what_it_cannot_serve_and_keeps_serving() -> None:
    import msgspec
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
        GET_META_MSG,
        NixlHandshakePayload,
    )

    from safeview.vllm._digest import _Kept
    from safeview.vllm._nixl import SideChannelError, fetch_payloads

    encode = msgspec.msgpack.encode
    held = encode({"compatibility_hash": "h", "agent_metadata_bytes": b"rank 1"})
    kept = _Kept()
    kept.add({"r": {1: b"digest"}})
    with _p_side_channel(kept, {(0, 1): held}) as port:
        said, frames = _ask(port, [encode((GET_META_MSG, 0, 0))]) or ("no answer", 0)
        assert said == (
            "safeview: P's side channel serves no handshake of (pp_rank, tp_rank) (0, 0); "
            "it serves (0, 1)"
        )
        assert frames == 2
        # vLLM's own D fails to decode it at once (no 5 s timeout); safeview's D names it
        with pytest.raises(msgspec.ValidationError):
            msgspec.msgpack.Decoder(NixlHandshakePayload).decode(encode(said))
        with pytest.raises(SideChannelError, match=r"handshake of rank 0: P answered"):
            fetch_payloads("127.0.0.1", port, [0], timeout_ms=2000)
        for frames_sent in ([b"\xc1"], [encode("x")], [encode((GET_META_MSG, {}, 1))]):
            answer = _ask(port, frames_sent)
            assert answer is not None, frames_sent
            assert answer[0].startswith("safeview: "), answer
        assert _ask(port, [b"junk"], dealer=True) is None
        assert _ask(port, [b"", b"one", b"two"], dealer=True) is None
        # a kind vLLM does not know is answered as vLLM's listener answers it: the payload
        assert _ask(port, [encode(("other", 0, 1))]) == [msgspec.msgpack.decode(held), 2]
        # and it serves on: the handshake it holds, the digests
        assert fetch_payloads("127.0.0.1", port, [1], timeout_ms=2000) == {
            1: {"compatibility_hash": "h", "agent_metadata_bytes": b"rank 1"}
        }
        assert _ask(port, [encode(("safeview_digest", "r", 0))]) == [{1: b"digest"}, 1]
