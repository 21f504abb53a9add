"""What the vLLM plugin knows of vLLM 0.33's NIXL connector worker
(``kv_connector/v1/nixl/base_worker.py``), beyond where it keeps its agent: which layer each
region it registers belongs to (the intent of its local descriptor rows).

The worker lists one region per layer (``region_names[i]`` is region ``i``'s layer; a layer
sharing another's base address joins that region) and builds its local rows region by region
(``_build_fa_local``), so a local list of ``k`` rows per region is ``k`` consecutive rows per
layer. Rows of a packed region (whole blocks of every layer) and the Mamba and mixed-memory
lists, which are laid out otherwise, carry no intent. Imported by ``safeview.vllm`` only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from safeview.policy import Policy
from safeview.transfer.nixl import _install

__all__ = ["check_worker_coverage", "guard_worker", "layers_to_transfer", "region_intent"]


def region_intent(worker: Any) -> Callable[[int], Sequence[str | None] | None]:
    """The layer each row of a local list of ``worker`` is meant for, read from the worker's
    own regions when the list is prepared (they exist only once it registers)."""

    def names(count: int) -> list[str | None] | None:
        if getattr(worker, "_has_mamba", False) or getattr(worker, "_mixed_mem_types", False):
            return None
        region_names = list(getattr(worker, "region_names", None) or ())
        indices = list(getattr(worker, "_transfer_layer_region_indices", None) or ())
        if not indices:
            indices = list(range(len(region_names)))
        packed = getattr(worker, "_packed_member_layouts", None) or {}
        try:
            per_region = [None if region_names[i] in packed else region_names[i] for i in indices]
        except (IndexError, TypeError):
            return None
        if not per_region or count % len(per_region):
            return None
        repeat = count // len(per_region)
        return [name for name in per_region for _ in range(repeat)]

    return names


def guard_worker(
    worker: Any, agent: Any, allocation: Any, policy: Policy, whole_pages: bool
) -> Any:
    """``safeview.transfer.nixl.guard`` of ``worker``'s ``agent`` against ``allocation``, told the
    layer of each region; a step-aside is an event only (the plugin's own warning says it)."""
    return _install(agent, allocation, policy, whole_pages, region_intent(worker), warn=False)


def layers_to_transfer(
    worker: Any, kv_caches: Mapping[str, Any], kv_cache_config: Any
) -> tuple[list[str], set[str]]:
    """The layers vLLM 0.33's NIXL worker is to transfer, by its own rules
    (``register_kv_caches``): the layers of ``kv_cache_config.transfer_groups`` among
    ``kv_caches`` (a ``kv_caches`` entry with no spec there shares another layer's cache and is
    skipped on purpose), less the host-memory layers of a TP rank other than 0 when a HiSparse
    host pool is shared (``_skip_dram_xfer``: rank 0 transfers them). The second set holds the
    layers whose pages are padded state (not attention), judged by the pages they reach."""
    groups = getattr(kv_cache_config, "transfer_groups", None)
    if groups is None:
        groups = kv_cache_config.kv_cache_groups
    try:
        from vllm.v1.kv_cache_interface import AttentionSpec
    except ImportError:  # pragma: no cover - only where vLLM is not importable
        attention: tuple[type, ...] = ()
    else:
        attention = (AttentionSpec,)
    skip_host = bool(getattr(worker, "_skip_dram_xfer", False))
    layers: list[str] = []
    padded: set[str] = set()
    for group in groups:
        group_spec = group.kv_cache_spec
        specs = getattr(group_spec, "kv_cache_specs", None) or {}
        for layer in group.layer_names:
            cache = kv_caches.get(layer)
            if cache is None:
                continue
            if skip_host and getattr(getattr(cache, "device", None), "type", None) == "cpu":
                continue
            spec = specs.get(layer, group_spec)
            if attention and not isinstance(spec, attention):
                padded.add(layer)
            layers.append(layer)
    return layers, padded


def check_worker_coverage(
    worker: Any,
    agent: Any,
    allocation: Any,
    kv_caches: Mapping[str, Any],
    kv_cache_config: Any,
    policy: Policy,
) -> None:
    """After the worker registered: every layer it is to transfer lies in the local lists it
    prepared (``safeview.transfer.coverage``); under strict ``CoverageError`` stops the start-up
    before any transfer, under warn one ``coverage_violation`` per layer left out."""
    from safeview.transfer.coverage import enforce, uncovered
    from safeview.transfer.nixl import _STATE

    state = getattr(agent, "__dict__", {}).get(_STATE)
    if state is None or kv_cache_config is None or policy is Policy.OFF:
        return
    layers, padded = layers_to_transfer(worker, kv_caches, kv_cache_config)
    known = {view.layer or view.name for view in allocation.views}
    layers = [layer for layer in layers if layer in known]  # no address (meta): no descriptor
    prepared, state.prepared = list(state.prepared), []
    if not layers:
        return
    found = uncovered(prepared, allocation, layers, padded)
    enforce(found, policy, "vllm.nixl")
