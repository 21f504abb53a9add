"""Nothing left behind, for vLLM 0.33's offloading connector: every layer its worker offloads lies
whole in the block views it builds. The worker's real ``register_kv_caches`` runs through vLLM's
connector factory (tests/vllm_harness.py), with safeview's plugin installed.

A spec page shorter than the block the allocator gave the layer is no error to vLLM or torch: the
worker cuts each block short, and the rest of every block is never offloaded. These run where
vLLM is installed (``.ci/run``); elsewhere they skip, saying so.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from typing import Any

import pytest

if os.environ.get("SAFEVIEW_REQUIRE_VLLM") == "1":
    import vllm  # noqa: F401  (an ImportError here fails the run, as it must in CI)
else:
    pytest.importorskip("vllm", reason="vLLM is not installed here; .ci/run tests against it")

import vllm_harness as harness  # type: ignore[import-not-found,unused-ignore]

import safeview
from safeview.testing import capture_events
from safeview.vllm import register_plugin


def _half_kv_heads(spec: Any) -> Any:
    """The worker's spec with half the KV heads the cache was allocated with."""
    from vllm.v1.kv_cache_interface import AttentionSpec

    if isinstance(spec, AttentionSpec):
        return dataclasses.replace(spec, num_kv_heads=spec.num_kv_heads // 2)
    return spec


def _short_pages() -> Any:
    built = harness.build("full_attention_lbnhc", "cpu")
    config = built.kv_cache_config
    groups = [
        dataclasses.replace(g, kv_cache_spec=_half_kv_heads(g.kv_cache_spec))
        for g in config.kv_cache_groups
    ]
    built.worker_kv_cache_config = dataclasses.replace(config, kv_cache_groups=groups)
    return built


@pytest.fixture(autouse=True)
def plugin() -> Iterator[None]:
    """The plugin installed on vLLM's connector factory, as vLLM would; undone after, so that
    the other vLLM tests of this process find the factory as vLLM left it."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    saved = KVConnectorFactory.__dict__["create_connector"]
    register_plugin()
    yield
    setattr(KVConnectorFactory, "create_connector", saved)  # noqa: B010
    safeview.reset_logging()  # the plugin sent safeview's events to vLLM's logger


def test_without_safeview_a_spec_page_half_the_block_offloads_half_of_each_block() -> None:
    built = _short_pages()
    run = harness.run_real_worker(built)
    assert run.error is None
    view = next(iter(run.views.values()))[0]
    cache = next(iter(built.kv_caches.values()))
    block_bytes = cache.stride(0) * cache.element_size()
    assert view.shape[1] * 2 == block_bytes  # half of every block, and nothing says so


def test_a_layer_left_half_out_of_the_offloading_views_is_refused_under_strict() -> None:
    built = _short_pages()
    harness.RECEIVED.clear()
    with capture_events() as events, pytest.raises(safeview.CoverageError) as refused:
        harness.run_via_connector(built)
    assert harness.RECEIVED == []  # the worker never ran
    assert set(refused.value.layers) == set(built.kv_caches)
    assert "is to be transferred, but" in str(refused.value)
    assert "(by vllm.offloading)" in str(refused.value)
    violations = [e for e in events if e["event"] == "coverage_violation"]
    assert {e["layer"] for e in violations} == set(built.kv_caches)
    assert all(e["level"] == "error" for e in violations)


def test_under_warn_the_layers_left_out_are_events_and_the_worker_runs() -> None:
    built = _short_pages()
    with safeview.policy_scope("warn"), capture_events() as events:
        run = harness.run_via_connector(built)
    assert run.error is None
    assert len(run.views) == len(built.kv_caches)
    violations = [e for e in events if e["event"] == "coverage_violation"]
    assert [e["level"] for e in violations] == ["warning"] * len(built.kv_caches)
    cache = next(iter(built.kv_caches.values()))
    half = cache.stride(0) * cache.element_size() // 2
    assert all(e["pages_missing"] == e["bytes_missing"] // half for e in violations)


@pytest.mark.parametrize("case", harness.CASES)
def test_every_clean_layout_is_covered_whole(case: str) -> None:
    built = harness.build(case, "cpu")
    with capture_events() as events:
        run = harness.run_via_connector(built)
    assert run.error is None
    assert [e for e in events if e["event"] in ("coverage_violation", "internal_error")] == []
