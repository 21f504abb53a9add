"""The digest's formula and its one value type (``safeview.manifest.digest`` says what it means
and is the module to import; every name here is re-exported there): the keys, the row weights,
``Digest`` and its wire form. No torch: ``safeview.manifest._digest_torch`` computes with these
on tensors, ``verify`` and the tests' oracle on Python ints.
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from safeview.errors import ManifestError

__all__ = [
    "DIGEST_CAP_BYTES",
    "DIGEST_SCHEME",
    "LANES",
    "MAX_PIECE_BYTES",
    "NO_HEAD",
    "PRIME",
    "Digest",
    "key",
    "layer_key",
    "piece_count",
    "row_weights",
]

DIGEST_SCHEME = "sv-digest-1"
PRIME = (1 << 31) - 1
"""The modulus of each lane: a Mersenne prime, so that a lane times a key fits in int64."""
LANES = 2
MAX_PIECE_BYTES = 1 << 15
"""A row longer than this is cut into equal pieces, each its own coordinate: ``R``'s lane
pairs stay distinct (254 * 254 of them) and ``int8 x int8`` sums stay exact in int32."""
DIGEST_CAP_BYTES = 4 << 20
"""The largest digest ``from_wire`` reads: 1,000 layers x 128 heads x 8 bytes, and room."""
_MAGIC = b"SVD1"
NO_HEAD = -1  # the head key of a layer without a head axis (an MLA latent, a Mamba state)


# -- the keys: one arithmetic for Python ints and torch int64 tensors ----------------------------

_SALT = (0x2545F491, 0x4F6CDD1D)  # per lane, below PRIME
_MULT = (0x5BD1E995 % PRIME, 0x27D4EB2F % PRIME)
_COORDS = {"layer": 1, "kv": 2, "token": 3, "head": 4, "piece": 5}


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
    number = int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "little")
    result: int = key(number % PRIME, "layer", lane)
    return result


def row_weights(length: int) -> list[tuple[int, int]]:
    """``R``: for byte ``j`` of a row (or piece) of ``length`` bytes, its two lane weights,
    int8 values in ``[-127, -1] u [1, 127]``, the pair different for every ``j`` (``j`` below
    254 * 254)."""
    if not 0 < length <= 254 * 254:
        raise ValueError(f"a row piece of {length} bytes is not in [1, {254 * 254}]")

    def signed(x: int) -> int:  # 254 values -> nonzero int8
        return x - 127 if x < 127 else x - 126

    return [
        (signed((j % 254 * 37 + 11) % 254), signed(((j // 254 + j) % 254 * 67 + 5) % 254))
        for j in range(length)
    ]


def piece_count(row_bytes: int) -> int:
    """Into how many equal pieces a row of ``row_bytes`` bytes is cut (1 for any real head)."""
    pieces = 1
    while row_bytes // pieces > MAX_PIECE_BYTES or row_bytes % pieces:
        pieces += 1
    return pieces


# -- the digest ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Digest:
    """One side's digest of one request: ``values[layer][head]`` (global KV head; ``-1`` for a
    layer without heads), a 62-bit int (lane 0 in the high 31 bits), over ``num_tokens``
    positions; ``tp_rank`` and ``tp_size`` of the rank that made it and the ``fingerprint`` of
    the manifest it read through (informative: two sides of one meaning have different
    manifests)."""

    num_tokens: int
    values: Mapping[str, Mapping[int, int]]
    tp_rank: int = 0
    tp_size: int = 1
    fingerprint: str = ""
    scheme: str = field(default=DIGEST_SCHEME)

    @property
    def layers(self) -> tuple[str, ...]:
        return tuple(self.values)

    def to_wire(self) -> bytes:
        """``SVD1``, the header's length, the zlib-compressed JSON header (scheme, tokens,
        rank, layer names, heads: once when every layer has the same), then 8 bytes per
        (layer, head), little-endian, in the header's order."""
        heads = [sorted(per) for per in self.values.values()]
        same = all(h == heads[0] for h in heads) if heads else True
        header: dict[str, Any] = {
            "scheme": self.scheme,
            "num_tokens": self.num_tokens,
            "tp_rank": self.tp_rank,
            "tp_size": self.tp_size,
            "fingerprint": self.fingerprint,
            "layers": list(self.values),
        }
        header["heads" if same else "layer_heads"] = heads[0] if same and heads else heads
        packed = zlib.compress(json.dumps(header, separators=(",", ":")).encode("utf-8"), 6)
        numbers = [self.values[layer][h] for layer, hs in zip(self.values, heads) for h in hs]
        return (
            _MAGIC
            + struct.pack("<I", len(packed))
            + packed
            + struct.pack(f"<{len(numbers)}Q", *numbers)
        )

    @classmethod
    def from_wire(cls, data: bytes, peer: str = "peer") -> Digest:
        """Read ``to_wire``'s bytes; ``ManifestError`` naming ``peer`` and the field for
        anything else: truncated, over ``DIGEST_CAP_BYTES``, another scheme, values that do
        not fit the header."""
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
        try:
            header = json.loads(zlib.decompress(data[8 : 8 + length]))
        except (zlib.error, ValueError) as error:
            raise ManifestError(
                f"{where} header", None, f"is not compressed JSON ({error})"
            ) from None
        if not isinstance(header, dict) or header.get("scheme") != DIGEST_SCHEME:
            scheme = header.get("scheme") if isinstance(header, dict) else None
            raise ManifestError(f"{where} scheme", scheme, f"is not {DIGEST_SCHEME!r}")
        try:
            layers = [str(name) for name in header["layers"]]
            if "heads" in header:
                heads = [[int(h) for h in header["heads"]] for _ in layers]
            else:
                heads = [[int(h) for h in hs] for hs in header["layer_heads"]]
            num_tokens, rank, size = (int(header[k]) for k in ("num_tokens", "tp_rank", "tp_size"))
            fingerprint = str(header.get("fingerprint", ""))
        except (KeyError, TypeError, ValueError) as error:
            raise ManifestError(f"{where} header", None, f"lacks or misstates {error}") from None
        if len(heads) != len(layers):
            raise ManifestError(f"{where} layer_heads", len(heads), f"are not {len(layers)} lists")
        count = sum(len(hs) for hs in heads)
        body = data[8 + length :]
        if len(body) != 8 * count:
            raise ManifestError(
                f"{where} values",
                len(body),
                f"bytes are not the {8 * count:,} its header announces ({count} values): "
                "truncated or padded",
            )
        numbers = iter(struct.unpack(f"<{count}Q", body))
        values = {layer: {h: next(numbers) for h in hs} for layer, hs in zip(layers, heads)}
        return cls(num_tokens, values, rank, size, fingerprint)
