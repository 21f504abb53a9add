"""Layout specs: what is accepted, what is refused and with which message, and the extent."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError
from torch._prims_common import compute_required_storage_length

import safeview
from safeview import ArgumentError, BlockLayout, Region, StridedLayout, packed_layouts
from safeview._arith import INT64_MAX, self_overlap
from safeview.spec import DTYPE_ITEMSIZE

VALID = {"num_blocks": 4, "page_bytes": 16, "block_stride_bytes": 32, "byte_offset": 8}


def _block(**changes: Any) -> BlockLayout:
    return BlockLayout(**{**VALID, **changes})


def test_block_layout_extent_is_the_documented_formula() -> None:
    layout = _block()
    assert layout.extent_bytes == 8 + (4 - 1) * 32 + 16
    assert layout.shape == (4, 16)
    assert layout.strides == (32, 1)


def test_empty_block_layout_extent_is_its_offset() -> None:
    assert _block(num_blocks=0, byte_offset=1000).extent_bytes == 1000


@pytest.mark.parametrize(
    "scalar",
    [np.int64(4), np.uint32(4), np.int8(4), torch.tensor(4), torch.tensor(4, dtype=torch.int32)],
    ids=repr,
)
def test_integer_scalars_of_numpy_and_torch_are_accepted(scalar: object) -> None:
    layout = _block(num_blocks=scalar)
    assert layout.num_blocks == 4
    assert type(layout.num_blocks) is int


@pytest.mark.parametrize("field", ["num_blocks", "page_bytes", "block_stride_bytes", "byte_offset"])
@pytest.mark.parametrize(
    "value",
    [True, False, np.bool_(True), torch.tensor(True), 4.0, np.float32(4), "4", None, b"4", [4]],
    ids=repr,
)
def test_non_integers_are_refused_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValidationError) as caught:
        _block(**{field: value})
    errors = caught.value.errors()
    assert [e["loc"] for e in errors] == [(field,)]
    assert errors[0]["type"] == "integer_type"
    assert f"input_value={value!r}" in str(caught.value)
    assert field in str(caught.value)


@pytest.mark.parametrize(
    ("field", "value", "limit_words"),
    [
        ("num_blocks", -1, "greater than or equal to 0"),
        ("page_bytes", 0, "greater than or equal to 1"),
        ("block_stride_bytes", 0, "greater than or equal to 1"),
        ("byte_offset", -8, "greater than or equal to 0"),
        ("byte_offset", 2**63, "less than or equal to 9223372036854775807"),
        ("num_blocks", 2**64, "less than or equal to 9223372036854775807"),
    ],
)
def test_out_of_range_values_name_field_value_and_limit(
    field: str, value: int, limit_words: str
) -> None:
    with pytest.raises(ValidationError) as caught:
        _block(**{field: value})
    message = str(caught.value)
    assert caught.value.errors()[0]["loc"] == (field,)
    assert limit_words in message
    assert str(value) in message


def test_extent_past_int64_is_refused_with_both_numbers() -> None:
    with pytest.raises(ValidationError) as caught:
        _block(num_blocks=2**62, block_stride_bytes=4, page_bytes=4, byte_offset=2**62)
    message = str(caught.value)
    assert str(INT64_MAX) in message
    assert str(2**62 + (2**62 - 1) * 4 + 4) in message


def test_largest_extent_that_fits_int64_is_accepted() -> None:
    layout = _block(num_blocks=1, page_bytes=1, byte_offset=INT64_MAX - 1)
    assert layout.extent_bytes == INT64_MAX


def test_pages_that_overlap_each_other_are_refused_on_the_stride_field() -> None:
    with pytest.raises(ValidationError) as caught:
        _block(page_bytes=64, block_stride_bytes=32)
    error = caught.value.errors()[0]
    assert error["loc"] == ("block_stride_bytes",)
    assert "block_stride_bytes=32 smaller than page_bytes=64" in error["msg"]


@pytest.mark.parametrize("num_blocks", [0, 1])
def test_stride_below_page_is_harmless_with_at_most_one_block(num_blocks: int) -> None:
    assert (
        _block(num_blocks=num_blocks, page_bytes=64, block_stride_bytes=1).num_blocks == num_blocks
    )


def test_unknown_fields_are_refused() -> None:
    with pytest.raises(ValidationError) as caught:
        BlockLayout(**VALID, page_size=16)  # type: ignore[call-arg]
    assert caught.value.errors()[0]["type"] == "extra_forbidden"


def test_layouts_are_frozen_and_hashable() -> None:
    layout = _block()
    with pytest.raises(ValidationError):
        layout.num_blocks = 5  # type: ignore[misc]
    assert hash(layout) == hash(_block())
    assert layout == _block()
    assert layout != _block(num_blocks=5)


def test_block_layout_json_roundtrip_and_schema() -> None:
    layout = _block()
    assert BlockLayout.model_validate_json(layout.model_dump_json()) == layout
    schema = BlockLayout.model_json_schema()
    assert schema["additionalProperties"] is False
    assert schema["properties"]["page_bytes"]["minimum"] == 1


@given(
    num_blocks=st.integers(0, 2**20),
    page=st.integers(1, 2**20),
    gap=st.integers(0, 2**20),
    offset=st.integers(0, 2**40),
)
def test_block_extent_matches_torch_formula(
    num_blocks: int, page: int, gap: int, offset: int
) -> None:
    layout = BlockLayout(
        num_blocks=num_blocks, page_bytes=page, block_stride_bytes=page + gap, byte_offset=offset
    )
    expected = compute_required_storage_length(layout.shape, layout.strides, offset)
    assert layout.extent_bytes == (offset if num_blocks == 0 else expected)
    assert layout.to_strided().extent_bytes == layout.extent_bytes


def test_dtype_item_sizes_match_torch() -> None:
    for name, itemsize in DTYPE_ITEMSIZE.items():
        dtype = getattr(torch, name, None)
        if dtype is not None:
            assert dtype.itemsize == itemsize, name


@pytest.mark.parametrize("dtype", [torch.float16, "torch.float16", "float16", " float16 "])
def test_strided_dtype_spellings_are_one_dtype(dtype: str | torch.dtype) -> None:
    layout = StridedLayout(shape=(2, 3), strides=(3, 1), byte_offset=4, dtype=dtype)
    assert layout.dtype == "float16"
    assert layout.itemsize == 2
    assert layout.extent_bytes == 4 + 2 * 6


def test_strided_refuses_unknown_dtype() -> None:
    with pytest.raises(ValidationError) as caught:
        StridedLayout(shape=(2,), strides=(1,), dtype="float13")
    assert caught.value.errors()[0]["loc"] == ("dtype",)


def test_strided_refuses_misaligned_offset() -> None:
    with pytest.raises(ValidationError, match="byte_offset=6 is not a multiple of the 4-byte"):
        StridedLayout(shape=(2,), strides=(1,), byte_offset=6, dtype="float32")


def test_strided_refuses_mismatched_ranks() -> None:
    with pytest.raises(ValidationError, match="strides has 1 entries but shape"):
        StridedLayout(shape=(2, 2), strides=(1,))


def test_strided_refuses_negative_stride_and_names_its_index() -> None:
    with pytest.raises(ValidationError) as caught:
        StridedLayout(shape=(2, 2), strides=(2, -1))
    assert caught.value.errors()[0]["loc"] == ("strides", 1)


def test_strided_accepts_torch_size_and_numpy_scalars() -> None:
    layout = StridedLayout(
        shape=torch.Size([2, 3]), strides=[np.int64(3), np.int64(1)], dtype=torch.int8
    )
    assert layout.shape == (2, 3)
    assert layout.strides == (3, 1)


def test_strided_refuses_self_overlap_naming_the_axis() -> None:
    with pytest.raises(ValidationError, match=r"axis 0 \(size 3, stride 2\)"):
        StridedLayout(shape=(3, 4), strides=(2, 1))


def test_strided_stride_in_bytes_past_int64_is_refused() -> None:
    with pytest.raises(ValidationError, match="int64"):
        StridedLayout(shape=(2,), strides=(2**62,), dtype="float64")


def _element_offsets(shape: tuple[int, ...], strides: tuple[int, ...]) -> list[int]:
    return [
        sum(i * s for i, s in zip(index, strides))
        for index in itertools.product(*(range(n) for n in shape))
    ]


@given(
    shape=st.lists(st.integers(0, 4), min_size=1, max_size=4),
    strides=st.lists(st.integers(0, 12), min_size=4, max_size=4),
)
def test_self_overlap_rule_never_accepts_a_view_that_touches_an_element_twice(
    shape: list[int], strides: list[int]
) -> None:
    strides = strides[: len(shape)]
    offsets = _element_offsets(tuple(shape), tuple(strides))
    if self_overlap(shape, strides) is None:
        assert len(offsets) == len(set(offsets))


@given(num_blocks=st.integers(0, 6), page=st.integers(1, 9), stride=st.integers(1, 12))
def test_self_overlap_rule_is_exact_for_block_layouts(
    num_blocks: int, page: int, stride: int
) -> None:
    offsets = _element_offsets((num_blocks, page), (stride, 1))
    distinct = len(offsets) == len(set(offsets))
    assert (self_overlap((num_blocks, page), (stride, 1)) is None) == distinct


@given(
    shape=st.lists(st.integers(0, 5), min_size=0, max_size=3),
    strides=st.lists(st.integers(0, 40), min_size=3, max_size=3),
    dtype=st.sampled_from(["int8", "float16", "float32", "float64"]),
    offset_items=st.integers(0, 50),
)
def test_strided_extent_matches_torch_formula(
    shape: list[int], strides: list[int], dtype: str, offset_items: int
) -> None:
    strides = strides[: len(shape)]
    if self_overlap(shape, strides) is not None:
        return
    itemsize = DTYPE_ITEMSIZE[dtype]
    layout = StridedLayout(
        shape=shape, strides=strides, byte_offset=offset_items * itemsize, dtype=dtype
    )
    elements = compute_required_storage_length(shape, strides, offset_items)
    expected = offset_items * itemsize if 0 in shape else elements * itemsize
    assert layout.extent_bytes == expected


def test_region_from_pair_and_refuses_reversed() -> None:
    assert Region.coerce((4, 8)) == Region(start_byte=4, end_byte=8)
    with pytest.raises(ValidationError, match="end_byte=4 is before start_byte=8"):
        Region.coerce((8, 4))
    with pytest.raises(ValidationError, match="got 3 values"):
        Region.coerce((1, 2, 3))
    with pytest.raises(ValidationError) as caught:
        Region.coerce((True, 8))
    assert caught.value.errors()[0]["loc"] == ("start_byte",)


def test_packed_layouts_put_each_page_after_the_last() -> None:
    layouts = packed_layouts({"mla": 41_984, "idx": 8_448}, num_blocks=3)
    assert layouts["mla"].byte_offset == 0
    assert layouts["idx"].byte_offset == 41_984
    assert {layout.block_stride_bytes for layout in layouts.values()} == {41_984 + 8_448}


@pytest.mark.parametrize("value", [torch.tensor([4]), torch.tensor([[4]]), np.array([4])])
def test_one_element_tensors_and_arrays_are_not_integer_scalars(value: object) -> None:
    with pytest.raises(ValidationError, match="num_blocks"):
        BlockLayout(num_blocks=value, page_bytes=8, block_stride_bytes=8)  # type: ignore[arg-type]
    assert (
        BlockLayout(num_blocks=torch.tensor(4), page_bytes=8, block_stride_bytes=8).num_blocks == 4
    )


def test_nbytes_counts_the_elements_held_not_the_span() -> None:
    typed = StridedLayout(shape=(2, 3, 4), strides=(64, 8, 1), dtype="float32")
    assert typed.nbytes == 2 * 3 * 4 * 4
    assert typed.extent_bytes == 4 * (64 + 2 * 8 + 3 + 1)
    assert StridedLayout(shape=(0, 5), strides=(5, 1), dtype="float16").nbytes == 0
    block = BlockLayout(num_blocks=3, page_bytes=16, block_stride_bytes=64)
    assert block.nbytes == 48
    assert block.extent_bytes == 2 * 64 + 16


def test_a_layout_built_again_with_the_same_ints_is_remembered_and_handed_back() -> None:
    from safeview import spec

    spec._INTERNED.clear()
    spec._SEEN.clear()
    first = BlockLayout(num_blocks=7, page_bytes=64, block_stride_bytes=128, byte_offset=64)
    assert spec._INTERNED == {}  # built once: nothing kept for the collector to scan
    again = BlockLayout(num_blocks=7, page_bytes=64, block_stride_bytes=128, byte_offset=64)
    assert again == first
    for _ in range(3):  # from then on, the same frozen instance
        assert (
            BlockLayout(num_blocks=7, page_bytes=64, block_stride_bytes=128, byte_offset=64)
            is again
        )
    other_order = BlockLayout(byte_offset=64, block_stride_bytes=128, page_bytes=64, num_blocks=7)
    assert other_order == first


def test_the_interned_layouts_never_let_a_refused_value_through() -> None:
    BlockLayout(num_blocks=1, page_bytes=8, block_stride_bytes=8)  # 1 is remembered...
    with pytest.raises(ValidationError, match="num_blocks"):
        BlockLayout(num_blocks=True, page_bytes=8, block_stride_bytes=8)  # ...True is not 1
    with pytest.raises(ValidationError, match="num_blocks"):
        BlockLayout(num_blocks=1.0, page_bytes=8, block_stride_bytes=8)  # type: ignore[arg-type]
    scalar = BlockLayout(num_blocks=np.int64(1), page_bytes=8, block_stride_bytes=8)
    assert scalar.num_blocks == 1
    assert type(scalar.num_blocks) is int
    with pytest.raises(ValidationError):  # and what validation refuses is refused every time
        BlockLayout(num_blocks=3, page_bytes=8, block_stride_bytes=4)
    with pytest.raises(ValidationError):
        BlockLayout(num_blocks=3, page_bytes=8, block_stride_bytes=4)


def test_the_interned_layouts_are_bounded() -> None:
    from safeview import spec

    for offset in range(spec._MAX_INTERNED + 10):
        for _ in range(2):  # built twice: remembered
            BlockLayout(num_blocks=1, page_bytes=1, block_stride_bytes=1, byte_offset=offset)
    assert 0 < len(spec._INTERNED) <= spec._MAX_INTERNED
    assert 0 < len(spec._SEEN) <= spec._MAX_INTERNED


# -- BlockLayout built from plain ints without pydantic's machinery: the same layout or error ---

EDGES = st.sampled_from(
    [-1, 0, 1, 2, 7, 8, 64, INT64_MAX // 2, INT64_MAX - 1, INT64_MAX, INT64_MAX + 1]
)
VALUES = st.integers(-3, 80) | EDGES


@given(
    num_blocks=VALUES,
    page_bytes=VALUES,
    block_stride_bytes=VALUES,
    byte_offset=st.none() | VALUES,
)
def test_a_layout_of_plain_ints_is_what_validation_makes_or_fails_as_it_does(
    num_blocks: int, page_bytes: int, block_stride_bytes: int, byte_offset: int | None
) -> None:
    fields = {"num_blocks": num_blocks, "page_bytes": page_bytes,
              "block_stride_bytes": block_stride_bytes}  # fmt: skip
    if byte_offset is not None:
        fields["byte_offset"] = byte_offset
    try:
        validated = BlockLayout.model_validate(fields)  # pydantic's own path, never interned
    except ValidationError as refused:
        with pytest.raises(ValidationError) as error:
            BlockLayout(**fields)
        assert error.value.errors(include_context=False) == refused.errors(include_context=False)
        return
    for built in (BlockLayout(**fields), BlockLayout(**fields)):  # new, then remembered
        assert type(built) is BlockLayout
        assert list(built.__dict__.items()) == list(validated.__dict__.items())
        assert built.model_fields_set == validated.model_fields_set
        assert built.__pydantic_extra__ == validated.__pydantic_extra__
        assert built.__pydantic_private__ == validated.__pydantic_private__
        assert built.model_dump(exclude_unset=True) == validated.model_dump(exclude_unset=True)
        assert built == validated
        assert hash(built) == hash(validated)


def test_new_values_are_checked_by_every_rule_of_the_fields_and_the_validator() -> None:
    from safeview import spec

    spec._INTERNED.clear()
    # each refused on a value never built before, so no remembered layout can answer
    for fields, field in (
        ({"num_blocks": -1, "page_bytes": 9, "block_stride_bytes": 9}, "num_blocks"),
        ({"num_blocks": 1, "page_bytes": 0, "block_stride_bytes": 9}, "page_bytes"),
        ({"num_blocks": 1, "page_bytes": 9, "block_stride_bytes": 0}, "block_stride_bytes"),
        (
            {"num_blocks": 1, "page_bytes": 9, "block_stride_bytes": 9, "byte_offset": -9},
            "byte_offset",
        ),
        ({"num_blocks": 3, "page_bytes": 9, "block_stride_bytes": 8}, "block_stride_bytes"),
        ({"num_blocks": 2, "page_bytes": 9, "block_stride_bytes": INT64_MAX}, "extent_bytes"),
        ({"num_blocks": 1, "page_bytes": 9, "block_stride_bytes": 9, "pages": 1}, "pages"),
    ):
        with pytest.raises(ValidationError, match=field):
            BlockLayout(**fields)
    assert spec._INTERNED == {}  # nothing refused was remembered


def test_a_layout_given_no_byte_offset_is_not_the_one_given_zero() -> None:
    implicit = BlockLayout(num_blocks=2, page_bytes=8, block_stride_bytes=8)
    explicit = BlockLayout(num_blocks=2, page_bytes=8, block_stride_bytes=8, byte_offset=0)
    assert implicit == explicit
    assert implicit.model_fields_set == {"num_blocks", "page_bytes", "block_stride_bytes"}
    assert "byte_offset" in explicit.model_fields_set


# -- packed_layouts: bad arguments are ArgumentErrors naming the argument, value and limit -----


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: packed_layouts({"k": -1}, 2),
            r"page_bytes\['k'\] must be an integer from 1 to 9223372036854775807; got -1",
        ),
        (lambda: packed_layouts({"k": 0}, 2), r"page_bytes\['k'\] .* from 1 .*; got 0"),
        (
            lambda: packed_layouts({"k": "8"}, 2),  # type: ignore[dict-item]
            r"page_bytes\['k'\] .*; got '8' \(str\)",
        ),
        (lambda: packed_layouts({"k": 8}, -1), r"num_blocks must be an integer from 0 .*; got -1"),
        (lambda: packed_layouts({"k": 8}, True), r"num_blocks .*; got True \(bool\)"),
        (
            lambda: packed_layouts({"k": 8}, 2, byte_offset=2.0),  # type: ignore[arg-type]
            r"byte_offset .*; got 2\.0 \(float\)",
        ),
        (
            lambda: packed_layouts([8, 8], 2),  # type: ignore[arg-type]
            r"page_bytes must be a mapping .*; got list",
        ),
        (
            lambda: packed_layouts({"k": INT64_MAX, "v": 1}, 2),
            r"the pages sum to 9223372036854775808 bytes",
        ),
        (
            lambda: packed_layouts({"k": 2**40}, 2**30),
            r"view 'k': extent_bytes = .* exceeds the int64 limit",
        ),
    ],
    ids=["negative", "zero", "str", "blocks", "bool", "float", "list", "stride", "extent"],
)
def test_packed_layouts_refuses_bad_arguments_naming_them(call: Any, message: str) -> None:
    with pytest.raises(ArgumentError, match=message):
        call()


def test_packed_layouts_takes_integer_scalars() -> None:
    pages: dict[str, Any] = {"k": np.int64(4), "v": torch.tensor(4)}
    layouts = packed_layouts(pages, np.int32(3))
    assert [layout.byte_offset for layout in layouts.values()] == [0, 4]
    assert layouts["v"].block_stride_bytes == 8


# -- fields in order, refusals as SafeViewError ----------------------------------------------------


def test_block_layout_takes_its_fields_in_the_documented_order() -> None:
    # docs/api.md writes BlockLayout(num_blocks, page_bytes, block_stride_bytes, byte_offset=0)
    assert BlockLayout(4, 16, 32, 8) == _block()
    assert BlockLayout(4, 16, 32, byte_offset=8) == _block()
    assert BlockLayout(4, 16, 16) == BlockLayout(num_blocks=4, page_bytes=16, block_stride_bytes=16)
    assert BlockLayout(np.int64(4), 16, 32, 8) == _block()
    assert StridedLayout((2, 4), (4, 1), 0, "float16").extent_bytes == 16
    assert Region(0, 8) == Region(start_byte=0, end_byte=8)


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda: BlockLayout(1, 2, 3, 4, 5), "BlockLayout takes at most 4 positional"),  # type: ignore[call-arg]
        (lambda: StridedLayout((1,), (1,), 0, "int8", 9), "StridedLayout takes at most 4"),  # type: ignore[call-arg]
        (lambda: Region(0, 8, start_byte=0), "start_byte given twice"),  # type: ignore[misc]
    ],
)
def test_too_many_or_doubled_fields_are_an_argument_error(call: Any, words: str) -> None:
    with pytest.raises(ArgumentError, match=words):
        call()


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: _block(num_blocks=-1), "num_blocks"),
        (lambda: _block(num_blocks=True), "num_blocks"),
        (lambda: _block(page_bytes=[16]), "page_bytes"),
        (lambda: _block(block_stride_bytes=8), "block_stride_bytes"),  # pages overlap
        (lambda: _block(num_block=4), "num_block"),
        (lambda: StridedLayout(shape=(2, 3), strides=(1, 1)), "strides"),
        (lambda: Region(start_byte=3, end_byte=2), ""),
        (lambda: Region.model_validate((3, 2)), ""),
        (lambda: _block().model_copy(update={"page_bytes": 0}), "page_bytes"),
    ],
)
def test_a_refused_value_is_a_safeview_error_and_still_pydantics(build: Any, field: str) -> None:
    with pytest.raises(safeview.SafeViewError) as caught:
        build()
    error = caught.value
    assert isinstance(error, safeview.SpecError)
    assert isinstance(error, ArgumentError)
    assert isinstance(error, ValidationError)  # code that catches pydantic's still does
    [found] = error.errors()
    assert ".".join(str(part) for part in found["loc"]) == field
    assert found["msg"] in str(error)


def test_a_spec_error_keeps_pydantics_kind_and_context() -> None:
    with pytest.raises(safeview.SpecError) as caught:
        _block(num_blocks=-1)
    [found] = caught.value.errors()
    assert (found["type"], found["input"], found["ctx"]) == ("greater_than_equal", -1, {"ge": 0})


def test_a_layout_rebuilt_from_the_same_variables_is_the_same_and_refusals_stay() -> None:
    num_blocks, page, stride = 1, 16, 16
    built = [
        BlockLayout(num_blocks=num_blocks, page_bytes=page, block_stride_bytes=stride)
        for _ in range(4)
    ]
    assert built[2] is built[3] == BlockLayout(num_blocks=1, page_bytes=16, block_stride_bytes=16)
    assert built[3].model_fields_set == {"num_blocks", "page_bytes", "block_stride_bytes"}
    # equal values of another type right after: never the remembered layout
    with pytest.raises(safeview.SpecError):
        BlockLayout(num_blocks=True, page_bytes=page, block_stride_bytes=stride)
    with pytest.raises(safeview.SpecError):
        BlockLayout(num_blocks=1.0, page_bytes=page, block_stride_bytes=stride)  # type: ignore[arg-type]
    with_offset = BlockLayout(num_blocks, page, stride, 0)
    assert with_offset.model_fields_set == {*built[3].model_fields_set, "byte_offset"}
