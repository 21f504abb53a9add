"""``make_view``: a checked layout becomes an ``as_strided`` view of the target's storage.

The one view it makes is judged by the checker's bounds rule (``safeview.check.bounds``) under
the policy in force; the layout itself was judged against itself when it was built. torch is
reached only through ``safeview._torch``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from safeview import _torch, log
from safeview.check import bounds
from safeview.errors import ArgumentError, BoundsError
from safeview.policy import Policy, PolicyArg, current_policy
from safeview.spec import BlockLayout, Layout, Region, StridedLayout

if TYPE_CHECKING:
    import torch

__all__ = ["make_view"]

_Tensor = _torch.Tensor
_UNTYPED = _torch.UntypedStorage
_STRIDED = _torch._STRIDED


def _geometry(layout: Layout) -> dict[str, object]:
    if type(layout) is BlockLayout:
        return log.block_geometry(
            layout.byte_offset, layout.num_blocks, layout.page_bytes, layout.block_stride_bytes
        )
    return log.strided_geometry(layout.byte_offset, layout.dtype, layout.shape, layout.strides)


def make_view(
    target: torch.Tensor | torch.UntypedStorage,
    layout: Layout,
    *,
    name: str | None = None,
    policy: PolicyArg | None = None,
    region: Region | Sequence[int] | None = None,
) -> torch.Tensor:
    """A view of ``target``'s storage with ``layout``'s dtype, shape, strides and offset, checked
    first under the policy in force.

    Offsets count from byte 0 of the untyped storage, whatever tensor of it you pass (vLLM's
    ``byte_offset = t.storage_offset() * t.element_size()``), and the view reads the storage's
    bytes as they are (a tensor's lazy conjugate or negative bit is not inherited).
    ``region=(start, end)`` is the byte range this view must stay inside.

    >>> import torch
    >>> kv = torch.zeros(4 * 1024, dtype=torch.int8)
    >>> layer = BlockLayout(num_blocks=4, page_bytes=512, block_stride_bytes=1024, byte_offset=512)
    >>> make_view(kv, layer, name="layer.1").stride()
    (1024, 1)

    Raises ``BoundsError`` when a bound is broken under ``strict`` (before torch is called), and
    under ``warn`` when torch then refuses the view too; ``ConfigError`` for an unknown policy;
    ``ArgumentError`` for a target or layout of the wrong kind.
    """
    active = policy if type(policy) is Policy else current_policy(policy)
    if type(layout) is not BlockLayout and not isinstance(layout, (BlockLayout, StridedLayout)):
        raise ArgumentError(
            f"layout must be a safeview BlockLayout or StridedLayout; got {type(layout).__name__}"
        )
    if type(target) is _UNTYPED:
        tensor, storage = None, target
    elif type(target) is _Tensor and target.layout is _STRIDED:
        tensor, storage = target, target.untyped_storage()
    else:
        storage = _torch.storage_of(target)
        tensor = target if isinstance(target, _Tensor) else None
    span = None
    if region is not None:
        span = region.as_tuple() if type(region) is Region else Region.coerce(region).as_tuple()

    extent = layout.extent_bytes
    if active is not Policy.OFF and (span is not None or extent > storage.nbytes()):
        found = bounds(
            name,
            storage=None,
            byte_offset=layout.byte_offset,
            extent_bytes=extent,
            storage_nbytes=storage.nbytes(),
            region=span,
        )
        if found:
            strict = active is Policy.STRICT
            device, nbytes = str(storage.device), storage.nbytes()
            geometry = _geometry(layout)
            for finding in found:
                log.bounds_violation(
                    finding,
                    strict=strict,
                    policy=active.value,
                    device=device,
                    storage_nbytes=nbytes,
                    geometry=geometry,
                    region=span,
                )
            if strict:
                raise BoundsError(
                    found[0],
                    storage_nbytes=nbytes,
                    device=device,
                    policy=active.value,
                    layout=layout,
                )

    try:
        view = _torch.view_of(
            tensor, storage, layout.dtype, layout.shape, layout.strides, layout.element_offset
        )
    except RuntimeError as error:
        if active is Policy.OFF or extent <= storage.nbytes():
            raise
        raise BoundsError(
            bounds(
                name,
                storage=None,
                byte_offset=layout.byte_offset,
                extent_bytes=extent,
                storage_nbytes=storage.nbytes(),
            )[0],
            storage_nbytes=storage.nbytes(),
            device=str(storage.device),
            policy=active.value,
            layout=layout,
        ) from error

    if log.enabled(logging.DEBUG):
        log.view_created(
            name=name,
            policy=active.value,
            device=str(storage.device),
            storage_nbytes=storage.nbytes(),
            geometry=_geometry(layout),
            extent_bytes=extent,
            region=span,
        )
    return view
