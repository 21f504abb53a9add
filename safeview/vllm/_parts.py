"""The parts of vLLM 0.33's pages, read off its own cache specs (issue 37, point 2).

``parts_of(spec)`` gives the ``Part`` dicts of a layer's row as vLLM 0.33 builds it, or ``None``
where the row is one dtype's elements (or vLLM's definition of it is not read here):

- per-token-head quantized attention (``int8_per_token_head``, ``fp8_per_token_head``): each
  (token, head) row of K, and of V, is ``head_size`` values then one fp32 scale
  (``TritonAttentionBackend.customize_spec``: ``state_content_bytes``; ``_ensure_scale_caches``
  carves the scale views at byte ``hs`` of each half); ``int4_per_token_head``: ``head_size /
  2`` bytes of 4-bit codes (``quint4x2``: element 2i in the low nibble) of the values rotated
  by vLLM's Hadamard transform (``single_rht``), then the fp32 scale with the codes' zero point
  in its 4 low mantissa bits (``scale_zero_point``);
- MLA ``fp8_ds_mla`` (656 bytes a token) and ``nvfp4_ds_mla`` (352), as
  ``v1/attention/backends/mla/flashmla_sparse.py`` lays them out;
- plain MLA (the model's dtype, or ``fp8``/``fp8_e4m3``: the platform's fp8, as
  ``MLAAttention.forward`` views the cache): ``kv_lora_rank`` latent values, then
  ``qk_rope_head_dim`` rope values (vLLM's writers: ``CPUMLAImpl.do_kv_cache_update``,
  ``concat_and_cache_mla``). vLLM's spec holds only their sum (``head_size``); the two numbers
  are the model config's, read with vLLM's own ``get_mla_dims`` (``mla_dims_of``), the
  function its MLA backends size their buffers with;
- NVFP4 attention (``nvfp4_page``): a page of two sides, each every (head, token)'s e2m1
  values then their e4m3 scales, V's scales in the order of the writer vLLM picks on this
  machine;
- Mamba state: the conv state's segments (Mamba1 ``x``; Mamba2 ``x``, ``B``, ``C``; GDN ``Q``,
  ``K``, ``V``: each split by TP on its own, or replicated where the spec says
  ``tp_replicated``) in ``SD`` or ``DS`` order (``VLLM_SSM_CONV_STATE_LAYOUT``), then the
  temporal (ssm) state split by heads, then what the page holds past them as ``pad``.

The sizes are worked out here from each model's own definition (conv dim = intermediate size
+ 2 x groups x state size for Mamba2; 2 x key dim + value dim for GDN), as vLLM's NIXL
connector reads them (``ssm_conv_transfer_utils.derive_mamba_conv_split``). Needs vLLM.
"""

from __future__ import annotations

import math
from typing import Any

from safeview import _torch
from safeview.manifest._formats import FORMATS

__all__ = ["NVFP4_AXES", "mla_dims_of", "nvfp4_page", "parts_of"]

_SCALE = {"role": "scale", "dtype": "float32", "granularity": "token_head", "length_bytes": 4}


def parts_of(
    spec: Any, row_bytes: int, mla_dims: tuple[int, int] | None = None
) -> list[dict[str, Any]] | None:
    """The parts of one row (``row_bytes``: the layer's element axis) of a layer of ``spec``;
    ``None`` where vLLM's names are not the ones read here (another vLLM): the layer then reads
    as one ``data`` part, as before. ``mla_dims``: the model's ``(kv_lora_rank,
    qk_rope_head_dim)`` (``mla_dims_of``); without them a plain MLA row is one ``data`` part."""
    try:
        return _parts_of(spec, row_bytes, mla_dims)
    except (ImportError, AttributeError, TypeError, ValueError, IndexError):
        return None


NVFP4_AXES = ("block", "kv", "element")
"""An NVFP4 page as its kernels read it (``_nvfp4_kv_views``): per block, K's side then V's."""


def nvfp4_page(spec: Any, cache: Any) -> tuple[list[dict[str, Any]], int] | None:
    """An NVFP4 attention layer's page (``kv_quant_mode`` NVFP4; FlashInfer's
    ``customize_spec``: ``2 * heads`` slots of ``head_size / 2 + head_size / 16`` bytes): the
    ``Part`` dicts of one K or V side and its bytes, read as ``_nvfp4_kv_views`` reads the
    cache (each side every (head, token)'s e2m1 values, then their e4m3 scales), V's scales in
    the order vLLM's writer on this machine stores them (``_nvfp4_kv_on_fa2``: FlashInfer's fa2
    writer on SM80/90/120, linear; else the SM100 trtllm-gen kernel's 4x4 swizzle,
    vllm#50084). ``None`` for any other layer, or an NVFP4 cache not laid out HND."""
    try:
        return _nvfp4_page(spec, cache)
    except (ImportError, AttributeError, TypeError, ValueError, IndexError):
        return None


def _nvfp4_page(spec: Any, cache: Any) -> tuple[list[dict[str, Any]], int] | None:
    from vllm.v1.kv_cache_interface import AttentionSpec, KVQuantMode

    if not isinstance(spec, AttentionSpec) or spec.kv_quant_mode != KVQuantMode.NVFP4:
        return None
    heads, head_size = spec.num_kv_heads, spec.head_size
    _, slots, tokens, full = (int(n) for n in cache.shape)
    if slots != 2 * heads or full != head_size // 2 + head_size // 16 or cache.element_size() != 1:
        return None
    if tuple(cache.stride())[1:] != (tokens * full, full, 1):
        return None  # NHD: its V scale order is not read here
    from vllm.v1.attention.backends.flashinfer import _nvfp4_kv_on_fa2

    named = FORMATS["vllm.nvfp4.sm120" if _nvfp4_kv_on_fa2() else "vllm.nvfp4.sm100"]
    return named.page(heads, tokens, head_size)  # type: ignore[misc]


def mla_dims_of(model_config: Any) -> tuple[int, int] | None:
    """``(kv_lora_rank, qk_rope_head_dim)`` of the model, as vLLM 0.33 reads them
    (``get_mla_dims``); ``None`` where the config has no MLA dimensions or is not there."""
    if model_config is None:
        return None
    try:
        from vllm.model_executor.layers.attention.mla_attention import get_mla_dims

        dims = get_mla_dims(model_config)
        latent, rope = int(dims.kv_lora_rank), int(dims.qk_rope_head_dim)
    except (ImportError, AttributeError, TypeError, ValueError):
        return None
    return (latent, rope) if latent > 0 and rope > 0 else None


def _parts_of(
    spec: Any, row_bytes: int, mla_dims: tuple[int, int] | None
) -> list[dict[str, Any]] | None:
    from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec

    if isinstance(spec, MambaSpec):
        return _mamba(spec, row_bytes)
    if isinstance(spec, AttentionSpec):
        dtype = str(getattr(spec, "cache_dtype_str", None) or "")
        if dtype in ("fp8_ds_mla", "nvfp4_ds_mla"):
            parts, row = FORMATS[f"vllm.{dtype}"].row(0, "uint8")  # type: ignore[misc]
            return parts if row == row_bytes else None
        if getattr(spec, "head_size_v", None) == 0:  # MLA: one latent vector, no V
            return _plain_mla(spec, row_bytes, mla_dims)
        return _per_token_head(spec, row_bytes)
    return None


def _plain_mla(
    spec: Any, row_bytes: int, mla_dims: tuple[int, int] | None
) -> list[dict[str, Any]] | None:
    """A plain MLA row: the latent, then the rope values, one element type."""
    from vllm.v1.kv_cache_interface import KVQuantMode

    if mla_dims is None or getattr(spec, "model_version", None) is not None:
        return None  # DeepSeek-V4's rows hold their rope inside the latent: not read here
    latent, rope = mla_dims
    if latent + rope != spec.head_size:  # another MLA layer (an indexer): not this split
        return None
    mode = spec.kv_quant_mode
    if mode == KVQuantMode.NONE:
        element = spec.dtype
    elif mode == KVQuantMode.FP8_PER_TENSOR and spec.cache_dtype_str in ("fp8", "fp8_e4m3"):
        from vllm.platforms import current_platform

        element = current_platform.fp8_dtype()  # MLAAttention.forward's view of the cache
    else:  # fp8_e5m2 (written e5m2, viewed as the platform's fp8) and the rest: not read here
        return None
    size = element.itemsize
    if spec.head_size * size != row_bytes:
        return None
    name = _torch.dtype_name(element)
    return [
        {"name": "data", "offset_bytes": 0, "length_bytes": latent * size, "dtype": name},
        {"name": "rope", "role": "rope", "offset_bytes": latent * size,
         "length_bytes": rope * size, "dtype": name},
    ]  # fmt: skip


def _per_token_head(spec: Any, row_bytes: int) -> list[dict[str, Any]] | None:
    from vllm.v1.kv_cache_interface import KVQuantMode

    mode = getattr(spec, "kv_quant_mode", None)
    if mode == KVQuantMode.INT4_PER_TOKEN_HEAD:
        return _int4_per_token_head(spec, row_bytes)
    if mode not in (KVQuantMode.INT8_PER_TOKEN_HEAD, KVQuantMode.FP8_PER_TOKEN_HEAD):
        return None
    itemsize = spec.dtype.itemsize
    data = spec.head_size * itemsize
    if data + 4 != row_bytes:  # not the row vLLM's Triton backend widens
        return None
    return [
        {"name": "data", "offset_bytes": 0, "length_bytes": data,
         "dtype": _torch.dtype_name(spec.dtype)},
        {"name": "scale", "offset_bytes": data, **_SCALE},
    ]  # fmt: skip


def _int4_per_token_head(spec: Any, row_bytes: int) -> list[dict[str, Any]] | None:
    """An int4 row: ``head_size / 2`` bytes of 4-bit codes, two a byte, then one fp32 scale
    whose 4 low mantissa bits hold the codes' zero point (``int4_per_token_head.py``:
    ``pack_int4_nibbles``, ``(scale_bits & -16) | zp``)."""
    if spec.head_size % 2 or spec.dtype.itemsize != 1:
        return None
    data = spec.head_size // 2
    if data + 4 != row_bytes:  # not the row vLLM's Triton backend widens
        return None
    return [
        {"name": "data", "offset_bytes": 0, "length_bytes": data, "dtype": "quint4x2"},
        {"name": "scale_zero_point", "offset_bytes": data, **_SCALE},
    ]


def _mamba(spec: Any, row_bytes: int) -> list[dict[str, Any]] | None:
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum as Kind

    if len(spec.shapes) != 2 or len(spec.shapes[0]) != 2:
        return None  # a ring or a third state: not read here
    layout = get_conv_state_layout()
    conv_shape, temporal = spec.shapes
    conv_dim, rows = conv_shape if layout == "DS" else conv_shape[::-1]
    conv_size = spec.dtypes[0].itemsize
    kind = spec.mamba_type
    if kind == Kind.MAMBA1:
        widths = [("x", conv_dim)]
    elif kind == Kind.MAMBA2:
        x = temporal[0] * temporal[1]  # this rank's heads x head dim
        widths = [("x", x), ("B", (conv_dim - x) // 2), ("C", (conv_dim - x) // 2)]
    elif kind == Kind.GDN_ATTN:
        value = temporal[0] * temporal[1]
        widths = [("Q", (conv_dim - value) // 2), ("K", (conv_dim - value) // 2), ("V", value)]
    else:
        return None
    if sum(w for _, w in widths) != conv_dim or min(w for _, w in widths) <= 0:
        return None
    tp = "replicated" if getattr(spec, "tp_replicated", False) else "segment"
    conv_type = _torch.dtype_name(spec.dtypes[0])
    parts: list[dict[str, Any]] = []
    at = 0
    for name, width in widths:
        if layout == "DS":  # each segment's columns contiguous, rows inside
            place = {"offset_bytes": at * rows * conv_size,
                     "length_bytes": width * rows * conv_size,
                     "index": [["element", width], ["token", rows]]}  # fmt: skip
        else:  # SD: one run of each segment per conv row
            place = {"offset_bytes": at * conv_size, "length_bytes": width * conv_size,
                     "count": rows, "stride_bytes": conv_dim * conv_size,
                     "index": [["token", rows], ["element", width]]}  # fmt: skip
        parts.append({"name": name, "role": "segment", "dtype": conv_type, "tp": tp, **place})
        at += width
    conv_bytes = conv_dim * rows * conv_size
    ssm_bytes = math.prod(temporal) * spec.dtypes[1].itemsize
    parts.append({
        "name": "ssm", "role": "segment", "dtype": _torch.dtype_name(spec.dtypes[1]),
        "tp": "replicated" if tp == "replicated" else "heads", "offset_bytes": conv_bytes,
        "length_bytes": ssm_bytes,
    })  # fmt: skip
    if conv_bytes + ssm_bytes > row_bytes:
        return None
    if conv_bytes + ssm_bytes < row_bytes:  # the page padded to the attention page
        parts.append({"name": "pad", "role": "pad", "dtype": "uint8",
                      "offset_bytes": conv_bytes + ssm_bytes,
                      "length_bytes": row_bytes - conv_bytes - ssm_bytes})  # fmt: skip
    return parts
