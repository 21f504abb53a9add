"""``safeview check --map``: a picture of each storage. Needs matplotlib (``safeview[plot]``).

A storage whose views share one block stride is drawn as one block period, each view's page a
band at its place in the block; any other storage is drawn whole, to scale. When a view of a
block-period storage runs past the end, a second panel shows the end of that storage to scale:
the last blocks, the end line and the bytes past it, hatched. Views with a violation are red, with
its kind written beside them; the other views are coloured by group, with the legend under the
panel, never over the bars.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter

from safeview.check import Report
from safeview.plan import Plan, PlanView

__all__ = ["draw_map"]

RED = "#d62728"
GROUP_COLOURS = ["#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#17becf", "#bcbd22", "#7f7f7f"]


def _segments_in_period(view: PlanView, stride: int) -> list[tuple[int, int]]:
    start = view.byte_offset % stride
    first = min(view.page_bytes, stride - start)
    segments = [(start, first)]
    if view.page_bytes > first:
        segments.append((0, min(view.page_bytes - first, stride)))
    return segments


def _period(views: list[PlanView]) -> int | None:
    """The block stride a storage's views share, when they leave gaps (a packed group)."""
    strides = {view.block_stride_bytes for view in views if view.num_blocks > 1}
    gapped = any(view.page_bytes < view.block_stride_bytes for view in views if view.num_blocks > 1)
    return next(iter(strides)) if len(strides) == 1 and gapped else None


def panels(plan: Plan, report: Report) -> list[tuple[str, str]]:
    """The panels of the picture, top to bottom: ``("storage", name)`` for each storage, then
    ``("end", name)`` right under it when that storage is drawn as one block period and a view
    runs past its end (the period alone cannot show where the storage stops)."""
    extents = {view.name: view.extent_bytes for view in report.views}
    drawn = []
    for storage in plan.storages:
        views = [view for view in plan.views if view.storage == storage.name]
        drawn.append(("storage", storage.name))
        if _period(views) is not None and any(extents[v.name] > storage.nbytes for v in views):
            drawn.append(("end", storage.name))
    return drawn


ROW_LIMIT = 120
"""Past this many views in one storage, the picture draws a row per group (and one row of the
views with a violation) instead of a row per view: a summary, not 100,000 slivers."""


def _rows(
    views: list[PlanView], status: dict[str, str], groups: Sequence[str | int | None]
) -> list[tuple[str, str, list[PlanView]]]:
    """The rows of a panel: ``(label, colour, views)``, a view each, or a summary when there are
    more than ``ROW_LIMIT``."""
    colour_of = {group: GROUP_COLOURS[i % len(GROUP_COLOURS)] for i, group in enumerate(groups)}
    if len(views) <= ROW_LIMIT:
        return [
            (view.name, RED if status[view.name] != "ok" else colour_of[view.group], [view])
            for view in views
        ]
    members: dict[str | int | None, list[PlanView]] = {group: [] for group in groups}
    flagged: list[PlanView] = []
    for view in views:
        (flagged if status[view.name] != "ok" else members[view.group]).append(view)
    rows = [
        (f"group {group}: {len(found):,} views", colour_of[group], found)
        for group, found in members.items()
        if found
    ]
    if flagged:
        rows.append((f"with a violation: {len(flagged):,} views", RED, flagged))
    return rows


def _merged(segments: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(start, width)`` segments with touching and overlapping ones joined: a summary row of
    100,000 tiled pages is drawn as a few bars."""
    joined: list[tuple[int, int]] = []
    for start, width in sorted(segments):
        if joined and start <= joined[-1][0] + joined[-1][1]:
            last_start, last_width = joined[-1]
            joined[-1] = (last_start, max(last_width, start + width - last_start))
        else:
            joined.append((start, width))
    return joined


def _bars(ax: Any, y: int, segments: list[tuple[int, int]], colour: str, many: bool) -> None:
    """One row of bars. A summary row's bars are merged and outlined in their own colour, so that
    a page far narrower than a pixel still shows."""
    if many:
        ax.broken_barh(_merged(segments), (y - 0.4, 0.8), facecolors=colour,
                       edgecolor=colour, linewidth=0.8)  # fmt: skip
    else:
        ax.broken_barh(segments, (y - 0.4, 0.8), facecolors=colour, edgecolor="white")


def _summary(members: list[PlanView], status: dict[str, str]) -> str:
    """What is wrong with a row's views, counted by kind."""
    counts: dict[str, int] = {}
    for view in members:
        for kind in status[view.name].split(", "):
            if kind != "ok":
                counts[kind] = counts.get(kind, 0) + 1
    return ", ".join(f"{kind} x{count:,}" if len(members) > 1 else kind for kind, count in
                     counts.items())  # fmt: skip


def _draw_end(ax: Any, plan: Plan, report: Report, storage: str) -> None:
    """The end of a block-period storage, to scale: two periods before the end and every byte
    past it, each view's blocks there, the part past the end hatched."""
    views = [view for view in plan.views if view.storage == storage]
    nbytes = next(s.nbytes for s in plan.storages if s.name == storage)
    period = _period(views) or 1
    extents = {view.name: view.extent_bytes for view in report.views}
    status = {row["name"]: row["status"] for row in report.rows()}
    start = max(0, nbytes - 2 * period)
    stop = max(extents[view.name] for view in views)
    rows = _rows(views, status, list(dict.fromkeys(view.group for view in views)))
    for y, (_, colour, members) in enumerate(rows):
        inside, outside = [], []
        for view in members:
            first = max(0, (start - view.byte_offset - view.page_bytes) // view.block_stride_bytes)
            for block in range(first, view.num_blocks):
                begin = view.byte_offset + block * view.block_stride_bytes
                if begin >= stop:
                    break
                end = begin + view.page_bytes
                if end <= start:
                    continue
                if begin < nbytes:
                    inside.append((max(begin, start), min(end, nbytes) - max(begin, start)))
                if end > nbytes:
                    outside.append((max(begin, nbytes), end - max(begin, nbytes)))
        many = len(views) > ROW_LIMIT
        _bars(ax, y, inside, colour if colour == RED else "#c7c7c7", many)
        if outside:
            ax.broken_barh(_merged(outside), (y - 0.4, 0.8), facecolors=RED, hatch="///",
                           edgecolor=RED, linewidth=0.8)  # fmt: skip
    ax.axvline(nbytes, color="black", linewidth=1.2)
    ax.text(nbytes, len(rows) - 1, " end of storage", fontsize=8, va="center")
    ax.set_xlim(start, stop + (stop - start) * 0.02)
    ax.set_ylim(len(rows) - 0.4, -1.0)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([label for label, _, _ in rows], fontsize=7)
    worst = max(extents[view.name] for view in views) - nbytes
    ax.set_title(
        f"the end of storage {storage!r}, to scale: views in red run past byte {nbytes:,}, "
        f"by up to {worst:,} bytes (hatched)",
        fontsize=9,
        loc="left",
    )
    ax.set_xlabel("byte of the storage", fontsize=8)
    ax.tick_params(axis="x", labelsize=8)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{int(x):,}"))
    ax.grid(axis="x", alpha=0.3)


def _draw_storage(ax: Any, plan: Plan, report: Report, storage: str) -> None:
    views = [view for view in plan.views if view.storage == storage]
    nbytes = next(s.nbytes for s in plan.storages if s.name == storage)
    status = {row["name"]: row["status"] for row in report.rows()}
    extents = {view.name: view.extent_bytes for view in report.views}
    groups = list(dict.fromkeys(view.group for view in views))
    # One block period says it all for a packed group; contiguous views are drawn to scale.
    period = _period(views)
    limit = period if period is not None else max([nbytes, *(extents[view.name] for view in views)])
    rows = _rows(views, status, groups)
    for y, (_, colour, members) in enumerate(rows):
        segments: list[tuple[int, int]] = []
        past: list[tuple[int, int]] = []
        for view in members:
            if period is not None:
                segments += _segments_in_period(view, period)
                continue
            extent = extents[view.name]
            segments.append((view.byte_offset, max(min(extent, nbytes) - view.byte_offset, 0)))
            if extent > nbytes:
                past.append((max(view.byte_offset, nbytes), extent - max(view.byte_offset, nbytes)))
        _bars(ax, y, segments, colour, len(views) > ROW_LIMIT)
        if past:
            ax.broken_barh(past, (y - 0.4, 0.8), facecolors=RED, hatch="///", edgecolor="white")
        if colour == RED:
            ax.text(limit, y, f"  {_summary(members, status)}", va="center", fontsize=7, color=RED)
    for finding in report.findings:
        byte = finding.byte
        if finding.kind == "overlap" and finding.storage == storage and byte is not None:
            x = byte % period if period is not None else byte
            ax.axvline(x, color=RED, linestyle="--", linewidth=0.8)
    if period is None:
        ax.axvline(nbytes, color="black", linewidth=1.0)
        ax.text(nbytes, -0.9, " end of storage", fontsize=7, va="bottom")
    ax.set_xlim(0, limit)
    ax.set_ylim(len(rows) - 0.4, -1.0)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([label for label, _, _ in rows], fontsize=7)
    if period is not None:
        blocks = max((view.num_blocks for view in views), default=0)
        ax.set_title(
            f"storage {storage!r}: {nbytes:,} bytes; one block period of {period:,} bytes "
            f"(up to {blocks:,} blocks)",
            fontsize=9,
            loc="left",
        )
        ax.set_xlabel("byte within the block", fontsize=8)
    else:
        ax.set_title(f"storage {storage!r}: {nbytes:,} bytes, to scale", fontsize=9, loc="left")
        ax.set_xlabel("byte of the storage", fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{int(x):,}"))
    if len(groups) > 1:
        handles = [
            Patch(color=GROUP_COLOURS[i % len(GROUP_COLOURS)], label=f"group {group}")
            for i, group in enumerate(groups)
        ]
        # under the panel, below the axis label: never over the bars
        ax.legend(
            handles=handles,
            fontsize=7,
            loc="upper center",
            bbox_to_anchor=(0.5, -0.12 - 3.0 / max(len(rows), 8)),
            ncol=min(len(handles), 6),
            frameon=False,
        )
    ax.grid(axis="x", alpha=0.3)


def draw_map(plan: Plan, report: Report, path: str | Path) -> None:
    """Write a PNG of every storage of ``plan``, marked with ``report``'s findings."""
    drawn = panels(plan, report)
    counts: dict[str, int] = {}
    for view in plan.views:
        counts[view.storage] = counts.get(view.storage, 0) + 1
    # rows per panel: a view each, or a summary (a few rows) past ROW_LIMIT views
    heights = [
        1.5 + 0.16 * (counts.get(storage, 0) if counts.get(storage, 0) <= ROW_LIMIT else 10)
        for _, storage in drawn
    ]
    figure, axes = plt.subplots(
        len(drawn),
        1,
        figsize=(11, sum(heights) + 0.6),
        squeeze=False,
        gridspec_kw={"height_ratios": heights},
    )
    for ax, (kind, storage) in zip(axes[:, 0], drawn):
        (_draw_storage if kind == "storage" else _draw_end)(ax, plan, report, storage)
    verdict = "clean" if report.ok else f"{len(report.findings)} violation(s), in red"
    figure.suptitle(f"{plan.description or Path(str(path)).stem}: {verdict}", fontsize=10)
    figure.tight_layout(rect=(0.0, 0.0, 1.0, 1.0 - 0.45 / (sum(heights) + 0.6)))
    figure.savefig(path, dpi=110)
    plt.close(figure)
