"""safeview.digest and safeview.verify (issue 29): a digest over what the bytes mean, the same on
two sides that hold one request in different layouts, TP splits and block sizes.

The oracle is the request's logical content: values per (layer, K/V, position, global head,
element), written into each side's pages through that side's own layout by torch indexing (no
safeview code), so that what a digest must call equal or different is decided by the bytes;
and the formula of ``safeview.manifest.digest``'s docstring, computed here from the logical
bytes with numpy (no layout read at all)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import safeview
from safeview.errors import ArgumentError, ManifestError
from safeview.manifest import _digest_torch, describe, heads_of_rank
from safeview.manifest.digest import (
    DIGEST_CAP_BYTES,
    DIGEST_SCHEME,
    MAX_PIECE_BYTES,
    PRIME,
    Digest,
    DigestSampling,
    key,
    layer_key,
    parse_sampling,
    piece_count,
    row_weights,
    type_key,
)
from safeview.spec import DTYPE_ITEMSIZE
from safeview.vllm._background import Background

LAYOUTS = {
    # name: axes in shape order, and how a tensor of it is allocated and read logically
    "NHD": ("kv", "block", "token", "head", "element"),
    "HND": ("kv", "block", "head", "token", "element"),
    "LBHNC": ("block", "head", "token", "kv|element"),  # vLLM 0.33, head-major pages
    "LBNHC": ("block", "head", "token", "kv|element"),  # vLLM 0.33, token-major pages
    "kv_inner": ("block", "kv", "token", "head", "element"),
}
MLA_AXES = ("block", "unit", "token", "element")


def _allocate(
    layout: str, blocks: int, tokens: int, heads: int, size: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's cache in ``layout`` and the same memory as ``(block, kv, token, head,
    element)``."""
    if layout == "NHD":
        t = torch.zeros(2, blocks, tokens, heads, size, dtype=dtype)
        return t, t.permute(1, 0, 2, 3, 4)
    if layout == "HND":
        t = torch.zeros(2, blocks, heads, tokens, size, dtype=dtype)
        return t, t.permute(1, 0, 3, 2, 4)
    if layout == "LBHNC":
        t = torch.zeros(blocks, heads, tokens, 2 * size, dtype=dtype)
        return t, t.view(blocks, heads, tokens, 2, size).permute(0, 3, 2, 1, 4)
    if layout == "LBNHC":
        physical = torch.zeros(blocks, tokens, heads, 2 * size, dtype=dtype)
        logical = physical.view(blocks, tokens, heads, 2, size).permute(0, 3, 1, 2, 4)
        return physical.permute(0, 2, 1, 3), logical
    t = torch.zeros(blocks, 2, tokens, heads, size, dtype=dtype)
    return t, t


@dataclass
class Side:
    """One engine's ranks holding one request: per rank its caches, manifest and block ids."""

    tp: int
    tokens: int
    layout: str
    caches: list[dict[str, torch.Tensor]]
    logical: list[dict[str, torch.Tensor]]
    manifests: list[safeview.Manifest]
    blocks: list[int]


def _content(
    layers: int, positions: int, heads: int, size: int, dtype: torch.dtype, seed: int
) -> dict[str, torch.Tensor]:
    """The request's logical values: per layer ``(2, positions, heads, size)``, random bytes."""
    generator = torch.Generator().manual_seed(seed)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    out = {}
    for layer in range(layers):
        raw = torch.randint(0, 256, (2, positions, heads, size * itemsize), generator=generator)
        out[f"model.layers.{layer}.attn"] = raw.to(torch.uint8).view(dtype)
    return out


def _side(
    content: dict[str, torch.Tensor], *, tp: int, tokens: int, layout: str, heads: int, seed: int
) -> Side:
    """Write ``content`` into ``tp`` ranks of ``layout`` with ``tokens``-token blocks, the
    request's blocks at random ids (the rest of each cache random too: not the request's); each
    layer's cache of its content's element type."""
    any_layer = next(iter(content.values()))
    positions, size = any_layer.shape[1], any_layer.shape[3]
    count = -(-positions // tokens)
    num_blocks = count + 3
    generator = torch.Generator().manual_seed(seed)
    blocks = torch.randperm(num_blocks, generator=generator)[:count].tolist()
    caches, logicals, manifests = [], [], []
    for rank in range(tp):
        held = heads_of_rank(rank, tp, heads)
        per_layer, per_logical = {}, {}
        for name, values in content.items():
            tensor, logical = _allocate(layout, num_blocks, tokens, len(held), size, values.dtype)
            noise = torch.randint(0, 256, (tensor.untyped_storage().nbytes(),), generator=generator)
            torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage()).copy_(noise)
            for at, block in enumerate(blocks):
                first = at * tokens
                n = min(tokens, positions - first)
                logical[block, :, :n] = values[:, first : first + n][:, :, list(held)]
            per_layer[name], per_logical[name] = tensor, logical
        axes = LAYOUTS[layout]
        manifests.append(
            describe(
                per_layer,
                axes=axes,
                topology={"tp_rank": rank, "tp_size": tp, "total_kv_heads": heads},
            )
        )
        caches.append(per_layer)
        logicals.append(per_logical)
    return Side(tp, tokens, layout, caches, logicals, manifests, blocks)


def _digests(side: Side, num_tokens: int | None = None) -> list[Digest]:
    return [
        safeview.digest(m, c, side.blocks, num_tokens=num_tokens)
        for m, c in zip(side.manifests, side.caches)
    ]


def _reference(
    content: dict[str, torch.Tensor], num_tokens: int, heads: int
) -> dict[str, dict[int, int]]:
    """The documented formula (``sv-digest-2``), from the logical bytes and their element type
    alone (numpy; no layout, no torch op on a page)."""
    out: dict[str, dict[int, int]] = {}
    for name, values in content.items():
        dtype = str(values.dtype).removeprefix("torch.")
        data = values.contiguous().view(torch.int8).numpy().astype(np.int64)  # (2, pos, heads, B)
        row_bytes = data.shape[3]
        pieces = piece_count(row_bytes)
        piece = row_bytes // pieces
        r = np.array(row_weights(piece), dtype=np.int64)  # (piece, 2)
        out[name] = {}
        for head in range(heads):
            lanes = []
            for lane in range(2):
                total = 0
                for kv in range(2):
                    for position in range(num_tokens):
                        row = data[kv, position, head]
                        for p in range(pieces):
                            dot = int(row[p * piece : (p + 1) * piece] @ r[:, lane])
                            weight = key(kv, "kv", lane) * key(position, "token", lane) % PRIME
                            weight = weight * key(p, "piece", lane) % PRIME
                            total = (total + dot % PRIME * weight) % PRIME
                typed = total * key(head, "head", lane) + type_key(dtype, lane)
                lanes.append(typed % PRIME * layer_key(name, lane) % PRIME)
            out[name][head] = (lanes[0] << 31) | lanes[1]
    return out


# -- equal meaning, equal digest ------------------------------------------------------------------


def test_one_request_in_two_layouts_tp_splits_and_block_sizes_digests_alike() -> None:
    content = _content(layers=2, positions=40, heads=4, size=8, dtype=torch.bfloat16, seed=1)
    p = _side(content, tp=1, tokens=16, layout="NHD", heads=4, seed=2)
    d = _side(content, tp=2, tokens=32, layout="LBNHC", heads=4, seed=3)
    sent, received = _digests(p, 40), _digests(d, 40)
    assert safeview.verify(sent, received) == []
    # each D rank alone, against all of P: it compares the heads it holds
    for rank in received:
        assert safeview.verify(sent, rank) == []
    # and the formula, from the logical bytes alone
    expected = _reference(content, 40, heads=4)
    assert sent[0].values == expected
    assert {
        **received[0].values["model.layers.0.attn"],
        **received[1].values["model.layers.0.attn"],
    } == expected["model.layers.0.attn"]


def test_the_digest_reads_pages_without_writing_or_moving_them() -> None:
    content = _content(layers=1, positions=20, heads=2, size=8, dtype=torch.float16, seed=4)
    side = _side(content, tp=1, tokens=8, layout="HND", heads=2, seed=5)
    tensor = side.caches[0]["model.layers.0.attn"]
    before = (tensor.data_ptr(), tensor.untyped_storage().nbytes(), tensor.clone())
    safeview.digest(side.manifests[0], side.caches[0], side.blocks)
    assert tensor.data_ptr() == before[0]
    assert tensor.untyped_storage().nbytes() == before[1]
    assert torch.equal(tensor.view(torch.uint8), before[2].view(torch.uint8))


@st.composite
def _pairs(draw: st.DrawFn) -> tuple[Any, ...]:
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    tp_p = draw(st.sampled_from([1, 2, 4, 8, 16]))
    tp_d = draw(st.sampled_from([1, 2, 4, 8, 16]))
    tokens = draw(st.sampled_from([1, 2, 4, 16]))
    ratio = draw(st.sampled_from([1, 2, 4]))
    if draw(st.booleans()):
        tokens_p, tokens_d = tokens, tokens * ratio
    else:
        tokens_p, tokens_d = tokens * ratio, tokens
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float32, torch.int8, torch.float16]))
    size = draw(st.sampled_from([2, 4, 8]))
    positions = draw(st.integers(1, 40))
    num_tokens = draw(st.integers(1, positions))
    layouts = draw(st.tuples(st.sampled_from(list(LAYOUTS)), st.sampled_from(list(LAYOUTS))))
    return heads, (tp_p, tp_d), (tokens_p, tokens_d), dtype, size, positions, num_tokens, layouts


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_pairs(), st.integers(0, 2**16), st.data())
def test_equal_meaning_equal_digests_and_one_changed_byte_names_its_layer_and_head(
    pair: tuple[Any, ...], seed: int, data: st.DataObject
) -> None:
    heads, (tp_p, tp_d), (tokens_p, tokens_d), dtype, size, positions, num_tokens, layouts = pair
    content = _content(
        layers=2, positions=positions, heads=heads, size=size, dtype=dtype, seed=seed
    )
    p = _side(content, tp=tp_p, tokens=tokens_p, layout=layouts[0], heads=heads, seed=seed + 1)
    d = _side(content, tp=tp_d, tokens=tokens_d, layout=layouts[1], heads=heads, seed=seed + 2)
    sent = _digests(p, num_tokens)
    assert safeview.verify(sent, _digests(d, num_tokens)) == []
    # one byte of the request's meaning changed on one D rank: decided by the oracle (which
    # layer, head, position it is), found and named by verify
    rank = data.draw(st.integers(0, tp_d - 1), label="rank")
    name = data.draw(st.sampled_from(sorted(content)), label="layer")
    held = heads_of_rank(rank, tp_d, heads)
    local = data.draw(st.integers(0, len(held) - 1), label="local head")
    kv = data.draw(st.integers(0, 1), label="kv")
    position = data.draw(st.integers(0, num_tokens - 1), label="position")
    byte = data.draw(st.integers(0, size * content[name].element_size() - 1), label="byte")
    delta = data.draw(st.integers(1, 255), label="delta")
    logical = d.logical[rank][name]
    block = d.blocks[position // tokens_d]
    element = logical[block, kv, position % tokens_d, local]  # a view of D's own pages
    element.view(torch.uint8)[byte] += delta
    findings = safeview.verify(sent, _digests(d, num_tokens)[rank])
    assert [(f.kind, f.layer, f.heads) for f in findings] == [("digest", name, (held[local],))]
    assert findings[0].receiver_rank == rank
    assert f"head {held[local]}" in findings[0].message
    assert "context-parallel" not in findings[0].message  # neither side splits tokens so


def test_bytes_past_the_request_and_in_other_blocks_are_not_its_meaning() -> None:
    content = _content(layers=1, positions=20, heads=2, size=4, dtype=torch.bfloat16, seed=7)
    p = _side(content, tp=1, tokens=16, layout="NHD", heads=2, seed=8)
    d = _side(content, tp=1, tokens=16, layout="NHD", heads=2, seed=9)
    sent = _digests(p, 20)
    logical = d.logical[0]["model.layers.0.attn"]
    logical[d.blocks[1], 0, 10].view(torch.uint8).add_(1)  # position 26: past the 20 tokens
    other = next(b for b in range(logical.shape[0]) if b not in d.blocks)
    logical[other].view(torch.uint8).add_(1)
    assert safeview.verify(sent, _digests(d, 20)) == []
    # and position 19 is
    logical[d.blocks[1], 1, 3].view(torch.uint8).add_(1)
    assert [f.heads for f in safeview.verify(sent, _digests(d, 20))] == [(0, 1)]


def test_a_request_of_many_scattered_blocks_is_gathered_in_batches_and_digests_as_the_formula(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """More runs of consecutive ids than are read in place: on CPU the pages are gathered in
    address order, a few at a time (batches of two pages here, so that a small request takes
    many), and their products weighed with the keys of their request positions, put in that
    order: the formula's value."""
    monkeypatch.setattr(_digest_torch, "_CHUNK_BYTES", 2 * 8 * 16)  # two pages' K (or V) part
    content = _content(layers=2, positions=70, heads=2, size=8, dtype=torch.float16, seed=31)
    p = _side(content, tp=1, tokens=4, layout="HND", heads=2, seed=32)
    d = _side(content, tp=2, tokens=8, layout="LBNHC", heads=2, seed=33)
    for side in (p, d):  # the gathered path, with ids out of address order
        assert len(_digest_torch._runs(side.blocks)) > _digest_torch._MAX_RUNS
        assert side.blocks != sorted(side.blocks)
    sent, received = _digests(p, 70), _digests(d, 70)
    assert sent[0].values == _reference(content, 70, heads=2)
    assert safeview.verify(sent, received) == []
    # a block's products weighed with another position's keys would be another meaning
    d.logical[1]["model.layers.1.attn"][d.blocks[6], 1, 2, 0].view(torch.uint8).add_(1)
    findings = safeview.verify(sent, _digests(d, 70))
    assert [(f.layer, f.heads) for f in findings] == [("model.layers.1.attn", (1,))]


def test_rows_at_the_exactness_bound_digest_as_the_formula() -> None:
    """The longest row piece (16 KiB) with bytes chosen so that each row's lane-0 product is
    near its largest, and more rows per head than one float64 product may sum exactly: the
    weighted sums are cut into exact parts (a single product over all of them loses low bits
    and gives another value), on both a head-major and a token-major side."""
    weights = np.array(row_weights(MAX_PIECE_BYTES), dtype=np.int64)[:, 0]
    extreme = np.where(weights > 0, 127, -128).astype(np.int8)  # lane 0 near 128 * 64 * 16384
    row = torch.from_numpy(np.tile(extreme, 2))  # 32 KiB: two pieces
    positions = 300  # 2 K/V x 300 positions x 2 pieces = 1,200 rows per head; 256 per part
    raw = row.repeat(2, positions, 1, 1).clone()  # (K/V, position, head, bytes)
    raw[1, 5, 0, 7] = 3  # not all rows alike
    content = {"model.layers.0.attn": raw.view(torch.bfloat16)}
    plan_rows = 2 * positions * 2
    assert plan_rows > (_digest_torch._EXACT - 1) // (128 * 64 * MAX_PIECE_BYTES * 65535)
    p = _side(content, tp=1, tokens=16, layout="LBHNC", heads=1, seed=41)
    d = _side(content, tp=1, tokens=8, layout="NHD", heads=1, seed=42)
    sent, received = _digests(p, positions), _digests(d, positions)
    assert sent[0].values == _reference(content, positions, heads=1)
    assert safeview.verify(sent, received) == []


def test_layers_weighed_one_batch_or_many_digest_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan's layers are weighed together, as many as fit ``_BATCH_BYTES``: one layer per
    batch gives the same values and token values as all in one, consecutive ids and scattered
    ones, and so do token values weighed entry by entry (``_ENTRIES``)."""
    content = _content(layers=3, positions=70, heads=2, size=8, dtype=torch.bfloat16, seed=51)
    side = _side(content, tp=1, tokens=4, layout="LBNHC", heads=2, seed=52)
    assert len(_digest_torch._runs(side.blocks)) > _digest_torch._MAX_RUNS
    consecutive = list(range(len(side.blocks)))
    manifest, caches = side.manifests[0], side.caches[0]
    together = [
        safeview.digest(manifest, caches, ids, num_tokens=70) for ids in (side.blocks, consecutive)
    ]
    monkeypatch.setattr(_digest_torch, "_BATCH_BYTES", 1)
    apart = [
        safeview.digest(manifest, caches, ids, num_tokens=70) for ids in (side.blocks, consecutive)
    ]
    assert [d.values for d in apart] == [d.values for d in together]
    assert apart == together  # the token values too
    assert together[0].values == _reference(content, 70, heads=2)
    # token values weighed once per plan, or every entry on its own
    monkeypatch.setattr(_digest_torch, "_ENTRIES", 1)
    flushed = [
        safeview.digest(manifest, caches, ids, num_tokens=70) for ids in (side.blocks, consecutive)
    ]
    assert flushed == together
    assert flushed[0].tokens == together[0].tokens


def test_a_thread_keeps_at_most_its_scratch_limit_between_digests(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On CPU the digest's work buffers stay with the calling thread between calls (fresh
    memory is paid in page faults), up to ``_KEEP_BYTES`` each: a larger one is let go."""
    content = _content(layers=2, positions=64, heads=2, size=64, dtype=torch.bfloat16, seed=61)
    side = _side(content, tp=1, tokens=4, layout="LBHNC", heads=2, seed=62)
    assert len(_digest_torch._runs(side.blocks)) > _digest_torch._MAX_RUNS  # pages gathered

    def kept() -> dict[str, int]:
        names = ("pages", "lanes", "values")
        found = {u: getattr(_digest_torch._SCRATCH, u, None) for u in names}
        return {u: t.numel() for u, t in found.items() if t is not None}

    for use in ("pages", "lanes", "values"):
        monkeypatch.delattr(_digest_torch._SCRATCH, use, raising=False)
    monkeypatch.setattr(_digest_torch, "_KEEP_BYTES", 4096)
    first = safeview.digest(side.manifests[0], side.caches[0], side.blocks)
    assert kept()
    assert all(size <= 4096 for size in kept().values())
    assert "values" not in kept()  # 2 layers x 16 blocks x 16 rows x 2 lanes x 8 bytes: 8 KiB
    monkeypatch.setattr(_digest_torch, "_KEEP_BYTES", 8 << 20)
    assert safeview.digest(side.manifests[0], side.caches[0], side.blocks) == first
    held = kept()
    assert set(held) == {"pages", "lanes", "values"}
    again = safeview.digest(side.manifests[0], side.caches[0], side.blocks)
    assert again == first
    assert kept() == held  # reused, not grown


# -- faults every geometric check passes --------------------------------------------------------


def _pair(seed: int = 10) -> tuple[dict[str, torch.Tensor], Side, Side]:
    content = _content(layers=3, positions=48, heads=4, size=8, dtype=torch.bfloat16, seed=seed)
    p = _side(content, tp=2, tokens=16, layout="LBHNC", heads=4, seed=seed + 1)
    d = _side(content, tp=4, tokens=16, layout="LBNHC", heads=4, seed=seed + 2)
    return content, p, d


def test_the_wrong_block_ids_are_caught() -> None:
    _, p, d = _pair()
    sent = _digests(p)
    wrong = [d.blocks[1], d.blocks[0], d.blocks[2]]  # two blocks swapped
    received = [safeview.digest(m, c, wrong) for m, c in zip(d.manifests, d.caches)]
    findings = safeview.verify(sent, received)
    assert [f.layer for f in findings] == list(d.manifests[0].layers)
    assert all(f.kind == "digest" for f in findings)


def test_two_bytes_swapped_inside_a_row_are_caught() -> None:
    _, p, d = _pair(20)
    row = d.logical[0]["model.layers.1.attn"][d.blocks[0], 0, 3, 0].view(torch.uint8)
    row[0], row[5] = row[5].item() + 0, row[0].item() + 0
    if int(row[0]) == int(row[5]):
        row[0] += 1
    findings = safeview.verify(_digests(p), _digests(d)[0])
    assert [(f.layer, f.heads) for f in findings] == [("model.layers.1.attn", (0,))]


def test_a_layer_never_written_is_caught_and_named_first() -> None:
    _, p, d = _pair(30)
    for rank in d.logical:
        for block in d.blocks:
            rank["model.layers.2.attn"][block].zero_()
    findings = safeview.verify(_digests(p), _digests(d))
    assert {f.layer for f in findings} == {"model.layers.2.attn"}
    assert sorted(h for f in findings for h in f.heads) == [0, 1, 2, 3]


def test_a_replicated_head_two_ranks_digest_differently_is_its_own_finding() -> None:
    content = _content(layers=1, positions=8, heads=2, size=4, dtype=torch.float16, seed=40)
    d = _side(content, tp=4, tokens=8, layout="NHD", heads=2, seed=41)  # each head on 2 ranks
    d.logical[1]["model.layers.0.attn"][d.blocks[0], 1, 2, 0].view(torch.uint8).add_(3)
    received = _digests(d)
    findings = safeview.verify(received[0], received)
    assert findings[0].kind == "digest"
    assert findings[0].heads == (0,)
    assert "ranks 0 and 1" in findings[0].message


def test_mla_latent_layers_digest_alike_across_tp_and_differ_on_a_byte() -> None:
    generator = torch.Generator().manual_seed(50)
    latent = (
        torch.randint(0, 256, (24, 36 * 2), generator=generator).to(torch.uint8).view(torch.float16)
    )

    def side(
        tokens: int, tp: int, seed: int
    ) -> list[tuple[Any, dict[str, torch.Tensor], list[int]]]:
        count = -(-24 // tokens)
        blocks = torch.randperm(count + 2, generator=torch.Generator().manual_seed(seed))[
            :count
        ].tolist()
        ranks = []
        for rank in range(tp):
            t = torch.zeros(count + 2, 1, tokens, 36, dtype=torch.float16)
            for at, block in enumerate(blocks):
                n = min(tokens, 24 - at * tokens)
                t[block, 0, :n] = latent[at * tokens : at * tokens + n]
            m = describe({"mla": t}, axes=MLA_AXES, topology={"tp_rank": rank, "tp_size": tp})
            ranks.append((m, {"mla": t}, blocks))
        return ranks

    p, d = side(16, 2, 51), side(8, 1, 52)
    sent = [safeview.digest(m, c, b, num_tokens=24) for m, c, b in p]
    received = [safeview.digest(m, c, b, num_tokens=24) for m, c, b in d]
    assert list(sent[0].values["mla"]) == [-1]
    assert safeview.verify(sent, received) == []
    m, c, b = d[0]
    c["mla"][b[2], 0, 1, 7:8].view(torch.uint8)[1] ^= 0x40
    findings = safeview.verify(sent, safeview.digest(m, c, b, num_tokens=24))
    assert [(f.layer, f.heads) for f in findings] == [("mla", (-1,))]
    assert "no head axis" in findings[0].message


# -- the element type is part of the meaning (issue 35) -----------------------------------------


def _decoded_differ(sent: torch.Tensor, received: torch.Tensor) -> bool:
    """The byte oracle: whether any element decodes to another number on the two sides (NaN
    read as NaN on both is the same)."""
    a, b = sent.to(torch.float64), received.to(torch.float64)
    same = (a == b) | (a.isnan() & b.isnan())
    return not bool(same.all())


@pytest.mark.parametrize(
    ("sent_dtype", "received_dtype"),
    [
        (torch.float8_e4m3fn, torch.float8_e5m2),
        (torch.float16, torch.bfloat16),
        (torch.float8_e4m3fn, torch.float8_e4m3fn),
        (torch.bfloat16, torch.bfloat16),
    ],
)
def test_pages_copied_byte_for_byte_into_a_cache_of_another_element_type_are_named(
    sent_dtype: torch.dtype, received_dtype: torch.dtype
) -> None:
    """P's pages copied byte for byte into D's cache (the same page geometry, as a connector
    copies them), D's cache of ``received_dtype``: whether D decodes other values is decided by
    decoding both sides' pages (the oracle); the digests must name every layer that does, with
    both element types, and nothing when it does not."""
    content = _content(layers=2, positions=24, heads=2, size=8, dtype=sent_dtype, seed=35)
    p = _side(content, tp=1, tokens=8, layout="NHD", heads=2, seed=36)
    d_caches = {}
    for name, tensor in p.caches[0].items():
        copy = torch.empty(tensor.shape, dtype=received_dtype)
        copy.view(torch.uint8).copy_(tensor.view(torch.uint8))  # the page copy
        d_caches[name] = copy
    d = describe(d_caches, axes=LAYOUTS["NHD"], topology={"total_kv_heads": 2})
    sent = safeview.digest(p.manifests[0], p.caches[0], p.blocks, num_tokens=24)
    received = safeview.digest(d, d_caches, p.blocks, num_tokens=24)
    differ = {
        name: _decoded_differ(
            p.caches[0][name][:, p.blocks, :].flatten(1, 2)[:, :24],
            d_caches[name][:, p.blocks, :].flatten(1, 2)[:, :24],
        )
        for name in content
    }
    findings = safeview.verify(sent, received)
    if sent_dtype == received_dtype:
        assert not any(differ.values())
        assert findings == []
        return
    assert all(differ.values())  # every layer decodes other values
    assert [(f.kind, f.layer, f.heads) for f in findings] == [
        ("digest", name, (0, 1)) for name in content
    ]
    names = [str(t).removeprefix("torch.") for t in (sent_dtype, received_dtype)]
    assert f"the sender's elements are {names[0]}, the receiver's {names[1]}" in findings[0].message
    # and across the wire, as D receives P's digest
    assert safeview.verify(Digest.from_wire(sent.to_wire()), received) == findings


def test_one_layer_of_another_element_type_across_tp_and_layouts_is_the_one_named() -> None:
    """P (TP 1, token-major) holds a two-layer request in float16; D (TP 2, head-major, other
    block size) holds the same bytes, layer 1 read as bfloat16 (the oracle: its values
    decode differently, layer 0's do not): only layer 1 is named, on each D rank."""
    content = _content(layers=2, positions=30, heads=4, size=4, dtype=torch.float16, seed=37)
    received_content = dict(content)
    received_content["model.layers.1.attn"] = content["model.layers.1.attn"].view(torch.bfloat16)
    assert _decoded_differ(content["model.layers.1.attn"], received_content["model.layers.1.attn"])
    assert not _decoded_differ(
        content["model.layers.0.attn"], received_content["model.layers.0.attn"]
    )
    p = _side(content, tp=1, tokens=16, layout="NHD", heads=4, seed=38)
    d = _side(received_content, tp=2, tokens=8, layout="LBHNC", heads=4, seed=39)
    sent = _digests(p, 30)
    for rank, received in enumerate(_digests(d, 30)):
        findings = safeview.verify(sent, received)
        held = tuple(heads_of_rank(rank, 2, 4))
        assert [(f.layer, f.heads) for f in findings] == [("model.layers.1.attn", held)]
        assert "float16, the receiver's bfloat16" in findings[0].message
    # a digest rebuilt without its element types (as a plugin may) still names the layer
    bare = [Digest(s.num_tokens, s.values, s.tp_rank, s.tp_size) for s in sent]
    findings = safeview.verify(bare, _digests(d, 30)[0])
    assert [f.layer for f in findings] == ["model.layers.1.attn"]
    assert "elements are" not in findings[0].message


def test_every_element_type_has_its_own_key_in_both_lanes() -> None:
    """What makes the same bytes under two element types two values, exactly: the value moves
    by ``key(layer) * (key(t) - key(t'))``, nonzero modulo the prime when the keys differ."""
    for lane in (0, 1):
        keys = [type_key(name, lane) for name in DTYPE_ITEMSIZE]
        assert len(set(keys)) == len(keys)
        assert all(1 <= k < PRIME for k in keys)


# -- known answers: the scheme pinned ------------------------------------------------------------


def _pattern(count: int, step: int, start: int) -> torch.Tensor:
    return torch.tensor([(i * step + start) % 256 for i in range(count)], dtype=torch.uint8)


def test_known_answers_pin_the_scheme() -> None:
    """Fixed bytes and their ``sv-digest-3`` values and token values, written here as numbers:
    a changed salt, multiplier, weight, key or combination (a P of one release and a D of the
    next disagreeing on every request) fails this test. If the scheme must change, give it a
    new name (``DIGEST_SCHEME``) and new numbers here."""
    name = "model.layers.0.attn"
    # NHD bfloat16: (K/V, block, token, head, element) = (2, 2, 4, 2, 4); the request's blocks
    # 1 then 0, six positions
    nhd = _pattern(256, 37, 11).view(torch.bfloat16).view(2, 2, 4, 2, 4)
    axes = ("kv", "block", "token", "head", "element")
    manifest = describe({name: nhd}, axes=axes, topology={"total_kv_heads": 2})
    found = safeview.digest(manifest, {name: nhd}, [1, 0], num_tokens=6)
    assert found.values == {name: {0: 1955207645845613101, 1: 2536484222389053933}}
    assert found.tokens == {0: (1610058428518528006,), 1: (2191335005061968838,)}
    # the same meaning in vLLM's head-major pages (block, head, token, K|V element)
    lbhnc = torch.zeros(2, 2, 4, 8, dtype=torch.bfloat16)
    lbhnc.view(2, 2, 4, 2, 4).copy_(nhd.permute(1, 3, 2, 0, 4))
    manifest = describe(
        {name: lbhnc}, axes=("block", "head", "token", "kv|element"), topology={"total_kv_heads": 2}
    )
    found = safeview.digest(manifest, {name: lbhnc}, [1, 0], num_tokens=6)
    assert found.values == {name: {0: 1955207645845613101, 1: 2536484222389053933}}
    assert found.tokens == {0: (1610058428518528006,), 1: (2191335005061968838,)}
    # the same bytes read as float16
    f16 = nhd.view(torch.float16)
    manifest = describe({name: f16}, axes=axes, topology={"total_kv_heads": 2})
    found = safeview.digest(manifest, {name: f16}, [1, 0], num_tokens=6)
    assert found.values == {name: {0: 4214270494076219665, 1: 183861054339756241}}
    # an MLA latent, float8_e4m3fn (block, unit, token, element) = (3, 1, 4, 8), blocks 2 then
    # 0, seven positions; and its bytes read as float8_e5m2
    mla = _pattern(96, 101, 7).view(torch.float8_e4m3fn).view(3, 1, 4, 8)
    for dtype, value in (
        (torch.float8_e4m3fn, 3084213864800698786),
        (torch.float8_e5m2, 4139374131526298424),
    ):
        latent = mla.view(dtype)
        manifest = describe({"mla": latent}, axes=MLA_AXES)
        found = safeview.digest(manifest, {"mla": latent}, [2, 0], num_tokens=7)
        assert found.values == {"mla": {-1: value}}
        assert found.tokens == {-1: (2550355386684415255,)}  # no element type in token values
    assert DIGEST_SCHEME == "sv-digest-3"


# -- verify's other findings --------------------------------------------------------------------


def test_heads_no_sender_digest_holds_are_said_not_compared() -> None:
    _, p, d = _pair(60)
    sent = _digests(p)
    findings = safeview.verify(
        sent[0], _digests(d)[3]
    )  # P rank 0 holds heads 0, 1; D rank 3 head 3
    assert {f.kind for f in findings} == {"digest_unmatched"}
    assert all(f.heads == (3,) for f in findings)
    assert "not compared" in findings[0].message


def test_different_token_counts_are_one_finding() -> None:
    _, p, d = _pair(70)
    findings = safeview.verify(_digests(p, 40), _digests(d, 48))
    assert [f.kind for f in findings] == ["digest_unmatched"]
    assert "40" in findings[0].message
    assert "48" in findings[0].message


def test_findings_serialise_with_their_heads() -> None:
    _, p, d = _pair(80)
    d.logical[0]["model.layers.0.attn"][d.blocks[0]].view(torch.uint8).add_(1)
    finding = safeview.verify(_digests(p), _digests(d)[0])[0]
    assert finding.to_json() == {
        "kind": "digest",
        "layer": "model.layers.0.attn",
        "heads": [0],
        "tokens": [0, 15],
        "receiver_rank": 0,
        "sender_ranks": [0],
        "message": finding.message,
    }


# -- the wire -----------------------------------------------------------------------------------


def test_the_wire_round_trips_and_stays_a_few_bytes_per_layer_and_head() -> None:
    _, p, _ = _pair(90)
    one = _digests(p)[0]
    wire = one.to_wire()
    assert Digest.from_wire(wire) == one
    assert len(wire) < 8 * (3 * 2 + 2 * 3) + 200  # (layer, head)s, then (head, run)s
    many = Digest(
        5, {f"model.layers.{i}.self_attn.attn": {h: i * h for h in range(8)} for i in range(100)}
    )
    assert len(many.to_wire()) < 8 * 800 + 400  # the names compress


@pytest.mark.parametrize(
    ("mangle", "field"),
    [
        (lambda w: w[:-3], "values"),
        (lambda w: w[:12], "header"),
        (lambda w: b"XXXX" + w[4:], "magic"),
        (lambda w: w + b"\0" * DIGEST_CAP_BYTES, "size"),
        (lambda w: w.replace(b"SVD1", b"SVD1", 1)[:8] + b"not zlib" + w[16:], "header"),
    ],
)
def test_a_bad_digest_on_the_wire_is_one_error_naming_the_peer_and_field(
    mangle: Callable[[bytes], bytes], field: str
) -> None:
    _, p, _ = _pair(91)
    with pytest.raises(ManifestError) as caught:
        Digest.from_wire(mangle(_digests(p)[0].to_wire()), peer="P 10.0.0.7:5600")
    assert "P 10.0.0.7:5600" in str(caught.value)
    assert field in str(caught.value)


def test_another_scheme_on_the_wire_is_refused() -> None:
    import json
    import struct
    import zlib

    header = zlib.compress(json.dumps({"scheme": "sv-digest-9", "layers": []}).encode())
    wire = b"SVD1" + struct.pack("<I", len(header)) + header
    with pytest.raises(ManifestError, match="sv-digest-9"):
        Digest.from_wire(wire, peer="P")


# -- bad arguments ------------------------------------------------------------------------------


def test_block_ids_outside_the_layer_and_a_manifest_of_other_tensors_are_argument_errors() -> None:
    _, p, _ = _pair(100)
    manifest, caches = p.manifests[0], p.caches[0]
    with pytest.raises(
        ArgumentError, match=r"block_ids holds 99, outside the 6 blocks of layer .* \(0 to 5\)"
    ):
        safeview.digest(manifest, caches, [0, 99])
    small = {name: t[:2].clone() for name, t in caches.items()}
    with pytest.raises(ArgumentError, match="not this tensor's"):
        safeview.digest(manifest, small, [0])
    with pytest.raises(ArgumentError, match="no tensor for layer"):
        safeview.digest(manifest, {}, [0])
    with pytest.raises(ArgumentError, match="num_tokens 999"):
        safeview.digest(manifest, caches, [0], num_tokens=999)
    with pytest.raises(ArgumentError, match="does not have"):
        safeview.digest(manifest, caches, [0], layers=["nope"])


def test_the_formula_keeps_its_exact_promises() -> None:
    for length in (1, 2, 256, 1152, MAX_PIECE_BYTES):
        weights = row_weights(length)
        assert all(a != 0 and b != 0 and -64 <= a <= 64 and -64 <= b <= 64 for a, b in weights)
        assert len(set(weights)) == length  # lane pairs differ: a swap inside a row shows
    assert MAX_PIECE_BYTES == 1 << 14
    assert piece_count(256) == 1
    assert piece_count(1 << 15) == 2
    assert piece_count(3 * (1 << 14)) == 3
    values = torch.arange(0, 5000, dtype=torch.int64)
    for lane in (0, 1):
        keys = key(values, "token", lane)
        assert int(keys.min()) >= 1
        assert int(keys.max()) < PRIME
        assert keys.tolist() == [key(v, "token", lane) for v in range(5000)]


# -- SAFEVIEW_DIGEST -----------------------------------------------------------------------------


def test_sampling_values() -> None:
    assert parse_sampling(None) == DigestSampling("off")
    assert parse_sampling(" ALL ") == DigestSampling("all")
    assert parse_sampling("sample:16") == DigestSampling("sample", 16)
    assert [parse_sampling("sample:4").wants(n) for n in range(6)] == [1, 0, 0, 0, 1, 0]
    assert not DigestSampling("off").wants(0)
    for bad in ("sample:0", "sample:x", "some", "sample:-2"):
        with pytest.raises(safeview.ConfigError, match="SAFEVIEW_DIGEST"):
            parse_sampling(bad)


def test_a_bad_safeview_digest_is_one_warning_and_digests_stay_off() -> None:
    code = (
        "import warnings, safeview.manifest.digest as d\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    warnings.simplefilter('always')\n"
        "    print(d.digest_sampling(), len(seen), seen[0].message if seen else '')\n"
    )
    env = {**os.environ, "SAFEVIEW_DIGEST": "sample:zero"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.startswith("off 1 SAFEVIEW_DIGEST='sample:zero' is not a valid value")
    env["SAFEVIEW_DIGEST"] = "sample:16"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.startswith("sample:16 0")


# -- a guest in the host's process ----------------------------------------------------------------


def test_d_fetches_p_digests_in_one_daemon_thread_that_hands_back_results_and_errors() -> None:
    background = Background("safeview-digest")
    added = background.submit(lambda a, b: a + b, 2, 3)
    refused = background.submit(int, "not a number")
    assert added.result(timeout=10) == 5
    with pytest.raises(ValueError, match="not a number"):
        refused.result(timeout=10)
    assert background.thread is not None
    assert background.thread.daemon


def test_the_background_thread_keeps_nothing_of_a_call_it_has_done() -> None:
    """A call's function and arguments (D's judgement holds its worker, and so its NIXL agent
    and that agent's threads) are let go once it is done, not kept until the next call."""

    class Worker:
        pass

    worker = Worker()
    alive = weakref.ref(worker)
    background = Background("safeview-handshake")
    background.submit(lambda held: type(held).__name__, worker).result(timeout=10)
    del worker
    for _ in range(500):  # the thread returns from the call just after it hands the result
        gc.collect()
        if alive() is None:
            break
        time.sleep(0.01)
    assert alive() is None


def test_a_fetch_still_waiting_for_p_never_holds_up_the_hosts_exit() -> None:
    """A ``ThreadPoolExecutor``'s worker is joined at exit: the host would wait out the fetch
    (here 60 s) before it could exit."""
    code = (
        "import threading, time\n"
        "from safeview.vllm._background import Background\n"
        "started = threading.Event()\n"
        "def fetch():\n"
        "    started.set()\n"
        "    time.sleep(60)\n"
        "Background('safeview-digest').submit(fetch)\n"
        "assert started.wait(30)\n"
        "print('exiting')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=40, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "exiting"


def test_the_keys_of_a_manifests_layers_are_kept_by_name_meaning_and_heads() -> None:
    """A digest's per-head keys (the head's, the element type's, the layer's) are made once per
    list of layers and kept (``_ROW_KEYS``): the same bytes under the same names but another
    element type, or on a rank past context-parallel position 0 (no element type's key), get
    other keys, not the kept ones; a digest with the keys kept is the one made afresh; at most
    64 lists are kept."""
    content = _content(layers=2, positions=24, heads=2, size=8, dtype=torch.float16, seed=40)
    p = _side(content, tp=1, tokens=8, layout="NHD", heads=2, seed=41)
    as_bf16 = {name: t.view(torch.bfloat16) for name, t in p.caches[0].items()}
    other = describe(as_bf16, axes=LAYOUTS["NHD"], topology={"total_kv_heads": 2})
    _digest_torch._ROW_KEYS.clear()
    fresh = [
        safeview.digest(m, c, p.blocks, num_tokens=24)
        for m, c in ((p.manifests[0], p.caches[0]), (other, as_bf16))
    ]
    assert fresh[0].values != fresh[1].values  # the same bytes, another element type
    assert len(_digest_torch._ROW_KEYS) == 2
    kept = [
        safeview.digest(m, c, p.blocks, num_tokens=24)
        for m, c in ((other, as_bf16), (p.manifests[0], p.caches[0]))
    ]
    assert kept == fresh[::-1]
    assert fresh[0].values == _reference(content, 24, heads=2)
    layer = p.manifests[0].layers["model.layers.0.attn"]
    sums = torch.ones(1, 2, dtype=torch.int64)
    typed = _digest_torch._values([("a", layer, (0,))], sums, True)
    untyped = _digest_torch._values([("a", layer, (0,))], sums, False)
    assert typed != untyped
    for index in range(70):
        _digest_torch._values([(f"layer {index}", layer, (0,))], sums, True)
    assert len(_digest_torch._ROW_KEYS) <= 64
    assert _digest_torch._values([("a", layer, (0,))], sums, True) == typed
    # and at most _ROW_KEYS_BYTES: a list of more heads than that is used, not kept
    many = tuple(range(_digest_torch._ROW_KEYS_BYTES // (3 * 2 * 8) + 1))
    wide = torch.ones(len(many), 2, dtype=torch.int64)
    found = _digest_torch._values([("a", layer, many)], wide, True)
    assert found["a"][0] == typed["a"][0]
    assert sum(t.nbytes for t in _digest_torch._ROW_KEYS.values()) <= _digest_torch._ROW_KEYS_BYTES


def test_a_meanings_key_is_the_same_kept_or_made_again_and_the_kept_ones_are_bounded() -> None:
    """``type_key`` keeps the key of a meaning it has not in its table (a layer's parts), up to
    4,096 of them; past that it lets the kept ones go (torch's own dtypes stay) and makes them
    again, the same keys."""
    from safeview.manifest import _digest_model

    meaning = "float8_e4m3fn|data:float8_e4m3fn|scale:float32:token_head"
    first = [_digest_model.type_key(meaning, lane) for lane in range(2)]
    for index in range(4200):
        _digest_model.type_key(f"test-meaning-{index}", 0)
    assert len(_digest_model._TYPE_KEYS) <= len(DTYPE_ITEMSIZE) + 4097
    assert all(name in _digest_model._TYPE_KEYS for name in DTYPE_ITEMSIZE)
    again = [_digest_model.type_key(meaning, lane) for lane in range(2)]
    assert again == first
    assert _digest_model.type_key("float16", 0) != _digest_model.type_key("bfloat16", 0)
