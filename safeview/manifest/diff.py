"""Will two parties read the same bytes the same way? ``diff`` pairs two manifests' layers by
name and, for every receiver page byte a transfer fills, compares what the sender meant there
with what the receiver reads it as; it names the first byte that differs::

    report = safeview.diff(prefill_manifests, decode_manifests, rule="vllm_nixl")
    report.compatible        # False
    report.findings[0].message
    # "layers.3: receiver page byte 4096 reads K token 8 head 0 element 0, the sender wrote
    #  V token 0 head 0 element 0 there"

Rules (how bytes move): ``page_copy`` (block ``b``'s page, chunk by chunk, into block ``b``),
``vllm_nixl`` (vLLM 0.33's NIXL connector, heterogeneous TP and block tokens included: see
``safeview.manifest._nixl_rules``), ``in_place`` (the receiver reads the sender's memory where it
lies: a connector's assumed format against the engine's cache). A page is compared once per distinct
pair of layouts, vectorised over its bytes with numpy; no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from safeview.errors import ArgumentError, LayoutMismatchError, ManifestError
from safeview.findings import Finding
from safeview.manifest import (
    CONNECTOR_RULES,
    Layer,
    Manifest,
    Topology,
    _nixl_rules,
    token_positions,
)
from safeview.manifest._formats import FORMATS
from safeview.manifest._parts import PART_DTYPE_ITEMSIZE, part_code, part_of_code, swizzled

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    Array = npt.NDArray[np.int64]

__all__ = ["DIFF_SCHEMA", "RULES", "DiffReport", "Meaning", "Mismatch", "diff"]


@dataclass(frozen=True)
class Meaning:
    """What one byte means to one side: K or V (``kv`` 0 or 1, None for a latent or state
    byte), token in the receiver's block, global head (None for a latent), element, byte of
    the element; ``status`` ``padding`` for a byte no axis reaches, ``outside`` for one past
    the page (another block's, another layer's); ``block`` under ``in_place``."""

    status: Literal["data", "padding", "outside", "unfilled"]
    kv: int | None = None
    token: int | None = None
    head: int | None = None
    element: int | None = None
    byte: int = 0
    block: int | None = None
    dtype: str | None = None
    part: str | None = None
    role: str | None = None

    def words(self) -> str:
        if self.status == "padding":
            return "padding"
        if self.status == "outside":
            return "a byte outside its page"
        if self.status == "unfilled":
            return "nothing (the transfer never fills it)"
        parts = [] if self.block is None else [f"block {self.block}"]
        if self.kv is not None:
            parts.append("KV"[self.kv])
        parts.append(f"token {self.token}")
        if self.head is not None:
            parts.append(f"head {self.head}")
        if self.part is not None:  # a layer with parts: which part, of which element type
            parts.append(f"{self.part} ({self.dtype})")
        parts.append(f"{'group' if self.role == 'scale' else 'element'} {self.element}")
        if self.byte:
            parts.append(f"byte {self.byte}")
        return " ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "block": self.block,
            "kv": None if self.kv is None else "KV"[self.kv],
            "token": self.token,
            "head": self.head,
            "element": self.element,
            "byte": self.byte,
            "dtype": self.dtype,
            "part": self.part,
            "words": self.words(),
        }


DIFF_SCHEMA = "urn:safeview:diff:1"
Rule = Literal["page_copy", "vllm_nixl", "in_place"]
RULES: tuple[Rule, ...] = ("page_copy", "vllm_nixl", "in_place")
MismatchKind = Literal["byte", "dtype", "missing_layer", "missing_rank", "refused"]
_FIELDS = ("status", "block", "kv", "token", "head", "element", "byte", "part")
_DATA, _PADDING, _OUTSIDE, _UNFILLED = 0, 1, 2, 3


Mismatch = Finding
"""A diff finding is a ``safeview.Finding`` of one of ``DIFF_KINDS`` (``Mismatch`` is the name it
had before: ``kind``, ``layer``, ``message``, ``byte``, ``block``, ``receiver_rank``,
``sender_ranks``, ``receiver_reads``, ``sender_wrote``, ``to_json()``)."""


@dataclass(frozen=True)
class DiffReport:
    """The verdict: ``compatible`` when every paired layer's filled bytes mean the same to both
    sides and nothing is missing; ``findings`` otherwise; ``layers`` the names compared;
    ``skipped`` layers not judged, with why; ``rule_from`` why this rule (``given``, or the
    connector the manifests name, or ``default``); ``sender_ranks`` and ``receiver_ranks`` the
    TP ranks judged, of ``sender_tp_size`` and ``receiver_tp_size``."""

    rule: Rule
    findings: tuple[Finding, ...]
    layers: tuple[str, ...]
    sender_fingerprints: tuple[str, ...]
    receiver_fingerprints: tuple[str, ...]
    skipped: dict[str, str] = field(default_factory=dict)
    rule_from: str = "given"
    sender_ranks: tuple[int, ...] = (0,)
    receiver_ranks: tuple[int, ...] = (0,)
    sender_tp_size: int = 1
    receiver_tp_size: int = 1

    def ranks(self) -> str:
        """The ranks judged, in words: ``sender ranks 0-1 of TP 2, receiver rank 0 of TP 4``."""
        return f"{_ranks_words('sender', self.sender_ranks, self.sender_tp_size)}, " + (
            _ranks_words("receiver", self.receiver_ranks, self.receiver_tp_size)
        )

    @property
    def compatible(self) -> bool:
        return not self.findings

    def raise_for_mismatch(self) -> None:
        """``LayoutMismatchError`` naming the first finding's layer and byte, if any."""
        if self.findings:
            raise LayoutMismatchError(self)

    def to_json(self) -> dict[str, Any]:
        return {
            "$schema": DIFF_SCHEMA,
            "rule": self.rule,
            "rule_from": self.rule_from,
            "verdict": "compatible" if self.compatible else "mismatch",
            "sender_ranks": list(self.sender_ranks),
            "sender_tp_size": self.sender_tp_size,
            "receiver_ranks": list(self.receiver_ranks),
            "receiver_tp_size": self.receiver_tp_size,
            "layers_compared": len(self.layers),
            "sender_fingerprints": list(self.sender_fingerprints),
            "receiver_fingerprints": list(self.receiver_fingerprints),
            "skipped": dict(self.skipped),
            "findings": [finding.to_json() for finding in self.findings],
        }


def _ranks_words(side: str, ranks: tuple[int, ...], tp_size: int) -> str:
    if len(ranks) == 1:
        return f"{side} rank {ranks[0]} of TP {tp_size}"
    if list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
        return f"{side} ranks {ranks[0]}-{ranks[-1]} of TP {tp_size}"
    return f"{side} ranks {', '.join(map(str, ranks))} of TP {tp_size}"


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy is there wherever torch is
        raise ArgumentError(
            "safeview.diff needs numpy, which is not installed; install it with "
            "pip install numpy (from a checkout of safeview: pip install -e '.[diff]')"
        ) from None
    return numpy


# -- what each page byte means --------------------------------------------------------------


def _decode_page(
    layer: Layer,
    k: Array,
    token_base: Array | int = 0,
    tokens: Tokens | None = None,
    tp: tuple[int, int] = (0, 1),
) -> dict[str, Array]:
    """Per page byte ``k`` (an array): its meaning, as arrays named after ``_FIELDS``; with
    ``tokens`` (each local slot's token position, context parallelism), the token is that
    position, plus ``token_base``; ``tp`` (rank, size) places a state's split segments."""
    np = _numpy()
    status = np.where((k >= 0) & (k < layer.page_bytes), _DATA, _OUTSIDE).astype(np.int64)
    safe = np.where(status == _DATA, k, 0)
    chunk = max(layer.chunk_bytes, 1)
    chunk_index, rest = np.divmod(safe, chunk)
    values = {name: np.zeros_like(k) for name in ("kv", "token", "head", "element")}
    outer = [axis for axis in layer.axes if axis.outer]
    for axis in reversed(outer):  # mixed radix: the innermost outer axis varies fastest
        chunk_index, values[axis.axis] = np.divmod(chunk_index, axis.size)
    for axis in layer.axes:
        if axis.outer or axis.size == 1:
            continue
        index, rest = np.divmod(rest, axis.stride_bytes)
        status = np.where((status == _DATA) & (index >= axis.size), _PADDING, status)
        values[axis.axis] = index
    status = np.where((status == _DATA) & (rest >= layer.itemsize), _PADDING, status)
    if layer.parts:
        part, rest, status = _decode_parts(layer, values, rest, status, tp)
    else:
        part = np.full_like(k, part_code("data", "data", layer.dtype))
    kv = values["kv"] if any(a.axis == "kv" for a in layer.axes) else np.full_like(k, 2)
    if layer.heads:
        table = np.asarray(layer.heads, dtype=np.int64)
        head = table[np.clip(values["head"], 0, len(table) - 1)]
    else:
        head = np.full_like(k, -1)
    data = status == _DATA
    token = values["token"]
    if tokens is not None:
        table = np.asarray(tokens, dtype=np.int64)
        token = table[np.clip(token, 0, len(table) - 1)]
    return {
        "status": status,
        "block": np.zeros_like(k),
        "kv": np.where(data, kv, 0),
        "token": np.where(data, token + token_base, 0),
        "head": np.where(data, head, 0),
        "element": np.where(data, values["element"], 0),
        "byte": np.where(data, rest, 0),
        "part": np.where(data, part, -1),
    }


def _decode_parts(
    layer: Layer, values: dict[str, Array], rest: Array, status: Array, tp: tuple[int, int]
) -> tuple[Array, Array, Array]:
    """A row's bytes by part (``layer.parts``): which part each is in (its code), its element
    (a scale's: the group it scales, in the order the part is stored), its byte; a part's
    ``index`` names the (K/V, token, head, element) of each of its elements; a split segment's
    element is its global one (``tp``: this rank of how many). Bytes in no part, or in a
    ``pad`` part, are padding."""
    np = _numpy()
    row = values["element"] * layer.itemsize + rest
    part = np.full_like(row, -1)
    byte = np.zeros_like(row)
    element = np.zeros_like(row)
    overrides = {name: values[name].copy() for name in ("kv", "token", "head")}
    tokens = layer.size_of("token")
    for each in layer.parts:
        relative = row - each.offset_bytes
        if each.count > 1:
            run, within = np.divmod(np.maximum(relative, 0), each.stride_bytes)
            inside = (relative >= 0) & (run < each.count) & (within < each.length_bytes)
        else:
            run, within = np.zeros_like(row), relative
            inside = (relative >= 0) & (relative < each.length_bytes)
        if each.kv is not None:
            inside &= values["kv"] == each.kv
        if not inside.any():
            continue
        unit = PART_DTYPE_ITEMSIZE[each.dtype]
        per_run = each.length_bytes // unit
        local = run * per_run + within // unit
        found = {"element": local}
        if each.index is not None:
            left = local
            for axis, size in reversed(each.index):  # the head: local, as the page's own
                left, found[axis] = np.divmod(left, size)
        if each.order != "linear":
            token = found.get("token", overrides["token"])
            per_row = each.index[-1][1] if each.index is not None else per_run
            found["token"], found["element"] = swizzled(
                each.order, token, found["element"], tokens, per_row
            )
        if each.tp in ("heads", "segment") and tp[1] > 1 and each.index is not None:
            width = dict(each.index).get("element", 1)  # this rank's share of the axis
            found["element"] = tp[0] * width + found["element"]
        elif each.tp in ("heads", "segment") and tp[1] > 1:
            outer, inner = np.divmod(local, per_run)
            found["element"] = outer * per_run * tp[1] + tp[0] * per_run + inner
        part = np.where(inside, part_code(each.name, each.role, each.dtype), part)
        byte = np.where(inside, within % unit, byte)
        element = np.where(inside, found["element"], element)
        for name in ("kv", "token", "head"):
            if name in found:
                overrides[name] = np.where(inside, found[name], overrides[name])
        if each.role == "pad":
            status = np.where(inside, _PADDING, status)
    status = np.where((status == _DATA) & (part < 0), _PADDING, status)
    values["element"] = element
    values.update(overrides)
    return part, byte, status


def _decode_address(layer: Layer, address: Array) -> dict[str, Array]:
    """Per storage byte (an array): which block and which page byte it is to ``layer``."""
    np = _numpy()
    relative = address - layer.byte_offset
    status = np.where(relative >= 0, _DATA, _OUTSIDE)
    rest = np.where(relative >= 0, relative, 0)
    chunk_index = np.zeros_like(rest)
    for axis in (a for a in layer.axes if a.outer):
        index, rest = np.divmod(rest, axis.stride_bytes)
        status = np.where(index >= axis.size, _OUTSIDE, status)
        chunk_index = chunk_index * axis.size + index
    stride = max(layer.block_stride_bytes, 1)
    block, inner = np.divmod(rest, stride) if layer.num_blocks > 1 else (rest * 0, rest)
    status = np.where((block >= layer.num_blocks) | (inner >= layer.chunk_bytes), _OUTSIDE, status)
    page = np.where(status == _DATA, chunk_index * layer.chunk_bytes + inner, -1)
    meaning = _decode_page(layer, page)
    meaning["status"] = np.where(status == _DATA, meaning["status"], _OUTSIDE)
    meaning["block"] = np.where(status == _DATA, block, 0)
    return meaning


def _meaning_at(fields: dict[str, Array], at: int, layer: Layer, with_block: bool) -> Meaning:
    status = int(fields["status"][at])
    if status != _DATA:
        words = {_PADDING: "padding", _OUTSIDE: "outside", _UNFILLED: "unfilled"}
        return Meaning(words[status], dtype=layer.dtype)  # type: ignore[arg-type]
    kv = int(fields["kv"][at])
    head = int(fields["head"][at])
    name, role, dtype = part_of_code(int(fields["part"][at]))
    return Meaning(
        "data",
        kv=None if kv == 2 else kv,
        token=int(fields["token"][at]),
        head=None if head < 0 else head,
        element=int(fields["element"][at]),
        byte=int(fields["byte"][at]),
        block=int(fields["block"][at]) if with_block else None,
        dtype=dtype,
        part=name if layer.parts else None,
        role=role if layer.parts else None,
    )


# -- comparing one layer's pages, once per distinct pair of layouts --------------------------

_Result = tuple[int, Meaning, Meaning, int] | None  # receiver byte, both meanings, block
# where each side's tokens lie, under context parallelism: the receiver's slot -> position
# table and first position, the sender's the same (``None``: identity, position 0)
Tokens = tuple[int, ...]
_TokenPlaces = tuple[Tokens | None, int, Tokens | None, int]
# each side's (TP rank, TP size), where a state's segments are split by TP
_Tps = tuple[tuple[int, int], tuple[int, int]]


def _first_difference(
    receiver: Layer, received: dict[str, Array], sent: dict[str, Array], sender: Layer
) -> _Result:
    np = _numpy()
    read = received["status"] == _DATA
    differs = read & (sent["status"] != _DATA)
    for name in _FIELDS[1:]:
        differs |= read & (received[name] != sent[name])
    where = np.flatnonzero(differs)
    if not where.size:
        return None
    at = int(where[0])
    return at, _meaning_at(received, at, receiver, False), _meaning_at(sent, at, sender, False), 0


_CACHE: dict[tuple[Any, ...], _Result] = {}
_CACHE_SIZE = 4096


def _remembered(key: tuple[Any, ...], compute: Any) -> _Result:
    """A page comparison depends on the two layouts, not on the layer's name or where it lies:
    computed once per distinct pair (1,000 layers of one shape cost one comparison)."""
    if key in _CACHE:
        return _CACHE[key]
    if len(_CACHE) >= _CACHE_SIZE:
        _CACHE.clear()
    found: _Result = compute()
    _CACHE[key] = found
    return found


def _compare_pieces(
    receiver: Layer,
    senders: tuple[Layer, ...],
    pieces: tuple[_nixl_rules.Piece, ...],
    ratio: int,
    permute: bool,
    places: _TokenPlaces | None = None,
    tps: _Tps | None = None,
) -> _Result:
    if places is None and tps is None and _copied_whole(receiver, senders, pieces, ratio, permute):
        return None
    key = (
        "pieces",
        receiver.fingerprint,
        tuple(sender.fingerprint for sender in senders),
        tuple((p.receiver_start, p.length, p.sub_block, p.sender_start) for p in pieces),
        ratio,
        permute,
        places,
        tps,
    )
    return _remembered(
        key, lambda: _fill_and_compare(receiver, senders, pieces, ratio, permute, places, tps)
    )


def _copied_whole(
    receiver: Layer,
    senders: tuple[Layer, ...],
    pieces: tuple[_nixl_rules.Piece, ...],
    ratio: int,
    permute: bool,
) -> bool:
    """Whether the transfer is one whole page, unpermuted, from a sender layer of the same page
    meaning (fingerprint): receiver byte ``k`` then holds the sender's byte ``k``, which means
    what the receiver reads it as by construction (``_decode_page`` reads nothing but what the
    fingerprint hashes), so there is nothing to compare. The same reasoning as ``_pair``'s for a
    page copy; it spares a first judgement the decoding of two pages per distinct layout."""
    if ratio != 1 or permute or len(pieces) != 1:
        return False
    piece = pieces[0]
    return (
        piece.receiver_start == 0
        and piece.sender_start == 0
        and piece.sub_block == 0
        and piece.length == receiver.page_bytes
        and senders[0].fingerprint == receiver.fingerprint
    )


def _fill_and_compare(
    receiver: Layer,
    senders: tuple[Layer, ...],
    pieces: tuple[_nixl_rules.Piece, ...],
    ratio: int,
    permute: bool,
    places: _TokenPlaces | None = None,
    tps: _Tps | None = None,
) -> _Result:
    """Fill a receiver page from the senders' pages as ``pieces`` say (then permute, as vLLM's
    receive-side reorder does), and compare meanings byte by byte; with ``places``, tokens
    are compared by position (context parallelism)."""
    mine, mine_base, theirs, theirs_base = places or (None, 0, None, 0)
    mine_tp, theirs_tp = tps or ((0, 1), (0, 1))
    size = receiver.page_bytes
    for k in _slices(size):
        pre = k
        if permute:  # final [H, r * N_P, C] <- pre [r, H, N_P, C] (an HND page)
            heads, tokens = receiver.size_of("head"), receiver.size_of("token")
            row = size // max(heads * tokens, 1)
            sub = tokens // ratio
            head, rest = _numpy().divmod(k, tokens * row)
            token, column = _numpy().divmod(rest, row)
            j, t = _numpy().divmod(token, sub)
            pre = ((j * heads + head) * sub + t) * row + column
        sent = {name: _numpy().zeros_like(k) for name in _FIELDS}
        sent["status"] = _numpy().full_like(k, _UNFILLED)
        for piece, sender in zip(pieces, senders):
            mask = (pre >= piece.receiver_start) & (pre < piece.receiver_start + piece.length)
            source = pre[mask] - piece.receiver_start + piece.sender_start
            base = theirs_base + piece.sub_block * sender.size_of("token")
            decoded = _decode_page(sender, source, base, theirs, theirs_tp)
            for name in _FIELDS:
                sent[name][mask] = decoded[name]
        received = _decode_page(receiver, k, mine_base, mine, mine_tp)
        found = _first_difference(receiver, received, sent, senders[0])
        if found is not None:
            return (int(k[0]) + found[0], *found[1:])
    return None


# A page is compared a slice at a time: memory stays bounded (a Mamba page is a megabyte, its
# meanings seven arrays of it) and a mismatch early in the page ends the work there.
_SLICE_BYTES = 1 << 16


def _slices(size: int) -> Any:
    np = _numpy()
    for start in range(0, size, _SLICE_BYTES):
        yield np.arange(start, min(size, start + _SLICE_BYTES), dtype=np.int64)


def _placement(layer: Layer) -> tuple[Any, ...]:
    outer = tuple(axis.stride_bytes for axis in layer.axes if axis.outer)
    return (layer.fingerprint, layer.block_stride_bytes, layer.num_blocks, outer)


def _compare_in_place(receiver: Layer, sender: Layer, per_layer: bool) -> _Result:
    # where the receiver's layer starts in the sender's memory: at the sender layer's first
    # byte when the receiver is handed a tensor (a pointer) per layer, else as both say
    shift = 0 if per_layer else receiver.byte_offset - sender.byte_offset
    key = ("in_place", _placement(receiver), _placement(sender), shift)
    return _remembered(key, lambda: _read_in_place(receiver, sender, shift))


def _per_layer(manifest: Manifest) -> bool:
    """A side that reads or writes a list of per-layer tensors (``assumed("NL_X_...")``): each
    of its layers starts at the other side's layer's first byte, wherever that lies."""
    layout = manifest.topology.layout or ""
    named = FORMATS.get(layout)
    return layout.upper().startswith("NL_X_") or (named is not None and named.per_layer)


def _read_in_place(receiver: Layer, sender: Layer, shift: int) -> _Result:
    """The receiver reads the sender's memory where it lies: blocks 0, 1 and the last. The
    receiver's block 0 starts ``shift`` bytes after the sender's."""
    np = _numpy()
    blocks = sorted({0, min(1, receiver.num_blocks - 1), receiver.num_blocks - 1} - {-1})
    for block, k in ((b, k) for b in blocks for k in _slices(receiver.page_bytes)):
        chunk_index, inner = np.divmod(k, max(receiver.chunk_bytes, 1))
        address = sender.byte_offset + shift + block * receiver.block_stride_bytes + inner
        for axis in reversed([a for a in receiver.axes if a.outer]):
            chunk_index, index = np.divmod(chunk_index, axis.size)
            address = address + index * axis.stride_bytes
        received = _decode_page(receiver, k)
        received["block"] = np.full_like(k, block)
        sent = _decode_address(sender, address)
        found = _first_difference(receiver, received, sent, sender)
        if found is not None:
            at = found[0]
            return (
                int(k[0]) + at,
                _meaning_at(received, at, receiver, True),
                _meaning_at(sent, at, sender, True),
                block,
            )
    return None


# -- pairing ---------------------------------------------------------------------------------


def _ranks(side: Manifest | Sequence[Manifest], what: str) -> dict[int, Manifest]:
    manifests = [side] if isinstance(side, Manifest) else list(side)
    if not manifests:
        raise ManifestError(what, [], "holds no manifest")
    for manifest in manifests:
        if not isinstance(manifest, Manifest):
            raise ManifestError(what, type(manifest).__name__, "is not a Manifest")
    sizes = {m.topology.tp_size for m in manifests}
    if len(sizes) > 1:
        raise ManifestError(f"{what}.topology.tp_size", sorted(sizes), "differ within one side")
    by_rank: dict[int, Manifest] = {}
    for manifest in manifests:
        rank = manifest.topology.tp_rank
        if rank in by_rank:
            raise ManifestError(f"{what}.topology.tp_rank", rank, "appears twice on one side")
        by_rank[rank] = manifest
    return by_rank


def _block_contiguous(layer: Layer) -> bool:
    """Whether a page holds heads before tokens, read off its strides: what vLLM's rule goes
    by where the topology names no layout (``_nixl_rules.plan_layer`` reads one it names)."""
    order = [axis.axis for axis in layer.axes if axis.size > 1 and not axis.outer]
    return order[:2] == ["head", "token"] or (order[:1] == ["token"] and layer.size_of("head") == 1)


# A page is compared a slice at a time; past this, a diff would run for minutes (a real page,
# a Mamba state's included, is a few MiB at most)
MAX_PAGE_BYTES = 1 << 30


def _rule_of(
    rule: Rule | None, senders: dict[int, Manifest], receivers: dict[int, Manifest]
) -> tuple[Rule, str]:
    """The rule given; else that of the connector the manifests name (the receiver's first:
    it is the one that moves the bytes in, ``manifest.CONNECTOR_RULES``); else ``page_copy``."""
    if rule is not None:
        if rule not in RULES:
            raise ArgumentError(f"rule must be one of {', '.join(RULES)}; got {rule!r}")
        return rule, "given"
    for side in (receivers, senders):
        named = {m.topology.connector for m in side.values()} - {None}
        if len(named) == 1:
            connector = named.pop()
            found = CONNECTOR_RULES.get(str(connector))
            if found in RULES:
                return found, f"connector {connector}"
            return "page_copy", f"connector {connector}"
    return "page_copy", "default"


def _missing_ranks(
    given: Manifest | Sequence[Manifest], ranks: dict[int, Manifest], side: str
) -> list[Finding]:
    """A side given as a sequence is one engine's ranks: each rank its TP size declares and
    no manifest holds is a finding. A single ``Manifest`` is that rank alone (the vLLM plugin
    judges one decode rank at a time)."""
    if isinstance(given, Manifest):
        return []
    tp_size = next(iter(ranks.values())).topology.tp_size
    return [
        Finding.missing_rank(
            None,
            rank=rank,
            receiver_rank=rank if side == "receiver" else None,
            sender_ranks=(rank,) if side == "sender" else (),
            side=side,  # type: ignore[arg-type]
            tp_size=tp_size,
        )
        for rank in range(tp_size)
        if rank not in ranks
    ]


def _page_sizes(ranks: dict[int, Manifest], what: str) -> None:
    for manifest in ranks.values():
        for name, layer in manifest.layers.items():
            if layer.page_bytes > MAX_PAGE_BYTES:
                raise ManifestError(
                    f"{what}.layers[{name!r}].page_bytes",
                    layer.page_bytes,
                    f"is more than the {MAX_PAGE_BYTES:,} bytes a diff compares",
                )


def diff(
    sender: Manifest | Sequence[Manifest],
    receiver: Manifest | Sequence[Manifest],
    rule: Rule | None = None,
    *,
    by_position: bool = False,
) -> DiffReport:
    """Compare what a sender's bytes mean with what a receiver reads them as, layer by layer,
    by name; each side one manifest or one per TP rank (a sequence is one engine's ranks: a
    rank its TP size declares and none holds is a ``missing_rank`` finding). Without a
    ``rule``, the rule of the connector the manifests name (``topology.connector``), else
    ``page_copy``. Tokens are compared by position under context parallelism (each side's
    ``token_positions``), and layers by global index where both sides name it
    (``topology.stage_layers``). ``by_position``: the connector pairs the two sides'
    registered layers by position, not by name (sglang#37175): each position whose two layers
    are not one layer is a finding. See the module's docstring."""
    if rule is not None and rule not in RULES:
        raise ArgumentError(f"rule must be one of {', '.join(RULES)}; got {rule!r}")
    senders = _ranks(sender, "sender")
    receivers = _ranks(receiver, "receiver")
    rule, rule_from = _rule_of(rule, senders, receivers)
    _page_sizes(senders, "sender")
    _page_sizes(receivers, "receiver")
    sender_names = {name for m in senders.values() for name in m.layers}
    receiver_names = {name for m in receivers.values() for name in m.layers}
    common = sorted(sender_names & receiver_names)
    if not common:
        raise ManifestError(
            "layers",
            f"{len(sender_names)} and {len(receiver_names)} layers",
            "have no name in common",
        )
    findings = _missing_ranks(sender, senders, "sender")
    findings += _missing_ranks(receiver, receivers, "receiver")
    gone = {f.sender_ranks[0] for f in findings if f.receiver_rank is None}
    skipped: dict[str, str] = {}
    for name in sorted(sender_names - receiver_names):
        findings.append(Finding.missing_layer(name, side="sender"))
    for name in sorted(receiver_names - sender_names):
        findings.append(Finding.missing_layer(name, side="receiver"))
    single = len(senders) == 1 and len(receivers) == 1
    in_place_per_layer = any(_per_layer(m) for m in (*senders.values(), *receivers.values()))
    for rank, manifest in sorted(receivers.items()):
        source = next(iter(senders.values())) if single else senders.get(rank)
        source = source or next(iter(senders.values()))
        findings += _stage_findings(rank, manifest, source, by_position)
        if rule == "vllm_nixl":
            findings += _nixl_rank(rank, manifest, senders, skipped, gone)
            continue
        source = next(iter(senders.values())) if single else senders.get(rank)
        where = "" if single else f" (receiver rank {rank})"
        if source is None:
            if rank not in gone:  # a rank the sender's TP size does not reach
                findings.append(Finding.missing_rank(None, rank=rank, receiver_rank=rank))
            continue
        for name in sorted(manifest.layers):
            theirs = source.layers.get(name)
            if theirs is None:
                continue
            findings += _pair(
                name,
                manifest.layers[name],
                theirs,
                rule,
                where,
                rank,
                (source.topology.tp_rank,),
                in_place_per_layer,
                (manifest.topology, source.topology),
            )
    return DiffReport(
        rule,
        tuple(findings),
        tuple(common),
        tuple(m.fingerprint for _, m in sorted(senders.items())),
        tuple(m.fingerprint for _, m in sorted(receivers.items())),
        skipped,
        rule_from,
        tuple(sorted(senders)),
        tuple(sorted(receivers)),
        next(iter(senders.values())).topology.tp_size,
        next(iter(receivers.values())).topology.tp_size,
    )


def _pair(
    name: str,
    mine: Layer,
    theirs: Layer,
    rule: Rule,
    where: str,
    rank: int,
    sources: tuple[int, ...],
    per_layer: bool = False,
    topologies: tuple[Topology, Topology] | None = None,
) -> list[Finding]:
    spread = topologies is not None and max(t.cp_size for t in topologies) > 1
    tps = _segment_tps(mine, theirs, topologies)
    if mine.dtype != theirs.dtype and not (mine.parts or theirs.parts):
        dtype = Finding.diff_dtype(
            name,
            reads=mine.dtype,
            wrote=theirs.dtype,
            receiver_rank=rank,
            sender_ranks=sources,
            where=where,
        )
        return [dtype]
    if rule == "in_place":
        found = _compare_in_place(mine, theirs, per_layer)
    elif mine.fingerprint == theirs.fingerprint and not spread and tps is None:
        found = None  # the same meaning for every page byte: a page copy changes nothing
    else:
        length = min(mine.page_bytes, theirs.page_bytes)
        piece = _nixl_rules.Piece(0, length, sources[0], 0, 0)
        found = None
        # under context parallelism block b's tokens depend on b: blocks 0 and 1 are compared
        for block in (0, 1) if spread else (0,):
            places = None
            if spread and topologies is not None:
                places = _places(mine, theirs, topologies, block, block)
            found = _compare_pieces(mine, (theirs,), (piece,), 1, False, places, tps)
            if found is not None and topologies is not None:
                where = f"{where} (block {block})" if block else where
                where += _spans(mine, theirs, topologies)
                break
    findings = []
    if rule == "page_copy" and theirs.page_bytes > mine.page_bytes:
        findings.append(
            Finding.diff_past_page(
                name,
                sender_page_bytes=theirs.page_bytes,
                receiver_page_bytes=mine.page_bytes,
                receiver_rank=rank,
                sender_ranks=sources,
                where=where,
            )
        )
    if found is not None:
        findings.append(_byte_finding(name, found, rule, where, rank, sources))
    findings += _beside_page(name, mine, theirs, rank, sources, where)
    return findings


def _segment_tps(
    mine: Layer, theirs: Layer, topologies: tuple[Topology, Topology] | None
) -> _Tps | None:
    """Each side's (TP rank, size) where either layer has a segment split by TP and the two
    differ: the same bytes then hold other global elements."""
    if topologies is None:
        return None
    split = any(p.tp in ("heads", "segment") for p in (*mine.parts, *theirs.parts))
    tps = tuple((t.tp_rank, t.tp_size) for t in topologies)
    if not split or tps[0] == tps[1]:
        return None
    return (tps[0], tps[1])


def _beside_page(
    name: str, mine: Layer, theirs: Layer, rank: int, sources: tuple[int, ...], where: str
) -> list[Finding]:
    """What two layers must agree on outside their pages: the scalars carried by value
    (``k_scale``), and the companion tensors tied to them (a scale pool: its element type,
    bytes per block and granularity), each named."""
    findings = []
    for key in sorted(set(mine.scalars) | set(theirs.scalars)):
        reads, wrote = mine.scalars.get(key), theirs.scalars.get(key)
        if reads != wrote:
            how = "differently" if None not in (reads, wrote) else "without it on one side"
            message = (
                f"{name}: the receiver's {key} is {reads}, the sender's {wrote}: every "
                f"element it scales is read {how}{where}"
            )
            findings.append(
                Finding._of_layer(
                    "dtype", name, message, byte=0, receiver_rank=rank, sender_ranks=sources
                )
            )
    ours = {c.name: c for c in mine.companions}
    others = {c.name: c for c in theirs.companions}
    for key in sorted(set(ours) | set(others)):
        a, b = ours.get(key), others.get(key)
        if a is not None and b is not None and (a.dtype, a.bytes_per_block, a.granularity,
                                                a.group_elements) == (
            b.dtype, b.bytes_per_block, b.granularity, b.group_elements
        ):  # fmt: skip
            continue
        said = "has none" if b is None else f"holds {b.dtype}, {b.bytes_per_block} bytes a block"
        has = "has none" if a is None else f"reads {a.dtype}, {a.bytes_per_block} bytes a block"
        message = f"{name}: companion {key!r}: the receiver {has}, the sender {said}{where}"
        findings.append(
            Finding._of_layer(
                "dtype", name, message, byte=0, receiver_rank=rank, sender_ranks=sources
            )
        )
    return findings


def _byte_finding(
    name: str,
    found: tuple[int, Meaning, Meaning, int],
    rule: Rule,
    where: str,
    rank: int,
    sources: tuple[int, ...],
) -> Finding:
    at, reads, wrote, block = found
    return Finding.diff_byte(
        name,
        byte=at,
        receiver_reads=reads,
        sender_wrote=wrote,
        receiver_rank=rank,
        sender_ranks=sources,
        block=block if rule == "in_place" else None,
        where=where,
    )


# What one layer of a D rank comes to under vLLM's NIXL rule, whatever its name: nothing (None),
# left out (its sender rank is missing as a whole), or a finding's kind and its name-free fields
_Outcome = tuple[Any, ...] | None
_LEFT_OUT: _Outcome = ("left_out",)


def _nixl_rank(
    rank: int,
    manifest: Manifest,
    senders: dict[int, Manifest],
    skipped: dict[str, str],
    gone: set[int],
) -> list[Finding]:
    """vLLM NIXL: every layer of D rank ``rank`` against the P ranks vLLM reads it from.

    What a layer comes to depends on its page meaning and its senders' (their fingerprints,
    which hash kind, dtype, page bytes, axes and heads: all that the plan and the comparison
    read), never on its name: it is worked out once per distinct set of fingerprints (100
    layers of one shape: once) and each layer's finding is made with its own name, in name
    order as before."""
    mine = manifest.topology
    theirs = next(iter(senders.values())).topology
    sides = tuple(senders.items())
    outcomes: dict[tuple[Any, ...], _Outcome] = {}
    findings: list[Finding] = []
    where = f" (receiver rank {rank})"
    for name in sorted(manifest.layers):
        layer = manifest.layers[name]
        if layer.kind == "state":
            skipped[name] = "state (Mamba) layers move by vLLM's ssm_sizes rules, not judged here"
            continue
        if layer.kind != "latent" and max(mine.cp_size, theirs.cp_size) > 1:
            skipped[name] = (
                "vLLM 0.33's NIXL connector pairs context-parallel blocks for MLA only; "
                "attention under DCP/PCP is not judged here"
            )
            continue
        sent = tuple(m.layers.get(name) for _, m in sides)
        key = (layer.fingerprint, *(None if other is None else other.fingerprint for other in sent))
        if key in outcomes:
            outcome = outcomes[key]
        else:
            outcome = outcomes[key] = _nixl_layer(rank, layer, sides, sent, mine, theirs, gone)
        if outcome is not None and outcome is not _LEFT_OUT:
            findings.append(_nixl_finding(name, outcome, rank, where))
        beside = [(r, o) for (r, _), o in zip(sides, sent) if o is not None]
        if beside and (layer.scalars or layer.companions or beside[0][1].scalars or
                       beside[0][1].companions):  # fmt: skip
            findings += _beside_page(name, layer, beside[0][1], rank, (beside[0][0],), where)
    return findings


def _nixl_layer(
    rank: int,
    layer: Layer,
    sides: tuple[tuple[int, Manifest], ...],
    sent: tuple[Layer | None, ...],
    mine: Topology,
    theirs: Topology,
    gone: set[int],
) -> _Outcome:
    """What one layer of D rank ``rank`` comes to (``sent``: the layer of that name on each
    sender rank of ``sides``, ``None`` where it has none), without its name."""
    first = next((other for other in sent if other is not None), None)
    if first is None:
        return None
    total = mine.total_kv_heads or theirs.total_kv_heads
    if total is None:
        total = len(layer.heads) * mine.tp_size if layer.heads else 1
    replicated = layer.kind == "latent"
    plan = _nixl_rules.plan_layer(
        tp_rank=rank,
        tp_size=mine.tp_size,
        remote_tp_size=theirs.tp_size,
        total_kv_heads=total,
        block_tokens=layer.size_of("token"),
        remote_block_tokens=first.size_of("token"),
        page_bytes=layer.page_bytes,
        remote_page_bytes=first.page_bytes,
        replicated=replicated,
        block_contiguous=_block_contiguous(layer),
        layout=mine.layout,
        remote_layout=theirs.layout,
    )
    if plan.refused is not None:
        return ("refused", plan.refused)
    by_rank = {sender_rank: other for (sender_rank, _), other in zip(sides, sent)}
    if max(mine.cp_size, theirs.cp_size) > 1:
        return _nixl_context_parallel(rank, layer, by_rank, mine, theirs, gone)
    sources = tuple(dict.fromkeys(piece.sender_rank for piece in plan.pieces))
    missing = [s for s in sources if by_rank.get(s) is None]
    if missing and all(s in gone for s in missing):
        return _LEFT_OUT  # its whole rank is missing: one finding says so, not one per layer
    if missing:
        return ("missing_rank", missing[0], sources)
    theirs_layers = tuple(by_rank[piece.sender_rank] for piece in plan.pieces)
    dtypes = {other.dtype for other in theirs_layers if other is not None}
    with_parts = layer.parts or any(o is not None and o.parts for o in theirs_layers)
    if dtypes != {layer.dtype} and not with_parts:
        return ("dtype", layer.dtype, ", ".join(sorted(dtypes)), sources)
    found = _compare_pieces(
        layer,
        tuple(other for other in theirs_layers if other is not None),
        plan.pieces,
        plan.ratio,
        plan.permute,
    )
    return None if found is None else ("byte", found, sources)


def _nixl_context_parallel(
    rank: int,
    layer: Layer,
    by_rank: dict[int, Layer | None],
    mine: Topology,
    theirs: Topology,
    gone: set[int],
) -> _Outcome:
    """An MLA layer of D rank ``rank`` under vLLM 0.33's NIXL with context parallelism on
    either side: vLLM's refusals (``_validate_remote_parallel_config``, DCP sizes that do not
    divide), then its block pairing (``_nixl_rules.dcp_pairs``: blocks matched by global
    block position), each pair's whole page compared by token position (the first two pairs
    of every P rank D reads)."""
    refused = _nixl_rules.refuse_context_parallel(
        dcp_size=mine.dcp_size,
        pcp_size=mine.pcp_size,
        remote_dcp_size=theirs.dcp_size,
        remote_pcp_size=theirs.pcp_size,
    )
    if refused is not None:
        return ("refused", refused)
    sources = tuple(
        _nixl_rules.dcp_source_ranks(
            rank, mine.tp_size, mine.dcp_size, theirs.tp_size, theirs.dcp_size
        )
    )
    missing = [s for s in sources if by_rank.get(s) is None]
    if missing and all(s in gone for s in missing):
        return _LEFT_OUT
    if missing:
        return ("missing_rank", missing[0], sources)
    for source in sources:
        other = by_rank[source]
        assert other is not None
        if other.dtype != layer.dtype and not (layer.parts or other.parts):
            return ("dtype", layer.dtype, other.dtype, sources)
        pairs = _nixl_rules.dcp_pairs(
            mine.dcp_size, mine.dcp_rank, theirs.dcp_size, source, count=2
        )
        piece = _nixl_rules.Piece(0, min(layer.page_bytes, other.page_bytes), source, 0, 0)
        sender_view = theirs.model_copy(update={"dcp_rank": source % theirs.dcp_size})
        for local, remote in pairs:
            places = _places(layer, other, (mine, sender_view), local, remote)
            found = _compare_pieces(layer, (other,), (piece,), 1, False, places)
            if found is not None:
                return ("byte", found, (source,))
    return None


def _nixl_finding(name: str, outcome: tuple[Any, ...], rank: int, where: str) -> Finding:
    """Layer ``name``'s finding of an outcome of ``_nixl_layer``."""
    if outcome[0] == "refused":
        return Finding.refused(
            name,
            connector="vLLM's NIXL connector",
            reason=outcome[1],
            receiver_rank=rank,
            where=where,
        )
    if outcome[0] == "missing_rank":
        _, missing, sources = outcome
        return Finding.missing_rank(
            name, rank=missing, receiver_rank=rank, sender_ranks=sources, where=where
        )
    if outcome[0] == "dtype":
        _, reads, wrote, sources = outcome
        return Finding.diff_dtype(
            name,
            reads=reads,
            wrote=wrote,
            receiver_rank=rank,
            sender_ranks=sources,
            where=where,
        )
    _, found, sources = outcome
    rule: Rule = "vllm_nixl"
    at = f"{where}, from sender ranks {list(sources)}"
    return _byte_finding(name, found, rule, at, rank, sources)


# -- parallelism: where tokens lie, which layer is which --------------------------------------


def _token_table(topology: Topology, layer: Layer) -> tuple[tuple[int, ...], int]:
    """A layer's slot -> token position table and the tokens one of its blocks stands for."""
    tokens = layer.size_of("token")
    positions = token_positions(topology, tokens)
    return positions, tokens * topology.cp_size


def _places(
    mine: Layer,
    theirs: Layer,
    topologies: tuple[Topology, Topology],
    mine_block: int,
    theirs_block: int,
) -> _TokenPlaces:
    """Where the tokens of receiver block ``mine_block`` and sender block ``theirs_block`` lie
    (block ``b``'s slots hold positions ``b * tokens * W`` on, as each side places them)."""
    mine_table, mine_span = _token_table(topologies[0], mine)
    theirs_table, theirs_span = _token_table(topologies[1], theirs)
    return mine_table, mine_block * mine_span, theirs_table, theirs_block * theirs_span


def _spans(mine: Layer, theirs: Layer, topologies: tuple[Topology, Topology]) -> str:
    """Words for two sides whose blocks stand for different numbers of tokens: block ``b``
    of one is not block ``b`` of the other, and a key made per block (a store's put, a
    ``zip`` of block lists) pairs other tokens."""
    mine_span, theirs_span = (
        _token_table(topologies[0], mine)[1],
        _token_table(topologies[1], theirs)[1],
    )
    if mine_span == theirs_span:
        return ""
    return (
        f"; a sender block stands for {theirs_span} tokens (DCP x PCP "
        f"{topologies[1].cp_size}), a receiver block for {mine_span} (DCP x PCP "
        f"{topologies[0].cp_size}): blocks paired or keyed one to one hold other tokens"
    )


def _stage_findings(
    rank: int, manifest: Manifest, source: Manifest, by_position: bool
) -> list[Finding]:
    """Layers the two sides pair that are not one layer: by name, a name whose global index
    (``topology.stage_layers``) differs; by position, each position whose two layers differ
    in global index (both sides give it) or else in name. One finding per pair, at byte 0."""
    mine, theirs = manifest.topology, source.topology
    mine_index = dict(zip(manifest.layers, mine.stage_layers or ()))
    theirs_index = dict(zip(source.layers, theirs.stage_layers or ()))
    both = bool(mine_index) and bool(theirs_index)
    where = f" (receiver rank {rank})" if mine.tp_size > 1 or theirs.tp_size > 1 else ""
    findings = []
    if by_position:
        pairs = list(zip(manifest.layers, source.layers))
    else:
        pairs = [(name, name) for name in manifest.layers if name in source.layers]
    for position, (name, other) in enumerate(pairs):
        same = mine_index[name] == theirs_index[other] if both else name == other
        if same:
            continue
        said = (
            f"global layer {mine_index[name]}, the sender's {other!r} is global layer "
            f"{theirs_index[other]}"
            if both
            else f"the sender's layer there is {other!r}"
        )
        how = f"paired by position ({position})" if by_position else "paired by name"
        message = (
            f"{name}: receiver page byte 0 of this layer is {said}; {how}, it would be filled "
            f"with another layer's bytes{where}"
        )
        findings.append(
            Finding._of_layer(
                "byte",
                name,
                message,
                byte=0,
                receiver_rank=rank,
                sender_ranks=(theirs.tp_rank,),
            )
        )
    return findings
