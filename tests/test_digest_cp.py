"""The digest in context-parallel coordinates (issue 36, point 4): a rank under decode or
prefill context parallelism holds some of each block's tokens, and its digest keys each token
by its position in the request, so a prefill engine at DCP 1 and a decode engine at DCP 2 or
PCP 2 agree on equal meaning, and a block paired with the wrong rank's tokens is named by layer,
head and tokens.

The oracle: each rank's pages are written here through the placement the issue states (a token
at request position ``g`` lives on the rank at context-parallel position ``(g // I) % W``, at
that rank's slot ``(g // (I * W)) * I + g % I`` of its sequence, that is block
``slot // T`` of the request and slot ``slot % T`` of it), by torch indexing, no safeview
code; tests/test_canonical_vllm.py checks the same placement against vLLM 0.33's own
``_local_to_canonical_token`` and runs the digest on pages vLLM's placement wrote."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import safeview
from safeview.manifest import describe, heads_of_rank
from safeview.manifest.digest import Digest, chunk_tokens, combine_lanes

sys.path.insert(0, str(Path(__file__).parent))

from test_digest import LAYOUTS, _allocate, _content, _reference


@dataclass
class Ranks:
    """One engine's ranks (TP x context-parallel) holding one request."""

    tokens: int
    cp: tuple[int, int, int]  # dcp, pcp, interleave
    manifests: list[safeview.Manifest]
    caches: list[dict[str, torch.Tensor]]
    logical: list[dict[str, torch.Tensor]]  # (block, kv, slot, local head, element) views
    where: list[tuple[int, int]]  # (tp rank, cp position) of each
    blocks: list[int]

    def digests(self, num_tokens: int, blocks: list[int] | None = None) -> list[Digest]:
        ids = self.blocks if blocks is None else blocks
        return [
            safeview.digest(m, c, ids, num_tokens=num_tokens)
            for m, c in zip(self.manifests, self.caches)
        ]


def owner(g: int, size: int, interleave: int) -> tuple[int, int]:
    """The issue's placement: (context-parallel position, slot in that rank's sequence)."""
    return (g // interleave) % size, (g // (interleave * size)) * interleave + g % interleave


def cp_side(
    content: dict[str, torch.Tensor],
    *,
    tp: int = 1,
    tokens: int,
    layout: str,
    heads: int,
    dcp: int = 1,
    pcp: int = 1,
    interleave: int = 1,
    seed: int,
) -> Ranks:
    """Write ``content`` into ``tp * dcp * pcp`` ranks, each token at its owner rank's slot,
    the request's blocks at random ids (the same ids on every rank: context-parallel ranks
    share a block table), the rest of every page random."""
    any_layer = next(iter(content.values()))
    positions, size = any_layer.shape[1], any_layer.shape[3]
    width = dcp * pcp
    count = -(-positions // (tokens * width))
    num_blocks = count + 3
    generator = torch.Generator().manual_seed(seed)
    blocks = torch.randperm(num_blocks, generator=generator)[:count].tolist()
    out = Ranks(tokens, (dcp, pcp, interleave), [], [], [], [], blocks)
    for tp_rank in range(tp):
        held = heads_of_rank(tp_rank, tp, heads)
        for cp_position in range(width):
            per_layer, per_logical = {}, {}
            for name, values in content.items():
                tensor, logical = _allocate(
                    layout, num_blocks, tokens, len(held), size, values.dtype
                )
                noise = torch.randint(
                    0, 256, (tensor.untyped_storage().nbytes(),), generator=generator
                )
                torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage()).copy_(noise)
                for g in range(positions):
                    rank, slot = owner(g, width, interleave)
                    if rank == cp_position:
                        block = blocks[slot // tokens]
                        logical[block, :, slot % tokens] = values[:, g][:, list(held)]
                per_layer[name], per_logical[name] = tensor, logical
            topology = {
                "tp_rank": tp_rank,
                "tp_size": tp,
                "total_kv_heads": heads,
                "dcp_size": dcp,
                "dcp_rank": cp_position % dcp,
                "pcp_size": pcp,
                "pcp_rank": cp_position // dcp,
                "cp_kv_cache_interleave_size": interleave,
            }
            out.manifests.append(describe(per_layer, axes=LAYOUTS[layout], topology=topology))
            out.caches.append(per_layer)
            out.logical.append(per_logical)
            out.where.append((tp_rank, cp_position))
    return out


def test_p_at_dcp_1_and_d_at_dcp_2_agree_and_add_up_to_the_formula() -> None:
    content = _content(layers=2, positions=70, heads=4, size=8, dtype=torch.bfloat16, seed=1)
    p = cp_side(content, tokens=16, layout="NHD", heads=4, seed=2)
    d = cp_side(content, tp=2, tokens=16, layout="LBNHC", heads=4, dcp=2, seed=3)
    sent, received = p.digests(70), d.digests(70)
    assert [(r.cp_size, r.cp_rank) for r in received] == [(2, 0), (2, 1), (2, 0), (2, 1)]
    assert safeview.verify(sent, received) == []
    # each D rank's values are a part: only the ranks of both positions add up to the formula
    expected = _reference(content, 70, heads=4)
    layer = "model.layers.1.attn"
    assert received[0].values[layer] != {h: expected[layer][h] for h in (0, 1)}
    for head in (0, 1):
        parts = (received[0].values[layer][head], received[1].values[layer][head])
        assert combine_lanes(parts) == expected[layer][head]
    # the request's 70 tokens: D's blocks stand for 32 tokens each, three of them
    assert len(d.blocks) == 3
    assert len(p.blocks) == 5


@st.composite
def _cp_pairs(draw: st.DrawFn) -> dict[str, Any]:
    tokens = draw(st.sampled_from([4, 8, 16]))
    return {
        "heads": draw(st.sampled_from([1, 2, 4])),
        "tp": draw(st.sampled_from([1, 2])),
        "p_tokens": draw(st.sampled_from([4, 8, 16])),
        "p_cp": draw(st.sampled_from([(1, 1), (2, 1), (1, 2)])),
        "d_cp": draw(st.sampled_from([(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)])),
        "tokens": tokens,
        "interleave": draw(st.sampled_from(sorted({1, 2, tokens}))),
        "positions": draw(st.integers(1, 90)),
        "layouts": draw(st.tuples(st.sampled_from(list(LAYOUTS)), st.sampled_from(list(LAYOUTS)))),
        "dtype": draw(st.sampled_from([torch.bfloat16, torch.float32, torch.int8])),
    }


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_cp_pairs(), st.integers(0, 2**16), st.data())
def test_any_two_context_parallel_splits_agree_and_one_changed_token_is_named(
    case: dict[str, Any], seed: int, data: st.DataObject
) -> None:
    """P and D at any DCP/PCP, interleave, TP, block size and layout: equal meaning agrees;
    one byte of one token changed on the rank that holds it is named by layer, head and the
    run of tokens that holds the token; bytes past the request on any rank are not meaning."""
    heads, positions = case["heads"], case["positions"]
    num_tokens = data.draw(st.integers(1, positions), label="num_tokens")
    content = _content(
        layers=2, positions=positions, heads=heads, size=4, dtype=case["dtype"], seed=seed
    )
    (p_dcp, p_pcp), (d_dcp, d_pcp) = case["p_cp"], case["d_cp"]
    p = cp_side(content, tp=1, tokens=case["p_tokens"], layout=case["layouts"][0], heads=heads,
                dcp=p_dcp, pcp=p_pcp, interleave=min(case["interleave"], case["p_tokens"]),
                seed=seed + 1)  # fmt: skip
    d = cp_side(content, tp=case["tp"], tokens=case["tokens"], layout=case["layouts"][1],
                heads=heads, dcp=d_dcp, pcp=d_pcp, interleave=case["interleave"],
                seed=seed + 2)  # fmt: skip
    sent = p.digests(num_tokens)
    assert safeview.verify(sent, d.digests(num_tokens)) == []
    # a token past the request on some D rank: every slot past num_tokens on every rank
    width = d_dcp * d_pcp
    for g in range(num_tokens, len(d.blocks) * case["tokens"] * width):
        rank, slot = owner(g, width, case["interleave"])
        for at, (_, cp_position) in enumerate(d.where):
            if cp_position == rank:
                block = d.blocks[slot // case["tokens"]]
                for logical in d.logical[at].values():
                    logical[block, :, slot % case["tokens"]].view(torch.uint8).add_(1)
    assert safeview.verify(sent, d.digests(num_tokens)) == []
    # one token's byte, on the rank that holds it
    g = data.draw(st.integers(0, num_tokens - 1), label="token")
    name = data.draw(st.sampled_from(sorted(content)), label="layer")
    head = data.draw(st.integers(0, heads - 1), label="head")
    rank, slot = owner(g, width, case["interleave"])
    block = d.blocks[slot // case["tokens"]]
    for at, (tp_rank, cp_position) in enumerate(d.where):  # every replica of the head
        held = heads_of_rank(tp_rank, case["tp"], heads)
        if cp_position == rank and head in held:
            row = d.logical[at][name][block, 1, slot % case["tokens"], held.index(head)]
            row.view(torch.uint8)[0] += 1
    received = d.digests(num_tokens)
    findings = [f for f in safeview.verify(sent, received) if f.kind == "digest"]
    assert [(f.layer, f.heads) for f in findings] == [(name, (head,))]
    run = chunk_tokens(num_tokens)
    first = g // run * run
    assert findings[0].tokens == (first, min(first + run, num_tokens) - 1)
    assert f"{first:,} to " in findings[0].message


def test_the_dcp_zip_pairing_is_named_by_layer_head_and_tokens() -> None:
    """ROCm/ATOM#2008's loop: P at DCP 1 hands D (DCP 4) its blocks with ``zip(src, dst)``, so
    D's block ``j`` on every rank holds P's block ``j`` whole, the first ceil(n/4) of P's
    blocks, and each D rank reads other ranks' tokens at its slots. Every geometric check
    passes (the pages are the same size); the digest names the first layer, the heads and
    tokens 0 to 15."""
    content = _content(layers=2, positions=64, heads=2, size=8, dtype=torch.bfloat16, seed=11)
    p = cp_side(content, tokens=16, layout="LBHNC", heads=2, seed=12)
    d = cp_side(content, tokens=16, layout="LBHNC", heads=2, dcp=4, seed=13)
    sent = p.digests(64)
    assert safeview.verify(sent, d.digests(64)) == []
    for at in range(4):  # the zip: D block j <- P block j, on every rank
        for name in content:
            for j, block in enumerate(d.blocks):
                d.caches[at][name][block] = p.caches[0][name][p.blocks[j]]
    findings = safeview.verify(sent, d.digests(64))
    assert [(f.kind, f.layer, f.heads, f.tokens) for f in findings] == [
        ("digest", name, (0, 1), (0, 15)) for name in content
    ]
    assert "first tokens that differ are 0 to 15 (of 64" in findings[0].message


def test_one_block_paired_with_the_wrong_ranks_tokens_names_that_blocks_tokens() -> None:
    """D at DCP 2: one block of rank 1 holds rank 0's tokens of that block (its pages swapped
    with the other rank's). The digest names the layer, both heads and the first run of the
    block's tokens (block 2 stands for tokens 64 to 95: the first run that differs is 64-79)."""
    content = _content(layers=1, positions=100, heads=2, size=8, dtype=torch.float16, seed=21)
    p = cp_side(content, tokens=8, layout="NHD", heads=2, seed=22)
    d = cp_side(content, tokens=16, layout="LBHNC", heads=2, dcp=2, seed=23)
    name = "model.layers.0.attn"
    block = d.blocks[2]
    d.caches[1][name][block] = d.caches[0][name][block]
    findings = safeview.verify(p.digests(100), d.digests(100))
    assert [(f.layer, f.heads, f.tokens, f.receiver_rank) for f in findings] == [
        (name, (0, 1), (64, 79), 0)
    ]


def test_both_sides_split_alike_compare_rank_by_rank_and_one_rank_alone() -> None:
    """P and D at the same DCP and interleave (another block size): each D rank compares with
    P's rank of the same context-parallel position, so one D rank is judged alone; with another
    split, one D rank alone is not all of the request's tokens, and is said not compared."""
    content = _content(layers=2, positions=40, heads=2, size=4, dtype=torch.bfloat16, seed=31)
    p = cp_side(content, tokens=8, layout="HND", heads=2, dcp=2, interleave=4, seed=32)
    d = cp_side(content, tokens=16, layout="LBNHC", heads=2, dcp=2, interleave=4, seed=33)
    sent, received = p.digests(40), d.digests(40)
    assert safeview.verify(sent, received) == []
    assert safeview.verify(sent, received[1]) == []
    d.logical[1]["model.layers.0.attn"][d.blocks[0], 0, 5, 1].view(torch.uint8)[1] += 1
    findings = safeview.verify(sent, d.digests(40)[1])
    assert [(f.kind, f.heads) for f in findings] == [("digest", (1,))]
    assert "context-parallel rank 1" in findings[0].message
    # P at DCP 1: D's rank 1 alone holds half the tokens
    whole = cp_side(content, tokens=16, layout="NHD", heads=2, seed=34)
    findings = safeview.verify(whole.digests(40), received[1])
    assert {f.kind for f in findings} == {"digest_unmatched"}
    assert "context-parallel rank" in findings[0].message


def test_a_context_parallel_digest_round_trips_on_the_wire() -> None:
    content = _content(layers=2, positions=40, heads=2, size=4, dtype=torch.bfloat16, seed=41)
    d = cp_side(content, tokens=8, layout="NHD", heads=2, dcp=2, pcp=2, interleave=2, seed=42)
    for one in d.digests(40):
        assert Digest.from_wire(one.to_wire()) == one
        assert (one.cp_size, one.cp_interleave) == (4, 2)
        assert len(one.tokens[0]) == 3  # 40 tokens in runs of 16


def test_num_tokens_past_what_the_ranks_blocks_stand_for_is_an_argument_error() -> None:
    content = _content(layers=1, positions=40, heads=2, size=4, dtype=torch.bfloat16, seed=51)
    d = cp_side(content, tokens=8, layout="NHD", heads=2, dcp=2, seed=52)
    manifest, caches = d.manifests[0], d.caches[0]
    safeview.digest(manifest, caches, d.blocks, num_tokens=48)  # 3 blocks of 16 tokens
    with pytest.raises(safeview.ArgumentError, match="over 2 context-parallel ranks"):
        safeview.digest(manifest, caches, d.blocks, num_tokens=49)
