"""Structured events: their keys (the table in docs/events.md), JSON lines, and no global
configuration."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import torch

import safeview
from safeview import BlockLayout, BoundsError, StridedLayout, configure_logging, make_view
from safeview.log import ENV_LOG_FORMAT, UnhandledToStderr

COMMON = {
    "event", "level", "timestamp", "logger", "name", "policy", "device", "storage_nbytes",
    "byte_offset", "extent_bytes", "limit_bytes", "slack_bytes",
}  # fmt: skip
BLOCK = {"num_blocks", "page_bytes", "block_stride_bytes"}
STRIDED = {"dtype", "shape", "strides"}
VIOLATION = {"kind", "check", "overflow_bytes", "message"}

LAYOUT = BlockLayout(num_blocks=3, page_bytes=16, block_stride_bytes=32, byte_offset=8)


def _lines(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_view_created_is_one_json_line_with_the_documented_keys() -> None:
    out = io.StringIO()
    configure_logging("json", level="DEBUG", stream=out)
    kv = torch.zeros(128, dtype=torch.int8)
    make_view(kv, LAYOUT, name="layer.0")
    [event] = _lines(out)
    assert set(event) == COMMON | BLOCK
    assert event["event"] == "view_created"
    assert event["level"] == "debug"
    assert event["name"] == "layer.0"
    assert event["policy"] == "strict"
    assert event["device"] == "cpu"
    assert event["storage_nbytes"] == 128
    assert event["extent_bytes"] == LAYOUT.extent_bytes == 88
    assert event["limit_bytes"] == 128
    assert event["slack_bytes"] == 40
    assert event["timestamp"].endswith("Z")  # UTC, written the short way
    stamp = datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00"))
    assert stamp.utcoffset() == timedelta(0)
    assert abs(datetime.now(timezone.utc) - stamp) < timedelta(minutes=5)


def test_strided_view_event_carries_shape_and_strides() -> None:
    out = io.StringIO()
    configure_logging("json", level="DEBUG", stream=out)
    layout = StridedLayout(shape=(2, 3), strides=(4, 1), byte_offset=4, dtype="float16")
    make_view(torch.zeros(64, dtype=torch.int8), layout, region=(0, 32))
    [event] = _lines(out)
    assert set(event) == COMMON | STRIDED | {"region"}
    assert event["shape"] == [2, 3]
    assert event["strides"] == [4, 1]
    assert event["dtype"] == "float16"
    assert event["region"] == [0, 32]
    assert event["limit_bytes"] == 32


def test_bounds_violation_event_has_check_and_overflow() -> None:
    out = io.StringIO()
    configure_logging("json", level="INFO", stream=out)
    with pytest.raises(BoundsError):
        make_view(torch.zeros(64, dtype=torch.int8), LAYOUT, name="layer.9", region=(0, 64))
    events = _lines(out)
    assert [e["check"] for e in events] == ["storage", "region"]
    for event in events:
        assert set(event) == COMMON | BLOCK | VIOLATION | {"region"}
        assert event["event"] == "bounds_violation"
        assert event["level"] == "error"
        assert event["overflow_bytes"] == 24
        assert event["slack_bytes"] == -24
    assert "view 'layer.9' needs bytes [8, 88) but the storage has 64 bytes" in events[0]["message"]


def test_level_filters_view_created() -> None:
    out = io.StringIO()
    configure_logging("json", level="INFO", stream=out)
    make_view(torch.zeros(128, dtype=torch.int8), LAYOUT)
    assert out.getvalue() == ""


def test_console_format_is_one_readable_line() -> None:
    out = io.StringIO()
    configure_logging("console", level="DEBUG", stream=out)
    make_view(torch.zeros(128, dtype=torch.int8), LAYOUT, name="layer.0")
    [line] = out.getvalue().splitlines()
    assert "view_created" in line
    assert "extent_bytes=88" in line
    assert "name=layer.0" in line


def test_configure_logging_twice_keeps_one_handler() -> None:
    first, second = io.StringIO(), io.StringIO()
    configure_logging("json", level="DEBUG", stream=first)
    configure_logging("json", level="DEBUG", stream=second)
    installed = logging.getLogger("safeview").handlers
    assert [type(h) for h in installed] == [UnhandledToStderr, logging.StreamHandler]
    make_view(torch.zeros(128, dtype=torch.int8), LAYOUT)
    assert first.getvalue() == ""
    assert len(_lines(second)) == 1


def test_plain_stdlib_handlers_get_a_readable_message_and_the_fields(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.DEBUG, logger="safeview"):
        make_view(torch.zeros(128, dtype=torch.int8), LAYOUT, name="layer.0")
    [record] = caplog.records
    assert record.name == "safeview"
    assert record.getMessage().startswith('event="view_created" name="layer.0" policy="strict"')
    assert " region=null" not in record.getMessage()  # no region given, no key
    assert record.safeview_event["extent_bytes"] == 88  # type: ignore[attr-defined]


def test_invalid_format_is_refused() -> None:
    with pytest.raises(ValueError, match="format='xml' is not a valid value"):
        configure_logging("xml", stream=io.StringIO())  # type: ignore[arg-type]


def _python(code: str, **env_vars: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAFEVIEW_")}
    env.update(env_vars)
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )


def test_import_configures_nothing_global() -> None:
    result = _python(
        "import logging, structlog, safeview\n"
        "print(logging.getLogger().handlers, logging.getLogger('safeview').handlers,"
        " structlog.is_configured(), 'torch' in __import__('sys').modules)"
    )
    assert result.returncode == 0, result.stderr
    # nothing on the root logger; on its own, only the handler that shows a warning nobody else
    # would (tests below)
    assert result.stdout.split() == ["[]", "[<UnhandledToStderr", "(WARNING)>]", "False", "False"]


_VIOLATE = """
import torch, safeview
meta = torch.empty(64, dtype=torch.int8, device="meta")
layout = safeview.BlockLayout(num_blocks=5, page_bytes=16, block_stride_bytes=16)
safeview.make_view(meta, layout, name="l0", policy="warn")
"""


def test_log_format_environment_variable_writes_json_lines_to_stderr() -> None:
    result = _python(_VIOLATE, **{ENV_LOG_FORMAT: "json"})
    assert result.returncode == 0, result.stderr
    [event] = [json.loads(line) for line in result.stderr.splitlines()]
    assert event["event"] == "bounds_violation"
    assert event["level"] == "warning"
    assert event["overflow_bytes"] == 16


@pytest.mark.slow
def test_log_level_environment_variable_shows_view_created() -> None:
    result = _python(_VIOLATE, SAFEVIEW_LOG_FORMAT="JSON", SAFEVIEW_LOG_LEVEL="debug")
    assert result.returncode == 0, result.stderr
    events = [json.loads(line)["event"] for line in result.stderr.splitlines()]
    assert events == ["bounds_violation", "view_created"]


def test_invalid_log_format_variable_is_a_config_error() -> None:
    result = _python("import safeview", SAFEVIEW_LOG_FORMAT="yaml")
    assert result.returncode == 1
    assert "SAFEVIEW_LOG_FORMAT='yaml' is not a valid value; allowed values: json, console" in (
        result.stderr
    )


def test_configured_events_do_not_also_reach_the_root_handlers() -> None:
    seen: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    root = logging.getLogger()
    collector = Collect(logging.DEBUG)
    root.addHandler(collector)
    try:
        out = io.StringIO()
        configure_logging("json", level="DEBUG", stream=out)
        make_view(torch.zeros(128, dtype=torch.int8), LAYOUT)
        assert len(_lines(out)) == 1
        assert seen == []  # no doubled line through the root logger
        safeview.reset_logging()
        logging.getLogger("safeview").setLevel(logging.DEBUG)
        make_view(torch.zeros(128, dtype=torch.int8), LAYOUT)
        assert len(seen) == 1  # unconfigured, events propagate to the application's handlers
    finally:
        root.removeHandler(collector)


def test_records_point_at_the_caller_not_at_safeview(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="safeview"):
        make_view(torch.zeros(128, dtype=torch.int8), LAYOUT, name="layer.0")
    [record] = caplog.records
    assert record.pathname == __file__
    assert record.funcName == "test_records_point_at_the_caller_not_at_safeview"


def test_forwarded_events_reach_a_vllm_style_handler_with_level_time_logger_and_line() -> None:
    # a host set up as vLLM sets itself up: its own handler and format, no propagation
    host = logging.getLogger("host_like_vllm")
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(
        logging.Formatter(
            "%(levelname)s %(asctime)s [%(name)s:%(filename)s:%(lineno)d] %(message)s"
        )
    )
    host.addHandler(handler)
    host.propagate = False
    try:
        configure_logging(forward_to="host_like_vllm", level="INFO")
        meta = torch.empty(64, dtype=torch.int8, device="meta")
        line_number = sys._getframe().f_lineno + 1
        make_view(meta, LAYOUT.model_copy(update={"num_blocks": 5}), name="l0", policy="warn")
        [line] = out.getvalue().splitlines()
        level, day, _time, origin = line.split(" ")[:4]
        assert level == "WARNING"
        assert datetime.strptime(day, "%Y-%m-%d")
        assert origin == f"[safeview:test_log.py:{line_number}]"
        assert 'event="bounds_violation" name="l0"' in line
    finally:
        host.removeHandler(handler)


# -- a warning nobody's logging would show reaches standard error --------------------------------
# A user who asks for ``warn`` (SAFEVIEW_GUARD=warn, safeview run --policy warn,
# SAFEVIEW_BOUNDS_POLICY=warn) without setting up logging must see each warning, one line on
# standard error; where the host logs, the warning goes there once, and only there.

HOOK_INSTALLED = os.path.exists(
    os.path.join(__import__("sysconfig").get_paths()["purelib"], "safeview-guard.pth")
)
needs_hook = pytest.mark.skipif(not HOOK_INSTALLED, reason="safeview-guard.pth is not installed")

# the four-argument set_ past the end of a storage another tensor uses: torch grows it (the bug)
GROWN_SET = """
import torch
kv = torch.arange(64, dtype=torch.int8)
layer = kv[16:32]
torch.empty(0, dtype=torch.int8).set_(kv.untyped_storage(), 0, (5, 16), (16, 1))
print(kv.untyped_storage().nbytes())
"""
TOO_LONG_VIEW = """
import torch, safeview
meta = torch.empty(64, dtype=torch.int8, device="meta")
safeview.make_view(meta, safeview.BlockLayout(num_blocks=5, page_bytes=16, block_stride_bytes=16))
"""


def _shown(result: subprocess.CompletedProcess[str]) -> list[str]:
    assert result.returncode == 0, result.stderr
    return result.stderr.splitlines()


def _our_line(line: str, op: str | None = None) -> None:
    assert line.startswith('safeview WARNING: event="bounds_violation" '), line
    assert 'policy="warn"' in line
    assert "overflow_bytes=16 " in line
    if op is not None:
        assert f'op="{op}"' in line


@pytest.mark.slow
@needs_hook
def test_guard_warn_shows_each_warning_on_stderr_once() -> None:
    result = _python(GROWN_SET, SAFEVIEW_GUARD="warn")
    [line] = _shown(result)
    _our_line(line, op="Tensor.set_")
    assert result.stdout.split() == ["80"]  # warn changes nothing: torch grew the storage


@pytest.mark.slow
@needs_hook
def test_safeview_run_policy_warn_shows_each_warning_on_stderr_once() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAFEVIEW_")}
    result = subprocess.run(
        [sys.executable, "-m", "safeview", "run", "--policy", "warn", "--",
         sys.executable, "-c", GROWN_SET],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    [line] = _shown(result)
    _our_line(line, op="Tensor.set_")
    assert result.stdout.split() == ["80"]


def test_bounds_policy_warn_shows_each_warning_on_stderr_once() -> None:
    twice = TOO_LONG_VIEW + TOO_LONG_VIEW.splitlines()[-1] + "\n"
    lines = _shown(_python(twice, SAFEVIEW_BOUNDS_POLICY="warn"))
    assert len(lines) == 2  # one line per warning
    for line in lines:
        _our_line(line)


@pytest.mark.slow
def test_a_host_handler_gets_the_warning_once_and_stderr_no_copy() -> None:
    # set up after safeview's import, as hosts often do: checked at each record
    code = TOO_LONG_VIEW.replace(
        "safeview.make_view", "import logging; logging.basicConfig()\nsafeview.make_view"
    )
    [line] = _shown(_python(code, SAFEVIEW_BOUNDS_POLICY="warn"))
    assert line.startswith('WARNING:safeview:event="bounds_violation" ')  # the host's format


@pytest.mark.slow
def test_a_logger_that_does_not_propagate_elsewhere_is_no_handler_of_ours() -> None:
    # vLLM's shape: a ``vllm`` logger with its own handler and propagate=False, nothing on the
    # root: it is no ancestor of ``safeview``, so the warning comes to stderr once; forwarded to
    # it (what the vLLM plugin does), it comes once, in that handler's format
    host = (
        "import logging, sys\n"
        "h = logging.StreamHandler(sys.stderr)\n"
        "h.setFormatter(logging.Formatter('VLLM %(levelname)s %(message)s'))\n"
        "v = logging.getLogger('vllm'); v.addHandler(h); v.propagate = False\n"
    )
    [line] = _shown(_python(host + TOO_LONG_VIEW, SAFEVIEW_BOUNDS_POLICY="warn"))
    _our_line(line)
    forward = host + "import safeview; safeview.configure_logging(forward_to='vllm')\n"
    [line] = _shown(_python(forward + TOO_LONG_VIEW, SAFEVIEW_BOUNDS_POLICY="warn"))
    assert line.startswith('VLLM WARNING event="bounds_violation" ')


@pytest.mark.slow
@pytest.mark.parametrize(
    "silence",
    [
        "logging.getLogger('safeview').addHandler(logging.NullHandler())",
        "logging.lastResort = None",
    ],
)
def test_the_host_can_still_silence_them(silence: str) -> None:
    code = f"import logging\n{silence}\n{TOO_LONG_VIEW}"
    assert _shown(_python(code, SAFEVIEW_BOUNDS_POLICY="warn")) == []


@pytest.mark.slow
@needs_hook
def test_info_and_debug_events_and_refusals_do_not_print() -> None:
    # the guard's started/stopped events (INFO), registration_checked (INFO) and view_created
    # (DEBUG) with the level lowered, and a refusal under strict that the program catches
    # (its ERROR event comes with the exception)
    code = (
        "import logging, torch, safeview\n"
        "logging.getLogger('safeview').setLevel(logging.DEBUG)\n"
        "kv = torch.zeros(4 * 32, dtype=torch.int8)\n"
        "from safeview.kv import block_views; block_views({'l0': kv}, {'l0': 32}, num_blocks=4)\n"
        "try:\n"
        "    torch.empty(0, dtype=torch.int8).set_(kv.untyped_storage(), 0, (5, 32), (32, 1))\n"
        "except safeview.BoundsError:\n"
        "    print('refused')\n"
    )
    result = _python(code, SAFEVIEW_GUARD="strict")
    assert _shown(result) == []
    assert result.stdout.split() == ["refused"]  # the guard was on


def test_in_process_a_logger_that_stops_propagating_without_handlers_shows_warnings(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # pytest's own handlers sit on the root logger: with propagation off, safeview's chain ends
    # at its own logger, where nothing but the fallback is
    logger = logging.getLogger("safeview")
    logger.propagate = False
    try:
        make_view(
            torch.empty(64, dtype=torch.int8, device="meta"),
            BlockLayout(num_blocks=5, page_bytes=16, block_stride_bytes=16),
            policy="warn",
        )
        with pytest.raises(BoundsError):
            make_view(
                torch.empty(64, dtype=torch.int8, device="meta"),
                BlockLayout(num_blocks=5, page_bytes=16, block_stride_bytes=16),
            )
    finally:
        logger.propagate = True
    [line] = capsys.readouterr().err.splitlines()
    _our_line(line)


def test_safeview_run_help_says_where_warnings_go() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "safeview", "run", "--help"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    text = " ".join(result.stdout.split())
    assert "each warning is one line on standard error" in text
    assert "SAFEVIEW_LOG_FORMAT=json or console" in text
