"""``safeview diff SENDER RECEIVER``: will two engines (or an engine and a connector, or one
engine before and after an upgrade) read the same bytes the same way? Never imports torch.

Each side is a manifest file (one rank) or a folder of one engine's per-rank manifests
(``*.json``; or holding one engine's folder of them, as the vLLM plugin writes). Without
``--rule``, the rule of the connector the manifests name. Exit status 0 compatible, 1 a mismatch
(a line per finding, the first byte named; a rank missing from a folder is one), 2 bad input
(one short line on standard error, never a traceback); ``--json`` prints one document with
``$schema``. Every verdict says the rule, why, and the ranks judged.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from safeview.errors import SafeViewError

__all__ = ["add_diff_command", "count", "run_diff"]

COMPATIBLE, MISMATCH, UNUSABLE = 0, 1, 2


def _shown(text: str) -> str:
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() else ascii(char)[1:-1] for char in text)


def _load_side(argument: str) -> Any:
    """A file: that one manifest (one rank, judged alone). A folder: one engine's manifests,
    every rank (a rank its TP size declares and the folder lacks is a finding); a folder
    holding no manifest but one engine's folder, as the vLLM plugin writes them
    (``DIR/ENGINE/ENGINE.tpRofN.manifest.json``), is read through."""
    from safeview.errors import ManifestError
    from safeview.manifest import Manifest

    path = Path(argument)
    try:
        if not path.is_dir():
            return Manifest.read(path)
        files = _json_files(path)
        if not files:
            engines = sorted(p for p in path.iterdir() if p.is_dir() and _json_files(p))
            if len(engines) > 1:
                names = ", ".join(_shown(p.name) for p in engines[:4])
                more = f" and {len(engines) - 4:,} more" if len(engines) > 4 else ""
                raise ManifestError(
                    argument,
                    None,
                    f"holds {len(engines):,} engines' folders ({names}{more}): give one, "
                    f"such as {_shown(str(engines[0]))}",
                )
            if not engines:
                raise ManifestError(
                    argument, None, "is a folder that holds no *.json manifest, nor one "
                    "engine's folder of them"
                )  # fmt: skip
            files = _json_files(engines[0])
        manifests = [Manifest.read(file) for file in files]
    except OSError as error:
        raise ManifestError(argument, None, f"cannot be read: {error.strerror or error}") from None
    engines_named = sorted({str(m.topology.engine) for m in manifests})
    if len(engines_named) > 1:
        shown = ", ".join(engines_named[:4]) + (" ..." if len(engines_named) > 4 else "")
        raise ManifestError(
            argument,
            None,
            f"holds manifests of several engines ({shown}): give one engine's folder",
        )
    return manifests


def _json_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*.json") if p.is_file() and not p.name.startswith("."))


def run_diff(args: argparse.Namespace) -> int:
    """``safeview diff``: load both sides, compare, print; the exit status."""
    from safeview.manifest.diff import DIFF_SCHEMA, diff

    out = args.out
    try:
        sender = _load_side(args.sender)
        receiver = _load_side(args.receiver)
        report = diff(sender, receiver, rule=args.rule)
    except SafeViewError as error:
        line = _shown(str(error))
        if not args.quiet:
            print(f"safeview: {line}", file=sys.stderr)
        if args.json:
            document = {
                "$schema": DIFF_SCHEMA,
                "verdict": "error",
                "exit_code": UNUSABLE,
                "error": line,
            }
            out.line(json.dumps(document, indent=2))
        return UNUSABLE
    code = COMPATIBLE if report.compatible else MISMATCH
    if args.json:
        document = {**report.to_json(), "exit_code": code}
        document["sender"], document["receiver"] = args.sender, args.receiver
        out.line(json.dumps(document, indent=2))
        return code
    if args.quiet:
        return code
    layers = f"{len(report.layers):,} layer{'s' if len(report.layers) != 1 else ''}"
    pair = f"{_shown(args.sender)} -> {_shown(args.receiver)}"
    rule = f"rule {report.rule}" + (
        f" of {report.rule_from}" if report.rule_from.startswith("connector") else ""
    )
    what = f"{layers}, {rule}; {report.ranks()}"
    if report.compatible:
        skipped = f"; {len(report.skipped):,} not judged" if report.skipped else ""
        out.line(f"COMPATIBLE {pair} ({what}{skipped})")
        out.line("every byte a transfer fills means to the receiver what the sender wrote there.")
        return code
    out.line(f"MISMATCH {pair} ({what})")
    for finding in report.findings[: args.max_findings]:
        out.line(f"  {finding.kind}  {_shown(finding.message)}")
    if len(report.findings) > args.max_findings:
        out.line(f"  ... and {len(report.findings) - args.max_findings:,} more")
    return code


def count(value: str) -> int:
    """An argument that counts (0 or more): ``--max-findings``, ``--max-violations``."""
    try:
        number = int(value)
    except ValueError:
        number = -1
    if number < 0:
        raise argparse.ArgumentTypeError(f"expected a count (0 or more), got {value!r}")
    return number


def add_diff_command(commands: Any) -> None:
    """Add ``diff`` to the command's subparsers."""
    from safeview.manifest.diff import RULES

    parser = commands.add_parser(
        "diff",
        help="compare what two engines' KV-cache bytes mean (layout manifests)",
        description="Compare two layout manifests layer by layer, by name: does every byte a "
        "transfer fills mean to the receiver what the sender wrote there? Exit status: 0 "
        "compatible, 1 mismatch, 2 bad input.",
    )
    parser.add_argument("sender", metavar="SENDER", help="a manifest file, or a folder of one "
                        "engine's per-rank manifests (for P/D: the prefill side)")  # fmt: skip
    parser.add_argument("receiver", metavar="RECEIVER", help="the same, for the receiving side")
    parser.add_argument(
        "--rule",
        choices=RULES,
        default=None,
        help="how bytes move: page_copy (block to block), vllm_nixl (vLLM's NIXL connector, "
        "heterogeneous TP and block tokens), in_place (the receiver reads the sender's memory "
        "where it lies: a connector's assumed format). Default: the rule of the connector "
        "the manifests name (vllm_nixl for the vLLM plugin's NIXL manifests), else page_copy",
    )
    shown = parser.add_mutually_exclusive_group()
    shown.add_argument("--json", action="store_true", help="print one JSON document")
    shown.add_argument("-q", "--quiet", action="store_true", help="print nothing; exit status")
    parser.add_argument(
        "--max-findings", type=count, default=20, metavar="N", help="show at most N findings"
    )
    parser.set_defaults(run=run_diff)
