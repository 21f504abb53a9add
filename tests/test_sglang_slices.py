"""SGLang's copy between two attention-TP sizes as ``safeview.diff`` judges it
(``safeview.sglang._slices``), on ``meta`` pools read by ``describe_pool``: no SGLang needed.
The same judgement over SGLang's real managers and bytes is ``tests/test_sglang.py``'s."""

from __future__ import annotations

import types

import pytest
import torch

from safeview.manifest import Manifest
from safeview.manifest.diff import diff
from safeview.sglang import describe_pool
from safeview.sglang._slices import SliceCopy, slice_copy, slice_manifests

PAGE = 4


def _pool(heads: int, head_dim: int, rank: int, tp: int, total: int = 4) -> Manifest:
    """An MHA pool as SGLang 0.5.23 allocates one (K and V of a layer in one allocation,
    ``[slots, heads, head_dim]`` each), on meta, read by ``describe_pool``."""
    allocation = torch.empty(2, 2, 64 + PAGE, heads, head_dim, dtype=torch.bfloat16, device="meta")
    pool = types.SimpleNamespace(
        k_buffer=[allocation[0, i] for i in range(2)],
        v_buffer=[allocation[1, i] for i in range(2)],
        page_size=PAGE, head_num=heads, dtype=torch.bfloat16, start_layer=0,
    )  # fmt: skip
    return describe_pool(pool, topology={"tp_rank": rank, "tp_size": tp, "total_kv_heads": total})


def _item(manifest: Manifest) -> int:
    return manifest.layers["layers.0"].chunk_bytes


@pytest.mark.parametrize(
    # the pairs SGLang makes: a D rank reads the P ranks holding its heads
    ("prefill_tp", "decode_tp"), [((0, 2), (0, 1)), ((1, 2), (0, 1)), ((0, 1), (0, 2)),
                                  ((0, 1), (1, 2)), ((1, 2), (3, 4)), ((3, 4), (1, 2)),
                                  ((2, 4), (1, 2)), ((0, 4), (0, 1))],
)  # fmt: skip
def test_heads_split_by_sglangs_rule_mean_the_same_on_both_sides(
    prefill_tp: tuple[int, int], decode_tp: tuple[int, int]
) -> None:
    prefill = _pool(4 // prefill_tp[1], 16, *prefill_tp)
    decode = _pool(4 // decode_tp[1], 16, *decode_tp)
    copy = slice_copy(sender_tp=prefill_tp, receiver_tp=decode_tp, total_heads=4,
                      page_size=PAGE, receiver_item_bytes=_item(decode))  # fmt: skip
    sent, read = slice_manifests(prefill, decode, copy)
    assert sorted(sent.layers) == ["layers.0.k", "layers.0.v", "layers.1.k", "layers.1.v"]
    report = diff(sent, read, rule="page_copy")
    assert report.compatible, [f.message for f in report.findings]


def test_a_run_placed_by_the_per_rank_head_count_is_a_mismatch_naming_the_first_byte() -> None:
    # sglang#22145's kind: P rank 1 of 2 (heads 2 and 3) written at D's head 0, as a head
    # offset counted from a per-rank count would put it
    prefill, decode = _pool(2, 16, 1, 2), _pool(4, 16, 0, 1)
    sent, read = slice_manifests(prefill, decode, SliceCopy(0, 0, 64))
    report = diff(sent, read, rule="page_copy")
    assert not report.compatible
    assert report.findings[0].message == (
        "layers.0.k: receiver page byte 0 reads K token 0 head 0 element 0, the sender wrote "
        "K token 0 head 2 element 0 there"
    )


def test_another_head_size_at_another_tp_is_a_mismatch() -> None:
    # D's heads are 32 values: SGLang counts the run in D's head bytes, so it reads P's slot
    # as if its heads were twice as long
    prefill, decode = _pool(2, 16, 1, 2), _pool(4, 32, 0, 1)
    copy = slice_copy(sender_tp=(1, 2), receiver_tp=(0, 1), total_heads=4, page_size=PAGE,
                      receiver_item_bytes=_item(decode))  # fmt: skip
    assert (copy.sender_offset, copy.receiver_offset, copy.length) == (0, 128, 128)
    sent, read = slice_manifests(prefill, decode, copy)
    report = diff(sent, read, rule="page_copy")
    assert not report.compatible
    assert report.findings[0].layer == "layers.0.k"
