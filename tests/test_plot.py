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
