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
    raise ImportError(
        "SAFEVIEW_REQUIRE_ENGINES=1 but NIXL is not installed "
        "(pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1)"
    )

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

    from safeview.kv import block_views
    from safeview.log import configure_logging, reset_logging
    from safeview.transfer import nixl as guard_module

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
    report["make_prepped_xfer_wrapped"] = "make_prepped_xfer" in vars(agent)
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
            "failures": [e for e in events if e["event"].endswith("_failed")],
            "coverage": [e for e in events if e["event"] == "coverage_violation"],
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
    # before NIXL is handed a second registration of the same bytes (which breaks transfers)
    _tensor_cases(guarded, kv, registration, attempt, prepped)
    _intent_cases(guarded, registration, base, attempt, prepped)
    _wrapped_agent_cases(config, registration, base, attempt)
    _failure_cases(guarded, kv, base, target, attempt, report)
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


def _tensor_cases(
    guarded: Any, kv: Any, registration: Any, attempt: Callable[..., None], prepped: Any
) -> None:  # pragma: no cover - runs in the child process
    """Tensors as NIXL reads them: one row of the tensor's bytes, whatever its shape."""
    import numpy as np
    import torch

    layer_1 = kv[BLOCKS * PAGE :].view(BLOCKS, PAGE)
    # half of page 0 of layer 1, as a 1-d tensor; NIXL takes it as one row of 128 bytes
    attempt("half_page_tensor", lambda: prepped(layer_1[0, : PAGE // 2], [0]))
    # one whole page as a (1, 256) tensor: one row of 256 bytes, right
    attempt("whole_page_2d_tensor", lambda: prepped(layer_1[1:2], [0]))
    other = torch.zeros(4 * PAGE, dtype=torch.int8)
    attempt("register_2d_tensor", lambda: guarded.register_memory(other.view(4, PAGE)) is not None)
    # registered as one tensor: registering its page 1 again is a duplicate
    again = [(other.data_ptr() + PAGE, PAGE, 0, "")]
    attempt("page_again_after_tensor", lambda: guarded.register_memory(again, "DRAM") is not None)
    third = torch.zeros(2 * PAGE, dtype=torch.int8)
    nx3 = np.array([[third.data_ptr(), third.numel(), 0]], dtype=np.uint64)
    with safeview.policy_scope("off"):
        attempt("register_nx3_off", lambda: guarded.register_memory(nx3, "DRAM") is not None)
    fourth = torch.zeros(2 * PAGE, dtype=torch.int8)
    nx3 = np.array([[fourth.data_ptr(), fourth.numel(), 0]], dtype=np.uint64)
    attempt("register_nx3_strict", lambda: guarded.register_memory(nx3, "DRAM") is not None)


def _intent_cases(
    guarded: Any, registration: Any, base: int, attempt: Callable[..., None], prepped: Any
) -> None:  # pragma: no cover - runs in the child process
    """The guard told which layer each row is for: the layers' strided rows in swapped order."""
    import numpy as np

    from safeview.transfer import nixl as guard_module

    swapped = np.array(
        [[base + n * BLOCKS * PAGE, PAGE, 0, PAGE, BLOCKS] for n in (1, 0)], np.uint64
    )
    attempt("swapped_rows_no_intent", lambda: prepped(swapped, [0]))
    guard_module.guard(guarded, registration, layers="views")
    attempt("swapped_rows_views", lambda: prepped(swapped, [0]))
    guard_module.guard(guarded, registration, layers=["layers.0", "layers.1"])
    attempt("swapped_rows_told", lambda: prepped(swapped, [0]))
    guard_module.guard(guarded, registration, layers=["layers.1", "layers.0"])
    attempt("swapped_rows_told_so", lambda: prepped(swapped, [0]))
    guard_module.guard(guarded, registration)


def _failure_cases(
    guarded: Any, kv: Any, base: int, target: int, attempt: Callable[..., None], report: Any
) -> None:  # pragma: no cover - runs in the child process
    """Failures NIXL reports (it raises): each an event naming the layers, the error unchanged."""
    # host memory registered as VRAM: UCX without CUDA refuses it (NIXL_ERR_BACKEND)
    attempt(
        "registration_fails",
        lambda: guarded.register_memory([(base, kv.numel(), 0, "")], "VRAM") is not None,
    )
    # a transfer to bytes past the peer's registration: NIXL refuses it (NIXL_ERR_NOT_FOUND)
    far = guarded.get_xfer_descs([(target + 64 * PAGE, PAGE, 0)], "DRAM")
    mine = guarded.get_xfer_descs([(base + BLOCKS * PAGE, PAGE, 0)], "DRAM")
    attempt(
        "transfer_fails",
        lambda: guarded.initialize_xfer("WRITE", mine, far, report["peer_name"], b"f") is not None,
    )


def _wrapped_agent_cases(
    config: Any, registration: Any, base: int, attempt: Callable[..., None]
) -> None:  # pragma: no cover - runs in the child process
    """An agent whose methods a tracing layer wrapped with a bare (*args, **kwargs)."""
    import numpy as np
    from nixl._api import nixl_agent

    from safeview.transfer import nixl as guard_module

    wrapped = nixl_agent("wrapped", config)

    def trace(original: Any) -> Any:
        def traced(*args: Any, **kwargs: Any) -> Any:  # no functools.wraps: a bare signature
            return original(*args, **kwargs)

        return traced

    for name in ("prep_xfer_dlist", "initialize_xfer", "register_memory", "deregister_memory"):
        setattr(wrapped, name, trace(getattr(wrapped, name)))
    with capture_events() as events:
        checked = guard_module.guard(wrapped, registration)
    attempt("wrapped_register", lambda: checked.register_memory([(base, 2 * BLOCKS * PAGE, 0, "")],
                                                                "DRAM") is not None)  # fmt: skip
    short = np.array([[base + BLOCKS * PAGE, 200, 0, PAGE, BLOCKS]], np.uint64)
    attempt("wrapped_short_row", lambda: checked.prep_xfer_dlist("NIXL_INIT_AGENT", short, "DRAM"))
    rows = np.array([[base, PAGE, 0, PAGE, BLOCKS]], np.uint64)
    attempt(
        "wrapped_clean_row",
        lambda: checked.prep_xfer_dlist(agent_name="NIXL_INIT_AGENT", xfer_list=rows,
                                        mem_type="DRAM") is not None,
    )  # fmt: skip
    attempt("wrapped_odd_call", lambda: checked.prep_xfer_dlist("NIXL_INIT_AGENT") is not None)
    attempt("wrapped_events", lambda: [e["event"] for e in events])
    # only layer 0's row was prepared: layer 1 would never be transferred
    attempt("coverage_one_layer", lambda: [f.layer for f in guard_module.check_coverage(checked)])
    with safeview.policy_scope("warn"):
        attempt(
            "coverage_one_layer_warn",
            lambda: [f.message for f in guard_module.check_coverage(checked)],
        )
    layer_1 = np.array([[base + BLOCKS * PAGE, PAGE, 0, PAGE, BLOCKS]], np.uint64)
    checked.prep_xfer_dlist("NIXL_INIT_AGENT", layer_1, "DRAM")
    attempt("coverage_both_layers", lambda: guard_module.check_coverage(checked))
    # a transfer posted after its peer is gone fails in transfer() (NIXL_ERR_NOT_FOUND)
    import torch

    receiver = nixl_agent("receiver", config)
    landing = torch.zeros(PAGE, dtype=torch.int8)
    receiver.register_memory([(landing.data_ptr(), PAGE, 0, "")], "DRAM")
    name = checked.add_remote_agent(receiver.get_agent_metadata())
    stale = checked.initialize_xfer(
        "WRITE",
        checked.get_xfer_descs([(base + BLOCKS * PAGE + PAGE, PAGE, 0)], "DRAM"),
        checked.get_xfer_descs([(landing.data_ptr(), PAGE, 0)], "DRAM"),
        name,
        b"s",
    )
    checked.remove_remote_agent(name)
    attempt("transfer_fails_when_posted", lambda: checked.transfer(stale))


# -- the tests: one case each ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def nixl() -> dict[str, Any]:
    if NIXL_MISSING:
        pytest.skip(
            "NIXL is not installed here (pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1)"
        )
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


def test_the_guard_returns_the_same_agent(nixl: dict[str, Any]) -> None:
    assert nixl["same_agent"]
    # make_prepped_xfer checks nothing: it remembers what a transfer moves (to name its layers
    # if it fails), and the clean prepared transfers below move as NIXL alone moves them
    assert nixl["make_prepped_xfer_wrapped"]


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


def test_a_tensor_is_one_row_of_its_bytes_as_nixl_reads_it(nixl: dict[str, Any]) -> None:
    half = nixl["half_page_tensor"]
    assert (half["error"], half["kind"]) == ("AddressError", "partial_page")
    assert "128 of the 256 bytes of page 0 of view 'layers.1'" in half["message"]
    assert half["moved"] == []
    whole = nixl["whole_page_2d_tensor"]
    assert (whole["error"], whole["outcome"]) == (None, "DONE")
    assert whole["events"] == []


def test_tensors_and_arrays_register_through_the_guard_as_through_nixl(
    nixl: dict[str, Any],
) -> None:
    for name in ("register_2d_tensor", "register_nx3_off", "register_nx3_strict"):
        assert (nixl[name]["error"], nixl[name]["outcome"]) == (None, True), name
    again = nixl["page_again_after_tensor"]
    assert (again["error"], again["kind"]) == ("AddressError", "duplicate_registration")


def test_a_row_on_another_layers_pages_is_the_wrong_layer_once_the_guard_knows_the_intent(
    nixl: dict[str, Any],
) -> None:
    # without the intent, whole pages of some layer are right: the bytes would go to the wrong
    # layer's pages on the other side, and NIXL moves them
    blind = nixl["swapped_rows_no_intent"]
    assert (blind["error"], blind["outcome"]) == (None, "DONE")
    for name in ("swapped_rows_views", "swapped_rows_told"):
        case = nixl[name]
        assert (case["error"], case["kind"]) == ("AddressError", "wrong_layer"), name
        assert (
            "is meant for layer 'layers.0' but covers page 0 of view 'layers.1'"
            in (case["message"])
        ), name
        assert case["moved"] == []
    # rows in the order the guard was told are right
    told_so = nixl["swapped_rows_told_so"]
    assert (told_so["error"], told_so["outcome"]) == (None, "DONE")


def test_a_failed_registration_is_an_event_naming_the_layers_and_reaches_the_caller(
    nixl: dict[str, Any],
) -> None:
    case = nixl["registration_fails"]
    assert case["error"] == "nixlBackendError"  # NIXL's own error, unchanged
    [event] = case["failures"]
    assert (event["event"], event["level"]) == ("registration_failed", "warning")
    assert event["layers"] == ["layers.0", "layers.1"]
    assert event["status"] == "nixlBackendError: NIXL_ERR_BACKEND"
    assert event["source"] == "nixl.register_memory"


def test_a_failed_transfer_is_an_event_naming_the_layers_and_reaches_the_caller(
    nixl: dict[str, Any],
) -> None:
    case = nixl["transfer_fails"]
    assert case["error"] == "nixlNotFoundError"
    assert case["events"] == []  # the local row is right: only NIXL refused the transfer
    [event] = case["failures"]
    assert (event["event"], event["source"]) == ("transfer_failed", "nixl.initialize_xfer")
    assert event["layers"] == ["layers.1"]
    assert "NIXL_ERR_NOT_FOUND" in event["status"]


def test_a_layer_no_prepared_row_covers_is_unregistered(nixl: dict[str, Any]) -> None:
    strict = nixl["coverage_one_layer"]
    assert (strict["error"], strict["kind"]) == ("CoverageError", None)
    assert "layer 'layers.1' is to be transferred, but 2,048 of its bytes" in strict["message"]
    warned = nixl["coverage_one_layer_warn"]
    [message] = warned["outcome"]
    assert "in 8 of its 8 pages of 256 bytes" in message
    assert "covering layers 'layers.0' of the 2 to transfer" in message
    covered = nixl["coverage_both_layers"]
    assert (covered["error"], covered["outcome"]) == (None, [])


def test_a_transfer_that_fails_when_posted_names_the_layers_of_its_handle(
    nixl: dict[str, Any],
) -> None:
    case = nixl["transfer_fails_when_posted"]
    assert case["error"] == "nixlNotFoundError"  # NIXL's own error, unchanged
    [event] = case["failures"]
    assert (event["event"], event["source"]) == ("transfer_failed", "nixl.transfer")
    assert event["layers"] == ["layers.1"]  # from the handle initialize_xfer returned


def test_clean_transfers_leave_no_failure_event(nixl: dict[str, Any]) -> None:
    for name in ("clean_prepped", "clean_initialized", "whole_page_2d_tensor"):
        assert nixl[name]["failures"] == [], name


def test_methods_wrapped_without_their_signature_are_bound_by_nixls_own(
    nixl: dict[str, Any],
) -> None:
    assert nixl["wrapped_events"]["outcome"] == []  # no integration_unavailable
    assert nixl["wrapped_register"]["outcome"] is True
    short = nixl["wrapped_short_row"]
    assert (short["error"], short["kind"]) == ("AddressError", "partial_page")
    assert nixl["wrapped_clean_row"]["outcome"] is True
    # a call that does not fit NIXL's signature goes to NIXL, which says what is wrong
    odd = nixl["wrapped_odd_call"]
    assert odd["error"] == "TypeError"
    assert "xfer_list" in odd["message"]


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
    from safeview.transfer import MemoryMap, StorageSpan, ViewSpan
    from safeview.transfer import nixl as guard_module

    memory = MemoryMap((StorageSpan("kv", 0x1000, 64),), (ViewSpan("x", "kv", 0, 16, 16, 4),))
    agent = _OtherAgent()
    with capture_events() as events:
        with pytest.warns(RuntimeWarning, match="left the agent unguarded"):
            assert guard_module.guard(agent, memory) is agent
        guard_module.guard(_OtherAgent(), memory)  # the same reason: said once
    assert "prep_xfer_dlist" not in vars(agent)
    [unavailable] = [e for e in events if e["event"] == "integration_unavailable"]  # once
    assert unavailable["integration"] == "nixl"
    assert unavailable["reason"] == "prep_xfer_dlist of _OtherAgent takes no agent_name, xfer_list"
    assert agent.prep_xfer_dlist([(0, 1)]) == [(0, 1)]


def test_an_agent_left_unguarded_is_said_under_default_logging() -> None:
    # a plain script, no logging configured: the warning reaches stderr
    code = (
        "from safeview.transfer import nixl\n"
        "from safeview.transfer import MemoryMap, StorageSpan, ViewSpan\n"
        "m = MemoryMap((StorageSpan('kv', 0x1000, 64),), (ViewSpan('x', 'kv', 0, 16, 16, 4),))\n"
        "agent = object()\n"
        "assert nixl.guard(agent, m) is agent\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "RuntimeWarning: safeview.transfer.nixl.guard left the agent unguarded" in done.stderr
    assert "has no method prep_xfer_dlist" in done.stderr


class _RecordingAgent:
    """An agent with NIXL 1.5's signatures that records what reaches it (VRAM needs a GPU)."""

    name = "recording"

    def __init__(self) -> None:
        self.registered: list[Any] = []

    def prep_xfer_dlist(self, agent_name: str, xfer_list: Any, mem_type: Any = None) -> Any:
        return xfer_list

    def initialize_xfer(
        self, operation: str, local_descs: Any, remote_descs: Any, remote_agent: str
    ) -> Any:
        return None

    def register_memory(self, reg_list: Any, mem_type: Any = None) -> Any:
        self.registered.append(reg_list)
        return reg_list

    def deregister_memory(self, dereg_list: Any) -> None:
        return None


@pytest.mark.parametrize("order", ["two_gpus_first", "gpu_0_first"])
def test_a_registration_on_two_gpus_keeps_each_region_on_its_own_device(order: str) -> None:
    from safeview.transfer import MemoryMap, StorageSpan, ViewSpan
    from safeview.transfer import nixl as guard_module

    memory = MemoryMap((StorageSpan("kv", 0x1000, 64),), (ViewSpan("x", "kv", 0, 16, 16, 4),))
    agent = guard_module.guard(_RecordingAgent(), memory, policy="strict")
    both = [(0x10_0000, 4096, 0, ""), (0x20_0000, 4096, 1, "")]
    one = [(0x10_0800, 256, 0, "")]  # inside the first, on GPU 0
    first, second = (both, one) if order == "two_gpus_first" else (one, both)
    agent.register_memory(first, "VRAM")
    with pytest.raises(safeview.AddressError) as refused:
        agent.register_memory(second, "VRAM")
    assert refused.value.kind == "duplicate_registration"
    assert len(agent.registered) == 1  # the second never reached the engine
    # the same numbers on two other GPUs are other memory
    agent.register_memory([(0x10_0800, 256, 2, ""), (0x10_0800, 256, 3, "")], "VRAM")
    assert len(agent.registered) == 2


def test_importing_the_guard_imports_no_engine() -> None:
    code = (
        "import sys, safeview.transfer.nixl, safeview.transfer.mooncake; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('nixl', 'mooncake')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


if __name__ == "__main__":  # pragma: no cover - the child process
    result = _child()
    print(REPORT + json.dumps(result, default=str), flush=True)
    os._exit(0)
