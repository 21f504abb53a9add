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
import warnings
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


def _nvfp4_spec(head_size: int = 64, tokens: int = 16) -> Any:
    from vllm.v1.attention.backends.flashinfer import (  # type: ignore[import-not-found,unused-ignore]
        FlashInferBackend,
    )

    return FlashInferBackend.customize_spec(
        FullAttentionSpec(block_size=tokens, num_kv_heads=HEADS, head_size=head_size,
                          dtype=torch.uint8, kv_quant_mode=KVQuantMode.NVFP4)
    )  # fmt: skip


@pytest.mark.parametrize("name", ["vllm.nvfp4.sm100", "vllm.nvfp4.sm120", "plugin"])
def test_nvfp4_claims_read_each_byte_where_vllms_own_nvfp4_views_put_it(name: str) -> None:
    """vLLM's planner and allocator build an NVFP4 cache on CPU (FlashInfer's
    ``customize_spec``: ``2 * heads`` slots of ``head_size / 2 + head_size / 16`` bytes); its
    own ``_nvfp4_kv_views`` carve K and V data and scales out of it. Each byte a view holds
    must be, in the claim, the part, K/V, head, token and element (a scale's: its block) that
    view says; SM120's linear V scales and SM100's 4x4 swizzle differ only in the V scales.
    The plugin's reading (``describe_caches``) is the one of the writer vLLM picks here
    (``_nvfp4_kv_on_fa2``: no SM80/90/120 on this machine, so SM100's trtllm-gen kernel)."""
    from vllm.v1.attention.backends.flashinfer import (  # type: ignore[import-not-found,unused-ignore]
        _nvfp4_kv_on_fa2,
        _nvfp4_kv_views,
    )

    from safeview.manifest import assumed
    from safeview.manifest.diff import _decode_page

    head_size, tokens = 64, 16
    spec = _nvfp4_spec(head_size, tokens)
    caches, config = _caches({"model.layers.0.attn": spec})
    cache = caches["model.layers.0.attn"]
    (k_data, v_data), (k_scale, v_scale), order = _nvfp4_kv_views(cache, HEADS)
    assert order == "HND"
    if name == "plugin":
        assert not _nvfp4_kv_on_fa2()
        reading = describe_caches(caches, config, Topology()).manifest()
        name = "vllm.nvfp4.sm100"
    else:
        reading = assumed(name, layers=["model.layers.0.attn"], num_blocks=BLOCKS,
                          block_tokens=tokens, num_heads=HEADS, head_size=head_size,
                          dtype="uint8")  # fmt: skip
    layer = reading.layers["model.layers.0.attn"]
    assert layer.heads == tuple(range(HEADS))
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


# -- plain MLA: the latent, then the rope, as the model's config says --------------------------

MLA_LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


@pytest.fixture(scope="module")
def deepseek_v2(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """vLLM's own ``ModelConfig`` of the DeepSeek-V2 the NIXL harness runs (``config.json``
    only, no weights): ``kv_lora_rank`` 512, ``qk_rope_head_dim`` 64."""
    import json

    import vllm_nixl_harness as base  # type: ignore[import-not-found,unused-ignore]
    from vllm.config import ModelConfig  # type: ignore[import-not-found,unused-ignore]

    folder = tmp_path_factory.mktemp("deepseek_v2")
    (folder / "config.json").write_text(json.dumps(base._DEEPSEEK_V2), encoding="utf-8")
    return ModelConfig(model=str(folder), skip_tokenizer_init=True)


def _mla_spec(cache_dtype: str, dtype: torch.dtype) -> Any:
    from vllm.v1.kv_cache_interface import get_kv_quant_mode  # type: ignore[import-not-found,unused-ignore]

    return MLAAttentionSpec(
        block_size=TOKENS, num_kv_heads=1, max_tp_shards=1, head_size=576, dtype=dtype,
        cache_dtype_str=cache_dtype, kv_quant_mode=get_kv_quant_mode(cache_dtype),
    )  # fmt: skip


def _row_at(layer: Any, block: int, token: int) -> int:
    """The byte offset in the storage of ``layer``'s row of (block, token), by its axes."""
    at = layer.byte_offset + block * layer.block_stride_bytes
    for axis in layer.axes:
        at += (token if axis.axis == "token" else 0) * axis.stride_bytes
    return int(at)


def _with_parts(manifest: Any, parts: list[dict[str, Any]]) -> Any:
    """``manifest`` with every layer's parts replaced: another reader of the same bytes."""
    from safeview.manifest import Manifest

    layers = {
        name: {**layer.model_dump(exclude={"fingerprint"}), "parts": parts}
        for name, layer in manifest.layers.items()
    }
    return Manifest.model_validate({"topology": manifest.topology.model_dump(), "layers": layers})


@pytest.mark.parametrize(
    ("cache_dtype", "dtype", "element"),
    [
        ("auto", torch.bfloat16, torch.bfloat16),
        ("float16", torch.float16, torch.float16),
        ("fp8", torch.uint8, torch.float8_e4m3fn),
        ("fp8_e4m3", torch.uint8, torch.float8_e4m3fn),
    ],
)
def test_plain_mla_rows_hold_the_latent_then_the_rope_the_model_config_names(
    cache_dtype: str, dtype: torch.dtype, element: torch.dtype, deepseek_v2: Any
) -> None:
    """vLLM's MLA spec carries ``head_size`` 576 only; ``kv_lora_rank`` and
    ``qk_rope_head_dim`` are the model config's (``get_mla_dims``). The oracle: vLLM's own CPU
    MLA writer (``CPUMLAImpl.do_kv_cache_update``, on the cache as ``MLAAttention.forward``
    views it: the platform's fp8 for ``fp8``) writes latents and ropes; each part, read at the
    bytes it names as its element type, holds them."""
    from vllm.platforms import current_platform  # type: ignore[import-not-found,unused-ignore]
    from vllm.v1.attention.backends.mla.cpu_mla import (  # type: ignore[import-not-found,unused-ignore]
        CPUMLAImpl,
    )

    spec = _mla_spec(cache_dtype, dtype)
    caches, config = _caches(dict.fromkeys(MLA_LAYERS, spec))
    manifest = describe_caches(caches, config, Topology(), deepseek_v2).manifest()
    layer = manifest.layers[MLA_LAYERS[0]]
    size, name = element.itemsize, str(element).removeprefix("torch.")
    assert [(p.name, p.role, p.offset_bytes, p.length_bytes, p.dtype) for p in layer.parts] == [
        ("data", "data", 0, 512 * size, name), ("rope", "rope", 512 * size, 64 * size, name),
    ]  # fmt: skip
    assert layer.row_bytes == 576 * size
    cache = caches[MLA_LAYERS[0]]
    fp8 = cache_dtype.startswith("fp8")
    assert not fp8 or current_platform.fp8_dtype() == element
    generator = torch.Generator().manual_seed(37)
    slots = torch.tensor([0, 5, TOKENS + 3, BLOCKS * TOKENS - 1])
    latent = torch.randn(len(slots), 512, generator=generator)
    rope = torch.randn(len(slots), 1, 64, generator=generator)
    CPUMLAImpl.do_kv_cache_update(
        CPUMLAImpl.__new__(CPUMLAImpl), latent, rope,
        cache.view(element) if fp8 else cache, slots, cache_dtype, torch.ones(()),
    )  # fmt: skip
    memory = bytes(cache.untyped_storage())
    for i, slot in enumerate(slots.tolist()):
        at = _row_at(layer, *divmod(slot, TOKENS))
        for part, meant in zip(layer.parts, (latent[i], rope[i, 0]), strict=True):
            raw = bytearray(memory[at + part.offset_bytes : at + part.end_bytes])
            read = torch.frombuffer(raw, dtype=getattr(torch, part.dtype)).float()
            assert torch.equal(read, meant.to(element).float()), (slot, part.name)


def test_mla_rope_read_as_latent_or_as_another_dtype_is_named_at_its_first_byte(
    deepseek_v2: Any,
) -> None:
    """A reader without the split (safeview 0.8.0's reading, or a plugin without the model's
    config) takes the bf16 rope as latent elements 512..575: ``diff`` names byte 1,024. An
    fp8 row's rope read as bf16 (the 656-byte row's rope) is named at byte 512; the 576-byte
    claim ``mla.fp8_576`` is the engine's own reading."""
    from safeview.manifest import assumed

    caches, config = _caches(dict.fromkeys(MLA_LAYERS, _mla_spec("auto", torch.bfloat16)))
    real = describe_caches(caches, config, Topology(), deepseek_v2).manifest()
    unsplit = describe_caches(caches, config, Topology()).manifest()
    assert unsplit.layers[MLA_LAYERS[0]].parts == ()
    findings = [
        f for f in diff(real, unsplit, rule="page_copy").findings if f.receiver_reads is not None
    ]  # fmt: skip
    assert findings[0].byte == 512 * 2
    assert "rope (bfloat16) element 0" in findings[0].message
    assert "element 512" in findings[0].message
    assert diff(real, describe_caches(caches, config, Topology(), deepseek_v2).manifest(),
                rule="page_copy").compatible  # fmt: skip

    caches, config = _caches(dict.fromkeys(MLA_LAYERS, _mla_spec("fp8", torch.uint8)))
    real = describe_caches(caches, config, Topology(), deepseek_v2).manifest()
    e4m3 = "float8_e4m3fn"
    bf16_rope = _with_parts(real, [
        {"name": "data", "offset_bytes": 0, "length_bytes": 512, "dtype": e4m3},
        {"name": "rope", "role": "rope", "offset_bytes": 512, "length_bytes": 64,
         "dtype": "bfloat16"},
    ])  # fmt: skip
    findings = [
        f for f in diff(real, bf16_rope, rule="page_copy").findings
        if f.receiver_reads is not None
    ]  # fmt: skip
    assert findings[0].byte == 512
    assert "rope (bfloat16) element 0" in findings[0].message
    assert f"rope ({e4m3}) element 0" in findings[0].message
    claim = assumed("mla.fp8_576", layers=MLA_LAYERS, num_blocks=BLOCKS, block_tokens=TOKENS,
                    num_heads=1, head_size=576, dtype="uint8")  # fmt: skip
    assert diff(real, claim, rule="in_place").compatible


def test_an_mla_layer_whose_config_names_no_split_stays_one_data_part(deepseek_v2: Any) -> None:
    """The split is the config's, not guessed: rank and rope that do not add up to the spec's
    head size (an indexer, another model) leave the row one ``data`` part."""
    from safeview.vllm._parts import mla_dims_of, parts_of

    assert mla_dims_of(deepseek_v2) == (512, 64)
    assert mla_dims_of(None) is None
    spec = _mla_spec("auto", torch.bfloat16)
    assert parts_of(spec, 576 * 2, (512, 64)) is not None
    assert parts_of(spec, 576 * 2, (448, 64)) is None  # 512 != 448 + 64
    assert parts_of(spec, 576 * 2, None) is None
    assert parts_of(_mla_spec("fp8_e5m2", torch.uint8), 576, (512, 64)) is None


@pytest.mark.slow
def test_through_the_plugin_each_engine_writes_the_mla_split_of_its_model_config() -> None:
    """The plugin's own path: vLLM 0.33's NIXL workers on CPU (DeepSeek-V2 from its
    ``config.json``, a real ``VllmConfig``) register their caches; each rank's manifest holds
    the latent and the rope (float16, the model's dtype), D judges P's (carried in P's
    handshake) compatible, and every byte arrives as P meant it."""
    import shutil

    pytest.importorskip("nixl", reason="the NIXL connector needs nixl")
    import vllm_layout_harness as layouts  # type: ignore[import-not-found,unused-ignore]

    from safeview.manifest import Manifest

    mla = layouts.Engine("LBNHC", model="deepseek_v2", block_size=16)
    run = layouts.run([layouts.Pair("mla_rope", p=mla, d=mla, policy="strict")])
    [result] = run.results
    try:
        assert result["error"] is None, result["error"]
        assert result["handshake_errors"] == []
        [read] = result["reads"]
        assert read["oracle"]["ok"], read["oracle"]
        verdicts = [
            (e["verdict"], e["against"]) for e in result["events"]
            if e["event"] in ("layout_checked", "layout_mismatch") and e["when"] == "handshake"
        ]  # fmt: skip
        assert verdicts == [("compatible", "handshake")]
        assert len(result["manifests"]) == 2  # P's rank and D's
        for written in result["manifests"].values():
            manifest = Manifest.model_validate(written)
            assert len(manifest.layers) == layouts.LAYERS
            for layer in manifest.layers.values():
                assert [(p.name, p.offset_bytes, p.length_bytes, p.dtype) for p in layer.parts] == [
                    ("data", 0, 1024, "float16"), ("rope", 1024, 128, "float16"),
                ]  # fmt: skip
    finally:
        shutil.rmtree(result["manifest_root"], ignore_errors=True)


# -- int4_per_token_head: two 4-bit codes a byte, an fp32 scale holding the zero point ---------

INT4_HEAD_SIZE = 64


def _int4_reference(rotated: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's int4 row from its definition (``_reshape_cache_int4_kernel``): per (token, head),
    scale ``(max - min) / 15``, zero point ``round(-min / scale)`` in [0, 15], codes
    ``round(x / scale + zp)`` in [0, 15], element 2i in the low nibble; the scale's 4 low
    mantissa bits replaced by the zero point. Returns the packed bytes and the scales' bits."""

    def rounded(x: torch.Tensor) -> torch.Tensor:  # the kernel's: half away from zero
        return torch.where(x >= 0, (x + 0.5).trunc(), (x - 0.5).trunc())

    low, high = rotated.amin(-1, keepdim=True), rotated.amax(-1, keepdim=True)
    scale = ((high - low) / 15.0).clamp_min(1e-6)
    zero = rounded(-low / scale).clamp(0, 15)
    codes = rounded(rotated * (1.0 / scale) + zero).clamp(0, 15).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    bits = (scale.view(torch.int32) & -16) | zero.to(torch.int32)
    return packed, bits.squeeze(-1)


def test_int4_rows_hold_packed_codes_then_a_scale_carrying_the_zero_point() -> None:
    """vLLM's Triton backend widens each int4 (token, head) row to ``64 / 2 + 4`` bytes. The
    oracle: K and V rotated by vLLM's own ``single_rht`` (its write path's first step, on
    CPU), quantized and packed by the reference above (vLLM's kernel is Triton only), written
    through vLLM's own views (``_pth_key_value_caches``, ``_ensure_scale_caches``); read back
    through the manifest's parts, unpacked and dequantized, they are the rotated values, and
    the packed bytes are what torch's own ``quint4x2`` holds for the same codes."""
    from vllm.v1.attention.ops.int4_per_token_head import (  # type: ignore[import-not-found,unused-ignore]
        single_rht,
    )

    spec = TritonAttentionBackend.customize_spec(
        FullAttentionSpec(block_size=TOKENS, num_kv_heads=HEADS, head_size=INT4_HEAD_SIZE,
                          dtype=torch.uint8, kv_quant_mode=KVQuantMode.INT4_PER_TOKEN_HEAD)
    )  # fmt: skip
    caches, config = _caches({"model.layers.0.attn": spec, "model.layers.1.attn": spec})
    manifest = describe_caches(caches, config, Topology()).manifest()
    layer = manifest.layers["model.layers.0.attn"]
    data_bytes = INT4_HEAD_SIZE // 2
    assert [(p.name, p.role, p.offset_bytes, p.length_bytes, p.dtype) for p in layer.parts] == [
        ("data", "data", 0, data_bytes, "quint4x2"),
        ("scale_zero_point", "scale", data_bytes, 4, "float32"),
    ]  # fmt: skip
    assert layer.parts[0].elements == INT4_HEAD_SIZE
    assert layer.parts[1].granularity == "token_head"
    cache = caches["model.layers.0.attn"]
    impl = TritonAttentionImpl.__new__(TritonAttentionImpl)
    impl._kv_quant_mode = KVQuantMode.INT4_PER_TOKEN_HEAD
    key_cache, value_cache = impl._pth_key_value_caches(cache)  # [B, N, H, 32 + 4] each
    generator = torch.Generator().manual_seed(4)
    meant = {}
    for kv, (data_view, scale_view) in enumerate(
        ((key_cache, impl._k_scale_cache), (value_cache, impl._v_scale_cache))
    ):
        values = torch.randn(BLOCKS, TOKENS, HEADS, INT4_HEAD_SIZE, generator=generator)
        rotated = single_rht(values)
        packed, bits = _int4_reference(rotated)
        data_view[..., :data_bytes].copy_(packed)
        scale_view.copy_(bits.view(torch.float32))
        meant[kv] = (values, rotated, packed, bits)
    memory = bytes(cache.untyped_storage())
    data, scale = layer.parts
    for block, token, head, kv in ((0, 0, 0, 0), (1, 5, 1, 1), (3, 15, 1, 0), (2, 7, 0, 1)):
        at = layer.byte_offset + block * layer.block_stride_bytes
        for axis in layer.axes:
            at += {"kv": kv, "token": token, "head": head}.get(axis.axis, 0) * axis.stride_bytes
        raw = torch.frombuffer(bytearray(memory[at : at + data.end_bytes]), dtype=torch.uint8)
        codes = torch.stack((raw & 15, raw >> 4), dim=-1).reshape(-1).float()
        [scale_bits] = torch.frombuffer(
            bytearray(memory[at + scale.offset_bytes : at + scale.end_bytes]), dtype=torch.int32
        ).tolist()
        zero = scale_bits & 15
        step = torch.tensor([scale_bits & -16], dtype=torch.int32).view(torch.float32).item()
        decoded = (codes - zero) * step
        values, rotated, packed, bits = meant[kv]
        assert int(bits[block, token, head]) == scale_bits
        assert (decoded - rotated[block, token, head]).abs().max() <= step * 0.51
        # undone by vLLM's inverse rotation (H H = 64 I), the values K and V held
        restored = single_rht(decoded, inverse=True) / INT4_HEAD_SIZE
        assert (restored - values[block, token, head]).abs().max() <= step * 0.51
        # torch's quint4x2 packs the same codes into the same bytes
        with warnings.catch_warnings():  # torch's quantized tensors are deprecated, not gone
            warnings.simplefilter("ignore", UserWarning)
            torch_bytes = torch.quantize_per_tensor(
                (codes - zero) * 0.5, 0.5, zero, torch.quint4x2
            ).int_repr()
        assert torch.equal(torch_bytes, raw), (block, token, head, kv)


def test_int4_read_as_int8_or_its_scale_without_zero_point_is_named() -> None:
    """An int4 row read as int8 codes (``int8_per_token_head``'s reading of the same head
    size) differs at byte 0; the same row with its fp32 scale read as a plain scale (no
    zero point) differs at the first scale byte."""

    def manifest(mode: Any, dtype: torch.dtype) -> Any:
        spec = TritonAttentionBackend.customize_spec(
            FullAttentionSpec(block_size=TOKENS, num_kv_heads=HEADS, head_size=INT4_HEAD_SIZE,
                              dtype=dtype, kv_quant_mode=mode)
        )  # fmt: skip
        caches, config = _caches({"model.layers.0.attn": spec, "model.layers.1.attn": spec})
        return describe_caches(caches, config, Topology()).manifest()

    int4 = manifest(KVQuantMode.INT4_PER_TOKEN_HEAD, torch.uint8)
    int8 = manifest(KVQuantMode.INT8_PER_TOKEN_HEAD, torch.int8)
    findings = [
        f for f in diff(int4, int8, rule="page_copy").findings if f.receiver_reads is not None
    ]  # fmt: skip
    assert findings[0].byte == 0
    assert "data (int8) element 0" in findings[0].message
    assert "data (quint4x2) element 0" in findings[0].message
    data_bytes = INT4_HEAD_SIZE // 2
    plain_scale = _with_parts(int4, [
        {"name": "data", "offset_bytes": 0, "length_bytes": data_bytes, "dtype": "quint4x2"},
        {"name": "scale", "role": "scale", "offset_bytes": data_bytes, "length_bytes": 4,
         "dtype": "float32", "granularity": "token_head"},
    ])  # fmt: skip
    findings = [
        f for f in diff(int4, plain_scale, rule="page_copy").findings
        if f.receiver_reads is not None
    ]  # fmt: skip
    assert findings[0].byte == data_bytes
    assert "scale_zero_point (float32)" in findings[0].message
    assert diff(int4, manifest(KVQuantMode.INT4_PER_TOKEN_HEAD, torch.uint8),
                rule="page_copy").compatible  # fmt: skip


def test_the_plugin_reads_nvfp4_v_scales_in_the_order_of_the_writer_vllm_picks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On this machine vLLM picks SM100's trtllm-gen writer (no SM80/90/120 here): the plugin's
    manifest is the ``vllm.nvfp4.sm100`` claim's reading. On SM120 vLLM picks FlashInfer's fa2
    writer (linear V scales): the device capability is the one thing this machine lacks, so
    vLLM's platform answers as an SM120's would, and vLLM's own ``_nvfp4_kv_on_fa2`` decides.
    SM100's pages read by SM120 (vllm#50084): ``diff`` names the first V scale byte whose
    (token, group) differs."""
    from vllm.platforms import current_platform  # type: ignore[import-not-found,unused-ignore]
    from vllm.platforms.interface import (  # type: ignore[import-not-found,unused-ignore]
        DeviceCapability,
    )

    from safeview.manifest import assumed

    layers = ["model.layers.0.attn", "model.layers.1.attn"]
    caches, config = _caches(dict.fromkeys(layers, _nvfp4_spec()))
    claims = {
        name: assumed(name, layers=layers, num_blocks=BLOCKS, block_tokens=16, num_heads=HEADS,
                      head_size=64, dtype="uint8")
        for name in ("vllm.nvfp4.sm100", "vllm.nvfp4.sm120")
    }  # fmt: skip
    here = describe_caches(caches, config, Topology()).manifest()
    assert diff(here, claims["vllm.nvfp4.sm100"], rule="in_place").compatible
    assert not diff(here, claims["vllm.nvfp4.sm120"], rule="in_place").compatible
    monkeypatch.setattr(
        type(current_platform), "get_device_capability",
        classmethod(lambda cls, device_id=0: DeviceCapability(12, 0)),
    )  # fmt: skip
    on_sm120 = describe_caches(caches, config, Topology()).manifest()
    assert diff(on_sm120, claims["vllm.nvfp4.sm120"], rule="in_place").compatible
    findings = [
        f for f in diff(here, on_sm120, rule="page_copy").findings if f.receiver_reads is not None
    ]  # fmt: skip
    side = HEADS * 16 * (32 + 4)  # a side: every (head, token)'s 32 bytes of e2m1, 4 scales
    v_scales = side + HEADS * 16 * 32
    # V scale (token 0, group 0) is at its first byte either way; the next differs
    assert findings[0].byte == v_scales + 1
    assert "V token 0 head 0 v_scale (float8_e4m3fn) group 1" in findings[0].message
    assert "V token 1 head 0 v_scale (float8_e4m3fn) group 0" in findings[0].message
