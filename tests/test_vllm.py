"""safeview.vllm against the real vLLM 0.33.0: its planner, its allocator, its offloading worker,
its connector factory and its plugin loader (tests/vllm_harness.py drives them).

These run where vLLM is installed (``.ci/run`` makes a virtual environment for it); elsewhere they
skip, saying so. With ``SAFEVIEW_REQUIRE_VLLM=1`` a missing vLLM is a failure instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

if os.environ.get("SAFEVIEW_REQUIRE_VLLM") == "1":
    import vllm  # noqa: F401  (an ImportError here fails the run, as it must in CI)
else:
    pytest.importorskip("vllm", reason="vLLM is not installed here; .ci/run tests against it")

import torch
import vllm_harness as harness  # type: ignore[import-not-found,unused-ignore]
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore[import-not-found,unused-ignore]
    KVConnectorBase_V1,
    SupportsHMA,
)

import safeview
from safeview import ArgumentError, BoundsError, OverlapError, sanitize
from safeview.testing import capture_events
from safeview.vllm import check_registration

DEVICES = ["cpu", "meta"]
TESTS = Path(__file__).parent


def _described(views: dict[str, Any]) -> dict[str, list[Any]]:
    return {layer: [harness.describe_view(view) for view in list(group)] for layer, group in
            views.items()}  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", harness.CASES)
def test_views_are_the_ones_the_real_worker_makes(case: str, device: str) -> None:
    built = harness.build(case, device)
    registration = check_registration(built.kv_caches, built.kv_cache_config)
    run = harness.run_real_worker(built)
    assert registration.report.ok, registration.report.findings
    # shape, strides, storage offset, storage data_ptr and dtype, view by view
    assert _described(registration.tensors_per_block) == _described(run.views)
    for layer, (view,) in registration.tensors_per_block.items():
        assert view.untyped_storage()._cdata == built.kv_caches[layer].untyped_storage()._cdata
    assert not run.reallocated


def test_two_groups_may_share_the_bytes_of_one_tensor() -> None:
    built = harness.build("attention_mamba", "cpu")
    registration = check_registration(built.kv_caches, built.kv_cache_config)
    groups = {view.group for view in registration.report.views}
    assert len(groups) == 2
    storages = {view.storage for view in registration.report.views}
    assert len(storages) == 1  # one allocation, layers of both groups on it, and no finding


@pytest.mark.parametrize("device", DEVICES)
def test_one_block_too_many_is_a_bounds_error_where_vllm_asserts_with_no_message(
    device: str,
) -> None:
    built = harness.build("full_attention_lbnhc", device, num_blocks_plus_one=True)
    with pytest.raises(BoundsError) as caught:
        check_registration(built.kv_caches, built.worker_kv_cache_config)
    assert caught.value.name == "model.layers.2.self_attn.attn"
    assert caught.value.overflow_bytes == 16_384
    run = harness.run_real_worker(built, raise_errors=False)
    assert type(run.error) is AssertionError
    assert str(run.error) == ""


@pytest.mark.parametrize("device", DEVICES)
def test_a_spec_page_too_big_is_refused_by_both_and_the_storage_is_untouched(device: str) -> None:
    built = harness.build("full_attention_lbnhc", device, worker_page_too_big=True)
    before = (built.storage.data_ptr(), built.storage.nbytes())
    with pytest.raises(BoundsError, match=r"model\.layers\.2\.self_attn\.attn"):
        check_registration(built.kv_caches, built.worker_kv_cache_config)
    with pytest.raises(BoundsError) as caught, sanitize():
        harness.run_real_worker(built)
    assert (
        (built.storage.data_ptr(), built.storage.nbytes())
        == before
        == (
            built.storage_data_ptr,
            491_520,
        )
    )
    assert caught.value.op == "aten::set_"
    assert caught.value.site is not None
    assert caught.value.site.startswith("offloading/worker.py:")
    assert caught.value.site.endswith("in register_kv_caches")
    if device == "cpu":  # what was prevented: vLLM alone reallocates the KV cache
        run = harness.run_real_worker(built)
        assert (run.storage_nbytes_before, run.storage_nbytes_after) == (491_520, 507_904)


def test_a_kernel_block_stride_where_a_manager_block_is_expected_is_a_self_overlap() -> None:
    built = harness.build("kernel_block_8", "cpu", kernel_stride_as_manager=True)
    with pytest.raises(OverlapError) as caught:
        check_registration(built.kv_caches, built.worker_kv_cache_config)
    assert {finding.kind for finding in caught.value.findings} == {"self_overlap"}
    assert "block_stride_bytes=8,192 smaller than page_bytes=16,384" in str(caught.value)
    assert harness.run_real_worker(built).error is None  # vLLM takes it, as "packed"


@pytest.mark.parametrize("case", ["full_attention_lbnhc", "attention_mamba"])
def test_two_layers_of_one_group_on_the_same_bytes_are_refused(case: str) -> None:
    built = harness.build(case, "cpu", alias_two_layers=True)
    with pytest.raises(OverlapError) as caught:
        check_registration(built.kv_caches, built.worker_kv_cache_config)
    [finding] = caught.value.findings
    assert finding.kind == "overlap"
    assert finding.byte is not None
    assert harness.run_real_worker(built).error is None  # vLLM merges them silently


def test_under_warn_the_events_say_it_and_the_worker_runs() -> None:
    built = harness.build("full_attention_lbnhc", "meta", worker_page_too_big=True)
    with capture_events() as events:
        registration = check_registration(
            built.kv_caches, built.worker_kv_cache_config, policy="warn"
        )
        with sanitize(policy="warn"):
            run = harness.run_real_worker(built)
    assert not registration.report.ok
    kinds = [(event["event"], event.get("op")) for event in events]
    assert ("bounds_violation", None) in kinds  # from check_registration
    assert ("bounds_violation", "aten::set_") in kinds  # from the sanitizer, op by op
    assert ("registration_checked", None) in kinds
    assert run.views  # the worker ran, as it would have without safeview


def test_structures_it_does_not_know_are_an_argument_error_naming_the_version() -> None:
    built = harness.build("full_attention_lbnhc", "cpu")
    with pytest.raises(ArgumentError, match=r"vLLM 0\.33.*vLLM 0\.33\.0 is installed"):
        check_registration(built.kv_caches, object())


# -- the plugin --------------------------------------------------------------------------------


class MisreadingConnector(harness.HarnessOffloadingConnector):  # type: ignore[misc,unused-ignore]
    """A connector whose worker reads the spec wrong (8 KV heads where the cache has 4), while the
    connector's own KVCacheConfig is right: only the sanitizer can see the bad view."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        wrong = harness.build("full_attention_lbnhc", "cpu", worker_page_too_big=True)
        worker: Any = self.connector_worker
        worker.kv_cache_config = wrong.worker_kv_cache_config


@pytest.fixture
def plugin() -> Iterator[Any]:
    """vLLM's own load_general_plugins, finding safeview's installed entry point; undone after."""
    import vllm.plugins
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    saved = KVConnectorFactory.__dict__["create_connector"]
    harness.reset_general_plugins()
    safeview.vllm._stepped_aside.clear()  # each test may be the first to step aside
    with capture_events() as events:
        vllm.plugins.load_general_plugins()  # type: ignore[no-untyped-call,unused-ignore]
        yield events
    setattr(KVConnectorFactory, "create_connector", saved)  # noqa: B010
    harness.reset_general_plugins()
    safeview.reset_logging()


def test_the_plugin_is_found_by_vllm_and_guards_the_factory(plugin: list[dict[str, Any]]) -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    create = KVConnectorFactory.__dict__["create_connector"].__func__
    assert getattr(create, "__safeview_guarded__", False)
    [installed] = [e for e in plugin if e["event"] == "integration_installed"]
    assert installed["version"] == "0.33.0"
    # its keys are the README's (the one event the main test run cannot provoke)
    from test_readme import ALWAYS, _documented_keys

    assert set(installed) - ALWAYS == _documented_keys()["integration_installed"]


def test_a_clean_registration_through_the_factory_runs_the_worker_unchanged(
    plugin: list[dict[str, Any]],
) -> None:
    plain = harness.build("full_attention_lbnhc", "cpu")
    run = harness.run_via_connector(plain)
    assert len(run.views) == 3
    assert not run.reallocated
    assert run.connector.register_kv_caches.__safeview_guarded__
    [summary] = [e for e in plugin if e["event"] == "registration_checked"]
    assert summary["source"] == "vllm"
    assert summary["violations"] == 0


def test_under_the_process_guard_the_registered_caches_are_known_memory(
    plugin: list[dict[str, Any]],
) -> None:
    import ctypes

    from safeview.guard import process

    built = harness.build("full_attention_lbnhc", "cpu")
    process.start("strict")
    try:
        harness.run_via_connector(built)
        known = {name for s in process._memory.storages.values() for _, _, name in s.layers}
        storage = next(iter(built.kv_caches.values())).untyped_storage()
        end = storage.data_ptr() + storage.nbytes()
        # a raw pointer 32 bytes before the end of the cache, read as 64 bytes (LMCache's way)
        with pytest.raises(BoundsError) as caught:
            torch.frombuffer((ctypes.c_uint8 * 64).from_address(end - 32), dtype=torch.uint8)
    finally:
        process.stop()
        process._memory.clear()
    assert known == set(built.kv_caches)
    assert caught.value.overflow_bytes == 32
    assert caught.value.name == list(built.kv_caches)[-1]


def test_aliasing_is_refused_before_the_worker_runs(plugin: list[dict[str, Any]]) -> None:
    built = harness.build("full_attention_lbnhc", "cpu", alias_two_layers=True)
    harness.RECEIVED.clear()
    with pytest.raises(OverlapError):
        harness.run_via_connector(built)
    assert harness.RECEIVED == []  # the worker never handed anything on


def test_a_bad_view_made_inside_the_connector_is_refused_by_the_sanitizer(
    plugin: list[dict[str, Any]],
) -> None:
    built = harness.build("full_attention_lbnhc", "cpu")
    before = (built.storage.data_ptr(), built.storage.nbytes())
    with pytest.raises(BoundsError) as caught:
        harness.run_via_connector(built, connector="MisreadingConnector", module_path=__name__)
    assert caught.value.op == "aten::set_"
    assert caught.value.site is not None
    assert "offloading/worker.py" in caught.value.site
    assert (built.storage.data_ptr(), built.storage.nbytes()) == before


_SUBPROCESS = """
import json, logging, sys
sys.path.insert(0, {tests!r})
import vllm.plugins
import vllm_harness as harness
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.logger import _configure_vllm_root_logger
_configure_vllm_root_logger()  # what vLLM's engine and workers do when they start
vllm.plugins.load_general_plugins()
create = KVConnectorFactory.__dict__["create_connector"].__func__
built = harness.build("full_attention_lbnhc", "cpu", alias_two_layers=True)
run = harness.run_via_connector(built, raise_errors=False)
print(json.dumps({{"guarded": bool(getattr(create, "__safeview_guarded__", False)),
                   "error": type(run.error).__name__ if run.error else None,
                   "views": len(run.views)}}))
"""


def _run_with(**env: str) -> tuple[dict[str, Any], str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SAFEVIEW_")}
    environ.update(env)
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_SUBPROCESS.format(tests=str(TESTS)))],
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stdout + result.stderr


def test_safeview_vllm_0_leaves_vllm_alone() -> None:
    outcome, _ = _run_with(SAFEVIEW_VLLM="0")
    assert outcome == {"guarded": False, "error": None, "views": 3}  # vLLM merges the alias


def test_under_warn_the_server_log_shows_the_violation_and_vllm_runs() -> None:
    outcome, output = _run_with(SAFEVIEW_BOUNDS_POLICY="warn")
    assert outcome == {"guarded": True, "error": None, "views": 3}
    # the event arrives through vLLM's own handler, in vLLM's format, located at the caller of
    # register_kv_caches (here the harness), not inside safeview
    [line] = [line for line in output.splitlines() if 'event="overlap_violation"' in line]
    assert " WARNING " in line
    assert "[vllm_harness.py:" in line
    assert 'views=["model.layers.0.self_attn.attn"' in line


def test_under_strict_the_refusal_is_in_the_server_log_and_stops_the_registration() -> None:
    outcome, output = _run_with()
    assert outcome == {"guarded": True, "error": "OverlapError", "views": 0}
    assert any(
        " ERROR " in line and 'event="overlap_violation"' in line for line in output.splitlines()
    )
    assert any('event="integration_installed"' in line for line in output.splitlines())


def test_a_vllm_without_the_factory_gets_one_warning_and_no_patching(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm.distributed.kv_transfer.kv_connector import factory

    monkeypatch.delattr(factory, "KVConnectorFactory")
    with capture_events() as events:
        from safeview.vllm import register_plugin

        register_plugin()  # must not raise
    safeview.reset_logging()
    [event] = [e for e in events if e["event"].startswith("integration_")]
    assert event["event"] == "integration_unavailable"
    assert event["level"] == "warning"
    assert "KVConnectorFactory" in event["reason"]


# -- the plugin never stops vLLM for its own reasons, and judges each connector by its own rules -


class RecordingConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc,unused-ignore]
    """A connector that is not the offloading one: it keeps the caches it is handed and, like a
    connector written after LMCache's, makes a K and a V view of each layer from the layer's own
    tensor (``v_page_of``, in elements, may put one layer's V on another's bytes)."""

    received: ClassVar[list[dict[str, Any]]] = []
    v_page_of: ClassVar[dict[str, int]] = {}

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        for layer, cache in kv_caches.items():
            half = cache.numel() // 2  # elements; the layer's cache is contiguous (LBNHC)
            torch.as_strided(cache, (half,), (1,), cache.storage_offset())
            start = self.v_page_of.get(layer, cache.storage_offset() + half)
            torch.as_strided(cache, (half,), (1,), start)
        RecordingConnector.received.append(dict(kv_caches))

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None: ...
    def wait_for_layer_load(self, layer_name: str) -> None: ...
    def save_kv_layer(self, *args: Any, **kwargs: Any) -> None: ...
    def wait_for_save(self) -> None: ...
    def get_num_new_matched_tokens(self, *args: Any, **kwargs: Any) -> Any: ...
    def update_state_after_alloc(self, *args: Any, **kwargs: Any) -> None: ...
    def build_connector_meta(self, *args: Any, **kwargs: Any) -> Any: ...
    def request_finished_all_groups(self, *args: Any, **kwargs: Any) -> Any: ...


def test_under_warn_a_wrong_worker_spec_is_logged_and_vllm_carries_on_as_it_would_alone(
    plugin: list[dict[str, Any]],
) -> None:
    built = harness.build("full_attention_lbnhc", "cpu", worker_page_too_big=True)
    alone = harness.run_real_worker(
        harness.build("full_attention_lbnhc", "cpu", worker_page_too_big=True)
    )
    with safeview.policy_scope("warn"):
        run = harness.run_via_connector(built)
    assert run.error is None
    assert len(run.views) == len(alone.views) == 3  # warn changes nothing
    assert run.reallocated == alone.reallocated
    kinds = [e["event"] for e in plugin]
    assert "bounds_violation" in kinds
    assert "registration_checked" in kinds


def test_a_kv_cache_config_it_does_not_know_steps_aside_and_the_registration_runs(
    plugin: list[dict[str, Any]],
) -> None:
    import types

    built = harness.build("full_attention_lbnhc", "cpu")
    built.worker_kv_cache_config = types.SimpleNamespace(groups_of_a_future_vllm=[])
    RecordingConnector.received.clear()
    run = harness.run_via_connector(
        built, connector="RecordingConnector", module_path=__name__, raise_errors=False
    )
    assert run.error is None
    assert len(RecordingConnector.received) == 1
    [aside] = [e for e in plugin if e["event"] == "integration_unavailable"]
    assert "left unchecked" in aside["reason"]
    assert "kv_cache_groups" in aside["reason"]


def test_a_connector_that_is_not_offloading_is_judged_by_its_allocation_not_the_offloading_views(
    plugin: list[dict[str, Any]],
) -> None:
    built = harness.build("full_attention_lhbnc", "cpu")
    with pytest.raises(OverlapError):  # the offloading worker's views of it do overlap
        check_registration(built.kv_caches, built.worker_kv_cache_config)
    RecordingConnector.received.clear()
    RecordingConnector.v_page_of = {}
    run = harness.run_via_connector(built, connector="RecordingConnector", module_path=__name__)
    assert run.error is None
    assert len(RecordingConnector.received) == 1
    [summary] = [
        e for e in plugin if e["event"] == "registration_checked" and e["source"] != "vllm"
    ]
    assert summary["source"] == "check_tensors"
    assert summary["violations"] == 0


def test_a_connectors_view_of_one_layer_on_another_layers_bytes_is_refused(
    plugin: list[dict[str, Any]],
) -> None:
    built = harness.build("full_attention_lbnhc", "cpu")
    first, second = list(built.kv_caches)[:2]
    cache = built.kv_caches[first]
    first_v = int(cache.storage_offset()) + cache.numel() // 2  # elements of layer 0's V
    RecordingConnector.received.clear()
    RecordingConnector.v_page_of = {second: first_v}  # layer 1's V on layer 0's V
    try:
        with pytest.raises(OverlapError) as caught:
            harness.run_via_connector(built, connector="RecordingConnector", module_path=__name__)
    finally:
        RecordingConnector.v_page_of = {}
    [finding] = caught.value.findings
    assert finding.views[0].startswith(f"{first}: ")
    assert finding.views[1].startswith(f"{second}: ")
    assert finding.byte == first_v * cache.element_size()
    assert RecordingConnector.received == []


def test_two_layers_of_one_group_handed_one_tensor_are_refused_for_any_connector(
    plugin: list[dict[str, Any]],
) -> None:
    built = harness.build("full_attention_lbnhc", "cpu", alias_two_layers=True)
    RecordingConnector.received.clear()
    with pytest.raises(OverlapError):
        harness.run_via_connector(built, connector="RecordingConnector", module_path=__name__)
    assert RecordingConnector.received == []


def _with_a_layer_sharing(built: Any, target: str) -> str:
    """vLLM's cross-layer KV sharing, as its model runner does it: a layer that is in no
    KV-cache group is handed its target's very tensor (``kv_caches[layer] =
    kv_caches[target]``), and the dict with both goes to ``register_kv_caches``."""
    sharing = "model.layers.3.self_attn.attn"
    groups = {name for group in built.kv_cache_config.kv_cache_groups for name in group.layer_names}
    assert sharing not in groups
    built.kv_caches = {**built.kv_caches, sharing: built.kv_caches[target]}
    return sharing


def test_a_layer_sharing_another_layers_cache_does_not_hide_it_from_the_sanitizer(
    plugin: list[dict[str, Any]],
) -> None:
    built = harness.build("full_attention_lbnhc", "cpu")
    first, second = list(built.kv_caches)[:2]
    _with_a_layer_sharing(built, first)
    cache = built.kv_caches[first]
    first_v = int(cache.storage_offset()) + cache.numel() // 2  # elements of layer 0's V
    before = (built.storage.data_ptr(), built.storage.nbytes())
    RecordingConnector.received.clear()
    RecordingConnector.v_page_of = {}
    clean = harness.run_via_connector(built, connector="RecordingConnector", module_path=__name__)
    assert clean.error is None  # the sharing layer's own views of its target's cache are fine
    assert len(RecordingConnector.received) == 1
    RecordingConnector.received.clear()
    RecordingConnector.v_page_of = {second: first_v}  # layer 1's V on layer 0's V
    try:
        with pytest.raises(OverlapError) as caught:
            harness.run_via_connector(built, connector="RecordingConnector", module_path=__name__)
    finally:
        RecordingConnector.v_page_of = {}
    [finding] = caught.value.findings
    assert finding.views[0].startswith(f"{first}: ")
    assert finding.views[1].startswith(f"{second}: ")
    assert finding.byte == first_v * cache.element_size()
    assert RecordingConnector.received == []
    assert (built.storage.data_ptr(), built.storage.nbytes()) == before


def test_under_warn_a_layer_sharing_another_layers_cache_changes_nothing_but_the_log(
    plugin: list[dict[str, Any]],
) -> None:
    built = harness.build("full_attention_lbnhc", "cpu")
    first, second = list(built.kv_caches)[:2]
    _with_a_layer_sharing(built, first)
    cache = built.kv_caches[first]
    first_v = int(cache.storage_offset()) + cache.numel() // 2
    before = (built.storage.data_ptr(), built.storage.nbytes())
    RecordingConnector.received.clear()
    RecordingConnector.v_page_of = {second: first_v}
    try:
        with safeview.policy_scope("warn"):
            run = harness.run_via_connector(
                built, connector="RecordingConnector", module_path=__name__
            )
    finally:
        RecordingConnector.v_page_of = {}
    assert run.error is None
    assert [list(caches) for caches in RecordingConnector.received] == [list(built.kv_caches)]
    assert (built.storage.data_ptr(), built.storage.nbytes()) == before
    # layer 1's V on layer 0's own bytes, then on the views the sharing layer makes of them
    events = [e for e in plugin if e["event"] == "overlap_violation"]
    assert events[0]["byte"] == first_v * cache.element_size()
    assert events[0]["views"][0].startswith(f"{first}: ")
    assert all(e["policy"] == "warn" and e["level"] == "warning" for e in events)
    assert all(any(view.startswith(f"{second}: ") for view in e["views"]) for e in events)


# -- offloading with canonical_layout: vLLM's canonical page mapping against the strides ------

CANONICAL = "HarnessCanonicalOffloadingConnector"
MLA_LAYER = "model.layers.0.self_attn.attn"


def _ranked(built: Any, *, tp: int, dcp: int, rank: int, total_kv_heads: int) -> Any:
    """``built`` as rank ``rank`` of a TP ``tp`` x DCP ``dcp`` engine sees it: vLLM's real
    ``ParallelConfig`` (what ``derive_canonical_mappings`` reads) and the model's KV heads."""
    from vllm.config import ParallelConfig  # type: ignore[import-not-found,unused-ignore]

    built.vllm_config.parallel_config = ParallelConfig(
        tensor_parallel_size=tp, decode_context_parallel_size=dcp, rank=rank
    )
    built.vllm_config.model_config.get_total_num_kv_heads = lambda: total_kv_heads
    return built


def _certified(run: Any) -> int:
    """The refs the worker handed on with a mapping vLLM certified (not its opaque fallback)."""
    refs = [ref for group in run.canonical.group_data_refs for ref in group]
    assert all(ref.mapping is not None for ref in refs)  # canonical_layout: a mapping on each
    return sum(
        ref.mapping.parallelism_agnostic or len(ref.mapping.runs) > 1 for ref in refs
    )  # fmt: skip


@pytest.mark.parametrize(
    ("case", "tp", "dcp", "heads"),
    [
        ("full_attention_lbnhc", 1, 1, 4),  # NHD pages, one rank
        ("full_attention_lbnhc", 2, 1, 8),  # rank 1 of TP 2: heads 4-7 of 8
        ("mla", 2, 2, 1),  # rank 1 of DCP 2: tokens 1, 3, 5, ... of each 32
    ],
)
def test_a_good_engine_with_canonical_layout_starts_and_each_certified_layer_was_compared(
    plugin: list[dict[str, Any]], case: str, tp: int, dcp: int, heads: int
) -> None:
    built = _ranked(harness.build(case, "cpu"), tp=tp, dcp=dcp, rank=tp - 1,
                    total_kv_heads=heads)  # fmt: skip
    run = harness.run_via_connector(built, connector=CANONICAL)
    assert run.error is None
    assert _certified(run) == len(built.kv_caches)  # every layer certified: every one compared
    kinds = {e["event"] for e in plugin}
    assert "registration_checked" in kinds
    assert not kinds & {"canonical_mismatch", "internal_error", "integration_unavailable"}


def test_an_mla_cache_vllm_certifies_without_reading_its_strides_is_refused_at_start_up(
    plugin: list[dict[str, Any]],
) -> None:
    """vLLM 0.33 certifies an MLA page from its spec alone (token rows of ``page // block``
    bytes); a kernel that keeps its pages element-major (same shape and bytes, other strides)
    has its tokens elsewhere. Rank 1 of DCP 2, interleave 1: local byte 0 is element 0 of local
    token 0, global token 1; vLLM copies it as token 1's row (canonical byte 1 x 128), the
    strides put it at element 0 of token 1 in the element-major canonical page (byte 2)."""
    from safeview.vllm._canonical import CanonicalMismatchError

    built = _ranked(harness.build("mla", "cpu", element_major=True), tp=2, dcp=2, rank=1,
                    total_kv_heads=1)  # fmt: skip
    harness.RECEIVED.clear()
    with pytest.raises(CanonicalMismatchError) as caught:
        harness.run_via_connector(built, connector=CANONICAL)
    assert harness.RECEIVED == []  # the worker never handed a mapping on
    error = caught.value
    assert isinstance(error, safeview.SafeViewError)
    assert (error.layer, error.byte) == (MLA_LAYER, 0)
    assert (error.vllm_canonical_byte, error.manifest_canonical_byte) == (128, 2)
    assert f"layers['{MLA_LAYER}']" in str(error)
    assert "local page byte 0 goes to canonical byte 128" in str(error)
    assert "canonical byte 2" in str(error)
    events = [e for e in plugin if e["event"] == "canonical_mismatch"]
    assert [e["layer"] for e in events] == list(built.kv_caches)  # both layers, by name
    assert events[0]["level"] == "error"
    assert events[0]["action"] == "refused"
    assert events[0]["bytes_wrong"] == 2016  # of 2,048: 32 where both readings meet


def test_under_warn_the_mismatch_is_an_event_and_the_worker_runs(
    plugin: list[dict[str, Any]],
) -> None:
    built = _ranked(harness.build("mla", "cpu", element_major=True), tp=2, dcp=2, rank=1,
                    total_kv_heads=1)  # fmt: skip
    with safeview.policy_scope("warn"):
        run = harness.run_via_connector(built, connector=CANONICAL)
    assert run.error is None
    assert run.canonical is not None  # the worker went on, as it would have alone
    [first, _] = [e for e in plugin if e["event"] == "canonical_mismatch"]
    assert (first["level"], first["action"], first["kind"]) == ("warning", "none", "byte")
    assert (first["byte"], first["vllm_canonical_byte"], first["manifest_canonical_byte"]) == (
        0, 128, 2
    )  # fmt: skip
    from test_readme import ALWAYS, _documented_keys

    assert set(first) - ALWAYS <= _documented_keys()["canonical_mismatch"]
    assert {"layer", "byte", "vllm_canonical_byte", "manifest_canonical_byte"} <= set(first)


def test_without_canonical_layout_or_on_one_rank_the_same_pages_are_not_a_finding(
    plugin: list[dict[str, Any]],
) -> None:
    # without canonical_layout the worker copies pages as they are: nothing to compare
    ranked = _ranked(harness.build("mla", "cpu", element_major=True), tp=2, dcp=2, rank=1,
                     total_kv_heads=1)  # fmt: skip
    assert harness.run_via_connector(ranked).error is None
    # one rank, no context parallelism: the canonical page is the page, in any order
    alone = harness.build("mla", "cpu", element_major=True)
    assert harness.run_via_connector(alone, connector=CANONICAL).error is None
    assert not [e for e in plugin if e["event"] in ("canonical_mismatch", "internal_error")]


def test_safeviews_own_failure_in_the_canonical_check_never_stops_a_healthy_engine(
    plugin: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from safeview.manifest import canonical

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("safeview's own bug")

    monkeypatch.setattr(canonical, "canonical_bytes", broken)  # stands in for a bug of ours
    built = _ranked(harness.build("mla", "cpu"), tp=2, dcp=2, rank=1, total_kv_heads=1)
    run = harness.run_via_connector(built, connector=CANONICAL)
    assert run.error is None
    [event] = [e for e in plugin if e["event"] == "internal_error"]
    assert event["where"] == "vllm offloading canonical layout"
    assert "safeview's own bug" in event["error"]


def test_each_way_a_mapping_can_disagree_is_named() -> None:
    """vLLM's own mapping of a good engine (rank 1 of TP 2 x DCP 2, MLA), changed one way at a
    time: a run shifted, a run copied twice, a run past the page, another writer count."""
    import dataclasses

    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import (  # type: ignore[import-not-found,unused-ignore]
        derive_canonical_mappings,
    )

    from safeview.vllm._canonical import canonical_findings

    built = _ranked(harness.build("mla", "cpu"), tp=4, dcp=2, rank=1, total_kv_heads=1)
    mappings = derive_canonical_mappings(built.vllm_config, built.kv_cache_config,
                                         built.kv_caches)  # fmt: skip
    good = mappings[MLA_LAYER]

    def judged(**change: Any) -> Any:
        bad = {**mappings, MLA_LAYER: dataclasses.replace(good, **change)}
        found = canonical_findings(bad, built.kv_caches, built.kv_cache_config, built.vllm_config)
        return {f.layer: f for f in found}.get(MLA_LAYER)

    assert judged() is None
    run = good.runs[1]
    shifted = dataclasses.replace(run, canonical_offset=run.canonical_offset + 2)
    finding = judged(runs=(good.runs[0], shifted, *good.runs[2:]))
    assert (finding.kind, finding.byte) == ("byte", run.local_offset)
    assert finding.vllm_canonical_byte == finding.manifest_canonical_byte + 2
    assert judged(runs=(*good.runs, good.runs[0])).kind == "tiling"  # copied twice
    past = dataclasses.replace(run, local_offset=good.local_page_size_bytes)
    assert judged(runs=(good.runs[0], past, *good.runs[2:])).kind == "outside"
    assert judged(canonical_page_size_bytes=good.canonical_page_size_bytes * 2).kind == "outside"
    writers = judged(num_writers=good.num_writers + 1)  # TP 4 / DCP 2: two ranks hold these
    assert writers.kind == "tiling"
    assert "ranks [1, 3]" in writers.message


def test_pages_with_k_and_v_in_halves_are_compared_too() -> None:
    """vLLM's canonical mapping also certifies ``[B, 2, N, H, D]`` caches (K and V in page
    halves): rank 1 of TP 2, NHD, 4 of 8 heads, compared through the same check."""
    import dataclasses
    import types

    from vllm.config import ParallelConfig  # type: ignore[import-not-found,unused-ignore]
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import (  # type: ignore[import-not-found,unused-ignore]
        derive_canonical_mappings,
    )
    from vllm.v1.kv_cache_interface import (  # type: ignore[import-not-found,unused-ignore]
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )

    from safeview.vllm._canonical import canonical_findings

    spec = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=8, dtype=torch.float16)
    config = KVCacheConfig(num_blocks=2, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(["attn"], spec)])  # fmt: skip
    vllm_config = types.SimpleNamespace(
        parallel_config=ParallelConfig(tensor_parallel_size=2, rank=1),
        model_config=types.SimpleNamespace(get_total_num_kv_heads=lambda: 8),
        cache_config=types.SimpleNamespace(kv_cache_layout="LBNHC"),
    )
    caches = {"attn": torch.zeros(2, 2, 16, 4, 8, dtype=torch.float16)}
    mappings = derive_canonical_mappings(vllm_config, config, caches)
    assert len(mappings["attn"].runs) > 1  # certified: K and V, token rows at heads 4-7
    assert canonical_findings(mappings, caches, config, vllm_config) == []
    first = mappings["attn"].runs[0]
    moved = dataclasses.replace(first, canonical_offset=first.canonical_offset + 16)
    bad = {"attn": dataclasses.replace(mappings["attn"], runs=(moved, *mappings["attn"].runs[1:]))}
    [finding] = canonical_findings(bad, caches, config, vllm_config)
    assert (finding.kind, finding.layer, finding.byte) == ("byte", "attn", first.local_offset)
    assert finding.manifest_canonical_byte is not None
    assert finding.vllm_canonical_byte == finding.manifest_canonical_byte + 16
