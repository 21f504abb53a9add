"""``safeview check --map``: a picture of a plan's storages. Needs matplotlib (``safeview[plot]``).

A storage whose views share one block stride and leave gaps (a packed group) is drawn as one block
period, each view's page a bar at its place in the block; any other storage is drawn whole, to
scale, with the line where it ends. When a view of a block-period storage runs past the end, a
second panel shows that end to scale: the last block periods, the end, and the bytes past it,
hatched. Views with a violation are red, their kinds written beside them; the other views are
coloured by group. One legend, under the title, says what the colours, the hatching and the
lines mean; no text is drawn over a bar.

The picture stays within ``MAX_SIDE_PX`` pixels a side, whatever the plan, and its cost grows with
what it draws (rows, bars, block periods near an end), never with the blocks a view spans: a
storage of more than ``ROW_LIMIT`` views is drawn as a row per group and a row per view with a
violation (the first few named, the rest counted); when even that does not fit, other storages
are left out, clean ones first, and named under the picture.

Nothing global is touched: no pyplot, no backend switch, no ``rcParams`` change.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.font_manager import FontProperties
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, MaxNLocator
from matplotlib.transforms import blended_transform_factory

from safeview.check import Report
from safeview.findings import KINDS
from safeview.plan import Plan, PlanView

__all__ = ["MAX_SIDE_PX", "ROW_LIMIT", "Layout", "draw_map", "layout", "picture"]

DPI = 110
WIDTH_PX = 1_210
MAX_SIDE_PX = 2_000
"""The picture is at most this many pixels high (and ``WIDTH_PX`` wide), whatever the plan."""
ROW_LIMIT = 120
"""Past this many views in one storage, its panel has a row per group and a row per view with a
violation instead of a row per view: a summary, not 100,000 slivers."""
NAMED_LIMIT = 20
"""A summarised panel names at most this many views with a violation, and counts the rest."""
GROUP_LIMIT = 12
"""A summarised panel has a row for at most this many groups, and one for the rest."""
MIN_BAR_PX = 3
"""A bar narrower than this is drawn this wide, so that no page shown vanishes (a 1-byte page of
a 3 MB block period, a few bytes past the end of a 130 GB storage)."""
MAX_LABEL_CHARS = 44

RED = "#d62728"
SHARED_LINE = "#6b0000"  # darker than RED: a shared byte often lies on a red bar's edge
PAST_END_FACE = "#f7c4c4"
INSIDE_GREY = "#c7c7c7"
GROUP_COLOURS = ["#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#17becf", "#bcbd22", "#7f7f7f"]

# Heights, in inches (at DPI pixels each).
TOP_IN = 0.42  # the title of the picture
LEGEND_ROW_IN = 0.22
TITLE_IN = 0.25  # a panel's title
AXIS_IN = 0.4  # a panel's tick labels and axis label
GAP_IN = 0.1
FOOT_IN = 0.3  # the line naming the storages left out
MIN_ROW_IN = 0.13
MAX_ROW_IN = 0.22
ROW_FONT = 7.0
LEGEND_PER_ROW = 6


def _text(value: object, limit: int | None = None) -> str:
    """A name as matplotlib should show it: control characters escaped, ``$`` not taken for
    mathtext, and at most ``limit`` characters (the middle cut out, as both ends name a view)."""
    text = str(value)
    if not text.isprintable():
        text = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)
    if limit is not None and len(text) > limit:
        head = (limit - 1) // 2
        text = text[:head] + "…" + text[len(text) - (limit - 1 - head) :]
    return text.replace("$", r"\$")


def _plural(count: int, noun: str) -> str:
    return f"{count:,} {noun if count == 1 else noun + 's'}"


def _group_label(group: Hashable | None) -> str:
    return "no group" if group is None else f"group {_text(group, 24)}"


@dataclass
class _Facts:
    """What the picture needs from the plan and its report, computed once: per view its extent
    and kinds, per storage its views."""

    plan: Plan
    extents: list[int]
    kinds: list[list[str]]
    by_storage: dict[str, list[int]]
    colour_of: dict[Hashable | None, str]
    shared_bytes: dict[str, list[int]]  # overlap findings' bytes, per storage

    @classmethod
    def of(cls, plan: Plan, report: Report) -> _Facts:
        found = report.kinds_of()
        clean: list[str] = []  # shared by every view without a finding: most of them
        kinds: list[list[str]] = []
        for view in plan.views:
            listed = found.get(view.name)
            kinds.append([kind for kind in KINDS if kind in listed] if listed else clean)
        by_storage: dict[str, list[int]] = {storage.name: [] for storage in plan.storages}
        for index, view in enumerate(plan.views):
            by_storage[view.storage].append(index)
        groups = dict.fromkeys(view.group for view in plan.views)
        colour_of: dict[Hashable | None, str] = {
            group: GROUP_COLOURS[i % len(GROUP_COLOURS)] for i, group in enumerate(groups)
        }
        shared: dict[str, set[int]] = {}
        for finding in report.findings:
            storage, byte = finding.storage, finding.byte
            if finding.kind == "overlap" and storage is not None and byte is not None:
                shared.setdefault(storage, set()).add(byte)
        return cls(
            plan,
            [record.extent_bytes for record in report.views],
            kinds,
            by_storage,
            colour_of,
            {storage: sorted(found_bytes) for storage, found_bytes in shared.items()},
        )


def _period(views: Sequence[PlanView]) -> int | None:
    """The block stride a storage's views share, when they leave gaps (a packed group)."""
    strides = {view.block_stride_bytes for view in views if view.num_blocks > 1}
    gapped = any(view.page_bytes < view.block_stride_bytes for view in views if view.num_blocks > 1)
    return next(iter(strides)) if len(strides) == 1 and gapped else None


@dataclass
class _Row:
    label: str
    colour: str
    members: list[int]
    note: str = ""
    violation: bool = False


@dataclass
class _Panel:
    """One panel: a storage (``"storage"``), or the end of a block-period storage (``"end"``)."""

    kind: Literal["storage", "end"]
    storage: str
    nbytes: int
    members: list[int]
    period: int | None
    flagged: list[int]  # the members with a violation
    groups: dict[Hashable | None, list[int]]  # the other members, by group
    summary: bool = False

    def full_rows(self) -> int | None:
        return max(len(self.members), 1) if len(self.members) <= ROW_LIMIT else None

    def summary_rows(self, named: int) -> int:
        groups = min(len(self.groups), GROUP_LIMIT) + (len(self.groups) > GROUP_LIMIT)
        flagged = min(len(self.flagged), named) + (len(self.flagged) > named)
        return max(groups + flagged, 1)

    def row_count(self, named: int) -> int:
        full = self.full_rows()
        return self.summary_rows(named) if self.summary or full is None else full

    def rows(self, facts: _Facts, named: int) -> list[_Row]:
        if not self.members:
            return [_Row("(no views)", INSIDE_GREY, [])]
        if not (self.summary or len(self.members) > ROW_LIMIT):
            return [self._row_of(facts, index) for index in self.members]
        rows = []
        listed = list(self.groups.items())
        # the views with a violation have rows of their own below: the gaps they leave in a
        # group's row are theirs, and the label says the row holds the others
        noun = "other view" if self.flagged else "view"
        for group, members in listed[:GROUP_LIMIT]:
            rows.append(
                _Row(f"{_group_label(group)}: {_plural(len(members), noun)}",
                     facts.colour_of[group], members)
            )  # fmt: skip
        if len(listed) > GROUP_LIMIT:
            rest = [index for _, members in listed[GROUP_LIMIT:] for index in members]
            more = len(listed) - GROUP_LIMIT
            rows.append(
                _Row(f"{more:,} more groups: {_plural(len(rest), 'view')}", INSIDE_GREY, rest)
            )
        rows += [self._row_of(facts, index) for index in self.flagged[:named]]
        rest = self.flagged[named:]
        if rest:
            counts: dict[str, int] = {kind: 0 for kind in KINDS}
            for index in rest:
                for kind in facts.kinds[index]:
                    counts[kind] += 1
            note = ", ".join(f"{kind} x{count:,}" for kind, count in counts.items() if count)
            label = f"{len(rest):,} more with a violation"
            if not self.flagged[:named]:
                label = f"with a violation: {_plural(len(rest), 'view')}"
            rows.append(_Row(label, RED, rest, note, violation=True))
        return rows

    @staticmethod
    def _row_of(facts: _Facts, index: int) -> _Row:
        view = facts.plan.views[index]
        kinds = facts.kinds[index]
        colour = RED if kinds else facts.colour_of[view.group]
        return _Row(_text(view.name, MAX_LABEL_CHARS), colour, [index], ", ".join(kinds),
                    violation=bool(kinds))  # fmt: skip


def _panels(facts: _Facts) -> list[list[_Panel]]:
    """The panels of each storage, in plan order: its own, and its end's when it is drawn as one
    block period and a view runs past its end."""
    units = []
    for storage in facts.plan.storages:
        members = facts.by_storage[storage.name]
        views = [facts.plan.views[index] for index in members]
        period = _period(views)
        flagged = [index for index in members if facts.kinds[index]]
        groups: dict[Hashable | None, list[int]] = {}
        for index in members:
            if not facts.kinds[index]:
                groups.setdefault(facts.plan.views[index].group, []).append(index)
        unit = [_Panel("storage", storage.name, storage.nbytes, members, period, flagged, groups)]
        if period is not None and any(facts.extents[i] > storage.nbytes for i in members):
            unit.append(
                _Panel("end", storage.name, storage.nbytes, members, period, flagged, groups)
            )
        units.append(unit)
    return units


@dataclass
class Layout:
    """What the picture holds: the panels drawn (a storage each, and the end of some), their
    rows, the storages left out for room, the row height and the picture's size in pixels."""

    panels: list[tuple[_Panel, list[_Row]]]
    left_out: list[str]
    row_in: float
    legend: list[Any]
    width_px: int
    height_px: int
    named: int = NAMED_LIMIT


def _legend_handles(facts: _Facts, drawn: list[tuple[_Panel, list[_Row]]]) -> list[Any]:
    handles: list[Any] = []
    groups = list(facts.colour_of)
    if len(groups) > 1:
        for group in groups[: len(GROUP_COLOURS)]:
            handles.append(Patch(color=facts.colour_of[group], label=_group_label(group)))
        if len(groups) > len(GROUP_COLOURS):
            handles.append(Patch(color="white", label=f"(colours repeat: {len(groups):,} groups)"))
    if any(row.violation for _, rows in drawn for row in rows):
        handles.append(Patch(color=RED, label="a view with a violation"))
    past = any(
        facts.extents[index] > panel.nbytes
        for panel, _ in drawn
        if panel.kind == "end" or panel.period is None
        for index in panel.members
    )
    if past:
        handles.append(
            Patch(facecolor=PAST_END_FACE, edgecolor=RED, hatch="////", label="bytes past the end")
        )
    if any(panel.kind == "end" or panel.period is None for panel, _ in drawn):
        handles.append(Line2D([], [], color="black", linewidth=1.2, label="end of the storage"))
    if any(panel.kind == "storage" and facts.shared_bytes.get(panel.storage) for panel, _ in drawn):
        handles.append(
            Line2D(
                [],
                [],
                color=SHARED_LINE,
                linestyle=(0, (3, 2)),
                linewidth=1.1,
                label="a byte two views share",
            )
        )
    return handles


def layout(plan: Plan, report: Report) -> Layout:
    """Decide what the picture of ``plan`` holds so that it stays within ``MAX_SIDE_PX``: a row
    per view where that fits, else summaries (the panels with the most rows first), fewer views
    named, then storages left out (clean ones first, from the last)."""
    facts = _Facts.of(plan, report)
    return _layout(facts, _panels(facts))


def _layout(facts: _Facts, units: list[list[_Panel]]) -> Layout:
    budget_in = MAX_SIDE_PX / DPI
    legend_in = math.ceil((len(GROUP_COLOURS) + 4) / LEGEND_PER_ROW) * LEGEND_ROW_IN  # at most
    named = NAMED_LIMIT
    kept = [True] * len(units)
    # running totals over the units kept, so that each step costs one pass, not one per unit
    panels = sum(len(unit) for unit in units)
    rows = dropped = 0

    def rows_of(unit: list[_Panel]) -> int:
        return sum(panel.row_count(named) for panel in unit)

    def recount() -> int:
        return sum(rows_of(unit) for unit, keep in zip(units, kept) if keep)

    def too_tall() -> bool:
        fixed = TOP_IN + legend_in + panels * (TITLE_IN + AXIS_IN + GAP_IN)
        return fixed + (FOOT_IN if dropped else 0.1) + rows * MIN_ROW_IN > budget_in

    rows = recount()
    # 1. summaries, the panel with the most rows first, where a summary has fewer rows
    if too_tall():
        candidates = [
            panel
            for unit in units
            for panel in unit
            if (full := panel.full_rows()) is not None and panel.summary_rows(named) < full
        ]
        candidates.sort(key=lambda panel: -(panel.full_rows() or 0))
        for panel in candidates:
            if not too_tall():
                break
            before = panel.row_count(named)
            panel.summary = True
            rows -= before - panel.row_count(named)

    def leave_out(order: list[int]) -> None:
        nonlocal panels, rows, dropped
        for u in order:
            if not too_tall() or dropped == len(units) - 1:
                return
            kept[u] = False
            dropped += 1
            panels -= len(units[u])
            rows -= rows_of(units[u])

    # 2. fewer views named; 3. clean storages left out, from the last; 4. then any storage
    if too_tall():
        named = 5
        rows = recount()
    clean = [u for u in range(len(units)) if not any(panel.flagged for panel in units[u])]
    leave_out(clean[::-1])
    if too_tall():
        named = 1
        rows = recount()
    leave_out([u for u in range(len(units) - 1, -1, -1) if kept[u]])

    drawn = [(panel, panel.rows(facts, named)) for unit, keep in zip(units, kept) if keep
             for panel in unit]  # fmt: skip
    rows = sum(len(panel_rows) for _, panel_rows in drawn)
    left_out = [storage.name for storage, keep in zip(facts.plan.storages, kept) if not keep]
    handles = _legend_handles(facts, drawn)
    legend_rows = math.ceil(len(handles) / LEGEND_PER_ROW)
    fixed = (
        TOP_IN
        + legend_rows * LEGEND_ROW_IN
        + len(drawn) * (TITLE_IN + AXIS_IN + GAP_IN)
        + (FOOT_IN if left_out else 0.1)
    )
    row_in = min(MAX_ROW_IN, max(MIN_ROW_IN, (budget_in - fixed) / max(rows, 1)))
    height_px = min(MAX_SIDE_PX, math.ceil((fixed + rows * row_in) * DPI))
    return Layout(drawn, left_out, row_in, handles, WIDTH_PX, height_px, named)


# -- drawing ----------------------------------------------------------------------------------


def _merged(segments: list[tuple[int, int]], gap: float = 0.0) -> list[tuple[int, int]]:
    """``(start, width)`` segments with touching and overlapping ones joined, and those closer
    than ``gap`` (less than a pixel apart: nobody could see the gap): a summary row of 100,000
    pages is drawn as a few bars."""
    joined: list[tuple[int, int]] = []
    for start, width in sorted(segments):
        if joined and start <= joined[-1][0] + joined[-1][1] + gap:
            last_start, last_width = joined[-1]
            joined[-1] = (last_start, max(last_width, start + width - last_start))
        else:
            joined.append((start, width))
    return joined


def _segments_in_period(view: PlanView, period: int) -> list[tuple[int, int]]:
    """Where a view's page lies within one block period: one bar, or two when it spills over
    into the next period."""
    start = view.byte_offset % period
    if view.num_blocks == 0:
        return [(start, 0)]
    first = min(view.page_bytes, period - start)
    segments = [(start, first)]
    if view.page_bytes > first:
        segments.append((0, min(view.page_bytes - first, period)))
    return segments


class _Axis:
    """The x range of a panel, in bytes, with the conversion to what matplotlib is given: floats
    relative to ``origin`` (exact where it matters; a view may end past 2**64)."""

    def __init__(self, low: int, high: int, origin: int, width_px: float) -> None:
        self.low, self.high, self.origin = low, max(high, low + 1), origin
        self.per_px = (self.high - self.low) / max(width_px, 1.0)

    def bars(self, segments: list[tuple[int, int]], many: bool) -> list[tuple[float, float]]:
        """Segments clipped to the range, merged (closer than a pixel, for a summary row), at
        least ``MIN_BAR_PX`` wide."""
        clipped = []
        for start, width in segments:
            end = start + width
            if end < self.low or start > self.high:
                continue
            clipped.append((max(start, self.low), min(end, self.high) - max(start, self.low)))
        if many:
            clipped = _merged(clipped, self.per_px)
        least = MIN_BAR_PX * self.per_px
        shown = []
        for start, width in clipped:
            left, right = float(start - self.origin), float(width)
            if right < least:  # centred on what it stands for, inside the axis
                left = max(left + (right - least) / 2, self.x(self.low))
                left = min(left, self.x(self.high) - least)
                right = least
            shown.append((left, right))
        return shown

    def x(self, byte: int) -> float:
        return float(byte - self.origin)


def _draw_bars(ax: Any, y: int, bars: list[tuple[float, float]], colour: str) -> None:
    if bars:
        ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=colour, edgecolor=colour, linewidth=0.5)


def _draw_past(ax: Any, y: int, bars: list[tuple[float, float]]) -> None:
    if bars:
        ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=PAST_END_FACE, edgecolor=RED,
                       hatch="////", linewidth=0.8)  # fmt: skip


def _draw_storage(ax: Any, facts: _Facts, panel: _Panel, rows: list[_Row], width: float) -> str:
    views = facts.plan.views
    period = panel.period
    if period is not None:
        axis = _Axis(0, period, 0, width)
    else:
        reach = max([panel.nbytes, *(facts.extents[index] for index in panel.members)])
        axis = _Axis(0, reach, 0, width)
    for y, row in enumerate(rows):
        many = len(row.members) > 1
        inside: list[tuple[int, int]] = []
        past: list[tuple[int, int]] = []
        for index in row.members:
            view = views[index]
            if period is not None:
                inside += _segments_in_period(view, period)
                continue
            extent, offset = facts.extents[index], view.byte_offset
            if offset < panel.nbytes or extent == offset:
                inside.append((offset, max(min(extent, panel.nbytes) - offset, 0)))
            if extent > panel.nbytes:
                start = max(offset, panel.nbytes)
                past.append((start, extent - start))
        _draw_bars(ax, y, axis.bars(inside, many), row.colour)
        _draw_past(ax, y, axis.bars(past, many))
    shared = facts.shared_bytes.get(panel.storage, [])
    if shared:
        spots = sorted({byte % period if period is not None else byte for byte in shared})
        lines = _merged([(spot, 0) for spot in spots], axis.per_px)[:500]
        ax.vlines([axis.x(spot) for spot, _ in lines], -0.5, len(rows) - 0.5, colors=SHARED_LINE,
                  linestyles=(0, (3, 2)), linewidth=1.1, zorder=3)  # fmt: skip
    if period is None:
        ax.axvline(axis.x(panel.nbytes), color="black", linewidth=1.2)
    name = _text(panel.storage, 40)
    if period is not None:
        blocks = max((views[index].num_blocks for index in panel.members), default=0)
        title = (
            f"storage '{name}': {panel.nbytes:,} bytes; one block period of {period:,} bytes "
            f"({_plural(blocks, 'block')})"
        )
        label = "byte within the block"
    else:
        title = f"storage '{name}': {panel.nbytes:,} bytes, to scale"
        label = "byte of the storage"
    return _finish(ax, axis, rows, title, label, lambda value: f"{value:,}")


def _draw_end(ax: Any, facts: _Facts, panel: _Panel, rows: list[_Row], width: float) -> str:
    """The end of a block-period storage, to scale: the last block period before the end and at
    most two past it; the blocks of each view there, the part past the end hatched. Only the
    blocks in that window are visited, however many a view has."""
    views = facts.plan.views
    period = panel.period or 1
    end = panel.nbytes
    reach = max(facts.extents[index] for index in panel.members)
    low = max(0, end - period)
    high = min(reach, end + 2 * period)
    high = max(high, end + max((end - low) // 20, 1))
    axis = _Axis(low, high, end, width)
    for y, row in enumerate(rows):
        many = len(row.members) > 1
        inside: list[tuple[int, int]] = []
        past: list[tuple[int, int]] = []
        for index in row.members:
            view = views[index]
            offset, page = view.byte_offset, view.page_bytes
            stride = view.block_stride_bytes
            # the blocks that meet [low, high): from the first ending after low to the last
            # starting before high
            first = max(0, (low - offset - page) // stride + 1)
            stop = min(view.num_blocks, -((offset - high) // stride))
            for block in range(first, min(stop, first + 64)):
                begin = offset + block * stride
                finish = begin + page
                if begin < end:
                    inside.append((begin, min(finish, end) - begin))
                if finish > end:
                    start = max(begin, end)
                    past.append((start, finish - start))
        colour = row.colour if row.violation else INSIDE_GREY
        _draw_bars(ax, y, axis.bars(inside, many), colour)
        _draw_past(ax, y, axis.bars(past, many))
    ax.axvline(0.0, color="black", linewidth=1.2)
    worst = reach - end
    title = (
        f"the end of storage '{_text(panel.storage, 40)}' (byte {end:,}), to scale: views reach "
        f"up to {_plural(worst, 'byte')} past it"
    )
    if reach > high:
        title += f"; drawn: {_plural((high - end) // period, 'block period')} of them"
    return _finish(ax, axis, rows, title, "bytes from the end of the storage",
            lambda value: "end" if value == 0 else f"{value:+,}")  # fmt: skip


def _finish(ax: Any, axis: _Axis, rows: list[_Row], title: str, label: str, tick: Any) -> str:
    """Axes, labels, the notes beside red rows: every text outside the bars. Returns the title,
    for the caller to set once it knows how much room it has."""
    ax.set_xlim(axis.x(axis.low), axis.x(axis.high))
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([row.label for row in rows], fontsize=ROW_FONT)
    for tick_label, row in zip(ax.get_yticklabels(), rows):
        if row.violation:
            tick_label.set_color(RED)
    beside = blended_transform_factory(ax.transAxes, ax.transData)
    for y, row in enumerate(rows):
        if row.note:
            ax.text(1.006, y, row.note, transform=beside, va="center", ha="left",
                    fontsize=ROW_FONT, color=RED, clip_on=False)  # fmt: skip
    ax.set_xlabel(label, fontsize=8, labelpad=2)
    ax.tick_params(axis="x", labelsize=7, pad=2)
    ax.tick_params(axis="y", length=2, pad=2)
    # ticks at whole bytes, relative to the axis' origin (the end, in an end panel)
    ax.xaxis.set_major_locator(MaxNLocator(nbins=5, integer=True, min_n_ticks=2))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: tick(round(x))))
    ax.grid(axis="x", alpha=0.3)
    return title


def _width_px(renderer: Any, text: str, size: float) -> float:
    width, _, _ = renderer.get_text_width_height_descent(
        text.replace(r"\$", "$"), FontProperties(size=size), ismath=False
    )
    return float(width)


def _fit(renderer: Any, text: str, size: float, room_px: float) -> str:
    """``text``, cut short with an ellipsis until it fits ``room_px``."""
    if _width_px(renderer, text, size) <= room_px:
        return text
    low, high = 0, len(text)
    while low < high:  # the longest prefix that fits with the ellipsis
        middle = (low + high + 1) // 2
        if _width_px(renderer, text[:middle] + "…", size) <= room_px:
            low = middle
        else:
            high = middle - 1
    return text[:low].rstrip("\\") + "…"


def draw_map(plan: Plan, report: Report, path: str | Path) -> None:
    """Write a picture of every storage of ``plan``, marked with ``report``'s findings, as PNG,
    SVG or PDF (by the name's suffix)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a glyph missing from the font is no reason to fail
        figure = picture(plan, report, Path(path).stem)
        figure.savefig(path, dpi=DPI)


def picture(plan: Plan, report: Report, name: str = "plan") -> Figure:
    """The figure ``draw_map`` writes (``name`` titles a plan without a description)."""
    facts = _Facts.of(plan, report)
    chosen = _layout(facts, _panels(facts))
    width_in, height_in = chosen.width_px / DPI, chosen.height_px / DPI
    figure = Figure(figsize=(width_in, height_in), dpi=DPI)
    canvas = FigureCanvasAgg(figure)
    renderer = canvas.get_renderer()  # type: ignore[no-untyped-call]

    # margins from the widest label and note, so that none is cut off
    labels = [row.label for _, rows in chosen.panels for row in rows]
    notes = [row.note for _, rows in chosen.panels for row in rows if row.note]
    left_px = max((_width_px(renderer, label, ROW_FONT) for label in labels), default=0) + 14
    right_px = max((_width_px(renderer, note, ROW_FONT) for note in notes), default=0) + 22
    left_px, right_px = max(left_px, 30.0), max(right_px, 24.0)
    axes_px = chosen.width_px - left_px - right_px

    verdict = "clean" if report.ok else f"{_plural(len(report.findings), 'violation')}, in red"
    heading = _text(plan.description or name)
    room = chosen.width_px - 24 - _width_px(renderer, f": {verdict}", 10)
    figure.text(0.5, 1 - 0.22 / height_in, f"{_fit(renderer, heading, 10, room)}: {verdict}",
                ha="center", va="center", fontsize=10)  # fmt: skip
    top_in = TOP_IN
    if chosen.legend:
        figure.legend(handles=chosen.legend, loc="upper center", fontsize=7, frameon=False,
                      bbox_to_anchor=(0.5, 1 - (TOP_IN - 0.08) / height_in),
                      ncol=min(len(chosen.legend), LEGEND_PER_ROW), handlelength=2.2,
                      columnspacing=1.6)  # fmt: skip
        top_in += math.ceil(len(chosen.legend) / LEGEND_PER_ROW) * LEGEND_ROW_IN

    y_in = top_in
    for panel, rows in chosen.panels:
        y_in += TITLE_IN
        tall_in = len(rows) * chosen.row_in
        ax = figure.add_axes(
            (left_px / chosen.width_px, 1 - (y_in + tall_in) / height_in,
             axes_px / chosen.width_px, tall_in / height_in)
        )  # fmt: skip
        draw = _draw_storage if panel.kind == "storage" else _draw_end
        title = draw(ax, facts, panel, rows, axes_px)
        ax.set_title(_fit(renderer, title, 8.5, chosen.width_px - left_px - 12),
                     fontsize=8.5, loc="left", pad=4)  # fmt: skip
        y_in += tall_in + AXIS_IN + GAP_IN
    if chosen.left_out:
        flagged = sum(
            1 for name in chosen.left_out if any(facts.kinds[i] for i in facts.by_storage[name])
        )
        what = _plural(len(chosen.left_out), "storage") + " left out for room"
        if flagged:
            what += f" ({flagged:,} with a violation)"
        # the first few: one line holds no more, and measuring 100,000 names would be slow
        names = ", ".join(_text(name, 40) for name in chosen.left_out[:40])
        if len(chosen.left_out) > 40:
            names += ", …"
        figure.text(0.01, 0.12 / height_in + 0.5 * FOOT_IN / height_in,
                    _fit(renderer, f"{what}: {names}", 8, chosen.width_px - 24),
                    ha="left", va="center", fontsize=8)  # fmt: skip
    return figure
