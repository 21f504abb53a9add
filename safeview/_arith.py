"""Plain integer arithmetic on strided byte layouts. No torch, no pydantic.

Everything here works on Python integers, which do not overflow; the int64 limits that torch and
the devices impose are enforced by the callers against ``INT64_MAX``.

Conventions: offsets and sizes in bytes unless a name says elements; intervals are half-open
``[start, end)``; strides are never negative (torch's ``as_strided`` refuses negative strides).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

INT64_MAX = 2**63 - 1


def extent_bytes(
    byte_offset: int, shape: Sequence[int], strides: Sequence[int], itemsize: int
) -> int:
    """Exclusive end byte of a strided view: the byte after the last byte it can touch.

    ``strides`` count elements of ``itemsize`` bytes. An empty view (any size 0) touches nothing,
    and its extent is its offset. This is torch's ``compute_required_storage_length`` in bytes::

        >>> extent_bytes(8, (3, 16), (32, 1), 1)    # 8 + (3 - 1) * 32 + 16
        88
    """
    last_element = 0
    for size, stride in zip(shape, strides):
        if not size:
            return byte_offset
        last_element += (size - 1) * stride
    return byte_offset + itemsize * (last_element + 1)


class SelfOverlap(NamedTuple):
    """Why a view's own elements collide: ``axis`` moves by ``stride`` elements, which is not more
    than ``reach``, the farthest the faster-moving axes already go."""

    axis: int
    size: int
    stride: int
    reach: int


def self_overlap(shape: Sequence[int], strides: Sequence[int]) -> SelfOverlap | None:
    """The first axis that makes a view touch some element twice, or ``None``.

    This is the rule Rust's ndarray uses (``dim_stride_overlap``): visit the axes from the smallest
    stride up; each axis longer than 1 must step past everything the faster axes reach. It never
    accepts an overlapping view; it refuses a few exotic interleavings that do not overlap (shape
    ``(3, 2)``, strides ``(2, 3)``), which no block layout produces.
    """
    if 0 in shape:
        return None
    reach = 0
    for axis in sorted(range(len(shape)), key=lambda a: strides[a]):
        size, stride = shape[axis], strides[axis]
        if size == 1:
            continue
        if stride <= reach:
            return SelfOverlap(axis, size, stride, reach)
        reach += (size - 1) * stride
    return None


class Blocks(NamedTuple):
    """``number`` runs of ``run`` contiguous bytes, the first at ``offset``, each ``stride`` bytes
    after the last. Every strided view is a union of these; a block layout is exactly one."""

    offset: int
    number: int
    stride: int
    run: int

    @property
    def end(self) -> int:
        return self.offset + (self.number - 1) * self.stride + self.run


def blocks(
    byte_offset: int,
    shape: Sequence[int],
    strides: Sequence[int],
    itemsize: int,
    *,
    max_pieces: int = 1 << 20,
) -> list[Blocks]:
    """Split a view that passed ``self_overlap`` into ``Blocks``: the contiguous inner axes become
    the run, the longest remaining axis the block axis, and the rest are enumerated.

    Raises ``ValueError`` when that enumeration would exceed ``max_pieces``.
    """
    if 0 in shape:
        return []
    axes = sorted(
        ((strides[a] * itemsize, shape[a]) for a in range(len(shape)) if shape[a] > 1),
        key=lambda axis: axis[0],
    )
    run = itemsize
    while axes and axes[0][0] == run:
        run *= axes.pop(0)[1]
    if not axes:
        return [Blocks(byte_offset, 1, run, run)]
    block_axis = max(range(len(axes)), key=lambda a: axes[a][1])
    block_stride, block_count = axes.pop(block_axis)
    pieces = 1
    for _, size in axes:
        pieces *= size
    if pieces > max_pieces:
        raise ValueError(
            f"this view splits into {pieces} block runs, more than the {max_pieces} "
            "that are checked exactly"
        )
    starts = [byte_offset]
    for stride, size in axes:
        starts = [start + k * stride for start in starts for k in range(size)]
    return sorted(Blocks(start, block_count, block_stride, run) for start in starts)


def _ceil_div(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


def first_multiple_in_range(a: int, m: int, lo: int, hi: int) -> int | None:
    """Smallest ``x >= 0`` with ``lo <= (a * x) % m <= hi``, or ``None``. Needs
    ``0 <= lo <= hi < m``.

    Euclid-like: if no multiple of ``a`` lies in ``[lo, hi]`` itself, the question turns into the
    same one about ``m`` modulo ``a``. Takes O(log m) steps.
    """
    a %= m
    if lo == 0:
        return 0
    if a == 0:
        return None
    x = _ceil_div(lo, a)
    if a * x <= hi:
        return x
    # No multiple of a in [lo, hi], so lo % a <= hi % a and the range does not wrap modulo a.
    # a*x - m*y in [lo, hi]  <=>  (m*y) % a in [a - hi % a, a - lo % a].
    y = first_multiple_in_range(m % a, a, a - hi % a, a - lo % a)
    if y is None:
        return None
    return _ceil_div(lo + m * y, a)


def shared_byte(first: Blocks, second: Blocks) -> int | None:
    """A byte that both ``first`` and ``second`` touch, or ``None`` when they are disjoint.

    Exact for any strides and counts, in O(log stride) steps, for runs whose own blocks do not
    overlap (``stride >= run`` or ``number == 1``). The answer is the lowest shared byte: the
    first byte where the earliest block of ``first`` that meets ``second`` meets it.
    """
    o1, n1, s1, p1 = first
    o2, n2, s2, p2 = second
    if first.end <= o2 or second.end <= o1:
        return None
    # Block i of `first` starts at x_i = o1 - o2 + i*s1 relative to `second`'s start and meets block
    # j of `second` iff j*s2 lies in [x_i - (p2 - 1), x_i + p1 - 1]. With r_i = x_i + p1 - 1 the
    # best j is min(r_i // s2, n2 - 1), and it works iff it is >= 0 and j*s2 >= r_i - (p1 + p2 - 2).
    c = o1 - o2 + p1 - 1
    window = p1 + p2 - 2

    # Blocks i whose best j is r_i // s2 itself (0 <= r_i < n2*s2): need r_i % s2 <= window.
    i_lo = max(0, _ceil_div(-c, s1))
    i_hi = min(n1 - 1, (n2 * s2 - 1 - c) // s1)
    if i_lo <= i_hi:
        if window >= s2 - 1:
            step: int | None = 0
        else:
            low = (-(c + i_lo * s1)) % s2
            high = low + window
            step = 0 if high >= s2 else first_multiple_in_range(s1, s2, low, high)
        if step is not None and step <= i_hi - i_lo:
            return _lowest_in_block(first, second, i_lo + step)
    # Blocks i past the end of `second` (r_i >= n2*s2): only the first of them can still meet its
    # last block.
    i = max(0, _ceil_div(n2 * s2 - c, s1))
    if i <= n1 - 1 and o1 + i * s1 - o2 <= (n2 - 1) * s2 + p2 - 1:
        return _lowest_in_block(first, second, i)
    return None


def _lowest_in_block(first: Blocks, second: Blocks, i: int) -> int:
    """The lowest byte that block ``i`` of ``first`` shares with ``second``, given that it
    shares one: with the first block of ``second`` that ends after block ``i`` starts."""
    start = first.offset + i * first.stride
    j = max(0, _ceil_div(start - second.offset - (second.run - 1), second.stride))
    return max(start, second.offset + j * second.stride)
