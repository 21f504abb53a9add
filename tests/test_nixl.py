"""The NIXL guard against the real engine: two NIXL 1.5 agents with the UCX backend on host
memory, in one process, transferring for real.

UCX may crash the interpreter when it exits, so the agents live in a child process (this file,
run as a script), which reports every case as JSON and leaves with ``os._exit``; each test reads
its case. Without NIXL installed the tests skip, saying so; with ``SAFEVIEW_REQUIRE_ENGINES=1``
(as CI sets it) a missing NIXL is a failure instead.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

import safeview
from safeview.testing import capture_events

REPORT = "SAFEVIEW-NIXL-REPORT "
NIXL_MISSING = importlib.util.find_spec("nixl") is None
if NIXL_MISSING and os.environ.get("SAFEVIEW_REQUIRE_ENGINES") == "1":
    raise ImportError("SAFEVIEW_REQUIRE_ENGINES=1 but NIXL is not installed (pip install nixl)")

PAGE = 256
BLOCKS = 8
LAYERS = 2


# -- the child: two agents, every case ------------------------------------------------------------


def _child() -> dict[str, Any]:  # pragma: no cover - runs in the child process
    import io
    import logging

    import numpy as np
    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    from safeview import nixl as guard_module
    from safeview.kv import block_views
    from safeview.log import configure_logging, reset_logging

    config = nixl_agent_config(backends=["UCX"])
    agent = nixl_agent("initiator", config)
    peer = nixl_agent("target", config)
    kv = (torch.arange(LAYERS * BLOCKS * PAGE) % 251).to(torch.int8)
    layer_bytes = BLOCKS * PAGE
    caches = {
        f"layers.{n}": kv[n * layer_bytes : (n + 1) * layer_bytes].view(BLOCKS, PAGE)
        for n in range(LAYERS)
    }
    registration = block_views(caches, dict.fromkeys(caches, PAGE), num_blocks=BLOCKS)
    base = kv.data_ptr()
    destination = torch.zeros(LAYERS * BLOCKS * PAGE, dtype=torch.int8)
    target = destination.data_ptr()
    guarded = guard_module.guard(agent, registration)
    report: dict[str, Any] = {"same_agent": guarded is agent}
    report["make_prepped_xfer_untouched"] = "make_prepped_xfer" not in vars(agent)
    guarded.register_memory([(base, kv.numel(), 0, "")], "DRAM")
    peer.register_memory([(target, destination.numel(), 0, "")], "DRAM")
    peer_name = agent.add_remote_agent(peer.get_agent_metadata())
    report["peer_name"] = peer_name.decode() if isinstance(peer_name, bytes) else peer_name

    def finish(handle: Any) -> str:
        state = agent.transfer(handle)
        while state not in ("DONE", "ERR"):
            state = agent.check_xfer_state(handle)
        return str(state)

    def moved() -> list[int]:
        """Where the destination now differs from zero: the first and last such byte."""
        changed = np.flatnonzero(destination.numpy())
        return [int(changed[0]), int(changed[-1])] if len(changed) else []

    def attempt(name: str, run: Callable[[], Any]) -> None:
        destination.zero_()
        with capture_events() as events:
            try:
                outcome: Any = run()
                error = None
            except Exception as caught:
                outcome, error = None, caught
        entry: dict[str, Any] = {
            "outcome": outcome,
            "error": type(error).__name__ if error is not None else None,
            "message": str(error) if error is not None else None,
            "kind": getattr(error, "kind", None),
            "moved": moved(),
            "events": [e for e in events if e["event"] == "address_violation"],
        }
        report[name] = entry

    remote = agent.prep_xfer_dlist(
        "target",
        np.array([[target + n * BLOCKS * PAGE, PAGE, 0, PAGE, BLOCKS] for n in range(LAYERS)],
                 dtype=np.uint64),
        "DRAM",
    )  # fmt: skip

    def prepped(rows: Any, blocks: list[int]) -> Any:
        local = guarded.prep_xfer_dlist("NIXL_INIT_AGENT", rows, "DRAM")
        handle = guarded.make_prepped_xfer("WRITE", local, blocks, remote, blocks, b"x")
        return finish(handle)

    def initialized(local_rows: list[tuple[int, int, int]], remote_rows: Any) -> Any:
        local = agent.get_xfer_descs(local_rows, "DRAM")  # never refused: roles unknown there
        far = agent.get_xfer_descs(remote_rows, "DRAM")
        return finish(guarded.initialize_xfer("WRITE", local, far, report["peer_name"], b"y"))

    layer_rows = np.array(
        [[base + n * BLOCKS * PAGE, PAGE, 0, PAGE, BLOCKS] for n in range(LAYERS)], np.uint64
    )
    attempt("clean_prepped", lambda: prepped(layer_rows, [0, 3, 9]))
    attempt("clean_initialized", lambda: initialized([(base + PAGE, PAGE, 0)],
                                                     [(target + PAGE, PAGE, 0)]))  # fmt: skip
    two_pages = [(base + PAGE // 2, PAGE, 0)]
    attempt("two_pages", lambda: initialized(two_pages, [(target, PAGE, 0)]))
    other_layer = np.array([[base, PAGE, 0, PAGE, BLOCKS + 1]], np.uint64)
    attempt("other_layer", lambda: prepped(other_layer, [BLOCKS]))
    short = np.array([[base + BLOCKS * PAGE, 200, 0, PAGE, BLOCKS]], np.uint64)
    attempt("short_of_a_page", lambda: prepped(short, [0]))
    kernel = np.array([[base, PAGE, 0, PAGE // 2, 2 * BLOCKS]], np.uint64)
    attempt("kernel_block_stride", lambda: prepped(kernel, [1]))
    overlapping = [(target, PAGE, 0), (target + PAGE // 2, PAGE, 0)]
    overlapping = [(target, PAGE, 0), (target + PAGE // 2, PAGE, 0)]
    two_local = [(base, PAGE, 0), (base + PAGE, PAGE, 0)]
    attempt("overlapping_remote_writes", lambda: initialized(two_local, overlapping))
    attempt("descs_of_any_address", lambda: agent.get_xfer_descs([(1, 2, 0)], "DRAM") is not None)
    inside = [(base + 100, 200, 0, "")]
    attempt("second_registration", lambda: guarded.register_memory(inside, "DRAM") is not None)
    with safeview.policy_scope("off"):
        attempt("two_pages_off", lambda: initialized(two_pages, [(target, PAGE, 0)]))
        # what NIXL checks itself: one byte past the registered region, a strided row whose
        # elements are longer than its stride, two written rows on the same bytes
        past = [(base + kv.numel() - PAGE + 1, PAGE, 0)]
        attempt("nixl_past_region", lambda: initialized(past, [(target, PAGE, 0)]))
        attempt("nixl_kernel_block_stride", lambda: prepped(kernel, [1]))
        attempt("nixl_overlapping_writes", lambda: initialized(two_local, overlapping))
    short_remote = agent.prep_xfer_dlist(
        "target", np.array([[target, 200, 0, PAGE, BLOCKS]], np.uint64), "DRAM"
    )

    def short_both_sides() -> Any:
        local = guarded.prep_xfer_dlist("NIXL_INIT_AGENT", short, "DRAM")
        return finish(guarded.make_prepped_xfer("WRITE", local, [0], short_remote, [0], b"z"))

    with safeview.policy_scope("warn"):
        stream = io.StringIO()
        configure_logging("json", level=logging.WARNING, stream=stream)
        attempt("two_pages_warn", lambda: initialized(two_pages, [(target, PAGE, 0)]))
        attempt("short_of_a_page_warn", short_both_sides)
        again = [(base + 8, 8, 0, "")]
        attempt(
            "second_registration_warn",
            lambda: guarded.register_memory(again, "DRAM") is not None,
        )
        reset_logging()
        report["log_lines"] = stream.getvalue().splitlines()
    # NIXL took the second registration: the clean transfer of before may now fail
    one_page, its_place = [(base + PAGE, PAGE, 0)], [(target + PAGE, PAGE, 0)]
    attempt("clean_after_duplicate", lambda: initialized(one_page, its_place))
    report["source"] = [int(v) for v in kv[: 2 * PAGE].tolist()]
    return report


# -- the tests: one case each ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def nixl() -> dict[str, Any]:
    if NIXL_MISSING:
        pytest.skip("NIXL is not installed here (pip install --no-deps nixl nixl-cu12)")
    done = subprocess.run(
        [sys.executable, __file__],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "SAFEVIEW_BOUNDS_POLICY": "strict"},
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith(REPORT)]
    assert lines, f"the child reported nothing (exit {done.returncode}):\n{done.stderr[-3000:]}"
    report: dict[str, Any] = json.loads(lines[-1][len(REPORT) :])
    return report


def test_the_guard_returns_the_same_agent_and_leaves_make_prepped_xfer_alone(
    nixl: dict[str, Any],
) -> None:
    assert nixl["same_agent"]
    assert nixl["make_prepped_xfer_untouched"]


def test_a_clean_prepared_transfer_moves_the_bytes(nixl: dict[str, Any]) -> None:
    case = nixl["clean_prepped"]
    assert case["outcome"] == "DONE"
    assert case["error"] is None
    assert case["events"] == []
    # blocks 0 and 3 of layer 0 and block 1 of layer 1 (index 9): the first byte moved is 1
    # (byte 0 of the pattern is 0), the last the end of layer 1's block 1
    assert case["moved"] == [1, BLOCKS * PAGE + 2 * PAGE - 1]


def test_a_clean_initialized_transfer_moves_the_bytes(nixl: dict[str, Any]) -> None:
    case = nixl["clean_initialized"]
    assert case["outcome"] == "DONE"
    assert case["moved"] == [PAGE, 2 * PAGE - 1]


@pytest.mark.parametrize(
    ("name", "kind", "words"),
    [
        ("two_pages", "outside_view", "pages 0 and 1 of view 'layers.0'"),
        ("other_layer", "outside_view", "need blocks 0..8 of view 'layers.0', which has 8"),
        ("short_of_a_page", "partial_page", "200 of the 256 bytes of page 0 of view 'layers.1'"),
        ("kernel_block_stride", "outside_view", "block stride of 256 bytes, not 128"),
    ],
)
def test_strict_refuses_a_wrong_local_row_before_nixl_sees_it(
    nixl: dict[str, Any], name: str, kind: str, words: str
) -> None:
    case = nixl[name]
    assert case["error"] == "AddressError"
    assert case["kind"] == kind
    assert words in case["message"]
    assert case["moved"] == []  # the destination is unchanged
    [event] = case["events"]
    assert event["level"] == "error"
    assert event["kind"] == kind


def test_overlapping_remote_writes_of_one_transfer_are_refused(nixl: dict[str, Any]) -> None:
    case = nixl["overlapping_remote_writes"]
    assert case["error"] == "AddressError"
    assert case["kind"] == "overlapping_writes"
    assert "write descriptors 0 and 1 both write byte" in case["message"]
    assert case["events"][0]["source"] == "nixl.initialize_xfer (remote list)"
    assert case["moved"] == []


def test_get_xfer_descs_never_refuses_a_list(nixl: dict[str, Any]) -> None:
    case = nixl["descs_of_any_address"]
    assert case["error"] is None
    assert case["outcome"] is True


def test_a_second_overlapping_registration_is_refused(nixl: dict[str, Any]) -> None:
    case = nixl["second_registration"]
    assert case["error"] == "AddressError"
    assert case["kind"] == "duplicate_registration"
    assert "overlaps the region" in case["message"]
    assert "registered before with this NIXL agent" in case["message"]


def test_under_warn_the_transfer_goes_ahead_with_the_event(nixl: dict[str, Any]) -> None:
    case = nixl["two_pages_warn"]
    assert case["outcome"] == "DONE"
    assert case["error"] is None
    [event] = case["events"]
    assert event["level"] == "warning"
    assert event["kind"] == "outside_view"
    assert event["source"] == "nixl.initialize_xfer"
    # NIXL moved the straddling bytes: bytes 128..383 of the source to 0..255
    assert case["moved"] == [0, PAGE - 1]
    short = nixl["short_of_a_page_warn"]
    assert short["outcome"] == "DONE"
    assert short["events"][0]["kind"] == "partial_page"
    registered = nixl["second_registration_warn"]
    assert registered["outcome"] is True
    assert registered["events"][0]["kind"] == "duplicate_registration"


def test_nixl_accepts_a_second_registration_and_then_fails_a_clean_transfer(
    nixl: dict[str, Any],
) -> None:
    # measured on NIXL 1.5.1: what the duplicate_registration refusal prevents
    assert nixl["second_registration_warn"]["outcome"] is True
    case = nixl["clean_after_duplicate"]
    assert case["error"] == "nixlNotFoundError"
    assert case["moved"] == []


def test_the_warn_events_are_json_lines_in_the_log(nixl: dict[str, Any]) -> None:
    lines = [json.loads(line) for line in nixl["log_lines"]]
    assert [line["event"] for line in lines] == ["address_violation"] * 3
    first = lines[0]
    assert first["level"] == "warning"
    assert first["kind"] == "outside_view"
    assert first["layers"] == ["layers.0"]
    assert first["message"].startswith("descriptor 0 (address 0x")


def test_off_checks_nothing_and_nixl_moves_the_straddling_bytes(nixl: dict[str, Any]) -> None:
    case = nixl["two_pages_off"]
    assert case["outcome"] == "DONE"
    assert case["events"] == []
    assert case["moved"] == [0, PAGE - 1]


def test_nixl_itself_refuses_a_row_past_its_registered_region(nixl: dict[str, Any]) -> None:
    case = nixl["nixl_past_region"]
    assert case["error"] is not None
    assert case["error"] != "AddressError"
    assert "NIXL_ERR_NOT_FOUND" in case["message"]


def test_nixl_itself_refuses_elements_longer_than_their_stride(nixl: dict[str, Any]) -> None:
    case = nixl["nixl_kernel_block_stride"]
    assert case["error"] not in (None, "AddressError")
    assert case["moved"] == []


def test_nixl_itself_writes_two_rows_on_the_same_bytes(nixl: dict[str, Any]) -> None:
    case = nixl["nixl_overlapping_writes"]
    assert case["outcome"] == "DONE"
    # both rows landed, the second over half the first (byte 0 of the pattern is 0)
    assert case["moved"] == [1, PAGE + PAGE // 2 - 1]


# -- without the engine --------------------------------------------------------------------------


class _OtherAgent:
    """An agent of some other release, whose preparation takes other arguments."""

    name = "other"

    def prep_xfer_dlist(self, descriptors: Any) -> Any:
        return descriptors

    def initialize_xfer(self, *args: Any) -> Any:
        return args

    def register_memory(self, regions: Any) -> Any:
        return regions

    def deregister_memory(self, regions: Any) -> Any:
        return regions


def test_an_agent_with_another_api_is_left_alone_with_one_event() -> None:
    from safeview import nixl as guard_module
    from safeview.transfer import MemoryMap, StorageSpan, ViewSpan

    memory = MemoryMap((StorageSpan("kv", 0x1000, 64),), (ViewSpan("x", "kv", 0, 16, 16, 4),))
    agent = _OtherAgent()
    with capture_events() as events:
        assert guard_module.guard(agent, memory) is agent
        guard_module.guard(_OtherAgent(), memory)
    assert "prep_xfer_dlist" not in vars(agent)
    [unavailable] = [e for e in events if e["event"] == "integration_unavailable"]  # once
    assert unavailable["integration"] == "nixl"
    assert unavailable["reason"] == "prep_xfer_dlist of _OtherAgent takes no agent_name, xfer_list"
    assert agent.prep_xfer_dlist([(0, 1)]) == [(0, 1)]


def test_importing_the_guard_imports_no_engine() -> None:
    code = (
        "import sys, safeview.nixl, safeview.mooncake; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('nixl', 'mooncake')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


if __name__ == "__main__":  # pragma: no cover - the child process
    result = _child()
    print(REPORT + json.dumps(result, default=str), flush=True)
    os._exit(0)
