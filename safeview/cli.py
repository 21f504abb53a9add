"""The ``safeview`` command: check a layout plan, print its JSON Schema. Never imports torch.

    safeview check PLAN.json [--json] [--map FILE.png]
    safeview schema

``check`` exits 0 when the plan is clean, 1 when it finds a violation, 2 when the plan cannot be
read or is invalid (or the map cannot be drawn).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from safeview import __version__
from safeview.check import Report
from safeview.plan import Plan

__all__ = ["main"]

CLEAN, VIOLATIONS, UNUSABLE = 0, 1, 2


def _location(loc: Sequence[int | str]) -> str:
    return ".".join(str(part) for part in loc) or "(plan)"


def _validation_lines(error: ValidationError) -> list[dict[str, Any]]:
    return [
        {"loc": _location(e["loc"]), "message": e["msg"], "input": repr(e.get("input"))[:80]}
        for e in error.errors(include_url=False)
    ]


def _unusable(args: argparse.Namespace, reason: str, details: list[dict[str, Any]]) -> int:
    print(f"safeview: {reason}", file=sys.stderr)
    for detail in details:
        print(f"  {detail['loc']}: {detail['message']} (got {detail['input']})", file=sys.stderr)
    if args.json:
        print(json.dumps({"ok": False, "error": reason, "details": details}, indent=2))
    return UNUSABLE


def _summary(plan: Plan, report: Report) -> str:
    storages = len(plan.storages)
    counts = f"{len(plan.views)} views over {storages} storage{'s' if storages != 1 else ''}"
    if report.ok:
        return (
            f"OK: {counts}. Every view stays inside its storage and region, no view's pages "
            "overlap each other, and no two views of one group share a byte."
        )
    lines = [f"{len(report.findings)} violation(s) in {counts}:"]
    width = max(len(finding.kind) for finding in report.findings)
    lines += [f"  {f.kind.ljust(width)}  {f.message}" for f in report.findings]
    return "\n".join(lines)


def check(args: argparse.Namespace) -> int:
    if args.map is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print(
                "safeview: --map needs matplotlib, which is not installed; "
                "install it with: pip install 'safeview[plot]'",
                file=sys.stderr,
            )
            return UNUSABLE
    try:
        plan = Plan.load(args.plan)
    except OSError as error:
        return _unusable(args, f"cannot read {args.plan}: {error.strerror or error}", [])
    except ValidationError as error:
        return _unusable(args, f"{args.plan} is not a valid plan", _validation_lines(error))
    report = plan.check()
    if args.json:
        print(json.dumps({"plan": str(args.plan), **report.to_json()}, indent=2))
    else:
        print(f"plan {args.plan}" + (f": {plan.description}" if plan.description else ""))
        print(report.table())
        print()
        print(_summary(plan, report))
    if args.map is not None:
        from safeview._plot import draw_map

        draw_map(plan, report, args.map)
        if not args.json:
            print(f"map written to {args.map}")
    return CLEAN if report.ok else VIOLATIONS


def schema(args: argparse.Namespace) -> int:
    print(json.dumps(Plan.model_json_schema(), indent=2))
    return CLEAN


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="safeview", description="Check KV-cache layout plans without touching a tensor."
    )
    parser.add_argument("--version", action="version", version=f"safeview {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    checking = commands.add_parser(
        "check",
        help="check every view and every pair of views of a plan",
        description="Exit status: 0 clean, 1 violations found, 2 plan unreadable or invalid.",
    )
    checking.add_argument("plan", type=Path, help="a plan file (JSON; see `safeview schema`)")
    checking.add_argument("--json", action="store_true", help="print a machine-readable report")
    checking.add_argument(
        "--map", type=Path, metavar="FILE.png", help="draw the storage layout (needs matplotlib)"
    )
    checking.set_defaults(run=check)
    schema_parser = commands.add_parser("schema", help="print the JSON Schema of a plan file")
    schema_parser.set_defaults(run=schema)
    args = parser.parse_args(argv)
    result: int = args.run(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
