"""safeview.testing: the helpers users (and these tests) capture events with."""

from __future__ import annotations

import io
import logging

import torch

from safeview import BlockLayout, configure_logging, make_view
from safeview.testing import capture_events

LAYOUT = BlockLayout(num_blocks=2, page_bytes=8, block_stride_bytes=8)


def test_capture_events_restores_the_loggers_level() -> None:
    logger = logging.getLogger("safeview")
    logger.setLevel(logging.ERROR)
    with capture_events() as events:
        assert logger.level == logging.DEBUG
        make_view(torch.zeros(16, dtype=torch.int8), LAYOUT, name="x")
    assert logger.level == logging.ERROR
    assert [event["event"] for event in events] == ["view_created"]
    assert events[0]["level"] == "debug"


def test_capture_events_sees_events_whatever_the_application_configured() -> None:
    out = io.StringIO()
    configure_logging("json", level="ERROR", stream=out)
    with capture_events(logging.INFO) as events:
        make_view(torch.zeros(16, dtype=torch.int8), LAYOUT, name="x")  # DEBUG: below INFO
        make_view(torch.zeros(8, dtype=torch.int8, device="meta"), LAYOUT, policy="warn")
    assert [event["event"] for event in events] == ["bounds_violation"]
    assert logging.getLogger("safeview").level == logging.ERROR  # as configured, again


def test_capture_events_removes_its_handler() -> None:
    before = list(logging.getLogger("safeview").handlers)
    with capture_events():
        pass
    assert logging.getLogger("safeview").handlers == before
