"""Across machines (issue 28): vLLM 0.33's real NIXL connectors on CPU, prefill (P) and decode (D)
in separate processes with separate temporary folders and no ``SAFEVIEW_MANIFEST_DIR``. P's
layout travels in P's own handshake payload; each request names it with a short token in its
``kv_transfer_params``, which the test relays from P's ``request_finished`` to D itself, verbatim,
as a P/D proxy does (tests/vllm_across_harness.py). Every verdict is checked against the bytes
a real READ delivers, decoded through D's own cache tensors.

The processes: P with safeview, P without (``SAFEVIEW_VLLM=0``), D with safeview (engines under
strict and under warn), D without; and two more P processes that take over the first one's
engine id and side-channel port once it is gone (P restarted). They start at once; vLLM's
start-up on CPU costs each one tens of seconds. These run where vLLM and NIXL are installed;
elsewhere they skip, saying so. With ``SAFEVIEW_REQUIRE_VLLM=1`` a missing vLLM or NIXL is a
failure instead.
"""

from __future__ import annotations

import importlib.util
import json
import os
import tempfile
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
MLA: dict[str, Any] = {"model": "deepseek_v2", "block_size": 16}  # vLLM's CPU MLA: 16 tokens
H8: dict[str, Any] = {"model": "llama8", "layer_heads": (8, 8, 8)}  # a Llama of 8 KV heads
LAYER_1 = "model.layers.1.self_attn.attn"
BLOCKS = [1, 2, 3]

#: P engines (served by the P process with safeview), by name
P_ENGINES: dict[str, tuple[Any, str | None]] = {
    "A": (E(), None),
    "B": (E(tp=2), None),
    "C": (E(), "permuted_layer"),  # layer 1 token-major behind the same shape and layout string
    "M": (E("LBNHC", tp=2, **MLA), None),
    "H": (E(tp=4), None),  # one KV head per rank
    "H8": (E(tp=8, **H8), None),  # one of 8 KV heads per rank
    "R": (E(), None),  # the one restarted
}
#: D engines (in the D process with safeview), by name: engine and policy
D_ENGINES: dict[str, tuple[Any, str]] = {
    "D1": (E(), "strict"),
    "D2": (E(tp=2), "strict"),
    "Dx2": (E(block_size=64), "strict"),  # D's blocks hold two of P's
    "DM": (E("LBNHC", tp=1, **MLA), "strict"),
    "D8": (E(tp=8), "strict"),  # more ranks than KV heads: each head on two ranks
    "D16": (E(tp=16, **H8), "strict"),  # the same with 8 KV heads
    "Dw": (E(), "warn"),
}
#: the valid pairs: (P engine, D engine)
VALID = {
    "identical": ("A", "D1"),
    "tp1_to_tp2": ("A", "D2"),
    "tp2_to_tp1": ("B", "D1"),
    "blocks_x2": ("A", "Dx2"),
    "mla_tp2_to_tp1": ("M", "DM"),
    # vllm#45330's class: more D ranks than KV heads, each head on two D ranks; its own case
    # (H=8 TP8->16) and the same with 4 heads
    "replicated_h8_tp8_to_tp16": ("H8", "D16"),
    "replicated_tp4_to_tp8": ("H", "D8"),
}
#: the pair read first and alone, its 24 ranks stopped right after: a NIXL agent's UCX threads
#: poll even when idle (about a core per process on CPU), and 24 more agents kept for the whole
#: module would slow every later step on a small machine
ALONE = "replicated_h8_tp8_to_tp16"


@pytest.fixture(scope="module")
def across() -> Iterator[dict[str, Any]]:
    models = harness.write_models(Path(tempfile.mkdtemp(prefix="safeview-models-")))
    off = {"SAFEVIEW_VLLM": "0"}
    p_sv, p_plain = harness.Child("P", models), harness.Child("P", models, off)
    d_sv, d_plain = harness.Child("D", models), harness.Child("D", models, off)
    # the P processes that take over R's engine id and port: started now, serving later
    p_same, p_other = harness.Child("P", models), harness.Child("P", models)
    children = [p_sv, p_plain, d_sv, d_plain, p_same, p_other]
    out: dict[str, Any] = {"served": {}, "started": {}, "reads": {}}
    ports = {name: harness.free_port() for name in [*P_ENGINES, "Ax2"]}

    def serve(child: Any, key: str, name: str, engine: Any, fault: str | None, d: Any) -> Any:
        answer = child.call(
            {"op": "serve", "name": name, "engine": asdict(engine), "port": ports[key],
             "fault": fault, "remote_blocks": harness.remote_blocks(engine, d, BLOCKS),
             "seed": len(out["served"])}
        )  # fmt: skip
        assert answer["error"] is None, (answer["error"], child.tail())
        out["served"][name] = answer
        return answer

    def read(child: Any, d_name: str, p_engine: Any, served: Any, tag: str) -> Any:
        answer = child.call(
            {"op": "read", "name": d_name, "p": asdict(p_engine), "tag": tag,
             "kv_transfer_params": served["kv_transfer_params"], "caches": served["caches"],
             "p_agents": served["agents"]}
        )  # fmt: skip
        assert answer["error"] is None, (answer["error"], child.tail())
        out["reads"][tag] = answer
        return answer

    def start(name: str) -> None:
        engine, policy = D_ENGINES[name]
        answer = d_sv.call({"op": "start", "name": name, "engine": asdict(engine),
                            "policy": policy})  # fmt: skip
        assert answer["error"] is None, (answer["error"], d_sv.tail())

    def stop(child: Any, name: str) -> None:
        answer = child.call({"op": "stop", "name": name})
        assert answer["error"] is None, (answer["error"], child.tail())

    try:
        alone_p, alone_d = VALID[ALONE]
        serve(p_sv, alone_p, alone_p, P_ENGINES[alone_p][0], None, D_ENGINES[alone_d][0])
        start(alone_d)
        read(d_sv, alone_d, P_ENGINES[alone_p][0], out["served"][alone_p], ALONE)
        stop(d_sv, alone_d)
        stop(p_sv, alone_p)
        for name in D_ENGINES:
            if name != alone_d:
                start(name)
        answer = d_plain.call({"op": "start", "name": "Dplain", "engine": asdict(E())})
        assert answer["error"] is None, (answer["error"], d_plain.tail())
        # each P engine serves the blocks its D reads (D's blocks may hold several of P's)
        readers = {"A": "D1", "B": "D1", "C": "D1", "M": "DM", "H": "D8", "R": "D1"}
        for key, (engine, fault) in P_ENGINES.items():
            if key != alone_p:
                serve(p_sv, key, key, engine, fault, D_ENGINES[readers[key]][0])
        served_x2 = serve(p_sv, "Ax2", "Ax2", E(), None, D_ENGINES["Dx2"][0])
        for name, (p, d) in VALID.items():
            if name == ALONE:
                continue
            source = served_x2 if name == "blocks_x2" else out["served"][p]
            read(d_sv, d, P_ENGINES[p][0], source, name)
        read(d_sv, "D1", E(), out["served"]["C"], "permuted_layer")
        read(d_sv, "D1", E(), out["served"]["R"], "R_before")
        read(d_sv, "Dw", E(), out["served"]["R"], "R_before_warn")
        # a token that is not one, and one that names no layout of P's (a proxy that mangles
        # it, or a forgery): that request fails under strict, before its READ, D goes on
        params = out["served"]["A"]["kv_transfer_params"]
        for tag, token in (("bad_token", "sv2:garbage"), ("forged_token", "sv1:0/1:" + "0" * 24)):
            forged = {**out["served"]["A"], "kv_transfer_params": {**params, "safeview": token}}
            read(d_sv, "D1", E(), forged, tag)
        read(d_sv, "D1", E(), out["served"]["A"], "after_bad_tokens")
        # safeview on P only: a D without it reads as vLLM alone does
        read(d_plain, "Dplain", E(), out["served"]["A"], "p_only")
        out["check_cost"] = d_sv.call(
            {"op": "check_cost", "name": "D1",
             "kv_transfer_params": out["served"]["A"]["kv_transfer_params"]}
        )  # fmt: skip
        # safeview on D only: a P without it
        ports["plain_p"] = harness.free_port()
        answer = p_plain.call(
            {"op": "serve", "name": "plain", "engine": asdict(E()), "port": ports["plain_p"],
             "remote_blocks": BLOCKS, "seed": 99}
        )  # fmt: skip
        assert answer["error"] is None, (answer["error"], p_plain.tail())
        out["served"]["plain"] = answer
        read(d_sv, "D1", E(), answer, "d_only")
        # P restarted behind the same engine id and port: first with the same layout ...
        p_sv.exit()
        serve(p_same, "R", "R", E(), None, E())
        out["served"]["R_same"] = out["served"]["R"]
        read(d_sv, "D1", E(), out["served"]["R_same"], "R_same")
        read(d_sv, "Dw", E(), out["served"]["R_same"], "R_same_warn")
        # ... then with layer 1 laid out otherwise (same shape, same layout string)
        p_same.exit()
        serve(p_other, "R", "R", E(), "permuted_layer", E())
        read(d_sv, "D1", E(), out["served"]["R"], "R_other")
        read(d_sv, "Dw", E(), out["served"]["R"], "R_other_warn")
        dump = os.environ.get("ACROSS_DUMP")  # where to keep what happened, to read it later
        if dump:
            Path(dump).write_text(json.dumps(out, indent=1), encoding="utf-8")
        yield out
    finally:
        for child in children:
            child.exit()


def _layout_events(answer: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in answer["events"] if e["event"] in ("layout_checked", "layout_mismatch")]


def _arrived(answer: dict[str, Any]) -> None:
    for read in answer["reads"]:
        assert (read["done"], read["failed"]) == (True, False), read
        assert read["oracle"]["ok"], read["oracle"]
        assert any(read["p_agents_loaded"]), read  # D holds the P agent(s) it read from


# -- what travels ------------------------------------------------------------------------------


def test_p_handshake_carries_its_manifest_and_each_request_a_short_token(
    across: dict[str, Any],
) -> None:
    served = across["served"]["A"]
    manifest = json.loads(served["payload"]["safeview_manifest"])
    assert manifest["$schema"] == "urn:safeview:manifest-wire:1"
    # vLLM's own keys are untouched
    assert {"compatibility_hash", "agent_metadata_bytes"} < set(served["payload"])
    token = served["kv_transfer_params"]["safeview"]
    assert token == f"sv1:0/1:{manifest['fingerprint'][:24]}"
    assert len(json.dumps({"safeview": token})) <= 100
    # a few KB more than vLLM's own payload at most
    plain = across["served"]["plain"]
    assert "safeview_manifest" not in plain["payload"]
    assert "safeview" not in plain["kv_transfer_params"]
    assert 0 < served["payload_bytes"] - plain["payload_bytes"] <= 4096


def test_safeview_diff_reads_a_handshake_payload_saved_from_the_side_channel(
    across: dict[str, Any],
) -> None:
    import subprocess
    import sys

    same, permuted = across["served"]["A"]["payload_file"], across["served"]["C"]["payload_file"]

    def diff(sender: str, receiver: str) -> Any:
        command = [sys.executable, "-m", "safeview", "diff", sender, receiver]
        return subprocess.run(command, capture_output=True, text=True, timeout=120)

    assert diff(same, same).returncode == 0
    refused = diff(permuted, same)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert LAYER_1 in refused.stdout + refused.stderr


# -- valid pairs pass untouched ------------------------------------------------------------------


@pytest.mark.parametrize("name", VALID)
def test_a_valid_pair_in_two_processes_passes_untouched_and_byte_identical(
    across: dict[str, Any], name: str
) -> None:
    answer = across["reads"][name]
    _arrived(answer)
    assert answer["handshake_errors"] == []
    events = _layout_events(answer)
    assert len(events) == len(answer["reads"])  # one judgement per D rank, at its handshake
    for event in events:
        assert (event["event"], event["verdict"], event["against"]) == (
            "layout_checked",
            "compatible",
            "handshake",
        )


def test_a_layer_that_contradicts_its_layout_string_is_refused_from_the_handshake_alone(
    across: dict[str, Any],
) -> None:
    answer = across["reads"]["permuted_layer"]
    [read] = answer["reads"]
    assert (read["done"], read["failed"], read["untouched"]) == (True, True, True)
    # judged while NIXL loaded P's agent, and the refused P's agent removed again
    assert read["p_agents_loaded"] == [False]
    [error] = answer["handshake_errors"]
    assert (error["type"], error["is_safeview_error"]) == ("LayoutMismatchError", True)
    assert error["attributes"]["layer"] == LAYER_1
    [event] = _layout_events(answer)
    assert (event["event"], event["against"], event["action"], event["layer"]) == (
        "layout_mismatch",
        "handshake",
        "refused",
        LAYER_1,
    )


@pytest.mark.parametrize("tag", ["bad_token", "forged_token"])
def test_under_strict_a_request_whose_token_cannot_be_judged_fails_before_its_read(
    across: dict[str, Any], tag: str
) -> None:
    answer = across["reads"][tag]
    [read] = answer["reads"]
    assert (read["done"], read["failed"], read["untouched"]) == (True, True, True)
    [event] = _layout_events(answer)
    assert (event["event"], event["verdict"], event["against"], event["when"]) == (
        "layout_checked",
        "not_judged",
        "request",
        "request",
    )
    assert "request token" in event["reason"]
    if tag == "forged_token":  # P did not change: the token is what is wrong, and it says so
        assert "is no layout of P" in event["reason"]
        assert "restarted" not in event["reason"]
    # the same P, with its own token, is read as before: D went on
    _arrived(across["reads"]["after_bad_tokens"])


def test_the_per_request_check_costs_under_10_us_once_judged(across: dict[str, Any]) -> None:
    cost = across["check_cost"]
    assert cost["error"] is None
    assert cost["verdict"] == "None"
    assert cost["seconds_per_check"] < 10e-6


# -- mixed deployments ---------------------------------------------------------------------------


def test_safeview_on_p_only_a_plain_d_handshakes_and_reads_byte_identical(
    across: dict[str, Any],
) -> None:
    answer = across["reads"]["p_only"]
    _arrived(answer)
    assert answer["handshake_errors"] == []
    assert answer["events"] == []  # nothing of safeview's runs in that D


def test_safeview_on_d_only_p_is_judged_from_its_nixl_metadata(across: dict[str, Any]) -> None:
    answer = across["reads"]["d_only"]
    _arrived(answer)
    assert answer["handshake_errors"] == []
    [event] = _layout_events(answer)
    assert (event["verdict"], event["against"]) == ("compatible", "nixl_metadata")


# -- P restarted behind the same engine id and address -------------------------------------------


def test_before_the_restart_both_decoders_read_p(across: dict[str, Any]) -> None:
    _arrived(across["reads"]["R_before"])
    _arrived(across["reads"]["R_before_warn"])


@pytest.mark.parametrize("tag", ["R_same", "R_same_warn"])
def test_a_p_restarted_with_the_same_layout_is_not_reported_as_a_layout_change(
    across: dict[str, Any], tag: str
) -> None:
    answer = across["reads"][tag]
    # vLLM's own story: no new handshake, the old agent is gone, the request fails
    [read] = answer["reads"]
    assert read["done"]
    assert read["untouched"]
    assert _layout_events(answer) == []


def test_a_p_restarted_with_another_layout_fails_the_request_before_the_read_in_words(
    across: dict[str, Any],
) -> None:
    answer = across["reads"]["R_other"]
    [read] = answer["reads"]
    assert (read["done"], read["failed"], read["untouched"]) == (True, True, True)
    [event] = _layout_events(answer)
    assert (event["event"], event["against"], event["when"], event["action"]) == (
        "layout_mismatch",
        "request",
        "request",
        "refused",
    )
    assert event["layer"] == LAYER_1
    assert "restarted behind the same engine id and address" in event["reason"]
    assert "is not the layout D judged at the handshake" in event["reason"]
    assert "judged against P's current handshake manifest" in event["reason"]


def test_under_warn_a_p_restarted_with_another_layout_is_said_in_words(
    across: dict[str, Any],
) -> None:
    answer = across["reads"]["R_other_warn"]
    [event] = _layout_events(answer)
    assert (event["event"], event["level"], event["against"]) == (
        "layout_mismatch",
        "warning",
        "request",
    )
    assert "restarted" in event["reason"]
    [read] = answer["reads"]
    assert read["done"]
    assert read["untouched"]  # vLLM's READ from the old agent fails on its own
