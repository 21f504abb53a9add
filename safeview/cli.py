"""The ``safeview`` command: check layout plans, print their JSON Schema. Never imports torch.

    safeview check PLAN [PLAN ...] [-q | -v | --json] [--max-violations N] [--map FILE.png]
    safeview schema

``check`` exits 0 when every plan is clean, 1 when one has a violation, 2 for anything else (a
plan unreadable or invalid, a bad option or ``SAFEVIEW_*`` variable, a map that cannot be drawn):
the worst over the plans. Every error is one line on standard error, ``safeview: ...``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from pydantic import ValidationError

from safeview import __version__
from safeview.check import Report
from safeview.errors import SafeViewError
from safeview.findings import KINDS, Finding
from safeview.log import configure_from_env
from safeview.plan import Plan

__all__ = ["main"]

CLEAN, VIOLATIONS, UNUSABLE = 0, 1, 2
SCHEMA_VERSION = 1  # of the --json document
MAP_FORMATS = (".png", ".svg", ".pdf")  # what matplotlib writes without extra packages
PROGRESS_AFTER_S = 1.0  # a check that takes longer shows progress on a terminal
STDIN = "-"


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors as one ``safeview: ...`` line (exit 2) instead of the usage."""

    def error(self, message: str) -> NoReturn:
        _error(f"{message} (see '{self.prog} --help')")
        raise SystemExit(UNUSABLE)


class _Stdout:
    """Standard output that a reader may close early (``safeview check ... | head -1``): the rest
    is dropped quietly and the exit code stays the check's."""

    def __init__(self) -> None:
        self.closed = False

    def line(self, text: str = "") -> None:
        if not self.closed:
            try:
                print(text)
            except BrokenPipeError:
                self._drop()

    def flush(self) -> None:
        if not self.closed:
            try:
                sys.stdout.flush()
            except BrokenPipeError:
                self._drop()

    def _drop(self) -> None:
        # Python's own advice: point the descriptor at devnull, so that the flush at exit (of
        # what is still buffered) does not fail again and print "Exception ignored".
        self.closed = True
        with contextlib.suppress(OSError, ValueError):  # no descriptor: a test's capture
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _error(message: str) -> None:
    print(f"safeview: {message}", file=sys.stderr)


class _Progress:
    """ "checking N views of PLAN..." on standard error, when it is a terminal and the check has
    taken more than ``PROGRESS_AFTER_S``; erased when the check ends."""

    def __init__(self, text: str, enabled: bool) -> None:
        self.text = text
        self.lock = threading.Lock()
        self.shown = self.done = False
        self.timer = threading.Timer(PROGRESS_AFTER_S, self._show) if enabled else None

    def __enter__(self) -> _Progress:
        if self.timer is not None:
            self.timer.daemon = True
            self.timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.timer is not None:
            self.timer.cancel()
        with self.lock:
            self.done = True
            if self.shown:
                sys.stderr.write("\r\x1b[K")
                sys.stderr.flush()

    def _show(self) -> None:
        with self.lock:
            if not self.done:
                sys.stderr.write(f"safeview: {self.text}")
                sys.stderr.flush()
                self.shown = True


@dataclass
class _Outcome:
    """One plan's result: its report, or why it could not be checked."""

    label: str
    plan: Plan | None = None
    report: Report | None = None
    error: str | None = None
    details: list[dict[str, Any]] = field(default_factory=list)

    @property
    def code(self) -> int:
        if self.report is None:
            return UNUSABLE
        return CLEAN if self.report.ok else VIOLATIONS

    @property
    def status(self) -> list[str]:
        if self.report is None:
            return ["error"]
        found = {finding.kind for finding in self.report.findings}
        return [kind for kind in KINDS if kind in found] or ["clean"]

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"plan": self.label, "status": self.status}
        if self.report is None:
            return {**data, "ok": False, "error": self.error, "details": self.details}
        if self.plan is not None and self.plan.description:
            data["description"] = self.plan.description
        return {**data, **self.report.to_json()}


def _location(loc: Sequence[int | str]) -> str:
    return ".".join(str(part) for part in loc) or "(plan)"


def _validation_details(error: ValidationError) -> list[dict[str, Any]]:
    return [
        {"loc": _location(e["loc"]), "message": e["msg"], "input": repr(e.get("input"))[:80]}
        for e in error.errors(include_url=False)
    ]


def _invalid(label: str, details: list[dict[str, Any]]) -> str:
    """One line: the first located error, and where the others are."""
    first = details[0]
    line = f"{label} is not a valid plan: {first['loc']}: {first['message']} (got {first['input']})"
    if len(details) > 1:
        line += f"; {len(details) - 1} more at " + ", ".join(d["loc"] for d in details[1:])
    return line


def _load(label: str, source: str) -> _Outcome:
    try:
        text = sys.stdin.buffer.read() if source == STDIN else Path(source).read_bytes()
    except OSError as error:
        return _Outcome(label, error=f"cannot read {label}: {error.strerror or error}")
    try:
        plan = Plan.from_json(text)
    except ValidationError as error:
        details = _validation_details(error)
        return _Outcome(label, error=_invalid(label, details), details=details)
    return _Outcome(label, plan=plan)


def _views(count: int) -> str:
    return f"{count} view{'s' if count != 1 else ''}"


def _storages(count: int) -> str:
    return f"{count} storage{'s' if count != 1 else ''}"


def _span(values: Sequence[int]) -> str:
    low, high = min(values), max(values)
    return f"{low:,}" if low == high else f"{low:,}..{high:,}"


def _describe(kind: str, found: Sequence[Finding]) -> str:
    """What a group of findings of one kind amounts to, with the range of their numbers."""
    count = len(found)
    overflows = [f.overflow_bytes for f in found if f.overflow_bytes is not None]
    if kind == "out_of_bounds":
        return f"{_views(count)} past the end of their storage by {_span(overflows)} bytes"
    if kind == "out_of_region":
        return f"{_views(count)} outside their region by {_span(overflows)} bytes"
    if kind == "self_overlap":
        return f"{_views(count)} whose own pages overlap"
    pairs = f"{count} pair{'s' if count != 1 else ''} of views that share bytes"
    bytes_ = [f.byte for f in found if f.byte is not None]
    return pairs + (f", at byte {_span(bytes_)}" if bytes_ else "")


def _groups(report: Report, limit: int, verbose: bool) -> list[str]:
    """A line per kind found, naming at most ``limit`` of its violations (with ``verbose``,
    their sentences under it)."""
    lines = []
    kinds = [kind for kind in KINDS if report.of_kind(kind)]
    width = max((len(kind) for kind in kinds), default=0)
    for kind in kinds:
        found = report.of_kind(kind)
        listed = found[:limit]
        names = ", ".join(" & ".join(repr(name) for name in f.views) for f in listed)
        line = f"  {kind.ljust(width)}  {_describe(kind, found)}"
        if names:
            line += f": {names}"
        if len(found) > len(listed):
            line += f"{' and' if listed else ','} {len(found) - len(listed)} more"
        lines.append(line)
        if verbose:
            lines += [f"      {f.message}" for f in listed]
    return lines


def _section(outcome: _Outcome, args: argparse.Namespace) -> list[str]:
    """The text a plan gets: verdict, violations by kind, the table with -v, a summary."""
    plan, report = outcome.plan, outcome.report
    assert plan is not None
    assert report is not None
    about = f" ({plan.description})" if plan.description else ""
    lines = [f"{'OK' if report.ok else 'FAIL'} {outcome.label}{about}"]
    lines += _groups(report, args.max_violations, args.table)
    if args.table:
        lines += [report.table(), ""]
    counts = f"{_views(len(report.views))} over {_storages(len(report.storages))}"
    if report.ok:
        lines.append(
            f"{counts}: every view stays inside its storage and region, no view's pages "
            "overlap each other, and no two views of one group share a byte."
        )
    else:
        number = len(report.findings)
        tally = ", ".join(f"{len(report.of_kind(k))} {k}" for k in KINDS if report.of_kind(k))
        lines.append(f"{number} violation{'s' if number != 1 else ''} ({tally}) in {counts}.")
    return lines


def _map_problem(target: Path, plans: int) -> str | None:
    """Why ``--map target`` cannot be drawn, found before any plan is checked."""
    if plans != 1:
        return f"--map draws one plan; {plans} were given"
    if target.suffix.lower() not in MAP_FORMATS:
        return f"--map {target}: the file name must end in {', '.join(MAP_FORMATS)}"
    folder = target.parent
    if not folder.is_dir():
        return f"--map {target}: folder {str(folder)!r} does not exist"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return (
            "--map needs matplotlib, which is not installed; "
            "install it with: pip install 'safeview[plot]'"
        )
    return None


def check(args: argparse.Namespace) -> int:
    """``safeview check``: each plan in turn, then the worst exit code."""
    out: _Stdout = args.out
    text = not (args.json or args.quiet)
    problem = None
    if args.plans.count(STDIN) > 1:
        problem = "standard input ('-') can be read only once"
    elif args.map is not None:
        problem = _map_problem(args.map, len(args.plans))
    if problem is not None:
        if not args.quiet:
            _error(problem)
        return UNUSABLE
    progress = sys.stderr.isatty() and not args.quiet
    outcomes = []
    for number, source in enumerate(args.plans):
        label = "<stdin>" if source == STDIN else source
        outcome = _load(label, source)
        if outcome.plan is not None:
            views = _views(len(outcome.plan.views))
            with _Progress(f"checking {views} of {label}...", progress):
                outcome.report = outcome.plan.check()
        outcomes.append(outcome)
        if outcome.error is not None and not args.quiet:
            _error(outcome.error)
        if text and outcome.report is not None:
            if number:
                out.line()
            for line in _section(outcome, args):
                out.line(line)
    code = max(outcome.code for outcome in outcomes)
    if args.map is not None and outcomes[0].report is not None:
        from safeview._plot import draw_map

        plan, report = outcomes[0].plan, outcomes[0].report
        assert plan is not None
        try:
            draw_map(plan, report, args.map)
        except OSError as error:
            if not args.quiet:
                _error(f"cannot write {args.map}: {error.strerror or error}")
            code = UNUSABLE
        else:
            if text:
                out.line(f"map written to {args.map}")
    if args.json:
        statuses = {status for outcome in outcomes for status in outcome.status}
        order = ["error", *KINDS]
        document = {
            "schema_version": SCHEMA_VERSION,
            "status": [s for s in order if s in statuses] or ["clean"],
            "exit_code": code,
            "plans": [outcome.to_json() for outcome in outcomes],
        }
        out.line(json.dumps(document, indent=2))
    elif text and len(outcomes) > 1:
        tally = [
            (sum(o.code == CLEAN for o in outcomes), "clean"),
            (sum(o.code == VIOLATIONS for o in outcomes), "with violations"),
            (sum(o.code == UNUSABLE for o in outcomes), "unusable"),
        ]
        out.line()
        out.line(f"{len(outcomes)} plans: " + ", ".join(f"{n} {what}" for n, what in tally if n))
    return code


def schema(args: argparse.Namespace) -> int:
    """``safeview schema``: the JSON Schema of a plan file."""
    args.out.line(json.dumps(Plan.model_json_schema(), indent=2))
    return CLEAN


def _max_violations(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = -1
    if number < 0:
        raise argparse.ArgumentTypeError(f"expected a count (0 or more), got {value!r}")
    return number


def _parser() -> _Parser:
    parser = _Parser(
        prog="safeview", description="Check KV-cache layout plans without touching a tensor."
    )
    parser.add_argument("--version", action="version", version=f"safeview {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    checking = commands.add_parser(
        "check",
        help="check every view and every pair of views of each plan",
        description="Check each plan: every view, and every pair of views. Exit status: 0 "
        "every plan clean, 1 violations found, 2 anything else (unreadable or invalid plan, "
        "bad option, map not drawn): the worst over the plans.",
    )
    checking.add_argument(
        "plans", nargs="+", metavar="PLAN", help="a plan file (JSON; see `safeview schema`), or -"
    )
    shown = checking.add_mutually_exclusive_group()
    shown.add_argument("--json", action="store_true", help="print one JSON document")
    shown.add_argument(
        "-q", "--quiet", action="store_true", help="print nothing; only the exit status"
    )
    shown.add_argument(
        "-v", "--table", action="store_true", help="also each violation's sentence, a row per view"
    )
    checking.add_argument(
        "--max-violations",
        type=_max_violations,
        default=3,
        metavar="N",
        help="name at most N violations of each kind (default 3)",
    )
    checking.add_argument(
        "--map",
        type=Path,
        metavar="FILE.png",
        help="draw the storage layout, as .png, .svg or .pdf (needs matplotlib)",
    )
    checking.set_defaults(run=check)
    schema_parser = commands.add_parser("schema", help="print the JSON Schema of a plan file")
    schema_parser.set_defaults(run=schema)
    return parser


def _why(error: BaseException) -> str:
    if isinstance(error, SafeViewError):
        return str(error)
    if isinstance(error, KeyboardInterrupt):
        return "interrupted"
    # a bug of safeview's: still one line, never a traceback
    return f"internal error: {type(error).__name__}: {error} (please report it)"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit status, having printed any error as one line."""
    out = _Stdout()
    quiet = False
    try:
        args = _parser().parse_args(argv)
        args.out, quiet = out, getattr(args, "quiet", False)
        configure_from_env()  # a bad SAFEVIEW_LOG_FORMAT: a ConfigError, reported below
        code: int = args.run(args)
    except SystemExit as stop:  # --help, --version, a usage error (already reported)
        code = stop.code if isinstance(stop.code, int) else UNUSABLE
    except (SafeViewError, KeyboardInterrupt, Exception) as error:
        if not quiet:
            _error(_why(error))
        code = UNUSABLE
    out.flush()
    return code


if __name__ == "__main__":
    sys.exit(main())
