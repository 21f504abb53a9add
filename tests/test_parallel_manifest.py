"""Every token in its place: context parallelism (DCP, PCP, the interleave) and pipeline stages
in the manifest, its JSON and wire forms and the request token; ``diff`` naming parallelism
mismatches at the first wrong byte; the field cases (ROCm/ATOM#2008's DCP ``zip`` pairing,
sglang#37175's positional PP pairing, vllm#47764's TP size in ``kv_transfer_params``) each
judged by a byte oracle: values written through the sender's placement (a token's value at its
owner rank's slot), moved as the connector moves them, decoded through the receiver's.

The placement the oracles use is the issue's own formula, in its direction (a token at
position ``g`` lives on rank ``(g // I) % W`` at slot ``(g // (I * W)) * I + g % I``), not
safeview's (slot -> position); ``tests/test_canonical_vllm.py`` judges against vLLM's own
functions where vLLM is installed.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

import pytest
import torch

from safeview.errors import ManifestError
from safeview.manifest import Manifest, assumed, canonical_bytes, describe, token_positions
from safeview.manifest.diff import diff
from safeview.manifest.wire import (
    check_transfer_params,
    from_wire,
    parse_request_token,
    request_token,
    to_wire,
    token_matches,
)

MLA = ("block", "unit", "token", "element")
ROW = 8  # float32 elements of a latent row (32 bytes a token)


def owner(g: int, size: int, interleave: int) -> tuple[int, int]:
    """The issue's placement: (context-parallel position, local slot in the block list) of
    the token at global position ``g``."""
    return (g // interleave) % size, (g // (interleave * size)) * interleave + g % interleave


def latent(
    blocks: int = 4, tokens: int = 16, topology: dict[str, Any] | None = None
) -> tuple[torch.Tensor, Manifest]:
    cache = torch.zeros(blocks, 1, tokens, ROW)
    return cache, describe({"layer": cache}, axes=MLA, topology=topology)


# -- the topology, its forms and its bad input ----------------------------------------------


def test_an_old_manifest_reads_as_dcp_pcp_pp_1_and_keeps_its_text_and_fingerprint() -> None:
    page = assumed(
        "NB_NH_BS_2HS", layers=["l"], num_blocks=2, block_tokens=2, num_heads=1,
        head_size=2, dtype="float16",
    )  # fmt: skip
    text = page.to_json(indent=None)
    for key in ("dcp", "pcp", "pp_", "interleave", "stage_layers"):
        assert key not in text
        assert key.encode() not in to_wire(page)
    read = Manifest.from_json(text)
    topology = read.topology
    assert (topology.dcp_size, topology.pcp_size, topology.pp_size) == (1, 1, 1)
    assert (topology.cp_size, topology.cp_rank, topology.stage_layers) == (1, 0, None)
    # the fingerprint docs/layouts.md pins, unchanged
    layer = "99a052e1d659534754b88e0182995540ddfefab91489bd4f966b8cd58887b4e3"
    assert read.fingerprint == hashlib.sha256(f'[["l","{layer}"]]'.encode()).hexdigest()
    assert request_token(read) == f"sv1:0/1:{read.fingerprint[:24]}"


def cp_topology(**more: Any) -> dict[str, Any]:
    return {
        "tp_rank": 1, "tp_size": 4, "dcp_size": 4, "dcp_rank": 1, "pcp_size": 2,
        "pcp_rank": 1, "cp_kv_cache_interleave_size": 8, "pp_size": 2, "pp_rank": 1,
        "stage_layers": [2, 3], **more,
    }  # fmt: skip


def two_layers(topology: dict[str, Any]) -> Manifest:
    cache = torch.zeros(3, 1, 16, ROW)
    return describe({"layers.2": cache, "layers.3": cache.clone()}, axes=MLA, topology=topology)


def test_context_parallelism_and_the_stage_round_trip_through_json_and_the_wire() -> None:
    manifest = two_layers(cp_topology())
    assert manifest.topology.cp_size == 8
    assert manifest.topology.cp_rank == 1 * 4 + 1
    read = Manifest.from_json(manifest.to_json())
    wired = from_wire(to_wire(manifest), peer="P")
    for other in (read, wired):
        assert other.topology == manifest.topology
        assert other.fingerprint == manifest.fingerprint
    # another token placement or stage is another meaning of the same bytes
    plain = two_layers({"tp_rank": 1, "tp_size": 4})
    others = {
        plain.fingerprint,
        two_layers(cp_topology(dcp_rank=2)).fingerprint,
        two_layers(cp_topology(cp_kv_cache_interleave_size=16)).fingerprint,
        two_layers(cp_topology(stage_layers=[3, 2])).fingerprint,
    }
    assert manifest.fingerprint not in others
    assert len(others) == 4


def test_the_request_token_carries_the_token_placement() -> None:
    manifest = two_layers(cp_topology())
    token = request_token(manifest)
    assert token == f"sv1:1/4:cp5/8i8:{manifest.fingerprint[:24]}"
    parsed = parse_request_token(token, peer="P")
    assert (parsed.cp_rank, parsed.cp_size, parsed.interleave) == (5, 8, 8)
    assert token_matches(parsed, manifest)
    assert not token_matches(parsed, two_layers(cp_topology(dcp_rank=2)))
    assert not token_matches(parsed, two_layers(cp_topology(dcp_size=1, dcp_rank=0)))
    with pytest.raises(ManifestError, match=r"request token: .* not a position"):
        parse_request_token(f"sv1:0/4:cp8/8i1:{'0' * 24}", peer="P")


BAD_TOPOLOGIES: dict[str, tuple[dict[str, Any], str, str]] = {
    "dcp-rank-past-its-size": ({"dcp_size": 4, "dcp_rank": 4}, "topology.dcp_rank", "dcp_size 4"),
    "pcp-rank-past-its-size": ({"pcp_size": 2, "pcp_rank": 2}, "topology.pcp_rank", "pcp_size"),
    "pp-rank-past-its-size": ({"pp_size": 2, "pp_rank": 3}, "topology.pp_rank", "pp_size 2"),
    "interleave-not-dividing-the-block": (
        {"dcp_size": 2, "cp_kv_cache_interleave_size": 3},
        "topology.cp_kv_cache_interleave_size",
        "does not divide the 16",
    ),
    "a-stage-naming-a-layer-twice": (
        {"stage_layers": [2, 2]},
        "topology.stage_layers",
        "global layer 2 twice",
    ),
    "a-stage-of-another-length": ({"stage_layers": [2]}, "topology.stage_layers", "names 1"),
    "dcp-size-zero": ({"dcp_size": 0}, "topology.dcp_size", "greater than or equal to 1"),
    "interleave-a-str": (
        {"cp_kv_cache_interleave_size": "16"},
        "topology.cp_kv_cache_interleave_size",
        "integer",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_TOPOLOGIES))
def test_bad_parallelism_is_a_manifest_error_naming_the_field(case: str) -> None:
    topology, field, limit = BAD_TOPOLOGIES[case]
    good = two_layers({})
    with pytest.raises(ManifestError) as described:
        two_layers(topology)
    data = json.loads(good.to_json())
    data["topology"].update(topology)
    data.pop("fingerprint")
    with pytest.raises(ManifestError) as read:
        Manifest.from_json(json.dumps(data))
    wire = json.loads(to_wire(good))
    wire["topology"].update(topology)
    with pytest.raises(ManifestError) as wired:
        from_wire(json.dumps(wire), peer="P")
    for error, prefix in ((described, ""), (read, "manifest: "), (wired, "P: ")):
        assert error.value.field == f"{prefix}{field}", error.value
        assert limit in str(error.value), str(error.value)


def test_a_wire_manifest_claiming_another_split_than_its_token_axis_holds_is_refused() -> None:
    """P says DCP 4 with an interleave of 32 over 16-token blocks: no rank could hold that."""
    sent = json.loads(to_wire(two_layers(cp_topology(cp_kv_cache_interleave_size=16))))
    sent["topology"]["cp_kv_cache_interleave_size"] = 32
    with pytest.raises(ManifestError) as error:
        from_wire(json.dumps(sent), peer="P rank 1")
    assert error.value.field == "P rank 1: topology.cp_kv_cache_interleave_size"
    assert "32 does not divide the 16 block tokens of layer 'layers.2'" in str(error.value)


@pytest.mark.parametrize(("size", "interleave", "tokens"), [(1, 1, 16), (2, 1, 16), (4, 16, 16),
                                                    (4, 4, 32), (8, 2, 64), (3, 2, 8)])  # fmt: skip
def test_token_positions_place_every_token_once_where_the_issue_says(
    size: int, interleave: int, tokens: int
) -> None:
    held: dict[int, tuple[int, int]] = {}
    for dcp in range(size):
        topology = describe(
            {"l": torch.zeros(1, 1, tokens, 1)},
            axes=MLA,
            topology={"dcp_size": size, "dcp_rank": dcp, "cp_kv_cache_interleave_size": interleave,
                      "tp_size": size, "tp_rank": dcp},
        ).topology  # fmt: skip
        for slot, position in enumerate(token_positions(topology, tokens)):
            assert position not in held
            held[position] = (dcp, slot)
    assert sorted(held) == list(range(tokens * size))
    assert all(held[g] == owner(g, size, interleave) for g in held)


# -- canonical_bytes without vLLM ------------------------------------------------------------


def test_canonical_bytes_of_one_rank_without_parallelism_is_the_page_itself() -> None:
    _, manifest = latent()
    page = manifest.layers["layer"].page_bytes
    assert canonical_bytes(manifest, "layer").tolist() == list(range(page))


def test_canonical_bytes_mark_padding_and_refuse_what_has_no_canonical_page() -> None:
    padded = torch.zeros(2, 1, 4, 12)[..., :8]  # 8 of 12 elements used: 16 bytes of padding
    manifest = describe({"l": padded}, axes=MLA)
    mapping = canonical_bytes(manifest, "l")
    assert (mapping[32:48] == -1).all()
    assert mapping[48] == 32
    state = describe({"s": torch.zeros(2, 1, 1, 64)}, axes=("block", "unit", "unit", "state"))
    with pytest.raises(ManifestError, match=r"layers\['s'\].kind: 'state' has no canonical"):
        canonical_bytes(state, "s")
    with pytest.raises(ManifestError, match="layer: 'x' is not a layer"):
        canonical_bytes(manifest, "x")


# -- field cases, byte oracles ----------------------------------------------------------------


def value(g: int) -> torch.Tensor:
    return torch.arange(ROW, dtype=torch.float32) + 1000.0 * (g + 1)


def first_wrong_byte(cache: torch.Tensor, want: dict[tuple[int, int], int]) -> tuple[int, int]:
    """(block, page byte) of the first cell whose value is not that of the token ``want``
    names for (block, slot), block by block, for a token-major latent page."""
    for block, slot in sorted(want):
        if not torch.equal(cache[block, 0, slot], value(want[block, slot])):
            return block, slot * ROW * 4
    return -1, -1


@pytest.mark.parametrize("interleave", [1, 16])
def test_the_dcp_zip_pairing_of_atom2008_reads_other_ranks_tokens(interleave: int) -> None:
    """P without DCP (16-token blocks, 8 blocks: 128 tokens) into D with DCP 4 by
    ``zip(src_blocks, dst_blocks)``: D rank d's block j gets P's block j, the first
    ceil(8 / 4) source blocks only. By the issue's placement D rank d's block j slot s should
    hold the token g with owner(g) = (d, 16 j + s)."""
    tokens, blocks, size = 16, 8, 4
    p_cache, p = latent(blocks, tokens)
    for g in range(blocks * tokens):
        p_cache[g // tokens, 0, g % tokens] = value(g)
    for d in range(size):
        d_cache, manifest = latent(
            blocks, tokens,
            {"tp_rank": d, "tp_size": size, "dcp_size": size, "dcp_rank": d,
             "cp_kv_cache_interleave_size": interleave},
        )  # fmt: skip
        held = blocks * tokens // size  # each rank holds a quarter of the 128 tokens
        for j in range(held // tokens or 1):
            d_cache[j] = p_cache[j]  # zip(src, dst): P block j into D block j
        want = {}
        for g in range(blocks * tokens):
            rank, slot = owner(g, size, interleave)
            if rank == d:
                want[slot // tokens, slot % tokens] = g
        wrong = first_wrong_byte(d_cache, want)
        report = diff(p, manifest, rule="page_copy")
        findings = [f for f in report.findings if f.kind == "byte"]
        assert wrong != (-1, -1)  # every D rank reads some other rank's tokens
        assert findings, report
        block, byte = wrong
        assert findings[0].byte == byte, (findings[0].message, wrong)
        assert (f"(block {block})" in findings[0].message) == (block > 0)
        # the DCP put-stride key miss, said at the manifest level: blocks stand for 16 and 64
        assert "a sender block stands for 16 tokens (DCP x PCP 1), a receiver block for 64" in (
            findings[0].message
        )
        assert findings[0].receiver_reads is not None
        assert findings[0].receiver_reads.token == (
            block * tokens * size + token_positions(manifest.topology, tokens)[byte // 32]
        )


def test_dcp_ranks_paired_rank_to_rank_with_one_placement_are_compatible() -> None:
    tokens, size, interleave = 16, 4, 4
    for d in range(size):
        topology = {"tp_rank": d, "tp_size": size, "dcp_size": size, "dcp_rank": d,
                    "cp_kv_cache_interleave_size": interleave}  # fmt: skip
        _, p = latent(4, tokens, topology)
        _, mine = latent(8, tokens, topology)
        assert diff(p, mine, rule="page_copy").compatible
        other = dict(topology, cp_kv_cache_interleave_size=8)
        assert not diff(p, latent(4, tokens, other)[1], rule="page_copy").compatible


def layers_of(
    names: list[str], stage: list[int] | None
) -> tuple[dict[str, torch.Tensor], Manifest]:
    caches = {name: torch.zeros(2, 1, 4, ROW) for name in names}
    topology = {} if stage is None else {"pp_size": 2, "stage_layers": stage}
    return caches, describe(caches, axes=MLA, topology=topology)


def test_pp_positional_pairing_of_sglang37175_copies_another_layer() -> None:
    """P is stage 1 of 2 (global layers 2 and 3), D holds all four and pairs by position: D's
    layer 0 receives P's layer 2. The oracle: values coded by global layer, copied by
    position, read back by D's layer."""
    p_caches, p = layers_of(["layers.2", "layers.3"], [2, 3])
    for index, cache in zip((2, 3), p_caches.values()):
        cache.fill_(index)
    d_caches, d = layers_of([f"layers.{i}" for i in range(4)], [0, 1, 2, 3])
    for mine, theirs in zip(d_caches.values(), p_caches.values()):  # by position
        mine.copy_(theirs)
    filled = list(d_caches.values())[: len(p_caches)]  # D's layers 2, 3 get nothing
    wrong = [i for i, cache in enumerate(filled) if (cache != i).any()]
    report = diff(p, d, rule="page_copy", by_position=True)
    byte = [f for f in report.findings if f.kind == "byte"]
    assert [f.layer for f in byte] == [f"layers.{i}" for i in wrong] == ["layers.0", "layers.1"]
    assert "global layer 0, the sender's 'layers.2' is global layer 2" in byte[0].message
    # by name, the same two manifests pair rightly: only D's layers 0 and 1 have no sender
    by_name = diff(p, d, rule="page_copy")
    assert {f.kind for f in by_name.findings} == {"missing_layer"}
    # a stage that names its layers locally ("layer.0" on every stage): the global index says
    _, local_p = layers_of(["layer.0", "layer.1"], [2, 3])
    _, local_d = layers_of(["layer.0", "layer.1"], [0, 1])
    by_local_name = diff(local_p, local_d, rule="page_copy")
    assert [f.layer for f in by_local_name.findings] == ["layer.0", "layer.1"]
    assert diff(p, layers_of(["layers.2", "layers.3"], [2, 3])[1], by_position=True).compatible


def test_eight_p_ranks_into_one_d_rank_of_vllm47764_is_named_before_a_byte_moves() -> None:
    """P runs TP 8 (one KV head each); the request's ``kv_transfer_params`` says ``tp_size``
    1 (the proxy's default). A push placed by that TP size sends all 8 P ranks' pages to D
    rank ``p * 1 // 8 = 0``: the oracle's D rank 0 ends with P rank 7's head, ranks 1-7
    with nothing."""
    heads, tp = 8, 8
    sent = [torch.full((2, 1, 16, 2 * ROW), float(p)) for p in range(tp)]
    received = [torch.zeros(2, 1, 16, 2 * ROW) for _ in range(tp)]
    claimed = 1
    for p in range(tp):
        received[p * claimed // tp].copy_(sent[p])
    held = [int(received[d][0, 0, 0, 0]) for d in range(tp)]
    assert held != list(range(heads))
    assert held[0] == 7
    p0 = describe(
        {"l": sent[0]},
        axes=("block", "head", "token", "kv|element"),
        topology={"tp_rank": 0, "tp_size": tp, "total_kv_heads": heads},
    )
    token = parse_request_token(request_token(p0), peer="P")
    reason = check_transfer_params({"tp_size": claimed, "remote_engine_id": "p"}, token)
    assert reason is not None
    assert "'tp_size'] is 1" in reason
    assert "runs TP 8" in reason
    assert check_transfer_params({"tp_size": tp}, token) is None
    assert check_transfer_params({"tp_size": True}, token) is not None
    assert check_transfer_params([], token) is not None


# -- cost ---------------------------------------------------------------------------------------


def best_of(repeat: int, run: Any) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def test_describe_with_context_parallelism_costs_about_what_it_costs_without() -> None:
    caches = {f"model.layers.{i}.attn": torch.zeros(64, 1, 16, 576) for i in range(100)}
    plain = {"tp_size": 4, "tp_rank": 1}
    spread = {**plain, "dcp_size": 4, "dcp_rank": 1, "cp_kv_cache_interleave_size": 16}
    describe(caches, axes=MLA, topology=spread)
    without = best_of(15, lambda: describe(caches, axes=MLA, topology=plain))
    with_cp = best_of(15, lambda: describe(caches, axes=MLA, topology=spread))
    assert with_cp <= 1.1 * without + 50e-6, (with_cp, without)


def test_a_100_layer_manifest_with_parallelism_stays_under_4_kb_on_the_wire() -> None:
    caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(1000, 1, 16, 576)
              for i in range(40, 140)}  # fmt: skip
    topology = {"tp_size": 8, "tp_rank": 3, "dcp_size": 8, "dcp_rank": 3, "pcp_size": 2,
                "pcp_rank": 1, "cp_kv_cache_interleave_size": 16, "pp_size": 4, "pp_rank": 1,
                "stage_layers": list(range(40, 140))}  # fmt: skip
    data = to_wire(describe(caches, axes=MLA, topology=topology))
    assert len(data) < 4096, len(data)


def test_diff_of_two_1000_layer_manifests_with_context_parallelism_under_a_second() -> None:
    names = [f"model.layers.{i}.attn" for i in range(1000)]
    caches = {name: torch.zeros(8, 1, 16, ROW) for name in names}
    p = describe(caches, axes=MLA)
    spread = {"tp_size": 4, "tp_rank": 1, "dcp_size": 4, "dcp_rank": 1}
    d = describe(caches, axes=MLA, topology={**spread, "stage_layers": list(range(1000))})
    start = time.perf_counter()
    report = diff(p, d, rule="page_copy", by_position=True)
    assert time.perf_counter() - start < 1.0
    assert len([f for f in report.findings if f.kind == "byte"]) == 1000
