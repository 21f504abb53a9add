"""Large plans for timing ``safeview check``: written as JSON, the way a user's plan arrives.

- ``packed_plan(100_000)``: one packed storage, every block holding one page of each of the
  100,000 views back to back (the shape of a block-major KV cache, scaled up).
- ``mixed_plan()``: 99,000 one-byte-page views of three block strides that divide one another
  (65,536, 131,072 and 262,144 bytes, a third each) interleaved over the same bytes, in two
  KV-cache groups that share those bytes (allowed: each view of group 1 lies on the same bytes as
  its twin of group 0), plus 1,000 contiguous views without a group after them. Clean: within a
  group the views hold different bytes of each period.
- ``mixed_plan(broken=True)``: the same with a view one page past the end, two views of one
  group on one byte (in each group), a contiguous view over the next one, and a contiguous view
  over grouped bytes.

Run: python benchmarks/big_plans.py OUT_FOLDER   (writes packed_100k.json, mixed_100k.json,
mixed_100k_broken.json)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

MIXED_STRIDES = (65_536, 131_072, 262_144)
MIXED_BLOCKS = 64


def packed_plan(count: int, num_blocks: int = 64) -> dict[str, Any]:
    """``count`` views of one packed storage, pages of 64 to 70 bytes."""
    pages = [64 + i % 7 for i in range(count)]
    stride = sum(pages)
    views, offset = [], 0
    for i, page in enumerate(pages):
        views.append(
            {
                "name": f"layer.{i}",
                "storage": "kv",
                "num_blocks": num_blocks,
                "page_bytes": page,
                "block_stride_bytes": stride,
                "byte_offset": offset,
                "group": 0,
            }
        )
        offset += page
    return {
        "description": f"{count:,} views of one packed storage",
        "storages": [{"name": "kv", "nbytes": num_blocks * stride}],
        "views": views,
    }


def mixed_plan(
    per_group: int = 49_500, contiguous: int = 1_000, *, broken: bool = False
) -> dict[str, Any]:
    """Two groups of ``per_group`` views of three dividing strides, and ``contiguous`` views
    without a group after them; see the module's docstring."""
    third = per_group // 3
    views: list[dict[str, Any]] = []
    for group in (0, 1):
        for i in range(per_group):
            stride = MIXED_STRIDES[min(i // third, 2)]
            views.append(
                {
                    "name": f"g{group}.layer.{i}",
                    "storage": "kv",
                    "num_blocks": MIXED_BLOCKS,
                    "page_bytes": 1,
                    "block_stride_bytes": stride,
                    "byte_offset": i,
                    "group": group,
                }
            )
    start = MIXED_BLOCKS * MIXED_STRIDES[-1]
    page = 1_024
    for i in range(contiguous):
        views.append(
            {
                "name": f"buffer.{i}",
                "storage": "kv",
                "num_blocks": 4,
                "page_bytes": page,
                "block_stride_bytes": page,
                "byte_offset": start + i * 4 * page,
            }
        )
    nbytes = start + contiguous * 4 * page
    if broken:
        views[-1]["num_blocks"] += 1  # one page past the end of the storage
        views[5]["byte_offset"] = views[4]["byte_offset"]  # two views of group 0 on one byte
        views[per_group + 7]["byte_offset"] = views[per_group + 8]["byte_offset"]  # group 1
        views[-2]["byte_offset"] = views[-3]["byte_offset"] + page  # contiguous overlap
        views[-5]["byte_offset"] = 100  # an ungrouped view on grouped bytes
    return {
        "description": f"{2 * per_group:,} views of three dividing strides in two groups and "
        f"{contiguous:,} contiguous views" + (", broken" if broken else ""),
        "storages": [{"name": "kv", "nbytes": nbytes}],
        "views": views,
    }


def write(folder: Path) -> dict[str, Path]:
    """Write the three plans into ``folder``; their paths by short name."""
    folder.mkdir(parents=True, exist_ok=True)
    plans = {
        "packed_100k": packed_plan(100_000),
        "mixed_100k": mixed_plan(),
        "mixed_100k_broken": mixed_plan(broken=True),
    }
    paths = {}
    for name, plan in plans.items():
        path = folder / f"{name}.json"
        path.write_text(json.dumps(plan))
        paths[name] = path
    return paths


if __name__ == "__main__":
    for written in write(Path(sys.argv[1])).values():
        print(written)
