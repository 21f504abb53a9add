"""What an operator sees (issue 38): safeview's verdicts and each request's KV on vLLM 0.33's
own metrics, with its real NIXL connector on CPU, P and D in separate processes
(tests/vllm_metrics_harness.py, after tests/vllm_across_harness.py).

Real requests go from P to D; then each process does what vLLM does with its connectors' stats
(aggregated over the workers, pickled, a dict to the front end) and its own ``KVConnectorProm``
and ``KVConnectorLogging`` observe them; the test reads ``prometheus_client``'s registry as a
scraper reads ``/metrics`` (its text exposition) and the periodic line vLLM's logger wrote.

The processes: P with safeview (``SAFEVIEW_DIGEST=all``, leases of 1 s), P without
(``SAFEVIEW_VLLM=0``, the one that dies), D with safeview (``SAFEVIEW_DIGEST=all``,
``kv_load_failure_policy`` ``recompute``; engines under strict and under warn) and D without.
One D process hosts two engines here: its counts are the process's, as they are in a real
engine's process.
Engine-starting: ``--slow``. With ``SAFEVIEW_REQUIRE_VLLM=1`` a missing vLLM or NIXL fails.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import tempfile
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import vllm_metrics_harness as harness  # type: ignore[import-not-found,unused-ignore]

from safeview import log

if os.environ.get("SAFEVIEW_REQUIRE_VLLM") == "1":
    import nixl  # type: ignore[import-untyped,unused-ignore]  # noqa: F401  (CI: must import)
    import vllm  # noqa: F401
HERE = importlib.util.find_spec("vllm") is not None and importlib.util.find_spec("nixl") is not None
#: the tests that start engines: vLLM and NIXL installed, and ``--slow``
engines = pytest.mark.skipif(
    not HERE, reason="vLLM and NIXL are not both installed here; .ci/run tests against them"
)

E = harness.Engine
BLOCKS = [1, 2, 3]
# D's page of one block on its one rank: 3 layers x 4 KV heads x 32 tokens x (K|V 128 fp16)
D_BLOCK_BYTES = 3 * 4 * 32 * 128 * 2


def _samples(exposition: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The exposition as a scraper parses it: (sample name, its labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    found = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def _value(samples: dict[Any, float], name: str, **labels: str) -> float:
    """A sample's value (``model_name`` and ``engine`` as the harness's front end says)."""
    wanted = {"model_name": "metrics-model", "engine": "0", **labels}
    return samples[(name, tuple(sorted(wanted.items())))]


def _line(answer: dict[str, Any]) -> dict[str, str]:
    """vLLM's periodic line, ``KV Transfer metrics: k=v, ...``, as a dict."""
    [line] = answer["lines"]
    body = line.removeprefix("KV Transfer metrics: ")
    return dict(part.split("=", 1) for part in body.split(", "))


@pytest.fixture(scope="module")
def run() -> Iterator[dict[str, Any]]:
    if not HERE:
        pytest.skip("vLLM and NIXL are not both installed here; .ci/run tests against them")
    models = harness.write_models(Path(tempfile.mkdtemp(prefix="safeview-metrics-models-")))
    digests = {"SAFEVIEW_DIGEST": "all"}
    p_sv = harness.Child("P", models, {**digests, "METRICS_KV_LEASE_S": "1"})
    p_plain = harness.Child("P", models, {"SAFEVIEW_VLLM": "0"})
    d_sv = harness.Child("D", models, {**digests, "METRICS_KV_LOAD_FAILURE_POLICY": "recompute"})
    d_plain = harness.Child("D", models, {"SAFEVIEW_VLLM": "0"})
    children = [p_sv, p_plain, d_sv, d_plain]
    out: dict[str, Any] = {"served": {}, "reads": {}, "metrics": {}}

    def call(child: Any, command: dict[str, Any]) -> dict[str, Any]:
        answer: dict[str, Any] = child.call(command)
        assert answer["error"] is None, (answer["error"], child.tail())
        return answer

    def serve(child: Any, name: str, fault: str | None = None) -> dict[str, Any]:
        answer = call(child, {"op": "serve", "name": name, "engine": asdict(E()),
                              "port": harness.free_port(), "fault": fault,
                              "remote_blocks": BLOCKS, "seed": len(out["served"]) + 1})  # fmt: skip
        out["served"][name] = answer
        return answer

    def read(child: Any, d_name: str, served: dict[str, Any], tag: str, **more: Any) -> Any:
        answer = call(child, {"op": "read", "name": d_name, "p": asdict(E()), "tag": tag,
                              "kv_transfer_params": served["kv_transfer_params"],
                              "caches": served["caches"], "p_agents": served["agents"],
                              **more})  # fmt: skip
        out["reads"][tag] = answer
        return answer

    try:
        for name, fault in (("A", None), ("C", "permuted_layer"), ("F", None)):
            serve(p_sv, name, fault)
        serve(p_plain, "X")
        more = call(p_plain, {"op": "finish", "name": "X", "engine": asdict(E()),
                              "remote_blocks": BLOCKS, "count": 1})  # fmt: skip
        for child, name, policy in ((d_sv, "D1", "strict"), (d_sv, "Dw", "warn"),
                                    (d_plain, "Dp", None)):  # fmt: skip
            call(child, {"op": "start", "name": name, "engine": asdict(E()), "policy": policy})
        # the same good read on a D without safeview and on one with it, each alone
        read(d_plain, "Dp", out["served"]["A"], "plain_good")
        out["metrics"]["plain"] = call(d_plain, {"op": "metrics"})
        read(d_sv, "D1", out["served"]["A"], "good")
        out["metrics"]["good"] = call(d_sv, {"op": "metrics"})
        # a refused pair under strict, the same pair under warn
        read(d_sv, "D1", out["served"]["C"], "refused_strict")
        read(d_sv, "Dw", out["served"]["C"], "mismatch_warn")
        # a byte of P's changed after its digest: the digest refuses the request
        call(p_sv, {"op": "flip", "name": "F", "rank": 0, "layer": "model.layers.0.self_attn.attn",
                    "block": BLOCKS[0], "head": 0, "token": 0, "byte": 0})  # fmt: skip
        read(d_sv, "D1", out["served"]["F"], "digest_refused")
        # a P without safeview: read once, then it dies and the next READ fails
        read(d_sv, "D1", out["served"]["X"], "plain_p")
        p_plain.exit()
        dead = {**out["served"]["X"], "kv_transfer_params": more["kv_transfer_params"][0]}
        read(d_sv, "D1", dead, "read_fails")
        out["metrics"]["end"] = call(d_sv, {"op": "metrics"})
        # on P: a request no D reads, freed when its lease runs out
        out["unread"] = call(p_sv, {"op": "unread", "name": "A", "engine": asdict(E()),
                                    "remote_blocks": BLOCKS})  # fmt: skip
        out["metrics"]["p"] = call(p_sv, {"op": "metrics", "name": "A"})
        out["p_output"] = list(p_sv.output)  # P's own log (vLLM's handler: standard output)
        dump = os.environ.get("METRICS_DUMP")  # where to keep what happened, to read it later
        if dump:
            Path(dump).write_text(json.dumps(out, indent=1), encoding="utf-8")
        yield out
    finally:
        for child in children:
            child.exit()


def _events(run: dict[str, Any], *names: str) -> list[dict[str, Any]]:
    return [e for r in run["reads"].values() for e in r["events"] if e["event"] in names]


def _outcome(run: dict[str, Any], tag: str) -> tuple[bool, bool]:
    [read] = run["reads"][tag]["reads"]
    return read["done"], read["failed"]


@engines
@pytest.mark.slow
def test_what_happened(run: dict[str, Any]) -> None:
    """The reads did what each scenario is for (the counters below are held to this)."""
    assert _outcome(run, "good") == (True, False)
    assert _outcome(run, "plain_good") == (True, False)
    assert _outcome(run, "refused_strict") == (True, True)
    assert _outcome(run, "mismatch_warn") == (True, False)
    assert _outcome(run, "digest_refused") == (True, True)
    assert _outcome(run, "plain_p") == (True, False)
    assert _outcome(run, "read_fails") == (True, True)
    handshakes = [e for e in _events(run, "layout_checked", "layout_mismatch")
                  if e["when"] == "handshake"]  # fmt: skip
    said = sorted(
        (e["remote_engine"], e["engine"], e["verdict"], e.get("action") or "") for e in handshakes
    )
    assert [(p, v) for p, _, v, _ in said] == [
        ("A", "compatible"), ("C", "mismatch"), ("C", "mismatch"), ("F", "compatible"),
        ("X", "compatible"),
    ], said  # fmt: skip
    assert sorted(a for p, _, _, a in said if p == "C") == ["none", "refused"]


@engines
@pytest.mark.slow
def test_counters_on_d_equal_what_happened(run: dict[str, Any]) -> None:
    samples = _samples(run["metrics"]["end"]["exposition"])
    handshakes = "vllm:safeview_handshakes_total"
    assert _value(samples, handshakes, verdict="compatible") == 3  # A, F, X
    assert _value(samples, handshakes, verdict="refused") == 1  # C under strict
    assert _value(samples, handshakes, verdict="mismatch") == 1  # C under warn
    assert _value(samples, handshakes, verdict="not_judged") == 0
    judged = "vllm:safeview_requests_judged_total"
    # READs issued under a compatible pair: good, digest_refused, plain_p, read_fails
    assert _value(samples, judged, verdict="compatible") == 4
    assert _value(samples, judged, verdict="mismatch") == 1  # mismatch_warn, read under warn
    assert _value(samples, judged, verdict="refused") == 1  # refused_strict: P refused
    digests = "vllm:safeview_digests_total"
    found = {v: _value(samples, digests, verdict=v) for v in ("agree", "mismatch", "refused",
                                                              "not_judged")}  # fmt: skip
    events = _events(run, "digest_checked", "digest_mismatch")
    said = {v: 0.0 for v in found}
    for event in events:
        verdict = "refused" if event.get("action") == "refused" else event["verdict"]
        said[verdict] += 1
    assert found == said
    assert found["agree"] == 1
    assert found["refused"] == 1
    requests = "vllm:safeview_kv_requests_total"
    assert _value(samples, requests, verdict="used", kind="read") == 3
    assert _value(samples, requests, verdict="recomputed", kind="refused") == 2
    assert _value(samples, requests, verdict="recomputed", kind="read_failed") == 1
    assert _value(samples, "vllm:safeview_kv_blocks_expected_total") == 6 * len(BLOCKS)
    assert _value(samples, "vllm:safeview_kv_blocks_read_total") == 3 * len(BLOCKS)
    assert _value(samples, "vllm:safeview_kv_bytes_read_total") == 3 * len(BLOCKS) * D_BLOCK_BYTES
    assert _value(samples, "vllm:safeview_digest_sampled_fraction") == 1.0


@engines
@pytest.mark.slow
def test_one_event_per_request_that_did_not_get_its_kv(run: dict[str, Any]) -> None:
    events = _events(run, "kv_not_received")
    by_reason = sorted((e["request"].rsplit("-", 1)[0], e["reason"], e["outcome"]) for e in events)
    assert by_reason == [
        ("digest_refused", "refused", "recomputed"),
        ("read_fails", "read_failed", "recomputed"),
        ("refused_strict", "refused", "recomputed"),
    ]
    for event in events:
        assert event["blocks_expected"] == len(BLOCKS)
        assert event["blocks_read"] == 0
        assert "kv_load_failure_policy" in event["message"]


@engines
@pytest.mark.slow
def test_the_periodic_log_line_carries_the_same_numbers(run: dict[str, Any]) -> None:
    good, end = _line(run["metrics"]["good"]), _line(run["metrics"]["end"])
    assert good["safeview KV reqs"] == "1"
    assert good["safeview KV used"] == "1"
    assert good["safeview KV blocks read"] == str(len(BLOCKS))
    assert good["Num successful transfers"] == "1"  # vLLM's own, in the same line
    assert (end["safeview KV reqs"], end["safeview KV used"], end["safeview KV recomputed"]) == (
        "5",
        "2",
        "3",
    )
    assert end["safeview handshakes refused"] == "1"


@engines
@pytest.mark.slow
def test_on_p_a_request_never_read_is_counted_and_said(run: dict[str, Any]) -> None:
    unread = run["unread"]
    request = "A-unread"
    assert unread["held"] == [[request]]
    assert unread["freed"] == [[request]]
    [event] = [e for e in unread["events"] if e["event"] == "kv_not_read"]
    assert (event["request"], event["reads"], event["lease_s"]) == (request, 0, 1.0)
    samples = _samples(run["metrics"]["p"]["exposition"])
    assert _value(samples, "vllm:safeview_kv_unread_requests_total", kind="never_read") == 1
    # vLLM's own count of the same
    assert _value(samples, "vllm:nixl_num_kv_expired_reqs_total") == 1
    assert _line(run["metrics"]["p"])["safeview kv_unread never_read"] == "1"


def _logged(lines: list[str], event: str) -> list[dict[str, Any]]:
    """safeview's ``event`` in a process's log lines (``key=JSON`` after vLLM's prefix)."""
    found = []
    decoder = json.JSONDecoder()
    key = re.compile(r"\s*([a-z_]+)=")
    for line in lines:
        at = line.find(f'event="{event}"')
        if at < 0:
            continue
        text, fields, index = line[at:].rstrip(), {}, 0
        while (match := key.match(text, index)) is not None:
            fields[match.group(1)], index = decoder.raw_decode(text, match.end())
        found.append(fields)
    return found


@engines
@pytest.mark.slow
def test_both_sides_log_the_pairs_verdict_with_both_fingerprints(run: dict[str, Any]) -> None:
    on_d = [e for e in _events(run, "layout_checked", "layout_mismatch")
            if e["when"] == "handshake" and e["remote_engine"] != "X"]  # fmt: skip
    on_p = _logged(run["p_output"], "layout_judged")
    said_d = sorted(
        (e["remote_engine"], e["engine"], "refused" if e.get("action") == "refused"
         else e["verdict"], tuple(e["remote_fingerprints"]), e["fingerprint"])
        for e in on_d
    )  # fmt: skip
    said_p = sorted(
        (e["engine"], e["remote_engine"], e["verdict"], tuple(e["fingerprints"]),
         e["remote_fingerprint"])
        for e in on_p
    )  # fmt: skip
    assert len(said_d) == 4  # A, C under strict, C under warn, F
    assert said_p == said_d


@engines
@pytest.mark.slow
def test_the_new_events_carry_the_keys_the_event_table_lists(run: dict[str, Any]) -> None:
    from test_readme import ALWAYS, _documented_keys  # type: ignore[import-not-found,unused-ignore]

    documented = _documented_keys()
    unread = [e for e in run["unread"]["events"] if e["event"] == "kv_not_read"]
    judged = _logged(run["p_output"], "layout_judged")
    emitted = _events(run, "kv_not_received") + unread + judged
    assert {e["event"] for e in emitted} == {"kv_not_received", "kv_not_read", "layout_judged"}
    for event in emitted:
        assert not set(event) - ALWAYS - documented[event["event"]], event


@engines
@pytest.mark.slow
def test_a_refusal_says_whether_a_setting_mends_it(run: dict[str, Any]) -> None:
    [error] = run["reads"]["refused_strict"]["handshake_errors"]
    assert error["type"] == "LayoutMismatchError"
    # C lays layer 1 out token-major behind the same dtype, layout name and sizes: no knob
    assert "no vLLM setting mends it" in error["message"]


def _vllm_own(samples: dict[Any, float]) -> dict[Any, float]:
    """vLLM's connector samples whose values do not depend on timing."""
    return {
        key: value
        for key, value in samples.items()
        if key[0].startswith("vllm:nixl_")
        and (key[0].endswith(("_count", "_total")) or "bytes" in key[0] or "descriptors" in key[0])
        and not key[0].endswith("_created")
    }


@engines
@pytest.mark.slow
def test_without_the_plugin_none_of_these_and_vllms_own_unchanged(run: dict[str, Any]) -> None:
    plain, good = run["metrics"]["plain"], run["metrics"]["good"]
    assert "vllm:safeview_" not in plain["exposition"]
    assert "safeview" not in plain["payload"]
    assert "safeview" in good["payload"]
    assert good["stats_class"] == "SafeviewKVConnectorStats"
    assert plain["stats_class"] == "NixlKVConnectorStats"
    # the connector's own stats: the same keys, and for the same read the same counts
    own = {k: v for k, v in good["payload"].items() if k != "safeview"}
    assert set(own) == set(plain["payload"])
    for key in ("bytes_transferred", "num_descriptors", "num_failed_transfers"):
        assert own[key] == plain["payload"][key], key
    # on /metrics: vLLM's families are the same, and their counts equal for the same read
    plain_samples, good_samples = _samples(plain["exposition"]), _samples(good["exposition"])
    names = {name for name, _ in plain_samples if name.startswith("vllm:")}
    assert names == {name for name, _ in good_samples if name.startswith("vllm:")
                     and not name.startswith("vllm:safeview_")}  # fmt: skip
    assert _vllm_own(plain_samples) == _vllm_own(good_samples)
    # and in vLLM's line, its own keys are the ones it writes without safeview
    assert set(_line(plain)) == {k for k in _line(good) if not k.startswith("safeview ")}


# -- without engines: the setting a refusal names, and counting at any log level ----------------


def _diff_pair(p_layout: str, d_layout: str) -> tuple[Any, Any, list[Any]]:
    from test_diff import nixl_pair  # type: ignore[import-not-found,unused-ignore]

    from safeview.manifest.diff import diff

    senders, receivers, _, _ = nixl_pair(1, 1, 4, 16, 16, p_layout, d_layout, False)
    report = diff(senders[0], receivers[0], rule="vllm_nixl")
    return report.findings[0], receivers[0], senders


def test_a_refused_layout_names_the_layout_setting_on_d() -> None:
    from safeview.vllm._settings import setting_for

    finding, receiver, senders = _diff_pair("LBHNC", "LBNHC")
    said = setting_for(finding, receiver, senders)
    assert said is not None
    assert "VLLM_KV_CACHE_LAYOUT" in said
    assert "enable_permute_local_kv" in said
    assert "on D" in said
    assert "D holds LBNHC, P LBHNC" in said


def test_another_cache_dtype_names_kv_cache_dtype_on_both_engines() -> None:
    import torch
    from test_diff import engine_rank, manifest_of  # type: ignore[import-not-found,unused-ignore]

    from safeview.manifest.diff import diff
    from safeview.vllm._settings import setting_for

    p = engine_rank(1, 0, 4, 16, "LBHNC", 3, False, 2)
    d = {
        k: v.view(torch.float16) for k, v in engine_rank(1, 0, 4, 16, "LBHNC", 3, False, 2).items()
    }
    sender = manifest_of(p, 1, 0, 4, "LBHNC", False)
    receiver = manifest_of(d, 1, 0, 4, "LBHNC", False)
    [finding, *_] = diff(sender, receiver, rule="vllm_nixl").findings
    said = setting_for(finding, receiver, [sender])
    assert said is not None
    assert "--kv-cache-dtype" in said
    assert "float16" in said
    assert "int32" in said
    assert "both engines" in said


def test_the_same_names_on_both_sides_name_no_setting() -> None:
    from safeview.vllm._settings import setting_for

    finding, receiver, _ = _diff_pair("LBHNC", "LBNHC")
    # the same manifests on both sides: whatever the finding says, no knob differs
    assert setting_for(finding, receiver, [receiver]) is None


def test_verdicts_are_counted_whatever_the_log_level() -> None:
    import logging

    counted: list[tuple[str, dict[str, Any]]] = []
    log.add_counter(lambda event, labels: counted.append((event, labels)))
    before = log.stdlib_logger.level
    log.stdlib_logger.setLevel(logging.CRITICAL)  # no event is built
    try:
        log.internal_error(where="a test", error=RuntimeError("x"))
        log.digest_checked(verdict="agree", **dict.fromkeys(log._DIGEST_KEYS))
    finally:
        log.stdlib_logger.setLevel(before)
        log._counters.pop()
    assert counted == [
        ("internal_error", {"where": "a test"}),
        ("digest_checked", {"verdict": "agree"}),
    ]


@engines
def test_a_scheduler_that_serves_no_handshake_metadata_still_marks_its_requests() -> None:
    """Telling D that P's side channel listens is an extra: a NIXL scheduler without
    ``set_xfer_handshake_metadata`` still has its requests marked for digests."""
    from safeview.manifest.digest import DigestSampling
    from safeview.vllm._digest import MARK_KEY, _guard_one_scheduler

    class Scheduler:
        engine_id = "P"

        def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any]]:
            return True, {"do_remote_prefill": True, "remote_block_ids": block_ids,
                          "remote_num_tokens": 96}  # fmt: skip

        def build_connector_meta(self) -> object:
            return object()

        def update_connector_output(self, output: Any) -> None:
            return None

    scheduler = Scheduler()
    _guard_one_scheduler(scheduler, DigestSampling("all"))
    request = type("Request", (), {"request_id": "r", "num_computed_tokens": 96})()
    _, params = scheduler.request_finished(request, [[1, 2, 3]])
    assert params[MARK_KEY] == 1
