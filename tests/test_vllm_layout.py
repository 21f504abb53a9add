"""Two vLLM engines, one layout: safeview's plugin judges a prefill (P) / decode (D) pair of vLLM
0.33's real NIXL connector when D meets P, before any byte moves; every verdict is checked
against the bytes a real READ delivers, decoded through D's own cache tensors
(tests/vllm_layout_harness.py drives them).

Each group of pairs runs in one child process (vLLM's start-up and UCX's cost seconds; UCX may
crash an interpreter at exit). These run where vLLM and NIXL are installed; elsewhere they skip,
saying so. With ``SAFEVIEW_REQUIRE_VLLM=1`` a missing vLLM or NIXL is a failure instead.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
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

import vllm_layout_harness as harness  # type: ignore[import-not-found,unused-ignore]

from safeview.manifest import Manifest

E, Pair = harness.Engine, harness.Pair
MLA: dict[str, Any] = {"model": "deepseek_v2", "block_size": 16}  # vLLM's CPU MLA: 16 tokens
LAYER_0, LAYER_1 = (f"model.layers.{i}.self_attn.attn" for i in range(2))  # vLLM's names

#: pairs vLLM accepts and moves correctly: every one must pass untouched
VALID = {
    "identical": (E(), E()),
    "tp1_to_tp2": (E(tp=1), E(tp=2)),
    "tp2_to_tp1": (E(tp=2), E(tp=1)),
    # vllm#45330's class: more D ranks than KV heads (each head on two D ranks), P at TP 4
    "replicated_tp4_to_tp8": (E(tp=4), E(tp=8)),
    "blocks_x2_hnd": (E(block_size=32), E(block_size=64)),  # D's block = 2 of P's, reordered
    "blocks_x2_nhd": (E("LBNHC", block_size=32), E("LBNHC", block_size=64)),
    "num_blocks": (E(num_blocks=10), E(num_blocks=12)),
    "mla_identical": (E("LBNHC", **MLA), E("LBNHC", **MLA)),
    "mla_tp1_to_tp2": (E("LBNHC", tp=1, **MLA), E("LBNHC", tp=2, **MLA)),  # replicated latent
    "mla_tp2_to_tp1": (E("LBNHC", tp=2, **MLA), E("LBNHC", tp=1, **MLA)),
}
#: block-major MLA: P registers one row per block holding every layer's page
PACKED_MLA = (E("BLHNC", **MLA), E("BLHNC", **MLA))
#: vllm#42895: P's blocks (kernel blocks on CPU) larger than D's
KERNEL = (E(block_size=64), E(block_size=32))


def _pairs(policy: str, manifests: str | None) -> list[Any]:
    return [
        *(
            Pair(name, p=p, d=d, policy=policy, manifests=manifests)
            for name, (p, d) in VALID.items()
        ),
        Pair("kernel_mismatch", p=KERNEL[0], d=KERNEL[1], policy=policy, manifests=manifests),
        Pair("permuted_layer", fault="permuted_layer", policy=policy, manifests=manifests),
    ]


@pytest.fixture(scope="module")
def judged() -> Iterator[dict[tuple[str, str, str | None], dict[str, Any]]]:
    """The plugin on, as vLLM loads it: every pair under strict with one folder for both engines
    and with one folder each (P's metadata), the faulty ones under warn and off, and a D that
    reads a faulty P and a healthy one."""
    pairs = [
        *_pairs("strict", "shared"),
        *_pairs("strict", "separate"),
        Pair("kernel_mismatch", p=KERNEL[0], d=KERNEL[1], policy="warn", manifests="shared"),
        Pair("permuted_layer", fault="permuted_layer", policy="warn", manifests="shared"),
        Pair("permuted_layer", fault="permuted_layer", policy="off", manifests="shared"),
        Pair("with_healthy_peer", fault="permuted_layer", policy="strict", healthy_peer=True),
        Pair("packed_mla", p=PACKED_MLA[0], d=PACKED_MLA[1], policy="strict", manifests="shared"),
        Pair("packed_mla", p=PACKED_MLA[0], d=PACKED_MLA[1], policy="strict", manifests=None),
    ]
    run = harness.run(pairs)
    yield {(r["pair"]["name"], r["pair"]["policy"], r["pair"]["manifests"]): r for r in run.results}
    for result in run.results:
        shutil.rmtree(result["manifest_root"], ignore_errors=True)


@pytest.fixture(scope="module")
def unguarded() -> Iterator[dict[str, dict[str, Any]]]:
    """vLLM alone (``SAFEVIEW_VLLM=0``), the same faulty pairs."""
    run = harness.run(
        [
            Pair("kernel_mismatch", p=KERNEL[0], d=KERNEL[1], manifests="shared"),
            Pair("permuted_layer", fault="permuted_layer", manifests="shared"),
        ],
        env={"SAFEVIEW_VLLM": "0"},
    )
    yield {r["pair"]["name"]: r for r in run.results}
    for result in run.results:
        shutil.rmtree(result["manifest_root"], ignore_errors=True)


def _layout_events(result: dict[str, Any], when: str = "handshake") -> list[dict[str, Any]]:
    return [
        e
        for e in result["events"]
        if e["event"] in ("layout_checked", "layout_mismatch") and e["when"] == when
    ]


def _every_element_arrived(result: dict[str, Any]) -> None:
    assert result["error"] is None, result["error"]
    assert result["handshake_errors"] == []
    for read in result["reads"]:
        [(_, outcome)] = [(k, v) for k, v in read.items() if k.endswith("-P")]
        assert outcome == {"done": True, "failed": False}
        assert read["oracle"]["ok"], read["oracle"]  # D reads every byte as P meant it


def _first_wrong_in_words(read: dict[str, Any]) -> tuple[str, str]:
    """The first element D reads wrong, per the decoded READ, as ``diff`` words it."""
    [(layer, first)] = [
        (name, v["first_wrong"]) for name, v in read["oracle"]["layers"].items() if v["wrong"]
    ]
    words = f"{first['kv']} token {first['token']} head {first['global_head']} element "
    return layer, words + str(first["element"])


# -- vLLM alone --------------------------------------------------------------------------------


def test_without_safeview_a_larger_p_block_fails_every_handshake_with_a_bare_assertion(
    unguarded: dict[str, Any],
) -> None:
    result = unguarded["kernel_mismatch"]
    [error] = result["handshake_errors"]
    assert error["type"] == "AssertionError"
    assert not error["is_safeview_error"]
    assert "self_attn" not in error["message"]  # no layer named
    [read] = result["reads"]
    assert read["untouched"]
    assert result["events"] == []


def test_without_safeview_a_layer_laid_out_otherwise_arrives_wrong_and_nothing_says_so(
    unguarded: dict[str, Any],
) -> None:
    result = unguarded["permuted_layer"]
    assert result["error"] is None
    assert result["handshake_errors"] == []
    [read] = result["reads"]
    assert next(v for k, v in read.items() if k.endswith("-P")) == {"done": True, "failed": False}
    layers = read["oracle"]["layers"]
    assert layers[LAYER_1]["wrong"] > 0  # the READ succeeded and delivered wrong bytes
    assert layers[LAYER_0]["wrong"] == 0
    assert result["events"] == []
    assert result["manifest_files"]["P"] == []


# -- with safeview: valid pairs pass untouched -------------------------------------------------


@pytest.mark.parametrize("manifests", ["shared", "separate"])
@pytest.mark.parametrize("name", VALID)
def test_a_valid_pair_passes_untouched_and_every_byte_arrives_as_p_meant_it(
    judged: dict[Any, Any], name: str, manifests: str
) -> None:
    result = judged[(name, "strict", manifests)]
    _every_element_arrived(result)
    events = _layout_events(result)
    assert len(events) == len(result["reads"])  # one judgement per D rank, at its handshake
    for event in events:
        assert (event["event"], event["verdict"], event["findings"]) == (
            "layout_checked",
            "compatible",
            0,
        )
        # P's own manifest travels in its handshake (issue 28): folder or none, it is judged
        assert event["against"] == "handshake"
        assert event["layers"] == harness.LAYERS
    assert not [e for e in result["events"] if e["event"] == "layout_mismatch"]


def test_the_manifest_rebuilt_from_p_metadata_is_the_one_p_derived(judged: dict[Any, Any]) -> None:
    for name in VALID:
        shared = _layout_events(judged[(name, "strict", "shared")])
        separate = _layout_events(judged[(name, "strict", "separate")])
        assert [e["remote_fingerprints"] for e in shared] == [
            e["remote_fingerprints"] for e in separate
        ], name


# -- with safeview: the manifests written ------------------------------------------------------


def test_each_rank_writes_its_manifest_and_logs_its_fingerprint_at_registration(
    judged: dict[Any, Any],
) -> None:
    result = judged[("tp1_to_tp2", "strict", "shared")]
    p, d = "1-tp1_to_tp2-P", "1-tp1_to_tp2-D"
    # one folder per engine inside the shared one, one file per rank
    assert result["manifest_files"]["P"] == [
        f"{d}/{d}.tp0of2.manifest.json",
        f"{d}/{d}.tp1of2.manifest.json",
        f"{p}/{p}.tp0of1.manifest.json",
    ]
    folder = Path(result["manifest_dir"]["P"])
    summaries = [e for e in result["events"] if e["event"] == "registration_checked"]
    assert len(summaries) == 3  # P's rank, D's two ranks
    for summary in summaries:
        written = Path(summary["manifest_path"])
        manifest = Manifest.model_validate(result["manifests"][str(written.relative_to(folder))])
        assert summary["manifest_fingerprint"] == manifest.fingerprint
    d0 = Manifest.model_validate(result["manifests"][f"{d}/{d}.tp0of2.manifest.json"])
    assert (d0.topology.tp_rank, d0.topology.tp_size, d0.topology.engine) == (0, 2, d)
    assert (d0.topology.layout, d0.topology.kernel_block_tokens) == ("LBHNC", 32)
    assert d0.layers[LAYER_0].heads == (0, 1)
    d1 = Manifest.model_validate(result["manifests"][f"{d}/{d}.tp1of2.manifest.json"])
    assert d1.layers[LAYER_0].heads == (2, 3)
    p0 = Manifest.model_validate(result["manifests"][f"{p}/{p}.tp0of1.manifest.json"])
    assert p0.layers[LAYER_0].heads == (0, 1, 2, 3)


def test_separate_folders_hold_one_engine_each(judged: dict[Any, Any]) -> None:
    result = judged[("tp2_to_tp1", "strict", "separate")]
    index = next(i for i, name in enumerate(VALID) if name == "tp2_to_tp1") + len(VALID) + 2
    p, d = f"{index}-tp2_to_tp1-P", f"{index}-tp2_to_tp1-D"
    assert result["manifest_files"] == {
        "P": [f"{p}/{p}.tp0of2.manifest.json", f"{p}/{p}.tp1of2.manifest.json"],
        "D": [f"{d}/{d}.tp0of1.manifest.json"],
    }


@pytest.mark.parametrize(
    ("name", "status"), [("tp2_to_tp1", 0), ("blocks_x2_hnd", 0), ("permuted_layer", 1)]
)
def test_safeview_diff_reads_the_engine_folders_the_plugin_wrote(
    judged: dict[Any, Any], name: str, status: int
) -> None:
    result = judged[(name, "strict", "shared")]
    folder = Path(result["manifest_dir"]["P"])
    engines = sorted({Path(file).parts[0] for file in result["manifest_files"]["P"]})
    [d, p] = engines  # "...-D" sorts before "...-P"
    command = [sys.executable, "-m", "safeview", "diff", str(folder / p), str(folder / d)]
    done = subprocess.run([*command, "--rule", "vllm_nixl"], capture_output=True, text=True)
    assert done.returncode == status, done.stdout + done.stderr
    if status:
        assert f"{LAYER_1}: receiver page byte 256 reads K token 1 head 0" in done.stdout


@pytest.mark.parametrize(
    ("name", "status"),
    [
        ("tp1_to_tp2", 0),
        ("tp2_to_tp1", 0),
        ("replicated_tp4_to_tp8", 0),
        ("blocks_x2_hnd", 0),
        ("num_blocks", 0),
        ("permuted_layer", 1),
    ],
)
def test_safeview_diff_of_each_engines_manifest_dir_needs_no_rule(
    judged: dict[Any, Any], name: str, status: int
) -> None:
    # SAFEVIEW_MANIFEST_DIR=/m-of-P on P and /m-of-D on D: each holds its engine's folder, and
    # the manifests name vLLM's NIXL connector, whose rule the diff takes
    result = judged[(name, "strict", "separate")]
    p, d = result["manifest_dir"]["P"], result["manifest_dir"]["D"]
    done = subprocess.run([sys.executable, "-m", "safeview", "diff", p, d], capture_output=True,
                          text=True)  # fmt: skip
    assert done.returncode == status, done.stdout + done.stderr
    first = done.stdout.splitlines()[0]
    assert "rule vllm_nixl of connector NixlConnector" in first
    pair = VALID.get(name, (E(), E()))
    assert f"of TP {pair[0].tp}, receiver rank" in first
    assert first.endswith(f"of TP {pair[1].tp})")
    if status:
        assert f"{LAYER_1}: receiver page byte 256 reads K token 1 head 0" in done.stdout


def test_every_layout_event_key_is_in_the_event_table(judged: dict[Any, Any]) -> None:
    from test_readme import ALWAYS, _documented_keys  # type: ignore[import-not-found,unused-ignore]

    documented = _documented_keys()
    documented["layout_mismatch"] |= documented["layout_checked"]
    seen = set()
    for result in judged.values():
        for event in result["events"]:
            if event["event"] in ("layout_checked", "layout_mismatch", "registration_checked"):
                seen.add(event["event"])
                undocumented = set(event) - documented[event["event"]] - ALWAYS - {"level"}
                assert not undocumented, (event["event"], undocumented)
                json.dumps(event)
    assert seen == {"layout_checked", "layout_mismatch", "registration_checked"}


def test_under_off_nothing_is_written_judged_or_logged(judged: dict[Any, Any]) -> None:
    result = judged[("permuted_layer", "off", "shared")]
    assert result["manifest_files"]["P"] == []
    assert _layout_events(result) == []
    assert _layout_events(result, "startup") == []
    [read] = result["reads"]
    assert read["oracle"]["layers"][LAYER_1]["wrong"] > 0  # vLLM as it is


# -- with safeview: the kernel block mismatch of vllm#42895 -------------------------------------


@pytest.mark.parametrize("manifests", ["shared", "separate"])
def test_a_larger_p_block_is_a_safeview_error_naming_the_layer_and_both_block_sizes(
    judged: dict[Any, Any], manifests: str
) -> None:
    result = judged[("kernel_mismatch", "strict", manifests)]
    [error] = result["handshake_errors"]
    assert (error["type"], error["module"]) == ("LayoutMismatchError", "safeview.errors")
    assert error["is_safeview_error"]
    assert error["attributes"]["layer"] == LAYER_0
    assert "D's block tokens 32 are not a multiple of P's 64" in error["message"]
    [read] = result["reads"]
    assert read["untouched"]  # refused before any byte moved
    assert next(v for k, v in read.items() if k.endswith("-P")) == {"done": True, "failed": True}
    [event] = _layout_events(result)
    assert (event["event"], event["level"], event["action"]) == (
        "layout_mismatch",
        "error",
        "refused",
    )
    assert (event["kind"], event["layer"]) == ("refused", LAYER_0)
    assert event["against"] == "handshake"


def test_with_p_manifests_already_there_the_mismatch_is_said_at_start_up(
    judged: dict[Any, Any],
) -> None:
    result = judged[("kernel_mismatch", "strict", "shared")]
    [event] = _layout_events(result, "startup")
    assert (event["event"], event["level"], event["action"]) == ("layout_mismatch", "error", "none")
    assert "D's block tokens 32 are not a multiple of P's 64" in event["message"]
    separate = judged[("kernel_mismatch", "strict", "separate")]
    assert _layout_events(separate, "startup") == []  # D cannot see P's manifests


def test_under_warn_a_larger_p_block_is_an_event_and_vllm_refuses_as_it_would(
    judged: dict[Any, Any],
) -> None:
    result = judged[("kernel_mismatch", "warn", "shared")]
    [error] = result["handshake_errors"]
    assert error["type"] == "AssertionError"  # vLLM's own, as without safeview
    [event] = _layout_events(result)
    assert (event["event"], event["level"], event["action"]) == (
        "layout_mismatch",
        "warning",
        "none",
    )


# -- with safeview: a layer laid out otherwise than its engine's layout string says -------------


def test_a_layer_laid_out_otherwise_is_refused_naming_the_layer_and_the_byte(
    judged: dict[Any, Any],
) -> None:
    result = judged[("permuted_layer", "strict", "shared")]
    [error] = result["handshake_errors"]
    assert error["type"] == "LayoutMismatchError"
    assert error["is_safeview_error"]
    assert (error["attributes"]["layer"], error["attributes"]["byte"]) == (LAYER_1, 256)
    assert error["message"].startswith(
        f"{LAYER_1}: receiver page byte 256 reads K token 1 head 0 element 0, "
        "the sender wrote K token 0 head 1 element 0 there"
    )
    [read] = result["reads"]
    assert read["untouched"]  # no byte moved


def test_under_warn_the_byte_named_is_the_first_one_the_real_read_delivers_wrong(
    judged: dict[Any, Any],
) -> None:
    result = judged[("permuted_layer", "warn", "shared")]
    assert result["handshake_errors"] == []
    [read] = result["reads"]
    assert next(v for k, v in read.items() if k.endswith("-P")) == {"done": True, "failed": False}
    [event] = _layout_events(result)
    assert (event["event"], event["level"], event["kind"]) == ("layout_mismatch", "warning", "byte")
    # D's page byte the event names is the first element the decoded READ finds wrong
    layer, words = _first_wrong_in_words(read)
    assert (event["layer"], event["receiver_reads"]) == (layer, words)
    assert event["byte"] == 2 * (1 * 128)  # token 1 of head 0, fp16 rows of K|V (128 values)
    assert event["sender_wrote"] == "K token 0 head 1 element 0"


def test_without_a_shared_folder_a_layer_laid_out_otherwise_is_refused_from_p_handshake(
    judged: dict[Any, Any],
) -> None:
    # P's metadata reports the same layout string and block lengths (a manifest rebuilt from it
    # cannot see the layer); P's own manifest, which its handshake carries (issue 28), can:
    # refused before the READ, with no folder at all
    result = judged[("permuted_layer", "strict", "separate")]
    [event] = _layout_events(result)
    assert (event["verdict"], event["against"], event["layer"]) == (
        "mismatch",
        "handshake",
        LAYER_1,
    )
    [read] = result["reads"]
    assert read["untouched"]


def test_a_refused_peer_does_not_hold_up_a_healthy_one(judged: dict[Any, Any]) -> None:
    result = judged[("with_healthy_peer", "strict", "shared")]
    [read] = result["reads"]
    outcomes = {k: v for k, v in read.items() if k.endswith("-P")}
    bad = next(k for k in outcomes if "with_healthy_peer" in k)
    [good] = [k for k in outcomes if k != bad]
    assert outcomes[bad] == {"done": True, "failed": True}
    assert outcomes[good] == {"done": True, "failed": False}
    assert read["untouched"]  # nothing of the refused P arrived
    assert read["peer_oracle"]["ok"]  # every byte of the healthy one did
    [error] = result["handshake_errors"]
    assert (error["type"], error["attributes"]["layer"]) == ("LayoutMismatchError", LAYER_1)
    verdicts = {e["remote_engine"]: e["verdict"] for e in _layout_events(result)}
    assert verdicts == {bad: "mismatch", good: "compatible"}


def test_packed_mla_rows_are_judged_against_manifests_and_left_to_vllm_from_metadata(
    judged: dict[Any, Any],
) -> None:
    shared = judged[("packed_mla", "strict", "shared")]
    _every_element_arrived(shared)
    [event] = _layout_events(shared)
    assert (event["verdict"], event["against"]) == ("compatible", "handshake")
    # without a folder too: P's handshake carries its manifest (from P's NIXL metadata alone,
    # packed rows would be left to vLLM)
    alone = judged[("packed_mla", "strict", None)]
    _every_element_arrived(alone)
    [event] = _layout_events(alone)
    assert (event["verdict"], event["against"]) == ("compatible", "handshake")


# -- heads belong to the layer (issue 26, point 12) --------------------------------------------

#: a model whose config says 4 KV heads, with a layer of 8 (two page sizes in one cache)
TWO_PAGES = (4, 8, 4)
PER_LAYER_HEADS = {
    "per_layer_heads_identical": (E(layer_heads=TWO_PAGES), E(layer_heads=TWO_PAGES)),
    "per_layer_heads_tp1_to_tp2": (E(layer_heads=TWO_PAGES), E(tp=2, layer_heads=TWO_PAGES)),
    "per_layer_heads_tp2_to_tp1": (E(tp=2, layer_heads=TWO_PAGES), E(layer_heads=TWO_PAGES)),
}


@pytest.fixture(scope="module")
def per_layer_heads() -> Iterator[dict[tuple[str, str | None], dict[str, Any]]]:
    pairs = [
        Pair(name, p=p, d=d, policy="strict", manifests=manifests)
        for name, (p, d) in PER_LAYER_HEADS.items()
        for manifests in ("shared", "separate")
    ]
    run = harness.run(pairs)
    yield {(r["pair"]["name"], r["pair"]["manifests"]): r for r in run.results}
    for result in run.results:
        shutil.rmtree(result["manifest_root"], ignore_errors=True)


@pytest.mark.parametrize("manifests", ["shared", "separate"])
@pytest.mark.parametrize("name", PER_LAYER_HEADS)
def test_layers_of_other_head_counts_keep_their_manifest_and_are_judged(
    per_layer_heads: dict[Any, Any], name: str, manifests: str
) -> None:
    result = per_layer_heads[(name, manifests)]
    assert not [e for e in result["events"] if e["event"] == "integration_unavailable"], [
        e.get("reason") for e in result["events"] if e["event"] == "integration_unavailable"
    ]
    _every_element_arrived(result)  # vLLM moves these right: the oracle's word
    events = _layout_events(result)
    assert len(events) == len(result["reads"])
    for event in events:
        assert (event["event"], event["verdict"], event["findings"]) == (
            "layout_checked",
            "compatible",
            0,
        )
        assert event["layers"] == harness.LAYERS
    _, d = PER_LAYER_HEADS[name]
    written = {
        Manifest.model_validate(m).topology.engine: Manifest.model_validate(m)
        for m in result["manifests"].values()
        if Manifest.model_validate(m).topology.tp_rank == d.tp - 1
    }
    last_d = next(m for engine, m in written.items() if str(engine).endswith("-D"))
    # D's last rank holds its share of each layer's own heads
    share = [TWO_PAGES[i] // d.tp for i in range(3)]
    assert [last_d.layers[f"model.layers.{i}.self_attn.attn"].heads for i in range(3)] == [
        tuple(range((d.tp - 1) * n, d.tp * n)) for n in share
    ]
    if manifests == "shared":
        engines = Path(result["manifest_dir"]["P"]) / f"{_index(result)}-{name}"
        command = ["diff", f"{engines}-P", f"{engines}-D"]  # no --rule: the connector's
        done = subprocess.run([sys.executable, "-m", "safeview", *command], capture_output=True,
                              text=True)  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        assert "rule vllm_nixl of connector NixlConnector" in done.stdout


def _index(result: dict[str, Any]) -> str:
    return Path(result["manifest_files"]["P"][0]).parts[0].split("-")[0]


# -- a request's tp_size (its kv_transfer_params) against P's own (vllm#47764) ------------------


def _request_judge(policy: str) -> tuple[Any, Any, str]:
    """A D worker's ``WorkerLayout`` that has judged P (engine ``p``, TP 2) at the handshake,
    P's rank 0 manifest, and that manifest's request token."""
    import torch

    from safeview.manifest import describe
    from safeview.manifest.wire import request_token
    from safeview.policy import Policy
    from safeview.vllm._layout import WorkerLayout, _Peer

    def manifest(engine: str, rank: int, size: int) -> Any:
        cache = torch.zeros(4, 2, 16, 8, dtype=torch.float16, device="meta")
        topology = {"tp_rank": rank, "tp_size": size, "total_kv_heads": 4, "engine": engine,
                    "connector": "NixlConnector", "layout": "LBHNC"}  # fmt: skip
        return describe({LAYER_0: cache}, axes=("block", "head", "token", "kv|element"),
                        topology=topology)  # fmt: skip

    p0 = manifest("p", 0, 2)
    layout = WorkerLayout(object(), manifest("d", 0, 1), None, Policy(policy))
    layout.peers["p"] = _Peer({0: p0, 1: manifest("p", 1, 2)}, [0, 1])  # as the handshake left
    return layout, p0, request_token(p0)


def _request(tp_size: Any) -> Any:
    """vLLM 0.33's own ``ReqMeta`` for a request whose ``kv_transfer_params`` say ``tp_size``."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnectorMetadata

    metadata = NixlConnectorMetadata()
    params = {"remote_block_ids": [[1]], "remote_engine_id": "p", "remote_request_id": "r",
              "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": tp_size}  # fmt: skip
    metadata.add_new_req_to_recv("r", ([4],), params)
    return metadata.reqs_to_recv["r"]


def test_a_request_whose_tp_size_is_not_ps_fails_under_strict_and_the_next_right_one_passes() -> (
    None
):
    from safeview.errors import ManifestError
    from safeview.testing import capture_events

    layout, _, token = _request_judge("strict")
    with capture_events() as events:
        assert layout.check_request("good", token, _request(2)) is None
        refused = layout.check_request("proxy-default", token, _request(1))  # vllm#47764
        again = layout.check_request("proxy-default-2", token, _request(1))
        assert layout.check_request("good-2", token, _request(2)) is None  # D went on
    assert isinstance(refused, ManifestError)
    assert again is refused  # one judgement per token and claimed size
    assert refused.field == "P p: request proxy-default kv_transfer_params['tp_size']"
    assert refused.value == 1
    assert "is not P's TP size 2" in str(refused)
    assert "pages would be placed for TP 1" in str(refused)
    [event] = [e for e in events if e["event"].startswith("layout_")]
    assert (event["verdict"], event["against"], event["when"]) == ("not_judged", "request",
                                                                   "request")  # fmt: skip
    assert "kv_transfer_params['tp_size']" in event["reason"]
    assert event["remote_tp_size"] == 2


def test_under_warn_a_wrong_request_tp_size_is_an_event_and_the_read_goes_on() -> None:
    from safeview.testing import capture_events

    layout, _, token = _request_judge("warn")
    with capture_events() as events:
        assert layout.check_request("a", token, _request(8)) is None
        assert layout.check_request("b", token, _request(8)) is None
    [event] = [e for e in events if e["event"].startswith("layout_")]
    assert "kv_transfer_params['tp_size'] is 8" in event["reason"]


def test_the_request_check_stays_one_lookup_and_one_compare() -> None:
    import time

    layout, _, token = _request_judge("strict")
    meta = _request(2)
    assert layout.check_request("warm", token, meta) is None
    calls = 20000
    started = time.perf_counter()
    for _ in range(calls):
        layout.check_request("cost", token, meta)
    assert (time.perf_counter() - started) / calls < 10e-6
