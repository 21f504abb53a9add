"""The one exception hierarchy of safeview.

Every error is named after the invariant it protects and carries its numbers as attributes, so a
program can act on them and a person can read them in the message::

    SafeViewError
    ├── BoundsError     a view reaches past its storage or outside its declared region
    ├── OverlapError    views that must not share bytes do
    ├── ConfigError     a policy or environment variable has a value safeview does not know
    └── ArgumentError   an argument of the wrong kind (also a TypeError and a ValueError)

Invalid layout fields are reported by pydantic's ``ValidationError`` (a ``ValueError``), which names
the field, the value and the limit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from safeview.check import Violation
    from safeview.overlap import Overlap
    from safeview.spec import Layout, Region

__all__ = ["ArgumentError", "BoundsError", "ConfigError", "OverlapError", "SafeViewError"]


class SafeViewError(Exception):
    """Base class of every error safeview raises on purpose."""


class ConfigError(SafeViewError, ValueError):
    """A policy name or an environment variable holds a value safeview does not know.

    ``variable`` is the environment variable (or argument) name, ``value`` the offending value and
    ``allowed`` the values that would have been accepted.
    """

    def __init__(self, variable: str, value: object, allowed: Sequence[str]) -> None:
        self.variable = variable
        self.value = value
        self.allowed = tuple(allowed)
        super().__init__(
            f"{variable}={value!r} is not a valid value; allowed values: {', '.join(self.allowed)}"
        )


class ArgumentError(SafeViewError, TypeError, ValueError):
    """An argument of the wrong kind: a target that is not a tensor or storage, a layout that is not
    a safeview layout, group names that do not match the views."""


class BoundsError(SafeViewError):
    """A view needs bytes outside its storage (``check == "storage"``) or outside the region it was
    given (``check == "region"``).

    Attributes: ``name``, ``check``, ``byte_offset`` (first byte), ``extent_bytes`` (exclusive end),
    ``limit_bytes`` (storage size, or region end), ``overflow_bytes`` (how many bytes of its span
    lie outside), ``storage_nbytes``, ``region``, ``device`` and ``layout``.
    """

    def __init__(
        self,
        violation: Violation,
        *,
        layout: Layout | None,
        storage_nbytes: int,
        device: str,
        policy: str,
    ) -> None:
        self.violation = violation
        self.name = violation.name
        self.check = violation.check
        self.byte_offset = violation.byte_offset
        self.extent_bytes = violation.extent_bytes
        self.limit_bytes = violation.limit_bytes
        self.overflow_bytes = violation.overflow_bytes
        self.region: Region | None = violation.region
        self.layout = layout
        self.storage_nbytes = storage_nbytes
        self.device = device
        self.policy = policy
        super().__init__(f"{violation.message()} [device {device}, policy {policy}]")


class OverlapError(SafeViewError):
    """Views that must not share bytes do: two views of one group, or the pages of one view.
    ``overlaps`` lists every offending pair, each with a byte both touch (a view whose own pages
    overlap appears as a pair of itself); ``messages`` says each in words."""

    def __init__(
        self,
        overlaps: Sequence[Overlap],
        *,
        messages: Sequence[str] | None = None,
        policy: str | None = None,
    ) -> None:
        self.overlaps = tuple(overlaps)
        self.messages = (
            tuple(messages) if messages is not None else tuple(o.message() for o in self.overlaps)
        )
        self.policy = policy
        shown = list(self.messages[:10])
        if len(self.messages) > len(shown):
            shown.append(f"... and {len(self.messages) - len(shown)} more")
        where = f" [policy {policy}]" if policy is not None else ""
        super().__init__(
            f"{len(self.overlaps)} overlap(s) between views that must not share bytes{where}:\n  "
            + "\n  ".join(shown)
        )
