"""A block-major ("packed") KV cache carved into per-layer views with safeview.

1. A small packed cache on the CPU: every layer's view is made and written through, and each
   layer's bytes land exactly where its layout says.
2. The real GLM-5.2-FP8 numbers on the meta device (130 GB, no memory used): all 101 views pass.
3. One block too many: what a four-argument ``Tensor.set_`` does to the storage (it is reallocated:
   the tensors over it follow the copy to a new address, and every address taken before, a
   ``data_ptr()`` handed to a transfer engine or a CUDA graph, points at freed memory), and what
   safeview reports instead.

Run: python examples/packed_kv_cache.py
"""

from __future__ import annotations

import sys

import torch

import safeview
from safeview import BlockLayout, BoundsError, make_view, packed_layouts


def small_cpu_cache() -> None:
    num_blocks = 8
    pages = {"layers.0.mla": 96, "layers.0.indexer": 32, "layers.1.mla": 96, "layers.1.indexer": 32}
    layouts = packed_layouts(pages, num_blocks=num_blocks)
    stride = next(iter(layouts.values())).block_stride_bytes
    kv = torch.zeros(num_blocks * stride, dtype=torch.int8)
    print(f"small packed cache: {kv.numel()} bytes, {num_blocks} blocks of {stride} bytes")
    for mark, (name, layout) in enumerate(layouts.items(), start=1):
        view = make_view(kv, layout, name=name)
        view.fill_(mark)
        print(
            f"  {name:18} offset {layout.byte_offset:4}  page {layout.page_bytes:3}  "
            f"extent {layout.extent_bytes:5}  slack {kv.numel() - layout.extent_bytes:4}"
        )
    # Every byte was written by exactly one layer: the packed pages tile the blocks.
    block = kv.view(num_blocks, stride)
    expected = torch.cat(
        [torch.full((page,), mark, dtype=torch.int8) for mark, page in enumerate(pages.values(), 1)]
    )
    assert bool((block == expected).all()), "a layer wrote outside its pages"
    print("  every block holds each layer's page where its layout says\n")


def glm_on_meta() -> None:
    pages = {}
    for layer in range(79):
        pages[f"model.layers.{layer}.self_attn"] = 36_864
        if layer < 22:
            pages[f"model.layers.{layer}.indexer"] = 8_448
    layouts = packed_layouts(pages, num_blocks=42_072)
    storage_nbytes = 42_072 * 3_098_112
    kv = torch.empty(storage_nbytes, dtype=torch.int8, device="meta")
    views = [make_view(kv, layout, name=name) for name, layout in layouts.items()]
    last = max(layout.extent_bytes for layout in layouts.values())
    print(
        f"GLM-5.2-FP8 on meta: {len(views)} views over {storage_nbytes:,} bytes; "
        f"the farthest ends at byte {last:,} (slack {storage_nbytes - last})\n"
    )


def one_block_too_many() -> None:
    layout = BlockLayout(num_blocks=5, page_bytes=16, block_stride_bytes=16)
    print(f"one block too many: {layout.num_blocks} blocks of 16 bytes over a 64-byte storage")

    victim = torch.zeros(64, dtype=torch.int8)
    layer_0 = victim[:16]  # a view made before
    storage = victim.untyped_storage()
    before = (storage.data_ptr(), storage.nbytes())  # the address a transfer engine was given
    torch.empty(0, dtype=torch.int8).set_(storage, 0, layout.shape, layout.strides)
    after = (storage.data_ptr(), storage.nbytes())
    followed = layer_0.data_ptr() == after[0]
    print(
        f"  4-argument set_: storage {before[1]} -> {after[1]} bytes, data_ptr "
        f"{'moved' if after[0] != before[0] else 'kept'}; the views made before "
        f"{'followed the copy' if followed else 'stayed behind'}, and an address taken before "
        f"({before[0]:#x}) {'now points at freed memory' if after[0] != before[0] else 'holds'}"
    )

    kv = torch.zeros(64, dtype=torch.int8)
    storage = kv.untyped_storage()
    before = (storage.data_ptr(), storage.nbytes())
    safeview.configure_logging("json", level="INFO", stream=sys.stdout)
    try:
        make_view(kv, layout, name="model.layers.3.self_attn")
    except BoundsError as error:
        print(f"  safeview: BoundsError: {error}")
    finally:
        safeview.reset_logging()
    after = (storage.data_ptr(), storage.nbytes())
    assert after == before
    print(f"  storage after safeview: {after[1]} bytes, data_ptr unchanged")


if __name__ == "__main__":
    small_cpu_cache()
    glm_on_meta()
    one_block_too_many()
