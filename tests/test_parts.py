"""Parts of a page (issue 37): rows and pages that hold data, scales, rope and state segments.

Each field case at byte level: values are written through the sender's format by a reference
written here from that format's definition (a scale really computed from its data), the bytes
are read through the receiver's, and what the receiver decodes is compared with what was meant.
``diff`` must name the first receiver byte where the two formats disagree, which the test finds
on its own by decoding every byte both ways; the valid reading of each format must pass.
"""

from __future__ import annotations

import importlib
import json
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from safeview.errors import ManifestError
from safeview.findings import Finding
from safeview.manifest import Layer, Manifest, Part, Topology, describe, layer_from_geometry
from safeview.manifest.diff import DiffReport, diff
from safeview.manifest.wire import from_wire, to_wire

VLLM_AXES = ("block", "head", "token", "kv|element")


def _hnd(
    name: str, blocks: int, heads: int, tokens: int, row: int, dtype: str, parts: Any = None
) -> Layer:
    """A vLLM-style ``[B, H, N, 2 * row]`` cache, heads outside tokens (HND), dense."""
    return layer_from_geometry(
        name,
        axes=VLLM_AXES,
        shape=(blocks, heads, tokens, 2 * row),
        strides_elements=(heads * tokens * 2 * row, tokens * 2 * row, 2 * row, 1),
        byte_offset=0,
        dtype=dtype,
        parts=parts,
    )


def _one(layer: Layer, **topology: Any) -> Manifest:
    return Manifest(layers={"layers.0": layer}, topology=topology)


def _byte_finding(report: DiffReport) -> Finding:
    found = [f for f in report.findings if f.kind == "byte" and f.receiver_reads is not None]
    assert found, [f.message for f in report.findings]
    return found[0]


# -- the model: old manifests stay as they were ----------------------------------------------


def test_a_manifest_without_parts_keeps_the_fingerprint_of_0_7_0() -> None:
    # computed with safeview 0.7.0 (git archive of the 0.7.0 commit) for this very layer
    layer = layer_from_geometry(
        "l", axes=VLLM_AXES, shape=(4, 2, 16, 16), strides_elements=(512, 256, 16, 1),
        byte_offset=0, dtype="float16",
    )  # fmt: skip
    manifest = Manifest(layers={"l": layer})
    assert manifest.fingerprint == (
        "eb05b50a482957b13a70544aff848ffb9ba264f0493bef8a4d536147b9cc105e"
    )
    assert "parts" not in manifest.to_json()
    assert layer.parts_or_data() == (
        Part(name="data", offset_bytes=0, length_bytes=16, dtype="float16"),
    )


def test_a_100_layer_manifest_without_parts_stays_under_4_kb_on_the_wire() -> None:
    from safeview.manifest import assumed

    manifest = assumed(
        "NL_X_TWO_NB_BS_NH_HS", layers=[f"model.layers.{i}.self_attn.attn" for i in range(100)],
        num_blocks=1000, block_tokens=16, num_heads=8, head_size=128, dtype="bfloat16",
        topology={"total_kv_heads": 8},
    )  # fmt: skip
    wire = to_wire(manifest)
    assert len(wire) < 4096
    assert b"parts" not in wire
    # the same bytes as 0.7.0 wrote: its fingerprint, computed there
    assert manifest.fingerprint == (
        "b0d6e1092ecd02d6f189666a52a914dc3e3a6aecf068d398326ade6c96459ad6"
    )


PER_TOKEN_HEAD = [
    {"name": "data", "offset_bytes": 0, "length_bytes": 8, "dtype": "int8"},
    {"name": "scale", "role": "scale", "offset_bytes": 8, "length_bytes": 4, "dtype": "float32",
     "granularity": "token_head"},
]  # fmt: skip


def test_parts_change_the_fingerprint_and_travel_on_the_wire_and_in_json() -> None:
    with_parts = _one(_hnd("l", 2, 2, 4, 12, "int8", PER_TOKEN_HEAD))
    without = _one(_hnd("l", 2, 2, 4, 12, "int8"))
    assert with_parts.fingerprint != without.fingerprint
    again = from_wire(to_wire(with_parts), peer="p")
    assert again.fingerprint == with_parts.fingerprint
    assert again.layers["layers.0"].parts == with_parts.layers["layers.0"].parts
    assert Manifest.from_json(with_parts.to_json()).fingerprint == with_parts.fingerprint


def test_a_part_dtype_is_in_the_fingerprint() -> None:
    e4m3 = [dict(PER_TOKEN_HEAD[0], dtype="float8_e4m3fn"), PER_TOKEN_HEAD[1]]
    e5m2 = [dict(PER_TOKEN_HEAD[0], dtype="float8_e5m2"), PER_TOKEN_HEAD[1]]
    a = _one(_hnd("l", 2, 2, 4, 12, "uint8", e4m3))
    b = _one(_hnd("l", 2, 2, 4, 12, "uint8", e5m2))
    assert a.fingerprint != b.fingerprint
    finding = _byte_finding(diff(a, b, rule="page_copy"))
    assert finding.byte == 0
    assert "float8_e4m3fn" in finding.message
    assert "float8_e5m2" in finding.message


# -- bad input: ManifestError naming the layer and the part ----------------------------------


@pytest.mark.parametrize(
    ("parts", "companions", "said"),
    [
        (
            [PER_TOKEN_HEAD[0], dict(PER_TOKEN_HEAD[1], offset_bytes=6)],
            (),
            "layers['l'].parts['scale']: overlaps parts['data']: byte 6 is in both",
        ),
        (
            [PER_TOKEN_HEAD[0],
             {"name": "scale", "role": "scale", "offset_bytes": 8, "length_bytes": 4,
              "dtype": "uint8", "granularity": "block", "group_elements": 3}],
            (),
            "layers['l'].parts['scale']: group_elements 3 does not divide the 8 elements",
        ),
        (
            [PER_TOKEN_HEAD[0],
             {"name": "scale", "role": "scale", "offset_bytes": 8, "length_bytes": 4,
              "dtype": "uint8", "granularity": "block", "group_elements": 4}],
            (),
            "layers['l'].parts['scale']: holds 4 scales; parts['data'] has 8 elements, 2 groups",
        ),
        (
            PER_TOKEN_HEAD,
            [{"name": "k_scale_pool", "dtype": "float32", "num_blocks": 3, "bytes_per_block": 64}],
            "layers['l'].companions['k_scale_pool']: holds 3 blocks; the layer holds 2",
        ),
        (
            [dict(PER_TOKEN_HEAD[0], dtype="float16", length_bytes=7), PER_TOKEN_HEAD[1]],
            (),
            "layers['l'].parts['data']: length_bytes 7 is not a whole number of float16",
        ),
    ],
)  # fmt: skip
def test_bad_parts_are_a_manifest_error_naming_the_layer_and_the_part(
    parts: list[Any], companions: list[Any], said: str
) -> None:
    with pytest.raises(ManifestError) as raised:
        layer_from_geometry(
            "l", axes=VLLM_AXES, shape=(2, 2, 4, 24), strides_elements=(192, 96, 24, 1),
            byte_offset=0, dtype="int8", parts=parts, companions=companions,
        )  # fmt: skip
    assert said in str(raised.value), str(raised.value)


def test_segments_that_do_not_cover_the_state_are_refused_naming_the_first_byte_left_out() -> None:
    segments = [
        {"name": "x", "role": "segment", "offset_bytes": 0, "length_bytes": 48,
         "dtype": "float16", "tp": "segment"},
        {"name": "B", "role": "segment", "offset_bytes": 48, "length_bytes": 12,
         "dtype": "float16", "tp": "segment"},
    ]  # fmt: skip
    with pytest.raises(ManifestError) as raised:
        _state("mamba", 64, segments)
    message = str(raised.value)
    assert "layers['mamba']" in message
    assert "cover 60 of the 64 bytes of the state: byte 60 is in no part" in message


def test_a_manifest_file_with_overlapping_parts_is_refused_naming_the_part() -> None:
    data = json.loads(_one(_hnd("l", 2, 2, 4, 12, "int8", PER_TOKEN_HEAD)).to_json())
    del data["fingerprint"], data["layers"]["layers.0"]["fingerprint"]
    data["layers"]["layers.0"]["parts"][1]["offset_bytes"] = 7
    with pytest.raises(ManifestError) as raised:
        Manifest.from_json(json.dumps(data))
    assert "layers['layers.0'].parts['scale']: overlaps parts['data']" in str(raised.value)


# -- vLLM's per-token-head rows: 132 bytes read as 128 (kvcached#433) ------------------------

HS, HEADS, TOKENS, BLOCKS = 8, 2, 4, 2


def _quantize_rows(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int8 per (token, head) row: scale = max |x| / 127, q = round(x / scale)."""
    scale = np.abs(values).max(axis=-1, keepdims=True) / 127.0
    scale = np.where(scale == 0, 1.0, scale).astype(np.float32)
    return np.clip(np.round(values / scale), -127, 127).astype(np.int8), scale[..., 0]


def _write_per_token_head(values: np.ndarray) -> np.ndarray:
    """vLLM's int8_per_token_head page (``TritonAttentionBackend.customize_spec``,
    ``_ensure_scale_caches``): per (head, token), ``[K(hs) | K scale f32 | V(hs) | V scale]``."""
    q, scale = _quantize_rows(values)  # values: [B, H, N, 2, HS]
    row = HS + 4
    page = np.zeros((BLOCKS, HEADS, TOKENS, 2 * row), np.uint8)
    for kv in (0, 1):
        page[..., kv * row : kv * row + HS] = q[..., kv, :].view(np.uint8)
        page[..., kv * row + HS : (kv + 1) * row] = (
            scale[..., kv].astype("<f4").view(np.uint8).reshape(BLOCKS, HEADS, TOKENS, 4)
        )
    return page.reshape(BLOCKS, -1)


def _meaning_per_token_head(k: int) -> tuple[object, ...]:
    """What byte ``k`` of a per-token-head page means (vLLM's definition)."""
    row = HS + 4
    head, rest = divmod(k, TOKENS * 2 * row)
    token, rest = divmod(rest, 2 * row)
    kv, at = divmod(rest, row)
    return ("data", kv, token, head, at) if at < HS else ("scale", kv, token, head, 0)


def _meaning_unwidened(k: int) -> tuple[object, ...]:
    """What byte ``k`` means to a reader that computed the unwidened 128-byte row."""
    head, rest = divmod(k, TOKENS * 2 * HS)
    token, rest = divmod(rest, 2 * HS)
    kv, at = divmod(rest, HS)
    return ("data", kv, token, head, at)


def test_a_132_byte_row_read_as_128_is_named_at_its_first_scale_byte() -> None:
    rng = np.random.default_rng(37)
    values = rng.normal(size=(BLOCKS, HEADS, TOKENS, 2, HS)).astype(np.float32)
    pages = _write_per_token_head(values)
    sender = _one(_hnd("l", BLOCKS, HEADS, TOKENS, HS + 4, "int8", PER_TOKEN_HEAD))
    receiver = _one(_hnd("l", BLOCKS, HEADS, TOKENS, HS, "int8"))
    # the receiver reads its own 128-byte-style rows over the bytes a page copy gives it
    received = pages[:, : receiver.layers["layers.0"].page_bytes]
    q = received.reshape(BLOCKS, HEADS, TOKENS, 2, HS).view(np.int8)
    _, true_scale = _quantize_rows(values)
    decoded = q.astype(np.float32) * true_scale[..., None]  # even with the right scales
    wrong = np.argwhere(~np.isclose(decoded, values, atol=0.02))
    assert len(wrong), "the unwidened reading must go wrong"
    first = next(
        k for k in range(received.shape[1])
        if _meaning_per_token_head(k) != _meaning_unwidened(k)
    )  # fmt: skip
    finding = _byte_finding(diff(sender, receiver, rule="page_copy"))
    assert finding.byte == first == HS
    assert "V token 0 head 0" in finding.message
    assert "scale (float32)" in finding.message


def test_the_132_byte_row_read_as_vllm_defines_it_passes_and_every_value_comes_back() -> None:
    rng = np.random.default_rng(38)
    values = rng.normal(size=(BLOCKS, HEADS, TOKENS, 2, HS)).astype(np.float32)
    pages = _write_per_token_head(values).reshape(BLOCKS, HEADS, TOKENS, 2, HS + 4)
    q = pages[..., :HS].copy().view(np.int8).astype(np.float32)
    scale = pages[..., HS:].copy().view("<f4")[..., 0]
    assert np.allclose(q * scale[..., None], values, atol=np.abs(values).max() / 127)
    sender = _one(_hnd("l", BLOCKS, HEADS, TOKENS, HS + 4, "int8", PER_TOKEN_HEAD))
    receiver = _one(_hnd("l", BLOCKS, HEADS, TOKENS, HS + 4, "int8", PER_TOKEN_HEAD))
    assert diff(sender, receiver, rule="page_copy").compatible


# -- NVFP4: V scales in the SM100 swizzle read linearly (vllm#50084) --------------------------

NV_HS, NV_TOKENS, NV_HEADS = 64, 4, 1
NV_S = NV_HS // 16  # fp8 scales per (head, token)
NV_DATA = NV_HEADS * NV_TOKENS * NV_HS // 2
NV_SIDE = NV_DATA + NV_HEADS * NV_TOKENS * NV_S
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)


def _nvfp4_parts(v_order: str) -> list[dict[str, Any]]:
    index_data = [["head", NV_HEADS], ["token", NV_TOKENS], ["element", NV_HS // 2]]
    index_scale = [["head", NV_HEADS], ["token", NV_TOKENS], ["element", NV_S]]
    scale = {"role": "scale", "offset_bytes": NV_DATA, "length_bytes": NV_SIDE - NV_DATA,
             "dtype": "float8_e4m3fn", "granularity": "block", "group_elements": 16,
             "index": index_scale}  # fmt: skip
    return [
        {"name": "data", "offset_bytes": 0, "length_bytes": NV_DATA,
         "dtype": "float4_e2m1fn_x2", "index": index_data},
        {**scale, "name": "k_scale", "kv": 0},
        {**scale, "name": "v_scale", "kv": 1, "order": v_order},
    ]  # fmt: skip


def _nvfp4_layer(v_order: str) -> Layer:
    """vLLM 0.33's NVFP4 page, one K/V side after the other: ``[data | scales]`` each."""
    return layer_from_geometry(
        "l", axes=("block", "kv", "element"), shape=(2, 2, NV_SIDE),
        strides_elements=(2 * NV_SIDE, NV_SIDE, 1), byte_offset=0, dtype="uint8",
        parts=_nvfp4_parts(v_order), kind="attention",
    )  # fmt: skip


def _swizzle_at(t: int, s: int) -> int:
    """Where vLLM's SM100 writer puts scale (token t, block s) of a [T, S] grid
    (``swizzle_scale_offset`` in csrc nvfp4_kv_cache_kernels.cu)."""
    group = NV_S // 4
    return ((t // 4) * 4 + s // group) * NV_S + (s % group) * 4 + t % 4


def _nvfp4_encode(values: np.ndarray, swizzle: bool) -> tuple[np.ndarray, np.ndarray]:
    """One side's bytes: e2m1 codes packed two a byte (low nibble first) and e4m3 block
    scales, block scale = max |x| / 6 over 16 elements; ``swizzle`` stores them as SM100."""
    blocks = values.reshape(NV_TOKENS, NV_S, 16)
    scale = torch.tensor(np.abs(blocks).max(axis=-1) / 6.0).to(torch.float8_e4m3fn)
    real = scale.to(torch.float32).numpy()
    scaled = blocks / np.where(real == 0, 1, real)[..., None]
    code = np.abs(scaled[..., None] - E2M1).argmin(axis=-1) | (np.signbit(scaled) << 3)
    code = code.reshape(NV_TOKENS, NV_HS).astype(np.uint8)
    data = (code[:, 0::2] | (code[:, 1::2] << 4)).reshape(-1)
    raw = scale.view(torch.uint8).numpy()
    stored = np.zeros(NV_TOKENS * NV_S, np.uint8)
    for t in range(NV_TOKENS):
        for s in range(NV_S):
            stored[_swizzle_at(t, s) if swizzle else t * NV_S + s] = raw[t, s]
    return data, stored


def _nvfp4_decode(data: np.ndarray, scales: np.ndarray) -> Any:
    """A linear reader (SM120's FlashInfer XQA): scale (t, s) at t * S + s."""
    codes = np.stack([data & 15, data >> 4], axis=-1).reshape(NV_TOKENS, NV_HS)
    value = E2M1[codes & 7] * np.where(codes & 8, -1.0, 1.0)
    real = torch.from_numpy(scales.copy()).view(torch.float8_e4m3fn).to(torch.float32).numpy()
    return (value.reshape(NV_TOKENS, NV_S, 16) * real.reshape(NV_TOKENS, NV_S, 1)).reshape(
        NV_TOKENS, NV_HS
    )


def test_v_scales_written_swizzled_and_read_linearly_are_named_at_the_first_scale_they_swap() -> (
    None
):
    rng = np.random.default_rng(50084)
    # each 16-element block has its own magnitude (as vllm#49011's probe): a swap shows
    values = rng.uniform(0.5, 1, (NV_TOKENS, NV_HS)) * np.repeat(
        np.arange(1, NV_TOKENS * NV_S + 1).reshape(NV_TOKENS, NV_S), 16, axis=1
    )
    k_data, k_scales = _nvfp4_encode(values, swizzle=False)
    v_data, v_scales = _nvfp4_encode(values, swizzle=True)  # SM100's writer
    k_back = _nvfp4_decode(k_data, k_scales)
    v_back = _nvfp4_decode(v_data, v_scales)  # SM120's reader
    assert np.allclose(k_back, values, rtol=0.35), "K round-trips"
    assert not np.allclose(v_back, values, rtol=0.35), "V comes back wrong"
    # the first page byte whose scale is another (token, block) than the linear reader's
    swapped = [
        (t, s) for t in range(NV_TOKENS) for s in range(NV_S) if _swizzle_at(t, s) != t * NV_S + s
    ]
    first = NV_SIDE + NV_DATA + min(_swizzle_at(t, s) for t, s in swapped)
    sm100, sm120 = _one(_nvfp4_layer("trtllm_4x4")), _one(_nvfp4_layer("linear"))
    finding = _byte_finding(diff(sm100, sm120, rule="page_copy"))
    assert finding.byte == first
    assert "V token 0" in finding.message
    assert "v_scale (float8_e4m3fn) group" in finding.message
    assert diff(sm100, _one(_nvfp4_layer("trtllm_4x4")), rule="page_copy").compatible


# -- the two FP8 MLA rows: 656 bytes read as 576 (pegainfer#756) ------------------------------

MLA_656 = [
    {"name": "data", "offset_bytes": 0, "length_bytes": 512, "dtype": "float8_e4m3fn"},
    {"name": "scale", "role": "scale", "offset_bytes": 512, "length_bytes": 16,
     "dtype": "float32", "granularity": "tile", "group_elements": 128, "group_tokens": 1},
    {"name": "rope", "role": "rope", "offset_bytes": 528, "length_bytes": 128,
     "dtype": "bfloat16"},
]  # fmt: skip
MLA_576 = [
    {"name": "data", "offset_bytes": 0, "length_bytes": 512, "dtype": "float8_e4m3fn"},
    {"name": "rope", "role": "rope", "offset_bytes": 512, "length_bytes": 64,
     "dtype": "float8_e4m3fn"},
]  # fmt: skip


def _mla(row: int, parts: list[dict[str, Any]], tokens: int = 2) -> Layer:
    return layer_from_geometry(
        "l", axes=("block", "unit", "token", "element"), shape=(2, 1, tokens, row),
        strides_elements=(tokens * row, tokens * row, row, 1), byte_offset=0, dtype="uint8",
        parts=parts,
    )  # fmt: skip


def _write_656(latent: np.ndarray, rope: np.ndarray) -> np.ndarray:
    """FlashMLA's fp8_ds_mla token (vLLM flashmla_sparse.py): 512 e4m3, 4 fp32 scales (one
    per 128 values, max |x| / 448), 64 bf16 rope."""
    row = np.zeros(656, np.uint8)
    scales = np.abs(latent.reshape(4, 128)).max(axis=1) / 448.0
    quantized = torch.tensor(latent.reshape(4, 128) / scales[:, None]).to(torch.float8_e4m3fn)
    row[:512] = quantized.view(torch.uint8).numpy().reshape(-1)
    row[512:528] = scales.astype("<f4").view(np.uint8)
    row[528:] = torch.tensor(rope).to(torch.bfloat16).view(torch.uint8).numpy()
    return row


def test_a_656_byte_fp8_mla_row_read_as_the_576_byte_row_is_named_at_byte_512() -> None:
    rng = np.random.default_rng(756)
    latent, rope = rng.normal(size=512), rng.normal(size=64)
    row = _write_656(latent, rope)
    # the 576-byte reader: rope as 64 e4m3 right after the latent
    read_rope = torch.from_numpy(row[512:576].copy()).view(torch.float8_e4m3fn).float().numpy()
    assert not np.allclose(read_rope, rope, atol=0.1)
    # the 656-byte reader gets every value back
    scales = row[512:528].copy().view("<f4")
    data = torch.from_numpy(row[:512].copy()).view(torch.float8_e4m3fn).float().numpy()
    assert np.allclose((data.reshape(4, 128) * scales[:, None]).reshape(-1), latent, atol=0.15)
    back = torch.from_numpy(row[528:].copy()).view(torch.bfloat16).float().numpy()
    assert np.allclose(back, rope, atol=0.02)
    finding = _byte_finding(diff(_one(_mla(656, MLA_656)), _one(_mla(576, MLA_576)), "page_copy"))
    assert finding.byte == 512
    assert "rope (float8_e4m3fn) element 0" in finding.message
    assert "scale (float32) group 0" in finding.message
    assert diff(_one(_mla(656, MLA_656)), _one(_mla(656, MLA_656)), "page_copy").compatible


def test_a_rope_part_in_another_dtype_is_named_at_the_first_rope_byte() -> None:
    fp16 = [*MLA_656[:2], dict(MLA_656[2], dtype="float16")]
    finding = _byte_finding(diff(_one(_mla(656, MLA_656)), _one(_mla(656, fp16)), "page_copy"))
    assert finding.byte == 528
    assert "rope (float16)" in finding.message
    assert "rope (bfloat16)" in finding.message


# -- a Mamba conv state's segments under another TP split (sglang#22060) ----------------------

X, GROUPS, ROWS, SSM = 8, 2, 3, 16  # global x width, B (= C) width, conv rows, ssm elements


def _mamba2_parts(tp: int, layout: str) -> list[dict[str, Any]]:
    """Mamba2's conv state ``[x | B | C]`` (conv dim split by TP segment by segment) then its
    ssm state, float16; ``DS`` holds each segment contiguously, ``SD`` row by row."""
    widths = [("x", X // tp), ("B", GROUPS // tp), ("C", GROUPS // tp)]
    conv = sum(w for _, w in widths)
    parts, at = [], 0
    for name, width in widths:
        # each element's meaning: its conv row (a token of the window) and its column
        if layout == "DS":
            part = {"offset_bytes": at * ROWS * 2, "length_bytes": width * ROWS * 2,
                    "index": [["element", width], ["token", ROWS]]}  # fmt: skip
        else:
            part = {"offset_bytes": at * 2, "length_bytes": width * 2, "count": ROWS,
                    "stride_bytes": conv * 2,
                    "index": [["token", ROWS], ["element", width]]}  # fmt: skip
        parts.append({"name": name, "role": "segment", "dtype": "float16", "tp": "segment",
                      **part})  # fmt: skip
        at += width
    parts.append({"name": "ssm", "role": "segment", "dtype": "float16", "tp": "heads",
                  "offset_bytes": conv * ROWS * 2, "length_bytes": SSM // tp * 2})  # fmt: skip
    return parts


def _state(
    name: str, state_bytes: int, parts: list[dict[str, Any]], padded: int | None = None
) -> Layer:
    return layer_from_geometry(
        name, axes=("block", "unit", "unit", "state"), shape=(3, 1, 1, state_bytes),
        strides_elements=(padded or state_bytes, state_bytes, state_bytes, 1), byte_offset=0,
        dtype="int8", parts=parts,
    )  # fmt: skip


def _state_bytes(tp: int) -> int:
    return ((X + 2 * GROUPS) // tp * ROWS + SSM // tp) * 2


def _global_ds(tp: int, rank: int, k: int) -> tuple[str, int]:
    """What byte ``k`` of rank ``rank``'s DS state means: (segment, global element)."""
    element = k // 2
    at = 0
    for name, width in (("x", X), ("B", GROUPS), ("C", GROUPS)):
        local = width // tp
        if element < at + local * ROWS:
            column, row = divmod(element - at, ROWS)
            return name, (rank * local + column) * ROWS + row
        at += local * ROWS
    return "ssm", rank * (SSM // tp) + element - at


def test_segments_merged_under_another_tp_split_are_named_at_the_first_segment_that_moves() -> None:
    p_rank0 = _one(_state("mamba", _state_bytes(2), _mamba2_parts(2, "DS")), tp_size=2)
    d = _one(_state("mamba", _state_bytes(1), _mamba2_parts(1, "DS")), tp_size=1)
    # merged as one block: D's page is P rank 0's page then P rank 1's
    merged = [(0, k) for k in range(_state_bytes(2))] + [(1, k) for k in range(_state_bytes(2))]
    first = next(
        at for at, (rank, k) in enumerate(merged)
        if _global_ds(2, rank, k) != _global_ds(1, 0, at)
    )  # fmt: skip
    finding = _byte_finding(diff(p_rank0, d, rule="page_copy"))
    assert finding.byte == first == (X // 2) * ROWS * 2  # where P's B begins
    assert "x (float16) element 4" in finding.message
    assert "B (float16) element 0" in finding.message
    # the same split on both sides reads every byte as written
    assert diff(p_rank0, _one(_state("mamba", _state_bytes(2), _mamba2_parts(2, "DS")),
                              tp_size=2), rule="page_copy").compatible  # fmt: skip


def test_rank_1_of_a_split_state_is_not_rank_0_and_sd_is_not_ds() -> None:
    layer = _state("mamba", _state_bytes(2), _mamba2_parts(2, "DS"))
    rank0 = Manifest(layers={"m": layer}, topology={"tp_size": 2, "tp_rank": 0})
    rank1 = Manifest(layers={"m": layer}, topology={"tp_size": 2, "tp_rank": 1})
    finding = _byte_finding(diff(rank1, rank0, rule="page_copy"))
    assert finding.byte == 0
    assert "x (float16) element 4" in finding.message  # rank 1's first x column is global 4
    sd = _one(_state("mamba", _state_bytes(2), _mamba2_parts(2, "SD")))
    ds = _one(_state("mamba", _state_bytes(2), _mamba2_parts(2, "DS")))
    assert _byte_finding(diff(sd, ds, rule="page_copy")).byte == 2  # SD's x[0, 1], DS's x[1, 0]


# -- scalars and companions ------------------------------------------------------------------


def test_k_scale_carried_by_value_must_agree() -> None:
    def layer(k_scale: float) -> Layer:
        return layer_from_geometry(
            "l", axes=VLLM_AXES, shape=(2, 2, 4, 16), strides_elements=(128, 64, 16, 1),
            byte_offset=0, dtype="float8_e4m3fn", scalars={"k_scale": k_scale, "v_scale": 1.0},
        )  # fmt: skip

    report = diff(_one(layer(0.5)), _one(layer(0.25)), rule="page_copy")
    assert [f.kind for f in report.findings] == ["dtype"]
    assert "k_scale is 0.25, the sender's 0.5" in report.findings[0].message
    assert diff(_one(layer(0.5)), _one(layer(0.5)), rule="page_copy").compatible


def test_a_companion_scale_pool_of_another_dtype_is_named() -> None:
    pool = {"name": "k_scale_pool", "dtype": "float32", "num_blocks": 2, "bytes_per_block": 32,
            "granularity": "token_head"}  # fmt: skip

    def layer(dtype: str) -> Layer:
        return layer_from_geometry(
            "l", axes=VLLM_AXES, shape=(2, 2, 4, 16), strides_elements=(128, 64, 16, 1),
            byte_offset=0, dtype="float8_e4m3fn", companions=[dict(pool, dtype=dtype)],
        )  # fmt: skip

    report = diff(_one(layer("float32")), _one(layer("bfloat16")), rule="page_copy")
    assert "companion 'k_scale_pool'" in report.findings[0].message
    assert "bfloat16" in report.findings[0].message


# -- describe takes parts by hand; costs -----------------------------------------------------


def test_describe_takes_parts_by_hand_one_list_for_every_layer_or_by_layer() -> None:
    caches = {f"l{i}": torch.empty(4, 2, 16, 24, dtype=torch.int8, device="meta") for i in range(3)}
    manifest = describe(caches, axes=VLLM_AXES, parts=PER_TOKEN_HEAD)
    assert all(layer.parts[1].name == "scale" for layer in manifest.layers.values())
    by_layer = describe(caches, axes=VLLM_AXES, parts={"l0": PER_TOKEN_HEAD})
    assert by_layer.layers["l0"].parts
    assert not by_layer.layers["l1"].parts
    with pytest.raises(ManifestError) as raised:
        describe(caches, axes=VLLM_AXES, parts=[dict(PER_TOKEN_HEAD[0], length_bytes=13)])
    assert "layers['l0'].parts" in str(raised.value)


def test_diff_of_two_1000_layer_manifests_with_parts_takes_under_a_second() -> None:
    caches = {
        f"model.layers.{i}.attn": torch.empty(64, 8, 16, 24, dtype=torch.int8, device="meta")
        for i in range(1000)
    }
    sender = describe(caches, axes=VLLM_AXES, parts=PER_TOKEN_HEAD)
    other = [PER_TOKEN_HEAD[0], dict(PER_TOKEN_HEAD[1], dtype="int32")]
    receiver = describe(caches, axes=VLLM_AXES, parts=other)
    importlib.import_module("safeview.manifest.diff")._CACHE.clear()
    started = time.perf_counter()
    report = diff(sender, receiver, rule="page_copy")
    elapsed = time.perf_counter() - started
    assert len(report.findings) == 1000
    assert report.findings[0].byte == 8
    assert elapsed < 1.0, f"{elapsed:.2f} s"


# -- coverage names the part a transfer's descriptors leave out --------------------------------


def test_coverage_names_the_scale_part_a_transfer_left_out() -> None:
    from safeview.transfer import MemoryMap
    from safeview.transfer.coverage import check_coverage

    layer = _hnd("layers.0", BLOCKS, HEADS, TOKENS, HS + 4, "int8", PER_TOKEN_HEAD)
    manifest = _one(layer)
    base = 1 << 20
    memory = MemoryMap.from_manifest(manifest, addresses={"storage0": base})
    # a connector that moves each row's values and not its scale (sglang#35718's kind)
    rows = [
        (base + block * layer.block_stride_bytes + row * (HS + 4), HS)
        for block in range(BLOCKS)
        for row in range(HEADS * TOKENS * 2)
    ]
    found = check_coverage([rows], memory, policy="warn", manifest=manifest)
    assert [f.layer for f in found] == ["layers.0"]
    assert "part 'scale' (scale, float32), byte 8 of its 12-byte row" in found[0].message
    # without the manifest, the finding is the one of before
    plain = check_coverage([rows], memory, policy="warn")
    assert "part" not in plain[0].message
    # every byte moved: nothing to say
    whole = [(base + b * layer.block_stride_bytes, layer.page_bytes) for b in range(BLOCKS)]
    assert check_coverage([whole], memory, policy="warn", manifest=manifest) == []


def test_part_at_reads_the_part_of_any_page_byte() -> None:
    layer = _hnd("l", BLOCKS, HEADS, TOKENS, HS + 4, "int8", PER_TOKEN_HEAD)
    for page_byte in range(layer.page_bytes):
        found = layer.part_at(page_byte)
        assert found is not None
        part, row = found
        assert row == page_byte % (HS + 4)  # HND rows of 12 bytes, K then V
        assert part.name == ("data" if row < HS else "scale")
    assert layer.part_at(layer.page_bytes) is None


def test_p_rebuilt_from_nixl_metadata_has_ds_rows_so_a_valid_pair_passes() -> None:
    """The plugin rebuilds P's manifest from its NIXL metadata with D's dtype and head size;
    with D's row parts too, or a per-token-head pair would be refused at its first scale."""
    from safeview.vllm import _layout as layout

    caches = {
        f"model.layers.{i}.attn": torch.empty(4, 2, 16, 2 * (HS + 4), dtype=torch.int8)
        for i in range(2)
    }
    topology = Topology(total_kv_heads=2, kernel_block_tokens=16, engine="D", layout="LBHNC")
    mine = describe(caches, axes=VLLM_AXES, topology=topology, parts=PER_TOKEN_HEAD)
    first = next(iter(caches.values()))
    metadata = SimpleNamespace(
        engine_id="P", block_lens=[first[0].nelement()] * 2,
        block_strides=[first.stride(0)] * 2, region_names=list(caches), region_num_blocks=None,
        num_blocks=4, block_size=16, kv_cache_layout="LBHNC", packed_member_layouts={},
    )  # fmt: skip
    rebuilt = layout.rebuild(metadata, 1, mine)
    assert (
        rebuilt[0].layers["model.layers.0.attn"].parts == mine.layers["model.layers.0.attn"].parts
    )
    assert diff(rebuilt, mine, rule="vllm_nixl").compatible


def test_vllm_nixl_names_a_k_scale_p_and_d_disagree_on() -> None:
    def side(k_scale: float) -> Manifest:
        layer = layer_from_geometry(
            "l", axes=VLLM_AXES, shape=(2, 2, 16, 16), strides_elements=(512, 256, 16, 1),
            byte_offset=0, dtype="float8_e4m3fn", scalars={"k_scale": k_scale},
        )  # fmt: skip
        return Manifest(layers={"l": layer}, topology={"total_kv_heads": 2, "layout": "LBHNC"})

    report = diff(side(0.5), side(0.25), rule="vllm_nixl")
    assert [f.kind for f in report.findings] == ["dtype"]
    assert "k_scale is 0.25, the sender's 0.5" in report.findings[0].message
    assert diff(side(0.5), side(0.5), rule="vllm_nixl").compatible


def test_vllm_nixl_passes_per_token_head_rows_across_tp_and_names_a_d_without_the_scale() -> None:
    """vLLM's NIXL rule splits P's page by heads; a per-token-head row (values and its scale)
    moves whole with its head, so P at TP 1 and D at TP 2 (or the reverse) agree; a D that
    reads 24-byte int8 rows without the scale part reads P's scale as values from byte 8."""

    def side(tp: int, rank: int, parts: Any) -> Manifest:
        heads = 4 // tp
        caches = {
            f"model.layers.{i}.attn": torch.empty(4, heads, 16, 24, dtype=torch.int8)
            for i in range(2)
        }
        topology = Topology(tp_size=tp, tp_rank=rank, total_kv_heads=4, layout="LBHNC",
                            kernel_block_tokens=16)  # fmt: skip
        return describe(caches, axes=VLLM_AXES, parts=parts, topology=topology)

    p = [side(1, 0, PER_TOKEN_HEAD)]
    d = [side(2, rank, PER_TOKEN_HEAD) for rank in range(2)]
    assert diff(p, d, rule="vllm_nixl").compatible
    assert diff(d, p, rule="vllm_nixl").compatible
    plain = [side(2, rank, None) for rank in range(2)]
    finding = _byte_finding(diff(p, plain, rule="vllm_nixl"))
    assert finding.byte == 8
    assert "scale (float32) group 0" in finding.message
