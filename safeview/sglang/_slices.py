"""What SGLang 0.5.23 moves between two attention-TP sizes, as two manifests ``diff`` compares.

When P's and D's attention-TP sizes differ, SGLang's ``MooncakeKVManager.send_kvcache_slice``
(``sglang/srt/disaggregation/mooncake/conn.py``) does not copy pages: for every token slot of
every K and V buffer it copies one run of heads, its offset and length counted in D's head
bytes (D's item length over the page size over D's heads a rank, sglang#22145 being the report
of that count taken per rank), from P's slot into D's. Which heads a pair exchanges follows
``compute_head_slice_params`` (``sglang/srt/disaggregation/common/staging_buffer.py``): when P
has more ranks, each P rank sends all its heads into the place they hold among D's; when D has
more, each D rank gets its heads out of the P rank that holds them.

``slice_manifests`` turns that copy into a page copy ``safeview.diff`` judges with its
``page_copy`` rule: a "page" is one token slot's run of heads, on each side (``layers.0.k``,
``layers.0.v``, ...), each byte meaning its global head and element as the real layer says. A
run that does not fall on one side's heads is described by element only, and differs.
"""

from __future__ import annotations

from safeview.manifest import Layer, Manifest, PageAxis, layer_from_geometry, layer_heads

__all__ = ["SliceCopy", "slice_copy", "slice_manifests"]


class SliceCopy:
    """The run of bytes SGLang moves per token slot between one P rank and one D rank:
    ``sender_offset`` and ``receiver_offset`` in the slot, ``length``, all in bytes."""

    __slots__ = ("length", "receiver_offset", "sender_offset")

    def __init__(self, sender_offset: int, receiver_offset: int, length: int) -> None:
        self.sender_offset = sender_offset
        self.receiver_offset = receiver_offset
        self.length = length


def slice_copy(
    *,
    sender_tp: tuple[int, int],
    receiver_tp: tuple[int, int],
    total_heads: int,
    page_size: int,
    receiver_item_bytes: int,
) -> SliceCopy:
    """SGLang 0.5.23's run for P rank ``sender_tp[0]`` of ``sender_tp[1]`` into D rank
    ``receiver_tp[0]`` of ``receiver_tp[1]`` (see the module's docstring)."""
    p_rank, p_size = sender_tp
    d_rank, d_size = receiver_tp
    p_heads = max(1, total_heads // p_size)
    d_heads = max(1, total_heads // d_size)
    head_bytes = receiver_item_bytes // page_size // d_heads
    if p_size > d_size:
        # P sends all its heads; they land where its first head sits among D's
        replicas = max(1, p_size // total_heads)
        first = (p_rank % p_size) // replicas * p_heads
        return SliceCopy(0, (first % d_heads) * head_bytes, p_heads * head_bytes)
    # D gets its heads from the P rank holding them
    replicas = max(1, d_size // total_heads)
    first = (d_rank % d_size) // replicas * d_heads
    return SliceCopy((first % p_heads) * head_bytes, 0, d_heads * head_bytes)


def _buffers(name: str, layer: Layer) -> list[tuple[str, int]]:
    """The K and V buffers of a layer: ``(name, first byte)`` each."""
    kv = next((axis for axis in layer.axes if axis.axis == "kv"), None)
    if kv is None:
        return [(name, layer.byte_offset)]
    return [
        (f"{name}.{'kv'[index]}", layer.byte_offset + index * kv.stride_bytes)
        for index in range(kv.size)
    ]


def _run_layer(
    name: str, layer: Layer, manifest: Manifest, first_byte: int, offset: int, length: int
) -> Layer:
    """The bytes ``[offset, offset + length)`` of each token slot of one buffer as a layer of
    their own, one slot a "page": by head and element where they fall on the layer's heads,
    else by element alone."""
    axes: dict[str, PageAxis] = {str(axis.axis): axis for axis in layer.axes}
    token, element = axes["token"], axes["element"]
    head = axes.get("head")
    itemsize = layer.itemsize
    slots = layer.num_blocks * token.size
    head_size = head.size if head is not None else 1
    # one head a rank: its axis has no stride to read (a size-1 dimension's is 0)
    head_stride = (
        head.stride_bytes
        if head is not None and head.size > 1
        else element.size * element.stride_bytes
    )
    topology = manifest.topology
    heads = layer.heads or layer_heads(
        topology.tp_rank, topology.tp_size, topology.total_kv_heads, head_size
    )
    whole_heads = (
        head_stride == element.size * element.stride_bytes
        and offset % head_stride == 0
        and length % head_stride == 0
        and offset + length <= head_size * head_stride
    )
    if whole_heads and length:
        first, count = offset // head_stride, length // head_stride
        return layer_from_geometry(
            name,
            axes=("kv", "block", "head", "element"),
            shape=(1, slots, count, element.size),
            strides_elements=(
                1,
                token.stride_bytes // itemsize,
                head_stride // itemsize,
                element.stride_bytes // itemsize,
            ),
            byte_offset=first_byte + offset,
            dtype=layer.dtype,
            heads=heads[first : first + count],
            kind="attention",
        )
    return layer_from_geometry(
        name,
        axes=("block", "element"),
        shape=(slots, max(1, length // itemsize)),
        # only the first slot's meaning is compared: a run past its slot is still one "page"
        strides_elements=(max(token.stride_bytes, length) // itemsize, 1),
        byte_offset=first_byte + offset,
        dtype=layer.dtype,
        kind="latent",
    )


def slice_manifests(
    sender: Manifest, receiver: Manifest, copy: SliceCopy
) -> tuple[Manifest, Manifest]:
    """P's and D's manifests as what ``copy`` moves: each K and V buffer's run of every token
    slot, a page of its own, for ``safeview.diff(..., rule="page_copy")``."""
    sides = []
    for manifest, offset in ((sender, copy.sender_offset), (receiver, copy.receiver_offset)):
        layers: dict[str, Layer] = {}
        for name, layer in manifest.layers.items():
            if not any(axis.axis == "token" for axis in layer.axes):
                continue
            for buffer, first_byte in _buffers(name, layer):
                layers[buffer] = _run_layer(
                    buffer, layer, manifest, first_byte, offset, copy.length
                )
        sides.append(Manifest(topology=manifest.topology, layers=layers))
    return sides[0], sides[1]
