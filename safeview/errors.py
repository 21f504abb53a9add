"""The one exception hierarchy of safeview. Depends on nothing else of the package.

Every error is named after the invariant it protects and carries its numbers as attributes, so a
program can act on them and a person can read them in the message::

    SafeViewError
    ├── BoundsError     a view reaches past its storage or outside its declared region
    ├── OverlapError    views that must not share bytes do
    ├── AddressError    a descriptor for a transfer engine misses the pages it must hit
    ├── CoverageError   a layer to be transferred is in no descriptor prepared for it
    ├── FailureIgnoredError  a call depends on a registration or transfer the engine failed
    ├── UnprovenWriteError  sanitize() cannot tell whether an op grows a storage others use
    ├── ManifestError   a layout manifest cannot be derived or read (an axis of unknown meaning)
    ├── LayoutMismatchError  two parties read the same bytes differently (``safeview.diff``)
    ├── ConfigError     a policy or environment variable has a value safeview does not know
    └── ArgumentError   an argument of the wrong kind or value (also a TypeError and a ValueError)
        └── SpecError   a model's field given a value it refuses (also pydantic's ValidationError)

``BoundsError`` and ``OverlapError`` are built from ``safeview.findings.Finding`` objects, never
by deriving the facts again. Invalid fields given to a model's constructor (``BlockLayout``,
``StridedLayout``, ``Region``, ``Plan``) raise ``safeview.spec.SpecError``, which is pydantic's
``ValidationError`` too (its ``errors()`` name the field, the value and the limit).
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
    "CoverageError",
    "FailureIgnoredError",
    "LayoutMismatchError",
    "ManifestError",
    "OverlapError",
    "SafeViewError",
    "UnprovenWriteError",
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

    Attributes: ``finding`` (the first ``Finding``), ``findings`` (every view found outside its
    storage or region by one check, the first first; the message names the others), ``kind``,
    ``check``, ``name``, ``byte_offset``
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
        more: Sequence[Finding] = (),
        also: str = "",
    ) -> None:
        self.finding = finding
        self.findings = (finding, *more)
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
        tail = ""
        if more:  # every other view that breaks a bound, named (the first 10), then counted
            names = [repr(other.views[0]) for other in more[:10] if other.views]
            rest = len(more) - len(names)
            tail = f"; and {len(more)} more view{'s' if len(more) != 1 else ''} outside " + (
                "their storage or region: "
                + ", ".join(names)
                + (f" and {rest} more" if rest else "")
            )
        # ``also``: what else the same check found, in words (views that overlap their
        # neighbours too, when one wrong page size runs through every layer)
        super().__init__(
            f"{finding.message}{_where(site, op)} [device {device}, policy {policy}]{tail}{also}"
        )


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


class ManifestError(SafeViewError, ValueError):
    """A layout manifest that cannot be derived or read (``safeview.describe``, ``Manifest``):
    an axis whose meaning was not given, strides that do not nest, a file of another schema.

    ``field`` names what is wrong (``layers['model.layers.0'].axes[2]``), ``value`` the
    offending value and ``limit`` what would have been accepted."""

    def __init__(self, field: str, value: object, limit: str) -> None:
        self.field = field
        self.value = value
        self.limit = limit
        # the value is shown short (a whole manifest can be the value pydantic refuses), and not
        # at all when there is none (a path that cannot be read)
        shown = "" if value is None else f"{_brief(value)} "
        super().__init__(f"{field}: {shown}{limit}")


def _brief(value: object, width: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= width else f"{text[: width - 3]}..."


class LayoutMismatchError(SafeViewError):
    """Two parties read the same bytes differently: ``safeview.diff`` found a layer whose
    receiver reads a byte as something else than what its sender wrote there, or a layer only
    one side has. ``report`` is the ``DiffReport``; ``findings`` its findings; ``layer`` and
    ``byte`` those of the first."""

    def __init__(self, report: Any) -> None:
        self.report = report
        self.findings = tuple(report.findings)
        first = self.findings[0] if self.findings else None
        self.layer = getattr(first, "layer", None)
        self.byte = getattr(first, "byte", None)
        more = len(self.findings) - 1
        tail = f"; and {more} more finding{'s' if more != 1 else ''}" if more > 0 else ""
        super().__init__(f"{getattr(first, 'message', 'layouts differ')}{tail}")


class DigestMismatchError(SafeViewError):
    """What a sender digested and what a receiver holds mean different things
    (``safeview.verify``): ``findings`` (``digest`` and ``digest_unmatched`` findings), ``layer``
    and ``heads`` those of the first, ``request`` the request they are about (or ``None``)."""

    def __init__(self, findings: Any, request: str | None = None) -> None:
        self.findings = tuple(findings)
        self.request = request
        first = self.findings[0] if self.findings else None
        self.layer = getattr(first, "layer", None)
        self.heads = tuple(getattr(first, "heads", ()))
        more = len(self.findings) - 1
        tail = f"; and {more} more finding{'s' if more != 1 else ''}" if more > 0 else ""
        about = f"request {request}: " if request is not None else ""
        super().__init__(f"{about}{getattr(first, 'message', 'digests differ')}{tail}")


class UnprovenWriteError(SafeViewError):
    """``sanitize()`` cannot tell what an op would write into a storage that other tensors use
    (an ``out=`` tensor of an op that meta cannot run and that cannot be run once more on
    stand-ins: a random op, an op that is not torch's own, an op that failed on the stand-ins),
    so under strict it refuses the op before it runs; under warn it says so and lets it run.

    Carries no finding (it is about an op, not a view). Attributes: ``op`` (``aten::nonzero
    (out=)``: the op and the argument), ``name`` (the layer whose cache the tensor is, when the
    sanitizer knows it, else ``None``), ``storage_nbytes``, ``device``, ``policy``, ``reason``
    (why it could not be worked out) and ``site`` (``file:line in function``).
    """

    def __init__(
        self,
        *,
        op: str,
        storage_nbytes: int,
        device: str,
        policy: str,
        reason: str,
        site: str | None = None,
        name: str | None = None,
    ) -> None:
        self.op = op
        self.name = name
        self.storage_nbytes = storage_nbytes
        self.device = device
        self.policy = policy
        self.reason = reason
        self.site = site
        whose = f" (layer {name!r})" if name is not None else ""
        super().__init__(
            f"cannot tell whether {op} grows the storage of {storage_nbytes:,} bytes{whose} "
            f"that other tensors use: {reason}{_where(site, None)} "
            f"[device {device}, policy {policy}]"
        )


class CoverageError(SafeViewError):
    """A layer that a connector is to transfer (or part of one) lies in no descriptor it prepared
    for its transfers: its bytes would never be transferred, and the engine would report every
    transfer done (``safeview.transfer.coverage``).

    Attributes: ``findings`` (one ``unregistered`` finding per layer left out), ``finding`` (the
    first), ``layers`` (the names of the layers left out), ``policy``, ``source`` (the guard that
    checked, such as ``vllm.nixl``).
    """

    def __init__(
        self, findings: Sequence[Finding], *, policy: str, source: str | None = None
    ) -> None:
        self.findings = tuple(findings)
        self.finding = self.findings[0]
        self.layers = tuple(f.layer for f in self.findings)
        self.policy = policy
        self.source = source
        more = len(self.findings) - 1
        tail = f"; and {more} more layer{'s' if more != 1 else ''} left out" if more > 0 else ""
        where = f" (by {source})" if source else ""
        super().__init__(f"{self.finding.message}{where} [policy {policy}]{tail}")


class FailureIgnoredError(SafeViewError):
    """A call to a transfer engine depends on an earlier call that the engine reported failed
    (a registration, a transfer) and that the caller went on from as if it had succeeded:
    a transfer from memory whose registration failed, or a write of bytes whose read failed.

    Attributes: ``source`` (this call, such as ``mooncake.transfer_sync_write``), ``failed``
    (the earlier call), ``status`` (what the engine returned then), ``address`` and ``length``
    (the bytes this call would use), ``layers`` (the layers they belong to), ``policy``.
    """

    def __init__(
        self,
        *,
        source: str,
        failed: str,
        status: object,
        address: int,
        length: int,
        layers: Sequence[str],
        policy: str,
    ) -> None:
        self.source = source
        self.failed = failed
        self.status = status
        self.address = address
        self.length = length
        self.layers = tuple(layers)
        self.policy = policy
        super().__init__(
            failure_ignored_message(source, failed, status, address, length, layers)
            + f" [policy {policy}]"
        )


def failure_ignored_message(
    source: str, failed: str, status: object, address: int, length: int, layers: Sequence[str]
) -> str:
    """The sentence of ``FailureIgnoredError`` and of the ``failure_ignored`` event."""
    of = f" (layers {', '.join(repr(name) for name in layers)})" if layers else ""
    return (
        f"{source} uses {length:,} bytes at address {address:#x}{of} that an earlier "
        f"{failed} left unusable (the engine returned {status!r}) and the caller went on as if "
        "it had succeeded"
    )
