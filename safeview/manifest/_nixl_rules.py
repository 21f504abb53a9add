"""How vLLM 0.33's NIXL connector moves one layer's blocks between a prefill (P, the sender)
and a decode (D, the receiver) engine of other tensor-parallel sizes or block tokens, as
``vllm/distributed/kv_transfer/kv_connector/v1/nixl`` implements it (``tp_mapping.py``:
``compute_tp_mapping``, ``compute_head_offset``; ``base_worker.py``: ``_build_fa_remote``,
``_build_local_splits_from_plan``, ``_validate_remote_agent_handshake``; ``utils.py``:
``TransferTopology``, ``kv_postprocess_blksize_on_receive``). Plain integers; no vLLM, no torch.

A D rank ``d`` pulls. ``r = N_D // N_P`` (block tokens) must be an integer; with ``P_TP > D_TP``
it must be 1. With ``D_TP >= P_TP`` (and for MLA), ``d`` reads rank ``d * P_TP // D_TP``: for
sub-block ``j < r`` of its block, ``L_D / r`` bytes at ``head_offset * L_D / r`` of the P block
``r * b + j``. With ``P_TP > D_TP`` it reads whole pages from the ranks holding distinct heads,
each into its slot of ``L_D / n`` bytes. With ``r > 1`` on a block-contiguous (``HND``) cache,
the receiver then permutes ``[r, H, N_P, C]`` into ``[H, r * N_P, C]``.

A topology's ``layout`` is read as vLLM reads ``kv_cache_layout``: one of ``VLLM_LAYOUTS``, the
names its handshake carries, or an older name it still takes (``LAYOUT_ALIASES``: ``HND``,
``NHD``); any other string is a ``ManifestError`` naming it and the names accepted.
"""

from __future__ import annotations

from dataclasses import dataclass

from safeview.errors import ManifestError

__all__ = [
    "CHECKS",
    "LAYOUT_ALIASES",
    "VLLM_LAYOUTS",
    "Piece",
    "Plan",
    "dcp_pairs",
    "dcp_source_ranks",
    "head_offset",
    "heads_per_rank",
    "plan_layer",
    "refuse_context_parallel",
    "source_ranks",
    "vllm_layout",
]

#: vLLM 0.33's KV-cache layouts (``vllm/v1/kv_cache_layout.py``, ``KVCacheLayout``: the name is
#: the physical order of ``[L, B, H, N, C]``), the strings its NIXL handshake carries, and
#: whether each is block-contiguous (``is_block_contiguous``: a block's ``[H, N, C]`` in one
#: run, heads outermost, so that a page splits by heads)
VLLM_LAYOUTS: dict[str, bool] = {
    "LBHNC": True,
    "LBNHC": False,
    "LHBNC": False,
    "BLHNC": True,
    "BLNHC": False,
    "BHLNC": False,
}
#: the older names vLLM 0.33 still takes for two of them (``vllm/config/cache.py``,
#: ``_LAYOUT_COMPAT_ALIASES``), FlashInfer's words for heads-first and tokens-first
LAYOUT_ALIASES: dict[str, str] = {"HND": "LBHNC", "NHD": "LBNHC"}

#: the handshake checks of vLLM's that can refuse a pair, by the name ``Plan.refused_by`` gives
CHECKS = (
    "tp_sizes_divide",  # one TP size a multiple of the other
    "block_tokens_divide",  # D's block tokens a multiple of P's
    "p_heads_replicated",  # P's TP above the KV heads: P holds copies D cannot split
    "p_tp_block_tokens",  # with P's TP above D's, one block size on both
    "layouts_equal",  # one kv_cache_layout on both sides
    "block_contiguous",  # heterogeneous TP splits pages by heads: D's heads outermost
    "block_len",  # P's page the bytes vLLM expects from D's, the heads and the block ratio
)


@dataclass(frozen=True)
class Piece:
    """Receiver page bytes ``[receiver_start, receiver_start + length)`` come from sender rank
    ``sender_rank``'s block ``r * b + sub_block``, bytes from ``sender_start``."""

    receiver_start: int
    length: int
    sender_rank: int
    sub_block: int
    sender_start: int


@dataclass(frozen=True)
class Plan:
    """What vLLM does for one layer and one D rank: the pieces, the receive-side permutation
    (``r`` sub-blocks, 1 for none), or why vLLM refuses the pair (``refused``)."""

    pieces: tuple[Piece, ...]
    ratio: int
    permute: bool
    refused: str | None = None
    refused_by: str | None = None  # which of ``CHECKS`` refused


def vllm_layout(layout: str | None, field: str) -> str | None:
    """vLLM's name (a key of ``VLLM_LAYOUTS``) for the ``layout`` string a topology reports,
    ``field`` (``None`` for ``None``): the name itself or an alias, in any case."""
    if layout is None:
        return None
    name = layout.strip().upper()
    name = LAYOUT_ALIASES.get(name, name)
    if name not in VLLM_LAYOUTS:
        names = ", ".join(VLLM_LAYOUTS)
        aliases = ", ".join(f"{alias} ({meant})" for alias, meant in LAYOUT_ALIASES.items())
        raise ManifestError(
            field,
            layout,
            f"is not a layout of vLLM's (kv_cache_layout): expected one of {names}, or {aliases}",
        )
    return name


def _named(layout: str | None, name: str | None) -> str:
    """A layout as the manifest wrote it, with vLLM's name when that is another."""
    if layout is None:
        return "none given"
    return repr(layout) if layout == name else f"{layout!r} ({name})"


def heads_per_rank(total_kv_heads: int, tp_size: int) -> int:
    return max(1, total_kv_heads // tp_size)


def head_offset(tp_rank: int, tp_size: int, remote_tp_size: int, total_kv_heads: int) -> int:
    """Which slice of heads (in units of this rank's heads) a D rank reads in its P's page."""
    if tp_size <= remote_tp_size:
        return 0
    if tp_size > total_kv_heads:
        remote_rank = tp_rank * remote_tp_size // tp_size
        local_head = tp_rank * total_kv_heads // tp_size
        remote_head = remote_rank * total_kv_heads // remote_tp_size
        return local_head - remote_head
    return tp_rank % (tp_size // remote_tp_size)


def source_ranks(
    tp_rank: int, tp_size: int, remote_tp_size: int, total_kv_heads: int, replicated: bool
) -> list[int]:
    """The P ranks a D rank reads, in slot order (one rank per distinct head)."""
    if replicated or tp_size >= remote_tp_size:
        return [tp_rank * remote_tp_size // tp_size]
    per_local = remote_tp_size // tp_size
    start = tp_rank * per_local
    seen: dict[int, int] = {}
    for rank in range(start, start + per_local):
        seen.setdefault(rank * total_kv_heads // remote_tp_size, rank)
    return sorted(seen.values())


def plan_layer(
    *,
    tp_rank: int,
    tp_size: int,
    remote_tp_size: int,
    total_kv_heads: int,
    block_tokens: int,
    remote_block_tokens: int,
    page_bytes: int,
    remote_page_bytes: int,
    replicated: bool,
    block_contiguous: bool,
    layout: str | None = None,
    remote_layout: str | None = None,
) -> Plan:
    """The transfer of one attention or MLA layer into D rank ``tp_rank``, or vLLM's refusal
    (the check it would fail at the handshake, in words, and its name in ``CHECKS``), in the
    order vLLM checks. ``layout`` and ``remote_layout``: D's and P's topology layouts (see
    ``vllm_layout``); ``block_contiguous`` (D's page read off its strides) counts only where
    D's layout is not given."""
    d_layout = vllm_layout(layout, f"D rank {tp_rank}: topology.layout")
    p_layout = vllm_layout(remote_layout, "P: topology.layout")
    if d_layout is not None:
        block_contiguous = VLLM_LAYOUTS[d_layout]
    bigger, smaller = max(tp_size, remote_tp_size), min(tp_size, remote_tp_size)
    if bigger % smaller:
        return Plan(
            (),
            1,
            False,
            f"TP sizes {remote_tp_size} (P) and {tp_size} (D) do not divide",
            "tp_sizes_divide",
        )
    if block_tokens % remote_block_tokens:
        return Plan(
            (),
            1,
            False,
            f"D's block tokens {block_tokens} are not a multiple of P's {remote_block_tokens}",
            "block_tokens_divide",
        )
    ratio = block_tokens // remote_block_tokens
    p_bigger = remote_tp_size > tp_size
    model_replicated = replicated or remote_tp_size > total_kv_heads
    if p_bigger and not replicated and remote_tp_size > total_kv_heads:
        return Plan(
            (),
            ratio,
            False,
            f"P's KV heads are replicated over TP {remote_tp_size}",
            "p_heads_replicated",
        )
    if not replicated and None not in (d_layout, p_layout) and d_layout != p_layout:
        return Plan(
            (),
            ratio,
            False,
            f"layouts differ: P {_named(remote_layout, p_layout)}, D {_named(layout, d_layout)}",
            "layouts_equal",
        )
    if tp_size != remote_tp_size and not model_replicated and not block_contiguous:
        d_is = (
            f"layout {_named(layout, d_layout)}"
            if layout is not None
            else "page (no layout given; read off its strides) holds tokens before heads"
        )
        return Plan(
            (),
            ratio,
            False,
            "heterogeneous TP needs a block-contiguous layout on D, heads before tokens in a "
            f"block (LBHNC or BLHNC; HND in vLLM's older words): D's {d_is}",
            "block_contiguous",
        )
    if p_bigger and ratio != 1 and not replicated:
        return Plan(
            (),
            ratio,
            False,
            f"P's TP {remote_tp_size} is larger than D's {tp_size} and block tokens differ "
            f"({remote_block_tokens} vs {block_tokens})",
            "p_tp_block_tokens",
        )
    local_heads = heads_per_rank(total_kv_heads, tp_size)
    remote_heads = heads_per_rank(total_kv_heads, remote_tp_size)
    if model_replicated:
        expected = page_bytes // ratio
    elif not p_bigger:
        expected = (page_bytes * remote_heads // local_heads) // ratio
    else:
        expected = page_bytes * remote_heads // local_heads
    if remote_page_bytes != expected:
        return Plan(
            (),
            ratio,
            False,
            f"P's page is {remote_page_bytes} bytes where vLLM expects {expected} "
            f"(D's {page_bytes}, heads {remote_heads} vs {local_heads}, block ratio {ratio})",
            "block_len",
        )
    sources = source_ranks(tp_rank, tp_size, remote_tp_size, total_kv_heads, replicated)
    unit = page_bytes // ratio
    if replicated or model_replicated or not p_bigger:
        offset = 0 if replicated else head_offset(tp_rank, tp_size, remote_tp_size, total_kv_heads)
        pieces = tuple(Piece(j * unit, unit, sources[0], j, offset * unit) for j in range(ratio))
    else:
        slot = page_bytes // len(sources)
        pieces = tuple(Piece(i * slot, slot, rank, 0, 0) for i, rank in enumerate(sources))
    return Plan(pieces, ratio, ratio > 1 and block_contiguous and not replicated)


# -- context parallelism (MLA only in vLLM 0.33: ``TransferTopology.dcp_source_ranks``,
# ``_validate_remote_parallel_config``, ``_apply_dcp_prefix_caching``) --------------------------


def refuse_context_parallel(
    *, dcp_size: int, pcp_size: int, remote_dcp_size: int, remote_pcp_size: int
) -> str | None:
    """Why vLLM refuses a pair's context parallelism at the handshake, or ``None``."""
    if dcp_size % remote_dcp_size and remote_dcp_size % dcp_size:
        return f"DCP sizes {remote_dcp_size} (P) and {dcp_size} (D) do not divide one another"
    if remote_pcp_size > 1 and remote_dcp_size not in (1, remote_pcp_size):
        return f"P's DCP {remote_dcp_size} does not span its PCP group of {remote_pcp_size}"
    if (pcp_size > 1 and dcp_size == 1 and remote_dcp_size > 1) or (
        remote_pcp_size > 1 and remote_dcp_size == 1 and dcp_size > 1
    ):
        return "a replicated PCP side cannot be paired with a DCP-sharded one"
    return None


def dcp_source_ranks(
    tp_rank: int, tp_size: int, dcp_size: int, remote_tp_size: int, remote_dcp_size: int
) -> list[int]:
    """The P ranks an MLA D rank reads under DCP: every P rank whose slice lies in its own,
    or the one P rank that covers it; P without DCP: the rank TP mapping gives (MLA is
    replicated). D's DCP rank is ``tp_rank % dcp_size``."""
    if remote_dcp_size == 1:
        return [tp_rank * remote_tp_size // tp_size]
    dcp_rank = tp_rank % dcp_size
    if dcp_size <= remote_dcp_size:
        return [r for r in range(remote_tp_size) if r % dcp_size == dcp_rank]
    return [dcp_rank % remote_dcp_size]


def dcp_pairs(
    dcp_size: int, dcp_rank: int, remote_dcp_size: int, remote_rank: int, count: int
) -> list[tuple[int, int]]:
    """The first ``count`` (D block position, P block position) pairs vLLM matches by global
    block position between D's DCP rank and P rank ``remote_rank`` (no prefix cached):
    positions in each side's block list for the request."""
    if dcp_size == remote_dcp_size:
        return [(i, i) for i in range(count)]
    if dcp_size < remote_dcp_size:
        k = remote_dcp_size // dcp_size
        p = (remote_rank - dcp_rank) // dcp_size
        start_local = p % k
        start_remote = (start_local - p) // k
        return [(start_local + k * i, start_remote + i) for i in range(count)]
    k = dcp_size // remote_dcp_size
    start_remote = (dcp_rank - remote_rank % remote_dcp_size) // remote_dcp_size
    return [(i, start_remote + k * i) for i in range(count)]
