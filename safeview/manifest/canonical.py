"""Where every token lives, and the canonical page: the bytes of a layer's page without
parallelism (all its KV heads, all ``block tokens * dcp * pcp`` tokens), as vLLM 0.33's KV
offloading defines it (``canonical_mapping.py``: "the full offloaded block without
parallelism ... in the worker's page encoding").

A rank's local slot ``s`` of a block holds the token at position ``token_positions(...)[s]``
of the tokens the block stands for: with context parallelism over ``W = dcp_size * pcp_size``
ranks, ``I`` tokens at a time (``cp_kv_cache_interleave_size``), the rank at position
``c = pcp_rank * dcp_size + dcp_rank`` holds ``(s // I * W + c) * I + s % I``; a token at
position ``g`` lives on position ``(g // I) % W``, at slot ``(g // (I * W)) * I + g % I``.

``canonical_bytes(manifest, layer)`` gives, for each byte of the layer's local page, its byte
in the canonical page (``-1`` for padding): the canonical page keeps the page's own axis order
and encoding (K/V, element, dtype), dense, with the head axis grown to the layer's total KV
heads (global head ``h`` at index ``h``) and the token axis to ``block tokens * W``. A page
whose head axis has one head keeps no stride for it (``Layer`` puts size-1 axes first): its
canonical head axis goes where the layout string puts heads (``...HNC``: outside the token
axis, as in ``HND``; any other, or none: just inside it, as in ``NHD``). numpy; no torch.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from safeview.errors import ManifestError
from safeview.manifest import Layer, Manifest, Topology, heads_of_rank

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = ["canonical_bytes", "canonical_layout", "token_of_slot", "token_positions"]


def token_of_slot(slot: int, cp_size: int, cp_rank: int, interleave: int) -> int:
    """The position, among the ``block tokens * cp_size`` tokens a block stands for, of the
    token a rank at context-parallel position ``cp_rank`` holds at local ``slot``."""
    return (slot // interleave * cp_size + cp_rank) * interleave + slot % interleave


def token_positions(topology: Topology, block_tokens: int) -> tuple[int, ...]:
    """Each local slot's token position in the block's ``block_tokens * cp_size`` tokens
    (``range(block_tokens)`` without context parallelism). ``ManifestError`` naming
    ``topology.cp_kv_cache_interleave_size`` when the interleave does not divide the block."""
    size, rank, interleave = (
        topology.cp_size,
        topology.cp_rank,
        topology.cp_kv_cache_interleave_size,
    )
    if size > 1 and block_tokens % interleave:
        raise ManifestError(
            "topology.cp_kv_cache_interleave_size",
            interleave,
            f"does not divide the block's {block_tokens} tokens",
        )
    return _positions(size, rank, interleave, block_tokens)


@functools.lru_cache(maxsize=1024)
def _positions(size: int, rank: int, interleave: int, block_tokens: int) -> tuple[int, ...]:
    # one table per placement and block size: a diff of 1,000 layers asks for it 4,000 times
    if size == 1:
        return tuple(range(block_tokens))
    return tuple(token_of_slot(slot, size, rank, interleave) for slot in range(block_tokens))


def layer_total_heads(topology: Topology, layer: Layer) -> int:
    """The KV heads of the layer over all ranks: the model's ``total_kv_heads`` when the layer
    holds the rank's share of them, else its own (its head axis times ``tp_size``, as
    ``safeview.manifest.layer_heads`` shards it), and never fewer than its highest global
    head plus one."""
    held = layer.heads
    if not held:
        return 1
    total = topology.total_kv_heads
    if total is None or held != _share(topology, total):
        total = len(held) * topology.tp_size
    return max(total, max(held) + 1)


def _share(topology: Topology, total: int) -> tuple[int, ...] | None:
    try:
        return heads_of_rank(topology.tp_rank, topology.tp_size, total)
    except ManifestError:
        return None


def canonical_layout(manifest: Manifest, layer: str) -> list[tuple[str, int, int]]:
    """The canonical page's axes, outermost first: ``(meaning, size, stride in bytes)``,
    dense, over ``kv``, ``token``, ``head`` and ``element`` (and ``byte``, the bytes of an
    element). See the module's docstring."""
    found = _layer(manifest, layer)
    return _canonical_axes(manifest.topology, found)[0]


def _layer(manifest: Manifest, name: str) -> Layer:
    if not isinstance(manifest, Manifest):
        raise ManifestError("manifest", type(manifest).__name__, "is not a Manifest")
    found = manifest.layers.get(name)
    if found is None:
        raise ManifestError(
            "layer", name, f"is not a layer of the manifest ({len(manifest.layers)} layers)"
        )
    if found.kind == "state":
        raise ManifestError(
            f"layers[{name!r}].kind", found.kind, "has no canonical page: its bytes hold no tokens"
        )
    return found


def _canonical_axes(topology: Topology, layer: Layer) -> tuple[list[tuple[str, int, int]], int]:
    """The canonical axes (outermost first, dense) and the canonical page's bytes."""
    real = [axis for axis in layer.axes if axis.size > 1 or axis.axis == "head"]
    order = [axis.axis for axis in real if axis.outer or axis.size > 1]
    heads = layer_total_heads(topology, layer) if layer.heads else 1
    if layer.heads and "head" not in order and heads > 1:
        # one local head: no stride says where heads lie; the layout string does
        at = order.index("token") if "token" in order else len(order)
        head_major = (topology.layout or "").upper().endswith("HNC")
        order.insert(at if head_major else at + 1, "head")
    sizes = {axis.axis: axis.size for axis in real}
    sizes["head"] = heads
    sizes["token"] = sizes.get("token", 1) * topology.cp_size
    axes: list[tuple[str, int, int]] = [("byte", layer.itemsize, 1)]
    stride = layer.itemsize
    for meaning in reversed(order):
        axes.append((meaning, sizes[meaning], stride))
        stride *= sizes[meaning]
    axes.reverse()
    return axes, stride


def canonical_bytes(manifest: Manifest, layer: str) -> npt.NDArray[np.int64]:
    """For each byte of ``layer``'s local page (``page_bytes`` of them), its byte in the
    canonical page, ``-1`` where it has none (padding no axis reaches). ``ManifestError`` for
    a layer the manifest does not hold, or a state (Mamba) layer, whose bytes hold no token."""
    import numpy as np

    found = _layer(manifest, layer)
    topology = manifest.topology
    axes, _ = _canonical_axes(topology, found)
    stride_of = {meaning: stride for meaning, _, stride in axes}
    k = np.arange(found.page_bytes, dtype=np.int64)
    chunk_index, rest = np.divmod(k, max(found.chunk_bytes, 1))
    index: dict[str, Any] = {}
    for axis in reversed([a for a in found.axes if a.outer]):
        chunk_index, index[axis.axis] = np.divmod(chunk_index, axis.size)
    padding = np.zeros(k.shape, dtype=bool)
    for axis in found.axes:
        if axis.outer or axis.size == 1:
            continue
        at, rest = np.divmod(rest, axis.stride_bytes)
        padding |= at >= axis.size
        index[axis.axis] = at
    padding |= rest >= found.itemsize
    canonical = rest.copy()
    for meaning, value in index.items():
        if meaning == "token":
            table = np.asarray(token_positions(topology, found.size_of("token")), dtype=np.int64)
            value = table[np.clip(value, 0, len(table) - 1)]
        elif meaning == "head":
            table = np.asarray(found.heads, dtype=np.int64)
            value = table[np.clip(value, 0, len(table) - 1)]
        canonical += value * stride_of[meaning]
    if "head" in stride_of and "head" not in index and found.heads:
        canonical += found.heads[0] * stride_of["head"]
    if "token" in stride_of and "token" not in index:  # one token a block
        canonical += token_positions(topology, 1)[0] * stride_of["token"]
    result: npt.NDArray[np.int64] = np.where(padding, -1, canonical)
    return result
