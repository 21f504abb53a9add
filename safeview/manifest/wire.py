"""A manifest on the wire: what one engine's rank sends another over the channels they already
share (vLLM's NIXL handshake, Mooncake's metadata store), and the short token a request carries.

The wire form (``urn:safeview:manifest-wire:1``) is compact JSON, UTF-8: the topology, one
description per page shape (a ``Layer`` without its first byte), and each layer's name, page
and first byte, with the prefix and suffix every name shares written once; so a model of 100
identical layers costs a page and 100 short entries (about 2 KB for a vLLM model), not 100
pages. Its ``fingerprint`` is the ``Manifest``'s: the receiver recomputes it from what arrived
and refuses a payload whose layers are not the ones it claims (edited, truncated, forged).

``from_wire`` refuses, before anything is built, a payload larger than ``WIRE_CAP_BYTES``, one
that is not JSON, of another schema, with a key it does not know or a field of the wrong type:
always a ``ManifestError`` naming the peer and the field, never another exception.

A request carries only ``request_token``: ``sv1:RANK/SIZE:`` and the first 24 hex digits of
the sender rank's fingerprint (96 bits: no two layouts met in practice share them), which the
receiver compares with the manifests it has judged (``token_matches``); under context
parallelism ``cpPOSITION/SIZEiINTERLEAVE:`` comes before the digits (a token without it is
DCP = PCP = 1), so that a receiver refuses another token placement before it reads.
``check_transfer_params`` compares the TP size a request's ``kv_transfer_params`` claims with
the sender's own (vllm#47764).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

from safeview.errors import ManifestError
from safeview.manifest import Derived, Layer, Manifest, Topology
from safeview.manifest._model import MAX_BYTES, MAX_RANKS, _short, _validated

__all__ = [
    "TOKEN_PREFIX_HEX",
    "WIRE_CAP_BYTES",
    "WIRE_SCHEMA",
    "RequestToken",
    "check_transfer_params",
    "from_wire",
    "parse_request_token",
    "request_token",
    "to_wire",
    "token_matches",
]

WIRE_SCHEMA: Literal["urn:safeview:manifest-wire:1"] = "urn:safeview:manifest-wire:1"
# A real model's manifest is a few KB on the wire (100 layers of one page shape: ~2 KB; 1,000
# layers of four shapes: ~25 KB). The cap bounds what a peer can make the receiver parse.
WIRE_CAP_BYTES = 256 * 1024
TOKEN_PREFIX_HEX = 24
_TOKEN = re.compile(
    rf"sv1:(\d{{1,5}})/(\d{{1,5}}):(?:cp(\d{{1,5}})/(\d{{1,5}})i(\d{{1,9}}):)?"
    rf"([0-9a-f]{{{TOKEN_PREFIX_HEX}}})"
)
_KEYS = {"$schema", "fingerprint", "topology", "pages", "prefix", "suffix", "layers"}
_HEX64 = re.compile(r"[0-9a-f]{64}")


def _entries(manifest: Manifest | Derived) -> list[tuple[str, Layer, int]]:
    """Each layer's name, its page (a ``Layer`` of that shape) and its first byte."""
    if isinstance(manifest, Derived):
        return list(manifest._entries)
    if not isinstance(manifest, Manifest):
        raise ManifestError("manifest", type(manifest).__name__, "is not a Manifest or Derived")
    return [(name, layer, layer.byte_offset) for name, layer in manifest.layers.items()]


def _page_key(layer: Layer) -> tuple[Any, ...]:
    # everything a Layer holds but its first byte: layers of one key share a page on the wire
    return (
        layer.kind, layer.dtype, layer.group, layer.num_blocks, layer.block_stride_bytes,
        layer.page_bytes, layer.chunk_bytes, layer.axes, layer.heads, layer.parts,
        layer.companions, tuple(sorted(layer.scalars.items())),
    )  # fmt: skip


def _affixes(names: Sequence[str]) -> tuple[str, str]:
    """The prefix and suffix every name shares, not overlapping in the shortest name."""
    prefix = _common_start(names)
    room = min(len(name) for name in names) - len(prefix)
    suffix = _common_start([name[::-1] for name in names])[:room][::-1]
    return prefix, suffix


def _common_start(texts: Sequence[str]) -> str:
    """The characters every text starts with (layer names are not paths: by character)."""
    first, last = min(texts), max(texts)  # the others lie between them, so share as much
    end = 0
    while end < len(first) and first[end] == last[end]:
        end += 1
    return first[:end]


def to_wire(manifest: Manifest | Derived) -> bytes:
    """The wire form of ``manifest`` (see the module's docstring), UTF-8 JSON bytes.
    ``ManifestError`` when it holds no layer or is larger than ``WIRE_CAP_BYTES``."""
    entries = _entries(manifest)
    if not entries:
        raise ManifestError("manifest.layers", 0, "is empty: a manifest on the wire needs a layer")
    pages: dict[tuple[Any, ...], int] = {}
    page_texts: list[dict[str, Any]] = []
    rows: list[tuple[str, int, int]] = []
    for name, layer, at in entries:
        key = _page_key(layer)
        index = pages.get(key)
        if index is None:
            index = pages[key] = len(page_texts)
            page_texts.append(
                layer.model_dump(mode="json", exclude={"byte_offset"}, exclude_defaults=True)
            )
        rows.append((name, index, at))
    prefix, suffix = _affixes([name for name, _, _ in rows])
    cut = len(prefix)
    layers = [[name[cut : len(name) - len(suffix)], index, at] for name, index, at in rows]
    document = {
        "$schema": WIRE_SCHEMA,
        "fingerprint": manifest.fingerprint,
        "topology": manifest.topology.model_dump(mode="json", exclude_defaults=True),
        "pages": page_texts,
        "prefix": prefix,
        "suffix": suffix,
        "layers": layers,
    }
    text = json.dumps(document, separators=(",", ":"), ensure_ascii=False)
    try:
        data = text.encode()
    except UnicodeEncodeError as error:  # a lone surrogate in a layer's name
        raise ManifestError(
            "manifest.layers", _short(text[error.start : error.end + 40]), "is not UTF-8 text"
        ) from None
    if len(data) > WIRE_CAP_BYTES:
        raise ManifestError(
            "manifest on the wire",
            f"{len(data):,} bytes",
            f"is more than the {WIRE_CAP_BYTES:,} bytes (WIRE_CAP_BYTES) a receiver reads",
        )
    return data


def _size(data: bytes | str) -> int:
    if isinstance(data, bytes):
        return len(data)
    if len(data) > WIRE_CAP_BYTES:  # each character is a byte or more: no need to encode
        return len(data)
    return len(data.encode("utf-8", "surrogatepass"))


def _loaded(data: object, peer: str) -> dict[str, Any]:
    """The payload's JSON object, after its size and syntax are checked."""
    if isinstance(data, (bytearray, memoryview)):
        data = bytes(data)
    if not isinstance(data, (bytes, str)):
        raise ManifestError(
            f"{peer}: manifest on the wire", type(data).__name__, "is not bytes or str"
        )
    size = _size(data)
    if size > WIRE_CAP_BYTES:
        raise ManifestError(
            f"{peer}: manifest on the wire",
            f"{size:,} bytes",
            f"is more than the {WIRE_CAP_BYTES:,} bytes (WIRE_CAP_BYTES) a receiver reads",
        )
    try:
        # UTF-8 only (json.loads would guess UTF-16 or UTF-32 from bytes)
        document = json.loads(data.decode("utf-8") if isinstance(data, bytes) else data)
    except (ValueError, UnicodeDecodeError) as error:  # truncated, garbled, not UTF-8
        raise ManifestError(
            f"{peer}: manifest on the wire", _short(data), f"is not JSON ({error})"
        ) from None
    except RecursionError:
        raise ManifestError(
            f"{peer}: manifest on the wire", _short(data), "nests deeper than JSON can be read"
        ) from None
    if not isinstance(document, dict):
        raise ManifestError(
            f"{peer}: manifest on the wire", type(document).__name__, "is not a JSON object"
        )
    schema = document.get("$schema")
    if schema != WIRE_SCHEMA:
        shown = schema if isinstance(schema, (str, int, float, type(None))) else type(schema)
        raise ManifestError(f"{peer}: $schema", shown, f"is not {WIRE_SCHEMA!r}")
    unknown = sorted(str(key) for key in document if key not in _KEYS)
    missing = sorted(_KEYS - set(document))
    if unknown:
        raise ManifestError(f"{peer}: {unknown[0]}", None, "is a key this version does not know")
    if missing:
        raise ManifestError(f"{peer}: {missing[0]}", None, "is missing")
    return document


def _field(peer: str, field: str, value: Any, kind: type, what: str) -> Any:
    if not isinstance(value, kind) or isinstance(value, bool):
        shown = value if isinstance(value, (str, int, float, type(None))) else type(value).__name__
        raise ManifestError(f"{peer}: {field}", shown, f"is not {what}")
    return value


def _checked(model: type[Any], data: dict[str, Any], where: str) -> Any:
    """``model`` validated from ``data``; a refusal of the whole (a rank not below its TP size)
    names ``where`` itself."""
    try:
        return _validated(model, data, where, ".")
    except ManifestError as error:
        if not error.field.endswith(".(manifest)"):
            raise
        raise ManifestError(where, error.value, error.limit) from None


def _extent(layer: Layer) -> int:
    """The last byte a layer at first byte 0 reaches, plus one."""
    last = max(layer.num_blocks - 1, 0) * layer.block_stride_bytes
    return last + sum((axis.size - 1) * axis.stride_bytes for axis in layer.axes) + layer.itemsize


def from_wire(data: bytes | str, *, peer: str) -> Manifest:
    """The ``Manifest`` a peer sent (``to_wire``'s form). ``peer`` names it in every error (an
    engine id, a rank, the channel): ``ManifestError`` naming the peer and the field for a
    payload that is truncated, not JSON, over ``WIRE_CAP_BYTES``, of another schema version,
    forged (its fingerprint is not that of its layers) or has a field of the wrong kind."""
    document = _loaded(data, peer)
    fingerprint = _field(peer, "fingerprint", document["fingerprint"], str, "a str")
    if not _HEX64.fullmatch(fingerprint):
        raise ManifestError(f"{peer}: fingerprint", fingerprint, "is not 64 hex digits")
    topology_data = _field(peer, "topology", document["topology"], dict, "a JSON object")
    topology: Topology = _checked(Topology, topology_data, f"{peer}: topology")
    prefix = _field(peer, "prefix", document["prefix"], str, "a str")
    suffix = _field(peer, "suffix", document["suffix"], str, "a str")
    pages_data = _field(peer, "pages", document["pages"], list, "a JSON array")
    pages: list[tuple[Layer, int]] = []
    for index, page in enumerate(pages_data):
        where = f"pages[{index}]"
        _field(peer, where, page, dict, "a JSON object")
        if "byte_offset" in page:
            raise ManifestError(f"{peer}: {where}.byte_offset", None, "is given per layer")
        layer: Layer = _checked(Layer, {**page, "byte_offset": 0}, f"{peer}: {where}")
        pages.append((layer, _extent(layer)))
    rows = _field(peer, "layers", document["layers"], list, "a JSON array")
    if not rows:
        raise ManifestError(f"{peer}: layers", [], "is empty: a manifest needs a layer")
    entries: list[tuple[str, Layer, int]] = []
    seen: set[str] = set()
    for index, row in enumerate(rows):
        where = f"layers[{index}]"
        if not isinstance(row, list) or len(row) != 3:
            shown = _short(json.dumps(row)) if isinstance(row, list) else type(row).__name__
            raise ManifestError(f"{peer}: {where}", shown, "is not [name, page, first byte]")
        middle = _field(peer, f"{where}[0]", row[0], str, "a str (the layer's name)")
        page_at = _field(peer, f"{where}[1]", row[1], int, "an int (a page's index)")
        offset = _field(peer, f"{where}[2]", row[2], int, "an int (the layer's first byte)")
        if not 0 <= page_at < len(pages):
            raise ManifestError(
                f"{peer}: {where}[1]", page_at, f"is no page's index (0 to {len(pages) - 1})"
            )
        template, extent = pages[page_at]
        if offset < 0 or offset + extent > MAX_BYTES:
            raise ManifestError(
                f"{peer}: {where}[2]", offset, "puts the layer outside the 2**62 bytes a "
                "manifest can address"
            )  # fmt: skip
        name = f"{prefix}{middle}{suffix}"
        try:
            name.encode()
        except UnicodeEncodeError:  # a lone surrogate, escaped in the JSON: no name to send on
            raise ManifestError(f"{peer}: {where}[0]", name, "is not UTF-8 text") from None
        if name in seen:
            raise ManifestError(f"{peer}: {where}[0]", name, "names a layer a second time")
        seen.add(name)
        entries.append((name, template, offset))
    try:  # the topology against the layers: a stage per layer, an interleave that divides
        derived = Derived(topology, entries)
    except ManifestError as error:
        raise ManifestError(f"{peer}: {error.field}", error.value, error.limit) from None
    if derived.fingerprint != fingerprint:
        raise ManifestError(
            f"{peer}: fingerprint",
            f"{fingerprint[:12]}...",
            f"is not that of the layers sent ({derived.fingerprint[:12]}...): edited, "
            "truncated or forged",
        )
    return derived.manifest()


class RequestToken(NamedTuple):
    """What a request's token says: the sender's TP rank and size, the first
    ``TOKEN_PREFIX_HEX`` hex digits of that rank's manifest fingerprint, and its token
    placement (context-parallel position and size, interleave: 0, 1, 1 without)."""

    tp_rank: int
    tp_size: int
    fingerprint_prefix: str
    cp_rank: int = 0
    cp_size: int = 1
    interleave: int = 1


def request_token(manifest: Manifest | Derived) -> str:
    """``sv1:RANK/SIZE:`` and the first 24 hex digits of ``manifest``'s fingerprint (about 33
    characters), for a request's ``kv_transfer_params``."""
    topology = manifest.topology
    prefix = manifest.fingerprint[:TOKEN_PREFIX_HEX]
    placement = ""
    if topology.cp_size > 1:
        placement = (
            f"cp{topology.cp_rank}/{topology.cp_size}i{topology.cp_kv_cache_interleave_size}:"
        )
    return f"sv1:{topology.tp_rank}/{topology.tp_size}:{placement}{prefix}"


def parse_request_token(text: object, *, peer: str) -> RequestToken:
    """The token a request carried; ``ManifestError`` naming the peer and the field for anything
    that is not one ``request_token`` writes (another version, a rank not below its size)."""
    if not isinstance(text, str):
        shown = text if isinstance(text, (int, float, type(None))) else type(text).__name__
        raise ManifestError(f"{peer}: request token", shown, "is not a str")
    match = _TOKEN.fullmatch(text)
    if match is None:
        raise ManifestError(
            f"{peer}: request token",
            _short(text),
            f"is not 'sv1:RANK/SIZE:' and {TOKEN_PREFIX_HEX} hex digits",
        )
    rank, size = int(match.group(1)), int(match.group(2))
    if not 1 <= size <= MAX_RANKS or rank >= size:
        raise ManifestError(
            f"{peer}: request token", text, f"holds rank {rank} of TP {size}: not a rank of it"
        )
    if match.group(3) is None:
        return RequestToken(rank, size, match.group(6))
    cp_rank, cp_size, interleave = (int(match.group(at)) for at in (3, 4, 5))
    if not 2 <= cp_size <= MAX_RANKS or cp_rank >= cp_size or interleave < 1:
        raise ManifestError(
            f"{peer}: request token",
            text,
            f"holds context-parallel position {cp_rank} of {cp_size}, interleave "
            f"{interleave}: not a position of it",
        )
    return RequestToken(rank, size, match.group(6), cp_rank, cp_size, interleave)


def token_matches(token: RequestToken, manifest: Manifest | Derived) -> bool:
    """Whether ``token`` stands for ``manifest``: its rank, TP size and fingerprint."""
    topology = manifest.topology
    return (
        token.tp_rank == topology.tp_rank
        and token.tp_size == topology.tp_size
        and (token.cp_rank, token.cp_size) == (topology.cp_rank, topology.cp_size)
        and (token.cp_size == 1 or token.interleave == topology.cp_kv_cache_interleave_size)
        and manifest.fingerprint.startswith(token.fingerprint_prefix)
    )


def check_transfer_params(params: object, token: RequestToken) -> str | None:
    """Why a request's ``kv_transfer_params`` cannot be trusted to place its pages, or
    ``None``: its ``tp_size`` (the sender's TP size, which the receiver's rank mapping reads)
    is not the sender's own, as its token says. vllm#47764: a proxy left ``tp_size`` at its
    default 1 and all 8 P ranks wrote into D rank 0."""
    if not isinstance(params, dict):
        return f"kv_transfer_params is a {type(params).__name__}, not a mapping"
    for key in ("tp_size",):
        claimed = params.get(key)
        if claimed is None:
            continue
        if isinstance(claimed, bool) or not isinstance(claimed, int):
            return f"kv_transfer_params[{key!r}] is {claimed!r}, not a TP size"
        if claimed != token.tp_size:
            return (
                f"kv_transfer_params[{key!r}] is {claimed}, but the sender rank "
                f"{token.tp_rank} runs TP {token.tp_size}: pages would be placed for TP "
                f"{claimed}"
            )
    return None
