"""Which earlier view of other layers a new view shares a byte with, without trying every one.

The sanitizer judges each view made from a layer's cache against every view and cache tensor of
the other layers of its group (``sanitize._aliasing``). Trying them all costs a registration of
N layers N * N pair tests; ``PieceIndex`` hands back only the entries that can share a byte with
the new view, and the pair test (``_arith.shared_byte``) decides as before, in the order the
entries were added, so the verdict and the byte named are those of trying every entry in order.

A piece (``_arith.Blocks``) is filed one of two ways:

- a contiguous span (one block, or blocks that touch: ``run >= stride``) by its first byte, in a
  bucket per power of two of its length: a span of less than ``2**k`` bytes that reaches a byte
  ``b`` starts after ``b - 2**k``, so a search is two bisections per bucket;
- spaced blocks (``run < stride``) by where their blocks start modulo the stride, in a bucket
  per stride: two pieces of one stride can share a byte only where their blocks' residues
  overlap, so the blocks of N layers packed into one page each find their own neighbours only.

Anything else (blocks of another stride than a bucket's) is tried against the whole bucket.
Plain integers only; no torch.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from safeview import _arith

__all__ = ["PieceIndex", "first_shared"]


def first_shared(first: Sequence[_arith.Blocks], second: Sequence[_arith.Blocks]) -> int | None:
    """The lowest byte that a piece of ``first`` and a piece of ``second`` both touch."""
    lowest = None
    for a in first:
        for b in second:
            byte = _arith.shared_byte(a, b)
            if byte is not None and (lowest is None or byte < lowest):
                lowest = byte
    return lowest


class Entry(NamedTuple):
    layer: str
    name: str
    pieces: list[_arith.Blocks]


def _spaced(piece: _arith.Blocks) -> bool:
    return piece.number > 1 and 0 < piece.run < piece.stride


class _Residues:
    """The spaced pieces of one stride, by the residue of their first byte."""

    def __init__(self, stride: int) -> None:
        self.stride = stride
        self.max_run = 0
        self.starts: list[tuple[int, int]] = []  # (offset % stride, entry), sorted

    def add(self, piece: _arith.Blocks, entry: int) -> None:
        self.max_run = max(self.max_run, piece.run)
        insort(self.starts, (piece.offset % self.stride, entry))

    def near(self, piece: _arith.Blocks) -> Iterable[int]:
        stride = self.stride
        # the residues, modulo the stride, of the bytes `piece` touches: [start, start + length)
        # (circularly) for spaced blocks of this stride, and for one span of bytes
        if _spaced(piece):
            if piece.stride != stride:
                return (entry for _, entry in self.starts)
            start, length = piece.offset, piece.run
        else:
            start, length = piece.offset, piece.end - piece.offset
        # a piece here whose blocks start at residue r covers [r, r + run), run <= max_run: it
        # meets [start, start + length) only if r lies in [start - max_run + 1, start + length)
        width = self.max_run + length - 1
        if width >= stride:
            return (entry for _, entry in self.starts)
        low = (start - self.max_run + 1) % stride
        high = low + width
        found = self._between(low, min(high, stride))
        if high > stride:
            found += self._between(0, high - stride)
        return found

    def _between(self, low: int, high: int) -> list[int]:
        starts = self.starts
        return [
            entry for _, entry in starts[bisect_left(starts, (low,)) : bisect_left(starts, (high,))]
        ]


class PieceIndex:
    """Entries (a layer, a view's name, the pieces of bytes it covers) in the order added, and the
    first one of another layer that shares a byte with given pieces."""

    def __init__(self) -> None:
        self.entries: list[Entry] = []
        self._spans: dict[int, list[tuple[int, int, int]]] = {}  # bit length -> (first, end, entry)
        self._residues: dict[int, _Residues] = {}

    def add(self, layer: str, name: str, pieces: list[_arith.Blocks]) -> None:
        entry = len(self.entries)
        self.entries.append(Entry(layer, name, pieces))
        for piece in pieces:
            if _spaced(piece):
                bucket = self._residues.get(piece.stride)
                if bucket is None:
                    bucket = self._residues[piece.stride] = _Residues(piece.stride)
                bucket.add(piece, entry)
            else:
                first, end = piece.offset, piece.end
                insort(self._spans.setdefault((end - first).bit_length(), []), (first, end, entry))

    def first_overlap(self, layer: str, pieces: Sequence[_arith.Blocks]) -> tuple[str, int] | None:
        """The name of the first entry added of a layer other than ``layer`` that shares a byte
        with ``pieces``, and the lowest byte they share; ``None`` when no such entry does."""
        candidates: set[int] = set()
        for piece in pieces:
            first, end = piece.offset, piece.end
            for bits, spans in self._spans.items():
                # a span shorter than 2**bits that reaches past `first` starts after it minus that
                low = bisect_left(spans, (first - (1 << bits) + 1,))
                high = bisect_left(spans, (end,))
                candidates.update(
                    entry for _, span_end, entry in spans[low:high] if span_end > first
                )
            for bucket in self._residues.values():
                candidates.update(bucket.near(piece))
        for entry in sorted(candidates):
            other = self.entries[entry]
            if other.layer == layer:
                continue
            byte = first_shared(pieces, other.pieces)
            if byte is not None:
                return other.name, byte
        return None
