"""The one exception hierarchy of safeview. Depends on nothing else of the package.

Every error is named after the invariant it protects and carries its numbers as attributes, so a
program can act on them and a person can read them in the message::

    SafeViewError
    ├── BoundsError     a view reaches past its storage or outside its declared region
    ├── OverlapError    views that must not share bytes do
    ├── AddressError    a descriptor for a transfer engine misses the pages it must hit
    ├── ConfigError     a policy or environment variable has a value safeview does not know
    └── ArgumentError   an argument of the wrong kind or value (also a TypeError and a ValueError)

``BoundsError`` and ``OverlapError`` are built from ``safeview.findings.Finding`` objects, never
by deriving the facts again. Invalid fields given to a model's constructor (``BlockLayout``,
``StridedLayout``, ``Region``, ``Plan``) are reported by pydantic's ``ValidationError`` (a
``ValueError``), which names the field, the value and the limit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from safeview.findings import Finding

__all__ = [
    "AddressError",
    "ArgumentError",
    "BoundsError",
    "ConfigError",
    "OverlapError",
    "SafeViewError",
]


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
    """An argument of the wrong kind or value: a target that is not a tensor or storage, a page
    size that is not a positive integer, vLLM structures safeview does not know. The message names
    the argument, the layer where there is one, and the value."""


def _where(site: str | None, op: str | None) -> str:
    if site is None and op is None:
        return ""
    parts = [f"by {op}" if op else "", f"at {site}" if site else ""]
    return " (" + " ".join(part for part in parts if part) + ")"


class BoundsError(SafeViewError):
    """A view needs bytes outside its storage (``kind == "out_of_bounds"``, ``check ==
    "storage"``) or outside its region (``kind == "out_of_region"``, ``check == "region"``).

    Attributes: ``finding`` (the ``Finding``), ``kind``, ``check``, ``name``, ``byte_offset``
    (first byte), ``extent_bytes`` (exclusive end), ``limit_bytes`` (storage size, or region end),
    ``overflow_bytes`` (bytes of its span outside), ``region``, ``storage_nbytes``, ``device``,
    ``policy``, ``layout`` (the layout given to ``make_view``, else ``None``), and for views seen by
    ``sanitize()`` the ``op`` (``aten::set_``) and the call ``site`` (``file:line in function``).
    """

    def __init__(
        self,
        finding: Finding,
        *,
        storage_nbytes: int,
        device: str,
        policy: str,
        layout: Any = None,
        op: str | None = None,
        site: str | None = None,
    ) -> None:
        self.finding = finding
        self.kind = finding.kind
        self.check = finding.check
        self.name = finding.views[0] if finding.views else None
        self.byte_offset = finding.byte_offset
        self.extent_bytes = finding.extent_bytes
        self.limit_bytes = finding.limit_bytes
        self.overflow_bytes = finding.overflow_bytes
        self.region = finding.region
        self.storage_nbytes = storage_nbytes
        self.device = device
        self.policy = policy
        self.layout = layout
        self.op = op
        self.site = site
        super().__init__(f"{finding.message}{_where(site, op)} [device {device}, policy {policy}]")


class OverlapError(SafeViewError):
    """Views that must not share bytes do: two views of one group, or the pages of one view.

    ``findings`` holds every ``overlap`` and ``self_overlap`` finding, each with the views and a
    byte they share; ``overlaps`` is the same tuple (its older name); ``messages`` says each in
    words."""

    def __init__(self, findings: Sequence[Finding], *, policy: str | None = None) -> None:
        self.findings = tuple(findings)
        self.overlaps = self.findings
        self.messages = tuple(finding.message for finding in self.findings)
        self.policy = policy
        shown = list(self.messages[:10])
        if len(self.messages) > len(shown):
            shown.append(f"... and {len(self.messages) - len(shown)} more")
        where = f" [policy {policy}]" if policy is not None else ""
        super().__init__(
            f"{len(self.findings)} overlap(s) between views that must not share bytes{where}:\n  "
            + "\n  ".join(shown)
        )


class AddressError(SafeViewError):
    """A descriptor handed (or about to be handed) to a transfer engine does not hit whole pages
    of the one layer it should (``safeview.transfer``), or a region is registered twice.

    Attributes: ``finding`` (the first ``Finding``), ``findings`` (all of them), ``kind``
    (``outside_memory``, ``outside_view``, ``partial_page``, ``wrong_layer``,
    ``overlapping_writes`` or ``duplicate_registration``), ``row`` (its index in the list),
    ``address``, ``length`` (bytes), ``device`` (``None`` when the rows carry none), ``layers``
    (the views it touches), ``layer`` (the layer it was meant for), ``policy`` and ``source`` (the
    call that checked it, such as ``nixl.prep_xfer_dlist``).
    """

    def __init__(
        self, findings: Sequence[Finding], *, policy: str, source: str | None = None
    ) -> None:
        self.findings = tuple(findings)
        finding = self.findings[0]
        self.finding = finding
        self.kind = finding.kind
        self.row = finding.rows[0] if finding.rows else None
        self.address = finding.address
        self.length = finding.length_bytes
        self.device = finding.device
        self.layers = finding.views
        self.layer = finding.layer
        self.policy = policy
        self.source = source
        more = len(self.findings) - 1
        tail = f"; and {more} more finding{'s' if more != 1 else ''}" if more else ""
        where = f" (by {source})" if source else ""
        super().__init__(f"{finding.message}{where} [policy {policy}]{tail}")
