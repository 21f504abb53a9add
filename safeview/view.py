"""The torch boundary: a checked layout becomes an ``as_strided`` view of the target's storage.

This is the only module of the core that imports torch. It never calls the four-argument
``Tensor.set_`` (which reallocates a resizable storage that is too small), never copies and never
resizes: the storage's ``data_ptr()`` and ``nbytes()`` are the same after every call as before.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from safeview import log
from safeview.check import Violation, bounds_violations
from safeview.errors import ArgumentError, BoundsError
from safeview.policy import Policy, current_policy
from safeview.spec import BlockLayout, Layout, Region, StridedLayout

__all__ = ["event_fields", "log_bounds_violations", "make_view", "storage_of", "strided_view"]

_DTYPES: dict[str, torch.dtype] = {}
_logger = log.stdlib_logger
_STRIDED = torch.strided
_UNTYPED = torch.UntypedStorage


def _torch_dtype(name: str) -> torch.dtype:
    dtype = _DTYPES.get(name)
    if dtype is None:
        dtype = _DTYPES[name] = getattr(torch, name)
    return dtype


def storage_of(target: torch.Tensor | torch.UntypedStorage) -> torch.UntypedStorage:
    """The untyped storage a target's offsets count from; ``ArgumentError`` for anything else."""
    if isinstance(target, torch.Tensor):
        if target.layout is not torch.strided:
            raise ArgumentError(
                f"target must be a strided tensor; got a tensor with layout {target.layout}"
            )
        return target.untyped_storage()
    if isinstance(target, torch.UntypedStorage):
        return target
    hint = " (pass its .untyped())" if isinstance(target, torch.TypedStorage) else ""
    raise ArgumentError(
        "target must be a torch.Tensor or a torch.UntypedStorage; "
        f"got {type(target).__name__}{hint}"
    )


def _event_fields(
    name: str | None,
    policy: Policy,
    layout: Layout,
    storage: torch.UntypedStorage,
    region: Region | None,
) -> dict[str, Any]:
    return event_fields(
        name, policy, layout.describe(), layout.extent_bytes, storage=storage, region=region
    )


def event_fields(
    name: str | None,
    policy: Policy,
    described: dict[str, Any],
    extent_bytes: int,
    *,
    storage: torch.UntypedStorage,
    region: Region | None = None,
) -> dict[str, Any]:
    """The fields of ``view_created`` and ``bounds_violation`` (see the README's event table)."""
    nbytes = storage.nbytes()
    limit = nbytes if region is None else min(nbytes, region.end_byte)
    fields: dict[str, Any] = {
        "name": name,
        "policy": policy.value,
        "device": str(storage.device),
        "storage_nbytes": nbytes,
        **described,
        "extent_bytes": extent_bytes,
        "limit_bytes": limit,
        "slack_bytes": limit - extent_bytes,
    }
    if region is not None:
        fields["region"] = region.as_list()
    return fields


def log_bounds_violations(
    violations: Sequence[Violation],
    *,
    level: int,
    name: str | None,
    policy: Policy,
    described: dict[str, Any],
    extent_bytes: int,
    storage: torch.UntypedStorage,
    region: Region | None = None,
) -> None:
    """One ``bounds_violation`` event per broken bound, if ``level`` is enabled."""
    if not log.enabled(level):
        return
    for violation in violations:
        fields = event_fields(name, policy, described, extent_bytes, storage=storage, region=region)
        fields.update(violation.fields())
        log.emit(level, "bounds_violation", fields)


def strided_view(
    tensor: torch.Tensor | None,
    storage: torch.UntypedStorage,
    dtype_name: str,
    shape: Sequence[int],
    strides: Sequence[int],
    element_offset: int,
) -> torch.Tensor:
    """``torch.as_strided`` over ``storage``, the one call that makes every view: directly on
    ``tensor`` when it has the dtype already, else on a one-argument ``set_`` of the storage,
    which views the storage as it is and never resizes it. Checks nothing itself."""
    dtype = _DTYPES.get(dtype_name) or _torch_dtype(dtype_name)
    if tensor is not None and tensor.dtype is dtype:
        base = tensor
    else:
        base = torch.empty(0, dtype=dtype, device=storage.device).set_(storage)
    return torch.as_strided(base, shape, strides, element_offset)


def make_view(
    target: torch.Tensor | torch.UntypedStorage,
    layout: Layout,
    *,
    name: str | None = None,
    policy: Policy | str | None = None,
    region: Region | Sequence[int] | None = None,
) -> torch.Tensor:
    """A view of ``target``'s storage with ``layout``'s dtype, shape, strides and offset, checked
    first under the policy in force.

    Offsets count from byte 0 of the untyped storage, whatever tensor of it you pass (vLLM's
    ``byte_offset = t.storage_offset() * t.element_size()``). ``region=(start, end)`` is the byte
    range this view must stay inside.

    >>> kv = torch.zeros(4 * 1024, dtype=torch.int8)
    >>> layer = BlockLayout(num_blocks=4, page_bytes=512, block_stride_bytes=1024, byte_offset=512)
    >>> make_view(kv, layer, name="layer.1").stride()
    (1024, 1)

    Raises ``BoundsError`` when a bound is broken under ``strict`` (before torch is called), and
    under ``warn`` when torch then refuses the view too; ``ConfigError`` for an unknown policy;
    ``ArgumentError`` for a target or layout of the wrong kind.
    """
    active = policy if type(policy) is Policy else current_policy(policy)
    if not isinstance(layout, (BlockLayout, StridedLayout)):
        raise ArgumentError(
            f"layout must be a safeview BlockLayout or StridedLayout; got {type(layout).__name__}"
        )
    if type(target) is _UNTYPED:
        tensor, storage = None, target
    else:
        tensor = target if isinstance(target, torch.Tensor) else None
        storage = (
            tensor.untyped_storage()
            if tensor is not None and tensor.layout is _STRIDED
            else storage_of(target)
        )
    if region is not None:
        region = Region.coerce(region)

    extent = layout.extent_bytes
    if active is not Policy.OFF and (region is not None or extent > storage.nbytes()):
        violations = bounds_violations(
            name=name,
            byte_offset=layout.byte_offset,
            extent_bytes=extent,
            storage_nbytes=storage.nbytes(),
            region=region,
        )
        if violations:
            _check_failed(violations, active, name, layout, storage, region)

    try:
        view = strided_view(
            tensor, storage, layout.dtype, layout.shape, layout.strides, layout.element_offset
        )
    except RuntimeError as error:
        if active is Policy.OFF or extent <= storage.nbytes():
            raise
        violation = bounds_violations(
            name=name,
            byte_offset=layout.byte_offset,
            extent_bytes=extent,
            storage_nbytes=storage.nbytes(),
        )[0]
        raise BoundsError(
            violation,
            layout=layout,
            storage_nbytes=storage.nbytes(),
            device=str(storage.device),
            policy=active.value,
        ) from error

    if _logger.isEnabledFor(logging.DEBUG):
        log.emit(
            logging.DEBUG, "view_created", _event_fields(name, active, layout, storage, region)
        )
    return view


def _check_failed(
    violations: Sequence[Violation],
    active: Policy,
    name: str | None,
    layout: Layout,
    storage: torch.UntypedStorage,
    region: Region | None,
) -> None:
    """Log the broken bounds; under strict, raise for the first."""
    strict = active is Policy.STRICT
    log_bounds_violations(
        violations,
        level=logging.ERROR if strict else logging.WARNING,
        name=name,
        policy=active,
        described=layout.describe(),
        extent_bytes=layout.extent_bytes,
        storage=storage,
        region=region,
    )
    if strict:
        raise BoundsError(
            violations[0],
            layout=layout,
            storage_nbytes=storage.nbytes(),
            device=str(storage.device),
            policy=active.value,
        )
