"""Structured events through the stdlib logger ``safeview``: one builder per row of the
event table in docs/events.md, and nothing else in the package builds an event.

safeview never configures logging on import: its events reach whatever handlers the application
set up, as a ``key=value`` message (values in JSON) with the event's fields on the record as
``record.safeview_event``, and the record's file and line those of the caller outside safeview.
Where no handler of the application's would see a warning or an error (no logging set up, as
in a plain script), it is written to standard error, one line each, as Python's own last-resort
handler would write it: someone who asked for ``warn`` sees the warnings.
``configure_logging`` (or the environment variable ``SAFEVIEW_LOG_FORMAT``) writes each event
as a JSON or console line, or hands the events to a host's handlers. An event is built only
when its level is enabled, and a handler that fails never changes what safeview returns or
raises.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from contextvars import ContextVar
from datetime import datetime, timezone
from typing import IO, TYPE_CHECKING, Any, Literal

from safeview.errors import ConfigError

if TYPE_CHECKING:
    from safeview.check import Report
    from safeview.findings import Finding

__all__ = [
    "ENV_LOG_FORMAT",
    "ENV_LOG_LEVEL",
    "LOGGER_NAME",
    "EventFormatter",
    "configure_logging",
    "reset_logging",
]

LOGGER_NAME = "safeview"
ENV_LOG_FORMAT = "SAFEVIEW_LOG_FORMAT"
ENV_LOG_LEVEL = "SAFEVIEW_LOG_LEVEL"
FORMATS = ("json", "console")
LEVELS = ("debug", "info", "warning", "error", "critical")

stdlib_logger = logging.getLogger(LOGGER_NAME)


class UnhandledToStderr(logging.Handler):
    """The ``safeview`` logger's own handler, in place of the usual library ``NullHandler``:
    writes a WARNING record to standard error, one line, only when no other handler would get
    it (none on the ``safeview`` logger, none on its ancestors while they propagate; checked at
    each record, so logging set up later takes over). That is when Python's own
    ``logging.lastResort`` would print it, which a ``NullHandler`` turns off: a library's debug
    and info stay quiet, but the warnings of a policy someone chose (``warn``) must be seen.
    ERROR events are left out: each comes just before the exception it describes, which the
    program sees (or catches: a caught error prints nothing). Configures nothing global;
    ``logging.lastResort = None`` silences it as it silences Python's, and so does a handler of
    the application's on the ``safeview`` logger (a ``logging.NullHandler()`` included)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)

    def _shown_elsewhere(self) -> bool:
        # the walk of ``Logger.callHandlers``: a handler counts whatever its level, as it does
        # for the last-resort rule
        logger: logging.Logger | None = stdlib_logger
        while logger is not None:
            if any(handler is not self for handler in logger.handlers):
                return True
            if not logger.propagate:
                return False
            logger = logger.parent
        return False

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR or logging.lastResort is None:
            return
        if self._shown_elsewhere():
            return
        try:
            # standard error as it is now (a test or host may have replaced it)
            sys.stderr.write(f"safeview {record.levelname}: {record.getMessage()}\n")
            sys.stderr.flush()
        except Exception:  # no usable standard error: the event is lost, nothing else
            pass


stdlib_logger.addHandler(UnhandledToStderr())
_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
# Frames skipped to find the caller a record points at: safeview's own, and torch's (the
# dispatcher, for the events the sanitizer emits from inside an op), by the installed torch
# package's folder, not by a folder name: code of the host's under a folder named torch/ is
# the host's.
_torch_dir: list[str] = []


def _skipped() -> tuple[str, ...]:
    if not _torch_dir:
        path = getattr(sys.modules.get("torch"), "__file__", None)
        if not isinstance(path, str):
            return (_PACKAGE,)  # no torch imported yet: no frame of torch's to skip
        _torch_dir.append(os.path.dirname(os.path.abspath(path)) + os.sep)
    return (_PACKAGE, _torch_dir[0])


def enabled(level: int) -> bool:
    """Whether an event at ``level`` would be seen; check this before building one."""
    return stdlib_logger.isEnabledFor(level)


def _message(fields: dict[str, Any]) -> str:
    """``event="view_created" name="layers.0" ...``: the event for a plain handler's line, each
    value written as JSON (so it reads the same in every log and parses back)."""
    return " ".join(f"{key}={json.dumps(value, default=str)}" for key, value in fields.items())


def _caller() -> tuple[str, int, str]:
    """File, line and function of the first frame outside safeview and torch."""
    frame = sys._getframe(2)
    skipped = _skipped()
    while frame.f_back is not None and frame.f_code.co_filename.startswith(skipped):
        frame = frame.f_back
    return frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name


def _emit(level: int, fields: dict[str, Any]) -> None:
    """Send one event, as a record located at the caller outside safeview. Never raises:
    logging must not change safeview's outcome."""
    try:
        path, line, function = _caller()
        record = stdlib_logger.makeRecord(
            LOGGER_NAME,
            level,
            path,
            line,
            _message(fields),
            (),
            None,
            function,
            {"safeview_event": fields},
        )
        stdlib_logger.handle(record)
    except Exception:  # a failing handler, filter or formatter of the host's
        pass


def _group(group: object) -> object:
    """A group as JSON can carry it: a string or an integer as it is, anything else (a float,
    ``inf`` included, a tuple) as its text."""
    if group is None or (isinstance(group, (str, int)) and not isinstance(group, bool)):
        return group
    return str(group)


def _levels(strict: bool) -> int:
    return logging.ERROR if strict else logging.WARNING


# -- counting verdicts, whatever the log level -------------------------------------------------

#: what counts events as they are announced (the vLLM plugin's metrics,
#: ``safeview.vllm._metrics``): each is called with the event's name and its few label fields
#: before the level decides whether the event is built, so that a count never depends on the
#: log level; none by default, and then the events pay one falsy check
_counters: list[Callable[[str, dict[str, Any]], None]] = []


def add_counter(counter: Callable[[str, dict[str, Any]], None]) -> None:
    """Have ``counter(event, labels)`` called for each verdict event (``layout_checked``,
    ``layout_mismatch``, ``digest_checked``, ``digest_mismatch``, ``address_violation``,
    ``internal_error``, ``integration_unavailable``), whatever the log level. Once per
    counter; a counter that raises is ignored."""
    if counter not in _counters:
        _counters.append(counter)


def _count(event: str, **labels: Any) -> None:
    for counter in _counters:
        with suppress(Exception):  # a count must never change what safeview does
            counter(event, labels)


# -- one builder per row of the event table ----------------------------------------------------


def view_created(
    *,
    name: str | None,
    policy: str,
    device: str,
    storage_nbytes: int,
    geometry: dict[str, Any],
    extent_bytes: int,
    region: tuple[int, int] | None,
) -> None:
    """``view_created`` (DEBUG): a checked view was made."""
    if not stdlib_logger.isEnabledFor(logging.DEBUG):
        return
    _emit(
        logging.DEBUG,
        _view_fields("view_created", name, policy, device, storage_nbytes, geometry, extent_bytes,
                     region),
    )  # fmt: skip


def bounds_violation(
    finding: Finding,
    *,
    strict: bool,
    policy: str,
    device: str,
    storage_nbytes: int,
    geometry: dict[str, Any],
    region: tuple[int, int] | None = None,
    site: dict[str, Any] | None = None,
) -> None:
    """``bounds_violation`` (ERROR under strict, WARNING under warn): the keys of
    ``view_created`` (``region``: the view's own, when it has one) for the broken limit, plus
    ``kind``, ``check``, ``overflow_bytes`` and ``message``; ``op``, ``file``, ``line`` and
    ``function`` for a view seen by ``sanitize()``."""
    level = _levels(strict)
    if not stdlib_logger.isEnabledFor(level):
        return
    assert finding.extent_bytes is not None
    assert finding.limit_bytes is not None
    name = finding.views[0] if finding.views else None
    fields = _view_fields(
        "bounds_violation",
        name,
        policy,
        device,
        storage_nbytes,
        geometry,
        finding.extent_bytes,
        region,
    )
    fields["limit_bytes"] = finding.limit_bytes
    fields["slack_bytes"] = finding.limit_bytes - finding.extent_bytes
    fields["kind"] = finding.kind
    fields["check"] = finding.check
    fields["overflow_bytes"] = finding.overflow_bytes
    fields["message"] = finding.message
    if site is not None:
        fields.update(site)
    _emit(level, fields)


def overlap_violation(finding: Finding, *, strict: bool, policy: str) -> None:
    """``overlap_violation`` (ERROR under strict, WARNING under warn): an ``overlap`` or
    ``self_overlap`` finding."""
    level = _levels(strict)
    if not stdlib_logger.isEnabledFor(level):
        return
    _emit(
        level,
        {
            "event": "overlap_violation",
            "kind": finding.kind,
            "views": list(finding.views),
            "storage": finding.storage,
            "byte": finding.byte,
            "group": _group(finding.group),
            "policy": policy,
            "message": finding.message,
        },
    )


def unproven_write(
    *,
    strict: bool,
    policy: str,
    op: str,
    name: str | None,
    device: str,
    storage_nbytes: int,
    reason: str,
    site: dict[str, Any],
    message: str,
) -> None:
    """``unproven_write`` (ERROR under strict, WARNING under warn): ``sanitize()`` could not tell
    whether an op grows a storage that other tensors use (``UnprovenWriteError``)."""
    level = _levels(strict)
    if not stdlib_logger.isEnabledFor(level):
        return
    fields: dict[str, Any] = {
        "event": "unproven_write",
        "op": op,
        "name": name,
        "policy": policy,
        "device": device,
        "storage_nbytes": storage_nbytes,
        "reason": reason,
    }
    fields.update(site)
    fields["message"] = message
    _emit(level, fields)


def address_violation(finding: Finding, *, strict: bool, policy: str, source: str) -> None:
    """``address_violation`` (ERROR under strict, WARNING under warn): a descriptor for a transfer
    engine that misses the pages it must hit, or a region registered twice (a finding of
    ``safeview.transfer``); ``source`` is the call that checked it."""
    if _counters:
        _count("address_violation", kind=finding.kind, strict=strict, source=source)
    level = _levels(strict)
    if not stdlib_logger.isEnabledFor(level):
        return
    _emit(
        level,
        {
            "event": "address_violation",
            "source": source,
            "kind": finding.kind,
            "rows": list(finding.rows),
            "address": finding.address,
            "length_bytes": finding.length_bytes,
            "device": finding.device,
            "stride_bytes": finding.stride_bytes,
            "count": finding.count,
            "element": finding.element,
            "layers": list(finding.views),
            "layer": finding.layer,
            "storage": finding.storage,
            "byte_offset": finding.byte_offset,
            "byte": finding.byte,
            "policy": policy,
            "message": finding.message,
        },
    )


# The layout manifest of the registration being checked (the vLLM plugin derives one per
# worker): its fingerprint and the file it was written to, for ``registration_checked``.
_manifest: ContextVar[dict[str, Any] | None] = ContextVar("safeview_manifest", default=None)


@contextmanager
def manifest_of_registration(
    fingerprint: str, path: str | None, published: Sequence[str] | None = None
) -> Iterator[None]:
    """Inside the block, ``registration_checked`` also carries ``manifest_fingerprint``,
    ``manifest_path`` (``None`` when no file was written) and ``manifest_published``: the
    channels the manifest goes out on for peers to judge it against (``handshake``, ``store``,
    ``folder``; the names of the layout events' ``against``), by default the folder when a file
    was written."""
    channels = list(published) if published is not None else ["folder"] if path else []
    token = _manifest.set(
        {"manifest_fingerprint": fingerprint, "manifest_path": path, "manifest_published": channels}
    )
    try:
        yield
    finally:
        _manifest.reset(token)


def coverage_violation(finding: Finding, *, strict: bool, policy: str, source: str) -> None:
    """``coverage_violation`` (ERROR under strict, WARNING under warn): a layer to be transferred,
    or part of one, in no descriptor prepared for its transfers (an ``unregistered`` finding)."""
    level = _levels(strict)
    if not stdlib_logger.isEnabledFor(level):
        return
    _emit(
        level,
        {
            "event": "coverage_violation",
            "source": source,
            "kind": finding.kind,
            "layer": finding.layer,
            "storage": finding.storage,
            "byte_offset": finding.byte_offset,
            "extent_bytes": finding.extent_bytes,
            "pages_missing": finding.count,
            "bytes_missing": finding.length_bytes,
            "policy": policy,
            "message": finding.message,
        },
    )


def canonical_mismatch(finding: Any, *, strict: bool, policy: str, source: str) -> None:
    """``canonical_mismatch`` (ERROR under strict, WARNING under warn): vLLM's offloading with
    ``canonical_layout`` would copy a layer's page into its canonical page otherwise than the
    layer's strides place its bytes (``safeview.vllm._canonical``)."""
    level = _levels(strict)
    if not stdlib_logger.isEnabledFor(level):
        return
    _emit(
        level,
        {
            "event": "canonical_mismatch",
            "source": source,
            "kind": finding.kind,
            "layer": finding.layer,
            "byte": finding.byte,
            "vllm_canonical_byte": finding.vllm_canonical_byte,
            "manifest_canonical_byte": finding.manifest_canonical_byte,
            "bytes_wrong": finding.count,
            "policy": policy,
            "message": finding.message,
            "action": "refused" if strict else "none",
        },
    )


def engine_failed(
    event: Literal["registration_failed", "transfer_failed"],
    *,
    source: str,
    engine: str,
    status: object,
    layers: Sequence[str],
    regions: Sequence[tuple[int, int]],
    policy: str,
) -> None:
    """``registration_failed`` and ``transfer_failed`` (WARNING): a transfer engine reported a
    failure (raised, or returned a failure status) for a call through a guard; the failure
    reaches the caller unchanged."""
    if not stdlib_logger.isEnabledFor(logging.WARNING):
        return
    what = "registration" if event == "registration_failed" else "transfer"
    named = ", ".join(repr(layer) for layer in layers) or "no known layer"
    _emit(
        logging.WARNING,
        {
            "event": event,
            "source": source,
            "engine": engine,
            "status": status if isinstance(status, (int, str)) else repr(status),
            "layers": list(layers),
            "regions": [list(region) for region in regions],
            "policy": policy,
            "message": f"the {engine} reported a failed {what} ({source} gave {status!r}) of "
            f"{len(regions)} region(s) of {named}",
        },
    )


def failure_ignored(
    *,
    source: str,
    failed: str,
    status: object,
    address: int,
    length: int,
    layers: Sequence[str],
    strict: bool,
    policy: str,
) -> None:
    """``failure_ignored`` (ERROR under strict, just before the raise; WARNING under warn): a call
    that depends on a registration or transfer the engine reported failed."""
    from safeview.errors import failure_ignored_message

    level = _levels(strict)
    if not stdlib_logger.isEnabledFor(level):
        return
    _emit(
        level,
        {
            "event": "failure_ignored",
            "source": source,
            "failed": failed,
            "status": status if isinstance(status, (int, str)) else repr(status),
            "address": address,
            "length_bytes": length,
            "layers": list(layers),
            "policy": policy,
            "message": failure_ignored_message(source, failed, status, address, length, layers),
        },
    )


def registration_checked(report: Report, *, policy: str, layers: int, source: str) -> None:
    """``registration_checked`` (INFO): the summary of one whole registration, after its
    violations."""
    if not stdlib_logger.isEnabledFor(logging.INFO):
        return
    overlaps = sum(1 for f in report.findings if f.kind in ("overlap", "self_overlap"))
    fields: dict[str, Any] = {
        "event": "registration_checked",
        "source": source,
        "policy": policy,
        "layers": layers,
        "views": len(report.views),
        "storages": len(report.storages),
        "storage_nbytes": sum(report.storages.values()),
        "bytes_covered": sum(view.nbytes for view in report.views),
        "min_slack_bytes": report.min_slack_bytes(),
        "overlaps": overlaps,
        "violations": len(report.findings),
        "checked": policy != "off",
    }
    fields.update(_manifest.get() or {})
    _emit(logging.INFO, fields)


#: what every layout event says of the pair, in the event table's order (``WorkerLayout``'s
#: fields, then the judgement's own)
_PAIR_KEYS = (
    "engine", "tp_rank", "tp_size", "remote_engine", "remote_tp_size", "when", "policy",
    "fingerprint", "against", "manifests", "reason", "remote_fingerprints", "layers", "findings",
)  # fmt: skip


def _in_order(fields: dict[str, Any], keys: tuple[str, ...], what: str) -> dict[str, Any]:
    """``fields`` in the table's order ``keys``; a missing or unknown one is safeview's own
    bug, a ``TypeError`` naming it."""
    if set(fields) != set(keys):
        raise TypeError(f"{what} are not {keys}: {sorted(set(fields) ^ set(keys))}")
    return {key: fields[key] for key in keys}


def _pair(fields: dict[str, Any]) -> dict[str, Any]:
    """The pair's fields in table order (sequences as lists); a missing or unknown one is
    safeview's own bug, a ``TypeError`` naming it."""
    fields.setdefault("remote_fingerprints", ())
    fields.setdefault("layers", 0)
    fields.setdefault("findings", 0)
    pair = _in_order(fields, _PAIR_KEYS, "a layout event's pair fields")
    for key in ("manifests", "remote_fingerprints"):
        pair[key] = list(pair[key])
    return pair


def layout_checked(*, verdict: Literal["compatible", "not_judged"], **fields: Any) -> None:
    """``layout_checked`` (INFO): a receiver was judged against its peer's manifest
    (``safeview.manifest.peer.judge_peer``: the vLLM plugin's decode worker against a prefill
    engine, a Mooncake receiver against a segment), whichever channel brought it (``against``),
    and found compatible, or left unjudged (``not_judged``, with the reason). ``fields``:
    ``_PAIR_KEYS`` (``remote_fingerprints``, ``layers`` and ``findings`` may be left out)."""
    if _counters:
        _count("layout_checked", verdict=verdict, when=fields.get("when"),
               engine=fields.get("engine"), remote_engine=fields.get("remote_engine"))  # fmt: skip
    if stdlib_logger.isEnabledFor(logging.INFO):
        pair = _pair(fields)
        _emit(logging.INFO, {"event": "layout_checked", **pair, "verdict": verdict})


def layout_mismatch(finding: Any, *, strict: bool, refused: bool, **fields: Any) -> None:
    """``layout_mismatch`` (ERROR under strict, WARNING under warn): the two engines of a pair
    read a byte differently; ``finding`` is the first diff ``Finding``; ``fields`` as for
    ``layout_checked``."""
    if _counters:
        _count("layout_mismatch", verdict="refused" if refused else "mismatch",
               when=fields.get("when"), engine=fields.get("engine"),
               remote_engine=fields.get("remote_engine"))  # fmt: skip
    level = _levels(strict)
    if not stdlib_logger.isEnabledFor(level):
        return
    reads, wrote = finding.receiver_reads, finding.sender_wrote
    _emit(
        level,
        {
            "event": "layout_mismatch",
            **_pair(fields),
            "verdict": "mismatch",
            "kind": finding.kind,
            "layer": finding.layer,
            "byte": finding.byte,
            "remote_tp_ranks": list(finding.sender_ranks),
            "receiver_reads": None if reads is None else reads.words(),
            "sender_wrote": None if wrote is None else wrote.words(),
            "message": finding.message,
            "action": "refused" if refused else "none",
        },
    )


def integration(
    event: Literal["integration_installed", "integration_unavailable"],
    *,
    integration: str,
    reason: str,
    version: str | None,
) -> None:
    """``integration_installed`` (INFO) and ``integration_unavailable`` (WARNING): what an engine
    integration (the vLLM plugin) did at start-up, and why."""
    if _counters and event == "integration_unavailable":
        _count(event, integration=integration)
    level = logging.INFO if event == "integration_installed" else logging.WARNING
    if not stdlib_logger.isEnabledFor(level):
        return
    _emit(
        level,
        {
            "event": event,
            "integration": integration,
            "version": version,
            "reason": reason,
        },
    )


_DIGEST_KEYS = (
    "engine", "tp_rank", "tp_size", "remote_engine", "remote_tp_size", "request", "policy",
    "num_tokens", "layers", "heads", "reason",
)  # fmt: skip


def digest_checked(*, verdict: Literal["agree", "not_judged"], **fields: Any) -> None:
    """``digest_checked`` (INFO for ``agree``, WARNING for ``not_judged``): what a receiver holds
    of a request was compared with what its sender digested (``safeview.manifest.digest.judge``:
    the vLLM plugin's decode worker after a READ), and found to mean the same, or could not be
    compared (``reason``). ``fields``: ``_DIGEST_KEYS``."""
    if _counters:
        _count("digest_checked", verdict=verdict)
    level = logging.INFO if verdict == "agree" else logging.WARNING
    if stdlib_logger.isEnabledFor(level):
        _emit(
            level,
            {
                "event": "digest_checked",
                **_in_order(fields, _DIGEST_KEYS, "a digest event's fields"),
                "verdict": verdict,
            },
        )


def digest_mismatch(finding: Any, *, strict: bool, findings: int, **fields: Any) -> None:
    """``digest_mismatch`` (ERROR under strict, WARNING under warn): a receiver holds a request's
    bytes otherwise than its sender digested them; ``finding`` is the first of ``verify``'s."""
    if _counters:
        _count("digest_mismatch", verdict="refused" if strict else "mismatch")
    level = _levels(strict)
    if not stdlib_logger.isEnabledFor(level):
        return
    _emit(
        level,
        {
            "event": "digest_mismatch",
            **_in_order(fields, _DIGEST_KEYS, "a digest event's fields"),
            "verdict": "mismatch",
            "findings": findings,
            "kind": finding.kind,
            "layer": finding.layer,
            "layer_heads": list(finding.heads),
            "remote_tp_ranks": list(finding.sender_ranks),
            "message": finding.message,
            "action": "refused" if strict else "none",
        },
    )


def layout_judged(
    *,
    engine: str | None,
    remote_engine: str,
    remote_tp_rank: Any,
    remote_tp_size: Any,
    verdict: str,
    fingerprints: Sequence[str],
    remote_fingerprint: str,
    policy: str,
) -> None:
    """``layout_judged`` (INFO for ``compatible`` and ``not_judged``, WARNING otherwise): on a
    prefill engine (P), what a decode worker (D) found of their pair at its handshake, as D
    told P's side channel: P's manifests D judged (``fingerprints``) and D's own
    (``remote_fingerprint``), so that both sides' logs hold the pair's verdict."""
    level = logging.INFO if verdict in ("compatible", "not_judged") else logging.WARNING
    if not stdlib_logger.isEnabledFor(level):
        return
    _emit(
        level,
        {
            "event": "layout_judged",
            "engine": engine,
            "remote_engine": remote_engine,
            "remote_tp_rank": remote_tp_rank,
            "remote_tp_size": remote_tp_size,
            "verdict": verdict,
            "fingerprints": list(fingerprints),
            "remote_fingerprint": remote_fingerprint,
            "policy": policy,
        },
    )


def kv_not_received(
    *,
    engine: str | None,
    tp_rank: int | None,
    remote_engine: str | None,
    request: str,
    reason: Literal["refused", "read_failed", "not_read"],
    outcome: Literal["recomputed", "failed"],
    blocks_expected: int,
    blocks_read: int,
) -> None:
    """``kv_not_received`` (WARNING): a decode engine did not use the KV a prefill engine
    computed for a request (``safeview.vllm._metrics``): safeview refused it, the READ failed,
    or it never ran; the request is recomputed or fails, as vLLM's ``kv_load_failure_policy``
    says."""
    if not stdlib_logger.isEnabledFor(logging.WARNING):
        return
    why = {
        "refused": "safeview refused it (see the layout or digest event before)",
        "read_failed": "its READ failed",
        "not_read": "no READ of it was issued (the handshake with P failed, or P was unknown)",
    }[reason]
    _emit(
        logging.WARNING,
        {
            "event": "kv_not_received",
            "engine": engine,
            "tp_rank": tp_rank,
            "remote_engine": remote_engine,
            "request": request,
            "reason": reason,
            "outcome": outcome,
            "blocks_expected": blocks_expected,
            "blocks_read": blocks_read,
            "message": f"request {request}: the KV of {blocks_expected} block(s) from P "
            f"{remote_engine} was not used: {why}; the prompt is "
            + ("recomputed locally" if outcome == "recomputed" else "failed")
            + " (kv_transfer_config.kv_load_failure_policy on D)",
        },
    )


def kv_not_read(
    *, engine: str | None, tp_rank: int | None, request: str, reads: int, lease_s: float | None
) -> None:
    """``kv_not_read`` (WARNING): a prefill engine freed a request's blocks, held for a decode
    engine to read, when their lease ran out before every reader had read them
    (``safeview.vllm._metrics``)."""
    if not stdlib_logger.isEnabledFor(logging.WARNING):
        return
    _emit(
        logging.WARNING,
        {
            "event": "kv_not_read",
            "engine": engine,
            "tp_rank": tp_rank,
            "request": request,
            "reads": reads,
            "lease_s": lease_s,
            "message": f"request {request}: P freed its KV blocks when their lease ran out, "
            f"read by {reads} decode worker(s) before (D never asked for them, was refused, "
            "or came too late: kv_connector_extra_config.kv_lease_duration on P)",
        },
    )


def internal_error(*, where: str, error: BaseException) -> None:
    """``internal_error`` (WARNING): safeview itself failed where it must not stop its host (the
    sanitizer, a plugin); the host's operation went on unchecked."""
    if _counters:
        _count("internal_error", where=where)
    if not stdlib_logger.isEnabledFor(logging.WARNING):
        return
    _emit(
        logging.WARNING,
        {
            "event": "internal_error",
            "where": where,
            "error": f"{type(error).__name__}: {error}",
        },
    )


def process_guard(
    event: Literal["process_guard_started", "process_guard_stopped"],
    *,
    policy: str,
    source: str | None,
    watches: list[str] | None,
    counts: dict[str, int] | None,
) -> None:
    """``process_guard_started`` (INFO, once per process: the policy, where it came from and the
    entry points watched) and ``process_guard_stopped`` (INFO, at exit: what it did)."""
    if not stdlib_logger.isEnabledFor(logging.INFO):
        return
    fields: dict[str, Any] = {"event": event, "policy": policy, "source": source}
    if watches is not None:
        fields["watches"] = watches
    if counts is not None:
        fields.update(counts)
    _emit(logging.INFO, fields)


def _view_fields(
    event: str,
    name: str | None,
    policy: str,
    device: str,
    storage_nbytes: int,
    geometry: dict[str, Any],
    extent_bytes: int,
    region: tuple[int, int] | None,
) -> dict[str, Any]:
    limit = storage_nbytes if region is None else min(storage_nbytes, region[1])
    fields: dict[str, Any] = {
        "event": event,
        "name": name,
        "policy": policy,
        "device": device,
        "storage_nbytes": storage_nbytes,
        **geometry,
        "extent_bytes": extent_bytes,
        "limit_bytes": limit,
        "slack_bytes": limit - extent_bytes,
    }
    if region is not None:
        fields["region"] = list(region)
    return fields


def block_geometry(
    byte_offset: int, num_blocks: int, page_bytes: int, block_stride_bytes: int
) -> dict[str, Any]:
    """The layout keys of a block view's events."""
    return {
        "byte_offset": byte_offset,
        "num_blocks": num_blocks,
        "page_bytes": page_bytes,
        "block_stride_bytes": block_stride_bytes,
    }


def strided_geometry(
    byte_offset: int, dtype: str, shape: Sequence[int], strides: Sequence[int]
) -> dict[str, Any]:
    """The layout keys of a typed view's events."""
    return {
        "byte_offset": byte_offset,
        "dtype": dtype,
        "shape": list(shape),
        "strides": list(strides),
    }


# -- where the events go ---------------------------------------------------------------------


def _timestamp(created: float) -> str:
    return (
        datetime.fromtimestamp(created, tz=timezone.utc)
        .isoformat(timespec="microseconds")
        .replace("+00:00", "Z")
    )


class EventFormatter(logging.Formatter):
    """Formats safeview's events (and any other record) as one JSON object per line, or as a
    console line: ``event``, ``level`` and an ISO 8601 UTC ``timestamp`` first, then the fields."""

    def __init__(self, format: Literal["json", "console"] = "json") -> None:
        super().__init__()
        if format not in FORMATS:
            raise ConfigError("format", format, FORMATS)
        self.format_name = format
        import structlog  # only where events are rendered: the command line does not pay for it

        self._render: Any = (
            structlog.processors.JSONRenderer()
            if format == "json"
            else structlog.dev.ConsoleRenderer(colors=False)
        )

    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "safeview_event", None)
        event: dict[str, Any] = {
            "event": record.getMessage() if fields is None else fields.get("event"),
            "level": record.levelname.lower(),
            "timestamp": _timestamp(record.created),
            "logger": record.name,
        }
        if fields is not None:
            event.update((k, v) for k, v in fields.items() if k != "event")
        if record.exc_info:
            event["exception"] = self.formatException(record.exc_info)
        rendered: str = self._render(None, event["level"], event)
        return rendered


class ForwardHandler(logging.Handler):
    """Hands each record to another logger (``logging.getLogger(name).handle``), so that it goes
    wherever that logger's records go, with its handlers and formatting as they are at the time
    of the event: the way into a host application's log that configures itself late (vLLM sets
    up its ``vllm`` logger, with ``propagate=False``, when its engine and workers start)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.target = name

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger(self.target).handle(record)


_installed: list[logging.Handler] = []


def _level(value: str | int, source: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in LEVELS:
        return logging.getLevelName(value.strip().upper())  # type: ignore[no-any-return]
    raise ConfigError(source, value, LEVELS)


def configure_logging(
    format: Literal["json", "console"] = "json",
    level: str | int = "INFO",
    stream: IO[str] | None = None,
    *,
    handlers: Sequence[logging.Handler] | None = None,
    forward_to: str | None = None,
) -> list[logging.Handler]:
    """Send safeview's events somewhere, one per line: to ``stream`` (standard error by default)
    in ``format``, to the given ``handlers`` as they are, or into the log of a host logger,
    formatted as that logger's own records are::

        configure_logging(forward_to="vllm", level="INFO")   # what the vLLM plugin does

    For applications, plugins and the command line; a library that uses safeview should leave
    this to its application. Replaces what an earlier call installed, sets the ``safeview``
    logger's level and stops its events from also reaching the root logger's handlers (no
    doubled lines). Returns the handlers installed.

    >>> import io; out = io.StringIO()
    >>> _ = configure_logging("json", level="DEBUG", stream=out)
    """
    resolved = _level(level, "level")
    if forward_to is not None:
        chosen: list[logging.Handler] = [ForwardHandler(forward_to)]
    elif handlers is None:
        handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
        handler.setFormatter(EventFormatter(format))
        chosen = [handler]
    else:
        chosen = list(handlers)
    for old in _installed:
        stdlib_logger.removeHandler(old)
    for new in chosen:
        stdlib_logger.addHandler(new)
    stdlib_logger.setLevel(resolved)
    stdlib_logger.propagate = False
    _installed[:] = chosen
    return list(chosen)


def reset_logging() -> None:
    """Undo ``configure_logging``: remove what it installed, reset the level, propagate again."""
    for old in _installed:
        stdlib_logger.removeHandler(old)
    _installed.clear()
    stdlib_logger.setLevel(logging.NOTSET)
    stdlib_logger.propagate = True


def configure_from_env() -> None:
    """Apply ``SAFEVIEW_LOG_FORMAT`` (``json`` or ``console``) and ``SAFEVIEW_LOG_LEVEL`` (default
    ``info``) if the format variable is set. Runs once, when safeview is imported."""
    raw = os.environ.get(ENV_LOG_FORMAT, "").strip()
    if not raw:
        return
    format = raw.lower()
    if format not in FORMATS:
        raise ConfigError(ENV_LOG_FORMAT, raw, FORMATS)
    configure_logging(
        format,  # type: ignore[arg-type]
        level=_level(os.environ.get(ENV_LOG_LEVEL, "").strip() or "info", ENV_LOG_LEVEL),
    )
