"""``sanitize()``: check every view that code we do not own makes, before it is made.

Inside ``with safeview.sanitize() as seen:`` a dispatch mode (``safeview._torch.ViewGuard``, the
same idea as torch's CUDA stream sanitizer) sees every aten op of this thread. For the ops that
place a view on a storage (``aten::set_`` with a storage or tensor and a geometry,
``aten::as_strided``, ``aten::as_strided_``, and an ``aten::resize_`` that would grow a storage
other tensors use) it computes the exact byte extent with the checker's bounds rule and applies
the policy: ``strict`` raises ``BoundsError`` before the op runs, so the storage is never
reallocated; ``warn`` emits ``bounds_violation`` and lets the op run; ``off`` installs nothing.
Every other op, and every correct view, runs as it would without the sanitizer.

Dispatch modes are per thread: a sanitizer sees, and slows, only the thread that entered it.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from safeview import _arith, log
from safeview.check import Report, StorageRecord, ViewRecord, bounds, check_views
from safeview.errors import BoundsError
from safeview.plan import Plan
from safeview.policy import Policy, PolicyArg, current_policy

if TYPE_CHECKING:
    from types import TracebackType

    from safeview._torch import Op

__all__ = ["Sanitizer", "SeenView", "sanitize"]

F = TypeVar("F", bound=Callable[..., Any])


class SeenView(NamedTuple):
    """One view made under a sanitizer: the ``op`` that made it, its ``storage`` (named
    ``storage0``, ``storage1``, ... in order of first sight) on ``device`` with
    ``storage_nbytes`` bytes, its first byte, ``shape`` and ``strides`` in elements of
    ``itemsize`` bytes of type ``dtype``, its exclusive end ``extent_bytes``, and the call site
    (``file``, ``line``, ``function``: the first frame outside torch and safeview)."""

    op: str
    storage: str
    device: str
    storage_nbytes: int
    byte_offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    itemsize: int
    dtype: str
    extent_bytes: int
    file: str
    line: int
    function: str

    @property
    def site(self) -> str:
        """``dir/file.py:line in function``, the last two parts of the path."""
        parts = Path(self.file).parts[-2:]
        return f"{os.path.join(*parts)}:{self.line} in {self.function}"


class Sanitizer:
    """The record of a ``sanitize()`` block: ``views`` lists every view made inside it (also the
    refused one, last), ``policy`` the policy it applied. Use ``sanitize()`` to make one."""

    def __init__(self, policy: PolicyArg | None = None) -> None:
        self._policy_arg = policy
        self.policy: Policy = Policy.STRICT
        self.views: list[SeenView] = []
        self._storages: dict[int, str] = {}
        self._memories: dict[str, StorageRecord] = {}
        self._mode: Any = None

    # -- as a context manager and a decorator -------------------------------------------------

    def __enter__(self) -> Sanitizer:
        self.policy = current_policy(self._policy_arg)
        if self.policy is Policy.OFF:
            return self
        from safeview import _torch  # torch is needed only once a sanitizer is entered

        self._mode = _torch.ViewGuard(self._on_view, self._on_error)
        self._mode.__enter__()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.__exit__(kind, error, traceback)

    def __call__(self, function: F) -> F:
        """Run ``function`` under a fresh sanitizer of the same policy at each call."""

        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with Sanitizer(self._policy_arg):
                return function(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    # -- what the guard hands over ------------------------------------------------------------

    def _on_error(self, error: BaseException) -> None:
        log.internal_error(where="sanitize", error=error)

    def _on_view(self, op: Op) -> None:
        try:
            seen, found = self._judge(op)
        except Exception as error:  # a failure of ours never stops the host's op
            self._on_error(error)
            return
        if not found:
            return
        strict = self.policy is Policy.STRICT
        geometry = _geometry(seen)
        where = {"op": seen.op, "file": seen.file, "line": seen.line, "function": seen.function}
        for finding in found:
            log.bounds_violation(
                finding,
                strict=strict,
                policy=self.policy.value,
                device=seen.device,
                storage_nbytes=seen.storage_nbytes,
                geometry=geometry,
                site=where,
            )
        if strict:
            raise BoundsError(
                found[0],
                storage_nbytes=seen.storage_nbytes,
                device=seen.device,
                policy=self.policy.value,
                op=seen.op,
                site=seen.site,
            )

    def _judge(self, op: Op) -> tuple[SeenView, list[Any]]:
        facts = op.storage
        name = self._storages.get(facts.key)
        if name is None:
            name = self._storages[facts.key] = f"storage{len(self._storages)}"
            self._memories[name] = StorageRecord(facts.nbytes, facts.memory, facts.base)
        negative = op.byte_offset < 0 or min(op.shape + op.strides, default=0) < 0
        extent = (
            op.byte_offset
            if negative
            else _arith.extent_bytes(op.byte_offset, op.shape, op.strides, op.itemsize)
        )
        file, line, function = op.site
        seen = SeenView(
            op.op,
            name,
            facts.device,
            facts.nbytes,
            op.byte_offset,
            op.shape,
            op.strides,
            op.itemsize,
            op.dtype,
            extent,
            file,
            line,
            function,
        )
        self.views.append(seen)
        if negative:  # torch refuses these itself (negative offsets, sizes and strides)
            return seen, []
        found = bounds(
            None,
            storage=None,
            byte_offset=op.byte_offset,
            extent_bytes=extent,
            storage_nbytes=facts.nbytes,
        )
        return seen, found

    # -- afterwards ---------------------------------------------------------------------------

    def _records(self) -> list[ViewRecord]:
        return [
            ViewRecord(
                f"view{index} ({seen.op} at {seen.site})",
                seen.storage,
                seen.byte_offset,
                seen.shape,
                seen.strides,
                seen.itemsize,
                dtype=seen.dtype,
            )
            for index, seen in enumerate(self.views)
        ]

    def report(self) -> Report:
        """Every view seen, judged together by the checker: bounds, each against itself, and
        every pair over one memory (no groups are known here, so any shared byte is reported)."""
        return check_views(self._memories, self._records())

    def to_plan(self, path: str | Path | None = None, *, description: str | None = None) -> Plan:
        """The block-shaped views seen (int8, ``(num_blocks, page_bytes)`` with strides
        ``(block_stride_bytes, 1)``) as a plan for ``safeview check --map``, written to ``path``
        if given. Other views are left out, and the description says how many."""
        records = [record for record in self._records() if record.is_block]
        left_out = len(self.views) - len(records)
        text = description or "views seen by safeview.sanitize()"
        if left_out:
            text += f" ({left_out} views that are not int8 block views left out)"
        devices = {seen.storage: seen.device for seen in self.views}
        sizes = {name: record.nbytes for name, record in self._memories.items()}
        plan = Plan.from_views(sizes, records, devices=devices, description=text)
        if path is not None:
            plan.dump(path)
        return plan


def _geometry(seen: SeenView) -> dict[str, Any]:
    if seen.itemsize == 1 and len(seen.shape) == 2 and seen.strides[1:] == (1,):
        return log.block_geometry(seen.byte_offset, seen.shape[0], seen.shape[1], seen.strides[0])
    return log.strided_geometry(seen.byte_offset, seen.dtype, seen.shape, seen.strides)


def sanitize(policy: PolicyArg | None = None) -> Sanitizer:
    """Check every view made in a block (or a decorated function) before it is made::

        with safeview.sanitize() as seen:
            connector.register_kv_caches(kv_caches)   # code you do not own, unchanged
        seen.views        # every view it made: op, storage, offset, shape, strides, call site
        seen.to_plan("registration.json")   # for: safeview check registration.json --map m.png

    Under ``strict`` (the default) a view past the end of its storage raises ``BoundsError``
    before the op runs, naming the op, the numbers and the call site; under ``warn`` the
    ``bounds_violation`` event says the same and the op runs; ``off`` installs nothing. Views
    that are correct come back exactly as torch makes them. Per thread.
    """
    return Sanitizer(policy)
