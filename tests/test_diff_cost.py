"""What D's judgement of a P handshake costs (issue 28): under vLLM's NIXL rule, layers of one page
layout are worked out once, a whole-page copy between layers of one page meaning decodes no page,
and neither changes a finding (each layer's own name, in name order, the message of the layer
judged alone)."""

from __future__ import annotations

import pytest
import torch

from safeview import Manifest
from safeview.manifest import _nixl_rules, describe, vllm_axes
from safeview.manifest import diff as layout_diff

LAYERS, HEADS, TOKENS, HEAD_SIZE, BLOCKS = 100, 4, 32, 64, 3


def engine(tp: int, rank: int, nhd: set[int], bf16: set[int]) -> Manifest:
    """One vLLM rank of a 100-layer model on meta, ``[B, H, N, K|V]`` views; the layers in
    ``nhd`` are physically ``[B, N, H, K|V]`` under the same layout string, those in ``bf16``
    of another dtype."""
    heads = HEADS // tp
    caches = {}
    for i in range(LAYERS):
        dtype = torch.bfloat16 if i in bf16 else torch.float16
        if i in nhd:
            shape = (BLOCKS, TOKENS, heads, 2 * HEAD_SIZE)
            tensor = torch.empty(shape, dtype=dtype, device="meta").permute(0, 2, 1, 3)
        else:
            tensor = torch.empty(BLOCKS, heads, TOKENS, 2 * HEAD_SIZE, dtype=dtype, device="meta")
        caches[f"model.layers.{i}.self_attn.attn"] = tensor
    topology = {"tp_rank": rank, "tp_size": tp, "total_kv_heads": HEADS, "layout": "LBHNC"}
    return describe(caches, axes=vllm_axes(), topology=topology)


def alone(manifest: Manifest, name: str) -> Manifest:
    return Manifest(topology=manifest.topology, layers={name: manifest.layers[name]})


def test_identical_layouts_are_judged_without_decoding_a_page(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    decoded: list[int] = []
    real = layout_diff._decode_page

    def counting(*args: object, **kwargs: object) -> object:
        decoded.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(layout_diff, "_decode_page", counting)
    layout_diff._CACHE.clear()  # a first judgement, as where D meets its first P
    report = layout_diff.diff(engine(1, 0, set(), set()), engine(1, 0, set(), set()), "vllm_nixl")
    assert report.compatible
    assert len(report.layers) == LAYERS
    assert decoded == []
    # a layer that differs is still decoded and named (the shortcut needs one page meaning)
    layout_diff._CACHE.clear()
    report = layout_diff.diff(engine(1, 0, {7}, set()), engine(1, 0, set(), set()), "vllm_nixl")
    assert [f.layer for f in report.findings] == ["model.layers.7.self_attn.attn"]
    assert report.findings[0].kind == "byte"
    assert decoded


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (1, 2), (2, 1)])
def test_one_plan_per_distinct_layout_and_every_layer_named_as_judged_alone(
    monkeypatch: pytest.MonkeyPatch, p_tp: int, d_tp: int
) -> None:
    planned: list[int] = []
    real = _nixl_rules.plan_layer

    def counting(**kwargs: object) -> _nixl_rules.Plan:
        planned.append(1)
        return real(**kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(_nixl_rules, "plan_layer", counting)
    # P: layers 3 and 50 physically NHD, layer 9 bf16
    senders = [engine(p_tp, r, {3, 50}, {9}) for r in range(p_tp)]
    receivers = [engine(d_tp, r, set(), set()) for r in range(d_tp)]
    report = layout_diff.diff(senders, receivers, "vllm_nixl")
    # one plan per distinct (D layout, P layouts) per D rank: plain, NHD, bf16
    assert len(planned) == 3 * d_tp
    found = [(f.receiver_rank, f.layer, f.kind, f.message) for f in report.findings]
    # the oracle: each layer judged alone, with no other layer to share its work with
    wanted = []
    for receiver in receivers:
        for name in sorted(receiver.layers):
            ones = [alone(sender, name) for sender in senders]
            layout_diff._CACHE.clear()
            one = layout_diff.diff(ones, alone(receiver, name), "vllm_nixl")
            wanted += [(f.receiver_rank, f.layer, f.kind, f.message) for f in one.findings]
    assert found == wanted
    assert {f[1] for f in found} == {
        "model.layers.3.self_attn.attn",
        "model.layers.9.self_attn.attn",
        "model.layers.50.self_attn.attn",
    }
