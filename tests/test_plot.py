"""The --map picture: where the storage ends when a view runs past it, and legends off the bars."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

import matplotlib.pyplot as plt

from safeview import Plan
from safeview._plot import _draw_storage, draw_map, panels

PLANS = Path(__file__).parent.parent / "examples" / "plans"


def test_a_view_past_the_end_of_a_packed_storage_gets_a_panel_of_that_end() -> None:
    plan = Plan.load(PLANS / "broken_one_block_too_many.json")
    assert panels(plan, plan.check()) == [("storage", "kv"), ("end", "kv")]
    clean = Plan.load(PLANS / "glm_5_2_fp8_packed.json")
    assert panels(clean, clean.check()) == [("storage", "kv")]


def test_the_map_of_a_broken_plan_is_written(tmp_path: Path) -> None:
    plan = Plan.load(PLANS / "broken_one_block_too_many.json")
    path = tmp_path / "map.png"
    draw_map(plan, plan.check(), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_legend_never_covers_the_bars() -> None:
    plan = Plan.load(PLANS / "qwen3_next_hybrid.json")
    report = plan.check()
    figure, ax = plt.subplots(figsize=(11, 2.5))
    _draw_storage(ax, plan, report, plan.storages[0].name)
    figure.tight_layout()
    figure.canvas.draw()
    legend = ax.get_legend()
    assert legend is not None
    assert len(legend.get_texts()) == 4
    renderer = figure.canvas.get_renderer()  # type: ignore[attr-defined]
    data_area = ax.get_window_extent(renderer)
    assert not legend.get_window_extent(renderer).overlaps(data_area)
    plt.close(figure)


def test_a_storage_of_many_views_is_summarised_by_group_with_the_broken_ones_apart() -> None:
    from safeview._plot import ROW_LIMIT, _merged, _rows

    views = [
        {"name": f"v{i}", "storage": "kv", "num_blocks": 2, "page_bytes": 4,
         "block_stride_bytes": 4 * (ROW_LIMIT + 10), "byte_offset": 4 * i, "group": i % 2}
        for i in range(ROW_LIMIT + 10)
    ]  # fmt: skip
    views[3]["num_blocks"] = 3  # one block past the end
    plan = Plan.model_validate(
        {"storages": [{"name": "kv", "nbytes": 2 * 4 * (ROW_LIMIT + 10)}], "views": views}
    )
    report = plan.check()
    status = {row["name"]: row["status"] for row in report.rows()}
    rows = _rows(list(plan.views), status, [0, 1])
    assert [(label, len(members)) for label, _, members in rows] == [
        (f"group 0: {(ROW_LIMIT + 10) // 2:,} views", (ROW_LIMIT + 10) // 2),
        (f"group 1: {(ROW_LIMIT + 10) // 2 - 1:,} views", (ROW_LIMIT + 10) // 2 - 1),
        ("with a violation: 1 views", 1),
    ]
    assert _merged([(8, 4), (0, 4), (4, 4), (20, 2)]) == [(0, 12), (20, 2)]
