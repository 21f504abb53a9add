"""safeview with SGLang 0.5.23's prefill/decode over Mooncake TCP, on CPU (issue 39).

SGLang's own managers run in processes (``tests/sglang_harness.py``): P writes through its pool,
SGLang's sender moves the pages over Mooncake TCP, D reads its pool; every case is decided by
the bytes D holds. These run where SGLang is installed (``.ci/run`` makes ``.venv-sglang`` for
it); elsewhere they skip, saying what is missing. With ``SAFEVIEW_REQUIRE_SGLANG=1`` a missing
SGLang or Mooncake is a failure instead.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

HARNESS = Path(__file__).with_name("sglang_harness.py")
PAGE_SIZE = 4  # the harness's


def _missing() -> str | None:
    for module, what in (("sglang", "SGLang 0.5.23"), ("mooncake", "Mooncake's transfer engine")):
        if importlib.util.find_spec(module) is None:
            return f"{what} is not installed here ({module!r}); .ci/run tests in .venv-sglang"
    return None


MISSING = _missing()
if MISSING and os.environ.get("SAFEVIEW_REQUIRE_SGLANG") == "1":
    raise ImportError(f"SAFEVIEW_REQUIRE_SGLANG=1: {MISSING}")  # fails the run, as it must in CI
pytestmark = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")

# P bf16, 4 KV heads of 16; D as each case says. P sends its pages 1 and 2 into D's 3 and 5.
CASES: list[dict[str, Any]] = [
    {"name": "equal", "decode": {}},
    {"name": "fp8", "decode": {"dtype": "float8_e4m3fn"}},  # sglang#19398
    {"name": "heads", "decode": {"heads": 2}},
    {"name": "head_dim", "decode": {"head_dim": 32}},
]
for _case in CASES:
    _case.update(prefill={}, src_pages=[1, 2], dst_pages=[3, 5])
# equal layouts, but D names a page past its pool (17 pages): P's descriptor runs past D's pages
CASES.append(
    {"name": "past_page", "prefill": {}, "decode": {}, "src_pages": [1, 2], "dst_pages": [3, 40]}
)
# equal layouts, but the manifest frame D sends is cut short (forged, truncated)
CASES.append(
    {"name": "forged", "prefill": {}, "decode": {}, "forge_manifest": 40, "src_pages": [1, 2],
     "dst_pages": [3, 5]}
)  # fmt: skip


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _run(
    role: str, port: int, cases: list[dict[str, Any]], env: dict[str, str], rank: int = 0
) -> list[Any]:
    """One harness process; its JSON lines (a failure shows its stderr)."""
    done = subprocess.run(
        [sys.executable, str(HARNESS), role, str(port), json.dumps(cases), str(rank)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=400,
    )
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    failed = done.returncode != 0 or any("error" in line for line in lines)
    assert not failed, (done.returncode, lines, done.stderr[-4000:])
    return lines


def _pair(
    cases: list[dict[str, Any]], prefill_env: dict[str, str], decode_env: dict[str, str]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A P and a D process through ``cases``: per case name, P's line and D's line, and every
    safeview event of each side in order (``"events"``)."""
    prefill, decode = _ranks(cases, prefill_env, decode_env)
    return prefill[0], decode[0]


def _ranks(
    cases: list[dict[str, Any]], prefill_env: dict[str, str], decode_env: dict[str, str]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A process per attention-TP rank of P and of D (``tp_size`` of the first case's sides)
    through ``cases``: per rank, as ``_pair`` gives one side."""
    port = _free_port()
    sizes = [int(cases[0][side].get("tp_size", 1)) for side in ("prefill", "decode")]
    # D starts a case once P is through with the one before (the harness's SYNC folder)
    with tempfile.TemporaryDirectory() as sync, ThreadPoolExecutor(sum(sizes)) as pool:
        futures = [
            pool.submit(_run, role, port, cases, {**env, "SAFEVIEW_HARNESS_SYNC": sync}, rank)
            for role, env, size in (
                ("prefill", prefill_env, sizes[0]),
                ("decode", decode_env, sizes[1]),
            )
            for rank in range(size)
        ]
        lines_of = [future.result() for future in futures]
    found: list[dict[str, Any]] = []
    for lines in lines_of:
        by_case: dict[str, Any] = {"events": []}
        for line in lines:
            by_case["events"] += line.pop("events", [])
            if "case" in line:
                by_case[line["case"]] = line
        found.append(by_case)
    return found[: sizes[0]], found[sizes[0] :]


def _installed(policy: str) -> dict[str, str]:
    return {"SAFEVIEW_HARNESS_INSTALL": "1", "SAFEVIEW_BOUNDS_POLICY": policy}


ALONE = {"SAFEVIEW_HARNESS_INSTALL": "0"}


def test_strict_passes_equal_layouts_byte_for_byte_and_refuses_the_others_before_a_byte_moves() -> (
    None
):
    prefill, decode = _pair(CASES, _installed("strict"), _installed("strict"))
    # equal layouts: SGLang's sender moved P's pages, and D's pool holds them byte for byte
    assert prefill["equal"]["state"] == decode["equal"]["state"] == "Success"
    assert decode["equal"]["received"] == prefill["equal"]["sent"]
    assert decode["equal"]["nonzero_bytes"] > 0
    # each other layout passes SGLang's own checks and is refused by safeview at P, naming the
    # layer and what differs; not one byte lands in D's pool
    expected = {
        # sglang#19398: named by SGLang's own item lengths too (32,768 vs 16,384 bytes an
        # item at 128-dim heads and 64-token pages; the harness's pages are smaller)
        "fp8": (
            "the receiver reads float8_e4m3fn, the sender wrote bfloat16",
            "item lengths differ: the prefill's 512 bytes an item, the decode's 256",
        ),
        "heads": (
            "the sender's page is 1,024 bytes, the receiver's 512",
            "the first byte that differs: layers.0: receiver page byte 64 reads K token 1 head 0",
        ),
        "head_dim": ("receiver page byte 32 reads K token 0 head 0 element 16", "layers.0"),
    }
    for name, words in expected.items():
        assert prefill[name]["state"] == "Failed", name
        for said in (*words, "layers.0"):
            assert said in prefill[name]["reason"], (name, said, prefill[name]["reason"])
        assert prefill[name]["reason"].count("safeview:") == 1
        assert decode[name]["state"] == "Failed", name
        assert decode[name]["nonzero_bytes"] == 0, name
    refused = [e for e in prefill["events"] if e["event"] == "layout_mismatch"]
    assert [e["action"] for e in refused] == ["refused"] * 3
    assert [e["against"] for e in refused] == ["handshake"] * 3
    # D's registration was checked before Mooncake registered it, and D sent its manifest;
    # the one D sent cut short is refused under strict, said so by name
    checked = [e for e in prefill["events"] if e["event"] == "layout_checked"]
    assert [e["verdict"] for e in checked] == ["compatible", "compatible", "not_judged"]
    assert checked[2]["reason"].startswith("the decode peer's manifest cannot be judged")
    assert prefill["forged"]["state"] == decode["forged"]["state"] == "Failed"
    assert "manifest" in prefill["forged"]["reason"]
    assert decode["forged"]["nonzero_bytes"] == 0
    # D judged P's manifest too (it came back on SGLang's ZMQ channel), with the same verdicts
    judged = [e for e in decode["events"] if e["event"] in ("layout_checked", "layout_mismatch")]
    assert [(e["event"], e.get("verdict"), e["against"]) for e in judged] == [
        ("layout_checked", "compatible", "handshake"),
        *[("layout_mismatch", "mismatch", "handshake")] * 3,
        ("layout_checked", "compatible", "handshake"),  # past_page: the layouts are equal
        ("layout_checked", "compatible", "handshake"),  # forged: D's frame, not P's
    ]
    assert all(e["remote_engine"].startswith("sglang-prefill@") for e in judged)
    # a descriptor past D's pages is refused before Mooncake runs the batch: nothing lands,
    # not even the rows of D's page 3, which lies inside its pool
    assert prefill["past_page"]["state"] == decode["past_page"]["state"] == "Failed"
    assert decode["past_page"]["nonzero_bytes"] == 0
    past = [e for e in prefill["events"] if e["event"] == "address_violation"]
    assert past, prefill["events"]
    assert past[0]["layer"] is None or past[0]["layer"].startswith("layers."), past[0]
    assert not [e for e in decode["events"] if e["event"] == "address_violation"]


def test_warn_goes_on_as_sglang_alone_with_an_event_and_a_side_without_safeview_ignores_it() -> (
    None
):
    cases = [*CASES[:3], CASES[4]]  # equal, fp8, heads, past_page
    with ThreadPoolExecutor(3) as pool:
        warned = pool.submit(_pair, cases, _installed("warn"), _installed("warn"))
        # SGLang alone on P, which gets D's manifest frame and reads past it
        alone = pool.submit(_pair, cases, ALONE, _installed("strict"))
        # a strict P and SGLang alone on D, which sends no manifest: nothing to judge
        unjudged = pool.submit(_pair, cases, _installed("strict"), ALONE)
        (warn_prefill, warn_decode), (alone_prefill, alone_decode) = (
            warned.result(),
            alone.result(),
        )
        strict_prefill, plain_decode = unjudged.result()
    for case in cases:
        name = str(case["name"])
        assert warn_prefill[name]["state"] == alone_prefill[name]["state"], name
        # which rows of a batch with a row past D's pool land before Mooncake gives up varies
        # from run to run: that case is compared by its outcome only
        keys = ("state",) if name == "past_page" else ("state", "received", "nonzero_bytes")
        for key in keys:
            assert warn_decode[name][key] == alone_decode[name][key], (name, key)
    assert [alone_prefill[str(case["name"])]["state"] for case in cases[:3]] == ["Success"] * 3
    assert alone_prefill["past_page"]["state"] == "Failed"  # Mooncake refuses the row, late
    violations = [e for e in warn_prefill["events"] if e["event"] == "address_violation"]
    assert violations, warn_prefill["events"]
    assert {e["policy"] for e in violations} == {"warn"}
    # SGLang alone moves P's pages into the fp8 and half-head pools too: bytes land in D's pool,
    # past the pages D asked for (its pages 3 and 5 stay empty)
    assert alone_decode["heads"]["nonzero_bytes"] > 0
    assert set("".join(alone_decode["heads"]["received"])) == {"0"}
    mismatches = [e for e in warn_prefill["events"] if e["event"] == "layout_mismatch"]
    assert [(e["action"], e["layer"]) for e in mismatches] == [("none", "layers.0")] * 2
    assert alone_prefill["events"] == []
    for case in cases[:3]:
        name = str(case["name"])
        assert strict_prefill[name]["state"] == alone_prefill[name]["state"], name
        assert plain_decode[name]["received"] == alone_decode[name]["received"], name
    assert strict_prefill["past_page"]["state"] == "Failed"
    verdicts = [e for e in strict_prefill["events"] if e["event"] == "layout_checked"]
    assert [e["verdict"] for e in verdicts] == ["not_judged"] * 4
    assert verdicts[0]["reason"] == "the decode peer sent no manifest (no safeview there)"


def test_decode_judges_the_prefills_manifest_and_refuses_under_strict_what_a_warn_prefill_sends(
) -> None:  # fmt: skip
    cases = [CASES[0], CASES[1]]  # equal, fp8
    prefill, decode = _pair(cases, _installed("warn"), _installed("strict"))
    # P under warn lets both go, as SGLang alone would
    assert prefill["equal"]["state"] == prefill["fp8"]["state"] == "Success"
    assert [e["action"] for e in prefill["events"] if e["event"] == "layout_mismatch"] == ["none"]
    # D judged P's manifest, sent on SGLang's channel before P read D's request: equal passes
    # byte for byte; bf16 into fp8 is refused at D, naming the dtypes and SGLang's item lengths
    assert decode["equal"]["state"] == "Success"
    assert decode["equal"]["received"] == prefill["equal"]["sent"]
    assert decode["fp8"]["state"] == "Failed"
    reason = decode["fp8"]["reason"]
    assert "safeview: layers.0: the receiver reads float8_e4m3fn" in reason, reason
    assert "the prefill's 512 bytes an item, the decode's 256" in reason, reason
    judged = [e for e in decode["events"] if e["event"] in ("layout_checked", "layout_mismatch")]
    assert [(e["event"], e.get("action")) for e in judged] == [
        ("layout_checked", None),
        ("layout_mismatch", "refused"),
    ]
    assert judged[1]["layer"] == "layers.0"


# attention TP 2 into 1 and 1 into 2 (SGLang's send_kvcache_slice): P's pages written by
# meaning (buffer, place in the request, token, global head, byte), D's checked by meaning
_TP_CASES: dict[str, list[dict[str, Any]]] = {
    "2->1": [
        {"name": "tp", "prefill": {"tp_size": 2, "heads": 2}, "decode": {"heads": 4}},
        {"name": "tp_head_dim", "prefill": {"tp_size": 2, "heads": 2},
         "decode": {"heads": 4, "head_dim": 32}},
        {"name": "tp_past_page", "prefill": {"tp_size": 2, "heads": 2}, "decode": {"heads": 4}},
    ],
    "1->2": [
        {"name": "tp", "prefill": {"heads": 4},
         "decode": {"tp_size": 2, "heads": 2, "total_heads": 4}},
        {"name": "tp_head_dim", "prefill": {"heads": 4},
         "decode": {"tp_size": 2, "heads": 2, "total_heads": 4, "head_dim": 32}},
        {"name": "tp_past_page", "prefill": {"heads": 4},
         "decode": {"tp_size": 2, "heads": 2, "total_heads": 4}},
    ],
}  # fmt: skip
for _cases in _TP_CASES.values():
    for _case in _cases:
        # tp_past_page: equal meaning, but D names a page past its pool (17 pages)
        pages = [3, 40] if _case["name"] == "tp_past_page" else [3, 5]
        _case.update(src_pages=[1, 2], dst_pages=pages, by_meaning=_case["name"] == "tp")


@pytest.mark.slow
def test_another_attention_tp_splits_heads_right_and_another_head_size_is_refused() -> None:
    with ThreadPoolExecutor(2) as pool:
        runs = {
            split: pool.submit(_ranks, cases, _installed("strict"), _installed("strict"))
            for split, cases in _TP_CASES.items()
        }
        found = {split: run.result() for split, run in runs.items()}
    for split, (prefills, decodes) in found.items():
        # heads split right: every byte of D's pages means what P's meant, on every D rank
        for decode in decodes:
            assert decode["tp"]["state"] == "Success", (split, decode["tp"])
            assert decode["tp"]["wrong_bytes"] == 0, split
            assert decode["tp"]["nonzero_bytes"] > 0, split
        for prefill in prefills:
            assert prefill["tp"]["state"] == "Success", split
            # another head size at another TP: SGLang's own check (the run fits D's slot)
            # passes it; safeview refuses it at P, naming the layer and the first byte
            assert prefill["tp_head_dim"]["state"] == "Failed", split
            reason = prefill["tp_head_dim"]["reason"]
            assert "safeview: layers.0." in reason, reason
            assert re.search(r"receiver page byte \d+ reads K token 0 head \d", reason), reason
            assert "send_kvcache_slice copies per token slot" in reason, reason
            verdicts = [
                (e["event"], e.get("action"))
                for e in prefill["events"]
                if e["event"] in ("layout_checked", "layout_mismatch")
            ]
            ranks = len(decodes)  # one verdict per D rank met, per case
            assert (
                sorted(verdicts)
                == [("layout_checked", None)] * 2 * ranks + [("layout_mismatch", "refused")] * ranks
            ), (split, verdicts)
            # send_kvcache_slice's token-slot descriptors, judged before Mooncake runs them: a
            # page past D's pool is refused, and the batches with it do not run
            assert prefill["tp_past_page"]["state"] == "Failed", split
            past = [e for e in prefill["events"] if e["event"] == "address_violation"]
            assert past, (split, prefill["events"])
            assert {e["policy"] for e in past} == {"strict"}, split
        for decode in decodes:
            assert decode["tp_past_page"]["state"] == "Failed", split
            assert decode["tp_past_page"]["nonzero_bytes"] == 0, split
            assert decode["tp_head_dim"]["state"] == "Failed", split
            assert decode["tp_head_dim"]["nonzero_bytes"] == 0, split
            mismatches = [e for e in decode["events"] if e["event"] == "layout_mismatch"]
            assert len(mismatches) == len(prefills), (split, decode["events"])


def _decode_page_bytes(document: dict[str, Any]) -> list[str]:
    """For every meaning the manifest gives each layer's page (K or V, token, head, element),
    whether the storage holds that element's code there: the mismatches, by name."""
    manifest = json.loads(document["manifest"])
    storages = document["storages"]
    wrong = []
    for layer_name, layer in manifest["layers"].items():
        axes = {axis["axis"]: axis for axis in layer["axes"]}
        itemsize = layer["itemsize"]
        index = int(layer_name.split(".")[1])
        which = layer_name.split(".")[2] if layer_name.count(".") == 2 else None
        key = f"kv.{index}" if "kv.0" in storages else f"{which or 'k'}.{index}"
        storage = bytes.fromhex(storages[key]["hex"])
        per_slot = 1
        for name in ("head", "element"):
            per_slot *= axes[name]["size"] if name in axes else 1
        slots = layer["num_blocks"] * PAGE_SIZE
        kvs = range(axes["kv"]["size"]) if "kv" in axes else [None]
        for block in (1, layer["num_blocks"] - 1):
            for kv in kvs:
                for token in range(axes["token"]["size"]):
                    for head in range(axes["head"]["size"] if "head" in axes else 1):
                        for element in range(axes["element"]["size"]):
                            at = layer["byte_offset"] + block * layer["block_stride_bytes"]
                            at += (kv or 0) * (axes["kv"]["stride_bytes"] if kv else 0)
                            at += token * axes["token"]["stride_bytes"]
                            at += head * axes["head"]["stride_bytes"] if "head" in axes else 0
                            at += element * axes["element"]["stride_bytes"]
                            buffer = 1 if (kv == 1 or which == "v") else 0
                            slot = block * PAGE_SIZE + token
                            code = (
                                (buffer * slots + slot) * per_slot
                                + head * (axes["element"]["size"])
                                + element
                            )
                            if itemsize == 1:
                                expected = (code % 251).to_bytes(1, "little")
                            else:
                                expected = (code % 2**15).to_bytes(2, "little")
                            if storage[at : at + itemsize] != expected:
                                wrong.append(f"{layer_name} block {block} kv {kv} t {token}")
    return wrong


def test_describe_pool_reads_sglangs_own_pools_off_their_strides_checked_against_bytes() -> None:
    cases: list[dict[str, Any]] = [
        {"kind": "mha"},
        {"kind": "mha", "v_head_dim": 8},
        {"kind": "mla", "latent": 24},
        {"kind": "mha", "dtype": "float8_e4m3fn"},
    ]
    documents = _run("pools", 0, cases, {})
    assert len(documents) == len(cases)
    fused, apart, latent, fp8 = (json.loads(d["manifest"]) for d in documents)
    # K and V of one layer lie in one allocation: one attention layer, K and V its outer axis
    assert sorted(fused["layers"]) == ["layers.0", "layers.1"]
    assert fused["layers"]["layers.0"]["kind"] == "attention"
    assert fused["layers"]["layers.0"]["heads"] == [0, 1, 2, 3]
    assert fused["topology"]["kernel_block_tokens"] == PAGE_SIZE
    # V's head size differs: K and V are two allocations, two layers
    assert sorted(apart["layers"]) == ["layers.0.k", "layers.0.v", "layers.1.k", "layers.1.v"]
    assert latent["layers"]["layers.0"]["kind"] == "latent"
    assert fp8["layers"]["layers.0"]["dtype"] == "float8_e4m3fn"  # stored as uint8
    for document in documents:
        assert _decode_page_bytes(document) == [], document["case"]


def test_a_window_pool_and_a_mamba_hybrid_are_read_as_their_kv_and_their_state() -> None:
    (found,) = _run("state_pools", 0, [], _installed("strict"))
    # SGLang registers the full-attention pool's buffers as the KV regions and the window
    # pool's, in their order, as its "swa" state: safeview reads both (the plugin remembers
    # each, as any MHA pool), the window's layers named after SGLang's state type
    assert found["kv_regions"] == found["state_regions"] == 4
    assert found["full_is_registered"]
    assert found["window_is_state"]
    assert found["full_layers"] == ["layers.0", "layers.1"]
    assert found["layers"] == ["layers.0", "layers.1", "swa.layers.0", "swa.layers.1"]
    assert found["parts_agree"]
    # a Mamba hybrid (HybridLinearKVPool over a MambaPool): each state tensor SGLang registers,
    # in its order, a state layer of one page per request slot, SGLang's item length
    assert found["mamba_is_state"]
    assert found["mamba_layers"] == [
        "mamba.conv.layers.0", "mamba.conv.layers.2",
        "mamba.temporal.layers.0", "mamba.temporal.layers.2",
    ]  # fmt: skip
    assert found["mamba_kinds"] == ["state"]
    assert (
        [chunk for _, chunk in found["mamba_pages"]]
        == found["mamba_items"]
        == [240] * 2 + [512] * 2
    )  # conv 40 x 3 bf16, temporal 4 x 8 x 4 float32
    assert {pages for pages, _ in found["mamba_pages"]} == {9}  # 8 slots and the padded one
    assert not [e for e in found["events"] if e["event"] == "integration_unavailable"]


# SGLang's state (sent by maybe_send_extra on the last chunk): an SWAKVPool's window KV, P's
# window pages 1 and 2 into D's 4 and 6; a Mamba hybrid's conv and temporal states, P's request
# slot 2 into D's 5. Each beside KV pages 1 and 2 into D's 3 and 5. Per kind: D's side for the
# case of another meaning (the same bytes a page or slot, which SGLang's own checks pass), and
# a page past D's state pool (the window's 9 pages; the Mamba pool's 9 slots).
STATE_KINDS: dict[str, dict[str, Any]] = {
    "swa": {
        "side": {"window": True},
        "other": {"window_heads": 8, "window_head_dim": 8},
        "pages": ([1, 2], [4, 6]),
        "past": [4, 20],
        "said": "safeview: swa.layers.0: receiver page byte 16 reads K token 0 head 1 element 0",
        "layer": "swa.layers.",
    },
    "mamba": {
        "side": {"mamba": True},
        "other": {"conv_dtype": "float16"},
        "pages": ([2], [5]),
        "past": [12],
        "said": "safeview: mamba.conv.layers.0: the receiver reads float16, the sender wrote "
        "bfloat16",
        "layer": "mamba.",
    },
}


def _state_cases(kind: str) -> list[dict[str, Any]]:
    known = STATE_KINDS[kind]
    side, (sent, received) = known["side"], known["pages"]
    cases: list[dict[str, Any]] = [
        {"name": "equal", "decode": side},
        {"name": "other", "decode": {**side, **known["other"]}},
        {"name": "past", "decode": side, "dst_state_pages": known["past"]},
    ]
    for case in cases:
        case.update(prefill=side, src_pages=[1, 2], dst_pages=[3, 5], src_state_pages=sent)
        case.setdefault("dst_state_pages", received)
    return cases


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(STATE_KINDS))
def test_a_pools_state_is_judged_as_its_kv_at_both_sides_and_in_transfer(kind: str) -> None:
    cases, known = _state_cases(kind), STATE_KINDS[kind]
    with ThreadPoolExecutor(4) as pool:
        strict = pool.submit(_pair, cases, _installed("strict"), _installed("strict"))
        warned = pool.submit(_pair, cases, _installed("warn"), _installed("warn"))
        alone = pool.submit(_pair, cases, ALONE, ALONE)
        # D's own verdict on P's state manifest: P under warn lets it go, D under strict
        decode_only = pool.submit(_pair, cases[:2], _installed("warn"), _installed("strict"))
        (prefill, decode), (warn_prefill, warn_decode) = strict.result(), warned.result()
        alone_prefill, alone_decode = alone.result()
        _, strict_decode = decode_only.result()
    # equal: SGLang moved the KV pages and the state, byte for byte
    assert prefill["equal"]["state"] == decode["equal"]["state"] == "Success"
    assert decode["equal"]["received"] == prefill["equal"]["sent"]
    assert decode["equal"]["state_received"] == prefill["equal"]["state_sent"]
    assert decode["equal"]["state_nonzero_bytes"] > 0
    # another meaning in the same bytes: SGLang alone moves it (D then reads P's bytes as
    # something else); safeview refuses the session at P, naming the state's layer and what
    # differs, before a byte moves
    assert alone_prefill["other"]["state"] == alone_decode["other"]["state"] == "Success"
    assert alone_decode["other"]["state_received"] == prefill["other"]["state_sent"]
    reason = prefill["other"]["reason"]
    assert prefill["other"]["state"] == decode["other"]["state"] == "Failed"
    assert known["said"] in reason, reason
    assert decode["other"]["nonzero_bytes"] == 0
    assert decode["other"]["state_nonzero_bytes"] == 0
    # each side judged the other's state manifest at the handshake, after the KV's
    for side in (prefill, decode):
        judged = [
            (e["event"], (e.get("layer") or "")[: len(known["layer"])])
            for e in side["events"]
            if e["event"] in ("layout_checked", "layout_mismatch")
        ]
        assert judged == [
            ("layout_checked", ""), ("layout_checked", ""),  # equal: KV, state
            ("layout_checked", ""), ("layout_mismatch", known["layer"]),  # other
            ("layout_checked", ""), ("layout_checked", ""),  # past
        ], judged  # fmt: skip
    # a state page past D's pool: the state batch is refused before Mooncake runs it (the KV
    # pages went first, in their own batches); the violation names the state's buffer
    assert prefill["past"]["state"] == decode["past"]["state"] == "Failed"
    assert decode["past"]["state_nonzero_bytes"] == 0
    assert decode["past"]["received"] == prefill["past"]["sent"]
    [violation, *_] = [e for e in prefill["events"] if e["event"] == "address_violation"]
    assert violation["layer"].startswith(known["layer"]), violation
    assert violation["policy"] == "strict"
    # under warn each goes on as SGLang alone: the same outcome and the same state bytes
    for name in ("equal", "other"):
        assert warn_prefill[name]["state"] == alone_prefill[name]["state"], name
        assert warn_decode[name]["state_received"] == alone_decode[name]["state_received"]
        assert warn_decode[name]["received"] == alone_decode[name]["received"]
    # the page past D's pool: SGLang alone hands Mooncake the batch, and which of its rows land
    # (in D's registered memory, another layer's state: the violation above) and whether
    # Mooncake refuses one varies from run to run; under warn the batch goes to Mooncake too
    # and bytes land in D's state pool; under strict none (above)
    for side in (alone_decode, warn_decode):
        assert side["past"]["state_nonzero_bytes"] > 0
    warned_events = [e["event"] for e in warn_prefill["events"]]
    assert "layout_mismatch" in warned_events
    assert "address_violation" in warned_events
    assert alone_prefill["events"] == alone_decode["events"] == []
    # D judged P's state manifest, sent back on SGLang's channel: it fails the request itself
    assert strict_decode["equal"]["state"] == "Success"
    assert strict_decode["other"]["state"] == "Failed"
    assert known["said"] in strict_decode["other"]["reason"], strict_decode["other"]["reason"]
    mismatches = [e for e in strict_decode["events"] if e["event"] == "layout_mismatch"]
    assert [(e["action"], e["layer"][: len(known["layer"])]) for e in mismatches] == [
        ("refused", known["layer"])
    ]


# the window at another attention TP (SGLang's _send_swa_state_slice): P's window pages written
# by meaning, as the KV's, and D's window pages read by meaning
_WINDOW_TP: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "2->1": ({"tp_size": 2, "heads": 2, "window": True}, {"heads": 4, "window": True}),
    "1->2": (
        {"heads": 4, "window": True},
        {"tp_size": 2, "heads": 2, "total_heads": 4, "window": True},
    ),
}


@pytest.mark.slow
def test_a_window_at_another_attention_tp_splits_heads_right_and_a_page_past_is_refused() -> None:
    runs = {}
    with ThreadPoolExecutor(2) as pool:
        for split, (prefill_side, decode_side) in _WINDOW_TP.items():
            cases = [
                {"name": name, "prefill": prefill_side, "decode": decode_side,
                 "src_pages": [1, 2], "dst_pages": [3, 5], "src_state_pages": [1, 2],
                 "dst_state_pages": pages, "by_meaning": name == "window_tp"}
                for name, pages in (("window_tp", [4, 6]), ("window_tp_past", [4, 20]))
            ]  # fmt: skip
            runs[split] = pool.submit(_ranks, cases, _installed("strict"), _installed("strict"))
        found = {split: run.result() for split, run in runs.items()}
    for split, (prefills, decodes) in found.items():
        # heads split right in the window too: every byte of D's window pages means what P's
        # meant, on every D rank
        for decode in decodes:
            assert decode["window_tp"]["state"] == "Success", (split, decode["window_tp"])
            assert decode["window_tp"]["wrong_bytes"] == 0, split
            assert decode["window_tp"]["state_wrong_bytes"] == 0, split
            assert decode["window_tp"]["state_nonzero_bytes"] > 0, split
            # a window page past D's window pool: every P rank's slice batch refused, nothing
            # of the window lands
            assert decode["window_tp_past"]["state"] == "Failed", split
            assert decode["window_tp_past"]["state_nonzero_bytes"] == 0, split
        for prefill in prefills:
            assert prefill["window_tp"]["state"] == "Success", split
            assert prefill["window_tp_past"]["state"] == "Failed", split
            past = [e for e in prefill["events"] if e["event"] == "address_violation"]
            assert past, (split, prefill["events"])
            assert {e["layer"][:4] for e in past} == {"swa."}, (split, past)
            judged = [e["event"] for e in prefill["events"] if e["event"].startswith("layout_")]
            assert judged == ["layout_checked"] * 2 * 2 * len(decodes), (split, judged)


# Mamba state at attention TP 2 into 1 (SGLang's _send_mamba_state_slice): its meaning is not
# judged, each row is checked inside one of D's slots. Mamba2 states of 2 groups (TP divides
# them: both sides agree on each rank's conv width), and of 1 group, which SGLang widens to 2
# on each of P's 2 ranks (24 conv channels a rank) but not on D's one (40): P's second rank
# writes its conv slice past the end of D's slot
_MAMBA_P = {"tp_size": 2, "heads": 2, "mamba": True, "groups": 2}
_MAMBA_D = {"heads": 4, "mamba": True, "groups": 2}
MAMBA_TP_CASES: list[dict[str, Any]] = [
    {"name": "mamba_tp", "decode": _MAMBA_D, "dst_state_pages": [5]},
    {"name": "mamba_tp_past", "decode": _MAMBA_D, "dst_state_pages": [12]},
    {"name": "mamba_tp_groups", "decode": {**_MAMBA_D, "groups": 1}, "dst_state_pages": [5]},
]
for _case in MAMBA_TP_CASES:
    _case.update(prefill=_MAMBA_P, src_pages=[1, 2], dst_pages=[3, 5], src_state_pages=[2])


@pytest.mark.slow
def test_mamba_state_at_another_attention_tp_is_checked_inside_d_slots() -> None:
    with ThreadPoolExecutor(2) as pool:
        strict = pool.submit(_ranks, MAMBA_TP_CASES, _installed("strict"), _installed("strict"))
        alone = pool.submit(_ranks, MAMBA_TP_CASES, ALONE, ALONE)
        (prefills, [decode]), (_, [plain]) = strict.result(), alone.result()
    # two groups: SGLang's slices fit D's slots; safeview lets them go, the same bytes land
    assert decode["mamba_tp"]["state"] == plain["mamba_tp"]["state"] == "Success"
    assert decode["mamba_tp"]["state_received"] == plain["mamba_tp"]["state_received"]
    assert decode["mamba_tp"]["state_nonzero_bytes"] > 0
    assert decode["mamba_tp"]["state_outside_bytes"] == 0
    # one group: SGLang alone reports success with P's second rank's conv slice run into the
    # next slot (another request's state); safeview refuses that rank's batch
    assert plain["mamba_tp_groups"]["state"] == "Success"
    assert plain["mamba_tp_groups"]["state_outside_bytes"] > 0
    assert decode["mamba_tp_groups"]["state"] == "Failed"
    assert decode["mamba_tp_groups"]["state_outside_bytes"] == 0
    # a slot past D's pool: every rank's batch refused, nothing of the state lands
    assert decode["mamba_tp_past"]["state"] == "Failed"
    assert decode["mamba_tp_past"]["state_nonzero_bytes"] == 0
    messages = [
        e["message"] for p in prefills for e in p["events"] if e["event"] == "address_violation"
    ]
    assert any("spans pages 5 and 6 of view 'mamba.conv.layers.0'" in m for m in messages)
    for prefill in prefills:
        assert prefill["mamba_tp"]["state"] == "Success"
        assert prefill["mamba_tp_past"]["state"] == "Failed"
        not_judged = [
            e["reason"] for e in prefill["events"]
            if e["event"] == "layout_checked" and e["verdict"] == "not_judged"
        ]  # fmt: skip
        assert len(not_judged) == 3, not_judged  # the state's meaning, once a case
        assert all("_send_mamba_state_slice" in reason for reason in not_judged)


def test_a_vllm_manifest_diffed_against_sglangs_by_meaning(tmp_path: Path) -> None:
    # the two engines cannot be joined (no connector speaks both bootstraps: docs/sglang.md);
    # their manifests can be compared. SGLang's from its real pool; vLLM's on meta, its
    # layers named as SGLang names them (vLLM's layer i is layers.i)
    import torch

    from safeview.manifest import describe, vllm_axes

    (document,) = _run("pools", 0, [{"kind": "mha"}], {})
    (tmp_path / "sglang.json").write_text(document["manifest"])
    topology = {"total_kv_heads": 4, "kernel_block_tokens": 4, "logical_block_tokens": 4}
    layouts = {
        # K and V outer, then blocks, tokens, heads (vLLM's FlashAttention): SGLang's meaning
        "flash": ((2, 17, PAGE_SIZE, 4, 16), ("kv", "block", "token", "head", "element")),
        # heads before tokens, K and V in the last axis (vllm_axes()): another meaning
        "hnd": ((17, 4, PAGE_SIZE, 32), vllm_axes()),
    }
    verdicts = {}
    for name, (shape, axes) in layouts.items():
        caches = {f"layers.{i}": torch.empty(shape, dtype=torch.bfloat16, device="meta")
                  for i in range(2)}  # fmt: skip
        manifest = describe(caches, axes=axes, topology=topology)
        (tmp_path / f"{name}.json").write_text(manifest.to_json())
        done = subprocess.run(
            [sys.executable, "-m", "safeview", "diff", "--rule", "page_copy",
             str(tmp_path / f"{name}.json"), str(tmp_path / "sglang.json")],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        verdicts[name] = (done.returncode, done.stdout)
    assert verdicts["flash"][0] == 0, verdicts["flash"]
    assert verdicts["hnd"][0] == 1, verdicts["hnd"]
    assert (
        "layers.0: receiver page byte 32 reads K token 0 head 1 element 0, the sender wrote "
        "V token 0 head 0 element 0 there" in verdicts["hnd"][1]
    ), verdicts["hnd"][1]


@pytest.mark.parametrize("policy", ["strict", "warn"])
@pytest.mark.parametrize(
    ("past", "buffer"),
    [
        ({"extra_pages": 1}, "layers.0.k"),
        ({"window": True, "state_extra_pages": 1}, "swa.layers.0.k"),
    ],
    ids=["kv", "window state"],
)
def test_a_region_past_its_buffer_is_refused_before_mooncake_registers_it(
    policy: str, past: dict[str, Any], buffer: str
) -> None:
    # a KV region, or the window KV of an SWAKVPool that SGLang's own setup_state_kv_args
    # registers as its "swa" state
    window = bool(past.get("window"))
    cases = [
        {"name": "whole", "extra_pages": 0, "window": window},
        {"name": "one page past", "extra_pages": 0, **past},
    ]
    whole, refused = _run("register", _free_port(), cases, _installed(policy))
    assert whole["registered"], whole
    assert not [e for e in whole["events"] if "violation" in e["event"]], whole["events"]
    assert not [e for e in whole["events"] if "left unchecked" in e.get("reason", "")]
    violations = [e for e in refused["events"] if e["event"] == "address_violation"]
    assert [v["layer"] for v in violations] == [buffer], refused["events"]
    if policy == "strict":
        assert not refused["registered"]
        assert refused["refused"].startswith("AddressError")
        assert f"meant for layer '{buffer}'" in refused["refused"]
    else:  # warn: SGLang registers it, as it would alone
        assert refused["registered"]


_LOADED_BY_SGLANG = """
import sys
sys.path.insert(0, sys.argv[1])
import sglang_harness  # the import-only stand-ins (docs/sglang.md), nothing else of the harness
sglang_harness._install_triton_stub()
sglang_harness._stand_ins()
from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
before = MooncakeKVManager.__dict__["_publish_peer_registration"]
from safeview.testing import capture_events
import sglang.srt.plugins
with capture_events() as events:
    sglang.srt.plugins.load_plugins()  # what SGLang's scheduler runs at start-up
after = MooncakeKVManager.__dict__["_publish_peer_registration"]
print([event["event"] for event in events if event.get("integration") == "sglang"], after is before)
"""


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, "['integration_installed'] False"),  # the entry point, loaded by SGLang itself
        ({"SAFEVIEW_SGLANG": "0"}, "[] True"),
        ({"SGLANG_PLUGINS": "someone_else"}, "[] True"),  # SGLang's own filter leaves it out
    ],
)
def test_sglangs_own_plugin_loader_turns_safeview_on(
    environ: dict[str, str], expected: str
) -> None:
    # the installed distribution's entry point, found and run by SGLang's load_plugins()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SAFEVIEW_", "SGLANG_PLUGINS"))}
    done = subprocess.run(
        [sys.executable, "-c", _LOADED_BY_SGLANG, str(HARNESS.parent)],
        env={**env, **environ},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip().splitlines()[-1] == expected, done.stderr[-2000:]
