"""``make_view``: a checked layout becomes a view of the target's storage.

The one view it makes is judged by the checker's bounds rule (``safeview.check.bounds``) under
the policy in force; the layout itself was judged against itself when it was built. torch is
reached only through ``safeview._torch.view_of``, told whether the view fits the storage.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from safeview import _torch, log
from safeview.check import bounds
from safeview.errors import ArgumentError, BoundsError
from safeview.policy import Policy, PolicyArg, current_policy
from safeview.spec import BlockLayout, Layout, Region, StridedLayout, region_span

if TYPE_CHECKING:
    import torch

__all__ = ["make_view"]

_Tensor = _torch.Tensor
_UNTYPED = _torch.UntypedStorage
_STRIDED = _torch._STRIDED
_BY_NAME = {policy.value: policy for policy in Policy}
_STRICT, _OFF = Policy.STRICT, Policy.OFF
_debug_enabled = log.stdlib_logger.isEnabledFor  # log.enabled, one call less per view


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
    ``ArgumentError`` for a target or layout of the wrong kind, or a region that is not a byte
    range.

    The storage is never resized, moved or copied: a view that fits it is placed on it with one
    four-argument ``set_`` (which grows only a storage too small for the view), or ``as_strided``
    of ``target`` itself; one that does not fit (under ``warn`` or ``off``) is made by
    ``as_strided``, which torch refuses on cpu and cuda and makes on meta.
    """
    if type(policy) is Policy:
        active = policy
    else:
        known = _BY_NAME.get(policy) if type(policy) is str else None
        active = known if known is not None else current_policy(policy)
    kind = type(layout)
    if (
        kind is not BlockLayout
        and kind is not StridedLayout
        and not isinstance(layout, (BlockLayout, StridedLayout))
    ):
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
    span = None if region is None else region_span(region)

    extent = layout.extent_bytes
    nbytes = storage.nbytes()
    if active is not _OFF and (span is not None or extent > nbytes):
        found = bounds(
            name,
            storage=None,
            byte_offset=layout.byte_offset,
            extent_bytes=extent,
            storage_nbytes=nbytes,
            region=span,
        )
        if found:
            strict = active is _STRICT
            device = str(storage.device)
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

    # `fits`: the view needs no byte past the storage's end, so torch may place it in one call
    # (safeview._torch.view_of); a view that does not fit, under warn or off, never gets there.
    try:
        view = _torch.view_of(
            tensor,
            storage,
            layout.dtype,
            layout.shape,
            layout.strides,
            layout.element_offset,
            extent <= nbytes,
        )
    except RuntimeError as error:
        if active is _OFF or extent <= nbytes:
            raise
        raise BoundsError(
            bounds(
                name,
                storage=None,
                byte_offset=layout.byte_offset,
                extent_bytes=extent,
                storage_nbytes=nbytes,
            )[0],
            storage_nbytes=nbytes,
            device=str(storage.device),
            policy=active.value,
            layout=layout,
        ) from error

    if _debug_enabled(logging.DEBUG):
        log.view_created(
            name=name,
            policy=active.value,
            device=str(storage.device),
            storage_nbytes=nbytes,
            geometry=_geometry(layout),
            extent_bytes=extent,
            region=span,
        )
    return view
