"""make_view against torch's own check, numpy's byte bounds, the meta device and the set_ hazard."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from numpy.lib.array_utils import byte_bounds
from torch.utils._python_dispatch import TorchDispatchMode

import safeview
from safeview import (
    ArgumentError,
    BlockLayout,
    BoundsError,
    Policy,
    Region,
    StridedLayout,
    make_view,
    packed_layouts,
)
from safeview._arith import self_overlap
from safeview.spec import DTYPE_ITEMSIZE
from safeview.testing import capture_events

# GLM-5.2-FP8, one rank: 79 MLA + 22 indexer layers in one block-major group (see FACTS.md).
GLM_NUM_BLOCKS = 42_072
GLM_BLOCK_STRIDE = 3_098_112
GLM_STORAGE = 130_343_768_064


def glm_pages() -> dict[str, int]:
    pages = {}
    for layer in range(79):
        pages[f"model.layers.{layer}.self_attn"] = 36_864
        if layer < 22:
            pages[f"model.layers.{layer}.indexer"] = 8_448
    return pages


def _storage_state(storage: torch.UntypedStorage) -> tuple[int, int]:
    return storage.data_ptr(), storage.nbytes()


def _torch_accepts(
    nbytes: int, shape: tuple[int, ...], strides: tuple[int, ...], offset: int, dtype: torch.dtype
) -> bool:
    probe = torch.empty(0, dtype=dtype).set_(torch.UntypedStorage(nbytes))  # type: ignore[no-untyped-call]
    try:
        torch.as_strided(probe, shape, strides, offset)
    except RuntimeError:
        return False
    return True


def _patterned(nbytes: int) -> torch.Tensor:
    return (torch.arange(nbytes, dtype=torch.int64) % 251).to(torch.int8)


@st.composite
def block_layouts(draw: st.DrawFn) -> BlockLayout:
    num_blocks = draw(st.integers(0, 6))
    page = draw(st.integers(1, 40))
    low = page if num_blocks > 1 else 1
    stride = draw(st.integers(low, low + 40))
    offset = draw(st.integers(0, 300))
    return BlockLayout(
        num_blocks=num_blocks, page_bytes=page, block_stride_bytes=stride, byte_offset=offset
    )


@given(layout=block_layouts(), nbytes=st.integers(0, 320))
def test_strict_accepts_a_block_view_exactly_when_torch_does(
    layout: BlockLayout, nbytes: int
) -> None:
    kv = _patterned(nbytes)
    before = kv.clone()
    state = _storage_state(kv.untyped_storage())
    try:
        view = make_view(kv, layout, name="layer", policy="strict")
    except BoundsError as error:
        assert layout.extent_bytes > nbytes
        # the bytes of the view's span that lie past the end (how far an empty view starts past)
        span = range(layout.byte_offset, layout.extent_bytes)
        past = len([b for b in span if b >= nbytes]) if span else layout.byte_offset - nbytes
        assert error.overflow_bytes == past
        if layout.num_blocks:
            assert not _torch_accepts(
                nbytes, layout.shape, layout.strides, layout.byte_offset, torch.int8
            )
    else:
        assert layout.extent_bytes <= nbytes
        if layout.num_blocks:
            assert _torch_accepts(
                nbytes, layout.shape, layout.strides, layout.byte_offset, torch.int8
            )
            low, high = byte_bounds(view.numpy())
            base = kv.data_ptr()
            assert (low - base, high - base) == (layout.byte_offset, layout.extent_bytes)
            assert view.untyped_storage().data_ptr() == kv.untyped_storage().data_ptr()
        assert tuple(view.shape) == layout.shape
        assert view.stride() == layout.strides
        assert view.storage_offset() == layout.byte_offset
    assert _storage_state(kv.untyped_storage()) == state
    assert torch.equal(kv, before)


@given(
    layout=block_layouts(),
    nbytes=st.integers(0, 320),
    policy=st.sampled_from(list(Policy)),
    region=st.none() | st.tuples(st.integers(0, 160), st.integers(160, 400)),
    through_tensor=st.booleans(),
)
def test_no_policy_ever_moves_resizes_or_writes_the_storage(
    layout: BlockLayout,
    nbytes: int,
    policy: Policy,
    region: tuple[int, int] | None,
    through_tensor: bool,
) -> None:
    kv = _patterned(nbytes)
    before = kv.clone()
    storage = kv.untyped_storage()
    state = _storage_state(storage)
    target: torch.Tensor | torch.UntypedStorage = kv if through_tensor else storage
    try:
        view = make_view(target, layout, policy=policy, region=region)
    except (BoundsError, RuntimeError) as error:
        # strict refuses what breaks a bound; warn and off only what torch itself refuses
        assert policy is Policy.STRICT or layout.extent_bytes > nbytes, error
    else:
        assert view.untyped_storage().data_ptr() == storage.data_ptr()
        if policy is Policy.STRICT:
            assert layout.extent_bytes <= nbytes
            if region is not None:
                assert region[0] <= layout.byte_offset <= layout.extent_bytes <= region[1]
    assert _storage_state(kv.untyped_storage()) == state
    assert torch.equal(kv, before)


@given(layout=block_layouts(), nbytes=st.integers(0, 320))
def test_empty_views_follow_numpys_offset_rule(layout: BlockLayout, nbytes: int) -> None:
    empty = layout.model_copy(update={"num_blocks": 0})
    buffer = bytearray(nbytes)
    try:
        np.ndarray(
            (0, empty.page_bytes),
            np.int8,
            buffer=buffer,
            offset=empty.byte_offset,
            strides=(empty.block_stride_bytes, 1),
        )
        numpy_accepts = True
    except ValueError:
        numpy_accepts = False
    try:
        make_view(
            torch.frombuffer(buffer, dtype=torch.int8)
            if nbytes
            else torch.empty(0, dtype=torch.int8),
            empty,
            policy="strict",
        )
        safeview_accepts = True
    except BoundsError:
        safeview_accepts = False
    assert safeview_accepts == numpy_accepts


@st.composite
def strided_layouts(draw: st.DrawFn) -> StridedLayout:
    # dtypes numpy knows too, so that numpy measures the bytes each view touches
    dtype = draw(st.sampled_from(["int8", "int16", "float16", "float32", "float64", "complex64"]))
    ndim = draw(st.integers(0, 3))
    shape = draw(st.lists(st.integers(0, 4), min_size=ndim, max_size=ndim))
    strides = draw(st.lists(st.integers(0, 24), min_size=ndim, max_size=ndim))
    if self_overlap(shape, strides) is not None:
        strides = [0] * ndim
        reach = 1
        for axis in sorted(range(ndim), key=lambda a: -a):
            strides[axis] = reach
            reach *= max(shape[axis], 1)
    offset = draw(st.integers(0, 40)) * DTYPE_ITEMSIZE[dtype]
    return StridedLayout(shape=shape, strides=strides, byte_offset=offset, dtype=dtype)


@given(layout=strided_layouts(), nbytes=st.integers(0, 400), through_tensor=st.booleans())
def test_strict_accepts_a_typed_view_exactly_when_torch_does(
    layout: StridedLayout, nbytes: int, through_tensor: bool
) -> None:
    raw = _patterned(nbytes)
    before = raw.clone()
    target: torch.Tensor | torch.UntypedStorage = raw if through_tensor else raw.untyped_storage()
    dtype = getattr(torch, layout.dtype)
    nonempty = 0 not in layout.shape
    try:
        view = make_view(target, layout, policy="strict")
    except BoundsError:
        assert layout.extent_bytes > nbytes
        if nonempty:
            assert not _torch_accepts(
                nbytes, layout.shape, layout.strides, layout.byte_offset // layout.itemsize, dtype
            )
    else:
        assert layout.extent_bytes <= nbytes
        assert view.dtype == dtype
        assert tuple(view.shape) == layout.shape
        if nonempty:
            assert _torch_accepts(
                nbytes, layout.shape, layout.strides, layout.byte_offset // layout.itemsize, dtype
            )
            low, high = byte_bounds(view.numpy())
            base = raw.data_ptr()
            assert layout.byte_offset <= low - base < high - base <= layout.extent_bytes
            assert high - base == layout.extent_bytes
    assert torch.equal(raw, before)


def test_bfloat16_view_has_the_right_dtype_and_bytes() -> None:
    kv = torch.arange(64, dtype=torch.int8)
    layout = StridedLayout(shape=(3,), strides=(2,), byte_offset=8, dtype="bfloat16")
    view = make_view(kv, layout)
    assert view.dtype == torch.bfloat16
    assert torch.equal(view.view(torch.int16), kv[8:20].view(torch.int16)[::2])


def test_view_of_a_tensor_counts_offsets_from_byte_zero_of_its_storage() -> None:
    kv = torch.zeros(256, dtype=torch.int8)
    tail = kv[128:]
    layout = BlockLayout(num_blocks=2, page_bytes=8, block_stride_bytes=16, byte_offset=32)
    view = make_view(tail, layout)
    assert view.storage_offset() == 32
    view.fill_(1)
    assert kv[32:40].eq(1).all()
    assert kv[48:56].eq(1).all()
    assert int(kv.sum()) == 16


def test_typed_view_of_an_int8_cache_reads_the_same_bytes() -> None:
    kv = torch.arange(64, dtype=torch.int8)
    layout = StridedLayout(shape=(2, 4), strides=(8, 1), byte_offset=16, dtype=torch.float16)
    view = make_view(kv, layout)
    expected = kv[16:48].view(torch.float16).reshape(2, 8)[:, :4]
    assert torch.equal(view, expected)


def test_glm_packed_cache_on_meta_all_101_views_pass() -> None:
    kv = torch.empty(GLM_STORAGE, dtype=torch.int8, device="meta")
    layouts = packed_layouts(glm_pages(), num_blocks=GLM_NUM_BLOCKS)
    assert len(layouts) == 101
    assert {layout.block_stride_bytes for layout in layouts.values()} == {GLM_BLOCK_STRIDE}
    views = {name: make_view(kv, layout, name=name) for name, layout in layouts.items()}
    last = layouts["model.layers.78.self_attn"]
    assert last.extent_bytes == GLM_STORAGE
    assert all(view.device.type == "meta" for view in views.values())
    assert views["model.layers.3.indexer"].shape == (GLM_NUM_BLOCKS, 8_448)
    assert kv.untyped_storage().nbytes() == GLM_STORAGE


def test_glm_one_block_too_many_is_caught_where_meta_torch_says_nothing() -> None:
    kv = torch.empty(GLM_STORAGE, dtype=torch.int8, device="meta")
    name = "model.layers.78.self_attn"
    layout = packed_layouts(glm_pages(), num_blocks=GLM_NUM_BLOCKS + 1)[name]
    # torch on meta creates the view without a word.
    silent = torch.as_strided(kv, layout.shape, layout.strides, layout.byte_offset)
    assert silent.shape[0] == GLM_NUM_BLOCKS + 1
    with pytest.raises(BoundsError) as caught:
        make_view(kv, layout, name=name)
    error = caught.value
    assert error.name == name
    assert error.limit_bytes == GLM_STORAGE
    assert error.overflow_bytes == GLM_BLOCK_STRIDE
    assert error.extent_bytes == GLM_STORAGE + GLM_BLOCK_STRIDE
    assert error.layout == layout
    assert (
        f"view '{name}' needs bytes [{layout.byte_offset:,}, {GLM_STORAGE + GLM_BLOCK_STRIDE:,}) "
        f"but the storage has {GLM_STORAGE:,} bytes ({GLM_BLOCK_STRIDE:,} bytes past the end)"
    ) in str(error)


# -- the set_ hazard -------------------------------------------------------------------------

TOO_LONG = BlockLayout(num_blocks=5, page_bytes=16, block_stride_bytes=16, byte_offset=0)
EMPTY_PAST = BlockLayout(num_blocks=0, page_bytes=8, block_stride_bytes=8, byte_offset=10**12)


def test_four_argument_set_reallocates_the_storage_that_safeview_leaves_alone() -> None:
    # The hazard itself: torch grows a resizable storage and moves its data.
    victim = torch.zeros(64, dtype=torch.int8)
    storage = victim.untyped_storage()
    pointer = storage.data_ptr()
    torch.empty(0, dtype=torch.int8).set_(storage, 0, TOO_LONG.shape, TOO_LONG.strides)
    assert storage.nbytes() == TOO_LONG.extent_bytes
    assert storage.data_ptr() != pointer


@pytest.mark.parametrize("policy", list(Policy))
def test_the_set_hazard_layout_leaves_the_storage_untouched_under_every_policy(
    policy: Policy,
) -> None:
    kv = _patterned(64)
    before = kv.clone()
    state = _storage_state(kv.untyped_storage())
    expected: type[Exception] = RuntimeError if policy is Policy.OFF else BoundsError
    with pytest.raises(expected):
        make_view(kv, TOO_LONG, policy=policy)
    assert _storage_state(kv.untyped_storage()) == state
    assert torch.equal(kv, before)


@pytest.mark.parametrize("policy", list(Policy))
def test_meta_storage_never_grows_under_any_policy(policy: Policy) -> None:
    kv = torch.empty(64, dtype=torch.int8, device="meta")
    if policy is Policy.STRICT:
        with pytest.raises(BoundsError):
            make_view(kv, TOO_LONG, policy=policy)
    else:
        view = make_view(kv, TOO_LONG, policy=policy)
        assert view.shape == (5, 16)
    assert kv.untyped_storage().nbytes() == 64


# -- the one placing set_: make_view's four-argument set_, once a view is proven to fit ---------
#
# make_view makes a view over a bare storage, or over a tensor of another dtype, with
# `torch.empty(0).set_(storage, offset, shape, strides)` when its extent is at most the
# storage's size (safeview._torch.view_of). torch grows a storage only for a view that needs
# more bytes than it has; these tests pin that, on cpu and meta, under every policy.


class _OpLog(TorchDispatchMode):  # type: ignore[no-untyped-call,unused-ignore]
    """Records every aten op of this thread and runs it unchanged (the real dispatcher)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call,unused-ignore]
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


PLACING_SET = "aten.set_.source_Storage_storage_offset"


def _state(tensor: torch.Tensor) -> tuple[int, int, int]:
    """What must not change: the storage object (its StorageImpl), its size and its address."""
    storage = tensor.untyped_storage()
    return storage._cdata, storage.nbytes(), storage.data_ptr()


@st.composite
def any_layouts(draw: st.DrawFn) -> BlockLayout | StridedLayout:
    if draw(st.booleans()):
        return draw(block_layouts())
    dtype = draw(st.sampled_from(["int8", "float16", "float32", "complex64"]))
    itemsize = DTYPE_ITEMSIZE[dtype]
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=1, max_size=3)))
    strides = tuple(draw(st.integers(0, 12)) for _ in shape)
    assume(self_overlap(shape, strides) is None)
    return StridedLayout(
        shape=shape, strides=strides, byte_offset=itemsize * draw(st.integers(0, 40)), dtype=dtype
    )


@settings(max_examples=400)
@given(
    layout=any_layouts(),
    slack=st.sampled_from([-1, 0, 0, 1, 7]),  # bytes of storage beyond the view's extent
    device=st.sampled_from(["cpu", "meta"]),
    target=st.sampled_from(["storage", "int8", "float16", "negative"]),
    policy=st.sampled_from(list(Policy)),
)
def test_making_a_view_never_resizes_moves_or_swaps_the_storage_or_its_other_tensors(
    layout: BlockLayout | StridedLayout, slack: int, device: str, target: str, policy: Policy
) -> None:
    nbytes = max(0, layout.extent_bytes + slack)
    nbytes += -nbytes % 4  # whole float16 / float32 elements for the typed targets
    kv = torch.zeros(nbytes, dtype=torch.int8, device=device)
    if device == "cpu":
        kv.copy_(_patterned(nbytes))
    storage = kv.untyped_storage()
    others = [kv[nbytes // 2 :], kv.view(torch.int16)[: nbytes // 4]]  # sharing the storage
    before = [_state(tensor) for tensor in (kv, *others)]
    contents = kv.clone()
    given_target: torch.Tensor | torch.UntypedStorage = storage
    if target == "int8":
        given_target = kv
    elif target == "float16":
        given_target = kv.view(torch.float16)
    elif target == "negative":
        given_target = kv.view(torch.float16)._neg_view()
    fits = layout.extent_bytes <= nbytes
    with _OpLog() as seen:
        try:
            view = make_view(given_target, layout, policy=policy)
        except (BoundsError, RuntimeError):
            assert not fits  # only a view that does not fit is ever refused
            view = None
    assert [_state(tensor) for tensor in (kv, *others)] == before
    if device == "cpu":
        assert torch.equal(kv, contents)
    if not fits:
        assert PLACING_SET not in seen.ops  # never reached by a view that does not fit
    if view is not None:
        assert view.untyped_storage()._cdata == storage._cdata
        assert view.dtype == getattr(torch, layout.dtype)
        assert (tuple(view.shape), view.stride()) == (layout.shape, layout.strides)
        assert view.storage_offset() == layout.element_offset
        assert not view.is_neg()
        assert not view.is_conj()


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("policy", list(Policy))
@pytest.mark.parametrize(
    ("layout", "nbytes"),
    [
        (BlockLayout(num_blocks=4, page_bytes=16, block_stride_bytes=16), 64),  # exactly fits
        (BlockLayout(num_blocks=2, page_bytes=8, block_stride_bytes=32, byte_offset=24), 64),
        (BlockLayout(num_blocks=0, page_bytes=16, block_stride_bytes=16, byte_offset=64), 64),
        (BlockLayout(num_blocks=0, page_bytes=16, block_stride_bytes=16), 0),  # empty storage
        (StridedLayout(shape=(16, 0), strides=(16, 1), byte_offset=64), 64),  # zero-size at end
        (StridedLayout(shape=(3, 8), strides=(8, 1), byte_offset=16, dtype="float16"), 64),
    ],
    ids=["exact", "gapped-exact", "empty-at-end", "empty-storage", "zero-size", "float16-exact"],
)
def test_a_view_that_fits_is_placed_by_one_set_and_the_storage_stays_as_it_was(
    layout: BlockLayout | StridedLayout, nbytes: int, policy: Policy, device: str
) -> None:
    kv = torch.zeros(nbytes, dtype=torch.int8, device=device)
    earlier = make_view(kv.untyped_storage(), layout, policy=policy)  # another tensor over it
    state = _state(kv)
    with _OpLog() as seen:
        view = make_view(kv.untyped_storage(), layout, policy=policy)
    assert seen.ops == ["aten.empty.memory_format", PLACING_SET]  # one placement, no resize
    assert _state(kv) == state
    assert _state(earlier) == state
    assert view.untyped_storage()._cdata == kv.untyped_storage()._cdata
    assert (tuple(view.shape), view.stride(), view.storage_offset()) == (
        layout.shape, layout.strides, layout.element_offset,
    )  # fmt: skip
    if device == "cpu" and view.numel():
        view.fill_(7)  # the view writes into the cache's own bytes
        first = kv[layout.byte_offset : layout.byte_offset + view.element_size()]
        assert first.view(view.dtype).item() == 7


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("policy", [Policy.WARN, Policy.OFF])
@pytest.mark.parametrize(
    ("layout", "nbytes"),
    [
        (TOO_LONG, 64),  # one page past the end
        (TOO_LONG, 79),  # one byte past the end
        (EMPTY_PAST, 64),  # an empty view far past the end
        (StridedLayout(shape=(16, 0), strides=(16, 1), byte_offset=10**12), 64),
    ],
    ids=["page-past", "byte-past", "empty-past", "zero-size-past"],
)
def test_a_view_that_does_not_fit_never_reaches_the_placing_set(
    layout: BlockLayout | StridedLayout, nbytes: int, policy: Policy, device: str
) -> None:
    kv = torch.zeros(nbytes, dtype=torch.int8, device=device)
    state = _state(kv)
    with _OpLog() as seen:
        try:
            make_view(kv.untyped_storage(), layout, policy=policy)
        except (BoundsError, RuntimeError):
            assert (device, bool(layout.nbytes)) == ("cpu", True)  # torch's refusal, on cpu
    assert PLACING_SET not in seen.ops
    assert "aten.as_strided.default" in seen.ops
    assert _state(kv) == state


def test_torch_grows_a_storage_with_that_set_only_for_a_view_that_does_not_fit() -> None:
    # The fact the placing set_ rests on, checked on this torch: a view that fits (exactly, or
    # empty anywhere) leaves the storage alone; one byte more grows it.
    for device in ("cpu", "meta"):
        for offset, shape, grows in (
            (0, (4, 16), False), (48, (1, 16), False), (64, (0, 16), False),
            (10**12, (0, 16), False), (10**12, (16, 0), False), (1, (4, 16), True),
        ):  # fmt: skip
            kv = torch.zeros(64, dtype=torch.int8, device=device)
            state = _state(kv)
            torch.empty(0, dtype=torch.int8, device=device).set_(
                kv.untyped_storage(), offset, shape, (16, 1)
            )
            assert (_state(kv) != state) == grows, (device, offset, shape)


# -- the policy table ------------------------------------------------------------------------


@pytest.fixture
def events() -> Iterator[list[dict[str, object]]]:
    with capture_events() as captured:
        yield captured


def _violations(events: list[dict[str, object]]) -> list[dict[str, object]]:
    return [e for e in events if e["event"] == "bounds_violation"]


def test_strict_past_storage_raises_before_torch_and_logs_an_error(
    events: list[dict[str, object]],
) -> None:
    kv = torch.empty(64, dtype=torch.int8, device="meta")  # torch would accept it here
    with pytest.raises(BoundsError) as caught:
        make_view(kv, TOO_LONG, name="l0", policy="strict")
    assert caught.value.__cause__ is None
    assert caught.value.check == "storage"
    [event] = _violations(events)
    assert event["level"] == "error"
    assert event["check"] == "storage"
    assert event["overflow_bytes"] == 16
    assert event["slack_bytes"] == -16
    assert not [e for e in events if e["event"] == "view_created"]


def test_warn_past_storage_on_cpu_logs_then_chains_torchs_refusal(
    events: list[dict[str, object]],
) -> None:
    kv = torch.zeros(64, dtype=torch.int8)
    with pytest.raises(BoundsError) as caught:
        make_view(kv, TOO_LONG, name="l0", policy="warn")
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert "out of bounds for storage" in str(caught.value.__cause__)
    [event] = _violations(events)
    assert event["level"] == "warning"
    assert event["policy"] == "warn"


def test_warn_past_storage_on_meta_logs_and_returns_the_view(
    events: list[dict[str, object]],
) -> None:
    kv = torch.empty(64, dtype=torch.int8, device="meta")
    view = make_view(kv, TOO_LONG, name="l0", policy="warn")
    assert view.shape == (5, 16)
    [event] = _violations(events)
    assert event["level"] == "warning"
    assert [e["event"] for e in events] == ["bounds_violation", "view_created"]


def test_off_past_storage_checks_nothing_and_torch_decides(
    events: list[dict[str, object]],
) -> None:
    with pytest.raises(RuntimeError, match="out of bounds for storage") as caught:
        make_view(torch.zeros(64, dtype=torch.int8), TOO_LONG, policy="off")
    assert not isinstance(caught.value, BoundsError)
    meta = torch.empty(64, dtype=torch.int8, device="meta")
    assert make_view(meta, TOO_LONG, policy="off").shape == (5, 16)
    assert not _violations(events)


INSIDE = BlockLayout(num_blocks=2, page_bytes=8, block_stride_bytes=16, byte_offset=16)


def test_strict_outside_region_raises_naming_the_region(events: list[dict[str, object]]) -> None:
    kv = torch.zeros(64, dtype=torch.int8)
    with pytest.raises(BoundsError) as caught:
        make_view(kv, INSIDE, name="l1", region=(16, 32), policy="strict")
    error = caught.value
    assert error.check == "region"
    assert error.limit_bytes == 32
    assert error.overflow_bytes == 8
    assert "its region is [16, 32) (8 bytes past its end)" in str(error)
    [event] = _violations(events)
    assert event["region"] == [16, 32]
    assert event["check"] == "region"


def test_region_start_is_a_bound_too() -> None:
    kv = torch.zeros(64, dtype=torch.int8)
    with pytest.raises(BoundsError, match=r"\(4 bytes before its start\)"):
        make_view(kv, INSIDE, region=(20, 64))


def test_warn_outside_region_logs_and_returns_the_view(events: list[dict[str, object]]) -> None:
    kv = torch.zeros(64, dtype=torch.int8)
    view = make_view(kv, INSIDE, region=(16, 32), policy="warn")
    assert view.shape == (2, 8)
    [event] = _violations(events)
    assert event["level"] == "warning"


def test_off_outside_region_checks_nothing(events: list[dict[str, object]]) -> None:
    kv = torch.zeros(64, dtype=torch.int8)
    assert make_view(kv, INSIDE, region=(16, 32), policy="off").shape == (2, 8)
    assert not _violations(events)


def test_region_that_holds_the_view_passes() -> None:
    kv = torch.zeros(64, dtype=torch.int8)
    assert make_view(kv, INSIDE, region=(16, 40)).shape == (2, 8)


def test_empty_view_past_the_storage_under_each_policy(events: list[dict[str, object]]) -> None:
    kv = torch.zeros(64, dtype=torch.int8)
    with pytest.raises(BoundsError, match="empty view 'e' starts at byte 1,000,000,000,000"):
        make_view(kv, EMPTY_PAST, name="e", policy="strict")
    assert make_view(kv, EMPTY_PAST, name="e", policy="warn").shape == (0, 8)
    assert make_view(kv, EMPTY_PAST, name="e", policy="off").shape == (0, 8)
    assert [e["level"] for e in _violations(events)] == ["error", "warning"]


def test_empty_view_at_the_very_end_is_fine() -> None:
    kv = torch.zeros(64, dtype=torch.int8)
    layout = EMPTY_PAST.model_copy(update={"byte_offset": 64})
    assert make_view(kv, layout).shape == (0, 8)


# -- bad arguments ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "target",
    [None, b"bytes", np.zeros(8, np.int8), [0] * 8, torch.zeros(8).to_sparse()],
    ids=["None", "bytes", "ndarray", "list", "sparse"],
)
def test_wrong_target_types_are_refused(target: object) -> None:
    with pytest.raises(ArgumentError, match="target must be"):
        make_view(target, INSIDE)  # type: ignore[arg-type]


def test_deprecated_typed_storage_is_refused_with_a_hint() -> None:
    kv = torch.zeros(64, dtype=torch.int8)
    with pytest.warns(UserWarning, match="TypedStorage is deprecated"):
        typed = kv.storage()  # type: ignore[no-untyped-call]
    with pytest.raises(ArgumentError, match=r"got TypedStorage \(pass its .untyped\(\)\)"):
        make_view(typed, INSIDE)


@pytest.mark.parametrize(
    "layout",
    [None, {"num_blocks": 1, "page_bytes": 1, "block_stride_bytes": 1}, (2, 8)],
    ids=["None", "dict", "tuple"],
)
def test_wrong_layout_types_are_refused(layout: object) -> None:
    with pytest.raises(ArgumentError, match="layout must be a safeview BlockLayout"):
        make_view(torch.zeros(8, dtype=torch.int8), layout)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("region", "message"),
    [
        ((5, 1), r"region=\(5, 1\) .*: end_byte=1 is before start_byte=5"),
        ((-1, 4), r"region=\(-1, 4\) .*start_byte: Input should be greater than or equal to 0"),
        ((0, 2**63), r"end_byte: Input should be less than or equal to 9223372036854775807"),
        ((1, 2, 3), r"region=\(1, 2, 3\) .*a region is \(start_byte, end_byte\); got 3 values"),
        ((True, 8), r"region=\(True, 8\) .*start_byte"),
        (7, r"region=7 is not a byte range"),
        ("ab", r"region='ab' is not a byte range"),
    ],
    ids=["reversed", "negative", "past-int64", "three", "bool", "int", "str"],
)
def test_a_region_that_is_not_a_byte_range_is_an_argument_error(
    region: object, message: str
) -> None:
    kv = torch.zeros(64, dtype=torch.int8)
    for policy in Policy:  # refused as an argument, whatever the policy
        with pytest.raises(ArgumentError, match=message):
            make_view(kv, INSIDE, region=region, policy=policy)  # type: ignore[arg-type]


def test_a_region_may_be_a_region_a_pair_or_a_mapping_of_its_fields() -> None:
    kv = torch.zeros(64, dtype=torch.int8)
    for region in (Region(start_byte=16, end_byte=48), (16, 48), [16, 48],
                   {"start_byte": 16, "end_byte": 48}):  # fmt: skip
        assert make_view(kv, INSIDE, region=region).shape == (2, 8)  # type: ignore[arg-type]


def test_unknown_policy_argument_is_a_config_error() -> None:
    with pytest.raises(safeview.ConfigError, match="policy='lenient' is not a valid value"):
        make_view(torch.zeros(64, dtype=torch.int8), INSIDE, policy="lenient")  # type: ignore[arg-type]


# Where safeview may call the four-argument set_, which grows a storage too small for the view,
# and why that never happens there.
PLACING_SET_SITES = {
    # make_view's view, only under `if fits:`, the extent proven to be at most the storage size
    ("_torch.py", "view_of"),
    # the guard's meta stand-ins of an op's arguments, on meta storages it has just made
    ("_torch_dispatch.py", "_meta_like"),
}


def test_the_four_argument_set_is_called_only_where_the_view_is_proven_to_fit() -> None:
    import ast
    from pathlib import Path

    sites = []
    for path in Path(safeview.__file__).parent.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "set_"
                    and len(node.args) + len(node.keywords) > 1
                ):
                    sites.append((path.name, function.name, node))
    assert {(file, function) for file, function, _ in sites} == PLACING_SET_SITES
    # in view_of, the one call is what `if fits:` returns
    [(_, _, call)] = [site for site in sites if site[1] == "view_of"]
    view_of = next(
        node
        for node in ast.walk(ast.parse(Path(safeview._torch.__file__).read_text()))
        if isinstance(node, ast.FunctionDef) and node.name == "view_of"
    )
    guards = [
        node
        for node in ast.walk(view_of)
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "fits"
    ]
    returned = [guard.body[0].value for guard in guards if isinstance(guard.body[0], ast.Return)]
    assert [ast.dump(node) for node in returned if node is not None] == [ast.dump(call)]


def test_a_conjugate_or_negative_view_target_does_not_change_the_bytes_read() -> None:
    values = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    layout = StridedLayout(shape=(2,), strides=(1,), dtype="complex64")
    assert values.conj().is_conj()
    assert make_view(values.conj(), layout).tolist() == values.tolist()
    floats = torch.tensor([1.0, -2.0])
    negative = floats._neg_view()
    assert negative.is_neg()
    plain = StridedLayout(shape=(2,), strides=(1,), dtype="float32")
    assert make_view(negative, plain).tolist() == [1.0, -2.0]


def test_a_failing_log_handler_never_changes_the_outcome() -> None:
    class Broken(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            raise RuntimeError("handler down")

        def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802
            raise RuntimeError("and its error handler too")

    logger = logging.getLogger("safeview")
    handler = Broken()
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        kv = torch.zeros(64, dtype=torch.int8)
        fits = BlockLayout(num_blocks=2, page_bytes=16, block_stride_bytes=32)
        assert make_view(kv, fits).shape == (2, 16)  # view_created failed to log; view made
        with pytest.raises(BoundsError):  # not the handler's RuntimeError
            make_view(kv, fits.model_copy(update={"num_blocks": 3}))
    finally:
        logger.removeHandler(handler)
