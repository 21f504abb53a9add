"""Writes the example plans of this folder from the published layouts they describe.

Numbers (bytes) from public model configs:
- DeepSeek-V3.2: 61 layers of MLA (fp8, 656 B/token) + indexer (132 B/token), 64 tokens/block,
  block-major: pages 41,984 and 8,448 alternating, block stride 3,076,352.
- GLM-5.2-FP8, one rank: 79 MLA (576 B/token) + 22 indexer layers, 64 tokens/block, block-major:
  pages 36,864 and 8,448, block stride 3,098,112, 42,072 blocks = 130,343,768,064 bytes.
- Qwen3-Next: 12 full-attention layers (2,048 B/token, 544 tokens/block: 1,114,112 B pages) and
  36 linear-attention (Mamba-like) layers whose state (49,152 + 1,048,576 = 1,097,728 B) is
  padded to the attention page. vLLM's hybrid allocator makes 12 tensors, each shared by one layer
  of each of its 4 KV-cache groups; a block id belongs to one group at a time.
- vLLM's own unit test: fp16, 16 tokens, 4 heads, head dim 64 (16,384 B pages), 10 blocks x 3
  layers, layer l at l x 163,840.

Run: python examples/plans/make_plans.py
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from safeview import Plan

HERE = Path(__file__).parent


def packed(pages: list[tuple[str, int]], num_blocks: int, storage: str) -> list[dict[str, Any]]:
    stride = sum(page for _, page in pages)
    views, offset = [], 0
    for name, page in pages:
        views.append(
            {
                "name": name,
                "storage": storage,
                "num_blocks": num_blocks,
                "page_bytes": page,
                "block_stride_bytes": stride,
                "byte_offset": offset,
                "group": 0,
            }
        )
        offset += page
    return views


def deepseek_v3_2(num_blocks: int = 16_384) -> dict[str, Any]:
    pages = []
    for layer in range(61):
        pages += [
            (f"model.layers.{layer}.self_attn", 41_984),
            (f"model.layers.{layer}.indexer", 8_448),
        ]
    stride = sum(page for _, page in pages)
    assert stride == 3_076_352
    return {
        "description": f"DeepSeek-V3.2, 61 x (MLA + indexer) packed, {num_blocks:,} blocks",
        "storages": [{"name": "kv", "nbytes": num_blocks * stride}],
        "views": packed(pages, num_blocks, "kv"),
    }


def glm_5_2_fp8(num_blocks: int = 42_072) -> dict[str, Any]:
    pages = []
    for layer in range(79):
        pages.append((f"model.layers.{layer}.self_attn", 36_864))
        if layer < 22:
            pages.append((f"model.layers.{layer}.indexer", 8_448))
    stride = sum(page for _, page in pages)
    assert stride == 3_098_112
    return {
        "description": "GLM-5.2-FP8 per rank, 79 MLA + 22 indexer packed, 42,072 blocks",
        "storages": [{"name": "kv", "nbytes": 42_072 * stride}],
        "views": packed(pages, num_blocks, "kv"),
    }


def qwen3_next(num_blocks: int = 2_000) -> dict[str, Any]:
    page = 2_048 * 544
    assert page == 1_114_112
    assert page >= 49_152 + 1_048_576
    storages, views = [], []
    for tensor in range(12):
        name = f"kv_tensor_{tensor}"
        storages.append({"name": name, "nbytes": num_blocks * page})
        for slot in range(4):
            layer = 4 * tensor + slot
            attention = slot == 3
            views.append(
                {
                    "name": f"model.layers.{layer}."
                    + ("self_attn" if attention else "linear_attn"),
                    "storage": name,
                    "num_blocks": num_blocks,
                    "page_bytes": page,
                    "block_stride_bytes": page,
                    "byte_offset": 0,
                    "group": "attention" if attention else f"mamba.{slot}",
                }
            )
    return {
        "description": "Qwen3-Next hybrid: 12 tensors, each shared by one layer of 4 groups",
        "storages": storages,
        "views": views,
    }


def vllm_unit_test() -> dict[str, Any]:
    page, num_blocks, layer_bytes = 2 * 16 * 4 * 64 * 2, 10, 163_840
    assert page == 16_384
    assert page * num_blocks == layer_bytes
    return {
        "description": "vLLM unit-test layout: 3 layers of 10 contiguous 16 KiB blocks",
        "storages": [{"name": "kv", "nbytes": 3 * layer_bytes}],
        "views": [
            {
                "name": f"layers.{layer}",
                "storage": "kv",
                "num_blocks": num_blocks,
                "page_bytes": page,
                "block_stride_bytes": page,
                "byte_offset": layer * layer_bytes,
                "region": [layer * layer_bytes, (layer + 1) * layer_bytes],
            }
            for layer in range(3)
        ],
    }


def broken_kv_split_stride() -> dict[str, Any]:
    plan = vllm_unit_test()
    plan["description"] = (
        "vLLM unit-test layout, broken: layer 1's block stride is the 8 KiB stride of one K/V "
        "half, so each 16 KiB page overlaps the next"
    )
    plan["views"][1]["block_stride_bytes"] = 8_192
    return plan


def broken_one_block_too_many() -> dict[str, Any]:
    plan = glm_5_2_fp8(num_blocks=42_073)
    plan["description"] = "GLM-5.2-FP8, broken: 42,073 blocks registered over 42,072"
    return plan


def broken_aliasing() -> dict[str, Any]:
    plan = deepseek_v3_2()
    plan["description"] = "DeepSeek-V3.2, broken: layer 7's MLA page placed on layer 6's"
    views = {view["name"]: view for view in plan["views"]}
    views["model.layers.7.self_attn"]["byte_offset"] = views["model.layers.6.self_attn"][
        "byte_offset"
    ]
    return plan


PLANS = {
    "deepseek_v3_2_packed.json": deepseek_v3_2,
    "glm_5_2_fp8_packed.json": glm_5_2_fp8,
    "qwen3_next_hybrid.json": qwen3_next,
    "vllm_unit_test.json": vllm_unit_test,
    "broken_kv_split_stride.json": broken_kv_split_stride,
    "broken_one_block_too_many.json": broken_one_block_too_many,
    "broken_aliasing.json": broken_aliasing,
}


def main() -> None:
    for file_name, build in PLANS.items():
        Plan.model_validate(build()).dump(HERE / file_name)
        print(f"wrote {HERE / file_name}")


if __name__ == "__main__":
    main()
