"""Whole-cache registration from live tensors, engine-neutral.

``block_views`` turns an engine's ``kv_caches`` (layer name -> tensor, or list of tensors) and
page sizes into checked ``(num_blocks, page_bytes)`` int8 views: the views are described as plain
records, judged once by the checker (``safeview.check.check_views``: bounds, regions, each view
against itself, every pair over one memory by KV-cache group), and then made, never copied, never
resized. ``check_tensors`` judges the tensors as they are; ``guard_registration`` does that for a
connector's ``register_kv_caches`` and runs the method under ``sanitize()``.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

from safeview import _torch, log
from safeview.check import Report, StorageRecord, ViewRecord, check_views
from safeview.errors import ArgumentError, BoundsError, OverlapError
from safeview.findings import Finding
from safeview.guard import process
from safeview.plan import Plan
from safeview.policy import Policy, PolicyArg, current_policy
from safeview.spec import BlockLayout, Positive, Region, Spec, _index

if TYPE_CHECKING:
    import torch

__all__ = [
    "LayerSpec",
    "Registration",
    "block_views",
    "check_tensors",
    "guard_registration",
]

KvCaches = (
    Mapping[str, "torch.Tensor | Sequence[torch.Tensor]"]
    | Sequence["torch.Tensor | Sequence[torch.Tensor]"]
)
_Tensor = _torch.Tensor
_STRIDED = _torch._STRIDED


class LayerSpec(Spec):
    """safeview's own layer spec: the page size of one block of the layer (all its tensors
    together) and whether its tensors are attention K/V or Mamba-like state."""

    page_bytes: Positive
    kind: Literal["attention", "mamba"] = "attention"


def _count(value: object, what: str) -> int:
    """A non-negative integer argument, or an ``ArgumentError`` naming it and the value."""
    try:
        number = _index(value)
    except ValueError:
        number = -1
    if number < 0:
        raise ArgumentError(
            f"{what} must be a non-negative integer; got {value!r} ({type(value).__name__})"
        )
    return number


def _page_and_kind(layer: str, spec: object) -> tuple[int, str, BlockLayout | None]:
    if type(spec) is int and spec > 0:  # a page size, the usual case
        return spec, "attention", None
    if isinstance(spec, BlockLayout):
        return spec.page_bytes, "explicit", spec
    if isinstance(spec, LayerSpec):
        return spec.page_bytes, spec.kind, None
    kind = "attention"
    page: object = spec
    if hasattr(spec, "page_size_bytes"):
        page = spec.page_size_bytes
        # vLLM's MambaSpec carries the state tensors' shapes and dtypes; attention specs do not.
        kind = "mamba" if hasattr(spec, "shapes") and hasattr(spec, "dtypes") else "attention"
    elif not (isinstance(page, int) or hasattr(page, "__index__")) or isinstance(page, bool):
        raise ArgumentError(
            f"specs[{layer!r}] must be a page size in bytes, a safeview LayerSpec or BlockLayout, "
            f"or a spec with page_size_bytes; got {spec!r} ({type(spec).__name__})"
        )
    number = _count(page, f"the page size of layer {layer!r}")
    if number == 0:
        raise ArgumentError(f"the page size of layer {layer!r} must be at least 1 byte; got 0")
    return number, kind, None


def _tensors(layer: str, value: object) -> list[torch.Tensor]:
    if _torch.is_strided_tensor(value):
        return [value]  # type: ignore[list-item]
    tensors = value
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise ArgumentError(
            f"kv_caches[{layer!r}] must be a strided tensor or a non-empty list of them; "
            f"got {type(value).__name__}"
        )
    for index, tensor in enumerate(tensors):
        if not _torch.is_strided_tensor(tensor):
            raise ArgumentError(
                f"kv_caches[{layer!r}][{index}] must be a strided torch.Tensor; "
                f"got {type(tensor).__name__}"
            )
    return list(tensors)


def _as_mapping(kv_caches: object, what: str) -> Mapping[str, Any]:
    """``kv_caches`` as a mapping of layer names to a tensor or a list of tensors: a mapping as
    it is, a list or tuple of them with layers named ``"0"``, ``"1"``, ...; else an
    ``ArgumentError`` that says what to pass."""
    if isinstance(kv_caches, Mapping):
        return kv_caches
    if isinstance(kv_caches, (list, tuple)) and not _torch.is_strided_tensor(kv_caches):
        return {str(index): value for index, value in enumerate(kv_caches)}
    raise ArgumentError(
        f"{what} must map each layer's name to its cache tensor (or a list of its K/V "
        "tensors), or be a list of those, one per layer; "
        f"got {type(kv_caches).__name__}"
    )


class _Storages:
    """The distinct storages behind a set of tensors, named ``storage0``, ``storage1``, ... in
    order of first appearance, with the memory each lies in."""

    def __init__(self) -> None:
        self._names: dict[int, str] = {}
        self.objects: dict[str, torch.UntypedStorage] = {}
        self.facts: dict[str, _torch.StorageFacts] = {}

    def name(self, storage: torch.UntypedStorage) -> str:
        key = storage._cdata
        name = self._names.get(key)
        if name is None:
            name = self._names[key] = f"storage{len(self._names)}"
            self.objects[name] = storage
            self.facts[name] = _torch.storage_facts(storage)
        return name

    def records(self) -> dict[str, StorageRecord]:
        return {
            name: StorageRecord(facts.nbytes, facts.memory, facts.base)
            for name, facts in self.facts.items()
        }


@dataclass(frozen=True)
class Registration:
    """What a checked registration made and found.

    ``tensors_per_block`` is what vLLM's offloading worker consumes: for each layer, its int8
    ``(num_blocks, page_bytes)`` views. ``page_bytes`` is each layer's page size; ``report`` has
    every view (``report.views``, in plain numbers), every finding and the storages' sizes;
    ``devices`` the device of each storage; ``storages`` what each storage is (``StorageFacts``:
    size, device and ``base``, the address of its byte 0, 0 on ``meta``), which is what
    ``safeview.transfer.memory_map`` turns into addresses to check descriptors against.
    """

    tensors_per_block: dict[str, tuple[torch.Tensor, ...]]
    page_bytes: dict[str, int]
    report: Report
    devices: dict[str, str]
    policy: Policy
    storages: dict[str, _torch.StorageFacts] = field(default_factory=dict)

    @property
    def violations(self) -> tuple[Finding, ...]:
        return self.report.findings

    def to_plan(self, path: str | Path | None = None, *, description: str | None = None) -> Plan:
        """This registration as a plan, written to ``path`` if given, to check and draw offline
        with ``safeview check``."""
        plan = Plan.from_views(
            self.report.storages, self.report.views, devices=self.devices, description=description
        )
        if path is not None:
            plan.dump(path)
        return plan


class _Planned:
    """Views to make, as records, with the layer and tensor each comes from. Equal shape and
    stride tuples are shared (a packed group has a few page sizes and one stride): fewer objects
    that outlive the call, so a registration of thousands of layers does not make the cyclic
    collector scan the host's heap."""

    def __init__(self) -> None:
        self.storages = _Storages()
        self.records: list[ViewRecord] = []
        self.layers: list[str] = []
        self.tensors: list[torch.Tensor] = []
        self._pairs: dict[tuple[int, int], tuple[int, int]] = {}

    def pair(self, first: int, second: int) -> tuple[int, int]:
        """``(first, second)``, the same tuple object for equal values."""
        key = (first, second)
        return self._pairs.setdefault(key, key)

    def add_block(
        self,
        layer: str,
        tensor: torch.Tensor,
        *,
        name: str,
        storage: str,
        byte_offset: int,
        num_blocks: int,
        page_bytes: int,
        block_stride_bytes: int,
        group: Hashable | None,
        region: tuple[int, int] | None = None,
    ) -> None:
        """Plan the int8 ``(num_blocks, page_bytes)`` view with strides
        ``(block_stride_bytes, 1)`` that ``layer`` gets from ``tensor``."""
        pairs = self._pairs
        shape = (num_blocks, page_bytes)
        strides = (block_stride_bytes, 1)
        self.records.append(
            ViewRecord(
                name,
                storage,
                byte_offset,
                pairs.setdefault(shape, shape),
                pairs.setdefault(strides, strides),
                1,
                group,
                region,
            )
        )
        self.layers.append(layer)
        self.tensors.append(tensor)


def _names(value: object, what: str) -> frozenset[str]:
    """A collection of layer names, taken once as a set (a tuple or list is what users pass, and
    ``in`` on it per layer would be quadratic)."""
    if isinstance(value, (set, frozenset)):
        return frozenset(value)
    if isinstance(value, (str, bytes)) or not isinstance(value, Collection):
        raise ArgumentError(
            f"{what} must be a collection of layer names; got {value!r} ({type(value).__name__})"
        )
    return frozenset(value)


def _known_layers(mapping: Mapping[str, object], kv_caches: Mapping[str, Any], what: str) -> None:
    """Refuse keys of ``groups`` or ``regions`` that name no layer of ``kv_caches``: a misspelt
    name leaves its layer without a group (a false overlap) or without a region (a check not
    made), and says nothing."""
    unknown = [key for key in mapping if key not in kv_caches]
    if not unknown:
        return
    near = difflib.get_close_matches(str(unknown[0]), [str(name) for name in kv_caches], n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    shown = ", ".join(repr(key) for key in unknown[:5])
    more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
    raise ArgumentError(
        f"{what} names {len(unknown)} layer{'s' if len(unknown) != 1 else ''} that kv_caches "
        f"does not have: {shown}{more}{hint}"
    )


def _region(regions: Mapping[str, Region | Sequence[int]] | None, layer: str) -> Any:
    if regions is None:
        return None
    value = regions.get(layer)
    if value is None:
        return None
    if isinstance(value, Region):
        return value.as_tuple()
    try:
        return Region.coerce(value).as_tuple()
    except ValueError as error:  # pydantic's ValidationError, for a caller's argument
        raise ArgumentError(
            f"regions[{layer!r}] must be (start_byte, end_byte) with 0 <= start <= end; "
            f"got {value!r}: {_first_error(error)}"
        ) from None


def _first_error(error: ValueError) -> str:
    errors = getattr(error, "errors", None)
    if callable(errors):
        found = errors()
        if found:
            return str(found[0].get("msg", error))
    return str(error)


def block_views(
    kv_caches: KvCaches,
    specs: Mapping[str, object],
    *,
    num_blocks: int,
    packed: Collection[str] = (),
    groups: Mapping[str, Hashable] | None = None,
    regions: Mapping[str, Region | Sequence[int]] | None = None,
    policy: PolicyArg | None = None,
) -> Registration:
    """Checked int8 block views of every layer of ``kv_caches``; a drop-in for the per-layer loop
    of a KV-cache connector's ``register_kv_caches``.

    - ``specs[layer]``: the layer's page size in bytes, a ``LayerSpec``, an explicit
      ``BlockLayout``, or an engine's spec object unchanged (anything with ``page_size_bytes``;
      Mamba-like specs, which carry ``shapes`` and ``dtypes``, are recognised).
    - A single tensor (attention): ``byte_offset = storage_offset * element_size``; the block
      stride is ``stride(0) * element_size`` for layers in ``packed``, else the page. (For vLLM,
      ``safeview.vllm.check_registration`` applies vLLM's own rules instead.)
    - A list of attention tensors (split K/V): one view each, each with its share of the page.
    - A list of Mamba state tensors: one view of contiguous pages from the first state tensor.
    - A single tensor whose outermost axis is K/V, not blocks (``(2, num_blocks, ...)``), is
      refused with an ``ArgumentError`` that says to pass ``[cache[0], cache[1]]``.
    - ``groups[layer]``: the layer's KV-cache group (the same mapping a ``guard_registration``
      is given); layers of different groups may share bytes, a layer without a group may share
      with none. ``regions[layer]``: its byte range. A key of either that names no layer of
      ``kv_caches`` is refused (``ArgumentError``), with the name it probably meant.

    Under ``strict`` a broken bound raises ``BoundsError`` and shared bytes ``OverlapError``,
    before any view is made; under ``warn`` both are logged and the views are made, except a
    view past the end of a cpu or cuda storage, which torch refuses (safeview never grows a
    storage): then ``BoundsError``, naming every such view and chained to torch's error, after
    the warnings (on meta the view is made); ``off`` checks nothing. One
    ``registration_checked`` event (INFO) sums it up. Arguments of the wrong kind or value (a
    ``num_blocks`` of ``True`` or ``-1``, a page of 0 bytes) raise ``ArgumentError``.
    """
    active = current_policy(policy)
    blocks = _count(num_blocks, "num_blocks")
    kv_caches = _as_mapping(kv_caches, "kv_caches")
    if not isinstance(specs, Mapping):
        raise ArgumentError(
            f"specs must map each layer's name to its page size or spec; got {type(specs).__name__}"
        )
    for what, mapping in (("groups", groups), ("regions", regions)):
        if mapping is not None and not isinstance(mapping, Mapping):
            raise ArgumentError(
                f"{what} must be a mapping keyed by layer name; got {type(mapping).__name__}"
            )
    for what, mapping in (("groups", groups), ("regions", regions)):
        if mapping:
            _known_layers(mapping, kv_caches, what)
    packed = _names(packed, "packed")
    planned = _Planned()
    page_bytes: dict[str, int] = {}
    for layer, value in kv_caches.items():
        if layer not in specs:
            raise ArgumentError(f"specs has no entry for layer {layer!r}")
        page, kind, explicit = _page_and_kind(layer, specs[layer])
        page_bytes[layer] = page
        strided = type(value) is _Tensor and value.layout is _STRIDED
        tensors: list[torch.Tensor] = [value] if strided else _tensors(layer, value)  # type: ignore[list-item]
        group = groups.get(layer) if groups is not None else None
        region = _region(regions, layer)
        first, offset, stride, rows = _torch.block_geometry(tensors[0])
        storage = planned.storages.name(first)
        if explicit is not None:
            planned.add_block(
                layer,
                tensors[0],
                name=layer,
                storage=storage,
                byte_offset=explicit.byte_offset,
                num_blocks=explicit.num_blocks,
                page_bytes=explicit.page_bytes,
                block_stride_bytes=explicit.block_stride_bytes,
                group=group,
                region=region,
            )
            continue
        if kind == "mamba":
            # The state tensors of a block sit one after another in one padded page.
            planned.add_block(
                layer,
                tensors[0],
                name=layer,
                storage=storage,
                byte_offset=offset,
                num_blocks=blocks,
                page_bytes=page,
                block_stride_bytes=page,
                group=group,
                region=region,
            )
            continue
        if rows == 2 and len(tensors) == 1:  # only a K/V axis of 2 outermost can be K/V-first
            _refuse_kv_first(layer, tensors[0], blocks, page)
        if len(tensors) > 1 and page % len(tensors):
            raise ArgumentError(
                f"layer {layer!r}: its page of {page} bytes does not split evenly over its "
                f"{len(tensors)} K/V tensors"
            )
        part = page // len(tensors)
        is_packed = layer in packed
        for index, tensor in enumerate(tensors):
            if index:
                first, offset, stride, rows = _torch.block_geometry(tensor)
                storage = planned.storages.name(first)
            planned.add_block(
                layer,
                tensor,
                name=layer if len(tensors) == 1 else f"{layer}[{index}]",
                storage=storage,
                byte_offset=offset,
                num_blocks=blocks,
                page_bytes=part,
                block_stride_bytes=stride if is_packed and (stride or rows) else part,
                group=group,
                region=region,
            )
    registration = _register(planned, page_bytes, active, source="block_views")
    process.learn_layers(kv_caches)  # known memory for the process guard, when it is on
    return registration


def _refuse_kv_first(layer: str, tensor: torch.Tensor, num_blocks: int, page: int) -> None:
    """Refuse one tensor whose outermost axis is K/V, not blocks (FlashAttention's per-layer
    ``(2, num_blocks, block_tokens, heads, head_dim)``): cut into ``(num_blocks, page)`` rows it
    would give rows that each hold K of two blocks, V of block 0 far down, silently."""
    if tensor.dim() < 3 or tensor.shape[0] != 2 or num_blocks == 2:
        return
    strides = tensor.stride()
    if strides[0] < strides[1] * tensor.shape[1]:  # K/V is not the outermost axis
        return
    itemsize = tensor.element_size()
    half = strides[1] * itemsize
    raise ArgumentError(
        f"layer {layer!r}: its cache tensor has shape {tuple(tensor.shape)} and strides "
        f"{strides} (in {itemsize}-byte elements): shape[0] == 2 != num_blocks={num_blocks} "
        "and that axis is the outermost, a K/V-first layout (the K of every block, then the V "
        f"of every block), which rows of {page:,} bytes, one per block, would cut wrongly (row "
        "i would hold the K of blocks 2i and 2i+1). Pass K and V as two tensors, "
        f"kv_caches[{layer!r}] = [cache[0], cache[1]]: each gets half the page (the K or the V "
        f"of one block, {half:,} bytes here)"
    )


def _register(
    planned: _Planned, page_bytes: dict[str, int], active: Policy, *, source: str
) -> Registration:
    """Judge the planned views once, report, and make them: the shared second half of
    ``block_views`` and ``safeview.vllm.check_registration``."""
    storages = planned.storages
    report = check_views(storages.records(), planned.records, checks=active is not Policy.OFF)
    _report(report, storages, active, layers=len(page_bytes), source=source)
    int8 = _torch.dtype("int8")
    bases = {
        name: _torch.base_tensor(None, storage, int8) for name, storage in storages.objects.items()
    }
    past_end = {f.views[0] for f in report.findings if f.kind == "out_of_bounds"}
    made: list[torch.Tensor] = []
    for record in planned.records:
        try:
            view = _torch.strided_view(
                bases[record.storage], record.shape, record.strides, record.byte_offset
            )
        except RuntimeError as error:
            if record.name not in past_end:
                raise
            # warn (or off): torch refuses a view past the end of a cpu or cuda storage, and
            # safeview never grows one; the error names every view that is past its end
            found = [f for f in report.findings if f.kind == "out_of_bounds"]
            [finding] = [f for f in found if f.views[0] == record.name]
            others = [f for f in found if f is not finding]
            raise _bounds_error(finding, storages, active, others) from error
        made.append(view)
    return Registration(
        _per_layer(page_bytes, planned.layers, made),
        page_bytes,
        report,
        {name: facts.device for name, facts in storages.facts.items()},
        active,
        dict(storages.facts),
    )


def _per_layer(
    page_bytes: Mapping[str, int], layers: Sequence[str], views: Sequence[torch.Tensor]
) -> dict[str, tuple[torch.Tensor, ...]]:
    """Each layer's views, in order, as one tuple per layer."""
    if len(layers) == len(page_bytes):  # one view per layer, the usual case
        return {layer: (view,) for layer, view in zip(layers, views)}
    grouped: dict[str, list[torch.Tensor]] = {layer: [] for layer in page_bytes}
    for layer, view in zip(layers, views):
        grouped[layer].append(view)
    return {layer: tuple(group) for layer, group in grouped.items()}


def _bounds_error(
    finding: Finding,
    storages: _Storages,
    active: Policy,
    more: Sequence[Finding] = (),
    also: str = "",
) -> BoundsError:
    assert finding.storage is not None
    facts = storages.facts[finding.storage]
    return BoundsError(
        finding,
        storage_nbytes=facts.nbytes,
        device=facts.device,
        policy=active.value,
        more=more,
        also=also,
    )


def _running_on(
    outside: Sequence[Finding], overlaps: Sequence[Finding], views: Sequence[ViewRecord]
) -> str:
    """The words a ``BoundsError`` adds for the views, other than those past a bound, whose
    pages run on into a neighbour's: with one wrong page size in every layer of a packed group,
    only the last layer's runs past the end of the storage, and every other layer's runs into
    the next one's (which strict would otherwise never say, raising for the bound first)."""
    if not overlaps:
        return ""
    records = {view.name: view for view in views}

    def runs_on(name: str, byte: int | None) -> bool:
        """Whether ``name``'s page that holds ``byte``, the lowest byte it shares with the
        other view, starts before it (the other view's page starts there: this one runs on)."""
        view = records.get(name)
        if view is None or byte is None or len(view.strides) != 2 or view.strides[1] != 1:
            return True  # not a block view: both views of the pair are named
        stride = view.strides[0] * view.itemsize
        return (byte - view.byte_offset) % stride != 0 if stride else byte != view.byte_offset

    named = {finding.views[0] for finding in outside}
    onto: dict[str, str] = {}  # a view that runs on -> the first view it runs into
    for finding in overlaps:
        if finding.kind == "self_overlap":
            onto.setdefault(finding.views[0], finding.views[0])
            continue
        for name, other in (finding.views, finding.views[::-1]):
            if name not in named and runs_on(name, finding.byte):
                onto.setdefault(name, other)
    if not onto:
        return ""
    shown = [
        f"{name!r} into {other!r}" if name != other else f"{name!r} into its own pages"
        for name, other in sorted(onto.items())[:3]
    ]
    if len(onto) > len(shown):
        shown.append(f"{len(onto) - len(shown)} more")
    count = len(onto)
    text = (
        f"; and {count} more view{'s' if count != 1 else ''} "
        f"run{'' if count != 1 else 's'} into a neighbour's bytes ({', '.join(shown)})"
    )
    wrong = len(named) + count
    if wrong == len(views) and wrong > 1:
        first = outside[0].views[0]
        text += (
            f": all {wrong} views are wrong, so the page size is likely wrong in every layer, "
            f"not in {first!r} alone"
        )
    return text


def _report(
    report: Report, storages: _Storages, active: Policy, *, layers: int, source: str
) -> None:
    """Log every finding, then the summary; under strict, raise for the findings."""
    strict = active is Policy.STRICT
    bounds = report.of_kind("out_of_bounds", "out_of_region")
    overlaps = report.of_kind("self_overlap", "overlap")
    if bounds and log.enabled(logging.WARNING):
        views = {view.name: view for view in report.views}
        for finding in bounds:
            view = views[finding.views[0]]
            facts = storages.facts[view.storage]
            log.bounds_violation(
                finding,
                strict=strict,
                policy=active.value,
                device=facts.device,
                storage_nbytes=facts.nbytes,
                geometry=_record_geometry(view),
                region=view.region,
            )
    for finding in overlaps:
        log.overlap_violation(finding, strict=strict, policy=active.value)
    log.registration_checked(report, policy=active.value, layers=layers, source=source)
    if strict and bounds:
        also = _running_on(bounds, overlaps, report.views)
        raise _bounds_error(bounds[0], storages, active, bounds[1:], also)
    if strict and overlaps:
        raise OverlapError(overlaps, policy=active.value)


def _record_geometry(view: ViewRecord) -> dict[str, Any]:
    if view.is_block and view.dtype is None:
        return log.block_geometry(view.byte_offset, view.shape[0], view.shape[1], view.strides[0])
    dtype = view.dtype or f"{view.itemsize}-byte"
    return log.strided_geometry(view.byte_offset, dtype, view.shape, view.strides)


def check_tensors(
    kv_caches: KvCaches,
    *,
    groups: Mapping[str, Hashable] | None = None,
    policy: PolicyArg | None = None,
) -> Report:
    """Check the tensors of ``kv_caches`` as they are: each inside its storage and not touching
    an element twice, and none sharing a byte with another of its group (layers without a group
    share with none), across storage objects over the same memory too. Under strict, raises
    ``BoundsError`` or ``OverlapError``; under warn, logs. ``groups`` may name layers this call
    does not get (a config's map of every layer); those keys are left aside. A layer missing
    from ``groups`` shares with none, so a misspelt name can give a false overlap, never hide one.
    """
    active = current_policy(policy)
    kv_caches = _as_mapping(kv_caches, "kv_caches")
    if groups is not None and not isinstance(groups, Mapping):
        raise ArgumentError(
            f"groups must map layer names to their KV-cache group; got {type(groups).__name__}"
        )
    storages = _Storages()
    records = []
    for layer, value in kv_caches.items():
        tensors = _tensors(layer, value)
        for index, tensor in enumerate(tensors):
            byte_offset, shape, strides, itemsize = _torch.geometry(tensor)
            records.append(
                ViewRecord(
                    layer if len(tensors) == 1 else f"{layer}[{index}]",
                    storages.name(_torch.storage_of(tensor)),
                    byte_offset,
                    shape,
                    strides,
                    itemsize,
                    groups.get(layer) if groups is not None else None,
                    None,
                    _torch.dtype_name(tensor.dtype),
                )
            )
    report = check_views(storages.records(), records, checks=active is not Policy.OFF)
    _report(report, storages, active, layers=len(kv_caches), source="check_tensors")
    process.learn_layers(kv_caches)  # known memory for the process guard, when it is on
    return report


F = TypeVar("F", bound=Callable[..., Any])
GroupsArg = Mapping[str, Hashable] | Callable[[Any], Mapping[str, Hashable] | None] | None


@overload
def guard_registration(
    method: F, *, groups: GroupsArg = None, policy: PolicyArg | None = None
) -> F: ...
@overload
def guard_registration(
    method: None = None, *, groups: GroupsArg = None, policy: PolicyArg | None = None
) -> Callable[[F], F]: ...
def guard_registration(
    method: F | None = None,
    *,
    groups: GroupsArg = None,
    policy: PolicyArg | None = None,
) -> F | Callable[[F], F]:
    """Decorate a connector's ``register_kv_caches(self, kv_caches, ...)``: the incoming tensors
    are checked with ``check_tensors`` before it runs, and the method runs under ``sanitize()``
    told the layers and their groups, so every view it makes is checked before it is made, and a
    view made from one layer's cache on another layer's bytes of the same group is refused::

        class MyConnector:
            @guard_registration(groups=lambda self: self.layer_groups)
            def register_kv_caches(self, kv_caches): ...

    ``kv_caches`` is a mapping of layer names to a tensor or a list of tensors, or a list of
    them (layers named ``"0"``, ``"1"``, ...). ``groups`` is a mapping, or a function of the
    connector that returns one (the KV-cache config is usually known only once the connector
    exists). ``async def`` methods are checked for the whole of their run.
    """
    from safeview.guard.sanitize import Sanitizer, _decorate

    def decorate(function: F) -> F:
        def make(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if len(args) < 2 and "kv_caches" not in kwargs:
                raise ArgumentError(
                    "guard_registration decorates a method called as "
                    "register_kv_caches(self, kv_caches, ...); it got no kv_caches"
                )
            self = args[0]
            kv_caches = args[1] if len(args) > 1 else kwargs["kv_caches"]
            resolved = groups(self) if callable(groups) else groups
            caches = _as_mapping(kv_caches, "kv_caches")
            check_tensors(caches, groups=resolved, policy=policy)
            return Sanitizer(policy, layers=caches, groups=resolved)

        return _decorate(function, make)

    return decorate(method) if method is not None else decorate
