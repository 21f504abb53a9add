"""Formats other projects name, as claims a manifest can check (issue 37, point 5).

Each named format is derived here from its project's own definition (the file is cited with
it) and written as a dense order of dimensions, outermost first: ``L`` layer, ``B`` block,
``K`` K/V (2), ``T`` token, ``H`` head, ``E`` head element, ``C`` K and V side by side in one
axis (2 x head size), ``1`` an axis of size 1, plus the parts of a row or a page where the
format holds several (``parts``). ``assumed(name, ...)`` builds the manifest of what a
connector that names the format reads; ``diff`` of it against the engine's real manifest
(``rule="in_place"``) names the first byte they read differently. Nothing here is guessed from
a shape: a name is one order of bytes, as its source writes it. No torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from safeview.errors import ManifestError

__all__ = ["FORMATS", "NamedFormat"]

# a format's parts (``Part`` dicts) and the bytes of the axis they lie in
Parts = tuple[list[dict[str, Any]], int]

# the manifest's axis name of each dimension letter
AXES = {
    "B": "block",
    "K": "kv",
    "T": "token",
    "H": "head",
    "E": "element",
    "C": "kv|element",
    "1": "unit",
}


@dataclass(frozen=True)
class NamedFormat:
    """One named format: its dimensions (outermost first), where it is defined, whether each
    layer is an allocation of its own (``per_layer``: a list of per-layer tensors), whether it
    is MLA (one latent vector per token, no K/V, one head), and the parts its rows hold (a
    function of the head size and dtype giving ``Part`` dicts, and the row's bytes), or, for
    a format whose parts span a block's tokens and heads, those of its ``E`` axis (``page``:
    a function of the head count, block tokens and head size giving ``Part`` dicts with their
    ``index``, and the axis's bytes)."""

    dims: str
    source: str
    per_layer: bool = False
    latent: bool = False
    row: Callable[[int, str], Parts] | None = None
    page: Callable[[int, int, int], Parts] | None = None


def _fp8_ds_mla(head_size: int, dtype: str) -> Parts:
    """vLLM's fp8_ds_mla token, 656 bytes: 512 e4m3, 4 fp32 scales (one per 128), 64 bf16."""
    return [
        {"name": "data", "offset_bytes": 0, "length_bytes": 512, "dtype": "float8_e4m3fn"},
        {"name": "scale", "role": "scale", "offset_bytes": 512, "length_bytes": 16,
         "dtype": "float32", "granularity": "tile", "group_elements": 128, "group_tokens": 1},
        {"name": "rope", "role": "rope", "offset_bytes": 528, "length_bytes": 128,
         "dtype": "bfloat16"},
    ], 656  # fmt: skip


def _fp8_mla_576(head_size: int, dtype: str) -> Parts:
    """The FP8 MLA row of 576 bytes: 512 e4m3 latent then 64 e4m3 rope, no scale in the row."""
    return [
        {"name": "data", "offset_bytes": 0, "length_bytes": 512, "dtype": "float8_e4m3fn"},
        {"name": "rope", "role": "rope", "offset_bytes": 512, "length_bytes": 64,
         "dtype": "float8_e4m3fn"},
    ], 576  # fmt: skip


def _nvfp4_ds_mla(head_size: int, dtype: str) -> Parts:
    """vLLM's nvfp4_ds_mla token, 352 bytes: 512 e2m1 two a byte, 64 e4m3 rope, 32 e4m3
    scales (one per 16) stored in the 8x4 -> 4x8 order ``ds_mla_8x4``."""
    return [
        {"name": "data", "offset_bytes": 0, "length_bytes": 256, "dtype": "float4_e2m1fn_x2"},
        {"name": "rope", "role": "rope", "offset_bytes": 256, "length_bytes": 64,
         "dtype": "float8_e4m3fn"},
        {"name": "scale", "role": "scale", "offset_bytes": 320, "length_bytes": 32,
         "dtype": "float8_e4m3fn", "granularity": "block", "group_elements": 16,
         "order": "ds_mla_8x4"},
    ], 352  # fmt: skip


def _nvfp4_side(num_heads: int, block_tokens: int, head_size: int, v_order: str) -> Parts:
    """One K or V side of vLLM's NVFP4 page, HND: every (head, token)'s ``head_size / 2``
    bytes of e2m1 values (two a byte), then every (head, token)'s ``head_size / 16`` e4m3
    scales, one per 16 values; K's scales linear, V's in ``v_order``."""
    if head_size % 16:
        raise ManifestError(
            "head_size", head_size, "is not a multiple of 16 (NVFP4 scales blocks of 16 values)"
        )
    per_row = head_size // 16
    if v_order != "linear" and (block_tokens % 4 or per_row % 4):
        raise ManifestError(
            "block_tokens, head_size", [block_tokens, head_size],
            "are not multiples of 4 and 64: the 4x4 scale swizzle tiles 4 tokens by 4 scales",
        )  # fmt: skip
    data = num_heads * block_tokens * head_size // 2
    scales = num_heads * block_tokens * per_row
    grid = [["head", num_heads], ["token", block_tokens], ["element", per_row]]
    scale = {"role": "scale", "offset_bytes": data, "length_bytes": scales,
             "dtype": "float8_e4m3fn", "granularity": "block", "group_elements": 16,
             "index": grid}  # fmt: skip
    return [
        {"name": "data", "offset_bytes": 0, "length_bytes": data, "dtype": "float4_e2m1fn_x2",
         "index": [["head", num_heads], ["token", block_tokens], ["element", head_size // 2]]},
        {**scale, "name": "k_scale", "kv": 0},
        {**scale, "name": "v_scale", "kv": 1, "order": v_order},
    ], data + scales  # fmt: skip


def _nvfp4_sm100(num_heads: int, block_tokens: int, head_size: int) -> Parts:
    return _nvfp4_side(num_heads, block_tokens, head_size, "trtllm_4x4")


def _nvfp4_sm120(num_heads: int, block_tokens: int, head_size: int) -> Parts:
    return _nvfp4_side(num_heads, block_tokens, head_size, "linear")


def _bsv_bss(num_heads: int, block_tokens: int, head_size: int) -> Parts:
    """LMCache's DSA indexer page: a block's ``head_size - 4`` fp8 values a token, then its
    fp32 scales, one a token."""
    values = head_size - 4
    if values < 1:
        raise ManifestError("head_size", head_size, "leaves no value before the 4-byte scale")
    return [
        {"name": "data", "offset_bytes": 0, "length_bytes": block_tokens * values,
         "dtype": "float8_e4m3fn", "index": [["token", block_tokens], ["element", values]]},
        {"name": "scale", "role": "scale", "offset_bytes": block_tokens * values,
         "length_bytes": block_tokens * 4, "dtype": "float32", "granularity": "token_head",
         "index": [["token", block_tokens], ["element", 1]]},
    ], block_tokens * head_size  # fmt: skip


_VLLM_MLA = "vllm/v1/attention/backends/mla/flashmla_sparse.py (vLLM 0.33, its format note)"
_DYNAMO_BLOCK = "ai-dynamo/dynamo lib/kvbm-physical/src/layout/kv_block_layout.rs (KvBlockLayout)"
_DYNAMO_LS = (
    "ai-dynamo/dynamo lib/kvbm-physical/src/layout/layer_separate.rs (block- or outer-contiguous)"
)
_VLLM_NVFP4 = (
    "vllm/v1/attention/backends/flashinfer.py (_nvfp4_kv_views, customize_spec) and "
    "vllm/utils/torch_utils.py (nvfp4_split_data_scale), vLLM 0.33; the V scale swizzle: "
    "csrc nvfp4_kv_cache_kernels.cu swizzle_scale_offset, vllm#50084"
)
_FLEXKV = "taco-project/FlexKV flexkv/common/storage.py (KVCacheLayout._compute_kv_shape)"
_VLLM_CANON = (
    "vllm/distributed/kv_transfer/kv_connector/v1/offloading/canonical_mapping.py "
    "(canonical_format_id: v1 of the LBNHC / LBHNC family, all heads)"
)

FORMATS: dict[str, NamedFormat] = {
    # Dynamo KVBM: a fully contiguous allocation [nb, nl, no, nt, nh, hd] (OperationalNHD by
    # default), its four named block orders, and the layer-separate layouts (one allocation
    # per layer, [nb, no, nt, nh*hd] block-contiguous or [no, nb, nt, nh*hd] outer-contiguous)
    "dynamo.fully_contiguous": NamedFormat("BLKTHE", _DYNAMO_BLOCK + "; fully_contiguous.rs"),
    "dynamo.OperationalNHD": NamedFormat("BLKTHE", _DYNAMO_BLOCK),
    "dynamo.OperationalHND": NamedFormat("BLKHTE", _DYNAMO_BLOCK),
    "dynamo.UniversalTP": NamedFormat("BHLKTE", _DYNAMO_BLOCK),
    "dynamo.UniversalPP": NamedFormat("BLHKTE", _DYNAMO_BLOCK),
    "dynamo.layer_separate.block_contiguous": NamedFormat("BKTHE", _DYNAMO_LS, per_layer=True),
    "dynamo.layer_separate.outer_contiguous": NamedFormat("KBTHE", _DYNAMO_LS, per_layer=True),
    # FlexKV: [nl, kv, nb, bs, nh, hs], [nb, nl, kv, bs, nh, hs], [nl, nb, kv, bs, nh, hs];
    # MLA: kv_dim 1 and one head, its per-layer vLLM tensor [nb, bs, hs] (LAYERFIRST)
    "flexkv.LAYERFIRST": NamedFormat("LKBTHE", _FLEXKV),
    "flexkv.BLOCKFIRST": NamedFormat("BLKTHE", _FLEXKV),
    "flexkv.LAYERBLOCK": NamedFormat("LBKTHE", _FLEXKV),
    "flexkv.MLA": NamedFormat("LBTE", _FLEXKV + " (is_mla: kv_dim 1, one head)", latent=True),
    # vLLM's canonical pages (offloading with canonical_layout): per layer and block, every
    # KV head, K and V side by side in the last axis, tokens outside heads (nhd) or inside
    "vllm.v1-nhd": NamedFormat("LBTHC", _VLLM_CANON),
    "vllm.v1-hnd": NamedFormat("LBHTC", _VLLM_CANON),
    # FP8 and NVFP4 MLA rows (one token each), per layer [nb, bs, row]
    "vllm.fp8_ds_mla": NamedFormat("LBTE", _VLLM_MLA, latent=True, row=_fp8_ds_mla),
    "vllm.nvfp4_ds_mla": NamedFormat("LBTE", _VLLM_MLA, latent=True, row=_nvfp4_ds_mla),
    # NVFP4 attention pages, per layer [nb, 2, side]: each side every (head, token)'s e2m1
    # values, then their e4m3 scales; V's scales swizzled 4x4 for SM100's trtllm-gen kernel,
    # linear for SM120's (vllm#50084)
    "vllm.nvfp4.sm100": NamedFormat("LBKE", _VLLM_NVFP4, page=_nvfp4_sm100),
    "vllm.nvfp4.sm120": NamedFormat("LBKE", _VLLM_NVFP4, page=_nvfp4_sm120),
    "mla.fp8_576": NamedFormat(
        "LBTE",
        "pegainfer#756 and vLLM flashmla_sparse.py (the DeepSeek 576-byte layout fp8_ds_mla keeps "
        "on SM90: 512 e4m3 then 64 e4m3 rope)",
        latent=True,
        row=_fp8_mla_576,
    ),
}
"""Named formats ``assumed`` knows besides LMCache's ``EngineKVFormat`` names, each with the
file it is derived from."""

# LMCache 0.5.6's EngineKVFormat names (lmcache/lmcache_native.pyi; each spec in
# lmcache/v1/gpu_connector/kv_format/specs/) that are not one order of dense axes per layer,
# with why: a format whose K and V, or whose planes, are separate allocations has no single
# first byte per layer to be read in place from.
LMCACHE_NOT_DENSE: dict[str, str] = {
    "TWO_X_NL_X_NBBS_NH_HS": "K and V are separate lists of per-layer tensors",
    "TWO_X_NL_X_NB_BS_NH_HS": "K and V are separate lists of per-layer tensors",
    "NL_X_TWO_X_NB_BS_NH_HS": "each layer's K and V are two tensors of their own",
    "NL_X_NP_X_NB_BS_ONE_HS": "each layer is a tuple of planes, each a tensor of its own",
}

# LMCache's DSA indexer page (specs/nl_x_nb_bsv_bss.py): per block, every token's 128 fp8
# values, then every token's fp32 scale
LMCACHE_BSV_BSS = "NL_X_NB_BSV_BSS"
LMCACHE_BSV_BSS_FORMAT = NamedFormat(
    "BE",
    "lmcache/lmcache_native.pyi (EngineKVFormat, LMCache 0.5.6); "
    "lmcache/v1/gpu_connector/kv_format/specs/nl_x_nb_bsv_bss.py",
    per_layer=True,
    latent=True,
    page=_bsv_bss,
)
