"""The ``safeview`` command: check layout plans, print their JSON Schema. Never imports torch.

    safeview check PLAN|FOLDER [...] [-q | -v | --json] [--max-violations N] [--map FILE.png]
    safeview schema
    safeview diff SENDER RECEIVER [--rule page_copy|vllm_nixl|in_place] [-q | --json]
    safeview run [--policy strict|warn] -- COMMAND ...

``check`` exits 0 when every plan is clean, 1 when one has a violation, 2 for anything else (a
plan unreadable, invalid or that could not be checked, a bad option or ``SAFEVIEW_*`` variable, a
map that cannot be drawn): the worst over the plans. Every error is one line on standard error,
``safeview: ...``, and a plan that fails leaves the others checked.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
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
from safeview.cli._diff import add_diff_command, count
from safeview.errors import ConfigError, SafeViewError
from safeview.findings import KINDS, Finding
from safeview.log import ENV_LOG_LEVEL, LEVELS, configure_from_env
from safeview.plan import Plan
from safeview.policy import ENV_POLICY, coerce_policy

__all__ = ["command", "main"]

CLEAN, VIOLATIONS, UNUSABLE = 0, 1, 2
SCHEMA_VERSION = 2  # of the --json document; 2: a view's status is a list of kinds
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


def _shown(text: str) -> str:
    """``text`` as one printable line: a file name with a newline or a control character in it
    has them escaped (``a\\nb.json``), so that every message stays one line."""
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() else ascii(char)[1:-1] for char in text)


def _error(message: str) -> None:
    print(f"safeview: {_shown(message)}", file=sys.stderr)


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


def _plural(count: int, noun: str, plural: str | None = None) -> str:
    """``1 view``, ``2 views``, ``1,000 views``."""
    return f"{count:,} {noun if count == 1 else plural or noun + 's'}"


@dataclass
class _Outcome:
    """One plan's result: its report, or why it could not be checked."""

    label: str  # the plan's name as given (the file name, or <stdin>)
    source: str | None = None  # where to read it from; None: nothing to read
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

    def failed(self, error: str, details: list[dict[str, Any]] | None = None) -> None:
        self.error = error
        self.details = details if details is not None else [_detail("(plan)", error)]

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"plan": self.label, "status": self.status}
        if self.report is None:
            return {**data, "ok": False, "error": self.error, "details": self.details}
        if self.plan is not None and self.plan.description:
            data["description"] = self.plan.description
        found = self.report.to_json()
        kinds = self.report.kinds_of()
        for row in found["views"]:
            listed = set(kinds.get(row["name"], ()))
            row["status"] = [str(kind) for kind in KINDS if kind in listed] or ["ok"]
        return {**data, **found}


def _detail(loc: str, message: str, value: Any = None) -> dict[str, Any]:
    # an integer, a boolean or null stays what it is in JSON; anything else is shown as Python
    # writes it, cut to 80 characters
    shown = value if value is None or type(value) in (int, bool) else repr(value)[:80]
    return {"loc": loc, "message": message, "input": shown}


def _location(loc: Sequence[int | str]) -> str:
    return ".".join(str(part) for part in loc) or "(plan)"


def _validation_details(error: ValidationError) -> list[dict[str, Any]]:
    return [
        _detail(_location(e["loc"]), e["msg"], e.get("input"))
        for e in error.errors(include_url=False)
    ]


def _invalid(label: str, details: list[dict[str, Any]]) -> str:
    """One line: the first located error (an unknown key, when there is one), and where the
    others are."""
    first = details[0]
    line = f"{label} is not a valid plan: {first['loc']}: {first['message']} (got {first['input']})"
    if len(details) > 1:
        line += f"; {len(details) - 1} more at " + ", ".join(d["loc"] for d in details[1:])
    return line


def _internal(error: BaseException) -> str:
    return f"internal error: {type(error).__name__}: {error} (please report it)"


def _outcomes(arguments: Sequence[str]) -> list[_Outcome]:
    """What to check, in order: each plan given, and every ``*.json`` file of each folder given,
    in name order. A folder that cannot be listed, or holds none, is an outcome of its own."""
    found = []
    for argument in arguments:
        if argument == STDIN:
            found.append(_Outcome("<stdin>", STDIN))
            continue
        folder = Path(argument)
        try:
            if not folder.is_dir():
                found.append(_Outcome(argument, argument))
                continue
            files = sorted(
                (path for path in folder.glob("*.json") if path.is_file()), key=lambda p: p.name
            )
        except (OSError, ValueError) as error:  # ValueError: a name with a NUL byte
            found.append(_Outcome(argument))
            found[-1].failed(f"cannot read {argument}: {getattr(error, 'strerror', None) or error}")
            continue
        if not files:
            found.append(_Outcome(argument))
            found[-1].failed(f"folder {argument} holds no *.json file")
        found += [_Outcome(str(path), str(path)) for path in files]
    return found


def _load(outcome: _Outcome) -> None:
    """Read and validate the plan, or say why not."""
    label, source = outcome.label, outcome.source
    try:
        text = sys.stdin.buffer.read() if source == STDIN else Path(str(source)).read_bytes()
    except (OSError, ValueError) as error:
        outcome.failed(f"cannot read {label}: {getattr(error, 'strerror', None) or error}")
        return
    try:
        outcome.plan = Plan.from_json(text)
    except ValidationError as error:
        details = _validation_details(error)
        outcome.failed(_invalid(label, details), details)
    except Exception as error:  # a bug of safeview's: this plan fails, the others go on
        outcome.failed(f"{label}: {_internal(error)}")


def _check(outcome: _Outcome, progress: bool) -> None:
    """Check the loaded plan, or say why it could not be checked (a documented limit, such as
    ``safeview.overlap.MAX_EXACT_TESTS``, or a bug)."""
    assert outcome.plan is not None
    views = _plural(len(outcome.plan.views), "view")
    try:
        with _Progress(f"checking {views} of {_shown(outcome.label)}...", progress):
            outcome.report = outcome.plan.check()
    except SafeViewError as error:
        why = str(error)
    except Exception as error:
        why = _internal(error)
    else:
        return
    outcome.failed(f"{outcome.label} could not be checked: {why}", [_detail("(plan)", why)])


def _span(values: Sequence[int]) -> str:
    """``3,098,112 bytes``, ``36,864..3,098,112 bytes``, ``1 byte``."""
    low, high = min(values), max(values)
    if low == high:
        return _plural(low, "byte")
    return f"{low:,}..{high:,} bytes"


def _describe(kind: str, found: Sequence[Finding]) -> str:
    """What a group of findings of one kind amounts to, with the range of their numbers."""
    count = len(found)
    overflows = [f.overflow_bytes for f in found if f.overflow_bytes is not None]
    one = count == 1
    if kind == "out_of_bounds":
        storage = "its storage" if one else "their storage"
        return f"{_plural(count, 'view')} past the end of {storage} by {_span(overflows)}"
    if kind == "out_of_region":
        region = "its region" if one else "their regions"
        return f"{_plural(count, 'view')} outside {region} by {_span(overflows)}"
    if kind == "self_overlap":
        return f"{_plural(count, 'view')} whose own pages overlap"
    if kind != "overlap":  # not a kind a plan's views have; said plainly all the same
        return _plural(count, "finding")
    pairs = f"{_plural(count, 'pair')} of views that share bytes"
    bytes_ = [f.byte for f in found if f.byte is not None]
    if not bytes_:
        return pairs
    low, high = min(bytes_), max(bytes_)
    return pairs + (f", at byte {low:,}" if low == high else f", at bytes {low:,}..{high:,}")


def _groups(report: Report, limit: int, verbose: bool) -> list[str]:
    """A line per kind found, naming at most ``limit`` of its violations (with ``verbose``,
    their sentences under it)."""
    lines = []
    kinds = [kind for kind in KINDS if report.of_kind(kind)]
    width = max((len(kind) for kind in kinds), default=0)
    for kind in kinds:
        found = report.of_kind(kind)
        listed = found[:limit]
        names = ", ".join(" & ".join(_shown(repr(name)) for name in f.views) for f in listed)
        line = f"  {kind.ljust(width)}  {_describe(kind, found)}"
        if names:
            line += f": {names}"
        if len(found) > len(listed):
            line += f"{' and' if listed else ','} {len(found) - len(listed):,} more"
        lines.append(line)
        if verbose:
            lines += [f"      {_shown(f.message)}" for f in listed]
    return lines


def _section(outcome: _Outcome, args: argparse.Namespace) -> list[str]:
    """The text a plan gets: verdict, violations by kind, the table with -v, a summary."""
    plan, report = outcome.plan, outcome.report
    assert plan is not None
    assert report is not None
    about = f" ({_shown(plan.description)})" if plan.description else ""
    lines = [f"{'OK' if report.ok else 'FAIL'} {_shown(outcome.label)}{about}"]
    lines += _groups(report, args.max_violations, args.table)
    if args.table:
        lines += [_shown(line) for line in report.table().splitlines()] + [""]
    counts = f"{_plural(len(report.views), 'view')} over {_plural(len(report.storages), 'storage')}"
    if report.ok:
        lines.append(
            f"{counts}: every view stays inside its storage and region, no view's pages "
            "overlap each other, and no two views of one group share a byte."
        )
    else:
        tally = ", ".join(f"{len(report.of_kind(k)):,} {k}" for k in KINDS if report.of_kind(k))
        lines.append(f"{_plural(len(report.findings), 'violation')} ({tally}) in {counts}.")
    return lines


def _map_problem(target: Path, plans: int) -> str | None:
    """Why ``--map target`` cannot be drawn, found before any plan is checked."""
    if plans != 1:
        return f"--map draws one plan; {plans:,} were given"
    if target.suffix.lower() not in MAP_FORMATS:
        return f"--map {target}: the file name must end in {', '.join(MAP_FORMATS)}"
    folder = target.parent
    if not folder.is_dir():
        return f"--map {target}: folder {str(folder)!r} does not exist"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return (
            "--map needs matplotlib, which is not installed; safeview is on no package index "
            "yet: from a checkout of it, pip install -e '.[plot]', else "
            "pip install '/path/to/safeview[plot]'"
        )
    return None


def _draw(outcome: _Outcome, target: Path) -> str | None:
    """Draw the map of a checked plan; why not, if it could not be drawn."""
    if outcome.plan is None or outcome.report is None:
        return None if outcome.error is not None else "the plan was not checked"
    try:
        from safeview.cli._map import draw_map

        draw_map(outcome.plan, outcome.report, target)
    except OSError as error:
        return f"cannot write {target}: {error.strerror or error}"
    except Exception as error:  # a bug of safeview's, or matplotlib's: the report still stands
        return f"cannot draw {target}: {_internal(error)}"
    return None


def check(args: argparse.Namespace) -> int:
    """``safeview check``: each plan in turn, then the worst exit code."""
    out: _Stdout = args.out
    text = not (args.json or args.quiet)
    problem = None
    outcomes: list[_Outcome] = []
    if args.plans.count(STDIN) > 1:
        problem = "standard input ('-') can be read only once"
    else:
        outcomes = _outcomes(args.plans)
        if args.map is not None:
            problem = _map_problem(args.map, len(outcomes))
    if problem is not None:
        if not args.quiet:
            _error(problem)
        if args.json:  # one document all the same: no plan read, the reason in it
            document = _document(UNUSABLE, [], problem)
            if args.map is not None:
                document["map"] = {"path": str(args.map), "written": False, "error": problem}
            out.line(json.dumps(document, indent=2))
        return UNUSABLE
    progress = sys.stderr.isatty() and not args.quiet
    shown = 0
    for outcome in outcomes:
        if outcome.error is None:
            _load(outcome)
        if outcome.plan is not None:
            _check(outcome, progress)
        if outcome.error is not None and not args.quiet:
            _error(outcome.error)
        if text and (outcome.report is not None or len(outcomes) > 1):
            # several plans: one that could not be checked is named on standard output too,
            # where the others' sections and the tally are
            if shown:
                out.line()
            lines = _section(outcome, args) if outcome.report is not None else [
                f"ERROR {_shown(outcome.label)}", f"  {_shown(outcome.error or '')}"
            ]  # fmt: skip
            for line in lines:
                out.line(line)
            shown += 1
    code = max(outcome.code for outcome in outcomes)
    map_error = None
    if args.map is not None:
        map_error = _draw(outcomes[0], args.map)
        if map_error is not None:
            if not args.quiet:
                _error(map_error)
            code = UNUSABLE
        elif outcomes[0].report is not None and text:
            out.line(f"map written to {_shown(str(args.map))}")
    if args.json:
        document = _document(code, outcomes)
        if args.map is not None:
            drawn = outcomes[0].report is not None and map_error is None
            document["map"] = {"path": str(args.map), "written": drawn}
            if not drawn:
                document["map"]["error"] = map_error or "the plan could not be checked"
        out.line(json.dumps(document, indent=2))
    elif text and len(outcomes) > 1:
        tally = [
            (sum(o.code == CLEAN for o in outcomes), "clean"),
            (sum(o.code == VIOLATIONS for o in outcomes), "with violations"),
            (sum(o.code == UNUSABLE for o in outcomes), "unusable"),
        ]
        out.line()
        out.line(f"{_plural(len(outcomes), 'plan')}: " + ", ".join(
            f"{n:,} {what}" for n, what in tally if n
        ))  # fmt: skip
    return code


def _document(code: int, outcomes: Sequence[_Outcome], error: str | None = None) -> dict[str, Any]:
    """The ``--json`` document of a check; ``error`` when no plan could be read at all."""
    statuses = {status for outcome in outcomes for status in outcome.status}
    if error is not None:
        statuses.add("error")
    document: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "status": [s for s in ("error", *KINDS) if s in statuses] or ["clean"],
        "exit_code": code,
        "plans": [outcome.to_json() for outcome in outcomes],
    }
    if error is not None:
        document["error"] = error
    return document


def schema(args: argparse.Namespace) -> int:
    """``safeview schema``: the JSON Schema of a plan file."""
    args.out.line(json.dumps(Plan.model_json_schema(), indent=2))
    return CLEAN


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
        "every plan clean, 1 violations found, 2 anything else (unreadable, invalid or "
        "unchecked plan, bad option or SAFEVIEW_* variable, map not drawn): the worst over "
        "the plans.",
    )
    checking.add_argument(
        "plans",
        nargs="+",
        metavar="PLAN",
        help="a plan file (JSON; see `safeview schema`), a folder (its *.json files, in name "
        "order), or - for standard input",
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
        type=count,
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
    add_diff_command(commands)  # safeview diff SENDER RECEIVER (safeview/cli/_diff.py)
    guarded = commands.add_parser(
        "run",
        help="run a command with the process guard on (SAFEVIEW_GUARD)",
        description="Run COMMAND with SAFEVIEW_GUARD set to the policy, so that every Python "
        "process it starts judges its views (docs/process.md). Exit status: the command's. "
        "Under strict (the default) a bad call raises BoundsError; under warn it runs, and "
        "each warning is one line on standard error (or goes to the command's own logging, "
        "where it has set some up). SAFEVIEW_LOG_FORMAT=json or console writes every event "
        "from info up instead, one line each: the guard's start, each warning, its counts at "
        "exit (SAFEVIEW_LOG_LEVEL chooses the level).",
    )
    guarded.add_argument(
        "--policy",
        choices=("strict", "warn"),
        default="strict",
        help="strict (the default): a bad call raises BoundsError; warn: it runs, and is reported",
    )
    guarded.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- COMMAND ...")
    guarded.set_defaults(run=run_guarded)
    return parser


def run_guarded(args: argparse.Namespace) -> int:
    """``safeview run``: the command's exit status, or 2 when there is no command to run."""
    from safeview.guard.process import run_command

    argv = list(args.argv)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        raise ConfigError("COMMAND", "", ("a command to run, after --",))
    args.out.flush()
    return run_command(argv, args.policy)


def _check_environment() -> None:
    """Every ``SAFEVIEW_*`` variable safeview reads, checked as the library would read it: a bad
    one is a ``ConfigError`` (exit 2) whatever the subcommand, even one that does not use it."""
    configure_from_env()  # SAFEVIEW_LOG_FORMAT, and SAFEVIEW_LOG_LEVEL with it
    policy = os.environ.get(ENV_POLICY, "")
    if policy.strip():  # set to nothing is unset
        coerce_policy(policy, source=ENV_POLICY)
    level = os.environ.get(ENV_LOG_LEVEL, "")
    if level.strip() and level.strip().lower() not in LEVELS:
        raise ConfigError(ENV_LOG_LEVEL, level, LEVELS)


def _why(error: BaseException) -> str:
    if isinstance(error, SafeViewError):
        return str(error)
    if isinstance(error, KeyboardInterrupt):
        return "interrupted"
    return _internal(error)  # a bug of safeview's: still one line, never a traceback


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit status, having printed any error as one line. Safe to
    call inside another program: it changes nothing of the process but what it prints (and the
    logging that ``SAFEVIEW_LOG_FORMAT`` asks for)."""
    out = _Stdout()
    quiet = False
    try:
        args = _parser().parse_args(argv)
        args.out, quiet = out, getattr(args, "quiet", False)
        _check_environment()
        code: int = args.run(args)
    except SystemExit as stop:  # --help, --version, a usage error (already reported)
        code = stop.code if isinstance(stop.code, int) else UNUSABLE
    except (SafeViewError, KeyboardInterrupt, Exception) as error:
        if not quiet:
            _error(_why(error))
        code = UNUSABLE
    out.flush()
    return code


def command() -> NoReturn:
    """The ``safeview`` console script and ``python -m safeview``: ``main()`` in a process of its
    own, with the cyclic garbage collector paused. A plan of 100,000 views allocates millions of
    objects and frees almost none, so the collector would only rescan them (about a fifth of the
    time of a large check); the process ends when the command does."""
    gc.disable()
    sys.exit(main())


if __name__ == "__main__":
    command()
