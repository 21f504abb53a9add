"""The plugin's manifest holds the parts of vLLM 0.33's pages (issue 37, point 2), read off
vLLM's own specs and caches: vLLM's planner and allocator (``allocate_kv_cache`` on ``meta`` and
CPU) build the caches of per-token-head quantized attention (its Triton backend's widened rows),
MLA in ``fp8_ds_mla``, and Mamba2 state (shapes from vLLM's own ``MambaStateShapeCalculator``)
in ``SD`` and ``DS``, padded to the attention page; ``describe_caches`` reads them.

Byte oracle: on CPU, bytes are written through vLLM's own views (the Triton backend's
``_ensure_scale_caches`` scale views, the cache tensor itself), and each part of the manifest
is read back at the bytes it names. These run where vLLM is installed (``.venv-vllm``);
elsewhere they skip. With ``SAFEVIEW_REQUIRE_VLLM=1`` a missing vLLM is a failure instead.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

if os.environ.get("SAFEVIEW_REQUIRE_VLLM") == "1":
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm", reason="vLLM is not installed here; .ci/run tests against it")

import torch
import vllm_harness as harness  # type: ignore[import-not-found,unused-ignore]
from vllm.v1.attention.backends.triton_attn import (  # type: ignore[import-not-found,unused-ignore]
    TritonAttentionBackend,
    TritonAttentionImpl,
)
from vllm.v1.kv_cache_interface import (  # type: ignore[import-not-found,unused-ignore]
    FullAttentionSpec,
    KVQuantMode,
    MambaSpec,
    MLAAttentionSpec,
)
from vllm.v1.worker.utils import allocate_kv_cache  # type: ignore[import-not-found,unused-ignore]

from safeview.manifest import Topology
from safeview.manifest._parts import part_of_code
from safeview.manifest.diff import diff
from safeview.vllm._layout import describe_caches

BLOCKS, TOKENS, HEADS, HEAD_SIZE = 4, 16, 2, 8


def _caches(specs: dict[str, Any], device: str = "cpu", layout: str = "LBHNC") -> tuple[Any, Any]:
    from vllm.v1.attention.backend import KVCacheLayout  # type: ignore[import-not-found,unused-ignore]

    _, config = harness._planned(specs, layout, BLOCKS, HEADS)
    caches = allocate_kv_cache(config, torch.device(device), KVCacheLayout[layout], None)
    return caches, config


def _per_token_head(mode: Any, dtype: torch.dtype) -> Any:
    spec = FullAttentionSpec(
        block_size=TOKENS, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=dtype,
        kv_quant_mode=mode,
    )  # fmt: skip
    return TritonAttentionBackend.customize_spec(spec)  # vLLM's widened rows


@pytest.mark.parametrize(
    ("mode", "dtype", "name"),
    [
        ("INT8_PER_TOKEN_HEAD", torch.int8, "int8"),
        ("FP8_PER_TOKEN_HEAD", torch.float8_e4m3fn, "float8_e4m3fn"),
    ],
)
def test_per_token_head_rows_carry_their_inline_fp32_scale(
    mode: str, dtype: torch.dtype, name: str
) -> None:
    spec = _per_token_head(KVQuantMode[mode], dtype)
    caches, config = _caches({"model.layers.0.attn": spec, "model.layers.1.attn": spec})
    manifest = describe_caches(caches, config, Topology()).manifest()
    layer = manifest.layers["model.layers.0.attn"]
    assert [(p.name, p.offset_bytes, p.length_bytes, p.dtype) for p in layer.parts] == [
        ("data", 0, HEAD_SIZE, name), ("scale", HEAD_SIZE, 4, "float32")
    ]  # fmt: skip
    assert layer.parts[1].granularity == "token_head"
    # the oracle: vLLM's own scale views (_ensure_scale_caches) write each (block, token,
    # head) its own scale; the manifest's scale part, read at the bytes it names, holds them
    cache = caches["model.layers.0.attn"]
    impl = TritonAttentionImpl.__new__(TritonAttentionImpl)
    impl._ensure_scale_caches(cache)
    codes = torch.arange(BLOCKS * TOKENS * HEADS, dtype=torch.float32).reshape(
        BLOCKS, TOKENS, HEADS
    )
    impl._k_scale_cache.copy_(codes)
    impl._v_scale_cache.copy_(codes + 10_000)
    raw = cache.untyped_storage()
    memory = np.frombuffer(bytes(raw), dtype=np.uint8)
    scale = layer.parts[1]
    for block, token, head, kv in ((0, 0, 0, 0), (1, 5, 1, 1), (3, 15, 1, 0)):
        at = layer.byte_offset + block * layer.block_stride_bytes
        for axis in layer.axes:
            index = {"kv": kv, "token": token, "head": head}.get(axis.axis, 0)
            at += index * axis.stride_bytes
        value = memory[at + scale.offset_bytes : at + scale.offset_bytes + 4].view("<f4")[0]
        expected = codes[block, token, head].item() + (10_000 if kv else 0)
        assert value == expected, (block, token, head, kv)
    # a reader of the unwidened row is named at the first scale byte
    plain = FullAttentionSpec(block_size=TOKENS, num_kv_heads=HEADS, head_size=HEAD_SIZE,
                              dtype=dtype)  # fmt: skip
    other, other_config = _caches({"model.layers.0.attn": plain, "model.layers.1.attn": plain})
    unwidened = describe_caches(other, other_config, Topology()).manifest()
    findings = [
        f for f in diff(manifest, unwidened, rule="page_copy").findings
        if f.receiver_reads is not None
    ]  # fmt: skip
    assert findings
    assert findings[0].byte == HEAD_SIZE
    assert "scale (float32)" in findings[0].message


def test_fp8_ds_mla_rows_hold_latent_scales_and_bf16_rope() -> None:
    spec = MLAAttentionSpec(
        block_size=64, num_kv_heads=1, max_tp_shards=1, head_size=576, dtype=torch.uint8,
        cache_dtype_str="fp8_ds_mla", state_content_bytes=656,
    )  # fmt: skip
    caches, config = _caches({"model.layers.0.attn": spec}, device="meta")
    layer = describe_caches(caches, config, Topology()).manifest().layers["model.layers.0.attn"]
    assert [(p.name, p.offset_bytes, p.length_bytes, p.dtype) for p in layer.parts] == [
        ("data", 0, 512, "float8_e4m3fn"), ("scale", 512, 16, "float32"),
        ("rope", 528, 128, "bfloat16"),
    ]  # fmt: skip
    assert layer.row_bytes == 656
    plain = MLAAttentionSpec(block_size=64, num_kv_heads=1, max_tp_shards=1, head_size=576,
                             dtype=torch.bfloat16)  # fmt: skip
    caches, config = _caches({"model.layers.0.attn": plain}, device="meta")
    assert (
        not describe_caches(caches, config, Topology())
        .manifest()
        .layers["model.layers.0.attn"]
        .parts
    )  # a bf16 MLA row: one data part, as before


def _mamba2_spec(tp: int, page_size_padded: int | None = None) -> Any:
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    shapes = MambaStateShapeCalculator.mamba2_state_shape(
        tp_world_size=tp, intermediate_size=64, n_groups=2, num_heads=8, head_dim=8,
        state_size=4, conv_kernel=4,
    )  # fmt: skip
    return MambaSpec(
        block_size=TOKENS, shapes=shapes, dtypes=(torch.float16, torch.float32),
        page_size_padded=page_size_padded, mamba_type=MambaAttentionBackendEnum.MAMBA2,
    )  # fmt: skip


@pytest.mark.parametrize("layout", ["SD", "DS"])
def test_mamba2_state_holds_x_b_c_segments_ssm_and_padding(
    layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm.model_executor.layers.mamba import mamba_utils

    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", layout)
    mamba_utils.get_conv_state_layout.cache_clear()
    try:
        spec = _mamba2_spec(tp=1)
        real = spec.page_size_bytes
        padded = _mamba2_spec(tp=1, page_size_padded=real + 64)
        caches, config = _caches({"model.layers.0.mixer": padded}, device="meta")
        manifest = describe_caches(caches, config, Topology()).manifest()
    finally:
        mamba_utils.get_conv_state_layout.cache_clear()
    layer = manifest.layers["model.layers.0.mixer"]
    names = [p.name for p in layer.parts]
    assert names[:4] == ["x", "B", "C", "ssm"]
    covered = sum(p.count * p.length_bytes for p in layer.parts)
    assert covered == layer.row_bytes
    x = layer.parts[0]
    # conv state (conv_dim 64 + 2 * 2 * 4 = 80 columns, 3 rows) in float16
    assert x.tp == "segment"
    assert x.dtype == "float16"
    if layout == "DS":
        assert (x.offset_bytes, x.length_bytes, x.count) == (0, 64 * 3 * 2, 1)
    else:
        assert (x.offset_bytes, x.length_bytes, x.count, x.stride_bytes) == (0, 128, 3, 160)
    if "pad" in names:
        assert layer.parts[-1].role == "pad"
    assert layer.block_stride_bytes >= real + 64


def test_mamba2_segments_merged_under_another_tp_split_are_named() -> None:
    from vllm.model_executor.layers.mamba import mamba_utils

    os.environ["VLLM_SSM_CONV_STATE_LAYOUT"] = "DS"
    mamba_utils.get_conv_state_layout.cache_clear()
    try:
        p_caches, p_config = _caches({"model.layers.0.mixer": _mamba2_spec(tp=2)}, device="meta")
        d_caches, d_config = _caches({"model.layers.0.mixer": _mamba2_spec(tp=1)}, device="meta")
        p = describe_caches(p_caches, p_config, Topology(tp_size=2)).manifest()
        d = describe_caches(d_caches, d_config, Topology(tp_size=1)).manifest()
        again = describe_caches(p_caches, p_config, Topology(tp_size=2)).manifest()
    finally:
        del os.environ["VLLM_SSM_CONV_STATE_LAYOUT"]
        mamba_utils.get_conv_state_layout.cache_clear()
    findings = [
        f for f in diff(p, d, rule="page_copy").findings if f.receiver_reads is not None
    ]  # fmt: skip
    # P rank 0's x holds 32 of the 64 columns: its B begins where D's x column 32 lies
    assert findings
    assert findings[0].byte == 32 * 3 * 2
    assert "B (float16) element 0" in findings[0].message
    assert "x (float16) element 32" in findings[0].message
    assert diff(p, again, rule="page_copy").compatible


def test_without_parts_the_plugins_manifest_is_the_one_of_before() -> None:
    plain = FullAttentionSpec(block_size=TOKENS, num_kv_heads=HEADS, head_size=HEAD_SIZE,
                              dtype=torch.float16)  # fmt: skip
    caches, config = _caches({"model.layers.0.attn": plain}, device="meta")
    derived = describe_caches(caches, config, Topology())
    assert "parts" not in derived.to_json()
    assert SimpleNamespace(parts=derived.manifest().layers["model.layers.0.attn"].parts).parts == ()


@pytest.mark.parametrize("name", ["vllm.nvfp4.sm100", "vllm.nvfp4.sm120"])
def test_nvfp4_claims_read_each_byte_where_vllms_own_nvfp4_views_put_it(name: str) -> None:
    """vLLM's planner and allocator build an NVFP4 cache on CPU (FlashInfer's
    ``customize_spec``: ``2 * heads`` slots of ``head_size / 2 + head_size / 16`` bytes); its
    own ``_nvfp4_kv_views`` carve K and V data and scales out of it. Each byte a view holds
    must be, in the claim, the part, K/V, head, token and element (a scale's: its block) that
    view says; SM120's linear V scales and SM100's 4x4 swizzle differ only in the V scales."""
    from vllm.v1.attention.backends.flashinfer import (  # type: ignore[import-not-found,unused-ignore]
        FlashInferBackend,
        _nvfp4_kv_views,
    )

    from safeview.manifest import assumed
    from safeview.manifest.diff import _decode_page

    head_size, tokens = 64, 16
    spec = FlashInferBackend.customize_spec(
        FullAttentionSpec(block_size=tokens, num_kv_heads=HEADS, head_size=head_size,
                          dtype=torch.uint8, kv_quant_mode=KVQuantMode.NVFP4)
    )  # fmt: skip
    caches, config = _caches({"model.layers.0.attn": spec})
    cache = caches["model.layers.0.attn"]
    # the plugin leaves NVFP4 pages as 0.7.0 read them (docs/layouts.md): no parts
    plugin = describe_caches(caches, config, Topology()).manifest()
    assert plugin.layers["model.layers.0.attn"].parts == ()
    (k_data, v_data), (k_scale, v_scale), order = _nvfp4_kv_views(cache, HEADS)
    assert order == "HND"
    claim = assumed(name, layers=["model.layers.0.attn"], num_blocks=BLOCKS, block_tokens=tokens,
                    num_heads=HEADS, head_size=head_size, dtype="uint8")  # fmt: skip
    layer = claim.layers["model.layers.0.attn"]
    assert layer.page_bytes == spec.page_size_bytes == cache.stride(0)
    page = np.arange(layer.page_bytes, dtype=np.int64)
    read = _decode_page(layer, page)
    base = cache.data_ptr()
    per_row = head_size // 16
    for kv, (data, scale) in enumerate(((k_data, k_scale), (v_data, v_scale))):
        for view, part in ((data, "data"), (scale, "k_scale" if kv == 0 else "v_scale")):
            block0 = view[0]  # [heads, tokens, columns]
            for head in range(HEADS):
                for token in (0, 1, 5, tokens - 1):
                    for column in range(block0.shape[-1]):
                        at = block0[head, token, column].data_ptr() - base
                        assert read["part"][at] >= 0
                        got = part_of_code(int(read["part"][at]))[0]
                        assert got == part, (kv, part, head, token, column, got)
                        assert read["kv"][at] == kv
                        assert read["head"][at] == head
                        if part == "data" or name.endswith("sm120") or kv == 0:
                            assert (read["token"][at], read["element"][at]) == (token, column)
                        else:  # SM100 stores V scale (t, s) of a [T, S] grid 4x4-swizzled
                            t, s = int(read["token"][at]), int(read["element"][at])
                            group = per_row // 4
                            row, col = (t // 4) * 4 + s // group, (s % group) * 4 + t % 4
                            assert (row, col) == (token, column)
