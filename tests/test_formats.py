"""Named formats as claims (issue 37, point 5): Dynamo KVBM's, FlexKV's, LMCache's
``EngineKVFormat`` names, vLLM's canonical format ids and MLA rows, each checked against the
bytes of a real tensor laid out as its project defines it.

The oracle is written here: a tensor whose every element holds a code of its own (K/V, token,
head, element) is laid out as the engine holds it; the claim's reading of each byte (decoded by
a reference written here from the project's definition) is compared with the code found there.
``diff(claim, engine, rule="in_place")`` must pass where they agree and name the first byte the
oracle finds wrong where they do not. LMCache's shapes come from LMCache 0.5.6's own
``paged_layer_shape`` where it is installed.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
import torch

from safeview.errors import ManifestError
from safeview.findings import Finding
from safeview.manifest import FORMATS, Manifest, assumed, describe, layer_from_geometry
from safeview.manifest.diff import DiffReport, diff

NB, BS, NH, HS = 3, 4, 2, 8
SIZES: dict[str, Any] = {
    "layers": ["l0", "l1"], "num_blocks": NB, "block_tokens": BS, "num_heads": NH,
    "head_size": HS, "dtype": "float16",
}  # fmt: skip


def _finding(report: DiffReport) -> Finding:
    found = [f for f in report.findings if f.receiver_reads is not None]
    assert found, [f.message for f in report.findings]
    return found[0]


def _engine(shape: tuple[int, ...], axes: tuple[str, ...], layers: int = 2) -> Manifest:
    """Per-layer engine tensors, dense, laid one after another in one storage."""
    storage = torch.empty(layers * int(np.prod(shape)), dtype=torch.float16, device="meta")
    size = int(np.prod(shape))
    caches = {f"l{i}": storage[i * size : (i + 1) * size].view(shape) for i in range(layers)}
    return describe(caches, axes=axes)


def test_every_named_format_cites_its_source() -> None:
    assert {
        "dynamo.fully_contiguous", "dynamo.layer_separate.outer_contiguous",
        "dynamo.layer_separate.block_contiguous", "dynamo.UniversalTP", "dynamo.OperationalNHD",
        "dynamo.OperationalHND", "flexkv.LAYERFIRST", "flexkv.BLOCKFIRST", "flexkv.LAYERBLOCK",
        "flexkv.MLA", "vllm.v1-nhd", "vllm.v1-hnd", "vllm.fp8_ds_mla", "mla.fp8_576",
        "vllm.nvfp4_ds_mla", "vllm.nvfp4.sm100", "vllm.nvfp4.sm120",
    } <= set(FORMATS)  # fmt: skip
    for name, named in FORMATS.items():
        assert "/" in named.source or "#" in named.source, name
        head_size = 576 if "mla" in name else 64 if "nvfp4" in name else HS
        assumed(name, **{**SIZES, "head_size": head_size})


# -- Dynamo KVBM: layer_separate read outer-contiguous over a block-contiguous cache ----------


def _block_contiguous_code() -> tuple[Any, Any]:
    """Per layer [NB, 2, BS, NH, HS]: each element's code (kv, token, head, element)."""
    kv, t, h, e = np.meshgrid(range(2), range(BS), range(NH), range(HS), indexing="ij")
    code = ((kv * BS + t) * NH + h) * HS + e
    blocks = np.arange(NB).reshape(NB, 1, 1, 1, 1) * 10_000
    return blocks + code, code


def test_dynamo_layer_separate_read_outer_over_block_contiguous_is_named_dynamo_12750() -> None:
    engine = _engine((NB, 2, BS, NH, HS), ("block", "kv", "token", "head", "element"))
    block_contiguous = assumed("dynamo.layer_separate.block_contiguous", **SIZES)
    assert diff(engine, block_contiguous, rule="in_place").compatible
    # the oracle: the outer-contiguous reader takes [2, NB, BS, NH, HS] over the same bytes
    memory, _ = _block_contiguous_code()
    read = memory.reshape(2, NB, BS, NH, HS)
    kv, t, h, e = np.meshgrid(range(2), range(BS), range(NH), range(HS), indexing="ij")
    meant = ((kv * BS + t) * NH + h) * HS + e
    wrong = np.flatnonzero((read[:, 0] != meant).reshape(-1))  # block 0's page, K then V
    first_element = int(wrong[0])
    outer = assumed("dynamo.layer_separate.outer_contiguous", **SIZES)
    assert outer.layers["l0"].page_bytes == block_contiguous.layers["l0"].page_bytes
    finding = _finding(diff(engine, outer, rule="in_place"))
    assert finding.byte == first_element * 2 == BS * NH * HS * 2  # V of block 0
    assert finding.layer == "l0"


def test_dynamo_operational_nhd_against_hnd_is_named_at_the_second_head() -> None:
    nhd = assumed("dynamo.OperationalNHD", **SIZES)
    hnd = assumed("dynamo.OperationalHND", **SIZES)
    # reference: byte k of block 0's page in NHD is (kv, t, h, e) row-major; in HND (kv, h, t, e)
    first = next(
        k for k in range(2 * BS * NH * HS)
        if np.unravel_index(k, (2, BS, NH, HS))
        != tuple(np.unravel_index(k, (2, NH, BS, HS))[i] for i in (0, 2, 1, 3))
    )  # fmt: skip
    finding = _finding(diff(nhd, hnd, rule="in_place"))
    assert finding.byte == first * 2 == HS * 2


def test_dynamo_universal_tp_puts_heads_outside_layers() -> None:
    universal = assumed("dynamo.UniversalTP", **SIZES)
    layer1 = universal.layers["l1"]
    # [nb, nh, nl, no, nt, hd]: layer 1 starts one [no, nt, hd] slab in, heads two layers apart
    assert layer1.byte_offset == 2 * BS * HS * 2
    head = next(a for a in layer1.axes if a.axis == "head")
    assert head.stride_bytes == 2 * 2 * BS * HS * 2
    assert not diff(universal, assumed("dynamo.OperationalNHD", **SIZES), "in_place").compatible


# -- FlexKV ---------------------------------------------------------------------------------


def test_flexkv_layerblock_is_vllm_new_gpu_layout_and_not_vllm_033_fused_pages() -> None:
    claim = assumed("flexkv.LAYERBLOCK", **SIZES)
    # FlexKV's note: LAYERBLOCK is vLLM >= 0.23's non-MLA per-layer (num_blocks, 2, ...)
    blockwise = _engine((NB, 2, BS, NH, HS), ("block", "kv", "token", "head", "element"))
    assert diff(blockwise, claim, rule="in_place").compatible
    # vLLM 0.33 packs K and V side by side in the last axis ([B, N, H, 2 * HS], NHD)
    fused = _engine((NB, BS, NH, 2 * HS), ("block", "token", "head", "kv|element"))
    finding = _finding(diff(fused, claim, rule="in_place"))
    # reference: the claim's byte k is (kv, t, h, e) of [2, BS, NH, HS]; the engine's byte k
    # is (t, h, kv, e) of [BS, NH, 2, HS]
    first = next(
        k for k in range(2 * BS * NH * HS)
        if np.unravel_index(k, (2, BS, NH, HS))
        != tuple(np.unravel_index(k, (BS, NH, 2, HS))[i] for i in (2, 0, 1, 3))
    )  # fmt: skip
    assert finding.byte == first * 2 == HS * 2


def test_flexkv_mla_over_a_packed_mha_cache_is_named_flexkv_252() -> None:
    claim = assumed("flexkv.MLA", **{**SIZES, "head_size": NH * 2 * HS})
    mha = _engine((NB, BS, NH, 2 * HS), ("block", "token", "head", "kv|element"))
    report = diff(mha, claim, rule="in_place")
    finding = _finding(report)
    assert finding.byte == 0  # a latent element where the engine holds K of head 0
    assert "K token 0 head 0 element 0" in finding.message


# -- vLLM's canonical format ids and MLA rows -------------------------------------------------


def test_vllm_v1_nhd_is_an_lbnhc_engine_and_v1_hnd_is_not() -> None:
    engine = _engine((NB, BS, NH, 2 * HS), ("block", "token", "head", "kv|element"))
    assert diff(engine, assumed("vllm.v1-nhd", **SIZES), rule="in_place").compatible
    finding = _finding(diff(engine, assumed("vllm.v1-hnd", **SIZES), rule="in_place"))
    assert finding.byte == 2 * HS * 2  # the claim's head 0 token 1; the engine's head 1 token 0


def test_the_two_fp8_mla_rows_disagree_at_byte_512_pegainfer_756() -> None:
    rows = {**SIZES, "head_size": 576}
    wide, narrow = assumed("vllm.fp8_ds_mla", **rows), assumed("mla.fp8_576", **rows)
    finding = _finding(diff(wide, narrow, rule="page_copy"))
    assert finding.byte == 512
    assert diff(wide, assumed("vllm.fp8_ds_mla", **rows), rule="page_copy").compatible


def test_nvfp4_ds_mla_scales_are_stored_in_vllms_8x4_order() -> None:
    rows = {**SIZES, "head_size": 576}
    claim = assumed("vllm.nvfp4_ds_mla", **rows)
    parts = {p.name: p for p in claim.layers["l0"].parts}
    assert parts["scale"].order == "ds_mla_8x4"
    assert parts["scale"].offset_bytes == 320
    linear = claim.layers["l0"].model_copy(
        update={"parts": (*claim.layers["l0"].parts[:2], parts["scale"].model_copy(
            update={"order": "linear"}))}
    )  # fmt: skip
    other = Manifest(layers={"l0": Manifest.model_validate(
        {"layers": {"l0": linear.model_dump(exclude={"fingerprint"})}}).layers["l0"]})  # fmt: skip
    finding = _finding(diff(Manifest(layers={"l0": claim.layers["l0"]}), other, "page_copy"))
    # vLLM: block s at byte 8 * (s & 3) + (s >> 2); byte 321 holds block 4, linear reads 1
    assert finding.byte == 321


def _sm100_at(t: int, s: int, per_row: int) -> int:
    """Where SM100's NVFP4 writer stores V scale (token t, block s) of one head's [T, S] grid
    (vLLM csrc ``swizzle_scale_offset``, vllm#50084): 4 tokens by 4 scales transposed."""
    group = per_row // 4
    return ((t // 4) * 4 + s // group) * per_row + (s % group) * 4 + t % 4


def test_nvfp4_v_scales_written_by_sm100_and_read_by_sm120_are_named_vllm_50084() -> None:
    heads, tokens, head_size = 2, 8, 128
    per_row = head_size // 16
    sizes = {**SIZES, "num_heads": heads, "block_tokens": tokens, "head_size": head_size}
    sm100, sm120 = assumed("vllm.nvfp4.sm100", **sizes), assumed("vllm.nvfp4.sm120", **sizes)
    layer = sm100.layers["l0"]
    data = heads * tokens * head_size // 2
    side = data + heads * tokens * per_row
    assert layer.page_bytes == 2 * side == 2 * heads * tokens * (head_size // 2 + head_size // 16)
    # the oracle: one block's page as SM100 writes it, every scale byte a code of its own
    # (kv, head, token, block of 16); SM120 reads scale (t, s) of head h at h*T*S + t*S + s
    page = np.zeros(2 * side, np.int64)
    for kv in range(2):
        for h in range(heads):
            for t in range(tokens):
                for s_ in range(per_row):
                    at = t * per_row + s_ if kv == 0 else _sm100_at(t, s_, per_row)
                    page[kv * side + data + h * tokens * per_row + at] = (
                        ((kv * heads + h) * tokens + t) * per_row + s_
                    )  # fmt: skip
    meant = np.array([
        ((kv * heads + h) * tokens + t) * per_row + s_
        for kv in range(2) for h in range(heads) for t in range(tokens) for s_ in range(per_row)
    ])  # fmt: skip
    read = np.concatenate([
        page[kv * side + data : (kv + 1) * side] for kv in range(2)
    ])  # fmt: skip
    wrong = np.flatnonzero(read != meant)
    assert wrong.size
    assert wrong[0] >= heads * tokens * per_row  # K's scales agree, V's do not
    first = side + data + int(wrong[0]) - heads * tokens * per_row
    finding = _finding(diff(sm100, sm120, rule="page_copy"))
    assert finding.byte == first
    assert "v_scale (float8_e4m3fn)" in finding.message
    assert diff(sm100, assumed("vllm.nvfp4.sm100", **sizes), rule="page_copy").compatible
    assert diff(sm120, assumed("vllm.nvfp4.sm120", **sizes), rule="page_copy").compatible
    with pytest.raises(ManifestError, match="head_size"):
        assumed("vllm.nvfp4.sm120", **{**sizes, "head_size": 72})


def test_nvfp4_page_parts_lay_out_the_ranks_own_global_heads() -> None:
    from safeview.manifest.diff import _decode_page

    heads, tokens, head_size = 2, 4, 64
    sizes = {**SIZES, "num_heads": heads, "block_tokens": tokens, "head_size": head_size,
             "topology": {"tp_rank": 1, "tp_size": 2, "total_kv_heads": 4}}  # fmt: skip
    layer = assumed("vllm.nvfp4.sm120", **sizes).layers["l0"]
    assert layer.heads == (2, 3)  # the page has no head axis: its parts' index holds two heads
    data = heads * tokens * head_size // 2
    scales = heads * tokens * head_size // 16
    # reference: each side is [data: head, token, byte] then [scales: head, token, block]
    for k, meant in (
        (tokens * head_size // 2, (0, 3, 0, 0)),  # K data, local head 1 -> global head 3
        (data + tokens * head_size // 16 + 1, (0, 3, 0, 1)),  # K scale, head 1, block 1
        (data + scales + 5, (1, 2, 0, 5)),  # V data, head 0, byte 5
    ):
        read = _decode_page(layer, np.array([k]))
        assert tuple(int(read[f][0]) for f in ("kv", "head", "token", "element")) == meant, k


# -- LMCache 0.5.6's EngineKVFormat names, through LMCache's own shapes -----------------------

LMCACHE_DENSE = [
    "NL_X_TWO_NB_BS_NH_HS", "NL_X_NB_TWO_BS_NH_HS", "NL_X_NB_BS_HS", "NL_X_NBBS_ONE_HS",
    "NL_X_TWO_NB_NH_BS_HS", "NL_X_NB_TWO_NH_BS_HS", "NL_X_NB_NH_BS_TWO_HS",
    "NL_X_NB_BS_NH_TWO_HS", "NL_X_NB_NH_BS_CS", "NL_X_NB_BS_NH_CS", "NL_X_TWO_NB_NH_ONE_BS_HS",
    "NL_X_NB_BS_NH_HS",
]  # fmt: skip
# LMCache's axis labels (specs/base.py) as a tensor's dimension meanings
_LABEL_AXES = {"TWO": "kv", "NB": "block", "BS": "token", "NH": "head", "HS": "element",
               "NBBS": "token", "ONE": "unit", "CS": "kv|element"}  # fmt: skip


def _lmcache() -> tuple[Any, Any]:
    if os.environ.get("SAFEVIEW_REQUIRE_ENGINES") != "1":
        pytest.importorskip("lmcache", reason="LMCache is not installed here")
    import lmcache.lmcache_native as native
    from lmcache.v1.gpu_connector.kv_format.specs.registry import get_spec_class

    return native, get_spec_class


@pytest.mark.parametrize("name", LMCACHE_DENSE)
def test_each_dense_lmcache_name_reads_lmcaches_own_paged_layer_shape(name: str) -> None:
    native, get_spec_class = _lmcache()
    fused = name.endswith(("_CS", "TWO_HS"))
    content = 2 * HS if fused else HS  # LMCache's hs: the packed K|V width where fused
    shape = get_spec_class(native.EngineKVFormat.__members__[name]).paged_layer_shape(
        NB, BS, NH, content
    )
    labels = [t for t in name.split("_X_")[-1].split("_") if t != "ONE" or len(shape) == 3]
    if "TWO_HS" in name:  # K|V fused in one last axis
        labels = [*labels[:-2], "CS"]
    if len(labels) != len(shape):  # LMCache drops a ONE inside a paged shape
        labels = [t for t in labels if t != "ONE"]
    axes = tuple("block" if t == "NBBS" else _LABEL_AXES[t] for t in labels)
    if "NBBS" in labels:  # blocks and tokens flattened: [NB * BS, ...] read as [NB, BS, ...]
        at = labels.index("NBBS")
        shape = (*shape[:at], NB, BS, *shape[at + 1 :])
        axes = (*axes[:at], "block", "token", *axes[at + 1 :])
    engine = _engine(tuple(shape), axes)
    claim = assumed(name, **SIZES)
    assert claim.layers["l0"].page_bytes * NB == int(np.prod(shape)) * 2 or "TWO_NB" in name
    assert diff(engine, claim, rule="in_place").compatible, name


def test_lmcache_names_whose_kv_or_planes_are_separate_tensors_are_refused_saying_why() -> None:
    for name in ("TWO_X_NL_X_NBBS_NH_HS", "NL_X_TWO_X_NB_BS_NH_HS", "NL_X_NP_X_NB_BS_ONE_HS"):
        with pytest.raises(ManifestError) as raised:
            assumed(name, **SIZES)
        assert (
            "separate" in str(raised.value)
            or "of their own" in str(raised.value)
            or ("of its own" in str(raised.value))
        )


def test_lmcache_dsa_indexer_page_holds_values_then_scales() -> None:
    claim = assumed("NL_X_NB_BSV_BSS", **{**SIZES, "head_size": 132})
    layer = claim.layers["l0"]
    assert layer.page_bytes == BS * 132
    assert [(p.name, p.offset_bytes, p.length_bytes) for p in layer.parts] == [
        ("data", 0, BS * 128), ("scale", BS * 128, BS * 4)
    ]  # fmt: skip
    # the per-token reading its registered shape [NB, BS, 132] suggests: [128 values | scale]
    # a token; the first byte they read differently is token 1's first value
    per_token = layer_from_geometry(
        "l0", axes=("block", "token", "element"), shape=(NB, BS, 132),
        strides_elements=(BS * 132, 132, 1), byte_offset=0, dtype="uint8", kind="latent",
        parts=[{"name": "data", "offset_bytes": 0, "length_bytes": 128, "dtype": "float8_e4m3fn"},
               {"name": "scale", "role": "scale", "offset_bytes": 128, "length_bytes": 4,
                "dtype": "float32", "granularity": "token_head"}],
    )  # fmt: skip
    one = Manifest(layers={"l0": layer})
    finding = _finding(diff(one, Manifest(layers={"l0": per_token}), "page_copy"))
    assert finding.byte == 128
    assert "token 1 data (float8_e4m3fn) element 0" in finding.message
    assert diff(one, one, "page_copy").compatible
