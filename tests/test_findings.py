"""One Finding type: its numbers and its one sentence per kind."""

from __future__ import annotations

import pytest

from safeview.check import bounds, self_overlap
from safeview.findings import KINDS, Finding


def test_overflow_counts_the_bytes_of_the_span_outside_not_the_distance_from_the_end() -> None:
    # a 16-byte view at [100, 116) of a 64-byte storage: 16 of its bytes are outside, not 52
    [finding] = bounds("v", storage=None, byte_offset=100, extent_bytes=116, storage_nbytes=64)
    assert finding.kind == "out_of_bounds"
    assert finding.overflow_bytes == 16
    assert finding.slack_bytes == 64 - 116
    assert "(16 bytes past the end)" in finding.message


def test_a_view_that_straddles_the_end_counts_only_its_bytes_past_it() -> None:
    [finding] = bounds("v", storage="kv", byte_offset=48, extent_bytes=80, storage_nbytes=64)
    assert finding.overflow_bytes == 16
    assert finding.message == (
        "view 'v' needs bytes [48, 80) but storage 'kv' has 64 bytes (16 bytes past the end)"
    )


def test_an_empty_view_past_the_end_counts_how_far_it_starts_past_it() -> None:
    [finding] = bounds(None, storage=None, byte_offset=70, extent_bytes=70, storage_nbytes=64)
    assert finding.overflow_bytes == 6
    assert finding.message.startswith("the empty view starts at byte 70")


def test_region_findings_say_which_side_and_count_both() -> None:
    [finding] = bounds(
        "v", storage=None, byte_offset=8, extent_bytes=40, storage_nbytes=64, region=(16, 32)
    )
    assert finding.kind == "out_of_region"
    assert finding.check == "region"
    assert finding.overflow_bytes == 8 + 8
    assert finding.limit_bytes == 32
    assert finding.region == (16, 32)
    assert "8 bytes before its start and 8 bytes past its end" in finding.message


def test_an_empty_view_inside_or_at_the_end_of_its_region_is_fine() -> None:
    for offset in (16, 24, 32):
        assert bounds("v", storage=None, byte_offset=offset, extent_bytes=offset,
                      storage_nbytes=64, region=(16, 32)) == []  # fmt: skip
    [finding] = bounds(
        "v", storage=None, byte_offset=33, extent_bytes=33, storage_nbytes=64, region=(16, 32)
    )
    assert finding.overflow_bytes == 1


def test_block_self_overlap_names_the_stride_the_page_and_the_first_shared_byte() -> None:
    finding = self_overlap(
        "layer.1", storage="kv", byte_offset=100, shape=(4, 64), strides=(32, 1), itemsize=1,
        block=True,
    )  # fmt: skip
    assert finding is not None
    assert finding.byte == 132  # page 1 starts inside page 0
    assert "block_stride_bytes=32 smaller than page_bytes=64" in finding.message
    assert "each of its 4 pages shares 32 bytes with the next, from byte 132 on" in (
        finding.message
    )


def test_typed_self_overlap_names_the_axis_and_a_byte_only_when_it_is_exact() -> None:
    broadcast = self_overlap(
        "t", storage=None, byte_offset=8, shape=(4, 8), strides=(0, 1), itemsize=2
    )
    assert broadcast is not None
    assert broadcast.byte == 8
    assert "axis 0 (size 4, stride 0)" in broadcast.message
    interleaved = self_overlap(
        "t", storage=None, byte_offset=0, shape=(3, 2), strides=(2, 3), itemsize=4
    )
    assert interleaved is not None
    assert interleaved.byte is None


@pytest.mark.parametrize(
    ("finding", "keys"),
    [
        (
            Finding.out_of_bounds("v", storage="s", byte_offset=0, extent_bytes=9,
                                  storage_nbytes=8),
            {"byte_offset", "extent_bytes", "limit_bytes", "overflow_bytes"},
        ),
        (
            Finding.overlap("a", "b", storage="s", byte=4, group=("g", 1)),
            {"byte", "group"},
        ),
    ],
)  # fmt: skip
def test_json_carries_the_numbers_of_its_kind(finding: Finding, keys: set[str]) -> None:
    data = finding.to_json()
    assert set(data) == {"kind", "views", "storage", "message"} | keys
    assert data["kind"] in KINDS
    if "group" in data:
        assert data["group"] == "('g', 1)"  # any group key is written as text
