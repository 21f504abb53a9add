"""The one checker: every judgement over plain records, against brute force and numpy."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from safeview import ArgumentError, OverlapError, sanitize
from safeview.check import StorageRecord, ViewRecord, check_views
from safeview.kv import block_views, check_tensors
from safeview.overlap import Pieces, _suspects
from safeview.plan import Plan

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
sys.path.insert(0, str(Path(__file__).parent))

import big_plans
from reference_sweep import extent, project, reference_findings


def _touched(view: ViewRecord) -> set[int]:
    """Every byte a view touches, by enumeration."""
    starts = {view.byte_offset}
    for size, stride in zip(view.shape, view.strides):
        if size == 0:
            return set()
        starts = {s + k * stride * view.itemsize for s in starts for k in range(size)}
    return {s + b for s in starts for b in range(view.itemsize)}


@st.composite
def block_records(draw: st.DrawFn, name: str) -> ViewRecord:
    number = draw(st.integers(0, 5))
    page = draw(st.integers(1, 12))
    stride = draw(st.sampled_from([page, 2 * page, 24, 36, draw(st.integers(1, 40))]))
    return ViewRecord.block(
        name,
        "kv",
        num_blocks=number,
        page_bytes=page,
        block_stride_bytes=stride,
        byte_offset=draw(st.integers(0, 60)),
        group=draw(st.sampled_from([None, 0, 1])),
    )


@given(data=st.data(), count=st.integers(1, 6), nbytes=st.integers(0, 200))
def test_findings_match_brute_force_on_small_block_layouts(
    data: st.DataObject, count: int, nbytes: int
) -> None:
    views = [data.draw(block_records(f"v{i}")) for i in range(count)]
    report = check_views({"kv": nbytes}, views)
    kinds = {(f.kind, f.views) for f in report.findings}
    touched = {view.name: _touched(view) for view in views}
    self_overlapping = set()
    for view in views:
        pages = [
            set(range(view.byte_offset + i * view.strides[0],
                      view.byte_offset + i * view.strides[0] + view.shape[1]))
            for i in range(view.shape[0])
        ]  # fmt: skip
        if sum(len(p) for p in pages) != len(set().union(*pages)):
            self_overlapping.add(view.name)
            assert ("self_overlap", (view.name,)) in kinds
        past = max(touched[view.name], default=view.byte_offset - 1) >= nbytes or (
            not touched[view.name] and view.byte_offset > nbytes
        )
        assert (("out_of_bounds", (view.name,)) in kinds) == past
    for i, first in enumerate(views):
        for second in views[i + 1 :]:
            if {first.name, second.name} & self_overlapping:
                continue  # kept out of the pairwise check
            may_share = (
                first.group is not None
                and second.group is not None
                and (first.group != second.group)
            )
            common = touched[first.name] & touched[second.name]
            expected = bool(common) and not may_share
            found = [f for f in report.findings if f.views == (first.name, second.name)]
            assert bool(found) == expected
            if found:
                assert found[0].byte == min(common)  # the witness is the lowest shared byte


def test_a_self_overlapping_view_is_kept_out_of_the_pairwise_check() -> None:
    views = [
        ViewRecord.block("bad", "kv", num_blocks=4, page_bytes=16, block_stride_bytes=8,
                         byte_offset=0),
        ViewRecord.block("good", "kv", num_blocks=1, page_bytes=16, block_stride_bytes=16,
                         byte_offset=0),
    ]  # fmt: skip
    report = check_views({"kv": 64}, views)
    assert [(f.kind, f.views) for f in report.findings] == [("self_overlap", ("bad",))]


def test_views_of_two_storages_over_one_memory_are_compared_by_address() -> None:
    storages = {
        "a": StorageRecord(64, memory="cpu", base=1000),
        "b": StorageRecord(64, memory="cpu", base=1032),  # its byte 0 is a's byte 32
    }
    views = [
        ViewRecord.block("x", "a", num_blocks=1, page_bytes=40, block_stride_bytes=40,
                         byte_offset=0),
        ViewRecord.block("y", "b", num_blocks=1, page_bytes=8, block_stride_bytes=8,
                         byte_offset=4),
    ]  # fmt: skip
    [finding] = check_views(storages, views).findings
    assert finding.views == ("x", "y")
    assert finding.byte == 36  # in x's storage: y's byte 4 is a's byte 36
    apart = {**storages, "b": StorageRecord(64, memory="cpu", base=2000)}
    assert check_views(apart, views).ok


def test_frombuffer_twice_gives_two_storages_whose_aliasing_is_still_found() -> None:
    buffer = bytearray(256)
    first = torch.frombuffer(buffer, dtype=torch.int8)
    second = torch.frombuffer(buffer, dtype=torch.int8)
    assert first.untyped_storage()._cdata != second.untyped_storage()._cdata
    caches = {
        "layer.0": torch.as_strided(first, (4, 32), (64, 1), 0),
        "layer.1": torch.as_strided(second, (4, 32), (64, 1), 16),  # shares 16 bytes a block
    }
    assert np.shares_memory(
        np.frombuffer(buffer, np.int8)[0:32], np.frombuffer(buffer, np.int8)[16:48]
    )
    with pytest.raises(OverlapError, match=r"'layer\.0' and 'layer\.1' both use byte 16"):
        check_tensors(caches)
    with pytest.raises(OverlapError):
        block_views(caches, {"layer.0": 32, "layer.1": 32}, num_blocks=4, packed=caches)


def test_meta_storages_are_each_their_own_memory() -> None:
    a = torch.empty(64, dtype=torch.int8, device="meta")
    b = torch.empty(64, dtype=torch.int8, device="meta")
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() == 0
    assert check_tensors({"a": a, "b": b}).ok


def test_a_view_naming_an_unknown_storage_is_an_argument_error() -> None:
    view = ViewRecord.block("v", "nowhere", num_blocks=1, page_bytes=1, block_stride_bytes=1,
                            byte_offset=0)  # fmt: skip
    with pytest.raises(ArgumentError, match="names storage 'nowhere'"):
        check_views({"kv": 8}, [view])


def test_off_judges_nothing() -> None:
    view = ViewRecord.block("v", "kv", num_blocks=9, page_bytes=8, block_stride_bytes=4,
                            byte_offset=0)  # fmt: skip
    assert check_views({"kv": 8}, [view], checks=False).ok
    assert {f.kind for f in check_views({"kv": 8}, [view]).findings} == {
        "out_of_bounds",
        "self_overlap",
    }


def test_bytes_covered_and_min_slack_are_the_views_own_numbers() -> None:
    views = [
        ViewRecord.block("a", "kv", num_blocks=3, page_bytes=8, block_stride_bytes=32,
                         byte_offset=0),
        ViewRecord.block("b", "kv", num_blocks=3, page_bytes=24, block_stride_bytes=32,
                         byte_offset=8),
    ]  # fmt: skip
    report = check_views({"kv": 100}, views)
    assert sum(view.nbytes for view in report.views) == 3 * 8 + 3 * 24
    assert report.min_slack_bytes() == 100 - (8 + 2 * 32 + 24)
    assert [row["status"] for row in report.rows()] == ["ok", "ok"]


def test_a_dlpack_alias_is_another_storage_over_the_same_memory_and_is_compared() -> None:
    kv = torch.zeros(1024, dtype=torch.int8)
    alias = torch.utils.dlpack.from_dlpack(kv)
    assert alias.untyped_storage()._cdata != kv.untyped_storage()._cdata
    report = check_tensors({"a": kv[:512], "b": alias[256:768]}, policy="warn")
    [finding] = report.findings
    assert (finding.kind, finding.views, finding.byte) == ("overlap", ("a", "b"), 256)


# -- the checker finds exactly what the page-by-page oracle finds (tests/reference_sweep.py) -----

FAMILIES = [(16,), (8, 16, 32), (12, 24, 48), (4, 8, 64), (6, 10, 15), (7, 11), (5, 320)]


def _random_view(
    rng: random.Random, name: str, storage: str, family: tuple[int, ...]
) -> ViewRecord:
    group = rng.choice([None, None, 0, 0, 1, 2, "x"])
    region = (rng.randint(0, 40), rng.randint(40, 400)) if rng.random() < 0.1 else None
    kind = rng.random()
    if kind < 0.12:  # a typed view, not a block view: split into runs by _arith.blocks
        itemsize = rng.choice([2, 4])
        inner = rng.randint(1, 4)
        # an outer stride below the row (0 included) makes a view that overlaps itself
        outer = rng.randint(inner, inner + 6) if rng.random() < 0.8 else rng.randint(0, inner)
        return ViewRecord(
            name, storage, itemsize * rng.randint(0, 60), (rng.randint(0, 4), inner),
            (outer, 1), itemsize, group, region, "float16",
        )  # fmt: skip
    stride = rng.choice(family)
    if kind < 0.3:  # contiguous: back-to-back pages, or a single one
        page = rng.randint(1, 60)
        number = rng.randint(0, 4)
        stride = page if rng.random() < 0.5 else rng.randint(1, 80)
    elif kind < 0.35:  # pages wider than the stride: a view that overlaps itself
        page = stride + rng.randint(1, 5)
        number = rng.randint(2, 5)
    else:
        page = rng.randint(1, stride)
        number = rng.randint(0, 9)
    return ViewRecord.block(
        name, storage, num_blocks=number, page_bytes=page, block_stride_bytes=stride,
        byte_offset=rng.randint(0, 300), group=group, region=region,
    )  # fmt: skip


def _random_plan(rng: random.Random) -> tuple[dict[str, int | StorageRecord], list[ViewRecord]]:
    storages: dict[str, int | StorageRecord] = {"kv": rng.randint(0, 600)}
    if rng.random() < 0.4:  # two more storages over one memory, the second 0..64 bytes in
        storages["a"] = StorageRecord(rng.randint(0, 600), memory="m", base=1000)
        storages["b"] = StorageRecord(
            rng.randint(0, 600), memory="m", base=1000 + rng.randint(0, 64)
        )
    family = rng.choice(FAMILIES)
    views = [
        _random_view(rng, f"v{i}", rng.choice(list(storages)), family)
        for i in range(rng.randint(2, 40))
    ]
    return storages, views


def test_checker_finds_what_the_page_by_page_oracle_finds_on_random_plans() -> None:
    rng = random.Random(20261214)
    overlapping, typed_extent, typed_self = 0, 0, 0
    for _ in range(3_000):
        storages, views = _random_plan(rng)
        expected = reference_findings(storages, views)
        found = check_views(storages, views).findings
        assert [project(f) for f in found] == expected, (storages, views)
        overlapping += any(f[0] == "overlap" for f in expected)
        typed = {v.name for v in views if v.dtype is not None}
        typed_extent += any(f[0] == "out_of_bounds" and f[1][0] in typed for f in expected)
        typed_self += any(f[0] == "self_overlap" and f[1][0] in typed for f in expected)
    assert 600 < overlapping < 2_900  # both answers are exercised
    # typed views (extent and self-overlap from safeview._arith, not the block fast path) are
    # judged too, in bounds and past them, clean and overlapping themselves
    assert typed_extent > 100, typed_extent
    assert typed_self > 100, typed_self


def test_the_oracle_agrees_with_numpy_and_torch_on_real_views() -> None:
    """The oracle itself, against the libraries that own the rules: numpy's byte bounds and exact
    shares_memory on real views of one bytearray, and torch's own as_strided bound check."""
    rng = random.Random(20261216)
    itemsizes = {2: torch.int16, 4: torch.int32}
    checked = {"extent": 0, "past": 0, "self": 0, "pairs": 0}
    for _ in range(300):
        family = rng.choice(FAMILIES)
        views = [
            _random_view(rng, f"v{i}", "kv", family)._replace(group=None, region=None)
            for i in range(rng.randint(2, 12))
        ]
        nbytes = 4 * rng.randint(0, 150)
        expected = reference_findings({"kv": nbytes}, views)
        buffer = bytearray(4_096)
        base = np.frombuffer(buffer, np.uint8)
        arrays = {}
        for view in views:
            shape = (*view.shape, view.itemsize)
            strides = (*(s * view.itemsize for s in view.strides), 1)
            array = np.ndarray(shape, np.uint8, buffer=buffer, offset=view.byte_offset,
                               strides=strides)  # fmt: skip
            _, high = np.lib.array_utils.byte_bounds(array)
            start = base.__array_interface__["data"][0]
            if array.size:
                assert extent(view) == high - start, view
                arrays[view.name] = array
                checked["extent"] += 1
                # torch refuses exactly the views that need a byte past the storage's end
                storage = torch.zeros(nbytes, dtype=torch.int8)
                if view.itemsize > 1:
                    storage = storage.view(itemsizes[view.itemsize])
                past = any(f[:2] == ("out_of_bounds", (view.name,)) for f in expected)
                try:
                    torch.as_strided(storage, view.shape, view.strides,
                                     view.byte_offset // view.itemsize)  # fmt: skip
                    assert not past, view
                except RuntimeError as error:
                    assert "out of bounds" in str(error), error
                    assert past, view
                    checked["past"] += 1
            touched = np.zeros(len(buffer), np.int64)
            np.add.at(touched, _addresses(array, start), 1)
            twice = any(f[:2] == ("self_overlap", (view.name,)) for f in expected)
            assert twice == bool((touched > 1).any()), view
            checked["self"] += twice
        broken = {f[1][0] for f in expected if f[0] == "self_overlap"}
        pairs = {f[1] for f in expected if f[0] == "overlap"}
        for i, first in enumerate(views):
            for second in views[i + 1 :]:
                if {first.name, second.name} & broken or not (
                    first.name in arrays and second.name in arrays
                ):
                    continue
                shares = np.shares_memory(arrays[first.name], arrays[second.name], max_work=-1)
                assert shares == ((first.name, second.name) in pairs), (first, second)
                checked["pairs"] += shares
    assert min(checked.values()) > 50, checked


def _addresses(array: np.ndarray, start: int) -> np.ndarray:
    """The offset from ``start`` of every byte of a uint8 view, one per element."""
    index = np.indices(array.shape).reshape(array.ndim, -1)
    offset = array.__array_interface__["data"][0] - start
    addresses: np.ndarray = offset + sum(i * s for i, s in zip(index, array.strides))
    return addresses


@pytest.mark.slow
def test_checker_finds_what_the_page_by_page_oracle_finds_on_every_shipped_plan() -> None:
    paths = sorted((Path(__file__).parent.parent / "examples" / "plans").glob("*.json"))
    assert len(paths) >= 7
    plans = [Plan.load(path) for path in paths]
    for big in (
        big_plans.packed_plan(3_000),
        big_plans.mixed_plan(3_000, 100),
        big_plans.mixed_plan(3_000, 100, broken=True),
    ):
        plans.append(Plan.model_validate(big))
    for plan in plans:
        expected = reference_findings(plan.sizes(), plan.records())
        assert [project(f) for f in plan.check().findings] == expected, plan.description
    # the broken one: a view past the end, two pairs in groups, two contiguous views on one page,
    # and a contiguous view on bytes 100..4195, which 2 x 2,900 grouped views hold a byte of
    assert [len(plan.check().findings) for plan in plans[-3:]] == [0, 0, 1 + 2 + 1 + 5_800]


def test_findings_match_numpy_on_random_plans_with_groups() -> None:
    rng = random.Random(20261215)
    for _ in range(300):
        family = rng.choice(FAMILIES)
        views = [_random_view(rng, f"v{i}", "kv", family) for i in range(rng.randint(2, 30))]
        report = check_views({"kv": 1_000}, views)
        found = {f.views: f.byte for f in report.findings if f.kind == "overlap"}
        broken = {f.views[0] for f in report.findings if f.kind == "self_overlap"}
        masks = {view.name: _mask(view) for view in views if view.name not in broken}
        for i, first in enumerate(views):
            for second in views[i + 1 :]:
                if first.name in broken or second.name in broken:
                    continue
                apart = None not in (first.group, second.group) and first.group != second.group
                both = np.flatnonzero(masks[first.name] & masks[second.name])
                expected = int(both[0]) if both.size and not apart else None
                assert found.get((first.name, second.name)) == expected, (first, second)


def _mask(view: ViewRecord) -> np.ndarray:
    """The bytes a view touches, marked by numpy from its own shape and strides."""
    buffer = bytearray(4_096)
    shape = (*view.shape, view.itemsize)
    strides = (*(s * view.itemsize for s in view.strides), 1)
    if 0 not in shape:
        np.ndarray(shape, np.uint8, buffer=buffer, offset=view.byte_offset, strides=strides)[
            ...
        ] = 1
    mask: np.ndarray = np.frombuffer(buffer, np.uint8).astype(bool)
    return mask


def test_views_of_two_groups_are_each_judged_with_the_views_of_none() -> None:
    # group 0 and group 1 lie on the same bytes, [0, 128) (allowed); "loose" has no group and
    # sits on the last page of both, and "spare" overlaps "loose" only: each pair reported once
    views = [
        ViewRecord.block(f"g{g}.{i}", "kv", num_blocks=4, page_bytes=8, block_stride_bytes=32,
                         byte_offset=8 * i, group=g)
        for g in (0, 1) for i in range(4)
    ]  # fmt: skip
    views.append(ViewRecord.block("loose", "kv", num_blocks=1, page_bytes=16,
                                  block_stride_bytes=16, byte_offset=120))  # fmt: skip
    views.append(ViewRecord.block("spare", "kv", num_blocks=1, page_bytes=4, block_stride_bytes=4,
                                  byte_offset=130))  # fmt: skip
    found = [(f.views, f.byte) for f in check_views({"kv": 256}, views).findings]
    assert found == [
        (("g0.3", "loose"), 120),
        (("g1.3", "loose"), 120),
        (("loose", "spare"), 130),
    ]
    assert found == [(f[1], f[8]) for f in reference_findings({"kv": 256}, views)]


def test_places_within_the_period_that_never_meet_prove_a_plan_clean_whatever_its_blocks() -> None:
    # one stride, different numbers of blocks and first blocks: 0.2.0's quick exit wanted them
    # all on the same blocks; the places within the period are enough
    views = [
        ViewRecord.block(f"v{i}", "kv", num_blocks=1 + i, page_bytes=10, block_stride_bytes=64,
                         byte_offset=64 * i + 10 * i)
        for i in range(6)
    ]  # fmt: skip
    pieces = Pieces()
    for position, view in enumerate(views):
        pieces.add(view.byte_offset, view.shape[0], view.strides[0], view.shape[1], position)
    assert _suspects(pieces, range(len(views))) == []
    assert check_views({"kv": 1_000}, views).ok
    # a page that runs over the end of its period is placed on two ranges: bytes [124, 140) and
    # [188, 204), places [60, 64) and [0, 12), meet v1's second page [138, 148) at byte 138
    spill = ViewRecord.block("spill", "kv", num_blocks=2, page_bytes=16, block_stride_bytes=64,
                             byte_offset=124)  # fmt: skip
    [finding] = check_views({"kv": 1_000}, [*views, spill]).findings
    assert (finding.views, finding.byte) == (("v1", "spill"), 138)
    assert [project(finding)] == reference_findings({"kv": 1_000}, [*views, spill])


def test_a_broken_plan_sweeps_only_the_views_that_may_be_at_fault() -> None:
    pieces = Pieces()
    for position in range(1_000):  # byte `position` of each 4,096-byte block
        pieces.add(position, 8, 4_096, 1, position)
    pieces.add(500, 2, 4_096, 1, 1_000)  # on view 500's bytes
    assert _suspects(pieces, range(1_001)) == [500, 1_000]
    # a contiguous run among the strided bytes is placed within the period too: bytes 990..1005
    # of block 3 meet views 990..999 there, and nothing else
    pieces.add(3 * 4_096 + 990, 1, 16, 16, 1_001)
    assert _suspects(pieces, range(1_002)) == [500, *range(990, 1_000), 1_000, 1_001]
    # one beyond the strided runs is judged by its span alone
    pieces.add(8 * 4_096, 1, 4_096, 4_096, 1_002)
    assert _suspects(pieces, [*range(1_000), 1_002]) == []


def test_strides_that_do_not_divide_one_another_cannot_be_placed() -> None:
    pieces = Pieces()
    pieces.add(0, 4, 12, 1, 0)
    pieces.add(1, 4, 8, 1, 1)
    assert _suspects(pieces, range(2)) is None


# -- bad arguments ---------------------------------------------------------------------------

ONE = ViewRecord.block("v", "kv", num_blocks=1, page_bytes=1, block_stride_bytes=1, byte_offset=0)


@pytest.mark.parametrize(
    ("storages", "views", "message"),
    [
        (None, [ONE], r"storages must be a mapping .*got NoneType"),
        ([("kv", 8)], [ONE], r"storages must be a mapping .*got list"),
        ({"kv": -1}, [ONE], r"storages\['kv'\] must be a size in bytes \(an int >= 0\).*got -1"),
        ({"kv": 8.0}, [ONE], r"storages\['kv'\] .*got 8\.0 \(float\)"),
        ({"kv": 8}, None, r"views must be an iterable of ViewRecords; got NoneType"),
        ({"kv": 8}, [("v", "kv", 0, (1, 1), (1, 1))], r"ViewRecord tuples; got tuple"),
    ],
    ids=["none", "list", "negative", "float", "views-none", "plain-tuple"],
)
def test_check_views_refuses_arguments_of_the_wrong_kind_naming_them(
    storages: object, views: object, message: str
) -> None:
    for checks in (True, False):
        with pytest.raises(ArgumentError, match=message):
            check_views(storages, views, checks=checks)  # type: ignore[arg-type]


def test_a_one_block_view_of_stride_zero_over_another_layer_is_refused() -> None:
    # a single row's stride is never stepped over and torch accepts 0 there; the exact pair test
    # once divided by it, and the sanitizer let this view of layer a over layer b's bytes through
    raw = torch.zeros(256, dtype=torch.int8)
    layers = {"a": raw[:128].view(2, 64), "b": raw[128:].view(2, 64)}
    with pytest.raises(OverlapError) as caught, sanitize(layers=layers, groups={"a": 0, "b": 0}):
        torch.as_strided(layers["a"], (1, 64), (0, 1), 160)
    [finding] = caught.value.findings
    assert finding.byte == 160
    with sanitize(layers=layers, groups={"a": 0, "b": 0}) as seen:
        torch.as_strided(layers["a"], (1, 64), (0, 1), 32)  # inside its own layer: made
    assert seen.report().ok
