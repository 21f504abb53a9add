"""``safeview diff SENDER RECEIVER``: will two engines (or an engine and a connector, or one
engine before and after an upgrade) read the same bytes the same way? Never imports torch.

Each side is a manifest file (one rank) or a folder of one engine's per-rank manifests
(``*.json``; or holding one engine's folder of them, as the vLLM plugin writes). A file may also
hold one rank's manifest as it travels between machines: its wire form
(``safeview.manifest.wire``), or a vLLM NIXL handshake payload saved as it was served (msgpack:
the manifest under ``safeview_manifest``). A side may be a metadata-store URL on this machine
(``http://127.0.0.1:PORT/metadata?key=KEY``, Mooncake's HTTP metadata server), fetched with no
proxy and no redirect; only loopback hosts. Without
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

    if "://" in argument:
        return _read_manifest(_fetched(argument), argument)
    path = Path(argument)
    try:
        if not path.is_dir():
            return _read_manifest(path.read_bytes(), argument)
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
        manifests = [_read_manifest(file.read_bytes(), str(file)) for file in files]
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


# What a side's file or URL may hold: a manifest is a few MB at most (1,000 layers written
# out in full); past this it is no manifest, and reading on would only fill memory.
MAX_SOURCE_BYTES = 64 * 1024 * 1024
# A store on this machine answers in milliseconds; the whole fetch (connecting, the headers and
# every byte of the body) ends within this, however slowly the server sends.
FETCH_TIMEOUT_S = 10.0
_LOOPBACK_NAMES = ("localhost",)


def _read_manifest(data: bytes, source: str) -> Any:
    """The one manifest ``data`` holds: a manifest file's JSON, its wire form, or a vLLM NIXL
    handshake payload (a msgpack map, the manifest's wire form under ``safeview_manifest``)."""
    from safeview.errors import ManifestError
    from safeview.manifest import Manifest
    from safeview.manifest.wire import WIRE_SCHEMA, from_wire

    if len(data) > MAX_SOURCE_BYTES:
        raise ManifestError(
            source,
            f"{len(data):,} bytes",
            f"is more than the {MAX_SOURCE_BYTES:,} a manifest holds",
        )
    if data[:1] and (0x80 <= data[0] <= 0x8F or data[0] in (0xDE, 0xDF)):  # a msgpack map
        return from_wire(_handshake_manifest(data, source), peer=f"{source}: safeview_manifest")
    if _schema_of(data) == WIRE_SCHEMA:
        return from_wire(data, peer=source)
    return Manifest.from_json(data, source=source)  # which names what is wrong, if anything


def _schema_of(data: bytes) -> object:
    """The ``$schema`` of a JSON object, ``None`` for anything else."""
    try:
        document = json.loads(data)
    except (ValueError, RecursionError):
        return None
    return document.get("$schema") if isinstance(document, dict) else None


def _handshake_manifest(data: bytes, source: str) -> bytes:
    """The wire form under ``safeview_manifest`` in a saved NIXL handshake payload."""
    from safeview.errors import ManifestError

    try:
        import msgspec

        decoded = msgspec.msgpack.decode(data)
    except ImportError:
        raise ManifestError(
            source, None, "is a msgpack handshake payload: reading one needs msgspec installed"
        ) from None
    except Exception as error:  # msgspec's DecodeError, or any value it will not read
        raise ManifestError(source, None, f"is not a msgpack handshake payload ({error})") from None
    if not isinstance(decoded, dict):
        raise ManifestError(source, type(decoded).__name__, "is not a handshake payload (a map)")
    wire = decoded.get("safeview_manifest")
    if wire is None:
        keys = ", ".join(sorted(str(key) for key in decoded)[:4])
        raise ManifestError(
            f"{source}: safeview_manifest",
            None,
            f"is absent (keys: {keys}): the engine that served this handshake sent no "
            "manifest (it runs without safeview)",
        )
    if not isinstance(wire, (bytes, str)):
        raise ManifestError(
            f"{source}: safeview_manifest", type(wire).__name__, "is not bytes (to_wire's form)"
        )
    return wire if isinstance(wire, bytes) else wire.encode("utf-8", "surrogatepass")


def _fetched(url: str) -> bytes:
    """The body a metadata store on this machine serves at ``url`` (http, a loopback host): no
    proxy (the environment's would see the request), no redirect (it could lead off the
    machine), the whole answer within ``FETCH_TIMEOUT_S`` and ``MAX_SOURCE_BYTES``."""
    import ipaddress
    import urllib.parse

    from safeview.errors import ManifestError
    from safeview.transfer.mooncake import store_request

    try:
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname or ""
        parts.port  # noqa: B018 - raises ValueError for a port that is not one
    except ValueError as error:
        raise ManifestError(_shown(url), None, f"is not a URL ({error})") from None
    if parts.scheme != "http":
        raise ManifestError(
            _shown(url), None, "is not an http:// URL of a metadata store on this machine"
        )
    try:
        loopback = host in _LOOPBACK_NAMES or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ManifestError(
            _shown(url),
            None,
            f"names host {_shown(host) or '(none)'}: only a store on this machine is read "
            "(127.0.0.1, ::1, localhost)",
        )
    try:
        answer = store_request(url, timeout_s=FETCH_TIMEOUT_S, max_bytes=MAX_SOURCE_BYTES)
    except TimeoutError as error:
        raise ManifestError(
            _shown(url),
            None,
            f"cannot be fetched: {error} (FETCH_TIMEOUT_S; a store answers at once)",
        ) from None
    except (OSError, ValueError) as error:
        reason = getattr(error, "strerror", None) or error
        raise ManifestError(_shown(url), None, f"cannot be fetched: {reason}") from None
    if answer.status == 200:
        return answer.body
    if answer.location is not None:
        where = _shown(answer.location)
        why = f"a redirect to {where!r}: not followed, it could lead off the machine"
    elif answer.status == 404:
        why = "nothing is stored under that key"
    else:
        why = answer.reason
    raise ManifestError(_shown(url), None, f"cannot be fetched: HTTP {answer.status} ({why})")


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
    parser.add_argument(
        "sender",
        metavar="SENDER",
        help="a manifest file (a manifest, its wire form, or a saved vLLM NIXL handshake "
        "payload), a folder of one engine's per-rank manifests, or a metadata-store URL on this "
        "machine (http://127.0.0.1:PORT/metadata?key=KEY); for P/D: the prefill side",
    )
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
