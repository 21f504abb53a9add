"""Descriptors for a transfer engine, checked against the views they must hit.

Connectors that move KV caches between processes hand a transfer engine raw descriptors:
``(address, length)``, ``(address, length, device)``, or NIXL's strided rows
``(address, length, device, stride, count)`` (``count`` elements of ``length`` bytes, ``stride``
bytes apart). The engines check only that a descriptor lies inside some registered region; a
descriptor on another layer's page, across two pages or short of a page goes through. Yet a
descriptor is a view in another form: a strided row is the block view ``(byte_offset,
page_bytes, block_stride_bytes, num_blocks)``. This module says of every descriptor whether it
hits whole pages of one layer's view, and nothing else.

The pipeline, one module each: ``memory_map(registration)`` (``safeview.transfer._pages``) turns
what ``safeview.kv.block_views`` or ``safeview.vllm.check_registration`` returned into plain
integers (each storage's address and size, each view's pages), which its index reads as the
checker's own records (``safeview.check``); the rows become columns of 64-bit numbers
(``safeview.transfer._rows``); ``check_descriptors`` judges them with numpy and explains one by one
only the rows it cannot prove right (``safeview.transfer._judge``); the findings go through the
policy, here. What the guards share also lives here: the regions registered through them, and the
intent (which layer a row is for).

What a row may be (every other row is a finding):

- one whole page of a view; with ``whole_pages=False``, any slice inside one page;
- a run of whole pages of one contiguous view (block stride equal to the page);
- a run of whole blocks of a packed group: views of one block stride whose pages tile each block
  back to back (vLLM's NIXL rows for packed MLA caches, the offloading worker's packed blocks);
- a strided row is one view: its elements sit at the same place of consecutive blocks (its stride
  is the view's block stride), or abut (stride equal to length) as runs of whole pages or blocks,
  or cut whole pages into equal pieces, all of them (vLLM's rows for a peer with smaller blocks).

All arithmetic is unsigned 64-bit: an address with bit 63 set is judged like any other, and a row
whose end passes 2**64 is an ``outside_memory`` finding. numpy is needed by this module only
(from a checkout: ``pip install -e ".[transfer]"``) and is imported on first use.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from safeview import log
from safeview.errors import AddressError, ArgumentError
from safeview.findings import Descriptor, Finding
from safeview.policy import Policy, PolicyArg, current_policy
from safeview.transfer._judge import _columns as _columns
from safeview.transfer._judge import _judge as _judge
from safeview.transfer._judge import _proven as _proven
from safeview.transfer._pages import ADDRESS_LIMIT as ADDRESS_LIMIT
from safeview.transfer._pages import MemoryMap, StorageSpan, ViewSpan, memory_map
from safeview.transfer._pages import _numpy as _numpy
from safeview.transfer._rows import _MAX_ELEMENTS as _MAX_ELEMENTS
from safeview.transfer._rows import _overlapping_writes as _overlapping_writes
from safeview.transfer._rows import _rows as _rows

__all__ = ["MemoryMap", "StorageSpan", "ViewSpan", "check_descriptors", "memory_map"]

# Up to this many rows, rows are judged one by one: cheaper than numpy's fixed cost.
_FEW_ROWS = 8

# -- the check ----------------------------------------------------------------------------------


def check_descriptors(
    descriptors: object,
    registration: object,
    *,
    layers: Sequence[str | None] | None = None,
    whole_pages: bool = True,
    writes: bool = False,
    policy: PolicyArg | None = None,
) -> list[Finding]:
    """Check that every descriptor hits whole pages of one view of ``registration``, and
    nothing else.

    ``descriptors``: rows ``(address, length)``, ``(address, length, device_id)`` or NIXL's
    strided ``(address, length, device_id, stride, count)``, as a list of tuples or an integer
    array (``uint64`` included; a signed array is read as the 64-bit patterns it holds).
    ``registration``: what ``safeview.kv.block_views``, ``safeview.vllm.check_registration`` or
    (with addresses) ``check_tensors`` returned, or a ``MemoryMap`` (see ``memory_map``).

    Findings: ``outside_memory`` (bytes in no storage), ``outside_view`` (in a storage but not
    whole pages of one view: a gap, two pages, two layers, a stride that is not the view's),
    ``partial_page`` (inside one page but not all of it; ``whole_pages=False`` allows such
    slices), ``wrong_layer`` (``layers[i]`` names the layer row ``i`` is meant for, and it lies
    in another), ``overlapping_writes`` (with ``writes=True``: two rows of the batch, or two
    elements of one row, write the same byte).

    Under strict, raises ``safeview.AddressError`` for the first finding; under warn, emits an
    ``address_violation`` event per finding and returns them; ``off`` checks nothing and returns
    ``[]``. Rows that are not numbers below 2**64, or a ``layers`` list of another length, raise
    ``ArgumentError``.
    """
    active = current_policy(policy)
    if active is Policy.OFF:
        return []
    return _check(
        descriptors,
        memory_map(registration),
        layers=layers,
        whole_pages=whole_pages,
        writes=writes,
        active=active,
        source="check_descriptors",
    )


def _check(
    descriptors: object,
    memory: MemoryMap | None,
    *,
    layers: Sequence[str | None] | None = None,
    whole_pages: bool = True,
    writes: bool = False,
    active: Policy,
    source: str,
) -> list[Finding]:
    """``check_descriptors`` under a policy already resolved, naming ``source`` in its events
    and errors; with ``memory=None`` only writes that share a byte are looked for (a peer's
    addresses, which no registration of ours describes)."""
    rows = _rows(descriptors)
    index = memory._index if memory is not None else None
    found: list[Finding] = []
    if index is not None:
        found = _judge(
            rows,
            index,
            layers=layers,
            whole_pages=whole_pages,
            first_only=active is Policy.STRICT,
            # a few rows (one transfer of an engine without preparation) cost less one by one
            vectorised=len(rows.addresses) > _FEW_ROWS,
        )
    if writes and not (found and active is Policy.STRICT):
        found += _overlapping_writes(rows, index)
    _enforce(found, active, source)
    return found


def _enforce(found: Sequence[Finding], active: Policy, source: str) -> None:
    """Log every finding; under strict, raise for them."""
    if active is Policy.OFF or not found:
        return
    strict = active is Policy.STRICT
    for finding in found:
        log.address_violation(finding, strict=strict, policy=active.value, source=source)
    if strict:
        raise AddressError(found, policy=active.value, source=source)


# -- regions registered with an engine ------------------------------------------------------------


class _Registered:
    """The regions registered with one engine through a guard, to refuse a region that overlaps
    one registered before (the engines accept both, and a transfer could then use either).
    Regions are keyed by the kind of memory they lie in: host memory (``DRAM``) is one address
    space, device memory (``VRAM``, files, objects) one per device id."""

    def __init__(self, engine: str) -> None:
        self.engine = engine
        self.regions: list[tuple[Any, Descriptor]] = []  # (memory key, region)

    @staticmethod
    def key(kind: str, region: Descriptor) -> tuple[str, int | None]:
        return (kind, None) if kind == "DRAM" else (kind, region.device)

    def overlapping(self, regions: Sequence[tuple[str, Descriptor]]) -> list[Finding]:
        """A ``duplicate_registration`` finding for each of ``regions`` (``(kind, region)``)
        that overlaps one registered before in the same memory, or one before it in the same
        call."""
        found = []
        earlier = list(self.regions)
        for kind, region in regions:
            key = self.key(kind, region)
            if region.length_bytes:
                for known, other in earlier:
                    if known != key:
                        continue
                    low = max(region.address, other.address)
                    if low < min(
                        region.address + region.length_bytes, other.address + other.length_bytes
                    ):
                        found.append(
                            Finding.duplicate_registration(
                                region, other, byte=low, engine=self.engine
                            )
                        )
                        break
            earlier.append((key, region))
        return found

    def add(self, regions: Iterable[tuple[str, Descriptor]]) -> None:
        self.regions += [
            (self.key(kind, region), region) for kind, region in regions if region.length_bytes
        ]

    def remove(self, kind: str, region: Descriptor, *, any_length: bool = False) -> None:
        """Forget the regions registered at ``region``'s address in its memory (of its length,
        unless ``any_length``)."""
        key = self.key(kind, region)
        self.regions = [
            (known, other)
            for known, other in self.regions
            if not (
                known == key
                and other.address == region.address
                and (any_length or other.length_bytes == region.length_bytes)
            )
        ]


# -- the intent: which layer each row is meant for ------------------------------------------------

Intent = Any
"""What a guard is told of the layer each row of a local list is meant for: ``None`` (nothing),
``"views"`` (the registration's layers, in the order of its views), a sequence of layer names in
the order the connector lists its regions, or a function of the number of rows that returns one
name (or ``None``) per row, or ``None``."""


def _intended(intent: Intent, memory: MemoryMap, count: int) -> list[str | None] | None:
    """One layer name (or ``None``) per row of a list of ``count`` rows, from ``intent``; names
    the registration does not know are ``None`` (no intent for that row), and so is every row of
    a list whose length does not fit the names."""
    if intent is None or not count:
        return None
    if callable(intent):
        given = intent(count)
        names = None if given is None else list(given)
        if names is None or len(names) != count:
            return None
    else:
        if isinstance(intent, str):
            if intent != "views":
                raise ArgumentError(
                    f"layers must be a list of layer names, 'views', a function or None; "
                    f"got {intent!r}"
                )
            order = [view.layer or view.name for view in memory.views]
            intent = list(dict.fromkeys(order))
        names_of_layers = list(intent)
        if not names_of_layers or count % len(names_of_layers):
            return None
        repeat = count // len(names_of_layers)
        names = [name for name in names_of_layers for _ in range(repeat)]
    known = memory._index.columns
    return [name if isinstance(name, str) and name in known else None for name in names]
