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
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Piece", "Plan", "head_offset", "heads_per_rank", "plan_layer", "source_ranks"]


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
    (the check it would fail at the handshake, in words)."""
    bigger, smaller = max(tp_size, remote_tp_size), min(tp_size, remote_tp_size)
    if bigger % smaller:
        return Plan((), 1, False, f"TP sizes {remote_tp_size} (P) and {tp_size} (D) do not divide")
    if block_tokens % remote_block_tokens:
        return Plan(
            (),
            1,
            False,
            f"D's block tokens {block_tokens} are not a multiple of P's {remote_block_tokens}",
        )
    ratio = block_tokens // remote_block_tokens
    p_bigger = remote_tp_size > tp_size
    model_replicated = replicated or remote_tp_size > total_kv_heads
    if p_bigger and ratio != 1 and not replicated:
        return Plan(
            (),
            ratio,
            False,
            f"P's TP {remote_tp_size} is larger than D's {tp_size} and block tokens differ "
            f"({remote_block_tokens} vs {block_tokens})",
        )
    if p_bigger and not replicated and remote_tp_size > total_kv_heads:
        return Plan((), ratio, False, f"P's KV heads are replicated over TP {remote_tp_size}")
    if not replicated and None not in (layout, remote_layout) and layout != remote_layout:
        return Plan((), ratio, False, f"layouts differ: P {remote_layout}, D {layout}")
    if tp_size != remote_tp_size and not model_replicated and not block_contiguous:
        return Plan((), ratio, False, "heterogeneous TP needs a block-contiguous (HND) layout on D")
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
