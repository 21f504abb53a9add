"""The --map picture: the culprits named at any size, a sane size whatever the plan, every text off
the bars and inside the picture, the hatching visible, and the README's picture what the README's
command draws today."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("matplotlib")

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.image import imread

from safeview import Plan
from safeview.cli._map import (
    MAX_SIDE_PX,
    NAMED_LIMIT,
    PAST_END_FACE,
    RED,
    ROW_LIMIT,
    WIDTH_PX,
    _merged,
    draw_map,
    layout,
    picture,
)

ROOT = Path(__file__).parent.parent
PLANS = ROOT / "examples" / "plans"
README_COMMAND = "safeview check examples/plans/broken_aliasing.json --map broken_aliasing.png"


def _load(file_name: str) -> Plan:
    return Plan.load(PLANS / file_name)


def _labels(plan: Plan) -> list[list[str]]:
    """Each panel's row labels."""
    return [[row.label for row in rows] for _, rows in layout(plan, plan.check()).panels]


def _storages(count: int, views_each: int, broken: frozenset[int] = frozenset()) -> Plan:
    """``count`` packed storages of ``views_each`` views; in those of ``broken``, view 1 lies on
    view 0."""
    storages, views = [], []
    for s in range(count):
        storages.append({"name": f"tensor_{s}", "nbytes": 4 * 64 * views_each})
        for v in range(views_each):
            offset = 64 * v if not (s in broken and v == 1) else 0
            views.append({"name": f"s{s}.v{v}", "storage": f"tensor_{s}", "num_blocks": 4,
                          "page_bytes": 64, "block_stride_bytes": 64 * views_each,
                          "byte_offset": offset, "group": 0})  # fmt: skip
    return Plan.model_validate({"storages": storages, "views": views})


def _many_views(count: int, broken: int) -> Plan:
    """One packed storage of ``count`` one-group views; the first ``broken`` of them one block too
    long."""
    views = [
        {"name": f"layer.{i}", "storage": "kv", "num_blocks": 3 if i < broken else 2,
         "page_bytes": 4, "block_stride_bytes": 4 * count, "byte_offset": 4 * i, "group": 0}
        for i in range(count)
    ]  # fmt: skip
    return Plan.model_validate({"storages": [{"name": "kv", "nbytes": 8 * count}], "views": views})


def _rendered(figure: Figure) -> Any:
    canvas = FigureCanvasAgg(figure)
    canvas.draw()  # type: ignore[no-untyped-call]
    return canvas.get_renderer()  # type: ignore[no-untyped-call]


def _title(ax: Any) -> Any:
    """A panel's title: set with ``loc="left"``, so not ``ax.title``."""
    return ax._left_title


def test_a_view_past_the_end_of_a_packed_storage_gets_a_panel_of_that_end() -> None:
    plan = _load("broken_one_block_too_many.json")
    kinds = [(panel.kind, panel.storage) for panel, _ in layout(plan, plan.check()).panels]
    assert kinds == [("storage", "kv"), ("end", "kv")]
    clean = _load("glm_5_2_fp8_packed.json")
    assert [panel.kind for panel, _ in layout(clean, clean.check()).panels] == ["storage"]


def test_past_120_views_the_rows_with_a_violation_name_the_culprits() -> None:
    # DeepSeek-V3.2's 122 views: a summary, and the two layers that share bytes by name
    [rows] = _labels(_load("broken_aliasing.json"))
    culprits = ["model.layers.6.self_attn", "model.layers.7.self_attn"]
    assert rows == ["group 0: 120 other views", *culprits]


def test_past_the_named_limit_the_culprits_are_counted_by_kind() -> None:
    plan = _many_views(ROW_LIMIT + 30, broken=NAMED_LIMIT + 7)
    [(_, rows), (_, end_rows)] = layout(plan, plan.check()).panels
    assert rows[0].label == f"group 0: {ROW_LIMIT + 30 - NAMED_LIMIT - 7} other views"
    assert [row.label for row in rows[1:-1]] == [f"layer.{i}" for i in range(NAMED_LIMIT)]
    assert all(row.note == "out_of_bounds" for row in rows[1:-1])
    assert (rows[-1].label, rows[-1].note) == ("7 more with a violation", "out_of_bounds x7")
    assert [row.label for row in end_rows] == [row.label for row in rows]


def test_up_to_120_views_each_view_has_its_row() -> None:
    [rows] = _labels(_load("deepseek_v3_2_packed.json").model_copy(
        update={"views": _load("deepseek_v3_2_packed.json").views[:ROW_LIMIT]}
    ))  # fmt: skip
    assert rows[:2] == ["model.layers.0.self_attn", "model.layers.0.indexer"]
    assert len(rows) == ROW_LIMIT


@pytest.mark.parametrize(
    "plan",
    [_load("broken_one_block_too_many.json"), _load("qwen3_next_hybrid.json"),
     _storages(400, 6, broken=frozenset({5, 399})), _storages(3, 120),
     _many_views(5_000, broken=300)],
    ids=["one-block-too-many", "qwen3-next", "400-storages", "3x120-views", "5000-views"],
)  # fmt: skip
def test_the_picture_stays_within_2000_pixels_a_side(plan: Plan, tmp_path: Path) -> None:
    chosen = layout(plan, plan.check())
    assert chosen.width_px == WIDTH_PX <= MAX_SIDE_PX
    assert chosen.height_px <= MAX_SIDE_PX
    draw_map(plan, plan.check(), tmp_path / "map.png")
    height, width, _ = imread(tmp_path / "map.png").shape
    assert (width, height) == (chosen.width_px, chosen.height_px)


def test_storages_left_out_for_room_are_named_and_violations_kept() -> None:
    plan = _storages(400, 6, broken=frozenset({5, 399}))
    chosen = layout(plan, plan.check())
    drawn = [panel.storage for panel, _ in chosen.panels]
    assert "tensor_5" in drawn
    assert "tensor_399" in drawn  # with a violation: kept before any clean storage
    assert drawn[0] == "tensor_0"
    assert sorted(drawn + chosen.left_out, key=lambda n: int(n.split("_")[1])) == [
        f"tensor_{s}" for s in range(400)
    ]
    texts = [text.get_text() for text in picture(plan, plan.check()).texts]
    [footer] = [text for text in texts if "left out for room" in text]
    assert footer.startswith(f"{len(chosen.left_out)} storages left out for room: tensor_")


@pytest.mark.parametrize(
    "plan",
    [_load("broken_one_block_too_many.json"), _load("broken_aliasing.json"),
     _load("qwen3_next_hybrid.json"), _storages(2, 3, broken=frozenset({1}))],
    ids=["one-block-too-many", "aliasing", "qwen3-next", "two-storages"],
)  # fmt: skip
def test_every_text_is_inside_the_picture_and_off_the_bars(plan: Plan) -> None:
    figure = picture(plan, plan.check())
    renderer = _rendered(figure)
    whole = figure.bbox
    areas = [ax.get_window_extent(renderer) for ax in figure.axes]
    for ax in figure.axes:
        low, high = ax.get_xlim()
        shown = [t for t in ax.get_xticklabels() if low <= t.get_position()[0] <= high]
        texts = [*ax.get_yticklabels(), *shown, *ax.texts, ax.xaxis.label]
        texts.append(_title(ax))
        for text in texts:
            if not text.get_text():
                continue
            box = text.get_window_extent(renderer)
            assert whole.x0 - 0.5 <= box.x0, text.get_text()
            assert box.x1 <= whole.x1 + 0.5, text.get_text()
            assert whole.y0 - 0.5 <= box.y0, text.get_text()
            assert box.y1 <= whole.y1 + 0.5, text.get_text()
            for other in areas:  # the data areas of every panel
                assert not box.overlaps(other.shrunk(0.98, 0.98)), text.get_text()
    for legend in figure.legends:
        box = legend.get_window_extent(renderer)
        assert not any(box.overlaps(area) for area in areas)


def test_long_and_odd_names_are_shortened_and_shown_as_written() -> None:
    name = "view0 (aten::as_strided at /a/long/path/to/the/module/file.py:123 in forward) $x$\n"
    plan = Plan.model_validate({
        "storages": [{"name": "kv", "nbytes": 64}],
        "views": [{"name": name, "storage": "kv", "num_blocks": 2, "page_bytes": 8,
                   "block_stride_bytes": 16}],
    })  # fmt: skip
    [[label]] = _labels(plan)
    # both ends kept; $ shown as written, not taken for mathtext; the newline escaped
    assert label == r"view0 (aten::as_strid…:123 in forward) \$x\$\n"
    assert len(label) - label.count("\\$") <= 44


def test_no_empty_band_under_a_panel_title() -> None:
    plan = _load("broken_aliasing.json")
    figure = picture(plan, plan.check())
    renderer = _rendered(figure)
    [ax] = figure.axes
    assert ax.get_ylim() == (len(ax.get_yticks()) - 0.5, -0.5)  # the rows fill the panel
    gap_px = _title(ax).get_window_extent(renderer).y0 - ax.get_window_extent(renderer).y1
    assert 0 <= gap_px <= 8


def test_the_hatching_of_bytes_past_the_end_is_visible(tmp_path: Path) -> None:
    plan = _load("broken_one_block_too_many.json")
    draw_map(plan, plan.check(), tmp_path / "map.png")
    pixels = (imread(tmp_path / "map.png")[:, :, :3] * 255).round()

    def count(colour: str) -> int:
        rgb = [int(colour[i : i + 2], 16) for i in (1, 3, 5)]
        return int((abs(pixels - rgb).max(axis=2) <= 12).sum())

    # the summary row's bytes past the end: the light face and the red hatch lines across it
    assert count(PAST_END_FACE) > 2_000
    assert count(RED) > 2_000


def test_a_view_ending_past_2_64_is_drawn_with_exact_ticks(tmp_path: Path) -> None:
    top = 2**63 - 1
    plan = Plan.model_validate({
        "storages": [{"name": "kv", "nbytes": top}],
        "views": [{"name": name, "storage": "kv", "num_blocks": top, "page_bytes": 8,
                   "block_stride_bytes": 16, "byte_offset": offset}
                  for name, offset in (("k", 0), ("v", 8))],
    })  # fmt: skip
    report = plan.check()
    assert max(view.extent_bytes for view in report.views) > 2**64
    figure = picture(plan, report)
    _rendered(figure)
    storage, end = figure.axes
    assert [t.get_text() for t in storage.get_xticklabels()][-1] == "16"
    assert "end" in [t.get_text() for t in end.get_xticklabels()]
    assert f"byte {top:,}" in end.get_title(loc="left")
    draw_map(plan, report, tmp_path / "map.png")


def test_drawing_time_does_not_grow_with_the_blocks_a_view_spans(tmp_path: Path) -> None:
    def one_view(num_blocks: int) -> Plan:
        return Plan.model_validate({
            "storages": [{"name": "kv", "nbytes": 42_072 * 3_098_112}],
            "views": [{"name": "model.layers.0.self_attn", "storage": "kv",
                       "num_blocks": num_blocks, "page_bytes": 36_864,
                       "block_stride_bytes": 3_098_112}],
        })  # fmt: skip

    for num_blocks in (42_073, 42_072 * 1_000_000_000):  # one block too many; 10**9 times
        plan = one_view(num_blocks)
        started = time.perf_counter()
        draw_map(plan, plan.check(), tmp_path / "map.png")
        # a block at a time, the second would take years
        assert time.perf_counter() - started < 30


def test_summary_rows_merge_pages_closer_than_a_pixel() -> None:
    assert _merged([(8, 4), (0, 4), (4, 4), (20, 2)]) == [(0, 12), (20, 2)]
    assert _merged([(8, 4), (0, 4), (4, 4), (20, 2)], gap=8) == [(0, 22)]


def test_the_map_changes_no_global_matplotlib_state(tmp_path: Path) -> None:
    code = (
        "import sys, matplotlib\n"
        "before = (matplotlib.get_backend(), dict(matplotlib.rcParams))\n"
        "from safeview.cli import main\n"
        "code = main(['check', sys.argv[1], '--map', sys.argv[2], '-q'])\n"
        "assert (matplotlib.get_backend(), dict(matplotlib.rcParams)) == before\n"
        "assert 'matplotlib.pyplot' not in sys.modules\n"
        "sys.exit(code)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(PLANS / "broken_aliasing.json"), str(tmp_path / "m.png")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr


def test_the_readme_picture_is_what_the_readme_command_draws_today(tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    assert README_COMMAND in readme
    assert re.search(r"!\[[^\]]*\]\(docs/broken_aliasing\.png\)", readme)
    (tmp_path / "examples" / "plans").mkdir(parents=True)
    shutil.copy(PLANS / "broken_aliasing.json", tmp_path / "examples" / "plans")
    script = Path(sys.executable).parent / "safeview"
    result = subprocess.run(
        [str(script), *README_COMMAND.split()[1:]], cwd=tmp_path, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    drawn = imread(tmp_path / "broken_aliasing.png")
    shown = imread(ROOT / "docs" / "broken_aliasing.png")
    regenerate = f"regenerate it: {README_COMMAND} && mv broken_aliasing.png docs/"
    assert drawn.shape == shown.shape, regenerate
    # the same pixels, but for the anti-aliasing of another FreeType build
    rms = float((((drawn - shown) * 255) ** 2).mean() ** 0.5)
    assert rms < 2.0, regenerate


@pytest.mark.slow
def test_twenty_thousand_storages_draw_quickly_with_the_culprit_kept(tmp_path: Path) -> None:
    count = 20_000
    plan = Plan.model_validate({
        "storages": [{"name": f"s{i}", "nbytes": 4_096} for i in range(count)],
        "views": [{"name": f"v{i}", "storage": f"s{i}", "num_blocks": 4 + (i == count - 7),
                   "page_bytes": 1_024, "block_stride_bytes": 1_024} for i in range(count)],
    })  # fmt: skip
    report = plan.check()
    started = time.perf_counter()
    chosen = layout(plan, report)
    draw_map(plan, report, tmp_path / "map.png")
    assert time.perf_counter() - started < 30  # a pass per storage left out would take minutes
    assert f"s{count - 7}" in [panel.storage for panel, _ in chosen.panels]
    assert len(chosen.left_out) > count - 100
