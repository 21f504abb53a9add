"""safeview's guard around vLLM 0.33's real NIXL connector: two workers on CPU, vLLM's own
handshake and READ, the bytes compared (tests/vllm_nixl_harness.py drives them).

Each group of scenarios runs in one child process (vLLM's start-up and UCX's cost seconds; UCX may
crash an interpreter at exit). These run where vLLM and NIXL are installed (``.ci/run`` makes a
virtual environment for them); elsewhere they skip, saying so. With ``SAFEVIEW_REQUIRE_VLLM=1`` a
missing vLLM or NIXL is a failure instead.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import pytest

if os.environ.get("SAFEVIEW_REQUIRE_VLLM") == "1":
    import nixl  # type: ignore[import-untyped,unused-ignore]  # noqa: F401  (CI: must import)
    import vllm  # noqa: F401
elif importlib.util.find_spec("vllm") is None or importlib.util.find_spec("nixl") is None:
    pytest.skip(
        "vLLM and NIXL are not both installed here; .ci/run tests against them",
        allow_module_level=True,
    )

import vllm_nixl_harness as harness  # type: ignore[import-not-found,unused-ignore]

HEALTHY = tuple(harness.CASES)
LAYER_0, LAYER_1, LAYER_2 = (harness.layer_name(i) for i in range(3))

#: the local rows vLLM 0.33's worker hands NIXL (``prep_xfer_dlist("NIXL_INIT_AGENT", ...)``),
#: relative to the storage's address: ``(offset, length, device, stride, count)``. Layers of an
#: ``LB*`` layout sit one after another (layer 1 of ``attention_two_pages``, of 8 heads, last);
#: ``BLHNC`` rows step over the other layers' pages; the packed MLA row is one whole block of
#: three pages, 3 x 18,432 bytes.
EXPECTED_ROWS = {
    "attention_lbhnc": [[0, 32768, 0, 32768, 10], [327680, 32768, 0, 32768, 10],
                        [655360, 32768, 0, 32768, 10]],
    "attention_lbnhc": [[0, 32768, 0, 32768, 10], [327680, 32768, 0, 32768, 10],
                        [655360, 32768, 0, 32768, 10]],
    "attention_blhnc": [[0, 32768, 0, 98304, 10], [32768, 32768, 0, 98304, 10],
                        [65536, 32768, 0, 98304, 10]],
    "attention_two_pages": [[0, 32768, 0, 32768, 10], [655360, 65536, 0, 65536, 10],
                            [327680, 32768, 0, 32768, 10]],
    "mla_lbnhc": [[0, 18432, 0, 18432, 10], [184320, 18432, 0, 18432, 10],
                  [368640, 18432, 0, 18432, 10]],
    "mla_blhnc": [[0, 55296, 0, 55296, 10]],
}  # fmt: skip
#: layer 1's row with layer 0's block length: half of each of its 65,536-byte pages
SHARED_ROW = [655360, 32768, 0, 65536, 10]


def _by_scenario(run: Any) -> dict[tuple[str, str | None, str | None], dict[str, Any]]:
    return {
        (r["scenario"]["case"], r["scenario"]["fault"], r["scenario"]["policy"]): r
        for r in run.results
    }


@pytest.fixture(scope="module")
def unguarded() -> Any:
    """vLLM alone (``SAFEVIEW_VLLM=0``): the shared block length, and a clean layout."""
    return harness.run(
        [
            harness.Scenario("attention_two_pages", fault="shared_block_len"),
            harness.Scenario("attention_two_pages"),
            harness.Scenario("attention_lbhnc", fault="skip_layer"),
            harness.Scenario("attention_lbhnc", fault="region_of_layer_0"),
        ],
        env={"SAFEVIEW_VLLM": "0"},
    )


@pytest.fixture(scope="module")
def guarded() -> Any:
    """The plugin on, as vLLM loads it: every healthy layout under strict, then the shared block
    length under strict and under warn."""
    return harness.run(
        [harness.Scenario(case, policy="strict") for case in HEALTHY]
        + [
            harness.Scenario("attention_two_pages", fault="shared_block_len", policy="strict"),
            harness.Scenario("attention_two_pages", fault="shared_block_len", policy="warn"),
        ]
        + [
            harness.Scenario("attention_lbhnc", fault=fault, policy=policy)
            for fault in ("skip_layer", "region_of_layer_0")
            for policy in ("strict", "warn")
        ]
        + [harness.Scenario("attention_lbhnc", fault="kv_sharing_layer", policy="strict")]
    )


def _whole_pages_arrived(result: dict[str, Any]) -> None:
    assert result["error"] is None, result["error"]
    assert result["transfer"]["done"]
    assert not result["transfer"]["failed"]
    for layer, numbers in result["layers"].items():
        assert numbers["delivered_bytes"] == [numbers["page_bytes"]] * 3, layer
    assert result["untouched_elsewhere"]


# -- vLLM alone --------------------------------------------------------------------------------


def test_without_safeview_nixl_takes_a_shared_block_length_and_delivers_half_of_each_page(
    unguarded: Any,
) -> None:
    result = _by_scenario(unguarded)[("attention_two_pages", "shared_block_len", None)]
    assert result["error"] is None
    # NIXL accepted the rows on both sides: they lie inside the registered memory
    assert SHARED_ROW in result["sides"]["P"]["local_rows"]
    assert SHARED_ROW in result["sides"]["D"]["local_rows"]
    # the READ reports success ...
    assert result["transfer"]["done"]
    assert not result["transfer"]["failed"]
    # ... and half of each page of layer 1 arrived; nothing says so
    layers = result["layers"]
    assert layers[LAYER_1] == {"page_bytes": 65536, "delivered_bytes": [32768] * 3}
    assert layers[LAYER_0]["delivered_bytes"] == [32768] * 3
    assert layers[LAYER_2]["delivered_bytes"] == [32768] * 3
    assert result["events"] == []


def test_safeview_vllm_0_leaves_the_nixl_agent_alone(unguarded: Any) -> None:
    for result in unguarded.results:
        for side in result["sides"].values():
            assert not side["guarded"]
            assert side["agent_type"] == "nixl_agent"
        assert result["events"] == []
    assert "event=" not in unguarded.output  # not one safeview line in the server log
    _whole_pages_arrived(_by_scenario(unguarded)[("attention_two_pages", None, None)])


# -- with safeview -------------------------------------------------------------------------------


@pytest.mark.parametrize("case", HEALTHY)
def test_every_healthy_layout_registers_and_transfers_unchanged_under_strict(
    guarded: Any, case: str
) -> None:
    result = _by_scenario(guarded)[(case, None, "strict")]
    _whole_pages_arrived(result)
    for side in ("P", "D"):
        assert result["sides"][side]["guarded"], side  # the plugin guarded the agent
        assert result["sides"][side]["same_agent"], side  # the very object vLLM made
        assert result["sides"][side]["local_rows"] == EXPECTED_ROWS[case], side
    # every layer covered (the packed MLA row covers all three), nothing failed
    quiet = ("address_violation", "coverage_violation", "registration_failed", "transfer_failed")
    assert [e for e in result["events"] if e["event"] in quiet] == []


def test_the_guarded_transfer_moves_what_vllm_alone_moves(guarded: Any, unguarded: Any) -> None:
    alone = _by_scenario(unguarded)[("attention_two_pages", None, None)]
    checked = _by_scenario(guarded)[("attention_two_pages", None, "strict")]
    assert checked["layers"] == alone["layers"]
    assert checked["sides"]["P"]["local_rows"] == alone["sides"]["P"]["local_rows"]


def test_a_shared_block_length_is_refused_under_strict_before_any_transfer(guarded: Any) -> None:
    result = _by_scenario(guarded)[("attention_two_pages", "shared_block_len", "strict")]
    error = result["error"]
    assert error is not None
    assert (error["stage"], error["type"]) == ("P.register_kv_caches", "AddressError")
    assert error["attributes"]["kind"] == "partial_page"
    assert error["attributes"]["length"] == 32768
    assert LAYER_1 in error["message"]
    assert "32,768 of the 65,536 bytes" in error["message"]
    # NIXL never saw the list, and no READ was tried: D is as it was allocated
    assert result["sides"]["P"]["local_rows"] == []
    assert result["transfer"] is None
    assert result["d_untouched"]
    [event] = [e for e in result["events"] if e["event"] == "address_violation"]
    assert event["level"] == "error"
    assert (event["kind"], event["layers"]) == ("partial_page", [LAYER_1])


def test_under_warn_a_shared_block_length_is_logged_once_per_worker_and_moves_as_without(
    guarded: Any, unguarded: Any
) -> None:
    result = _by_scenario(guarded)[("attention_two_pages", "shared_block_len", "warn")]
    alone = _by_scenario(unguarded)[("attention_two_pages", "shared_block_len", None)]
    assert result["error"] is None
    assert result["transfer"]["done"]
    assert result["layers"] == alone["layers"]  # half of each page of layer 1, as without safeview
    assert result["sides"]["P"]["local_rows"] == alone["sides"]["P"]["local_rows"]
    # checked once, when each worker prepared its list; not again for the READ
    events = [e for e in result["events"] if e["event"] == "address_violation"]
    assert len(events) == 2
    for event in events:
        assert event["level"] == "warning"
        assert (event["kind"], event["layers"]) == ("partial_page", [LAYER_1])
        assert (event["length_bytes"], event["stride_bytes"], event["count"]) == (32768, 65536, 10)
    # in the server log, through vLLM's own handler
    lines = [line for line in guarded.output.splitlines() if 'event="address_violation"' in line]
    assert any(" WARNING " in line and LAYER_1 in line for line in lines)
    assert any(" ERROR " in line and LAYER_1 in line for line in lines)  # the strict scenario


# -- nothing left behind ------------------------------------------------------------------------


@pytest.mark.parametrize("fault", ["skip_layer", "region_of_layer_0"])
def test_without_safeview_a_layer_no_descriptor_covers_reads_as_zeros_and_nothing_says_so(
    unguarded: Any, fault: str
) -> None:
    result = _by_scenario(unguarded)[("attention_lbhnc", fault, None)]
    assert result["error"] is None
    assert result["transfer"]["done"]
    assert not result["transfer"]["failed"]
    delivered = {name: layer["delivered_bytes"] for name, layer in result["layers"].items()}
    assert delivered == {LAYER_0: [32768] * 3, LAYER_1: [0] * 3, LAYER_2: [32768] * 3}
    assert result["events"] == []


def test_a_layer_the_worker_does_not_prepare_is_refused_under_strict_before_any_transfer(
    guarded: Any,
) -> None:
    result = _by_scenario(guarded)[("attention_lbhnc", "skip_layer", "strict")]
    error = result["error"]
    assert (error["stage"], error["type"]) == ("P.register_kv_caches", "CoverageError")
    assert f"layer '{LAYER_1}' is to be transferred, but 327,680 of its bytes" in error["message"]
    assert "in 10 of its 10 pages of 32,768 bytes" in error["message"]
    assert result["transfer"] is None
    assert result["d_untouched"]
    [event] = [e for e in result["events"] if e["event"] == "coverage_violation"]
    assert (event["level"], event["kind"], event["layer"]) == ("error", "unregistered", LAYER_1)
    assert (event["pages_missing"], event["bytes_missing"]) == (10, 327680)


def test_under_warn_a_layer_left_out_is_one_event_per_worker_and_moves_as_without(
    guarded: Any, unguarded: Any
) -> None:
    result = _by_scenario(guarded)[("attention_lbhnc", "skip_layer", "warn")]
    alone = _by_scenario(unguarded)[("attention_lbhnc", "skip_layer", None)]
    assert result["error"] is None
    assert result["layers"] == alone["layers"]  # layer 1 stays zero, as without safeview
    assert result["sides"]["P"]["local_rows"] == alone["sides"]["P"]["local_rows"]
    events = [e for e in result["events"] if e["event"] == "coverage_violation"]
    assert [(e["level"], e["layer"]) for e in events] == [("warning", LAYER_1)] * 2  # P and D


def test_a_region_on_another_layers_pages_is_the_wrong_layer_by_the_plugins_intent(
    guarded: Any, unguarded: Any
) -> None:
    # vLLM's worker names each region after its layer: safeview tells the guard, so a row of
    # whole pages of layer 0 in layer 1's place is refused
    strict = _by_scenario(guarded)[("attention_lbhnc", "region_of_layer_0", "strict")]
    error = strict["error"]
    assert (error["stage"], error["type"]) == ("P.register_kv_caches", "AddressError")
    assert error["attributes"]["kind"] == "wrong_layer"
    assert (
        f"is meant for layer '{LAYER_1}' but covers page 0 of view '{LAYER_0}'"
        in (error["message"])
    )
    assert strict["transfer"] is None
    assert strict["d_untouched"]
    warn = _by_scenario(guarded)[("attention_lbhnc", "region_of_layer_0", "warn")]
    alone = _by_scenario(unguarded)[("attention_lbhnc", "region_of_layer_0", None)]
    assert warn["layers"] == alone["layers"]
    kinds = [(e["event"], e.get("kind")) for e in warn["events"] if e["level"] == "warning"]
    assert (
        kinds == [("address_violation", "wrong_layer"), ("coverage_violation", "unregistered")] * 2
    )


def test_a_layer_sharing_another_layers_cache_is_skipped_as_vllm_skips_it(guarded: Any) -> None:
    # in no KV-cache group, with no spec: vLLM's worker does not transfer it, and nothing says
    # it is left out
    result = _by_scenario(guarded)[("attention_lbhnc", "kv_sharing_layer", "strict")]
    _whole_pages_arrived(result)
    assert result["sides"]["P"]["local_rows"] == EXPECTED_ROWS["attention_lbhnc"]
    quiet = ("address_violation", "coverage_violation", "internal_error", "integration_unavailable")
    assert [e for e in result["events"] if e["event"] in quiet] == []


# -- what the plugin cannot guard, it leaves alone ---------------------------------------------


class _Worker:
    """A worker that keeps a NIXL agent where vLLM 0.33's does (``nixl_wrapper``)."""

    def __init__(self, agent: object, *, use_host_buffer: bool = False) -> None:
        self.nixl_wrapper = agent
        self.use_host_buffer = use_host_buffer


class _Connector:
    def __init__(self, worker: _Worker) -> None:
        self.connector_worker = worker


class _OtherAgent:
    """An agent of a NIXL whose API this guard does not know: it has no ``prep_xfer_dlist``."""

    name = "other"


@pytest.fixture
def stepped_aside() -> Any:
    """The once-per-process notes forgotten, so each test sees its own."""
    import safeview.transfer.nixl
    import safeview.vllm

    safeview.vllm._stepped_aside.clear()
    safeview.transfer.nixl._reported.clear()
    yield
    safeview.vllm._stepped_aside.clear()
    safeview.transfer.nixl._reported.clear()


@pytest.mark.usefixtures("stepped_aside")
@pytest.mark.parametrize(
    ("worker", "kv_caches", "reason"),
    [
        (_Worker(_OtherAgent()), None, "has no method prep_xfer_dlist"),
        (_Worker(_OtherAgent(), use_host_buffer=True), None, "host buffers"),
        (_Worker(_OtherAgent()), {"layer": "not a tensor"}, "ArgumentError"),
    ],
    ids=["unknown_agent", "host_buffers", "own_failure"],
)
def test_an_agent_it_cannot_guard_is_left_alone_with_one_warning(
    worker: _Worker, kv_caches: Any, reason: str
) -> None:
    import torch

    from safeview.policy import Policy
    from safeview.testing import capture_events
    from safeview.vllm import _guard_nixl_agents

    agent = worker.nixl_wrapper
    caches = kv_caches or {"layer": torch.zeros(4, 2, 8)}
    with (
        capture_events() as events,
        _guard_nixl_agents(_Connector(worker), caches, None, Policy.STRICT),
    ):
        pass  # the connector's own register_kv_caches runs here, unchecked
    assert worker.nixl_wrapper is agent
    assert "prep_xfer_dlist" not in vars(agent)
    [event] = events
    assert (event["event"], event["level"]) == ("integration_unavailable", "warning")
    assert reason in event["reason"]


#: the child of the test below: for each AMX answer, every case's config as the harness builds it,
#: the backends vLLM picks for it, and the kernel block vLLM's NIXL worker would take
_BACKEND_PROBE = """
import json, os, sys, torch
import vllm_nixl_harness as harness
from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
from vllm.v1.worker.utils import select_common_block_size
child, found = harness._Child(), {}
for amx in (True, False):
    torch.cpu._is_amx_tile_supported = lambda amx=amx: amx  # what vLLM's CPU platform asks
    for name, case in harness.CASES.items():
        config = child.vllm_config(case, "probe")
        backends = get_current_attn_backends(config)
        try:
            kernel = select_common_block_size(case.block_size, backends)
        except ValueError as error:
            kernel = str(error)
        found[f"{amx}/{name}"] = [
            [b.get_name() for b in backends], config.cache_config.block_size, kernel
        ]
print("PROBE " + json.dumps(found), flush=True)
os._exit(0)
"""


def test_every_case_is_the_same_engine_on_a_cpu_with_or_without_amx() -> None:
    """vLLM's CPU platform gives MLA layers AMX_MLA (blocks a multiple of 32) where the CPU has
    AMX tiles and CPU_MLA (exactly 16) elsewhere; CI's machines have AMX. Each case's block size
    must be its backend's kernel block on both kinds, so the worker's blocks are the
    allocator's: the harness names CPU_MLA for MLA."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    environ = {k: v for k, v in os.environ.items() if not k.startswith("SAFEVIEW_")}
    environ["VLLM_TARGET_DEVICE"] = "cpu"
    environ["PYTHONPATH"] = str(Path(harness.__file__).resolve().parent)
    child = subprocess.run(
        [sys.executable, "-c", _BACKEND_PROBE],
        env=environ,
        capture_output=True,
        text=True,
        timeout=600,
    )
    [line] = [x for x in child.stdout.splitlines() if x.startswith("PROBE ")] or [
        child.stdout[-4000:] + child.stderr[-4000:]
    ]
    found = json.loads(line.removeprefix("PROBE "))
    for amx in (True, False):
        for name, case in harness.CASES.items():
            backend = "CPU_MLA" if case.model == "deepseek_v2" else "CPU_ATTN"
            want = [[backend], case.block_size, case.block_size]
            assert found[f"{amx}/{name}"] == want, (amx, name)
