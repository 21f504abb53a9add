"""``SAFEVIEW_DIGEST`` on SGLang 0.5.23's prefill/decode over Mooncake TCP, on CPU (issue 39,
point 3): P digests a sampled room's pages, the digest travels on SGLang's ZMQ channel, D digests
what its pool holds and judges before SGLang's receiver reports the room done.

SGLang's own managers run in processes (``tests/sglang_harness.py``, as ``tests/test_sglang.py``
runs them); every case is decided by the bytes D's pool holds. They run where SGLang is
installed (``.venv-sglang``); ``SAFEVIEW_REQUIRE_SGLANG=1`` makes a missing SGLang a failure.
"""

from __future__ import annotations

import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from test_sglang import (  # type: ignore[import-not-found,unused-ignore]
    ALONE,
    MISSING,
    PAGE_SIZE,
    _pair,
    _ranks,
    _run,
)

pytestmark = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")


def _digesting(policy: str = "strict", sampling: str = "all") -> dict[str, str]:
    return {
        "SAFEVIEW_HARNESS_INSTALL": "1",
        "SAFEVIEW_BOUNDS_POLICY": policy,
        "SAFEVIEW_DIGEST": sampling,
    }


def _digest_events(side: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in side["events"] if e["event"] in ("digest_checked", "digest_mismatch")]


# P bf16, 4 KV heads of 16, pages of 4 tokens; P's pages 1 and 2 into D's 3 and 5. "corrupt":
# byte 37 of D's page 5 (the room's second page) in the V buffer of layer 1 (buffer 3: K0, K1,
# V0, V1) changes once the transfer is done, before D's receiver says so: V token 0 of that
# page, head 1, byte 5 (16 bf16 values, 32 bytes, a head)
EQUAL: list[dict[str, Any]] = [
    {"name": "equal"},
    {"name": "tokens", "num_tokens": 7},  # the last page holds 3 of the request's 7 tokens
    {"name": "corrupt_strict", "corrupt": [3, 1, 37]},
    {"name": "corrupt_warn", "corrupt": [3, 1, 37], "decode_policy": "warn"},
    {"name": "digest_lost", "digest_fault": "lost"},  # P's digest message never arrives
    {"name": "digest_unmade", "digest_fault": "unmade"},  # P has none: it sends its reason
]
for _case in EQUAL:
    _case.update(prefill={}, decode={}, src_pages=[1, 2], dst_pages=[3, 5])


@pytest.mark.slow
def test_equal_layouts_agree_and_a_byte_changed_after_the_transfer_fails_the_room_at_decode() -> (
    None
):
    prefill, decode = _pair(EQUAL, _digesting(), _digesting())
    # equal layouts: SGLang moved the pages, D holds them byte for byte, and D's digest of
    # them agrees with P's, which came on SGLang's channel
    for name in ("equal", "tokens"):
        assert prefill[name]["state"] == decode[name]["state"] == "Success", name
        assert decode[name]["received"] == prefill[name]["sent"], name
    verdicts = _digest_events(decode)
    assert [(e["event"], e.get("verdict"), e["request"]) for e in verdicts] == [
        ("digest_checked", "agree", "1"),
        ("digest_checked", "agree", "2"),
        ("digest_mismatch", "mismatch", "3"),
        ("digest_mismatch", "mismatch", "4"),
        ("digest_checked", "not_judged", "5"),
        ("digest_checked", "not_judged", "6"),
    ], verdicts
    assert [e["num_tokens"] for e in verdicts] == [8, 7, 8, 8, None, None]
    assert (verdicts[0]["layers"], verdicts[0]["heads"]) == (2, 8)  # 2 layers x 4 heads
    assert verdicts[0]["remote_engine"].startswith("sglang-prefill@127.0.0.1:")
    # one byte changed in D's pool after the transfer: under strict the room fails at D as
    # SGLang fails a transfer, the reason naming the layer, the head and the first tokens
    assert prefill["corrupt_strict"]["state"] == "Success"  # P's transfer went through
    assert decode["corrupt_strict"]["state"] == "Failed"
    reason = decode["corrupt_strict"]["reason"]
    assert "safeview: request 3: layers.1: head 1 read differently" in reason, reason
    assert "first tokens that differ are 0 to 7" in reason, reason  # one run of 16 tokens
    assert decode["corrupt_strict"]["received"] != prefill["corrupt_strict"]["sent"]
    said = [(e["layer"], e["layer_heads"], e["action"]) for e in verdicts[2:4]]
    # under warn (the second): the event, and the room goes on as SGLang alone would take it
    assert said == [("layers.1", [1], "refused"), ("layers.1", [1], "none")], said
    warned = verdicts[3]
    assert warned["policy"] == "warn"
    assert decode["corrupt_warn"]["state"] == "Success"
    sent, got = prefill["corrupt_warn"]["sent"], decode["corrupt_warn"]["received"]
    assert [a == b for a, b in zip(sent, got)] == [True, True, True, False]
    # P's digest lost on the way: D holds the room back at most 5 s, then lets it go on
    # unjudged, saying which P rank's digest did not come; P without a digest sends its
    # reason, which D's event gives. Both rooms moved byte for byte and succeed.
    for name in ("digest_lost", "digest_unmade"):
        assert prefill[name]["state"] == decode[name]["state"] == "Success", name
        assert decode[name]["received"] == prefill[name]["sent"], name
    lost, unmade = verdicts[4]["reason"], verdicts[5]["reason"]
    assert re.fullmatch(
        r"P's digest of prefill rank 127\.0\.0\.1:\d+ did not come within 5 s", lost
    ), lost
    assert re.fullmatch(
        r"P could not digest the room \(127\.0\.0\.1:\d+: P noted none of the room's "
        r"pages\)",
        unmade,
    ), unmade
    # P's side says nothing of the digests: it sends, D judges
    assert not _digest_events(prefill)


# attention TP 2 into 1 and 1 into 2 (SGLang's send_kvcache_slice), P's pages written by
# meaning: each D rank's digest of its heads agrees with P's ranks' digests combined. In 2->1,
# one byte of D's pool changed after the transfer: head 3 (P rank 1's) named
_TP: dict[str, list[dict[str, Any]]] = {
    "2->1": [
        {"name": "tp", "prefill": {"tp_size": 2, "heads": 2}, "decode": {"heads": 4}},
        {"name": "tp_corrupt", "prefill": {"tp_size": 2, "heads": 2}, "decode": {"heads": 4},
         "corrupt": [0, 0, 4 * 32 * 3 + 100]},  # K of layer 0, token 3, head 3, byte 4
    ],
    "1->2": [
        {"name": "tp", "prefill": {"heads": 4},
         "decode": {"tp_size": 2, "heads": 2, "total_heads": 4}},
    ],
}  # fmt: skip
for _cases in _TP.values():
    for _case in _cases:
        _case.update(src_pages=[1, 2], dst_pages=[3, 5], by_meaning=True)


@pytest.mark.slow
def test_another_attention_tp_agrees_by_meaning_and_a_changed_byte_names_its_global_head() -> None:
    with ThreadPoolExecutor(2) as pool:
        runs = {
            split: pool.submit(_ranks, cases, _digesting(), _digesting())
            for split, cases in _TP.items()
        }
        found = {split: run.result() for split, run in runs.items()}
    for split, (prefills, decodes) in found.items():
        for rank, decode in enumerate(decodes):
            # heads split right (every byte means what P's meant) and the digests agree:
            # D rank's heads against P's ranks' digests combined
            assert decode["tp"]["state"] == "Success", (split, decode["tp"])
            assert decode["tp"]["wrong_bytes"] == 0, split
            verdict = _digest_events(decode)[0]
            assert (verdict["event"], verdict["verdict"]) == ("digest_checked", "agree"), split
            assert verdict["heads"] == 2 * (4 // len(decodes)), (split, rank)
            assert verdict["tp_size"] == len(decodes)
            assert verdict["remote_tp_size"] == len(prefills), split
        for prefill in prefills:
            assert prefill["tp"]["state"] == "Success", split
    (decode,) = found["2->1"][1]
    assert decode["tp_corrupt"]["state"] == "Failed"
    reason = decode["tp_corrupt"]["reason"]
    assert re.search(r"layers\.0: head 3 read differently .*\(sender rank 1,", reason), reason
    assert "first tokens that differ are 0 to 7" in reason, reason
    (mismatch,) = [e for e in decode["events"] if e["event"] == "digest_mismatch"]
    assert mismatch["remote_engine"].count("sglang-prefill@") == 2  # both P ranks' digests


# equal layouts, one side without safeview (or, in the last pair, sampling every other room)
ONE_SIDED: list[dict[str, Any]] = [
    {"name": "one_sided", "prefill": {}, "decode": {}, "src_pages": [1, 2], "dst_pages": [3, 5]},
    {"name": "second", "prefill": {}, "decode": {}, "src_pages": [4, 6], "dst_pages": [7, 9]},
]


@pytest.mark.slow
def test_a_side_without_safeview_is_not_judged_and_never_gets_a_frame_it_does_not_know() -> None:
    frames = {"SAFEVIEW_HARNESS_FRAMES": "1"}
    with ThreadPoolExecutor(3) as pool:
        # D digests, P is SGLang alone: nothing to compare, never a failure
        unjudged = pool.submit(_pair, ONE_SIDED[:1], ALONE, _digesting())
        # P digests, D is SGLang alone (it sent no manifest): P sends it nothing of safeview's
        alone = pool.submit(_pair, ONE_SIDED[:1], _digesting(), {**ALONE, **frames})
        # P samples every other room (by number: room 2, not room 1), D every room
        halves = pool.submit(_pair, ONE_SIDED, _digesting(sampling="sample:2"), _digesting())
        (alone_prefill, digest_decode), (digest_prefill, alone_decode) = (
            unjudged.result(),
            alone.result(),
        )
        half_prefill, half_decode = halves.result()
    assert alone_prefill["one_sided"]["state"] == digest_decode["one_sided"]["state"] == "Success"
    assert digest_decode["one_sided"]["received"] == alone_prefill["one_sided"]["sent"]
    (verdict,) = _digest_events(digest_decode)
    assert (verdict["event"], verdict["verdict"]) == ("digest_checked", "not_judged")
    assert "sent no manifest (no safeview there)" in verdict["reason"], verdict
    # the room succeeds byte for byte, and D's decode thread was offered SGLang's messages only
    assert digest_prefill["one_sided"]["state"] == alone_decode["one_sided"]["state"] == "Success"
    assert alone_decode["one_sided"]["received"] == digest_prefill["one_sided"]["sent"]
    seen = alone_decode["one_sided"]["frames"]
    assert seen, alone_decode
    assert not [frame for frame in seen if frame.startswith("safeview")], seen
    # a P that does not sample a room says so at the handshake: D does not wait for it
    for name in ("one_sided", "second"):
        assert half_decode[name]["state"] == "Success", name
        assert half_decode[name]["received"] == half_prefill[name]["sent"], name
    first, second = _digest_events(half_decode)
    assert (first["request"], first["verdict"], second["request"], second["verdict"]) == (
        "1", "not_judged", "2", "agree",
    ), (first, second)  # fmt: skip
    assert first["reason"].endswith("does not digest this room (its SAFEVIEW_DIGEST is sample:2)")


@pytest.mark.slow
def test_a_vllm_manifest_with_another_head_size_is_diffed_against_sglangs_by_its_first_byte(
    tmp_path: Path,
) -> None:
    # a vLLM P and an SGLang D cannot be joined (docs/sglang.md); their manifests are compared
    # by meaning: vLLM's FlashAttention layout on meta, with SGLang's head size and with twice
    # it, against SGLang's real pool (4 heads of 16 bf16 values)
    import torch

    from safeview.manifest import describe

    (document,) = _run("pools", 0, [{"kind": "mha"}], {})
    (tmp_path / "sglang.json").write_text(document["manifest"])
    topology = {"total_kv_heads": 4, "kernel_block_tokens": 4, "logical_block_tokens": 4}
    verdicts = {}
    for head_dim in (16, 32):
        caches = {
            f"layers.{i}": torch.empty(
                (2, 17, PAGE_SIZE, 4, head_dim), dtype=torch.bfloat16, device="meta"
            )
            for i in range(2)
        }
        manifest = describe(
            caches, axes=("kv", "block", "token", "head", "element"), topology=topology
        )
        path = tmp_path / f"vllm{head_dim}.json"
        path.write_text(manifest.to_json())
        done = subprocess.run(
            [sys.executable, "-m", "safeview", "diff", "--rule", "page_copy", str(path),
             str(tmp_path / "sglang.json")],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        verdicts[head_dim] = (done.returncode, done.stdout + done.stderr)
    assert verdicts[16][0] == 0, verdicts[16]
    assert verdicts[32][0] == 1, verdicts[32]
    assert "layers.0: receiver page byte 32 reads K token 0 head 1 element 0" in verdicts[32][1], (
        verdicts[32][1]
    )
