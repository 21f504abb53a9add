"""The sanitizer's index of the bytes each layer's views cover: it names the same first entry and
byte as trying every entry in order would, checked against the bytes themselves."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from safeview import sanitize
from safeview._arith import Blocks
from safeview.guard._piece_index import PieceIndex

# -- against an oracle that lists the bytes ------------------------------------------------------


@st.composite
def a_piece(draw: st.DrawFn) -> Blocks:
    number = draw(st.integers(1, 6))
    run = draw(st.integers(1, 24))
    # blocks that do not overlap one another (a view that passed self_overlap): spaced,
    # touching (run == stride) or one block with any stride
    stride = draw(st.integers(run, 64)) if number > 1 else draw(st.integers(1, 64))
    return Blocks(draw(st.integers(0, 400)), number, stride, run)


def _bytes(pieces: list[Blocks]) -> set[int]:
    return {
        piece.offset + block * piece.stride + byte
        for piece in pieces
        for block in range(piece.number)
        for byte in range(piece.run)
    }


def _oracle(
    entries: list[tuple[str, str, list[Blocks]]], layer: str, pieces: list[Blocks]
) -> tuple[str, int] | None:
    mine = _bytes(pieces)
    for other_layer, name, other in entries:
        shared = mine & _bytes(other)
        if other_layer != layer and shared:
            return name, min(shared)
    return None


# a few strides shared by many pieces, as a packed group has, and any other
_STEPS = st.lists(
    st.tuples(st.sampled_from("abcd"), st.lists(a_piece(), min_size=1, max_size=3)),
    min_size=1,
    max_size=30,
)


@settings(max_examples=400, deadline=None)
@given(_STEPS)
def test_the_first_entry_sharing_a_byte_and_the_byte_are_the_oracles(
    steps: list[tuple[str, list[Blocks]]],
) -> None:
    index = PieceIndex()
    entries: list[tuple[str, str, list[Blocks]]] = []
    for number, (layer, pieces) in enumerate(steps):
        assert index.first_overlap(layer, pieces) == _oracle(entries, layer, pieces)
        name = f"{layer}{number}"
        index.add(layer, name, pieces)
        entries.append((layer, name, pieces))


@settings(max_examples=200, deadline=None)
@given(
    st.integers(2, 40),
    st.integers(1, 16),
    st.lists(st.tuples(st.integers(0, 39), st.integers(-20, 20)), max_size=8),
)
def test_a_packed_group_of_spaced_blocks_matches_the_oracle(
    layers: int, page: int, shifted: list[tuple[int, int]]
) -> None:
    # N layers packed into one block, one page each: every layer's blocks have the same stride
    stride = layers * page
    index = PieceIndex()
    entries: list[tuple[str, str, list[Blocks]]] = []
    steps = [(f"l{i}", [Blocks(i * page, 5, stride, page)]) for i in range(layers)]
    steps += [
        (f"l{i % layers}", [Blocks(max(0, (i % layers) * page + shift), 5, stride, page)])
        for i, shift in shifted
    ]
    for number, (layer, pieces) in enumerate(steps):
        assert index.first_overlap(layer, pieces) == _oracle(entries, layer, pieces)
        index.add(layer, f"{layer}.{number}", pieces)
        entries.append((layer, f"{layer}.{number}", pieces))


# -- the sanitizer's verdicts on a registration of many layers ------------------------------------

NUM_BLOCKS = 4
PAGE = 64


def _layers(count: int, packed: bool, slack: int = 0) -> dict[str, torch.Tensor]:
    raw = torch.zeros(count * NUM_BLOCKS * PAGE + slack, dtype=torch.int8)
    if packed:  # every block holds one page of each layer
        return {
            f"layers.{i}": torch.as_strided(raw, (NUM_BLOCKS, PAGE), (count * PAGE, 1), i * PAGE)
            for i in range(count)
        }
    return {
        f"layers.{i}": torch.as_strided(raw, (NUM_BLOCKS, PAGE), (PAGE, 1), i * NUM_BLOCKS * PAGE)
        for i in range(count)
    }


def _one_view_each(caches: dict[str, torch.Tensor], moved: dict[str, int]) -> None:
    for name, cache in caches.items():
        offset = moved.get(name, cache.storage_offset())
        torch.as_strided(cache, cache.shape, cache.stride(), offset)


def test_many_layers_making_their_own_views_find_nothing() -> None:
    for packed in (True, False):
        caches = _layers(300, packed)
        with sanitize("strict", layers=caches, groups=dict.fromkeys(caches, 0)) as seen:
            _one_view_each(caches, {})
        assert seen.findings == []
        assert len(seen.views) == 300


def test_views_moved_onto_the_next_layer_name_that_layers_cache_and_its_first_byte() -> None:
    count = 300
    for packed in (True, False):
        caches = _layers(count, packed)
        step = PAGE if packed else NUM_BLOCKS * PAGE  # where the next layer starts
        moved = {f"layers.{i}": (i + 1) * step for i in (3, 150, 298)}
        with sanitize("warn", layers=caches, groups=dict.fromkeys(caches, 0)) as seen:
            _one_view_each(caches, moved)
        found = [
            (f.views[0].split(" (")[0], f.views[1].split(":")[0], f.byte) for f in seen.findings
        ]
        # the moved view meets the next layer's cache tensor, then that layer's own view meets it
        assert found == [
            finding
            for i in (3, 150, 298)
            for finding in (
                (f"layers.{i + 1}: its cache tensor", f"layers.{i}", (i + 1) * step),
                (f"layers.{i}: view{i}", f"layers.{i + 1}", (i + 1) * step),
            )
        ]


def test_two_layers_views_over_bytes_no_layer_holds_are_found_in_a_large_group() -> None:
    count = 300
    for packed in (True, False):
        caches = _layers(count, packed, slack=2 * PAGE)
        slack = count * NUM_BLOCKS * PAGE
        with sanitize("warn", layers=caches, groups=dict.fromkeys(caches, 0)) as seen:
            _one_view_each(caches, {})
            torch.as_strided(caches["layers.5"], (1, PAGE), (PAGE, 1), slack)
            torch.as_strided(caches["layers.9"], (1, PAGE), (PAGE, 1), slack + PAGE)  # next to it
            assert seen.findings == []
            torch.as_strided(caches["layers.7"], (1, PAGE), (PAGE, 1), slack + PAGE // 2)
        [finding] = seen.findings
        assert finding.views[0].startswith("layers.5: view")
        assert finding.views[1].startswith("layers.7: view")
        assert finding.byte == slack + PAGE // 2
