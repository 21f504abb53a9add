"""Helpers for testing code that uses safeview, in the spirit of ``structlog.testing``."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from safeview.log import stdlib_logger

__all__ = ["capture_events"]


class _Collector(logging.Handler):
    def __init__(self, events: list[dict[str, Any]]) -> None:
        super().__init__(logging.DEBUG)
        self.events = events

    def emit(self, record: logging.LogRecord) -> None:
        fields = getattr(record, "safeview_event", None)
        if fields is not None:
            self.events.append({**fields, "level": record.levelname.lower()})


@contextlib.contextmanager
def capture_events(level: int = logging.DEBUG) -> Iterator[list[dict[str, Any]]]:
    """Collect every safeview event emitted inside the block, as dicts with ``event``, ``level``
    and the event's fields, whatever logging the application configured::

        with capture_events() as events:
            safeview.make_view(kv, layout, policy="warn")
        assert events[-1]["event"] == "view_created"
    """
    events: list[dict[str, Any]] = []
    handler = _Collector(events)
    previous = stdlib_logger.level
    stdlib_logger.addHandler(handler)
    stdlib_logger.setLevel(level)
    try:
        yield events
    finally:
        stdlib_logger.removeHandler(handler)
        stdlib_logger.setLevel(previous)
