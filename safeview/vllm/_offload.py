"""Coverage for vLLM 0.33's offloading connector: every layer its worker offloads lies, whole, in
the block views the worker builds of it (``OffloadingConnectorWorker.register_kv_caches``).

The worker cuts each layer of the groups it stores (the prefix-cacheable groups, or HiSparse's
indexer groups: ``safeview.vllm._selected_groups``) into ``num_blocks`` pages of its spec's
``page_size_bytes``, one block stride apart. A page shorter than the block the allocator gave the
layer (a spec that disagrees with the allocation) is not an error to vLLM or torch: the rest of
every block is simply never offloaded, and a later load brings back a half-filled page. Imported
by ``safeview.vllm`` only, which hands it the views it planned and the allocation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from safeview import log
from safeview.errors import CoverageError
from safeview.policy import Policy

__all__ = ["check_offloading_coverage"]


def check_offloading_coverage(
    planned: Any, allocated: Callable[[], Any], config: Any, policy: Policy
) -> None:
    """The layers of ``planned`` (the worker's views, as ``safeview.vllm`` plans them) against
    ``allocated()`` (a ``MemoryMap`` of the caches as allocated): under strict ``CoverageError``
    for a layer whose allocated blocks the views leave partly out, under warn one
    ``coverage_violation`` each. safeview's own failure here is an ``internal_error`` event."""
    from safeview.transfer.coverage import enforce, uncovered

    if policy is Policy.OFF:
        return
    try:
        allocation = allocated()
        rows = []
        layers: list[str] = []
        for layer, record in zip(planned.layers, planned.records):
            base = planned.storages.facts[record.storage].base
            if not base:
                continue  # meta: no address
            num_blocks, page = record.shape
            rows.append((base + record.byte_offset, page, 0, record.strides[0], num_blocks))
            layers.append(layer)
        known = {view.layer or view.name for view in allocation.views}
        layers = [layer for layer in dict.fromkeys(layers) if layer in known]
        if not layers:
            return
        found = uncovered([rows], allocation, layers, _padded(config, layers))
    except CoverageError:
        raise
    except Exception as error:  # safeview's own failure: the registration goes on unchecked
        log.internal_error(where="vllm offloading coverage", error=error)
        return
    enforce(found, policy, "vllm.offloading")


def _padded(config: Any, layers: list[str]) -> set[str]:
    """The layers whose spec is not attention (Mamba state, padded to a common page)."""
    try:
        from vllm.v1.kv_cache_interface import AttentionSpec
    except ImportError:  # pragma: no cover - only where vLLM is not importable
        return set()
    padded = set()
    wanted = set(layers)
    for group in config.kv_cache_groups:
        specs = getattr(group.kv_cache_spec, "kv_cache_specs", None) or {}
        for layer in group.layer_names:
            spec = specs.get(layer, group.kv_cache_spec)
            if layer in wanted and not isinstance(spec, AttentionSpec):
                padded.add(layer)
    return padded
