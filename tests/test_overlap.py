"""find_overlaps: exact, against numpy.shares_memory, with witnesses, groups and big layouts."""

from __future__ import annotations

import random

import numpy as np
import pytest

from safeview import ArgumentError, BlockLayout, Layout, StridedLayout, overlap, packed_layouts
from safeview.overlap import find_overlaps

NUMPY_DTYPES = {"int8": np.int8, "float16": np.float16, "float32": np.float32}


def _touched(layout: Layout, nbytes: int) -> np.ndarray:
    """A boolean mask of the bytes ``layout`` touches, made by numpy from its own strides."""
    buffer = bytearray(nbytes)
    shape = (*layout.shape, layout.itemsize)
    strides = (*(s * layout.itemsize for s in layout.strides), 1)
    if 0 not in shape:
        view = np.ndarray(
            shape, np.uint8, buffer=buffer, offset=layout.byte_offset, strides=strides
        )
        view[...] = 1
    mask: np.ndarray = np.frombuffer(buffer, np.uint8).astype(bool)
    return mask


def _numpy_view(layout: Layout, buffer: bytearray) -> np.ndarray:
    view: np.ndarray = np.ndarray(
        layout.shape,
        NUMPY_DTYPES[layout.dtype],
        buffer=buffer,
        offset=layout.byte_offset,
        strides=[s * layout.itemsize for s in layout.strides],
    )
    return view


def _random_block(rng: random.Random, kind: str) -> Layout:
    page = rng.randint(1, 24)
    num_blocks = rng.randint(0, 7)
    if kind == "packed":
        stride = 64
    elif kind == "contiguous":
        stride = page
    else:
        stride = rng.randint(page, page + 40)
    return BlockLayout(
        num_blocks=num_blocks,
        page_bytes=page,
        block_stride_bytes=stride if num_blocks > 1 else rng.randint(1, 80),
        byte_offset=rng.randint(0, 200),
    )


def _random_kv_split(rng: random.Random) -> Layout:
    page = rng.randint(1, 16)
    block_stride = rng.randint(page, 3 * page + 8)
    num_blocks = rng.randint(1, 6)
    kv_stride = rng.randint(block_stride * num_blocks, block_stride * num_blocks + 40)
    return StridedLayout(
        shape=(2, num_blocks, page),
        strides=(kv_stride, block_stride, 1),
        byte_offset=rng.randint(0, 100),
    )


def _random_interleaved_kv(rng: random.Random) -> Layout:
    # K and V pages side by side inside each block: (2, blocks, page), strides (kv, block, 1)
    page = rng.randint(1, 12)
    kv_stride = rng.randint(page, page + 8)
    return StridedLayout(
        shape=(2, rng.randint(1, 6), page),
        strides=(kv_stride, rng.randint(page + kv_stride, page + kv_stride + 20), 1),
        byte_offset=rng.randint(0, 100),
    )


def _random_typed(rng: random.Random) -> Layout:
    dtype = rng.choice(["float16", "float32"])
    itemsize = 2 if dtype == "float16" else 4
    inner = rng.randint(1, 6)
    outer = rng.randint(1, 5)
    return StridedLayout(
        shape=(outer, inner),
        strides=(rng.randint(inner, inner + 9), 1),
        byte_offset=itemsize * rng.randint(0, 40),
        dtype=dtype,
    )


def _random_layout(rng: random.Random) -> Layout:
    kind = rng.choice(["packed", "packed", "contiguous", "gapped", "kv", "interleaved", "typed"])
    if kind == "kv":
        return _random_kv_split(rng)
    if kind == "interleaved":
        return _random_interleaved_kv(rng)
    if kind == "typed":
        return _random_typed(rng)
    return _random_block(rng, kind)


def test_agrees_with_numpy_shares_memory_on_ten_thousand_random_pairs() -> None:
    rng = random.Random(20261202)
    kinds_seen = {"overlap": 0, "disjoint_but_spans_meet": 0, "disjoint": 0}
    for _ in range(10_000):
        first, second = _random_layout(rng), _random_layout(rng)
        nbytes = max(first.extent_bytes, second.extent_bytes, 1)
        buffer = bytearray(nbytes)
        expected = bool(
            np.shares_memory(_numpy_view(first, buffer), _numpy_view(second, buffer), max_work=-1)
        )
        found = find_overlaps({"a": first, "b": second})
        assert bool(found) == expected, (first, second)
        if found:
            [overlap] = found
            assert overlap.views == ("a", "b")
            assert _touched(first, nbytes)[overlap.byte]
            assert _touched(second, nbytes)[overlap.byte]
            kinds_seen["overlap"] += 1
        elif max(first.byte_offset, second.byte_offset) < min(
            first.extent_bytes, second.extent_bytes
        ):
            kinds_seen["disjoint_but_spans_meet"] += 1
        else:
            kinds_seen["disjoint"] += 1
    # the random mix really exercises all three answers
    assert min(kinds_seen.values()) > 500, kinds_seen


def test_witness_is_the_lowest_shared_byte_of_a_block_pair() -> None:
    first = BlockLayout(num_blocks=4, page_bytes=8, block_stride_bytes=16, byte_offset=0)
    second = BlockLayout(num_blocks=4, page_bytes=8, block_stride_bytes=16, byte_offset=4)
    [overlap] = find_overlaps({"k": first, "v": second})
    assert overlap.byte == 4


def test_interleaved_packed_pages_do_not_overlap_although_their_spans_do() -> None:
    layouts = packed_layouts({f"layer.{i}": 16 + i for i in range(6)}, num_blocks=50)
    spans = [(layout.byte_offset, layout.extent_bytes) for layout in layouts.values()]
    assert all(a0 < b1 and b0 < a1 for a0, a1 in spans for b0, b1 in spans)
    assert find_overlaps(layouts) == []


def test_a_layer_that_counts_its_blocks_twice_runs_into_the_next_one() -> None:
    # vLLM's unit-test layout: 3 layers of 10 contiguous 16 KiB blocks, layer l at l * 163,840.
    page = 16_384
    layers = {
        f"layer.{i}": BlockLayout(
            num_blocks=10, page_bytes=page, block_stride_bytes=page, byte_offset=i * 163_840
        )
        for i in range(3)
    }
    assert find_overlaps(layers) == []
    broken = dict(layers)
    broken["layer.1"] = layers["layer.1"].model_copy(update={"num_blocks": 20})
    [overlap] = find_overlaps(broken)
    assert (*overlap.views, overlap.byte) == ("layer.1", "layer.2", 2 * 163_840)


def test_kv_halves_of_packed_layers_overlap_only_when_misplaced() -> None:
    page, num_blocks = 64, 8
    block_stride = 4 * page  # two layers, K and V each
    split = {
        f"layer.{i}": StridedLayout(
            shape=(2, num_blocks, page),
            strides=(page, block_stride, 1),
            byte_offset=i * 2 * page,
        )
        for i in range(2)
    }
    assert find_overlaps(split) == []
    shifted = dict(split)
    shifted["layer.1"] = split["layer.1"].model_copy(update={"byte_offset": page})
    [overlap] = find_overlaps(shifted)
    assert overlap.byte == page  # layer.1's K page sits on layer.0's V page


def test_every_overlapping_pair_is_reported_in_input_order() -> None:
    pages = {f"v{i}": 32 for i in range(5)}
    layouts = packed_layouts(pages, num_blocks=10)
    # v3 moves onto v1's page, v4 straddles v1 and v2
    layouts["v3"] = layouts["v1"].model_copy()
    layouts["v4"] = layouts["v1"].model_copy(update={"byte_offset": 48})
    pairs = [o.views for o in find_overlaps(layouts)]
    assert pairs == [("v1", "v3"), ("v1", "v4"), ("v2", "v4"), ("v3", "v4")]


def test_groups_allow_sharing_across_groups_only() -> None:
    attention = BlockLayout(num_blocks=8, page_bytes=64, block_stride_bytes=64)
    mamba = BlockLayout(num_blocks=8, page_bytes=64, block_stride_bytes=64)
    other_attention = BlockLayout(num_blocks=1, page_bytes=8, block_stride_bytes=8, byte_offset=8)
    layouts = {"attn.0": attention, "mamba.0": mamba, "attn.1": other_attention}
    assert len(find_overlaps(layouts)) == 3
    groups = {"attn.0": 0, "mamba.0": 1, "attn.1": 0}
    [overlap] = find_overlaps(layouts, groups=groups)
    assert (*overlap.views, overlap.group) == ("attn.0", "attn.1", 0)
    assert overlap.byte == 8
    assert "group 0" in overlap.message


def test_a_view_without_group_may_share_with_no_view() -> None:
    attention = BlockLayout(num_blocks=8, page_bytes=64, block_stride_bytes=64)
    mamba = BlockLayout(num_blocks=8, page_bytes=64, block_stride_bytes=64)
    stray = BlockLayout(num_blocks=1, page_bytes=8, block_stride_bytes=8, byte_offset=64)
    layouts = {"attn.0": attention, "mamba.0": mamba, "stray": stray}
    overlaps = find_overlaps(layouts, groups={"attn.0": 0, "mamba.0": 1})
    assert [(*o.views, o.group) for o in overlaps] == [
        ("attn.0", "stray", None),
        ("mamba.0", "stray", None),
    ]


def test_empty_views_share_nothing() -> None:
    empty = BlockLayout(num_blocks=0, page_bytes=64, block_stride_bytes=64)
    full = BlockLayout(num_blocks=4, page_bytes=64, block_stride_bytes=64)
    assert find_overlaps({"empty": empty, "full": full}) == []


def test_result_is_deterministic() -> None:
    rng = random.Random(7)
    layouts = {f"v{i}": _random_layout(rng) for i in range(60)}
    first = find_overlaps(layouts)
    assert first == find_overlaps(dict(layouts))
    assert len(first) > 0


def test_many_views_of_one_stride_match_pairwise_checks() -> None:
    # 300 views of one stride with a few deliberate collisions; the sweep must find exactly the
    # pairs that the pairwise exact check finds.
    rng = random.Random(11)
    stride = 4096
    layouts: dict[str, Layout] = {}
    offset = 0
    for i in range(300):
        page = rng.randint(1, 12)
        if rng.random() < 0.03:
            offset = max(0, offset - rng.randint(1, 20))
        layouts[f"v{i}"] = BlockLayout(
            num_blocks=rng.randint(2, 5),
            page_bytes=page,
            block_stride_bytes=stride,
            byte_offset=offset + stride * rng.randint(0, 2),
        )
        offset += page
    found = {o.views for o in find_overlaps(layouts)}
    names = list(layouts)
    pairwise = {
        (names[i], names[j])
        for i in range(len(names))
        for j in range(i + 1, len(names))
        if find_overlaps({names[i]: layouts[names[i]], names[j]: layouts[names[j]]})
    }
    assert found == pairwise
    assert len(found) > 3


def _mixed_strides(rng: random.Random, base: int) -> dict[str, Layout]:
    """Views whose block strides divide one another (a stride, twice it, four times it) and
    contiguous views, interleaved over the same bytes."""
    layouts: dict[str, Layout] = {}
    for index in range(rng.randint(2, 7)):
        stride = base * rng.choice([1, 2, 4])
        page = rng.randint(1, stride)
        number = rng.randint(0, 9)
        if rng.random() < 0.2:  # contiguous: stride == page
            page = stride = rng.randint(1, 3 * base)
        layouts[f"v{index}"] = BlockLayout(
            num_blocks=number,
            page_bytes=page,
            block_stride_bytes=stride,
            byte_offset=rng.randint(0, 3 * base),
        )
    return layouts


def test_views_of_strides_that_divide_one_another_match_numpy_and_the_lowest_byte() -> None:
    rng = random.Random(20261203)
    for _ in range(3_000):
        layouts = _mixed_strides(rng, base=rng.choice([3, 8, 12]))
        size = max(layout.extent_bytes for layout in layouts.values()) + 1
        masks = {name: _touched(layout, size) for name, layout in layouts.items()}
        found = {o.views: o.byte for o in find_overlaps(layouts)}
        names = list(layouts)
        for i, first in enumerate(names):
            for second in names[i + 1 :]:
                both = np.flatnonzero(masks[first] & masks[second])
                expected = int(both[0]) if both.size else None
                assert found.get((first, second)) == expected, (layouts, first, second)


def test_strides_that_divide_one_another_scale_like_one_stride() -> None:
    # kernel blocks (stride 8,192) beside manager blocks (16,384): folded into one period, so
    # the work grows with the views, never with their pairs
    # (byte r of every kernel block for the first half, then manager-block views on other bytes)
    big: dict[str, Layout] = {
        f"v{index}": BlockLayout(
            num_blocks=1_000,
            page_bytes=1,
            block_stride_bytes=8_192 if index < 4_000 else 16_384,
            byte_offset=index,
        )
        for index in range(8_000)
    }
    assert find_overlaps(big) == []  # one by one, 3.2 * 10^7 pair tests
    moved = {**big, "v7999": BlockLayout(num_blocks=1_000, page_bytes=1, block_stride_bytes=16_384,
                                         byte_offset=8_192 + 5)}  # fmt: skip
    [found] = find_overlaps(moved)
    assert (found.views, found.byte) == (("v5", "v7999"), 8_192 + 5)


def test_unrelated_strides_stop_at_the_work_limit_naming_the_views(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(overlap, "MAX_EXACT_TESTS", 50)
    layouts: dict[str, Layout] = {
        f"v{index}": BlockLayout(
            num_blocks=100,
            page_bytes=1,
            block_stride_bytes=101 if index % 2 else 103,  # neither divides the other
            byte_offset=index,
        )
        for index in range(40)
    }
    with pytest.raises(ArgumentError, match=r"views 'v\d+' and 'v\d+' \(block strides 10[13] and"):
        find_overlaps(layouts)
    monkeypatch.setattr(overlap, "MAX_EXACT_TESTS", 5_000_000)
    size = max(layout.extent_bytes for layout in layouts.values())
    masks = {name: _touched(layout, size) for name, layout in layouts.items()}
    expected = {
        (a, b)
        for i, a in enumerate(layouts)
        for b in list(layouts)[i + 1 :]
        if (masks[a] & masks[b]).any()
    }
    assert {o.views for o in find_overlaps(layouts)} == expected  # exact, under the real limit


# -- bad arguments: ArgumentError naming the argument and the value ---------------------------

LAYOUT = BlockLayout(num_blocks=2, page_bytes=8, block_stride_bytes=16)


@pytest.mark.parametrize(
    ("layouts", "groups", "message"),
    [
        ([LAYOUT], None, r"layouts must be a mapping of view names to layouts .*got list"),
        ((LAYOUT, LAYOUT), None, r"layouts must be a mapping .*got tuple"),
        (
            {"a": 3},
            None,
            r"layouts\['a'\] must be a safeview BlockLayout or Strided.*; got int",
        ),
        (
            {"a": LAYOUT},
            ["a"],
            r"groups must be a mapping of view names to groups.*got list",
        ),
        (
            {"a": LAYOUT},
            {"a": [0]},
            r"groups\['a'\] must be a hashable .*got \[0\] \(list\)",
        ),
    ],
    ids=["list", "tuple", "not-a-layout", "groups-list", "unhashable-group"],
)
def test_find_overlaps_refuses_arguments_of_the_wrong_kind_naming_them(
    layouts: object, groups: object, message: str
) -> None:
    with pytest.raises(ArgumentError, match=message):
        find_overlaps(layouts, groups=groups)  # type: ignore[arg-type]
