"""The digest weighs what a byte means, parts included (issue 37, point 4).

Rows that hold a quantized value and its scale (vLLM's per-token-head caches: the data, then an
fp32 scale computed from it) are written here through the sender's format; the receiver holds
the same bytes. A receiver that reads a part as another element type, a scale in another
order or under another ``k_scale`` must not agree with the sender, however equal the bytes;
one that reads them as the sender does agrees, across a tensor-parallel split too. Layers
without parts keep the values of before (tests/test_digest.py's known answers pin them).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import safeview
from safeview.manifest import describe
from safeview.manifest._digest_model import layer_meaning

AXES = ("block", "head", "token", "kv|element")
BLOCKS, HEADS, TOKENS, HS = 6, 4, 16, 32
ROW = HS + 4  # the data, then its fp32 scale


def _parts(data: str = "float8_e4m3fn", scale: str = "float32") -> list[dict[str, Any]]:
    return [
        {"name": "data", "offset_bytes": 0, "length_bytes": HS, "dtype": data},
        {"name": "scale", "role": "scale", "offset_bytes": HS, "length_bytes": 4,
         "dtype": scale, "granularity": "token_head"},
    ]  # fmt: skip


def _written(seed: int = 37) -> torch.Tensor:
    """A ``[B, H, N, 2 * ROW]`` int8 cache whose every (block, head, token, K/V) row is an
    e4m3 quantization of random values and the fp32 scale it was made with (max |x| / 448)."""
    rng = np.random.default_rng(seed)
    values = rng.normal(0, 3, (BLOCKS, HEADS, TOKENS, 2, HS))
    scale = np.abs(values).max(axis=-1, keepdims=True) / 448.0
    data = torch.tensor(values / scale).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    rows = np.concatenate([data, scale.astype("<f4").view(np.uint8)], axis=-1)
    assert rows.shape[-1] == ROW
    return torch.from_numpy(rows.reshape(BLOCKS, HEADS, TOKENS, 2 * ROW).copy()).view(torch.int8)


def _digest(cache: torch.Tensor, parts: Any, ids: list[int], **kwargs: Any) -> Any:
    manifest = describe({"l0": cache}, axes=AXES, parts=parts, **kwargs)
    return safeview.digest(manifest, {"l0": cache}, ids)


IDS = [4, 1, 3]


def test_a_part_read_as_another_element_type_disagrees_and_the_same_reading_agrees() -> None:
    cache = _written()
    before = cache.clone()
    sent = _digest(cache, _parts(), IDS)
    assert safeview.verify(sent, _digest(cache.clone(), _parts(), IDS)) == []
    for receiver in (_parts(data="float8_e5m2"), _parts(scale="int32")):
        found = safeview.verify(sent, _digest(cache.clone(), receiver, IDS))
        assert [f.kind for f in found] == ["digest"], [f.message for f in found]
        assert found[0].layer == "l0"
    # the same bytes without parts: a plain int8 layer is not the quantized one
    plain = safeview.verify(sent, _digest(cache.clone(), None, IDS))
    assert [f.kind for f in plain] == ["digest"]
    assert torch.equal(cache, before)  # a digest reads, never writes


def test_the_scale_keyed_by_its_token_and_head_a_swapped_scale_is_named_by_token() -> None:
    cache = _written()
    sent = _digest(cache, _parts(), IDS)
    moved = cache.clone()
    rows = moved.view(BLOCKS, HEADS, TOKENS, 2, ROW)
    # block 1 (the request's second, tokens 16 to 31), head 2: two tokens' scales swapped
    first, second = rows[1, 2, 3, 0, HS:].clone(), rows[1, 2, 9, 0, HS:].clone()
    rows[1, 2, 3, 0, HS:], rows[1, 2, 9, 0, HS:] = second, first
    found = safeview.verify(sent, _digest(moved, _parts(), IDS))
    assert [f.kind for f in found] == ["digest"]
    assert found[0].heads == (2,)
    assert found[0].tokens == (16, 31)


def test_a_k_scale_carried_by_value_is_in_the_value() -> None:
    cache = _written()
    sent = _digest(cache, _parts(), IDS, scalars={"k_scale": 0.5, "v_scale": 1.0})
    same = _digest(cache.clone(), _parts(), IDS, scalars={"k_scale": 0.5, "v_scale": 1.0})
    other = _digest(cache.clone(), _parts(), IDS, scalars={"k_scale": 0.25, "v_scale": 1.0})
    assert safeview.verify(sent, same) == []
    assert [f.kind for f in safeview.verify(sent, other)] == ["digest"]


def test_rows_with_parts_agree_across_a_tensor_parallel_split() -> None:
    cache = _written()
    sent = _digest(cache, _parts(), IDS, topology={"tp_size": 1, "total_kv_heads": HEADS})
    # D at TP 2: each rank holds two of the heads, in blocks of its own numbering
    received = []
    for rank in range(2):
        mine = cache[:, 2 * rank : 2 * rank + 2].contiguous()
        topology = {"tp_rank": rank, "tp_size": 2, "total_kv_heads": HEADS}
        received.append(_digest(mine, _parts(), IDS, topology=topology))
    assert safeview.verify(sent, received) == []
    broken = cache.clone()
    broken.view(BLOCKS, HEADS, TOKENS, 2, ROW)[3, 3, 0, 1, HS] ^= 1  # one scale bit, head 3
    mine = broken[:, 2:4].contiguous()
    rank_1 = _digest(mine, _parts(), IDS, topology={"tp_rank": 1, "tp_size": 2,
                                                     "total_kv_heads": HEADS})  # fmt: skip
    found = safeview.verify(sent, [received[0], rank_1])
    assert [(f.kind, f.heads) for f in found] == [("digest", (3,))]


def test_the_meaning_of_a_layer_without_parts_is_its_element_type() -> None:
    cache = _written()
    plain = describe({"l0": cache}, axes=AXES).layers["l0"]
    assert layer_meaning(plain) == "int8"
    with_parts = describe({"l0": cache}, axes=AXES, parts=_parts()).layers["l0"]
    other_order = describe({"l0": cache}, axes=AXES, parts=[_parts()[1], _parts()[0]]).layers["l0"]
    assert layer_meaning(with_parts) != "int8"
    # the parts' meaning, not the order they are listed in: the same parts, the same key
    assert layer_meaning(with_parts) == layer_meaning(other_order)


def test_v_scales_in_the_sm100_swizzle_read_linearly_do_not_agree() -> None:
    """NVFP4 (vllm#50084): the same page bytes, V scales stored in SM100's 4x4 swizzle, read
    by SM120 as linear. Each scale is keyed by its place in its side's format and the order is
    in the value: the two readings differ; two SM100 sides agree."""
    from test_parts import NV_SIDE, _nvfp4_layer

    from safeview.manifest import Manifest

    rng = np.random.default_rng(50084)
    pages = torch.from_numpy(rng.integers(0, 256, (2, 2, NV_SIDE), dtype=np.uint8))

    def side(order: str) -> Any:
        manifest = Manifest(layers={"l0": _nvfp4_layer(order)})
        return safeview.digest(manifest, {"l0": pages.clone()}, [1, 0])

    sm100 = side("trtllm_4x4")
    assert safeview.verify(sm100, side("trtllm_4x4")) == []
    found = safeview.verify(sm100, side("linear"))
    assert [(f.kind, f.layer) for f in found] == [("digest", "l0")]
