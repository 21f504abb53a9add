"""Structured events through the stdlib logger ``safeview``.

safeview never configures logging on import: its events go to ``logging.getLogger("safeview")``
and reach whatever handlers the application (or vLLM) set up, as a ``key=value`` message with the
event's fields attached to the record as ``record.safeview_event``. ``configure_logging`` (or the
environment variable ``SAFEVIEW_LOG_FORMAT``) puts a handler on that one logger that writes each
event as a JSON line or a console line. Events are built only when their level is enabled.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping
from datetime import datetime, timezone
from typing import IO, Any, Literal

import structlog

from safeview.errors import ConfigError

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
_key_values = structlog.processors.KeyValueRenderer(key_order=["event"])


def _to_stdlib(
    _logger: Any, _method: str, event_dict: MutableMapping[str, Any]
) -> tuple[tuple[str], dict[str, Any]]:
    """Last processor: a readable message for plain stdlib handlers, the fields for ours."""
    fields = dict(event_dict)
    return (_key_values(None, _method, dict(fields)),), {"extra": {"safeview_event": fields}}


_logger: structlog.stdlib.BoundLogger = structlog.wrap_logger(
    stdlib_logger,
    processors=[_to_stdlib],
    wrapper_class=structlog.stdlib.BoundLogger,
    cache_logger_on_first_use=True,
)


def enabled(level: int) -> bool:
    """Whether an event at ``level`` would be seen; check this before building one."""
    return stdlib_logger.isEnabledFor(level)


def emit(level: int, event: str, fields: dict[str, Any]) -> None:
    """Send one event. Callers check ``enabled(level)`` first."""
    _logger.log(level, event, **fields)


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


_installed: logging.Handler | None = None


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
) -> logging.Handler:
    """Write safeview's events to ``stream`` (standard error by default), one per line.

    For applications and the command line; a library that uses safeview should leave this to its
    application. Replaces a handler installed by an earlier call, sets the ``safeview`` logger's
    level and stops its events from also reaching the root logger's handlers (no doubled lines).
    Returns the handler.

    >>> import io; out = io.StringIO()
    >>> _ = configure_logging("json", level="DEBUG", stream=out)
    """
    global _installed
    formatter = EventFormatter(format)
    resolved = _level(level, "level")
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(formatter)
    if _installed is not None:
        stdlib_logger.removeHandler(_installed)
    stdlib_logger.addHandler(handler)
    stdlib_logger.setLevel(resolved)
    stdlib_logger.propagate = False
    _installed = handler
    return handler


def reset_logging() -> None:
    """Undo ``configure_logging``: remove its handler, reset the level, propagate again."""
    global _installed
    if _installed is not None:
        stdlib_logger.removeHandler(_installed)
        _installed = None
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
        level=_level(os.environ.get(ENV_LOG_LEVEL, "info"), ENV_LOG_LEVEL),
    )
