"""A digest of what a request's KV bytes mean, not of the rows that hold them (issue 29).

Two engines that hold the same request differently (prefill TP 2 and decode TP 4, 16-token and
32-token blocks, token-major and head-major pages, decode context parallelism on one side only)
hold different rows, so a checksum of rows
differs even when every value arrived. ``digest`` reads each side's pages through that side's
own manifest and sums a value per **logical coordinate** instead: layer (by name), K or V,
token position in the request, global KV head, element and byte of the element, and the
element type the layer's bytes are read as (issue 35). The same meaning gives the same number
on both sides, whatever the split.

``safeview.digest(manifest, kv_caches, block_ids)`` -> ``Digest``: per layer, per global head
(``-1`` for a layer without heads: an MLA latent, a state) one 62-bit value; a rank holds the
heads (and, under context parallelism, the tokens) it holds, so the digests of P's ranks
combine and each D rank compares only its heads (its tokens, where both sides split them alike;
else all of D's context-parallel ranks together).
``safeview.verify(sent, received)`` -> findings (``digest``, ``digest_unmatched``), empty when
the meaning agrees, first layer first. ``Digest.to_wire()`` is a few bytes per (layer, head)
and a compressed header; ``Digest.from_wire`` refuses anything else in one ``ManifestError``,
its work bounded before it is done (the payload, the inflated header, the counts).

The value of a (layer, head), two lanes of arithmetic modulo the prime ``p = 2**31 - 1``
(scheme ``sv-digest-3``)::

    lane(layer, head) = key(layer) * ( [c == 0] * key(dtype)
                        + key(head) * sum over K/V, positions g < num_tokens held, pieces
                          of  key(kv) * key(g) * key(piece) * <row bytes, R[:, lane]> )

A row is one (K/V, token, head) vector of elements, as int8 bytes (a row of more than 16 KiB
is cut into equal pieces); ``R`` is a fixed int8 matrix whose entries are never 0, at most 64
in magnitude (so that CPUs whose int8 product adds pairs of products into int16 compute it
exactly), and whose lane pairs ``(R[j, 0], R[j, 1])`` differ for every byte ``j`` of a row.
``g`` is the token's position in the request: under context parallelism (``W`` ranks,
interleave ``I``) a rank's slot ``s`` of the request's block ``b`` holds position
``b * T * W + ((s // I) * W + c) * I + s % I``, ``c`` the rank's context-parallel position
(``pcp_rank * dcp_size + dcp_rank``); without it, ``b * T + s``. Only the rank at ``c == 0``
adds the element type's key, so the values of a side's ``W`` ranks add up, lane by lane, to
the value of the whole request (``combine_lanes``), whatever the split. Every key is in
``[1, p)``. Hence, exactly, not by chance: one changed byte changes the value (a change ``d``
of one byte changes the lane by ``key * d * R[j]``, a product of nonzeros below ``p``); two
bytes of a row swapped change it; a row moved to another position, K/V, head or layer changes
it; the same bytes read as another element type (``float8_e4m3fn`` pages copied into a
``float8_e5m2`` cache, ``float16`` into ``bfloat16``: every value decodes differently) change it
(the value moves by ``key(layer) * (key(dtype) - key(dtype'))``, nonzero: every element type
safeview knows has its own key in both lanes). Any other fault matches by chance with
probability about ``2**-62`` per (layer, head) (two lanes, each a sum with pseudo-random keys
modulo a prime). Bytes past ``num_tokens`` (in the last block, on any rank) are not meaning and
are not read into the value.

**Token values**, to name where two sides differ: per head and run of ``chunk_tokens(n)``
positions (16, or a larger power of two that cuts the request into at most 64 runs), the same
sum over every layer digested (each row also times ``key(layer)``), times ``key(head)``, with no
element type. ``verify`` names the first run whose token values differ for a head it finds
different (where both sides digested the same layers). Digests of another scheme
(``sv-digest-1`` and ``sv-digest-2``, earlier releases) are never compared: ``from_wire``
refuses them, ``verify`` says them not compared.

What it cannot see: a fault before the sender's digest (the sender digests what it holds), a
fault that leaves every value as it was (a value rewritten with itself), and a layer, head or
token the digests were not asked about. The keys are public: this detects accidents, it is no
signature against a forger.

No torch here: ``digest`` computes in ``safeview.manifest._digest_torch``, on the tensors' own
device, with torch ops only (``torch._int_mm`` for the rows; no host copy of pages, no Python
loop over tokens or blocks).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from safeview import log
from safeview.errors import ArgumentError, ConfigError, DigestMismatchError
from safeview.findings import Finding
from safeview.manifest._digest_model import (
    DIGEST_CAP_BYTES,
    DIGEST_HEADER_CAP_BYTES,
    DIGEST_SCHEME,
    LANES,
    MAX_PIECE_BYTES,
    NO_HEAD,
    PRIME,
    Digest,
    chunk_tokens,
    combine_lanes,
    key,
    layer_key,
    piece_count,
    row_weights,
    type_key,
)
from safeview.policy import Policy, PolicyArg, current_policy

if TYPE_CHECKING:
    from safeview.manifest._model import Manifest

__all__ = [
    "DIGEST_CAP_BYTES",
    "DIGEST_HEADER_CAP_BYTES",
    "DIGEST_SCHEME",
    "ENV_DIGEST",
    "LANES",
    "MAX_PIECE_BYTES",
    "NO_HEAD",
    "PRIME",
    "Digest",
    "DigestSampling",
    "chunk_tokens",
    "combine_lanes",
    "digest",
    "digest_sampling",
    "judge",
    "key",
    "layer_key",
    "not_judged",
    "parse_sampling",
    "piece_count",
    "row_weights",
    "type_key",
    "verify",
]

ENV_DIGEST = "SAFEVIEW_DIGEST"


def digest(
    manifest: Manifest,
    kv_caches: Any,
    block_ids: Sequence[int] | Any,
    *,
    layers: Sequence[str] | None = None,
    num_tokens: int | None = None,
) -> Digest:
    """The digest of one request's blocks (``block_ids``, in token order: position ``p`` of
    the request is token ``p % T`` of block ``block_ids[p // T]``) in ``kv_caches`` (by layer
    name, as vLLM's ``kv_caches``, or a sequence in the manifest's layer order), read through
    ``manifest`` (this side's, as ``safeview.describe`` made it from these tensors), for
    ``layers`` (default: all) and the first ``num_tokens`` positions (default: every position
    of the blocks given). ``ArgumentError`` names a block id, layer or tensor that does not
    fit the manifest; nothing is written, no page is copied to the host."""
    from safeview.manifest import _digest_torch

    return _digest_torch.digest(manifest, kv_caches, block_ids, layers, num_tokens)


# -- comparing two sides ------------------------------------------------------------------------


def _group(digests: Any, side: str) -> list[Digest]:
    """One side's digests as a list: a ``Digest``, or a non-empty sequence of them."""
    if isinstance(digests, Digest):
        return [digests]
    if isinstance(digests, Sequence) and not isinstance(digests, (str, bytes)):
        group = list(digests)
        if group and all(isinstance(d, Digest) for d in group):
            return group
    shown = repr(digests) if len(repr(digests)) <= 60 else f"{repr(digests)[:57]}..."
    raise ArgumentError(f"{side} is {shown}, not a Digest or a non-empty sequence of Digests")


_Key = tuple[str, int, int]  # (layer, head, context-parallel rank; -1 once combined)


def _merged(
    group: list[Digest], side: str, findings: list[Finding]
) -> tuple[dict[_Key, tuple[int, int]], list[str], dict[str, str]]:
    """One side's values by (layer, head, context-parallel rank), with the TP rank that gave
    each; layers in first-seen order; the element type each layer was read as, where said. Two
    ranks of one side that hold one head of the same tokens (replicated heads) and disagree
    about it are a finding of their own."""
    merged: dict[_Key, tuple[int, int]] = {}
    order: list[str] = []
    dtypes: dict[str, str] = {}
    for one in group:
        dtypes.update(one.dtypes)
        for layer, per_head in one.values.items():
            if layer not in order:
                order.append(layer)
            for head, value in per_head.items():
                known = merged.setdefault((layer, head, one.cp_rank), (value, one.tp_rank))
                if known[0] != value:
                    findings.append(
                        Finding.digest_mismatch(
                            layer,
                            heads=(head,),
                            receiver_rank=one.tp_rank if side == "received" else None,
                            sender_ranks=(known[1], one.tp_rank) if side == "sent" else (),
                            message=f"{layer}: the {side} side's ranks {known[1]} and "
                            f"{one.tp_rank} hold head {_head(head)}{_cp(one)} and digest it "
                            "differently",
                        )
                    )
    return merged, order, dtypes


def _cp(one: Digest) -> str:
    if one.cp_size == 1:
        return ""
    return f" (context-parallel rank {one.cp_rank} of {one.cp_size})"


def _tokens_merged(group: list[Digest]) -> dict[tuple[int, int], tuple[int, ...]]:
    """One side's token values by (head, context-parallel rank) (replicas agree, or the
    (layer, head) values already say they do not)."""
    found: dict[tuple[int, int], tuple[int, ...]] = {}
    for one in group:
        for head, runs in one.tokens.items():
            found.setdefault((head, one.cp_rank), runs)
    return found


def _split(group: list[Digest]) -> set[tuple[int, int]]:
    return {(d.cp_size, d.cp_interleave if d.cp_size > 1 else 1) for d in group}


def _combine(
    merged: dict[_Key, tuple[int, int]],
    tokens: dict[tuple[int, int], tuple[int, ...]],
    cp_size: int,
) -> tuple[dict[_Key, tuple[int, int]], dict[tuple[int, int], tuple[int, ...]], set[_Key]]:
    """A side's values of its ``cp_size`` context-parallel ranks added up into the request's
    (``combine_lanes``), keyed with rank ``-1``; the (layer, head)s some rank did not give
    (not all of the request's tokens: not comparable), apart."""
    whole: dict[_Key, tuple[int, int]] = {}
    missing: set[_Key] = set()
    for layer, head in dict.fromkeys((layer, head) for layer, head, _ in merged):
        parts = [merged.get((layer, head, rank)) for rank in range(cp_size)]
        if any(part is None for part in parts):
            missing.add((layer, head, -1))
            continue
        given = [part for part in parts if part is not None]
        whole[layer, head, -1] = (combine_lanes(v for v, _ in given), given[0][1])
    runs: dict[tuple[int, int], tuple[int, ...]] = {}
    for head in dict.fromkeys(head for head, _ in tokens):
        per_rank = [tokens.get((head, rank)) for rank in range(cp_size)]
        if all(r is not None for r in per_rank):
            columns = zip(*(r for r in per_rank if r is not None))
            runs[head, -1] = tuple(combine_lanes(column) for column in columns)
    return whole, runs, missing


def _unmatched(sent: list[Digest], received: list[Digest]) -> Finding | None:
    """One finding when the two sides' digests cannot be compared at all: values of two schemes
    (two safeview releases), or of different token counts."""
    schemes = ({d.scheme for d in sent}, {d.scheme for d in received})
    if len(schemes[0] | schemes[1]) > 1:
        return Finding.digest_unmatched(
            None,
            heads=(),
            message=f"the sender's digests are of scheme {_listed(schemes[0])}, the receiver's "
            f"of {_listed(schemes[1])}: values of two schemes mean different things, not compared",
        )
    tokens = ({d.num_tokens for d in sent}, {d.num_tokens for d in received})
    if len(tokens[0] | tokens[1]) > 1:
        return Finding.digest_unmatched(
            None,
            heads=(),
            message=f"the sender digested {_tokens(tokens[0])} positions, the receiver "
            f"{_tokens(tokens[1])}: not the same request, or not all of it",
        )
    return None


def verify(sent: Digest | Sequence[Digest], received: Digest | Sequence[Digest]) -> list[Finding]:
    """Compare what a sender digested with what a receiver holds: each a ``Digest`` or one per
    rank (P's ranks combine; pass only the D ranks to be judged). Every (layer, head) the
    receiver digested is compared with the sender's; a layer's heads that differ make one
    ``digest`` finding naming them, the first tokens that differ (where both sides digested
    the same layers) and both element types where the two sides read the layer as different
    ones, first layer first; a (layer, head) no sender digest holds makes a
    ``digest_unmatched`` finding; different token counts, or digests of two schemes, one
    ``digest_unmatched`` finding and nothing else. Empty when the meaning agrees.

    Context parallelism: where both sides split the request's tokens alike (the same
    context-parallel size and interleave), each rank's values are compared with the other
    side's rank of that position; otherwise each side's context-parallel ranks are added up
    into the request's values first, and a (layer, head) some of a side's ranks did not give
    is ``digest_unmatched`` (not all of its tokens). ``ArgumentError`` for a side that is not
    a ``Digest`` or a non-empty sequence of them."""
    sent_group, received_group = _group(sent, "sent"), _group(received, "received")
    unmatched = _unmatched(sent_group, received_group)
    if unmatched is not None:
        return [unmatched]
    findings: list[Finding] = []
    theirs, _, their_types = _merged(sent_group, "sent", findings)
    ours, order, our_types = _merged(received_group, "received", findings)
    their_runs, our_runs = _tokens_merged(sent_group), _tokens_merged(received_group)
    splits = _split(sent_group) | _split(received_group)
    incomplete: set[_Key] = set()
    if len(splits) > 1:  # added up per side, then compared
        sent_size = next(iter(_split(sent_group)))[0] if len(_split(sent_group)) == 1 else 0
        received_size = (
            next(iter(_split(received_group)))[0] if len(_split(received_group)) == 1 else 0
        )
        if not sent_size or not received_size:
            return [
                Finding.digest_unmatched(
                    None,
                    heads=(),
                    message="one side's digests split the request's tokens in different "
                    "context-parallel ways: not compared",
                )
            ]
        theirs, their_runs, _ = _combine(theirs, their_runs, sent_size)
        ours, our_runs, incomplete = _combine(ours, our_runs, received_size)
    same_layers = len({frozenset(d.values) for d in sent_group + received_group}) == 1
    received_ranks: dict[_Key, int] = {k: rank for k, (_, rank) in ours.items()}
    for layer in order:
        keys = sorted(k for k in ours if k[0] == layer)
        differ = [k for k in keys if k in theirs and theirs[k][0] != ours[k][0]]
        absent = [k for k in keys if k not in theirs]
        absent += sorted(k for k in incomplete if k[0] == layer)
        if differ:
            findings.append(
                _mismatch(
                    layer, differ, theirs, received_ranks, (their_types, our_types),
                    (their_runs, our_runs) if same_layers else None,
                    sent_group[0].num_tokens,
                    any(d.cp_size > 1 for d in sent_group + received_group),
                )
            )  # fmt: skip
        if absent:
            heads = tuple(sorted({head for _, head, _ in absent}))
            why = (
                "are in no sender digest given"
                if not incomplete
                else "are in no sender digest given, or not in every context-parallel rank of "
                "the receiver given (not all of the request's tokens)"
            )
            findings.append(
                Finding.digest_unmatched(
                    layer,
                    heads=heads,
                    message=f"{layer}: {_heads(heads)} of the receiver {why}: not compared",
                )
            )
    return findings


def _mismatch(
    layer: str,
    differ: list[_Key],
    theirs: dict[_Key, tuple[int, int]],
    received_ranks: dict[_Key, int],
    types: tuple[dict[str, str], dict[str, str]],
    runs: tuple[dict[tuple[int, int], tuple[int, ...]], ...] | None,
    num_tokens: int,
    context_parallel: bool,
) -> Finding:
    """One ``digest`` finding for ``layer``'s (head, context-parallel rank)s that differ
    (the rank named only where a side splits tokens by context parallelism)."""
    heads = tuple(dict.fromkeys(head for _, head, _ in differ))
    ranks = tuple(sorted({theirs[k][1] for k in differ}))
    their_type, our_type = types[0].get(layer), types[1].get(layer)
    typed = (
        f"; the sender's elements are {their_type}, the receiver's {our_type}: the same "
        "bytes are other values"
        if their_type is not None and our_type is not None and their_type != our_type
        else ""
    )
    tokens = _first_tokens(differ, runs, num_tokens)
    where = ""
    if tokens is not None:
        first, last = tokens[1]
        where = (
            f"; head {_head(tokens[0])}'s first tokens that differ are {first:,} to {last:,} "
            f"(of {num_tokens:,}, every layer together)"
        )
    ranked = [k[2] for k in differ if k[2] >= 0]
    cp = f", context-parallel rank {ranked[0]}" if ranked and context_parallel else ""
    return Finding.digest_mismatch(
        layer,
        heads=heads,
        receiver_rank=received_ranks[differ[0]],
        sender_ranks=ranks,
        tokens=None if tokens is None else tokens[1],
        message=f"{layer}: {_heads(heads)} read differently from what the sender digested "
        f"(sender rank {', '.join(map(str, ranks))}, receiver rank "
        f"{received_ranks[differ[0]]}{cp}){where}{typed}",
    )


def _first_tokens(
    differ: list[_Key],
    runs: tuple[dict[tuple[int, int], tuple[int, ...]], ...] | None,
    num_tokens: int,
) -> tuple[int, tuple[int, int]] | None:
    """The head and the first run of tokens (first, last) whose token values differ, among
    ``differ``'s; ``None`` where the token values do not tell."""
    if runs is None:
        return None
    size = chunk_tokens(num_tokens)
    best: tuple[int, tuple[int, int]] | None = None
    for _, head, rank in differ:
        theirs, ours = runs[0].get((head, rank)), runs[1].get((head, rank))
        if theirs is None or ours is None or len(theirs) != len(ours):
            continue
        run = next((at for at, (a, b) in enumerate(zip(theirs, ours)) if a != b), None)
        if run is not None and (best is None or run * size < best[1][0]):
            best = (head, (run * size, min((run + 1) * size, num_tokens) - 1))
    return best


def judge(
    sent: Digest | Sequence[Digest],
    received: Digest | Sequence[Digest],
    *,
    policy: PolicyArg | str | None = None,
    request: str | None = None,
    engine: str | None = None,
    tp_rank: int | None = None,
    tp_size: int | None = None,
    remote_engine: str | None = None,
    remote_tp_size: int | None = None,
) -> DigestMismatchError | None:
    """``verify``, and its event: ``digest_checked`` when the meaning agrees, ``digest_mismatch``
    when it does not (nothing under ``off``); the error to fail the request with under strict.
    ``policy``: the policy in force where not given (``safeview.current_policy``). The event's
    pair: ``engine``, ``tp_rank``, ``tp_size`` (the receiver's), ``remote_engine``,
    ``remote_tp_size`` (the sender's), as ``layout_checked`` names them; the ranks default to
    the digests' own (the receiver's rank where it is one), the engines to ``None``::

        error = judge(sent, received, policy="strict", request="r1")
    """
    active = current_policy(policy)
    findings = verify(sent, received)
    group, senders = _group(received, "received"), _group(sent, "sent")
    said = {
        "engine": engine,
        "tp_rank": tp_rank if tp_rank is not None else _one({d.tp_rank for d in group}),
        "tp_size": tp_size if tp_size is not None else _one({d.tp_size for d in group}),
        "remote_engine": remote_engine,
        "remote_tp_size": (
            remote_tp_size if remote_tp_size is not None else _one({d.tp_size for d in senders})
        ),
        "request": request,
        "policy": active.value,
        "num_tokens": group[0].num_tokens,
        "layers": len({layer for one in group for layer in one.values}),
        "heads": sum(len(per) for one in group for per in one.values.values()),
        "reason": None,
    }
    if not findings:
        log.digest_checked(verdict="agree", **said)
        return None
    if active is Policy.OFF:
        return None
    strict = active is Policy.STRICT
    log.digest_mismatch(findings[0], strict=strict, findings=len(findings), **said)
    return DigestMismatchError(findings, request) if strict else None


def not_judged(
    reason: str,
    *,
    policy: PolicyArg | str | None = None,
    request: str | None = None,
    engine: str | None = None,
    tp_rank: int | None = None,
    tp_size: int | None = None,
    remote_engine: str | None = None,
    remote_tp_size: int | None = None,
) -> None:
    """``digest_checked`` with ``verdict`` ``not_judged``: a request a sender digested whose
    digests could not be compared (``reason``); the request goes on. The fields as ``judge``'s
    (unknown ones ``None``)."""
    log.digest_checked(
        verdict="not_judged",
        engine=engine,
        tp_rank=tp_rank,
        tp_size=tp_size,
        remote_engine=remote_engine,
        remote_tp_size=remote_tp_size,
        request=request,
        policy=current_policy(policy).value,
        num_tokens=None,
        layers=0,
        heads=0,
        reason=reason,
    )


def _one(values: set[int]) -> int | None:
    """The value every digest of a side states, or ``None`` where they differ."""
    return next(iter(values)) if len(values) == 1 else None


def _listed(schemes: set[str]) -> str:
    return " and ".join(repr(s) for s in sorted(schemes))


def _head(head: int) -> str:
    return "(no head axis)" if head == NO_HEAD else str(head)


def _heads(heads: Sequence[int]) -> str:
    if list(heads) == [NO_HEAD]:
        return "its bytes (no head axis)"
    shown = ", ".join(map(str, heads[:8])) + (", ..." if len(heads) > 8 else "")
    return f"head{'s' if len(heads) > 1 else ''} {shown}"


def _tokens(counts: set[int]) -> str:
    return " or ".join(f"{n:,}" for n in sorted(counts))


# -- sampling: SAFEVIEW_DIGEST ------------------------------------------------------------------


@dataclass(frozen=True)
class DigestSampling:
    """Which requests an integration digests: ``off`` (none), ``all``, or ``sample`` every
    ``every``-th (the first included)."""

    mode: Literal["off", "sample", "all"] = "off"
    every: int = 1

    def wants(self, count: int) -> bool:
        """Whether the ``count``-th request (from 0) is digested."""
        if self.mode == "off":
            return False
        return self.mode == "all" or count % self.every == 0

    def __str__(self) -> str:
        return f"sample:{self.every}" if self.mode == "sample" else self.mode


def parse_sampling(raw: str | None, source: str = ENV_DIGEST) -> DigestSampling:
    """``off``, ``all`` or ``sample:N`` (N >= 1; case and blanks ignored; unset or blank is
    ``off``); ``ConfigError`` naming the variable, the value and what it may be otherwise."""
    text = (raw or "").strip().lower()
    if text in ("", "off"):
        return DigestSampling("off")
    if text == "all":
        return DigestSampling("all")
    if text.startswith("sample:"):
        count = text.removeprefix("sample:").strip()
        if count.isdigit() and int(count) >= 1:
            return DigestSampling("sample", int(count)) if int(count) > 1 else DigestSampling("all")
    raise ConfigError(source, raw, ("off", "sample:N (N >= 1)", "all"))


def digest_sampling(environ: Mapping[str, str] | None = None) -> DigestSampling:
    """``SAFEVIEW_DIGEST`` as an integration reads it: a value that is not one is one
    ``RuntimeWarning`` naming it, and digests stay off (a digest is an extra check: a typo
    must not stop an engine)."""
    raw = (os.environ if environ is None else environ).get(ENV_DIGEST)
    try:
        return parse_sampling(raw)
    except ConfigError as error:
        warnings.warn(f"{error}; digests stay off", RuntimeWarning, stacklevel=2)
        return DigestSampling("off")
