"""safeview.manifest._nixl_rules against vLLM 0.33's own NIXL code: the ranks a decode rank reads,
the descriptor rows vLLM builds for one layer (``_build_fa_remote``, ``_build_fa_local``,
``_build_local_splits_from_plan``, called on a stand-in worker that holds only the fields they
read), and the receive-side reorder (``kv_postprocess_blksize_on_receive``), over a grid of
TP sizes, KV heads, block tokens and MLA.

These run where vLLM is installed (``.venv-vllm``); elsewhere they skip, saying so. With
``SAFEVIEW_REQUIRE_VLLM=1`` a missing vLLM is a failure instead.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import traceback
from types import SimpleNamespace
from typing import Any

import pytest

if os.environ.get("SAFEVIEW_REQUIRE_VLLM") == "1":
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm", reason="vLLM is not installed here; .ci/run tests against it")

import torch
from vllm.distributed.kv_transfer.kv_connector.utils import (  # type: ignore[import-not-found,unused-ignore]
    EngineTransferInfo,
    TransferTopology,
    kv_postprocess_blksize_on_receive,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import (  # type: ignore[import-not-found,unused-ignore]
    NixlBaseConnectorWorker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (  # type: ignore[import-not-found,unused-ignore]
    NixlAgentMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.tp_mapping import (  # type: ignore[import-not-found,unused-ignore]
    compute_tp_mapping,
)
from vllm.v1.kv_cache_interface import (  # type: ignore[import-not-found,unused-ignore]
    FullAttentionSpec,
    MLAAttentionSpec,
)

from safeview.manifest import _nixl_rules

HEAD_BYTES = 2 * 64 * 2  # K|V of 64 fp16 elements, per token and head


def grid() -> list[tuple[int, int, int, int, int, bool]]:
    cases = []
    # TP 3 against powers of two and 8 block tokens against 16: pairs vLLM refuses outright
    for p_tp, d_tp, heads, p_n, d_n, mla in itertools.product(
        (1, 2, 3, 4, 8), (1, 2, 4, 8, 16), (1, 2, 4, 8), (16,), (8, 16, 32), (False, True)
    ):
        if mla and heads != 1:
            continue
        cases.append((p_tp, d_tp, heads, p_n, d_n, mla))
    return cases


def topology(rank: int, tp: int, block: int, heads: int, mla: bool) -> Any:
    return TransferTopology(
        tp_rank=rank,
        tp_size=tp,
        block_size=block,
        engine_id="decode",
        is_mla=mla,
        is_mamba=False,
        total_num_kv_heads=1 if mla else heads,
        attn_backends=[],
    )


def page(tokens: int, heads: int, tp: int, mla: bool) -> int:
    return tokens * 576 * 2 if mla else tokens * max(1, heads // tp) * HEAD_BYTES


def vllm_rows(
    rank: int, p_tp: int, d_tp: int, heads: int, p_n: int, d_n: int, mla: bool
) -> tuple[list[tuple[int, int]], list[tuple[int, int]], list[int]]:
    """For block 0 of one layer: vLLM's local (offset, length) pieces in slot order, the remote
    (offset, length) read from each source, and the source ranks, from vLLM's own builders."""
    topo = topology(rank, d_tp, d_n, heads, mla)
    spec = MLAAttentionSpec if mla else FullAttentionSpec
    plan = compute_tp_mapping(topo, p_tp, (spec,))
    ratio = topo.block_size_ratio(p_n)
    local_len = page(d_n, heads, d_tp, mla)
    remote_len = page(p_n, heads, p_tp, mla)
    worker: Any = SimpleNamespace(
        transfer_topo=topo,
        _group_spec_types=(spec,),
        _transfer_layer_region_indices=[],
        _region_is_mla=[mla],
        block_len_per_layer=[local_len],
        block_stride_per_layer=[local_len],
        region_num_blocks=[4],
        device_id=0,
        _head_sharded_draft_regions=set(),
        num_regions=1,
        _logical_num_blocks=4,
        _ple_region_index=None,
        use_mla=mla,
    )
    for method in ("_is_region_replicated", "_fa_desc_replicated"):
        setattr(worker, method, getattr(NixlBaseConnectorWorker, method).__get__(worker))
    for static in ("_pack_strided_descs", "_block_strided_descs", "_strided_desc_starts"):
        setattr(worker, static, getattr(NixlBaseConnectorWorker, static))
    meta = SimpleNamespace(
        kv_caches_base_addr=[0],
        region_num_blocks=None,
        num_blocks=4 * ratio,
        device_id=0,
        block_strides=[remote_len],
        engine_id="prefill",
    )
    remote = NixlBaseConnectorWorker._build_fa_remote(worker, plan, meta, ratio)
    local = NixlBaseConnectorWorker._build_fa_local(worker, [0], ratio)
    sources = list(plan.source_ranks_per_group[0])
    tp_ratio = topo.tp_ratio(p_tp)
    if NixlBaseConnectorWorker._needs_split_local_xfer_handles(worker, tp_ratio, plan):
        handles = list(
            NixlBaseConnectorWorker._build_local_splits_from_plan(
                worker, plan, local, int(local[:, 4].sum()), ratio
            )
        )
        pieces = [(int(h[0, 0]), int(h[0, 1])) for h in handles]
    else:
        row = local[0]
        pieces = [(j * int(row[3]), int(row[1])) for j in range(ratio)]
    reads = [(int(remote[0, 0]), int(remote[0, 1]))]
    return pieces, reads, sources


def vllm_refusal(
    rank: int,
    p_tp: int,
    d_tp: int,
    heads: int,
    p_n: int,
    d_n: int,
    mla: bool,
    *,
    p_layout: str = "LBHNC",
    d_layout: str = "LBHNC",
    p_page_extra: int = 0,
) -> str | None:
    """Why vLLM refuses this pair, in its own words, or ``None``: its handshake check
    (``_validate_remote_agent_handshake``, on a stand-in worker holding the fields it reads, P's
    metadata as P would send it), then the row builders (``vllm_rows``), which assert on what the
    handshake lets through but they cannot serve. ``p_page_extra``: bytes P's block length
    says beyond its page's."""
    topo = topology(rank, d_tp, d_n, heads, mla)
    local_len = page(d_n, heads, d_tp, mla)
    remote_len = page(p_n, heads, p_tp, mla) + p_page_extra
    spec = MLAAttentionSpec if mla else FullAttentionSpec
    worker: Any = SimpleNamespace(
        transfer_topo=topo,
        dcp_size=1,
        _has_mamba=False,
        use_mla=mla,
        _head_sharded_draft_regions=set(),
        _head_sharded_draft_kv_heads=None,
        region_group_ids=[0],
        dst_region_group_ids={"prefill": [0]},
        _physical_blocks_per_logical_kv_block=1,
        use_host_buffer=False,
        kv_cache_layout=d_layout,
        host_buffer_kv_cache_layout=d_layout,
        kv_transfer_config=SimpleNamespace(enable_permute_local_kv=False),
        enable_permute_local_kv=False,
        backend_name="FLASH_ATTN",
        _is_hma_required=False,
        _layer_specs={},
        _transfer_layer_region_indices=[],
        block_len_per_layer=[local_len],
        _group_spec_types=(spec,),
        _region_is_mla=[mla],
        dst_num_blocks={"prefill": 8},
        _transfer_layer_names=[],
        region_names=["model.layers.0.attn"],
    )
    worker._is_region_replicated = NixlBaseConnectorWorker._is_region_replicated.__get__(worker)
    meta = NixlAgentMetadata(
        engine_id="prefill",
        agent_metadata=b"",
        kv_caches_base_addr=[0],
        device_id=0,
        num_blocks=8,
        block_lens=[remote_len],
        block_strides=[remote_len],
        kv_cache_layout=p_layout,
        block_size=p_n,
        ssm_sizes=(0, 0),
        attn_backend_name="FLASH_ATTN",
        physical_blocks_per_logical_kv_block=1,
        region_names=["model.layers.0.attn"],
    )
    try:
        topo.register_remote_engine(
            "prefill",
            EngineTransferInfo(
                remote_tp_size=p_tp,
                remote_block_len=remote_len,
                remote_block_size=p_n,
                remote_physical_blocks_per_logical=1,
            ),
        )
        NixlBaseConnectorWorker._validate_remote_agent_handshake(worker, meta, p_tp)
        vllm_rows(rank, p_tp, d_tp, heads, p_n, d_n, mla)
    except (AssertionError, RuntimeError, NotImplementedError) as refused:
        # a bare assert says nothing: its line does
        where = traceback.extract_tb(refused.__traceback__)[-1]
        return f"{type(refused).__name__}: {refused} [{where.name}: {where.line}]"
    return None


# vLLM's refusals by the check that makes them (a phrase of its message, or of a bare assert's
# line), each with the name safeview's plan gives that check (``_nixl_rules.CHECKS``)
VLLM_CHECKS = (
    ("tensor parallel size", "tp_sizes_divide"),
    ("is not divisible by remote block size", "block_tokens_divide"),
    ("is_kv_replicated", "p_heads_replicated"),
    ("expects same kv_cache_layout", "layouts_equal"),
    ("requires contiguous heads", "block_contiguous"),
    ("Different local/remote block sizes", "p_tp_block_tokens"),
    ("KV cache sizes must match", "block_len"),
    ("block_len", "block_len"),
)


def vllm_check(refusal: str) -> str:
    """The check of vLLM's that made ``refusal`` (``vllm_refusal``'s words)."""
    found = [name for phrase, name in VLLM_CHECKS if phrase in refusal]
    assert found, f"a refusal this test does not know: {refusal}"
    return found[0]


def test_the_checks_named_are_safeviews() -> None:
    assert {name for _, name in VLLM_CHECKS} == set(_nixl_rules.CHECKS)


@pytest.mark.parametrize(("p_tp", "d_tp", "heads", "p_n", "d_n", "mla"), grid())
def test_every_rank_reads_what_vllm_reads(
    p_tp: int, d_tp: int, heads: int, p_n: int, d_n: int, mla: bool
) -> None:
    """safeview refuses a pair exactly where vLLM's own handshake or row builders refuse it, by
    the check that refuses it there (a refusal for another reason would hide a dead check),
    and where both accept, reads the bytes vLLM's rows read."""
    for rank in range(d_tp):
        plan = _nixl_rules.plan_layer(
            tp_rank=rank,
            tp_size=d_tp,
            remote_tp_size=p_tp,
            total_kv_heads=1 if mla else heads,
            block_tokens=d_n,
            remote_block_tokens=p_n,
            page_bytes=page(d_n, heads, d_tp, mla),
            remote_page_bytes=page(p_n, heads, p_tp, mla),
            replicated=mla,
            block_contiguous=True,
        )
        refusal = vllm_refusal(rank, p_tp, d_tp, heads, p_n, d_n, mla)
        assert (plan.refused is None) == (refusal is None), (rank, plan.refused, refusal)
        if refusal is not None:
            assert plan.refused_by == vllm_check(refusal), (rank, plan.refused, refusal)
            continue
        pieces, reads, sources = vllm_rows(rank, p_tp, d_tp, heads, p_n, d_n, mla)
        assert [(p.receiver_start, p.length) for p in plan.pieces] == pieces
        assert {(p.sender_start, p.length) for p in plan.pieces} == set(reads)
        assert list(dict.fromkeys(p.sender_rank for p in plan.pieces)) == sources


LAYOUT_NAMES = ["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC", "HND", "NHD"]


@pytest.mark.parametrize("name", [*LAYOUT_NAMES, "hnd", "foo", "HDN", "NL_X_NB_NH_BS_2HS"])
def test_a_layout_string_means_what_it_means_to_vllm(name: str) -> None:
    """vLLM's own reading of a ``kv_cache_layout`` string (``_layout_from_name``: its names and
    its older aliases) against ``_nixl_rules.vllm_layout``: the same layout, the same
    block-contiguity (``KVCacheLayout.is_block_contiguous``); what vLLM refuses, safeview
    refuses, naming the string. Only the case is forgiven."""
    from vllm.config.cache import _layout_from_name  # type: ignore[import-not-found,unused-ignore]

    from safeview import ManifestError

    try:
        theirs = _layout_from_name(name.upper())
    except ValueError:
        with pytest.raises(ManifestError, match=f"topology.layout: {name!r} is not a layout"):
            _nixl_rules.vllm_layout(name, "topology.layout")
        return
    ours = _nixl_rules.vllm_layout(name, "topology.layout")
    assert ours is not None
    assert ours == theirs.name
    assert _nixl_rules.VLLM_LAYOUTS[ours] == theirs.is_block_contiguous


@pytest.mark.parametrize(("p_said", "d_said"), [
    ("LBHNC", "LBHNC"), ("HND", "LBHNC"), ("LBNHC", "NHD"), ("BLHNC", "BLHNC"),
    ("BLNHC", "BLNHC"), ("LBHNC", "LBNHC"), ("LBNHC", "LBHNC"), ("BLHNC", "LBHNC"),
])  # fmt: skip
@pytest.mark.parametrize(("p_tp", "d_tp", "p_page_extra"), [
    (2, 4, 0), (4, 2, 0), (2, 2, 0), (2, 4, HEAD_BYTES), (2, 2, -HEAD_BYTES),
])  # fmt: skip
def test_layouts_and_block_lengths_are_refused_where_and_why_vllm_refuses(
    p_said: str, d_said: str, p_tp: int, d_tp: int, p_page_extra: int
) -> None:
    """The layout strings each side reports (vLLM's names, or its older words on safeview's
    side, where vLLM has resolved them before its handshake) and a P block length off by a
    head's bytes: safeview refuses where vLLM's handshake refuses, by the same check."""
    heads, tokens = 8, 16
    p_layout = _nixl_rules.vllm_layout(p_said, "P")
    d_layout = _nixl_rules.vllm_layout(d_said, "D")
    assert p_layout is not None
    assert d_layout is not None
    for rank in range(d_tp):
        plan = _nixl_rules.plan_layer(
            tp_rank=rank, tp_size=d_tp, remote_tp_size=p_tp, total_kv_heads=heads,
            block_tokens=tokens, remote_block_tokens=tokens,
            page_bytes=page(tokens, heads, d_tp, False),
            remote_page_bytes=page(tokens, heads, p_tp, False) + p_page_extra,
            replicated=False, block_contiguous=False, layout=d_said, remote_layout=p_said,
        )  # fmt: skip
        refusal = vllm_refusal(
            rank, p_tp, d_tp, heads, tokens, tokens, False,
            p_layout=p_layout, d_layout=d_layout, p_page_extra=p_page_extra,
        )  # fmt: skip
        assert (plan.refused is None) == (refusal is None), (rank, plan.refused, refusal)
        if refusal is not None:
            assert plan.refused_by == vllm_check(refusal), (rank, plan.refused, refusal)


@pytest.mark.parametrize("ratio", [2, 4])
@pytest.mark.parametrize("heads", [1, 2])
def test_receive_reorder_is_vllms(ratio: int, heads: int) -> None:
    """vLLM's own reorder (``kv_postprocess_blksize_on_receive``) on real bytes against
    safeview's own model of it (``_nixl_rules.plan_layer``'s pieces and ``permute``, applied by
    ``safeview.diff``): P's HND blocks of ``N_P`` tokens hold values that say (block, head,
    token, element); D's blocks hold ``ratio * N_P`` tokens. After the copy and vLLM's reorder
    every D byte holds what D's own layout says it holds, and diff, which models the same move,
    finds D compatible. With two heads the bytes are wrong without the reorder, so a model that
    forgot it, or permuted otherwise, would find a mismatch."""
    import safeview
    from safeview.manifest import vllm_axes

    p_n, width, blocks = 4, 4, 3  # width: int32 elements per token and head (K|V)
    d_n = ratio * p_n
    sender = torch.zeros(blocks * ratio, heads, p_n, width, dtype=torch.int32)
    for b, h, t, c in itertools.product(*(range(n) for n in sender.shape)):
        sender[b, h, t, c] = ((b * p_n + t) * 16 + h) * 16 + c + 1  # global token, head, element
    receiver = torch.zeros(blocks, heads, d_n, width, dtype=torch.int32)
    want = torch.zeros_like(receiver)
    for b, h, t, c in itertools.product(*(range(n) for n in receiver.shape)):
        want[b, h, t, c] = ((b * d_n + t) * 16 + h) * 16 + c + 1
    page_bytes = receiver[0].numel() * 4
    plan = _nixl_rules.plan_layer(
        tp_rank=0, tp_size=1, remote_tp_size=1, total_kv_heads=heads, block_tokens=d_n,
        remote_block_tokens=p_n, page_bytes=page_bytes, remote_page_bytes=sender[0].numel() * 4,
        replicated=False, block_contiguous=True,
    )  # fmt: skip
    assert plan.refused is None
    assert (plan.ratio, plan.permute) == (ratio, True)
    sent = sender.view(-1).view(torch.uint8).view(blocks * ratio, -1)
    got = receiver.view(-1).view(torch.uint8).view(blocks, -1)
    for b, piece in itertools.product(range(blocks), plan.pieces):
        source = sent[ratio * b + piece.sub_block]
        got[b, piece.receiver_start : piece.receiver_start + piece.length] = source[
            piece.sender_start : piece.sender_start + piece.length
        ]
    unpermuted = receiver.clone()
    kv_postprocess_blksize_on_receive(receiver, torch.arange(blocks), ratio)
    assert torch.equal(receiver, want)
    # with two heads the reorder is needed (the test can tell); with one it moves nothing
    assert torch.equal(unpermuted, want) == (heads == 1)
    axes = vllm_axes("attention")
    report = safeview.diff(
        safeview.describe({"l": sender}, axes=axes, topology={"tp_rank": 0, "tp_size": 1,
                          "total_kv_heads": heads, "layout": "LBHNC"}),
        safeview.describe({"l": receiver}, axes=axes, topology={"tp_rank": 0, "tp_size": 1,
                          "total_kv_heads": heads, "layout": "LBHNC"}),
        rule="vllm_nixl",
    )  # fmt: skip
    assert report.compatible, [f.message for f in report.findings]


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC", "BLHNC", "BLNHC"])
def test_describe_reads_vllms_own_views_for_every_layout(layout: str) -> None:
    """vLLM 0.33's ``create_kv_cache_views`` (what ``allocate_kv_cache`` calls) for 3 layers of
    4 heads, 16 tokens, 64 fp16 elements: the physical order describe reads is the layout's, K
    is the first half of C (FlashAttention splits ``C`` at ``head_size``), and block-major
    layouts put the other layers' pages between blocks."""
    from vllm.v1.kv_cache_interface import (  # type: ignore[import-not-found,unused-ignore]
        KVCacheLayout,
        KVCacheTensor,
        create_kv_cache_views,
    )

    import safeview
    from safeview.manifest import vllm_axes

    spec = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=64, dtype=torch.float16)
    page, blocks, names = spec.page_size_bytes, 5, ["l0", "l1", "l2"]
    block_major = layout.startswith("B")
    tensor = KVCacheTensor(
        size=3 * blocks * page,
        layers=names,
        layer_stride=page if block_major else blocks * page,
        block_stride=3 * page if block_major else page,
    )
    raw = torch.zeros(3 * blocks * page, dtype=torch.int8, device="meta")
    views = create_kv_cache_views(raw, spec, blocks, KVCacheLayout[layout], tensor)
    manifest = safeview.describe(dict(zip(names, views)), axes=vllm_axes())
    layer = manifest.layers["l1"]
    order = [axis.axis for axis in layer.axes if axis.size > 1]
    inner = ["head", "token"] if layout.endswith("HNC") else ["token", "head"]
    assert order == [*inner, "kv", "element"]
    kv = next(axis for axis in layer.axes if axis.axis == "kv")
    assert kv.stride_bytes == 64 * 2  # V starts head_size elements into C
    assert layer.page_bytes == page
    assert layer.block_stride_bytes == (3 * page if block_major else page)
    assert layer.byte_offset == (page if block_major else blocks * page)
    assert manifest.layers["l0"].fingerprint == layer.fingerprint


def test_real_nixl_reads_agree_with_diff() -> None:
    """vLLM's own handshake and READ on CPU (tests/vllm_layout_harness.py; safeview's plugin
    under warn, so that vLLM moves the bytes as it would, and one folder for both engines' derived
    manifests), TP 2 -> 4 and 4 -> 2 included: ``diff`` of the manifests the plugin wrote is
    compatible exactly where every byte arrived where each decode rank's own view reads it, and
    names, per rank and layer, the first wrong byte the READ delivered."""
    import shutil

    import vllm_layout_harness as layouts  # type: ignore[import-not-found,unused-ignore]

    from safeview import diff
    from safeview.manifest import Manifest

    engine, pair = layouts.Engine, layouts.Pair
    valid = {
        "identical_lbhnc": pair("identical_lbhnc"),
        "identical_lbnhc": pair("identical_lbnhc", p=engine("LBNHC"), d=engine("LBNHC")),
        "blocks_32_to_64": pair("blocks_32_to_64", d=engine(block_size=64)),
        "tp2_to_tp4": pair("tp2_to_tp4", p=engine(tp=2), d=engine(tp=4)),
        "tp4_to_tp2": pair("tp4_to_tp2", p=engine(tp=4), d=engine(tp=2)),
    }
    wrong_bytes = {
        # both report LBHNC; D reads its layer 1 token-major: vLLM cannot see it
        "same_string_layer_1_nhd": pair("same_string_layer_1_nhd", fault="permuted_layer_on_d"),
        # P's layer 1 token-major under LBHNC: each D rank's slice of P's page is cut by heads
        "tp2_to_tp4_p_layer_1_nhd": pair(
            "tp2_to_tp4_p_layer_1_nhd", p=engine(tp=2), d=engine(tp=4), fault="permuted_layer"
        ),
    }
    pairs = [
        dataclasses.replace(one, policy="warn", manifests="shared")
        for one in (*valid.values(), *wrong_bytes.values())
    ]
    run = layouts.run(pairs)
    try:
        results = {result["pair"]["name"]: result for result in run.results}
        assert set(results) == set(valid) | set(wrong_bytes)
        for name, result in results.items():
            assert result["error"] is None, (name, result["error"])
            sides = {}
            for side in ("P", "D"):
                files = sorted(
                    (path, text)
                    for path, text in result["manifests"].items()
                    if path.split("/")[0].endswith(f"-{side}")
                )
                assert files, (name, side, list(result["manifests"]))
                sides[side] = [Manifest.model_validate(text) for _, text in files]
            report = diff(sides["P"], sides["D"], rule="vllm_nixl")
            ok = True
            first_wrong = {}
            for rank, read in enumerate(result["reads"]):
                [outcome] = [v for k, v in read.items() if k.endswith("-P")]
                assert outcome == {"done": True, "failed": False}, (name, rank, outcome)
                ok = ok and read["oracle"]["ok"]
                for layer, found in read["oracle"]["layers"].items():
                    if found["first_wrong_byte"] is not None:
                        first_wrong[f"{rank}:{layer}"] = found["first_wrong_byte"]
            assert report.compatible == ok, (name, report.findings, first_wrong)
            named = {
                f"{f.receiver_rank}:{f.layer}": f.byte for f in report.findings if f.kind == "byte"
            }
            assert named == first_wrong, name
            assert ok == (name in valid), name
    finally:
        for result in run.results:
            shutil.rmtree(result["manifest_root"], ignore_errors=True)


def test_the_docs_recipe_saves_the_payload_vllms_own_side_channel_serves(tmp_path: Any) -> None:
    """docs/layouts.md's recipe for saving P's handshake payload, run as written against vLLM
    0.33's own side-channel listener (``_nixl_handshake_listener``) serving P's payload as the
    plugin makes it: the file holds those bytes, and ``safeview diff`` judges it."""
    import re
    import socket
    import subprocess
    import sys
    import threading
    from pathlib import Path

    import msgspec
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler import (  # type: ignore[import-not-found,unused-ignore]
        NixlBaseConnectorScheduler,
    )

    import safeview
    from safeview.manifest import vllm_axes
    from safeview.manifest.wire import to_wire
    from safeview.vllm._nixl import payload_class

    docs = (Path(__file__).parent.parent / "docs" / "layouts.md").read_text()
    [(arguments, script)] = re.findall(r"^python - (.*) <<'EOF'\n(.*?)^EOF$", docs, re.M | re.S)
    assert arguments.split()[1:] == ["10.0.0.5", "5600", "0"]  # what the test replaces
    cache = torch.empty(4, 2, 16, 256, dtype=torch.bfloat16, device="meta")
    topology = {"tp_rank": 0, "tp_size": 1, "total_kv_heads": 2, "layout": "LBHNC"}
    manifest = safeview.describe({"model.layers.0.attn": cache}, axes=vllm_axes(),
                                 topology=topology)  # fmt: skip
    receiver = tmp_path / "decode.tp0of1.manifest.json"
    receiver.write_text(manifest.to_json())
    served = msgspec.msgpack.encode(payload_class()(
        compatibility_hash="h", agent_metadata_bytes=b"nixl", safeview_manifest=to_wire(manifest)
    ))  # fmt: skip
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ready, stop = threading.Event(), threading.Event()
    listener = threading.Thread(
        target=NixlBaseConnectorScheduler._nixl_handshake_listener,
        args=({(0, 0): served}, ready, stop, "127.0.0.1", port),
        daemon=True,
    )
    listener.start()
    try:
        assert ready.wait(30)
        saved = tmp_path / "p.rank0.handshake"
        ran = subprocess.run(
            [sys.executable, "-", str(saved), "127.0.0.1", str(port), "0"],
            input=script, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert ran.returncode == 0, ran.stderr
    finally:
        stop.set()
        listener.join(timeout=10)
    assert saved.read_bytes() == served
    command = [sys.executable, "-m", "safeview", "diff", str(saved), str(receiver)]
    judged = subprocess.run(
        [*command, "--rule", "vllm_nixl"], capture_output=True, text=True, timeout=120
    )
    assert judged.returncode == 0, judged.stdout + judged.stderr
    assert judged.stdout.startswith(f"COMPATIBLE {saved} -> {receiver}")
