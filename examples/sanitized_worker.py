"""A KV-cache worker written like vLLM 0.33's offloading worker, run under ``safeview.sanitize()``.

The worker is code we do not own: it builds each layer's int8 block view with the four-argument
``Tensor.set_``. Told a page one notch too big (its spec says 8 KV heads, the cache was allocated
for 4), that call silently reallocates the whole KV cache. Under ``sanitize()`` the same unchanged
code is stopped before the call runs, with the op, the numbers and the line; a correct run is
recorded view by view and saved as a plan for ``safeview check``. Without safeview the cache moves:
its tensors follow the copy, and every address taken before (what a transfer engine was given
at registration, a CUDA graph) points at freed memory.

Run: python examples/sanitized_worker.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

import safeview

NUM_BLOCKS, LAYERS, PAGE = 10, 3, 16_384  # fp16, 16 tokens, 4 KV heads, head size 64


def allocate() -> dict[str, torch.Tensor]:
    """Layer-outer caches in one int8 buffer, as vLLM's allocator makes them."""
    raw = torch.zeros(LAYERS * NUM_BLOCKS * PAGE, dtype=torch.int8)
    per_layer = NUM_BLOCKS * PAGE // 2
    halves = raw.view(torch.float16)
    return {
        f"model.layers.{i}.self_attn": halves[i * per_layer : (i + 1) * per_layer].view(
            NUM_BLOCKS, 2, 16, 4, 64
        )
        for i in range(LAYERS)
    }


class Worker:
    """Not ours: the per-layer loop of an offloading worker, unchanged."""

    def __init__(self, page_bytes: int) -> None:
        self.page_bytes = page_bytes
        self.tensors_per_block: dict[str, torch.Tensor] = {}

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for layer, ref in kv_caches.items():
            elem = ref.element_size()
            self.tensors_per_block[layer] = torch.tensor([], dtype=torch.int8).set_(
                ref.untyped_storage(),
                ref.storage_offset() * elem,
                (NUM_BLOCKS, self.page_bytes),
                (ref.stride(0) * elem, 1),
            )


def main() -> int:
    caches = allocate()
    storage = next(iter(caches.values())).untyped_storage()

    print("1. the right page, under sanitize()")
    with safeview.sanitize() as seen:
        Worker(PAGE).register_kv_caches(caches)
    for view in seen.views:
        print(f"  {view.op} at {view.site}: bytes [{view.byte_offset}, {view.extent_bytes})")
    # a folder of this run's own, kept for `safeview check`: two users never share a file name
    plan = Path(tempfile.mkdtemp(prefix="safeview-")) / "sanitized_worker.json"
    seen.to_plan(plan, description="recorded by examples/sanitized_worker.py")
    verdict = "clean" if seen.report().ok else "broken"
    print(f"  the views together: {verdict}; saved for `safeview check {plan}`")

    print("\n2. a page twice too big (8 KV heads in the spec, 4 in the cache)")
    before = (storage.data_ptr(), storage.nbytes())
    try:
        with safeview.sanitize():
            Worker(2 * PAGE).register_kv_caches(caches)
    except safeview.BoundsError as error:
        print(f"  refused: {error}")
    assert (storage.data_ptr(), storage.nbytes()) == before
    print(f"  the KV cache is untouched: {before[1]:,} bytes at the same address")

    print("\n3. the same, without safeview")
    Worker(2 * PAGE).register_kv_caches(caches)
    moved = storage.data_ptr() != before[0]
    followed = all(
        cache.data_ptr() == storage.data_ptr() + cache.storage_offset() * cache.element_size()
        for cache in caches.values()
    )
    print(f"  the KV cache was reallocated: now {storage.nbytes():,} bytes, moved {moved};")
    print(f"  the layers' tensors followed the copy ({followed}), but an address taken before")
    print(f"  ({before[0]:#x}: a transfer engine's registration, a CUDA graph) points at")
    print("  freed memory")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
