"""vLLM 0.33's offloading with ``canonical_layout``: what its worker stores and loads against the
layer's manifest, byte for byte, before the worker makes any view.

With ``kv_connector_extra_config: {"canonical_layout": true}`` the offloading worker copies each
layer's page into a canonical page (all KV heads, all ``block tokens * dcp * pcp`` tokens) by
``CopyRun``s that ``derive_canonical_mappings`` (``offloading/canonical_mapping.py``) certifies
from the spec and, for attention, a few strides; an MLA page is certified from its spec alone.
Where those runs and the cache's real strides disagree, every store writes a token's bytes where
another token (or head, or element) belongs, and every load brings them back there: no error,
only wrong attention. ``safeview.manifest.canonical_bytes`` says, from the real strides, where
each local byte belongs; this module compares the two for each certified layer of this rank:

- every local byte a run copies goes to the canonical byte ``canonical_bytes`` says (``byte``);
- the runs lie inside the layer's local and canonical pages, whose sizes agree (``outside``);
- the runs copy each byte of the local page once and to distinct canonical bytes, and the
  ranks of the group, as the manifest places them, tile each canonical page exactly once with
  as many writers as vLLM elects (``tiling``): what one process can see of the others.

Layers vLLM leaves opaque (its fail-closed fallback: the page whole at a rank's own offset) are
not judged; neither is the packed path (DSv4), where the worker uses no mapping. Imported by
``safeview.vllm`` only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from safeview import log
from safeview.errors import ManifestError
from safeview.policy import Policy

__all__ = ["CanonicalFinding", "CanonicalMismatchError", "canonical_findings", "check_canonical"]

SOURCE = "vllm.offloading"


@dataclass(frozen=True)
class CanonicalFinding:
    """One disagreement: ``kind`` (``byte``, ``outside``, ``tiling``), the layer, the local page
    byte (``None`` where the finding is about the canonical page), the canonical byte vLLM's runs
    give it and the one the manifest gives it (``-1``: padding, or none), and the sentence."""

    kind: str
    layer: str
    byte: int | None
    vllm_canonical_byte: int | None
    manifest_canonical_byte: int | None
    count: int
    message: str


class CanonicalMismatchError(ManifestError):
    """vLLM's canonical page mapping of a layer and the layer's real strides disagree: the
    offloading worker would store (and load) bytes at other tokens', heads' or elements' places.
    ``findings`` holds one ``CanonicalFinding`` per layer judged wrong; ``layer``, ``byte`` and
    the two canonical bytes are the first's."""

    def __init__(self, findings: list[CanonicalFinding]) -> None:
        first = findings[0]
        self.findings = tuple(findings)
        self.layer = first.layer
        self.byte = first.byte
        self.vllm_canonical_byte = first.vllm_canonical_byte
        self.manifest_canonical_byte = first.manifest_canonical_byte
        more = len(findings) - 1
        tail = f"; and {more} more layer{'s' if more != 1 else ''}" if more else ""
        super().__init__(
            f"layers[{first.layer!r}] canonical mapping",
            None,
            f"{first.message}{tail} (kv_connector_extra_config canonical_layout: vLLM "
            "0.33's derive_canonical_mappings against the cache's strides)",
        )


def check_canonical(
    connector: Any, kv_caches: Mapping[str, Any], kv_cache_config: Any, packed: bool,
    policy: Policy,
) -> None:  # fmt: skip
    """For an offloading connector whose worker runs with ``canonical_layout``: under strict
    ``CanonicalMismatchError`` for the layers whose runs and strides disagree, under warn one
    ``canonical_mismatch`` event each. ``packed``: the worker offloads whole packed blocks and
    uses no mapping. safeview's own failure is an ``internal_error`` event; the start goes on."""
    if policy is Policy.OFF or packed:
        return
    try:
        worker = _canonical_worker(connector)
        if worker is None:
            return
        try:
            from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import (
                derive_canonical_mappings,
            )
        except ImportError as error:
            log.integration(
                "integration_unavailable", integration="vllm", version=_version(),
                reason=f"canonical_layout left unchecked: {error}",
            )  # fmt: skip
            return
        try:
            mappings = derive_canonical_mappings(worker.vllm_config, kv_cache_config, kv_caches)
        except Exception:  # vLLM's own refusal (its tiling assertion): the worker raises it too
            return
        found = canonical_findings(mappings, kv_caches, kv_cache_config, worker.vllm_config)
    except Exception as error:  # safeview's own failure: the registration goes on unchecked
        log.internal_error(where="vllm offloading canonical layout", error=error)
        return
    if not found:
        return
    strict = policy is Policy.STRICT
    for finding in found:
        log.canonical_mismatch(finding, strict=strict, policy=policy.value, source=SOURCE)
    if strict:
        raise CanonicalMismatchError(found)


def _version() -> str:
    from safeview.vllm._layout import _vllm_version

    return _vllm_version()


def _canonical_worker(connector: Any) -> Any:
    """The offloading worker of ``connector`` (or of a connector a ``MultiConnector`` drives)
    whose spec says ``canonical_layout``, or ``None``."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )

    for part in (connector, *getattr(connector, "_connectors", ())):
        if not isinstance(part, OffloadingConnector):
            continue
        worker = getattr(part, "connector_worker", None)
        config = getattr(getattr(worker, "spec", None), "config", None)
        if getattr(config, "canonical_layout", False) is True:
            return worker
    return None


# -- the judgement -----------------------------------------------------------------------------


def topology_of(vllm_config: Any, kv_cache_config: Any, rank: int | None = None) -> Any:
    """This rank's topology, under safeview's names: the TP rank from vLLM's group (else
    ``parallel_config.rank``), DCP and PCP ranks from vLLM's groups where they exist (else
    where ``derive_canonical_mappings`` puts them); ``rank`` (a position in the TP x PCP group)
    places another rank as ``derive_canonical_mappings`` does, asking no group."""
    from safeview.manifest import Topology
    from safeview.vllm._layout import _parallel, _vllm_version

    parallel = vllm_config.parallel_config
    tp = int(parallel.tensor_parallel_size)
    found: dict[str, int] = {}
    if rank is None:
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            tp_rank = int(get_tensor_model_parallel_rank())
        except Exception:  # no TP group in this process: vLLM's own reading of its rank
            tp_rank = int(parallel.rank) % tp
        try:
            found = _parallel(vllm_config)
        except Exception:  # no DCP/PCP group here: placed as derive_canonical_mappings places it
            rank = int(parallel.rank)
    if rank is not None:
        tp_rank = rank % tp
        dcp = int(getattr(parallel, "decode_context_parallel_size", 1) or 1)
        pcp = int(getattr(parallel, "prefill_context_parallel_size", 1) or 1)
        found = {}
        if dcp * pcp > 1:
            interleave = int(getattr(parallel, "cp_kv_cache_interleave_size", 1) or 1)
            found = {"dcp_size": dcp, "pcp_size": pcp, "cp_kv_cache_interleave_size": interleave,
                     "dcp_rank": tp_rank % dcp, "pcp_rank": rank // tp}  # fmt: skip
    cache = vllm_config.cache_config
    layout = getattr(cache, "kv_cache_layout", None)
    if layout is None:
        layout = getattr(kv_cache_config, "kv_cache_layout", None)
    return Topology(
        tp_rank=tp_rank,
        tp_size=tp,
        total_kv_heads=int(vllm_config.model_config.get_total_num_kv_heads()),
        engine_version=f"vllm {_vllm_version()}",
        layout=None if layout is None else str(getattr(layout, "name", layout)),
        connector="OffloadingConnector",
        **found,
    )


def _is_opaque(mapping: Any, group: int, rank: int) -> bool:
    """vLLM's fail-closed fallback: the page whole at this rank's own offset, one writer."""
    page = mapping.local_page_size_bytes
    runs = tuple(mapping.runs)
    return (
        not mapping.parallelism_agnostic
        and mapping.num_writers == 1
        and mapping.canonical_page_size_bytes == group * page
        and len(runs) == 1
        and (runs[0].local_offset, runs[0].canonical_offset, runs[0].fragment_size,
             runs[0].num_fragments) == (0, rank * page, page, 1)
    )  # fmt: skip


def canonical_findings(
    mappings: Mapping[str, Any], kv_caches: Mapping[str, Any], kv_cache_config: Any,
    vllm_config: Any,
) -> list[CanonicalFinding]:  # fmt: skip
    """Each certified layer of ``mappings`` (``derive_canonical_mappings``'s, this rank's)
    against ``canonical_bytes`` of the layer's manifest (derived from ``kv_caches``' strides):
    the first disagreement of each layer that has one."""
    from safeview.manifest.canonical import canonical_bytes, canonical_layout

    parallel = vllm_config.parallel_config
    group = int(parallel.tensor_parallel_size) * int(
        getattr(parallel, "prefill_context_parallel_size", 1) or 1
    )
    rank = int(getattr(parallel, "rank", 0))
    topology = topology_of(vllm_config, kv_cache_config)
    wanted = {
        name: kv_caches[name]
        for name, mapping in mappings.items()
        if name in kv_caches
        and getattr(kv_caches[name], "ndim", 0) in (4, 5)
        and not _is_opaque(mapping, group, rank)
    }
    if not wanted:
        return []
    found: list[CanonicalFinding] = []
    tilings: dict[Any, CanonicalFinding | None] = {}
    for name, manifest in _manifests(wanted, kv_cache_config, topology).items():
        layer = manifest.layers[name]
        if layer.kind == "state" or name not in mappings:
            continue
        mapping = mappings[name]
        ours = canonical_bytes(manifest, name)
        axes = canonical_layout(manifest, name)
        size = axes[0][1] * axes[0][2]
        finding = _compare(name, mapping, ours, size)
        if finding is None and group > 1:
            cache = wanted[name]
            key = (layer.fingerprint, layer.heads, tuple(cache.stride()), mapping.num_writers)
            if key not in tilings:
                tilings[key] = _tiling(name, mapping, cache, kv_cache_config, vllm_config, group,
                                       size)  # fmt: skip
            finding = tilings[key]
            if finding is not None and finding.layer != name:
                finding = CanonicalFinding(**{**finding.__dict__, "layer": name})
        if finding is not None:
            found.append(finding)
    return found


SPLIT_AXES = ("block", "kv", "token", "head", "element")


def _manifests(caches: Mapping[str, Any], kv_cache_config: Any, topology: Any) -> dict[str, Any]:
    """Layer name -> the manifest that describes it: vLLM 0.33's ``[B, H, N, C]`` views as the
    plugin describes them, and the ``[B, 2, N, H, D]`` pages vLLM's canonical mapping also
    certifies (K and V in page halves), by their strides."""
    from safeview.manifest import describe
    from safeview.vllm._layout import describe_caches

    four = {name: cache for name, cache in caches.items() if cache.ndim == 4}
    five = {name: cache for name, cache in caches.items() if cache.ndim == 5}
    found: dict[str, Any] = {}
    for manifest in (
        describe_caches(four, kv_cache_config, topology).manifest() if four else None,
        describe(five, axes=SPLIT_AXES, topology=topology) if five else None,
    ):
        if manifest is not None:
            found.update(dict.fromkeys(manifest.layers, manifest))
    return found


def _compare(name: str, mapping: Any, ours: Any, size: int) -> CanonicalFinding | None:
    """This rank's runs of one layer against ``ours`` (``canonical_bytes``)."""
    import numpy as np

    local = int(mapping.local_page_size_bytes)
    canonical = int(mapping.canonical_page_size_bytes)
    if local > len(ours) or canonical != size:
        return CanonicalFinding(
            "outside", name, None, None, None, 1,
            f"vLLM's mapping copies a local page of {local} bytes into a canonical page of "
            f"{canonical}; the layer's page holds {len(ours)} bytes and its canonical page "
            f"{size}",
        )  # fmt: skip
    theirs = np.full(local, -1, dtype=np.int64)
    copied = np.zeros(local, dtype=np.int64)
    for run in mapping.runs:
        starts = np.arange(run.num_fragments, dtype=np.int64)
        low = run.local_offset + starts * run.local_stride
        high = run.canonical_offset + starts * run.canonical_stride
        if run.num_fragments and (
            low.min() < 0 or low.max() + run.fragment_size > local
            or high.min() < 0 or high.max() + run.fragment_size > canonical
        ):  # fmt: skip
            return CanonicalFinding(
                "outside", name, int(low.min()), int(high.min()), None, 1,
                f"a run of vLLM's mapping ({run}) reaches outside the local page of {local} "
                f"bytes or the canonical page of {canonical}",
            )  # fmt: skip
        inner = np.arange(run.fragment_size, dtype=np.int64)
        at = (low[:, None] + inner).ravel()
        theirs[at] = (high[:, None] + inner).ravel()
        np.add.at(copied, at, 1)
    twice = np.flatnonzero(copied > 1)
    if twice.size:
        byte = int(twice[0])
        return CanonicalFinding(
            "tiling", name, byte, int(theirs[byte]), int(ours[byte]), int(twice.size),
            f"local page byte {byte} is copied by {int(copied[byte])} runs of vLLM's mapping "
            f"({twice.size} such bytes)",
        )  # fmt: skip
    mine = ours[:local]
    wrong = np.flatnonzero((theirs != mine) & ((copied > 0) | (mine >= 0)))
    if wrong.size:
        byte = int(wrong[0])
        said = "no canonical byte (padding)" if mine[byte] < 0 else f"canonical byte {mine[byte]}"
        goes = "is not copied" if copied[byte] == 0 else f"goes to canonical byte {theirs[byte]}"
        return CanonicalFinding(
            "byte", name, byte, int(theirs[byte]), int(mine[byte]), int(wrong.size),
            f"local page byte {byte} {goes} in vLLM's mapping, the layer's strides put it at "
            f"{said} ({wrong.size} of {local} bytes disagree)",
        )  # fmt: skip
    held = theirs[theirs >= 0]
    if np.unique(held).size != held.size:
        values, counts = np.unique(held, return_counts=True)
        byte = int(values[counts > 1][0])
        return CanonicalFinding(
            "tiling", name, None, byte, None, int((counts > 1).sum()),
            f"canonical byte {byte} is written by {int(counts[counts > 1][0])} local bytes of "
            "one rank",
        )  # fmt: skip
    return None


def _tiling(
    name: str, mapping: Any, cache: Any, kv_cache_config: Any, vllm_config: Any, group: int,
    size: int,
) -> CanonicalFinding | None:  # fmt: skip
    """The ranks of the group, each placed as the manifest places it: the distinct pages tile
    the canonical page exactly once, and this rank's bytes are held by as many ranks as vLLM
    elects writers."""
    import numpy as np

    from safeview.manifest.canonical import canonical_bytes

    parallel = vllm_config.parallel_config
    rank = int(getattr(parallel, "rank", 0))
    pages: dict[bytes, list[int]] = {}
    maps: dict[bytes, Any] = {}
    for other in range(group):
        topology = topology_of(vllm_config, kv_cache_config, rank=other)
        manifest = _manifests({name: cache}, kv_cache_config, topology)[name]
        where = canonical_bytes(manifest, name)
        key = where.tobytes()
        pages.setdefault(key, []).append(other)
        maps[key] = where
    mine = next(ranks for ranks in pages.values() if rank in ranks)
    if len(mine) != mapping.num_writers:
        return CanonicalFinding(
            "tiling", name, None, None, None, 1,
            f"vLLM elects {mapping.num_writers} writers of this rank's canonical bytes; by the "
            f"strides, ranks {mine} of the group's {group} hold them",
        )  # fmt: skip
    count = np.zeros(size, dtype=np.int64)
    for where in maps.values():
        held = where[where >= 0]
        if held.size and held.max() >= size:
            break
        np.add.at(count, held, 1)
    else:
        bad = np.flatnonzero(count != 1)
        if not bad.size:
            return None
        byte = int(bad[0])
        return CanonicalFinding(
            "tiling", name, None, None, byte, int(bad.size),
            f"canonical byte {byte} is held by {int(count[byte])} of the group's distinct "
            f"pages ({group} ranks), not one ({bad.size} such bytes)",
        )  # fmt: skip
    return CanonicalFinding(
        "tiling", name, None, None, None, 1,
        f"a rank of the group holds bytes past the canonical page of {size} bytes",
    )  # fmt: skip
