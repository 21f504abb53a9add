"""Descriptor lists as columns of unsigned 64-bit numbers (``_Rows``), and the writes of a batch
that share a byte. Private to ``safeview``: ``safeview.transfer`` is the public module.
"""

from __future__ import annotations

import array as array_module
import operator
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from safeview.errors import ArgumentError
from safeview.findings import Descriptor, Finding
from safeview.transfer._pages import _TOP, ADDRESS_LIMIT, _Index, _numpy

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

    U64 = NDArray[np.uint64]

# The most elements a writes check expands strided rows into (16 bytes each).
_MAX_ELEMENTS = 1 << 27

# -- rows -----------------------------------------------------------------------------------------


class _Rows(NamedTuple):
    """The columns of a descriptor list, as ``uint64`` arrays (``device``, ``stride`` and
    ``count`` ``None`` where the rows do not carry them)."""

    addresses: U64
    lengths: U64
    devices: U64 | None
    strides: U64 | None
    counts: U64 | None

    def describe(self, index: int) -> Descriptor:
        return Descriptor(
            index,
            int(self.addresses[index]),
            int(self.lengths[index]),
            None if self.devices is None else int(self.devices[index]),
            None if self.strides is None else int(self.strides[index]),
            None if self.counts is None else int(self.counts[index]),
        )


def _rows(descriptors: object) -> _Rows:
    _numpy()
    import numpy as np

    if not isinstance(descriptors, np.ndarray):
        if not isinstance(descriptors, Iterable) or isinstance(descriptors, (str, bytes)):
            raise ArgumentError(
                "descriptors must be a list of (address, length[, device[, stride, count]]) "
                f"rows or an integer array of them; got {type(descriptors).__name__}"
            )
        rows = descriptors if isinstance(descriptors, (list, tuple)) else list(descriptors)
        return _columns_of(rows) if rows else _Rows(*_empty_columns(), None, None, None)
    array = descriptors
    if array.ndim != 2:
        raise ArgumentError(f"a descriptor array must be 2-d; got shape {array.shape}")
    _width(array.shape[1])
    if array.dtype.kind == "O":
        try:
            array = np.array(array.tolist(), dtype=np.uint64).reshape(array.shape)
        except (OverflowError, ValueError, TypeError):
            raise _bad_value(array.tolist()) from None
    elif array.dtype.kind in "iu":
        # a signed array holds the 64-bit patterns the engines read: -1 is 2**64 - 1
        array = array.astype(np.uint64, copy=False)
    else:
        raise ArgumentError(f"a descriptor array must hold integers; got dtype {array.dtype}")
    width = array.shape[1]
    columns = np.ascontiguousarray(array.T)  # one pass; each column then reads in order
    return _Rows(
        columns[0],
        columns[1],
        columns[2] if width >= 3 else None,
        columns[3] if width == 5 else None,
        columns[4] if width == 5 else None,
    )


def _empty_columns() -> tuple[U64, U64]:
    import numpy as np

    return np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.uint64)


def _columns_of(rows: Sequence[Any]) -> _Rows:
    """A list of rows as columns, each read straight into its own array."""
    import numpy as np

    try:
        widths = set(map(len, rows))
    except TypeError:
        raise ArgumentError(
            "each descriptor must be a row (address, length[, device[, stride, count]]); "
            f"got {type(rows[0]).__name__}"
        ) from None
    if len(widths) != 1:
        raise ArgumentError(
            f"descriptors must all have one width; got rows of {sorted(widths)} numbers"
        )
    width = widths.pop()
    _width(width)
    columns = []
    for position in range(width):
        try:
            # array's "Q" takes integers (and __index__) from 0 to 2**64 - 1 and refuses floats
            # and strings, which numpy.fromiter would truncate or parse
            column = array_module.array("Q", map(operator.itemgetter(position), rows))
        except (OverflowError, ValueError, TypeError, IndexError, KeyError):
            raise _bad_value(rows) from None
        columns.append(np.frombuffer(column, dtype=np.uint64))
    return _Rows(
        columns[0],
        columns[1],
        columns[2] if width >= 3 else None,
        columns[3] if width == 5 else None,
        columns[4] if width == 5 else None,
    )


def _width(width: int) -> None:
    if width not in (2, 3, 5):
        raise ArgumentError(
            "a descriptor is (address, length), (address, length, device) or "
            f"(address, length, device, stride, count); got rows of {width} numbers"
        )


def _bad_value(rows: Sequence[Any]) -> ArgumentError:
    for index, row in enumerate(rows):
        for value in row:
            if not (isinstance(value, int) and 0 <= value < ADDRESS_LIMIT) or isinstance(
                value, bool
            ):
                return ArgumentError(
                    f"descriptor {index} holds {value!r}; descriptors hold integers from 0 to "
                    "2**64 - 1"
                )
    return ArgumentError("descriptors hold integers from 0 to 2**64 - 1")


# -- writes that share a byte -------------------------------------------------------------------


def _overlapping_writes(rows: _Rows, index: _Index | None) -> list[Finding]:
    """One finding per pair of rows (or per row, for its own elements) that write a byte twice,
    naming the byte found: every row that shares a byte with another is named in one."""
    import numpy as np

    count = len(rows.addresses)
    if count < 1:
        return []
    with np.errstate(all="ignore"):
        numbers = np.ones(count, dtype=np.uint64) if rows.counts is None else rows.counts
        keep = (rows.lengths > 0) & (numbers > 0)
        total = int(numbers[keep].sum(dtype=np.uint64)) if keep.any() else 0
        if total > _MAX_ELEMENTS:
            raise ArgumentError(
                f"writes=True would check {total} elements, more than {_MAX_ELEMENTS}; check "
                "the batch in parts"
            )
        chosen = np.flatnonzero(keep)
        repeats = numbers[chosen].astype(np.intp)
        owner = np.repeat(chosen, repeats)
        first_of_row = np.cumsum(repeats) - repeats
        element = np.arange(total, dtype=np.uint64) - np.repeat(
            first_of_row.astype(np.uint64), repeats
        )
        step = np.zeros(count, dtype=np.uint64) if rows.strides is None else rows.strides
        starts = rows.addresses[owner] + element * step[owner]
        lasts = starts + rows.lengths[owner] - np.uint64(1)
        lasts = np.where(lasts < starts, np.uint64(_TOP), lasts)
        devices = np.zeros(total, dtype=np.uint64) if rows.devices is None else rows.devices[owner]
        # Sorted by start, an element shares a byte with an earlier one exactly when it starts
        # before the farthest end so far; the element that reaches that far is named with it.
        order = np.lexsort((starts, devices))
        starts, lasts, owner, devices = starts[order], lasts[order], owner[order], devices[order]
        pairs: dict[tuple[int, int], int] = {}
        for device in np.unique(devices).tolist():
            part = np.flatnonzero(devices == device)
            if len(part) < 2:
                continue
            part_starts, part_lasts, part_owner = starts[part], lasts[part], owner[part]
            reach = np.maximum.accumulate(part_lasts)
            holder = np.maximum.accumulate(np.where(part_lasts == reach, np.arange(len(part)), 0))
            later = np.flatnonzero(part_starts[1:] <= reach[:-1]) + 1
            for position in later.tolist():
                one = int(part_owner[holder[position - 1]])
                other = int(part_owner[position])
                key = (min(one, other), max(one, other))
                byte = int(part_starts[position])
                if key not in pairs or byte < pairs[key]:
                    pairs[key] = byte
    found = []
    for (first, second), byte in sorted(pairs.items()):
        where: dict[str, Any] = {}
        if index is not None:
            device = None if rows.devices is None else int(rows.devices[first])
            holders = index.storage_at(byte, device)
            if holders:
                page = index.page_at(byte, device)
                where = {
                    "storage": holders[0].name,
                    "byte_offset": byte - holders[0].address,
                    "views": page[0] if page is not None else (),
                }
        found.append(
            Finding.overlapping_writes(
                rows.describe(first), rows.describe(second), byte=byte, **where
            )
        )
    return found
