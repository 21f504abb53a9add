"""The digest's formula and its one value type (``safeview.manifest.digest`` says what it means
and is the module to import; every name here is re-exported there): the keys, the row weights,
``Digest`` and its wire form. No torch: ``safeview.manifest._digest_torch`` computes with these
on tensors, ``verify`` and the tests' oracle on Python ints.

``from_wire`` reads what a peer sent, so it bounds the work before it does any: the payload
(``DIGEST_CAP_BYTES``), the header once inflated (``DIGEST_HEADER_CAP_BYTES``, inflated no
further), every field's type and range, and the header's count of values against the body's,
all before a value is built; anything else is one ``ManifestError`` naming the field.
"""

from __future__ import annotations

import functools
import hashlib
import json
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from safeview.errors import ManifestError
from safeview.manifest._model import MAX_BYTES, MAX_HEADS, MAX_RANKS
from safeview.spec import DTYPE_ITEMSIZE

__all__ = [
    "DIGEST_CAP_BYTES",
    "DIGEST_HEADER_CAP_BYTES",
    "DIGEST_SCHEME",
    "LANES",
    "MAX_CHUNKS",
    "MAX_PIECE_BYTES",
    "NO_HEAD",
    "PRIME",
    "WEIGHT_BOUND",
    "Digest",
    "chunk_tokens",
    "combine_lanes",
    "key",
    "layer_key",
    "piece_count",
    "row_weights",
    "type_key",
]

DIGEST_SCHEME = "sv-digest-3"
"""The formula's name, on the wire: ``sv-digest-3`` keys a token by its position in the
request (context parallelism included), weighs a row's bytes by weights of at most 64, and
adds values per (head, run of tokens); ``sv-digest-2`` (0.7) put each layer's element type into
its values, ``sv-digest-1`` did not. A peer of another scheme is refused by ``from_wire``, and
``verify`` compares no values of two schemes: their numbers mean different things."""
PRIME = (1 << 31) - 1
"""The modulus of each lane: a Mersenne prime, so that a lane times a key fits in int64."""
LANES = 2
MAX_PIECE_BYTES = 1 << 14
"""A row longer than this is cut into equal pieces, each its own coordinate: ``R``'s lane
pairs stay distinct (128 * 128 of them) and ``int8 x int8`` sums stay exact in int32."""
WEIGHT_BOUND = 64
"""``R``'s entries are in ``[-64, -1] u [1, 64]``: a pair of byte-times-weight products, with
the byte read as unsigned (0 to 255), stays inside int16 (``2 * 255 * 64 = 32,640``), so the
int8 kernels that add such pairs into int16 (oneDNN's on CPUs without VNNI) are exact
(issue 35)."""
DIGEST_CAP_BYTES = 4 << 20
"""The largest digest ``from_wire`` reads: 1,000 layers x 128 heads x 8 bytes, and room."""
DIGEST_HEADER_CAP_BYTES = 256 * 1024
"""The most a digest's header may inflate to (``from_wire`` inflates no further): 1,000 layers
named in 40 characters each, with their element types, is about 60 KB."""
MAX_CHUNKS = 64
"""A digest's token values cut the request into at most this many runs of tokens
(``chunk_tokens``)."""
_MAGIC = b"SVD1"
NO_HEAD = -1  # the head key of a layer without a head axis (an MLA latent, a Mamba state)


# -- the keys: one arithmetic for Python ints and torch int64 tensors ----------------------------

_SALT = (0x2545F491, 0x4F6CDD1D)  # per lane, below PRIME
_MULT = (0x5BD1E995 % PRIME, 0x27D4EB2F % PRIME)
_COORDS = {"layer": 1, "kv": 2, "token": 3, "head": 4, "piece": 5, "dtype": 6}


def key(value: Any, coordinate: str, lane: int) -> Any:
    """The key of coordinate ``value`` (a non-negative int below ``2**31``, or an int64 tensor
    of them) for ``coordinate`` and ``lane``: in ``[1, PRIME)``. The same formula runs on
    Python ints (``verify``'s oracle tests, the layer and head keys) and on tensors (the
    position keys of ``_digest_torch``): ``+``, ``*`` and ``%`` of non-negative operands below
    ``2**62``, exact in both."""
    salt = (_SALT[lane] + _COORDS[coordinate] * 0x9E3779B1) % PRIME
    x = (value + salt) % PRIME
    x = (x * x) % PRIME
    x = (x * _MULT[lane] + salt) % PRIME
    x = (x * x) % PRIME
    x = (x * _MULT[lane] + value) % PRIME
    return x % (PRIME - 1) + 1


def layer_key(name: str, lane: int) -> int:
    """A layer's key, from its name (layers are paired by name, never by position)."""
    return _name_key(name, "layer", lane)


def _name_key(text: str, coordinate: str, lane: int) -> int:
    number = int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "little")
    result: int = key(number % PRIME, coordinate, lane)
    return result


_TYPE_KEYS = {
    name: tuple(_name_key(name, "dtype", lane) for lane in range(LANES)) for name in DTYPE_ITEMSIZE
}


def type_key(dtype: str, lane: int) -> int:
    """An element type's key (torch's name: ``float8_e4m3fn``), the term a layer's values add
    for it: the same bytes under two element types give two values, whatever the bytes. Other
    meanings (a layer's parts: ``layer_meaning``) are keyed once and kept, up to 4,096."""
    found = _TYPE_KEYS.get(dtype)
    if found is None:
        if len(_TYPE_KEYS) > len(DTYPE_ITEMSIZE) + 4096:
            for name in [n for n in _TYPE_KEYS if n not in DTYPE_ITEMSIZE]:
                _TYPE_KEYS.pop(name, None)
        found = _TYPE_KEYS[dtype] = tuple(_name_key(dtype, "dtype", n) for n in range(LANES))
    return found[lane]


_MEANING_FIELDS = ("name", "role", "dtype", "granularity", "group_elements", "group_tokens",
                   "scales", "order", "kv", "tp")  # fmt: skip


def layer_meaning(layer: Any) -> str:
    """What a layer's values add for the meaning of its bytes, besides their place: its element
    type, and where the layer has parts (issue 37), each part's element type, role, scale
    granularity and order, its companions' and its scalars' values. A layer without parts,
    companions or scalars gives its element type's name, so its values are those of before.
    Offsets, lengths and a page-level part's index are left out: a byte's place is weighed by
    ``R`` and the keys of its token and head, and a page of another block size lays the same
    meaning out over other indices."""
    parts = getattr(layer, "parts", ())
    companions = getattr(layer, "companions", ())
    scalars = getattr(layer, "scalars", {})
    if not parts and not companions and not scalars:
        return str(layer.dtype)
    # parts and companions are frozen models of hashable fields: the cache's key
    return _meaning(str(layer.dtype), tuple(parts), tuple(companions), tuple(scalars.items()))


@functools.lru_cache(maxsize=256)
def _meaning(dtype: str, parts: tuple[Any, ...], companions: tuple[Any, ...],
             scalars: tuple[tuple[str, float], ...]) -> str:  # fmt: skip
    """``layer_meaning`` of a layer with parts, made once per distinct layer (a model's layers
    share a few)."""
    described = {
        "dtype": dtype,
        "parts": sorted(  # by name (unique in a layer): the parts, not the order listed
            ([getattr(part, f) for f in _MEANING_FIELDS] for part in parts), key=lambda p: p[0]
        ),
        "companions": [
            [c.name, c.role, c.dtype, c.granularity, c.group_elements] for c in companions
        ],
        "scalars": sorted((name, float(value).hex()) for name, value in scalars),
    }
    return json.dumps(described, sort_keys=True, separators=(",", ":"))


def row_weights(length: int) -> list[tuple[int, int]]:
    """``R``: for byte ``j`` of a row (or piece) of ``length`` bytes, its two lane weights,
    int8 values in ``[-64, -1] u [1, 64]`` (``WEIGHT_BOUND``), the pair different for every
    ``j`` (``j`` below 128 * 128)."""
    if not 0 < length <= 128 * 128:
        raise ValueError(f"a row piece of {length} bytes is not in [1, {128 * 128}]")

    def signed(x: int) -> int:  # 128 values -> nonzero, at most WEIGHT_BOUND in magnitude
        return x - 64 if x < 64 else x - 63

    return [
        (signed((j % 128 * 37 + 11) % 128), signed(((j // 128 + j) % 128 * 67 + 5) % 128))
        for j in range(length)
    ]


def piece_count(row_bytes: int) -> int:
    """Into how many equal pieces a row of ``row_bytes`` bytes is cut (1 for any real head)."""
    pieces = 1
    while row_bytes // pieces > MAX_PIECE_BYTES or row_bytes % pieces:
        pieces += 1
    return pieces


def chunk_tokens(num_tokens: int) -> int:
    """The tokens of one run of a digest's token values: 16, or the smallest power of two
    above it that cuts ``num_tokens`` into at most ``MAX_CHUNKS`` runs (both sides of one
    request cut it alike)."""
    tokens = 16
    while -(-num_tokens // tokens) > MAX_CHUNKS:
        tokens *= 2
    return tokens


def combine_lanes(values: Any) -> int:
    """Values of one coordinate from parts of the request's tokens (a context-parallel rank
    each), as one value: each lane the sum of the parts' lanes modulo ``PRIME`` (the formula
    is a sum over tokens, and only the rank at context-parallel position 0 adds the element
    type's key)."""
    high = low = 0
    for value in values:
        high = (high + (value >> 31)) % PRIME
        low = (low + (value & PRIME)) % PRIME
    return (high << 31) | low


# -- the digest ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Digest:
    """One side's digest of one request: ``values[layer][head]`` (global KV head; ``-1`` for a
    layer without heads), a 62-bit int (lane 0 in the high 31 bits), over ``num_tokens``
    positions; ``tp_rank`` and ``tp_size`` of the rank that made it and the ``fingerprint`` of
    the manifest it read through (informative: two sides of one meaning have different
    manifests); ``dtypes[layer]`` the element type each layer was read as (already in its
    values; said here so that a finding can name it; a layer may be absent).

    Under context parallelism a rank holds some of the request's tokens: ``cp_size``,
    ``cp_rank`` (``pcp_rank * dcp_size + dcp_rank``) and ``cp_interleave`` say which, and
    ``verify`` adds the values of a side's context-parallel ranks up (``combine_lanes``).
    ``tokens[head]``: per run of ``chunk_tokens(num_tokens)`` tokens of the request, the
    values of ``head`` over every layer of ``values`` (how ``verify`` names the first tokens
    that differ)."""

    num_tokens: int
    values: Mapping[str, Mapping[int, int]]
    tp_rank: int = 0
    tp_size: int = 1
    fingerprint: str = ""
    scheme: str = field(default=DIGEST_SCHEME)
    dtypes: Mapping[str, str] = field(default_factory=dict)
    cp_size: int = 1
    cp_rank: int = 0
    cp_interleave: int = 1
    tokens: Mapping[int, tuple[int, ...]] = field(default_factory=dict)

    @property
    def layers(self) -> tuple[str, ...]:
        return tuple(self.values)

    def to_wire(self) -> bytes:
        """``SVD1``, the header's length, the zlib-compressed JSON header (scheme, tokens,
        rank, layer names, each distinct list of heads once and per layer which where there
        are several, the element type once where every layer has the same, else per layer
        where known; the context-parallel split where there is one; the heads of the token
        values), then 8 bytes per (layer, head), little-endian, in the header's order, then 8
        per (head, run of tokens)."""
        heads = [sorted(per) for per in self.values.values()]
        head_sets: dict[tuple[int, ...], int] = {}  # each distinct list, and its index
        for hs in heads:
            head_sets.setdefault(tuple(hs), len(head_sets))
        header: dict[str, Any] = {
            "scheme": self.scheme,
            "num_tokens": self.num_tokens,
            "tp_rank": self.tp_rank,
            "tp_size": self.tp_size,
            "fingerprint": self.fingerprint,
            "layers": list(self.values),
            "heads": [list(hs) for hs in head_sets],
        }
        if len(head_sets) > 1:
            header["layer_heads"] = [head_sets[tuple(hs)] for hs in heads]
        dtypes = [self.dtypes.get(layer) for layer in self.values]
        if dtypes and None not in dtypes and len(set(dtypes)) == 1:
            header["dtype"] = dtypes[0]
        elif self.dtypes:
            header["dtypes"] = dtypes
        if self.cp_size > 1:
            header["cp"] = [self.cp_size, self.cp_rank, self.cp_interleave]
        token_heads = sorted(self.tokens)
        if token_heads:
            header["token_heads"] = token_heads
        packed = zlib.compress(json.dumps(header, separators=(",", ":")).encode("utf-8"), 6)
        numbers = [self.values[layer][h] for layer, hs in zip(self.values, heads) for h in hs]
        numbers += [value for h in token_heads for value in self.tokens[h]]
        return (
            _MAGIC
            + struct.pack("<I", len(packed))
            + packed
            + struct.pack(f"<{len(numbers)}Q", *numbers)
        )

    @classmethod
    def from_wire(cls, data: bytes, peer: str = "peer") -> Digest:
        """Read ``to_wire``'s bytes; ``ManifestError`` naming ``peer`` and the field for
        anything else: truncated, over ``DIGEST_CAP_BYTES``, a header that inflates past
        ``DIGEST_HEADER_CAP_BYTES`` or is nested past reading, another scheme, a field
        ``to_wire`` never writes (a key it does not know, a count or rank out of range, a layer
        named twice), values that do not fit the header. The work is bounded before it is
        done: a 4 MiB payload is read in milliseconds."""
        where = f"{peer}: digest"
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ManifestError(where, type(data).__name__, "is not bytes")
        data = bytes(data)
        if len(data) > DIGEST_CAP_BYTES:
            raise ManifestError(f"{where} size", len(data), f"is over {DIGEST_CAP_BYTES:,} bytes")
        if len(data) < 8 or data[:4] != _MAGIC:
            raise ManifestError(f"{where} magic", data[:4], f"is not {_MAGIC!r}: not a digest")
        (length,) = struct.unpack("<I", data[4:8])
        if 8 + length > len(data):
            raise ManifestError(
                f"{where} header", length, f"runs past the {len(data):,} bytes received: truncated"
            )
        header = _read_header(data[8 : 8 + length], where)
        layers, heads, dtypes, (num_tokens, rank, size, fingerprint) = _fields(header, where)
        cp_size, cp_rank, cp_interleave = _cp_fields(header, where)
        token_heads = _token_heads(header, where)
        runs = -(-num_tokens // chunk_tokens(num_tokens))
        # the values the header announces, counted before any is built
        count = sum(len(hs) for hs in heads)
        total = count + len(token_heads) * runs
        body = memoryview(data)[8 + length :]
        if len(body) != 8 * total:
            raise ManifestError(
                f"{where} values",
                len(body),
                f"bytes are not the {8 * total:,} its header announces ({total:,} values): "
                "truncated or padded",
            )
        numbers = struct.unpack(f"<{total}Q", body)
        if numbers and max(numbers) >= 1 << 62:
            raise ManifestError(f"{where} values", max(numbers), "is not a 62-bit digest value")
        values: dict[str, dict[int, int]] = {}
        at = 0
        for layer, hs in zip(layers, heads):
            values[layer] = dict(zip(hs, numbers[at : at + len(hs)]))
            at += len(hs)
        tokens = {h: tuple(numbers[at + i * runs : at + (i + 1) * runs]) for i, h in
                  enumerate(token_heads)}  # fmt: skip
        typed = {layer: t for layer, t in zip(layers, dtypes) if t is not None}
        return cls(
            num_tokens, values, rank, size, fingerprint, DIGEST_SCHEME, typed,
            cp_size, cp_rank, cp_interleave, tokens,
        )  # fmt: skip


_HEADER_KEYS = {
    "scheme", "num_tokens", "tp_rank", "tp_size", "fingerprint", "layers", "heads",
    "layer_heads", "dtype", "dtypes", "cp", "token_heads",
}  # fmt: skip
_MAX_TOKENS = MAX_BYTES


def _read_header(packed: bytes, where: str) -> dict[str, Any]:
    """The header as a dict, inflated at most to ``DIGEST_HEADER_CAP_BYTES`` (a payload that
    inflates further is refused at the cap, not inflated whole), read as JSON with no key given
    twice and no nesting past what the parser takes; its scheme checked first."""
    inflater = zlib.decompressobj()
    try:
        text = inflater.decompress(packed, DIGEST_HEADER_CAP_BYTES + 1)
    except zlib.error as error:
        raise ManifestError(f"{where} header", None, f"is not compressed ({error})") from None
    if len(text) > DIGEST_HEADER_CAP_BYTES:
        raise ManifestError(
            f"{where} header",
            None,
            f"inflates past {DIGEST_HEADER_CAP_BYTES:,} bytes (DIGEST_HEADER_CAP_BYTES; a header "
            f"of 1,000 layers is about 60 KB) from {len(packed):,} compressed: refused",
        )
    if not inflater.eof or inflater.unused_data:
        raise ManifestError(
            f"{where} header", None, "is not compressed whole (cut short, or other bytes follow)"
        )
    try:
        header = json.loads(text, object_pairs_hook=_no_twice)
    except ValueError as error:  # JSONDecodeError and UnicodeDecodeError among them
        raise ManifestError(f"{where} header", None, f"is not JSON ({error})") from None
    except RecursionError:
        raise ManifestError(
            f"{where} header", None, "is nested deeper than JSON is read: not a digest's header"
        ) from None
    if not isinstance(header, dict) or header.get("scheme") != DIGEST_SCHEME:
        scheme = header.get("scheme") if isinstance(header, dict) else None
        raise ManifestError(
            f"{where} scheme",
            scheme,
            f"is not {DIGEST_SCHEME!r}: the peer digests by another formula (another safeview "
            "release); its values cannot be compared with ours",
        )
    unknown = sorted(set(header) - _HEADER_KEYS)
    if unknown:
        raise ManifestError(f"{where} header", unknown, "are keys a digest's header never holds")
    return header


def _no_twice(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for name, value in pairs:
        if name in found:
            raise ValueError(f"the key {name!r} is given twice")
        found[name] = value
    return found


def _integer(value: Any, name: str, low: int, high: int) -> int:
    """``value`` if it is an int (not a bool) in ``[low, high)``, else ``ManifestError``."""
    if type(value) is not int or not low <= value < high:
        raise ManifestError(name, value, f"is not an integer in [{low:,}, {high:,})")
    return value


def _fields(
    header: dict[str, Any], where: str
) -> tuple[list[str], list[list[int]], list[str | None], tuple[int, int, int, str]]:
    """The header's fields checked against what ``to_wire`` writes: layer names (strings, each
    once), per layer its list of heads (``-1`` or a head below ``MAX_HEADS``, each once, in
    order) and element type (one safeview knows, or ``null``), the token count, rank and size
    (a rank of that size) and fingerprint."""
    missing = sorted({"num_tokens", "tp_rank", "tp_size", "layers", "heads"} - set(header))
    if missing:
        raise ManifestError(f"{where} header", missing, "are missing")
    num_tokens = _integer(header["num_tokens"], f"{where} num_tokens", 0, _MAX_TOKENS)
    size = _integer(header["tp_size"], f"{where} tp_size", 1, MAX_RANKS + 1)
    rank = _integer(header["tp_rank"], f"{where} tp_rank", 0, size)
    fingerprint = header.get("fingerprint", "")
    if not isinstance(fingerprint, str) or len(fingerprint) > 128:
        raise ManifestError(f"{where} fingerprint", fingerprint, "is not a fingerprint's text")
    layers = header["layers"]
    if not isinstance(layers, list) or not all(isinstance(name, str) for name in layers):
        raise ManifestError(f"{where} layers", layers, "is not a list of layer names")
    seen: set[str] = set()
    for name in layers:
        if name in seen:
            raise ManifestError(f"{where} layers", name, "is named twice: which values are its?")
        seen.add(name)
    head_sets = header["heads"]
    if not isinstance(head_sets, list) or not all(isinstance(hs, list) for hs in head_sets):
        raise ManifestError(f"{where} heads", head_sets, "is not a list of lists of heads")
    for at, hs in enumerate(head_sets):
        for head in hs:
            _integer(head, f"{where} heads[{at}]", NO_HEAD, MAX_HEADS)
        if hs != sorted(set(hs)):
            raise ManifestError(f"{where} heads[{at}]", hs, "is not its heads once each, in order")
    which = header.get("layer_heads", [0] * len(layers))
    if not isinstance(which, list) or len(which) != len(layers):
        raise ManifestError(
            f"{where} layer_heads", which, f"is not one index of heads per layer ({len(layers)})"
        )
    for at, index in enumerate(which):
        _integer(index, f"{where} layer_heads[{at}]", 0, len(head_sets))
    if "dtype" in header and "dtypes" in header:
        raise ManifestError(f"{where} header", "dtype", "and dtypes are both given")
    dtypes = header.get("dtypes", [header.get("dtype")] * len(layers))
    if not isinstance(dtypes, list) or len(dtypes) != len(layers):
        raise ManifestError(
            f"{where} dtypes", dtypes, f"is not one element type per layer ({len(layers)})"
        )
    for at, dtype in enumerate(dtypes):
        if dtype is not None and (not isinstance(dtype, str) or dtype not in DTYPE_ITEMSIZE):
            raise ManifestError(
                f"{where} dtypes[{at}]", dtype, "is not an element type safeview knows"
            )
    return layers, [head_sets[i] for i in which], dtypes, (num_tokens, rank, size, fingerprint)


def _cp_fields(header: dict[str, Any], where: str) -> tuple[int, int, int]:
    """The context-parallel split (``cp``: size, rank, interleave; none is ``1, 0, 1``)."""
    if "cp" not in header:
        return 1, 0, 1
    cp = header["cp"]
    if not isinstance(cp, list) or len(cp) != 3:
        raise ManifestError(f"{where} cp", cp, "is not [size, rank, interleave]")
    size = _integer(cp[0], f"{where} cp size", 2, MAX_RANKS + 1)
    rank = _integer(cp[1], f"{where} cp rank", 0, size)
    interleave = _integer(cp[2], f"{where} cp interleave", 1, MAX_BYTES)
    return size, rank, interleave


def _token_heads(header: dict[str, Any], where: str) -> list[int]:
    """The heads of the token values: ``-1`` or a head below ``MAX_HEADS``, each once, in
    order."""
    heads = header.get("token_heads", [])
    if not isinstance(heads, list):
        raise ManifestError(f"{where} token_heads", heads, "is not a list of heads")
    for head in heads:
        _integer(head, f"{where} token_heads", NO_HEAD, MAX_HEADS)
    if heads != sorted(set(heads)):
        raise ManifestError(f"{where} token_heads", heads, "is not its heads once each, in order")
    return heads
