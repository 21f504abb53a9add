"""Whole-cache registration, shaped like the per-layer loop of vLLM's ``register_kv_caches``.

``block_views`` turns the engine's ``kv_caches`` (layer name -> tensor, or list of tensors) into
checked ``(num_blocks, page_bytes)`` int8 views: every view is checked by ``make_view``'s rules
(bounds, region; a view that breaks one goes through ``make_view`` itself, for its event and its
error), and all views of one storage are checked against each other for shared bytes, scoped by
their KV-cache groups. ``guard_registration`` checks the tensors a
connector is handed, as they are, before its own ``register_kv_caches`` runs.
"""

from __future__ import annotations

import functools
import logging
import operator
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple, TypeVar, overload

import torch

from safeview import log
from safeview.check import bounds_violations
from safeview.errors import ArgumentError, BoundsError, OverlapError
from safeview.overlap import Overlap
from safeview.plan import Plan
from safeview.policy import Policy, current_policy
from safeview.report import Finding, Report, ViewRecord, check_views
from safeview.spec import BlockLayout, Positive, Region, Spec
from safeview.view import event_fields, log_bounds_violations, make_view, strided_view

__all__ = [
    "LayerSpec",
    "Registration",
    "block_views",
    "check_tensors",
    "guard_registration",
]

KvCaches = Mapping[str, "torch.Tensor | Sequence[torch.Tensor]"]


class LayerSpec(Spec):
    """safeview's own layer spec: the page size of one block of the layer (all its tensors
    together) and whether its tensors are attention K/V or Mamba-like state."""

    page_bytes: Positive
    kind: Literal["attention", "mamba"] = "attention"


def _page_and_kind(layer: str, spec: object) -> tuple[int, str, BlockLayout | None]:
    if type(spec) is int:
        return spec, "attention", None
    if isinstance(spec, BlockLayout):
        return spec.page_bytes, "explicit", spec
    if isinstance(spec, LayerSpec):
        return spec.page_bytes, spec.kind, None
    if isinstance(spec, int) and not isinstance(spec, bool):
        return spec, "attention", None
    page = getattr(spec, "page_size_bytes", None)
    if page is None or isinstance(page, bool):
        raise ArgumentError(
            f"specs[{layer!r}] must be a page size in bytes, a safeview LayerSpec or BlockLayout, "
            f"or a spec with page_size_bytes; got {type(spec).__name__}"
        )
    # vLLM's MambaSpec carries the state tensors' shapes and dtypes; attention specs do not.
    kind = "mamba" if hasattr(spec, "shapes") and hasattr(spec, "dtypes") else "attention"
    return operator.index(page), kind, None


def _tensors(layer: str, value: object) -> list[torch.Tensor]:
    if type(value) is torch.Tensor and value.layout is torch.strided:
        return [value]
    tensors = [value] if isinstance(value, torch.Tensor) else value
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise ArgumentError(
            f"kv_caches[{layer!r}] must be a tensor or a non-empty list of tensors; "
            f"got {type(value).__name__}"
        )
    for index, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor) or tensor.layout is not torch.strided:
            raise ArgumentError(
                f"kv_caches[{layer!r}][{index}] must be a strided torch.Tensor; "
                f"got {type(tensor).__name__}"
            )
    return list(tensors)


class _Storages:
    """Names the distinct storages behind a set of tensors, in order of first appearance."""

    def __init__(self) -> None:
        self.names: dict[int, str] = {}
        self.storages: dict[str, torch.UntypedStorage] = {}

    def name(self, tensor: torch.Tensor) -> str:
        storage = tensor.untyped_storage()
        key = storage._cdata  # the StorageImpl: one per allocation, also on meta
        name = self.names.get(key)
        if name is None:
            name = self.names[key] = f"storage{len(self.names)}"
            self.storages[name] = storage
        return name

    def nbytes(self) -> dict[str, int]:
        return {name: storage.nbytes() for name, storage in self.storages.items()}


class _Planned(NamedTuple):
    record: ViewRecord
    layer: str
    tensor: torch.Tensor


@dataclass(frozen=True)
class Registration:
    """What ``block_views`` made and found.

    ``tensors_per_block`` is what vLLM's offloading worker consumes: for each layer, its int8
    ``(num_blocks, page_bytes)`` views. ``page_bytes`` is each layer's page size, ``report`` has a
    row per view (extent, slack, storage, group) and every violation.
    """

    tensors_per_block: dict[str, tuple[torch.Tensor, ...]]
    page_bytes: dict[str, int]
    report: Report
    records: tuple[ViewRecord, ...]
    devices: dict[str, str]
    policy: Policy

    @property
    def violations(self) -> tuple[Finding, ...]:
        return self.report.findings

    def to_plan(self, path: str | Path | None = None, *, description: str | None = None) -> Plan:
        """This registration as a plan, written to ``path`` if given, to check and draw offline
        with ``safeview check``."""
        plan = Plan.model_validate(
            {
                "description": description,
                "storages": [
                    {"name": name, "nbytes": nbytes, "device": self.devices[name]}
                    for name, nbytes in self.report.storages.items()
                ],
                "views": [
                    {
                        "name": record.name,
                        "storage": record.storage,
                        "num_blocks": record.shape[0],
                        "page_bytes": record.shape[1],
                        "block_stride_bytes": record.strides[0],
                        "byte_offset": record.byte_offset,
                        "group": _plan_group(record.group),
                        "region": record.region,
                    }
                    for record in self.records
                ],
            }
        )
        if path is not None:
            plan.dump(path)
        return plan


def _plan_group(group: Hashable | None) -> str | int | None:
    """Plans name groups by ``str`` or ``int``; other group keys are written as text."""
    if group is None or (isinstance(group, (str, int)) and not isinstance(group, bool)):
        return group
    return str(group)


def _plan_layer(
    layer: str,
    value: object,
    spec: object,
    *,
    num_blocks: int,
    packed: Collection[str],
    group: Hashable | None,
    region: Region | None,
    storages: _Storages,
) -> tuple[int, list[_Planned]]:
    page, kind, explicit = _page_and_kind(layer, spec)
    tensors = _tensors(layer, value)
    first = tensors[0]
    if explicit is not None:
        record = ViewRecord(
            layer,
            storages.name(first),
            explicit.byte_offset,
            explicit.shape,
            explicit.strides,
            1,
            group,
            region,
        )
        return page, [_Planned(record, layer, first)]
    if kind == "mamba":
        # The state tensors of a block sit one after another in one padded page.
        offset = int(first.storage_offset()) * first.element_size()
        record = ViewRecord(
            layer, storages.name(first), offset, (num_blocks, page), (page, 1), 1, group, region
        )
        return page, [_Planned(record, layer, first)]
    if len(tensors) > 1 and page % len(tensors):
        raise ArgumentError(
            f"layer {layer!r}: its page of {page} bytes does not split evenly over its "
            f"{len(tensors)} K/V tensors"
        )
    part = page // len(tensors)
    is_packed = layer in packed
    views = []
    for index, tensor in enumerate(tensors):
        size = tensor.element_size()
        stride = tensor.stride(0) * size if is_packed and tensor.dim() else part
        record = ViewRecord(
            layer if len(tensors) == 1 else f"{layer}[{index}]",
            storages.name(tensor),
            int(tensor.storage_offset()) * size,
            (num_blocks, part),
            (stride, 1),
            1,
            group,
            region,
        )
        views.append(_Planned(record, layer, tensor))
    return page, views


def _overlap_messages(report: Report) -> tuple[list[Overlap], list[str]]:
    overlaps, messages = [], []
    for finding in report.findings:
        if finding.kind in ("overlap", "self_overlap"):
            first, second = finding.views[0], finding.views[-1]
            overlaps.append(
                Overlap(first, second, finding.numbers["byte"], finding.numbers.get("group"))
            )
            messages.append(finding.message)
    return overlaps, messages


def _log_overlaps(report: Report, active: Policy) -> None:
    level = logging.ERROR if active is Policy.STRICT else logging.WARNING
    if not log.enabled(level):
        return
    for finding in report.findings:
        if finding.kind in ("overlap", "self_overlap"):
            log.emit(
                level,
                "overlap_violation",
                {
                    "kind": finding.kind,
                    "views": list(finding.views),
                    "storage": finding.storage,
                    "byte": finding.numbers["byte"],
                    "group": finding.numbers.get("group"),
                    "policy": active.value,
                    "message": finding.message,
                },
            )


def _raise_or_log(report: Report, active: Policy) -> None:
    """Log the shared bytes; under strict, raise ``OverlapError`` for them."""
    if active is Policy.OFF:
        return
    _log_overlaps(report, active)
    if active is not Policy.STRICT:
        return
    overlaps, messages = _overlap_messages(report)
    if overlaps:
        raise OverlapError(overlaps, messages=messages, policy=active.value)


def _layout(record: ViewRecord) -> BlockLayout:
    return BlockLayout(
        num_blocks=record.shape[0],
        page_bytes=record.shape[1],
        block_stride_bytes=record.strides[0],
        byte_offset=record.byte_offset,
    )


def block_views(
    kv_caches: KvCaches,
    specs: Mapping[str, object],
    *,
    num_blocks: int,
    packed: Collection[str] = (),
    groups: Mapping[str, Hashable] | None = None,
    regions: Mapping[str, Region | Sequence[int]] | None = None,
    policy: Policy | str | None = None,
) -> Registration:
    """Checked int8 block views of every layer of ``kv_caches``; a drop-in for the per-layer loop
    of vLLM's offloading worker.

    - ``specs[layer]``: the layer's page size in bytes, a ``LayerSpec``, an explicit
      ``BlockLayout``, or vLLM's own spec object unchanged (anything with ``page_size_bytes``;
      Mamba-like specs, which carry ``shapes`` and ``dtypes``, are recognised).
    - A single tensor (attention): ``byte_offset = storage_offset * element_size``; the block
      stride is ``stride(0) * element_size`` for layers in ``packed``, else the page.
    - A list of attention tensors (split K/V): one view each, each with its share of the page.
    - A list of Mamba state tensors: one view of contiguous pages from the first state tensor.
    - ``groups[layer]``: the layer's KV-cache group; layers of different groups may share bytes,
      a layer without a group may share with none. ``regions[layer]``: its byte range.

    Under ``strict`` a broken bound raises ``BoundsError`` and shared bytes ``OverlapError``;
    under ``warn`` both are logged and the views are made; ``off`` checks nothing. One
    ``registration_checked`` event (INFO) sums it up.
    """
    active = current_policy(policy)
    storages = _Storages()
    plans: list[_Planned] = []
    page_bytes: dict[str, int] = {}
    for layer, value in kv_caches.items():
        if layer not in specs:
            raise ArgumentError(f"specs has no entry for layer {layer!r}")
        region = regions.get(layer) if regions is not None else None
        page_bytes[layer], planned = _plan_layer(
            layer,
            value,
            specs[layer],
            num_blocks=num_blocks,
            packed=packed,
            group=groups.get(layer) if groups is not None else None,
            region=Region.coerce(region) if region is not None else None,
            storages=storages,
        )
        plans.extend(planned)

    records = [plan.record for plan in plans]
    report = check_views(storages.nbytes(), records, checks=active is not Policy.OFF)
    _summarise(report, records, active, layers=len(page_bytes))
    if active is Policy.STRICT:
        bounds = [f for f in report.findings if f.kind in ("out_of_bounds", "out_of_region")]
        if bounds:
            # make_view raises the BoundsError (and logs it) for the first view that breaks one.
            plan = next(p for p in plans if p.record.name == bounds[0].views[0])
            make_view(
                plan.tensor,
                _layout(plan.record),
                name=plan.record.name,
                policy=active,
                region=plan.record.region,
            )
    _raise_or_log(report, active)

    flagged = {name for finding in report.findings for name in finding.views}
    self_overlapping = {f.views[0] for f in report.findings if f.kind == "self_overlap"}
    views: dict[str, list[torch.Tensor]] = {layer: [] for layer in page_bytes}
    debug = log.enabled(logging.DEBUG)
    for plan in plans:
        record = plan.record
        storage = storages.storages[record.storage]
        if record.name in flagged and record.name not in self_overlapping:
            # make_view logs the broken bound and, where torch refuses, raises BoundsError.
            view = make_view(
                plan.tensor, _layout(record), name=record.name, policy=active, region=record.region
            )
        else:
            # Checked above by the same rules make_view applies (or the policy is off).
            view = strided_view(
                plan.tensor, storage, "int8", record.shape, record.strides, record.byte_offset
            )
            if debug:
                described = {
                    "byte_offset": record.byte_offset,
                    "num_blocks": record.shape[0],
                    "page_bytes": record.shape[1],
                    "block_stride_bytes": record.strides[0],
                }
                log.emit(
                    logging.DEBUG,
                    "view_created",
                    event_fields(
                        record.name,
                        active,
                        described,
                        record.extent_bytes,
                        storage=storage,
                        region=record.region,
                    ),
                )
        views[plan.layer].append(view)
    return Registration(
        {layer: tuple(tensors) for layer, tensors in views.items()},
        page_bytes,
        report,
        tuple(records),
        {name: str(storage.device) for name, storage in storages.storages.items()},
        active,
    )


def _summarise(
    report: Report, records: Sequence[ViewRecord], active: Policy, *, layers: int
) -> None:
    if not log.enabled(logging.INFO):
        return
    slack = [row.slack_bytes for row in report.rows]
    log.emit(
        logging.INFO,
        "registration_checked",
        {
            "policy": active.value,
            "layers": layers,
            "views": len(report.rows),
            "storages": len(report.storages),
            "storage_nbytes": sum(report.storages.values()),
            "bytes_covered": sum(record.nbytes for record in records),
            "min_slack_bytes": min(slack) if slack else None,
            "overlaps": len(report.of_kind("overlap")) + len(report.of_kind("self_overlap")),
            "violations": len(report.findings),
            "checked": active is not Policy.OFF,
        },
    )


def check_tensors(
    kv_caches: KvCaches,
    *,
    groups: Mapping[str, Hashable] | None = None,
    policy: Policy | str | None = None,
) -> Report:
    """Check the tensors of ``kv_caches`` as they are: each inside its storage and not touching
    an element twice, and none sharing a byte with another of its group (layers without a group
    share with none). Under strict, raises ``BoundsError`` or ``OverlapError``; under warn, logs.
    """
    active = current_policy(policy)
    storages = _Storages()
    records = []
    dtypes: dict[str, torch.dtype] = {}
    for layer, value in kv_caches.items():
        tensors = _tensors(layer, value)
        for index, tensor in enumerate(tensors):
            size = tensor.element_size()
            name = layer if len(tensors) == 1 else f"{layer}[{index}]"
            dtypes[name] = tensor.dtype
            records.append(
                ViewRecord(
                    name,
                    storages.name(tensor),
                    int(tensor.storage_offset()) * size,
                    tuple(tensor.shape),
                    tuple(tensor.stride()),
                    size,
                    groups.get(layer) if groups is not None else None,
                )
            )
    report = check_views(storages.nbytes(), records, checks=active is not Policy.OFF)
    if active is Policy.OFF:
        return report
    strict = active is Policy.STRICT
    level = logging.ERROR if strict else logging.WARNING
    first_error: BoundsError | None = None
    for finding in report.of_kind("out_of_bounds"):
        record = next(r for r in records if r.name == finding.views[0])
        storage = storages.storages[record.storage]
        [violation] = bounds_violations(
            name=record.name,
            byte_offset=record.byte_offset,
            extent_bytes=record.extent_bytes,
            storage_nbytes=storage.nbytes(),
        )
        described = {
            "byte_offset": record.byte_offset,
            "dtype": str(dtypes[record.name]).removeprefix("torch."),
            "shape": list(record.shape),
            "strides": list(record.strides),
        }
        log_bounds_violations(
            [violation],
            level=level,
            name=record.name,
            policy=active,
            described=described,
            extent_bytes=record.extent_bytes,
            storage=storage,
        )
        if first_error is None:
            first_error = BoundsError(
                violation,
                layout=None,
                storage_nbytes=storage.nbytes(),
                device=str(storage.device),
                policy=active.value,
            )
    if strict and first_error is not None:
        raise first_error
    _raise_or_log(report, active)
    return report


F = TypeVar("F", bound=Callable[..., Any])
GroupsArg = Mapping[str, Hashable] | Callable[[Any], Mapping[str, Hashable] | None] | None


@overload
def guard_registration(
    method: F, *, groups: GroupsArg = None, policy: Policy | str | None = None
) -> F: ...
@overload
def guard_registration(
    method: None = None, *, groups: GroupsArg = None, policy: Policy | str | None = None
) -> Callable[[F], F]: ...
def guard_registration(
    method: F | None = None,
    *,
    groups: GroupsArg = None,
    policy: Policy | str | None = None,
) -> F | Callable[[F], F]:
    """Decorate a connector's ``register_kv_caches(self, kv_caches, ...)`` so that the incoming
    tensors are checked with ``check_tensors`` before it runs::

        class MyConnector:
            @guard_registration(groups=lambda self: self.layer_groups)
            def register_kv_caches(self, kv_caches): ...

    ``groups`` is a mapping, or a function of the connector that returns one (the KV-cache
    config is usually known only once the connector exists).
    """

    def decorate(function: F) -> F:
        @functools.wraps(function)
        def wrapper(self: Any, kv_caches: KvCaches, *args: Any, **kwargs: Any) -> Any:
            resolved = groups(self) if callable(groups) else groups
            check_tensors(kv_caches, groups=resolved, policy=policy)
            return function(self, kv_caches, *args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate(method) if method is not None else decorate
