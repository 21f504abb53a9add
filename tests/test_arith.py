"""The integer arithmetic under the overlap checks, against brute-force enumeration."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from safeview._arith import Blocks, blocks, first_multiple_in_range, shared_byte


@given(a=st.integers(0, 60), m=st.integers(1, 60), data=st.data())
def test_first_multiple_in_range_matches_enumeration(a: int, m: int, data: st.DataObject) -> None:
    lo = data.draw(st.integers(0, m - 1))
    hi = data.draw(st.integers(lo, m - 1))
    expected = next((x for x in range(m + 1) if lo <= (a * x) % m <= hi), None)
    assert first_multiple_in_range(a, m, lo, hi) == expected


@given(
    a=st.integers(1, 10**12),
    m=st.integers(2, 10**12),
    lo=st.integers(0, 10**12),
    width=st.integers(0, 50),
)
def test_first_multiple_in_range_answer_is_in_range_for_large_numbers(
    a: int, m: int, lo: int, width: int
) -> None:
    lo %= m
    hi = min(m - 1, lo + width)
    x = first_multiple_in_range(a, m, lo, hi)
    if x is not None:
        assert lo <= (a * x) % m <= hi
        # and nothing smaller works, checked on a window below it
        for smaller in range(max(0, x - 200), x):
            assert not lo <= (a * smaller) % m <= hi


def _bytes(piece: Blocks) -> set[int]:
    return {
        piece.offset + i * piece.stride + k for i in range(piece.number) for k in range(piece.run)
    }


@st.composite
def pieces(draw: st.DrawFn) -> Blocks:
    number = draw(st.integers(1, 8))
    run = draw(st.integers(1, 12))
    stride = draw(st.integers(run, run + 30)) if number > 1 else run
    return Blocks(draw(st.integers(0, 120)), number, stride, run)


@given(first=pieces(), second=pieces())
def test_shared_byte_is_the_lowest_byte_both_touch(first: Blocks, second: Blocks) -> None:
    common = _bytes(first) & _bytes(second)
    expected = min(common) if common else None
    assert shared_byte(first, second) == expected
    assert shared_byte(second, first) == expected


def test_shared_byte_on_glm_scale_numbers() -> None:
    stride = 3_098_112
    mla = Blocks(0, 42_072, stride, 36_864)
    idx = Blocks(36_864, 42_072, stride, 8_448)
    assert shared_byte(mla, idx) is None
    # half the stride taken as the block stride: every second page lands mid-block
    wrong = Blocks(0, 42_072, stride // 2, 36_864)
    assert shared_byte(mla, wrong) == 0
    middle = Blocks(stride // 2, 42_072, stride, 8_448)
    assert shared_byte(middle, wrong) == stride // 2
    assert shared_byte(wrong, middle) == stride // 2
    just_after = Blocks(stride // 2 + 36_864, 42_072, stride, 8_448)
    assert shared_byte(just_after, wrong) is None
    last_block_only = Blocks(42_071 * stride + 100, 1, 10, 10)
    assert shared_byte(last_block_only, mla) == 42_071 * stride + 100
    past_the_end = Blocks(42_072 * stride, 1, 10, 10)
    assert shared_byte(past_the_end, mla) is None


@given(
    shape=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    extra=st.lists(st.integers(0, 5), min_size=3, max_size=3),
    itemsize=st.sampled_from([1, 2, 4]),
    offset=st.integers(0, 40),
)
def test_blocks_cover_exactly_the_bytes_of_a_view(
    shape: list[int], extra: list[int], itemsize: int, offset: int
) -> None:
    # strides that never self-overlap: each axis steps past the reach of the faster ones
    strides = [0] * len(shape)
    reach = 1
    for axis in reversed(range(len(shape))):
        strides[axis] = reach + extra[axis] * (axis != len(shape) - 1)
        reach = strides[axis] * shape[axis]
    expected: set[int] = set()
    for index in itertools.product(*(range(n) for n in shape)):
        element = sum(i * s for i, s in zip(index, strides))
        expected.update(range(offset + element * itemsize, offset + (element + 1) * itemsize))
    covered: set[int] = set()
    for piece in blocks(offset, shape, strides, itemsize):
        assert not (_bytes(piece) & covered)
        covered |= _bytes(piece)
    assert covered == expected
