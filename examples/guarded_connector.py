"""A KV-cache connector written like vLLM's offloading worker, guarded and registered by safeview.

``register_kv_caches`` receives the engine's per-layer tensors. ``guard_registration`` checks
them as given (each inside its storage, none sharing bytes with another layer of its KV-cache
group) before the connector touches them; ``block_views`` then makes the int8 block views the
connector copies blocks through, checked, and ``to_plan`` saves the layout for ``safeview check``.

Run: python examples/guarded_connector.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

import safeview
from safeview.kv import block_views, guard_registration


class OffloadingConnector:
    """The worker side of a connector: it needs one int8 (num_blocks, page) view per layer."""

    def __init__(self, num_blocks: int, page_bytes: dict[str, int], groups: dict[str, int]):
        self.num_blocks = num_blocks
        self.page_bytes = page_bytes
        self.groups = groups
        self.tensors_per_block: dict[str, tuple[torch.Tensor, ...]] = {}

    @guard_registration(groups=lambda self: self.groups)
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        registration = block_views(
            kv_caches,
            self.page_bytes,
            num_blocks=self.num_blocks,
            packed=set(kv_caches),
            groups=self.groups,
        )
        self.tensors_per_block = registration.tensors_per_block
        # a folder of this run's own, kept for `safeview check`: two users never share a file name
        plan = Path(tempfile.mkdtemp(prefix="safeview-")) / "live_registration.json"
        registration.to_plan(plan, description="captured by examples/guarded_connector.py")
        print(f"  registered {len(self.tensors_per_block)} layers; plan saved to {plan}")


def packed_kv_caches(pages: dict[str, int], num_blocks: int) -> dict[str, torch.Tensor]:
    """What the engine hands over: one block-major storage, an fp16 tensor per layer."""
    stride = sum(pages.values())
    halves = torch.zeros(num_blocks * stride, dtype=torch.int8).view(torch.float16)
    caches, offset = {}, 0
    for name, page in pages.items():
        caches[name] = torch.as_strided(
            halves, (num_blocks, page // 2), (stride // 2, 1), offset // 2
        )
        offset += page
    return caches


def main() -> int:
    safeview.configure_logging("console", level="INFO", stream=sys.stdout)
    pages = {f"model.layers.{i}.self_attn": 4_096 for i in range(4)}
    groups = dict.fromkeys(pages, 0)
    caches = packed_kv_caches(pages, num_blocks=16)

    print("1. a correct registration")
    OffloadingConnector(16, pages, groups).register_kv_caches(caches)

    print("\n2. layer 3's tensor built with layer 2's offset: the two alias")
    broken = dict(caches)
    broken["model.layers.3.self_attn"] = caches["model.layers.2.self_attn"][:, :1024]
    try:
        OffloadingConnector(16, pages, groups).register_kv_caches(broken)
    except safeview.OverlapError as error:
        print(f"  refused before the connector ran: {error}")
    finally:
        safeview.reset_logging()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
