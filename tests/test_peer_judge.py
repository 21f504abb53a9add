"""``safeview.manifest.peer.judge_peer``: one verdict, event and error whichever channel brought
the sender's manifest. Verdicts are decided against test_diff's byte oracle (vLLM 0.33's NIXL
movement re-implemented there, bytes moved and decoded): compatible exactly when every byte a
decode rank reads means what the prefill rank wrote; a mismatch names the oracle's first wrong
byte. Manifests from the wire channels go through ``to_wire``/``from_wire`` first."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_diff import (  # type: ignore[import-not-found,unused-ignore]
    VALID_NIXL,
    engine_rank,
    expected,
    first_wrong_byte,
    manifest_of,
    nixl_pair,
    vllm_moves,
)

from safeview.errors import LayoutMismatchError, ManifestError
from safeview.log import _PAIR_KEYS
from safeview.manifest import Manifest
from safeview.manifest.peer import AGAINST, Against, judge_peer
from safeview.manifest.wire import from_wire, to_wire
from safeview.testing import capture_events

LAYER = "model.layers.0.attn"


def carried(manifests: list[Manifest], against: Against) -> list[Manifest]:
    """The sender's manifests as the channel brings them: over the wire for the handshake, a
    request and the store; as they are for the folder and a NIXL-metadata rebuild."""
    if against in ("handshake", "request", "store"):
        return [from_wire(to_wire(m), peer=f"P rank {m.topology.tp_rank}") for m in manifests]
    return manifests


def oracle_case(
    p_tp: int, d_tp: int, heads: int, p_n: int, d_n: int, p_layout: str, d_layout: str, mla: bool
) -> tuple[list[Manifest], list[Manifest], dict[int, bool], dict[tuple[int, str], int]]:
    """Both engines' manifests, whether each D rank reads every byte right (the oracle), and the
    first wrong byte per (D rank, layer)."""
    senders, receivers, refused, wrong = nixl_pair(
        p_tp, d_tp, heads, p_n, d_n, p_layout, d_layout, mla
    )
    if refused:
        return senders, receivers, dict.fromkeys(range(d_tp), False), {}
    right = {rank: not any(r == rank for r, _ in wrong) for rank in range(d_tp)}
    return senders, receivers, right, wrong


def judged(
    receiver: Manifest, senders: list[Manifest], against: Against, policy: str = "strict"
) -> tuple[LayoutMismatchError | None, list[dict[str, Any]]]:
    with capture_events() as events:
        error = judge_peer(
            receiver,
            senders,
            against=against,
            fields={"when": "handshake", "remote_engine": "P"},
            rule="vllm_nixl",
            policy=policy,  # type: ignore[arg-type]
        )
    return error, events


def assert_agrees_with_the_oracle(
    case: tuple[Any, ...], against: Against, one_rank_at_a_time: bool = False
) -> None:
    senders, receivers, right, wrong = oracle_case(*case)
    senders = carried(senders, against)
    p_tp, d_tp = len(senders), len(receivers)
    for rank, receiver in enumerate(receivers):
        given = senders
        if one_rank_at_a_time:  # a handshake brings the one P rank this D rank reads
            given = [senders[rank * p_tp // d_tp]]
        error, events = judged(receiver, given, against)
        [event] = events
        assert event["against"] == against
        assert event["fingerprint"] == receiver.fingerprint
        assert event["remote_fingerprints"] == [m.fingerprint for m in given]
        if right[rank]:
            assert error is None, [f.message for f in error.findings] if error else None
            assert (event["event"], event["verdict"]) == ("layout_checked", "compatible")
            continue
        assert error is not None, f"D rank {rank} reads wrong bytes, judged compatible"
        assert (event["event"], event["action"], event["level"]) == (
            "layout_mismatch", "refused", "error"
        )  # fmt: skip
        named = {f.layer: f.byte for f in error.findings if f.kind == "byte"}
        assert named == {name: byte for (r, name), byte in wrong.items() if r == rank}


@pytest.mark.parametrize("against", AGAINST)
@pytest.mark.parametrize(
    ("p_tp", "d_tp", "heads", "p_n", "d_n", "p_layout", "d_layout", "mla"), VALID_NIXL
)
def test_valid_pairs_are_compatible_whatever_brought_the_manifest(
    p_tp: int, d_tp: int, heads: int, p_n: int, d_n: int, p_layout: str, d_layout: str,
    mla: bool, against: Against,
) -> None:  # fmt: skip
    case = (p_tp, d_tp, heads, p_n, d_n, p_layout, d_layout, mla)
    assert_agrees_with_the_oracle(case, against)
    if d_tp >= p_tp:  # each D rank reads one P rank: that rank's handshake alone judges it
        assert_agrees_with_the_oracle(case, against, one_rank_at_a_time=True)


@settings(max_examples=25, deadline=None)
@given(
    p_tp=st.sampled_from([1, 2, 4]),
    d_tp=st.sampled_from([1, 2, 4]),
    heads=st.sampled_from([1, 2, 4]),
    p_n=st.sampled_from([2, 4]),
    d_n=st.sampled_from([2, 4, 8]),
    p_layout=st.sampled_from(["LBHNC", "LBNHC"]),
    d_layout=st.sampled_from(["LBHNC", "LBNHC"]),
    mla=st.booleans(),
    against=st.sampled_from(AGAINST),
)
def test_every_verdict_agrees_with_the_byte_oracle(
    p_tp: int, d_tp: int, heads: int, p_n: int, d_n: int, p_layout: str, d_layout: str,
    mla: bool, against: Against,
) -> None:  # fmt: skip
    assert_agrees_with_the_oracle((p_tp, d_tp, heads, p_n, d_n, p_layout, d_layout, mla), against)


def contradicting_pair() -> tuple[Manifest, Manifest, int]:
    """Both engines report LBHNC; P's layer 1 is really NHD (vLLM cannot see it): P's manifest,
    D's, and the first byte D reads wrong, by the oracle."""
    prefill = [engine_rank(1, 0, 2, 4, "LBHNC", 2, False, 2)]
    prefill[0]["model.layers.1.attn"] = engine_rank(1, 0, 2, 4, "LBNHC", 2, False, 2)[
        "model.layers.1.attn"
    ]
    decode = [
        {n: torch.zeros_like(t) for n, t in engine_rank(1, 0, 2, 4, "LBHNC", 2, False, 2).items()}
    ]
    sender = manifest_of(prefill[0], 1, 0, 2, "LBHNC", False)
    receiver = manifest_of(decode[0], 1, 0, 2, "LBHNC", False)
    vllm_moves(prefill, decode, 2, 4, 4, "LBHNC", False)
    cache = decode[0]["model.layers.1.attn"]
    wrong = first_wrong_byte(cache, expected(cache, 1, 0, 1, 2, False))
    assert wrong is not None
    return sender, receiver, wrong


def test_a_layer_contradicting_its_layout_string_is_refused_from_the_handshake_alone() -> None:
    sender, receiver, wrong = contradicting_pair()
    [received] = carried([sender], "handshake")
    error, [event] = judged(receiver, [received], "handshake")
    assert isinstance(error, LayoutMismatchError)
    assert (error.layer, error.byte) == ("model.layers.1.attn", wrong)
    assert event["event"] == "layout_mismatch"
    assert (event["layer"], event["byte"], event["against"]) == (
        "model.layers.1.attn", wrong, "handshake"
    )  # fmt: skip
    assert event["message"] == str(error).split("; and ")[0]


# -- policies, events and what is not judged -----------------------------------------------------


def test_strict_returns_the_error_warn_an_event_only_off_nothing() -> None:
    sender, receiver, _ = contradicting_pair()
    strict, [refused] = judged(receiver, [sender], "request", "strict")
    assert isinstance(strict, LayoutMismatchError)
    assert (refused["level"], refused["action"], refused["policy"]) == ("error", "refused",
                                                                        "strict")  # fmt: skip
    warned, [event] = judged(receiver, [sender], "request", "warn")
    assert warned is None
    assert (event["level"], event["action"], event["policy"]) == ("warning", "none", "warn")
    assert (event["verdict"], event["kind"]) == ("mismatch", "byte")
    off, events = judged(receiver, [sender], "request", "off")
    assert off is None
    assert events == []


def test_at_startup_strict_says_it_but_refuses_nothing() -> None:
    sender, receiver, _ = contradicting_pair()
    with capture_events() as events:
        error = judge_peer(receiver, [sender], against="folder", fields={"when": "startup"},
                           policy="strict")  # fmt: skip
    assert error is None
    [event] = events
    assert (event["event"], event["level"], event["action"]) == ("layout_mismatch", "error",
                                                                 "none")  # fmt: skip


def test_every_event_carries_the_pair_keys_in_the_tables_order() -> None:
    sender, receiver, _ = contradicting_pair()
    for against in AGAINST:
        _, [event] = judged(receiver, carried([sender], against), against, "warn")
        keys = [key for key in event if key in _PAIR_KEYS]
        assert keys == list(_PAIR_KEYS)
        assert (event["engine"], event["remote_engine"], event["remote_tp_size"]) == (
            receiver.topology.engine, "P", 1
        )  # fmt: skip
        assert event["against"] == against
        assert event["fingerprint"] == receiver.fingerprint
        assert event["remote_fingerprints"] == [sender.fingerprint]


@pytest.mark.parametrize("reason", [None, "P sent nothing of safeview's"])
def test_no_sender_manifest_is_not_judged_with_the_reason(reason: str | None) -> None:
    _, receiver, _ = contradicting_pair()
    with capture_events() as events:
        error = judge_peer(receiver, None, against=None, fields={"when": "handshake"},
                           policy="strict", reason=reason)  # fmt: skip
    assert error is None
    [event] = events
    assert (event["event"], event["verdict"], event["against"]) == ("layout_checked",
                                                                    "not_judged", None)  # fmt: skip
    assert event["reason"] == reason or (reason is None and "no manifest" in event["reason"])
    assert (event["layers"], event["findings"], event["remote_fingerprints"]) == (0, 0, [])


def test_a_pair_diff_cannot_compare_is_not_judged_and_says_why() -> None:
    # two P "ranks" of different TP sizes: no engine; diff refuses, the judge says so
    sender, receiver, _ = contradicting_pair()
    other = Manifest(topology=sender.topology.model_copy(update={"tp_size": 2, "tp_rank": 1}),
                     layers=dict(sender.layers))  # fmt: skip
    with capture_events() as events:
        error = judge_peer(receiver, [sender, other], against="store",
                           fields={"when": "transfer"}, policy="strict")  # fmt: skip
    assert error is None
    [event] = events
    assert (event["event"], event["verdict"]) == ("layout_checked", "not_judged")
    assert "tp_size" in event["reason"]
    assert "differ within one side" in event["reason"]


def test_one_p_rank_of_two_that_a_d_rank_reads_is_never_compatible() -> None:
    # D TP1 reads both ranks of a P TP2: the handshake of rank 0 alone cannot vouch for rank 1
    senders, receivers, right, _ = oracle_case(2, 1, 8, 16, 16, "LBHNC", "LBHNC", False)
    assert right == {0: True}
    error, [event] = judged(receivers[0], senders[:1], "handshake")
    assert error is not None
    assert {f.kind for f in error.findings} == {"missing_rank"}
    assert event["verdict"] == "mismatch"
    both, [event] = judged(receivers[0], senders, "handshake")
    assert both is None
    assert event["verdict"] == "compatible"


def test_nixl_metadata_judges_only_the_layers_the_metadata_names() -> None:
    senders, receivers, _, _ = oracle_case(1, 1, 2, 4, 4, "LBHNC", "LBHNC", False)
    named = Manifest(topology=senders[0].topology,
                     layers={LAYER: senders[0].layers[LAYER]})  # fmt: skip
    error, [event] = judged(receivers[0], [named], "nixl_metadata")
    assert error is None
    assert (event["verdict"], event["layers"]) == ("compatible", 1)
    # from any other source, a layer the sender lacks is a finding
    error, [event] = judged(receivers[0], [named], "folder")
    assert error is not None
    assert [(f.kind, f.layer) for f in error.findings] == [("missing_layer",
                                                            "model.layers.1.attn")]  # fmt: skip


def test_an_unknown_source_is_refused() -> None:
    _, receiver, _ = contradicting_pair()
    with pytest.raises(ManifestError, match="against: 'manifest' is not one of handshake"):
        judge_peer(receiver, None, against="manifest", fields={"when": "handshake"},  # type: ignore[arg-type]
                   policy="warn")  # fmt: skip
