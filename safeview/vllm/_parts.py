"""The parts of vLLM 0.33's pages, read off its own cache specs (issue 37, point 2).

``parts_of(spec)`` gives the ``Part`` dicts of a layer's row as vLLM 0.33 builds it, or ``None``
where the row is one dtype's elements (or vLLM's definition of it is not read here):

- per-token-head quantized attention (``int8_per_token_head``, ``fp8_per_token_head``): each
  (token, head) row of K, and of V, is ``head_size`` values then one fp32 scale
  (``TritonAttentionBackend.customize_spec``: ``state_content_bytes``; ``_ensure_scale_caches``
  carves the scale views at byte ``hs`` of each half);
- MLA ``fp8_ds_mla`` (656 bytes a token) and ``nvfp4_ds_mla`` (352), as
  ``v1/attention/backends/mla/flashmla_sparse.py`` lays them out;
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

__all__ = ["parts_of"]

_SCALE = {"role": "scale", "dtype": "float32", "granularity": "token_head", "length_bytes": 4}


def parts_of(spec: Any, row_bytes: int) -> list[dict[str, Any]] | None:
    """The parts of one row (``row_bytes``: the layer's element axis) of a layer of ``spec``;
    ``None`` where vLLM's names are not the ones read here (another vLLM): the layer then reads
    as one ``data`` part, as before."""
    try:
        return _parts_of(spec, row_bytes)
    except (ImportError, AttributeError, TypeError, ValueError, IndexError):
        return None


def _parts_of(spec: Any, row_bytes: int) -> list[dict[str, Any]] | None:
    from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec

    if isinstance(spec, MambaSpec):
        return _mamba(spec, row_bytes)
    if isinstance(spec, AttentionSpec):
        dtype = str(getattr(spec, "cache_dtype_str", None) or "")
        if dtype in ("fp8_ds_mla", "nvfp4_ds_mla"):
            parts, row = FORMATS[f"vllm.{dtype}"].row(0, "uint8")  # type: ignore[misc]
            return parts if row == row_bytes else None
        return _per_token_head(spec, row_bytes)
    return None


def _per_token_head(spec: Any, row_bytes: int) -> list[dict[str, Any]] | None:
    from vllm.v1.kv_cache_interface import KVQuantMode

    mode = getattr(spec, "kv_quant_mode", None)
    if mode not in (KVQuantMode.INT8_PER_TOKEN_HEAD, KVQuantMode.FP8_PER_TOKEN_HEAD):
        return None  # int4 packs two values a byte with zero points: not read here
    itemsize = spec.dtype.itemsize
    data = spec.head_size * itemsize
    if data + 4 != row_bytes:  # not the row vLLM's Triton backend widens
        return None
    return [
        {"name": "data", "offset_bytes": 0, "length_bytes": data,
         "dtype": _torch.dtype_name(spec.dtype)},
        {"name": "scale", "offset_bytes": data, **_SCALE},
    ]  # fmt: skip


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
