"""safeview.diff against a byte oracle: sender pages filled with values that encode (layer, K/V,
token, global head, element), bytes moved as the connector moves them (a page copy; for vLLM's
NIXL connector a re-implementation here, from vLLM 0.33's source, of the descriptors it builds
and of its receive-side reorder, independent of safeview.manifest._nixl_rules), the receiver's pages
decoded through its own layout. diff must say compatible exactly when every byte decodes right,
and otherwise name the first wrong byte."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import safeview
from safeview import LayoutMismatchError, Manifest, ManifestError
from safeview.manifest import assumed, describe, vllm_axes
from safeview.manifest import diff as layout_diff
from safeview.manifest.diff import DiffReport, Meaning

D = 4  # head elements: small pages, every byte still checked

# -- values that say what they are ------------------------------------------------------------


def code(layer: int, kv: int, token: int, head: int, element: int) -> int:
    return (((layer * 3 + kv) * 4096 + token) * 64 + head) * 64 + element + 1


def held_heads(rank: int, tp: int, heads: int) -> list[int]:
    """vLLM's sharding, written out again: TP <= H splits heads evenly; TP > H replicates."""
    if tp <= heads:
        per = heads // tp
        return list(range(rank * per, rank * per + per))
    return [rank * heads // tp]


def engine_rank(
    tp: int, rank: int, heads: int, tokens: int, layout: str, blocks: int, mla: bool, layers: int
) -> dict[str, torch.Tensor]:
    """One rank's caches as vLLM 0.33 holds them: logical [B, H, N, C] int32, C = K|V."""
    held = [0] if mla else held_heads(rank, tp, heads)
    width = D if mla else 2 * D
    caches = {}
    for layer in range(layers):
        if layout == "LBHNC" or mla:
            tensor = torch.zeros(blocks, len(held), tokens, width, dtype=torch.int32)
        else:
            physical = torch.zeros(blocks, tokens, len(held), width, dtype=torch.int32)
            tensor = physical.permute(0, 2, 1, 3)
        for b, h, t, c in itertools.product(
            range(blocks), range(len(held)), range(tokens), range(width)
        ):
            kv, element = (2, c) if mla else divmod(c, D)
            tensor[b, h, t, c] = code(layer, kv, b * tokens + t, held[h], element)
        caches[f"model.layers.{layer}.attn"] = tensor
    return caches


def manifest_of(
    caches: dict[str, torch.Tensor], tp: int, rank: int, heads: int, layout: str, mla: bool
) -> Manifest:
    return describe(
        caches,
        axes=vllm_axes("mla" if mla else "attention"),
        topology={"tp_rank": rank, "tp_size": tp, "total_kv_heads": heads, "layout": layout},
    )


def expected(
    tensor: torch.Tensor, layer: int, rank: int, tp: int, heads: int, mla: bool
) -> torch.Tensor:
    held = [0] if mla else held_heads(rank, tp, heads)
    blocks, local, tokens, width = tensor.shape
    out = torch.zeros(blocks, local, tokens, width, dtype=torch.int32)
    for b, h, t, c in itertools.product(range(blocks), range(local), range(tokens), range(width)):
        kv, element = (2, c) if mla else divmod(c, D)
        out[b, h, t, c] = code(layer, kv, b * tokens + t, held[h], element)
    return out


def page_bytes_of(tensor: torch.Tensor) -> np.ndarray:
    """The bytes of the whole storage, as uint8, shared with the tensor."""
    whole = torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())
    return whole.numpy()


def first_wrong_byte(tensor: torch.Tensor, want: torch.Tensor) -> int | None:
    """The lowest byte of block 0's page whose element is wrong, by the element's address."""
    wrong = (tensor[0] != want[0]).nonzero().tolist()
    if not wrong:
        return None
    strides = tensor.stride()
    return int(min(sum(i * s for i, s in zip(index, strides[1:])) * 4 for index in wrong))


# -- vLLM 0.33's NIXL movement, re-implemented for the oracle -----------------------------------


def vllm_refuses(
    p_tp: int,
    d_tp: int,
    p_n: int,
    d_n: int,
    heads: int,
    p_layout: str,
    d_layout: str,
    mla: bool,
    p_len: int,
    d_len: int,
) -> bool:
    if max(p_tp, d_tp) % min(p_tp, d_tp) or d_n % p_n:
        return True  # TransferTopology.tp_ratio / block_size_ratio asserts
    ratio = d_n // p_n
    tp_ratio = d_tp // p_tp if d_tp >= p_tp else -(p_tp // d_tp)
    p_replicated = p_tp > heads
    if not mla and tp_ratio < 0 and p_replicated:
        return True
    if not mla and p_layout != d_layout:
        return True
    if abs(tp_ratio) != 1 and not mla and not p_replicated and d_layout != "LBHNC":
        return True
    local_heads, remote_heads = max(1, heads // d_tp), max(1, heads // p_tp)
    if mla or p_replicated:
        return d_len // ratio != p_len
    if tp_ratio > 0:
        return p_len != (d_len * remote_heads // local_heads) // ratio
    return ratio != 1 or p_len != d_len * remote_heads // local_heads


def vllm_moves(
    prefill: list[dict[str, torch.Tensor]],
    decode: list[dict[str, torch.Tensor]],
    heads: int,
    p_n: int,
    d_n: int,
    d_layout: str,
    mla: bool,
) -> None:
    """Per D rank and layer: the (address, length) rows _build_fa_remote and
    _build_local_splits_from_plan build, copied byte for byte, then the reorder of
    kv_postprocess_blksize_on_receive, as vLLM writes it, on the logical tensor."""
    p_tp, d_tp = len(prefill), len(decode)
    ratio = d_n // p_n
    for d, caches in enumerate(decode):
        for name, cache in caches.items():
            d_len = cache[0].numel() * 4
            local = page_bytes_of(cache)
            if d_tp >= p_tp or mla:
                source = d * p_tp // d_tp
                offset = 0
                if not mla and d_tp > p_tp:
                    if d_tp > heads:
                        offset = d * heads // d_tp - (source * heads // p_tp)
                    else:
                        offset = d % (d_tp // p_tp)
                unit = d_len // ratio
                remote_tensor = prefill[source][name]
                p_len = remote_tensor[0].numel() * 4
                remote = page_bytes_of(remote_tensor)
                for b in range(cache.shape[0]):
                    for j in range(ratio):
                        start = (ratio * b + j) * p_len + offset * unit
                        local[b * d_len + j * unit : b * d_len + (j + 1) * unit] = remote[
                            start : start + unit
                        ]
            else:
                per = p_tp // d_tp
                firsts: dict[int, int] = {}
                for rank in range(d * per, d * per + per):
                    firsts.setdefault(rank * heads // p_tp, rank)
                ranks = sorted(firsts.values())
                slot = d_len // len(ranks)
                for i, rank in enumerate(ranks):
                    remote_tensor = prefill[rank][name]
                    p_len = remote_tensor[0].numel() * 4
                    remote = page_bytes_of(remote_tensor)
                    for b in range(cache.shape[0]):
                        local[b * d_len + i * slot : b * d_len + (i + 1) * slot] = remote[
                            b * p_len : b * p_len + slot
                        ]
            if ratio > 1 and not mla and d_layout == "LBHNC":
                indices = torch.arange(cache.shape[0])
                blocks_to_update = cache.index_select(0, indices)
                n_kv_heads, block_size, head_size = blocks_to_update.shape[1:]
                remote_block_size = block_size // ratio
                permuted = (
                    blocks_to_update.reshape(-1, ratio, n_kv_heads, remote_block_size, head_size)
                    .permute(0, 2, 1, 3, 4)
                    .flatten(2, 3)
                )
                cache.index_copy_(0, indices, permuted)


def nixl_pair(
    p_tp: int, d_tp: int, heads: int, p_n: int, d_n: int, p_layout: str, d_layout: str, mla: bool
) -> tuple[list[Manifest], list[Manifest], bool, dict[tuple[int, str], int]]:
    """Both engines' manifests (derived before any byte moves), whether vLLM refuses the pair,
    and, when it does not, the first wrong byte per (D rank, layer) after vLLM's own moves."""
    layers = 2
    d_blocks = 2
    p_blocks = d_blocks * max(1, d_n // p_n) + 1  # other block counts on each side
    prefill = [
        engine_rank(p_tp, r, heads, p_n, p_layout, p_blocks, mla, layers) for r in range(p_tp)
    ]
    decode = [
        {
            name: torch.zeros_like(t)
            for name, t in engine_rank(d_tp, r, heads, d_n, d_layout, d_blocks, mla, layers).items()
        }
        for r in range(d_tp)
    ]
    senders = [manifest_of(c, p_tp, r, heads, p_layout, mla) for r, c in enumerate(prefill)]
    receivers = [manifest_of(c, d_tp, r, heads, d_layout, mla) for r, c in enumerate(decode)]
    p_len = prefill[0]["model.layers.0.attn"][0].numel() * 4
    d_len = decode[0]["model.layers.0.attn"][0].numel() * 4
    if vllm_refuses(p_tp, d_tp, p_n, d_n, heads, p_layout, d_layout, mla, p_len, d_len):
        return senders, receivers, True, {}
    vllm_moves(prefill, decode, heads, p_n, d_n, d_layout, mla)
    wrong = {}
    for rank, caches in enumerate(decode):
        for layer, (name, cache) in enumerate(caches.items()):
            first = first_wrong_byte(cache, expected(cache, layer, rank, d_tp, heads, mla))
            if first is not None:
                wrong[(rank, name)] = first
    return senders, receivers, False, wrong


def nixl_case(
    p_tp: int, d_tp: int, heads: int, p_n: int, d_n: int, p_layout: str, d_layout: str, mla: bool
) -> tuple[DiffReport, bool, dict[tuple[int, str], int]]:
    """The oracle's verdict and first wrong bytes next to safeview's report."""
    senders, receivers, refused, wrong = nixl_pair(
        p_tp, d_tp, heads, p_n, d_n, p_layout, d_layout, mla
    )
    report = safeview.diff(senders, receivers, rule="vllm_nixl")
    return report, not refused and not wrong, wrong


def assert_agrees(report: DiffReport, ok: bool, wrong: dict[tuple[int, str], int]) -> None:
    assert report.compatible == ok, [f.message for f in report.findings]
    if wrong:
        named = {(f.receiver_rank, f.layer): f.byte for f in report.findings if f.kind == "byte"}
        assert named == wrong


VALID_NIXL = [
    pytest.param(1, 1, 8, 16, 16, "LBHNC", "LBHNC", False, id="identical"),
    pytest.param(2, 4, 8, 16, 16, "LBHNC", "LBHNC", False, id="P-TP2-to-D-TP4"),
    pytest.param(4, 2, 8, 16, 16, "LBHNC", "LBHNC", False, id="P-TP4-to-D-TP2"),
    pytest.param(8, 16, 8, 16, 16, "LBHNC", "LBHNC", False, id="H8-TP8-to-TP16-vllm45330"),
    pytest.param(2, 4, 1, 16, 16, "LBHNC", "LBHNC", True, id="MLA-replicated"),
    pytest.param(4, 1, 1, 16, 32, "LBHNC", "LBHNC", True, id="MLA-P-TP4-D-TP1-blocks-16-32"),
    pytest.param(2, 2, 8, 16, 32, "LBHNC", "LBHNC", False, id="N_D-2x-N_P"),
    pytest.param(2, 4, 8, 8, 16, "LBHNC", "LBHNC", False, id="N_D-2x-N_P-and-TP2-to-TP4"),
    pytest.param(2, 2, 8, 16, 32, "LBNHC", "LBNHC", False, id="N_D-2x-N_P-NHD"),
]


@pytest.mark.parametrize(
    ("p_tp", "d_tp", "heads", "p_n", "d_n", "p_layout", "d_layout", "mla"), VALID_NIXL
)
def test_pairs_vllm_transfers_correctly_diff_clean(
    p_tp: int, d_tp: int, heads: int, p_n: int, d_n: int, p_layout: str, d_layout: str, mla: bool
) -> None:
    report, ok, wrong = nixl_case(p_tp, d_tp, heads, p_n, d_n, p_layout, d_layout, mla)
    assert ok, wrong
    assert report.compatible, [f.message for f in report.findings]


def test_kernel_block_mismatch_of_vllm42895_names_both_block_sizes() -> None:
    report, ok, _ = nixl_case(4, 1, 8, 16, 32, "LBHNC", "LBHNC", False)
    assert not ok
    assert not report.compatible
    first = report.findings[0]
    assert first.kind == "refused"
    assert "16" in first.message
    assert "32" in first.message
    assert first.layer == "model.layers.0.attn"
    with pytest.raises(LayoutMismatchError, match=r"model\.layers\.0\.attn"):
        report.raise_for_mismatch()


def test_same_layout_string_other_physical_layout_names_the_first_wrong_byte() -> None:
    # both engines report LBHNC; P's layer 1 is really NHD: vLLM cannot see it, bytes land wrong
    prefill = [engine_rank(1, 0, 2, 4, "LBHNC", 2, False, 2)]
    nhd = engine_rank(1, 0, 2, 4, "LBNHC", 2, False, 2)
    prefill[0]["model.layers.1.attn"] = nhd["model.layers.1.attn"]
    decode = [
        {n: torch.zeros_like(t) for n, t in engine_rank(1, 0, 2, 4, "LBHNC", 2, False, 2).items()}
    ]
    report = safeview.diff(
        [manifest_of(prefill[0], 1, 0, 2, "LBHNC", False)],
        [manifest_of(decode[0], 1, 0, 2, "LBHNC", False)],
        rule="vllm_nixl",
    )
    vllm_moves(prefill, decode, 2, 4, 4, "LBHNC", False)
    cache = decode[0]["model.layers.1.attn"]
    wrong = first_wrong_byte(cache, expected(cache, 1, 0, 1, 2, False))
    assert wrong is not None
    assert [(f.layer, f.byte) for f in report.findings] == [("model.layers.1.attn", wrong)]
    assert report.findings[0].message == (
        "model.layers.1.attn: receiver page byte 32 reads K token 1 head 0 element 0, the "
        "sender wrote K token 0 head 1 element 0 there (receiver rank 0), from sender ranks [0]"
    )


def test_a_topology_layout_is_read_as_vllm_reads_it_and_a_typo_is_named() -> None:
    """The layout string a topology reports: vLLM's names, in any case, and its older words HND
    and NHD (what its configuration still takes for LBHNC and LBNHC); a refusal names the
    string it read and what it expected; any other string is a ManifestError naming it and the
    names accepted, not a refusal of every layer (which "HND" and "foo" both were)."""

    def side(tp: int, physical: str, said: str) -> list[Manifest]:
        return [
            manifest_of(engine_rank(tp, r, 8, 16, physical, 2, False, 2), tp, r, 8, said, False)
            for r in range(tp)
        ]

    # TP 2 -> 4: vLLM splits P's pages by heads, which needs D's heads outermost
    for p_said, d_said in (("HND", "HND"), ("hnd", "LBHNC"), ("LBHNC", "HND")):
        report = safeview.diff(side(2, "LBHNC", p_said), side(4, "LBHNC", d_said), "vllm_nixl")
        assert report.compatible, (p_said, d_said, [f.message for f in report.findings])
    report = safeview.diff(side(2, "LBNHC", "NHD"), side(4, "LBNHC", "NHD"), "vllm_nixl")
    assert {f.kind for f in report.findings} == {"refused"}
    assert "heterogeneous TP needs a block-contiguous layout on D, heads before tokens in a " \
        "block (LBHNC or BLHNC; HND in vLLM's older words): D's layout 'NHD' (LBNHC)" in \
        report.findings[0].message  # fmt: skip
    report = safeview.diff(side(2, "LBHNC", "HND"), side(4, "LBNHC", "LBNHC"), "vllm_nixl")
    assert "layouts differ: P 'HND' (LBHNC), D 'LBNHC'" in report.findings[0].message
    for typo in ("foo", "HDN", "NL_X_NB_NH_BS_2HS"):
        with pytest.raises(ManifestError) as bad:
            safeview.diff(side(2, "LBHNC", "LBHNC"), side(4, "LBHNC", typo), "vllm_nixl")
        assert bad.value.field == "D rank 0: topology.layout"
        assert bad.value.value == typo
        assert str(bad.value).endswith(
            f"{typo!r} is not a layout of vLLM's (kv_cache_layout): expected one of LBHNC, "
            "LBNHC, LHBNC, BLHNC, BLNHC, BHLNC, or HND (LBHNC), NHD (LBNHC)"
        )
    with pytest.raises(ManifestError, match=r"^P: topology\.layout: 'foo' is not"):
        safeview.diff(side(2, "LBHNC", "foo"), side(4, "LBHNC", "LBHNC"), "vllm_nixl")


def test_nhd_against_hnd_pr33007_is_a_mismatch_under_a_page_copy() -> None:
    hnd = manifest_of(engine_rank(1, 0, 4, 16, "LBHNC", 3, False, 1), 1, 0, 4, "LBHNC", False)
    nhd = manifest_of(engine_rank(1, 0, 4, 16, "LBNHC", 3, False, 1), 1, 0, 4, "LBNHC", False)
    report = safeview.diff(nhd, hnd)
    assert not report.compatible
    assert report.findings[0].byte == 2 * D * 4  # token 1 of head 0 in NHD, head 1 in HND... first
    assert "reads K token 1 head 0" in report.findings[0].message


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    p_tp=st.sampled_from([1, 2, 4]),
    d_tp=st.sampled_from([1, 2, 4]),
    heads=st.sampled_from([1, 2, 4]),
    p_n=st.sampled_from([2, 4]),
    d_n=st.sampled_from([2, 4, 8]),
    p_layout=st.sampled_from(["LBHNC", "LBNHC"]),
    d_layout=st.sampled_from(["LBHNC", "LBNHC"]),
    mla=st.booleans(),
)
def test_vllm_nixl_diff_agrees_with_the_byte_oracle(
    p_tp: int, d_tp: int, heads: int, p_n: int, d_n: int, p_layout: str, d_layout: str, mla: bool
) -> None:
    report, ok, wrong = nixl_case(p_tp, d_tp, heads, p_n, d_n, p_layout, d_layout, mla)
    assert_agrees(report, ok, wrong)


# -- page copies between any two layouts --------------------------------------------------------

LOGICAL = ("block", "kv", "token", "head", "element")


def strided_cache(order: tuple[str, ...], sizes: dict[str, int], heads: list[int]) -> torch.Tensor:
    """A cache whose physical axis order is ``order``, seen in the logical order LOGICAL, filled
    with its codes."""
    physical = torch.zeros([sizes[a] for a in order], dtype=torch.int32)
    tensor = physical.permute([order.index(a) for a in LOGICAL])
    for b, kv, t, h, e in itertools.product(*(range(sizes[a]) for a in LOGICAL)):
        tensor[b, kv, t, h, e] = code(0, kv, t, heads[h], e)
    return tensor


def chunks(tensor: torch.Tensor, block: int) -> list[tuple[int, int]]:
    """(first byte, length) of block ``block``'s runs, in address order: one page, or a K and a
    V page apart when K/V lies outside the block axis."""
    strides = dict(zip(LOGICAL, tensor.stride()))
    sizes = dict(zip(LOGICAL, tensor.shape))
    inner = [a for a in LOGICAL[2:] if sizes[a] > 1] + (
        ["kv"] if strides["kv"] < strides["block"] else []
    )
    span = 4 * (1 + sum((sizes[a] - 1) * strides[a] for a in inner))
    start = block * strides["block"] * 4
    if strides["kv"] < strides["block"]:
        return [(start, span)]
    return [(start + kv * strides["kv"] * 4, span) for kv in range(2)]


@settings(max_examples=60, deadline=None)
@given(
    sender_order=st.permutations(LOGICAL[1:]),
    receiver_order=st.permutations(LOGICAL[1:]),
    sender_kv_outer=st.booleans(),
    receiver_kv_outer=st.booleans(),
    tokens=st.sampled_from([1, 2, 3]),
    heads=st.sampled_from([1, 2]),
)
def test_page_copy_diff_agrees_with_the_byte_oracle(
    sender_order: list[str],
    receiver_order: list[str],
    sender_kv_outer: bool,
    receiver_kv_outer: bool,
    tokens: int,
    heads: int,
) -> None:
    sizes = {"block": 2, "kv": 2, "token": tokens, "head": heads, "element": 2}

    def order(inner: list[str], kv_outer: bool) -> tuple[str, ...]:
        if kv_outer:
            return ("kv", "block", *[a for a in inner if a != "kv"])
        return ("block", *inner)

    sender = strided_cache(order(sender_order, sender_kv_outer), sizes, list(range(heads)))
    receiver = torch.zeros_like(
        strided_cache(order(receiver_order, receiver_kv_outer), sizes, list(range(heads)))
    )
    receiver.copy_(torch.zeros_like(receiver))
    s_bytes, r_bytes = page_bytes_of(sender), page_bytes_of(receiver)
    for block in range(2):
        run = np.concatenate([s_bytes[a : a + n] for a, n in chunks(sender, block)])
        at = 0
        for a, n in chunks(receiver, block):
            r_bytes[a : a + n] = run[at : at + n]
            at += n
    want = torch.zeros_like(receiver)
    for b, kv, t, h, e in itertools.product(*(range(sizes[a]) for a in LOGICAL)):
        want[b, kv, t, h, e] = code(0, kv, t, h, e)
    report = safeview.diff(
        describe({"l": sender}, axes=LOGICAL), describe({"l": receiver}, axes=LOGICAL)
    )
    assert report.compatible == bool(torch.equal(receiver, want)), [
        f.message for f in report.findings
    ]
    if not report.compatible:
        wrong = (receiver[0] != want[0]).nonzero().tolist()
        strides = receiver.stride()
        # page byte: address order over the block's chunks
        addresses = sorted(sum(i * s for i, s in zip(index, strides[1:])) * 4 for index in wrong)
        runs = chunks(receiver, 0)

        def page_byte(address: int) -> int:
            before = 0
            for a, n in runs:
                if a <= address < a + n:
                    return before + address - a
                before += n
            raise AssertionError(address)

        assert report.findings[0].byte == page_byte(addresses[0])


# -- the other pairs users hit ------------------------------------------------------------------


def test_kv_axis_move_of_flexkv_pr187_is_found_in_place() -> None:
    engine = assumed(
        "NB_TWO_BS_NH_HS",
        layers=["layers.0"],
        num_blocks=8,
        block_tokens=16,
        num_heads=4,
        head_size=8,
        dtype="bfloat16",
    )
    connector = assumed(
        "TWO_NB_BS_NH_HS",
        layers=["layers.0"],
        num_blocks=8,
        block_tokens=16,
        num_heads=4,
        head_size=8,
        dtype="bfloat16",
    )
    report = safeview.diff(engine, connector, rule="in_place")
    assert not report.compatible
    page = 16 * 4 * 8 * 2
    first = report.findings[0]
    assert first.byte == page  # the connector's V page of block 0 is the engine's block 4 K
    assert first.receiver_reads == Meaning("data", 1, 0, 0, 0, 0, 0, "bfloat16")
    assert first.sender_wrote is not None
    assert first.sender_wrote.block == 4
    assert safeview.diff(engine, engine, rule="in_place").compatible


def test_packed_nh2_of_lmcache4463_same_shape_other_meaning() -> None:
    engine = assumed(
        "NB_NH_BS_2HS",
        layers=["layers.0"],
        num_blocks=4,
        block_tokens=16,
        num_heads=2,
        head_size=8,
        dtype="float16",
    )
    connector = assumed(
        "NB_TWO_BS_NH_HS",
        layers=["layers.0"],
        num_blocks=4,
        block_tokens=16,
        num_heads=2,
        head_size=8,
        dtype="float16",
    )
    report = safeview.diff(engine, connector, rule="in_place")
    assert report.findings[0].message == (
        "layers.0: block 0's page byte 16 reads block 0 K token 0 head 1 element 0, "
        "the sender wrote block 0 V token 0 head 0 element 0 there"
    )


def test_pairing_by_name_never_by_position_vllm57661() -> None:
    # the same layers in another order, and one layer whose page is longer: only it is named
    small = assumed(
        "NB_NH_BS_2HS",
        layers=["swa.0", "swa.1"],
        num_blocks=4,
        block_tokens=16,
        num_heads=2,
        head_size=8,
        dtype="float16",
    )
    state = assumed(
        "NB_NH_BS_2HS",
        layers=["state_cache"],
        num_blocks=4,
        block_tokens=16,
        num_heads=4,
        head_size=8,
        dtype="float16",
    )
    sender = Manifest(layers={**small.layers, **state.layers})
    receiver = Manifest(layers={"state_cache": state.layers["state_cache"], **small.layers})
    assert safeview.diff(sender, receiver).compatible
    # a receiver that took the SWA page length for state_cache (deduplicated by address)
    wrong = Manifest(layers={**small.layers, "state_cache": small.layers["swa.0"]})
    report = safeview.diff(sender, wrong)
    assert [f.layer for f in report.findings] == ["state_cache"]


def test_a_layer_on_one_side_only_is_a_finding_and_no_common_layer_an_error() -> None:
    one = assumed(
        "NB_NH_BS_2HS",
        layers=["a", "b"],
        num_blocks=2,
        block_tokens=4,
        num_heads=1,
        head_size=2,
        dtype="float16",
    )
    other = assumed(
        "NB_NH_BS_2HS",
        layers=["a"],
        num_blocks=2,
        block_tokens=4,
        num_heads=1,
        head_size=2,
        dtype="float16",
    )
    report = safeview.diff(one, other)
    assert [(f.kind, f.layer) for f in report.findings] == [("missing_layer", "b")]
    elsewhere = assumed(
        "NB_NH_BS_2HS",
        layers=["z"],
        num_blocks=2,
        block_tokens=4,
        num_heads=1,
        head_size=2,
        dtype="float16",
    )
    with pytest.raises(ManifestError, match="no name in common"):
        safeview.diff(one, elsewhere)


def test_other_dtype_is_a_finding() -> None:
    half = assumed(
        "NB_NH_BS_2HS",
        layers=["a"],
        num_blocks=2,
        block_tokens=4,
        num_heads=1,
        head_size=2,
        dtype="float16",
    )
    brain = assumed(
        "NB_NH_BS_2HS",
        layers=["a"],
        num_blocks=2,
        block_tokens=4,
        num_heads=1,
        head_size=2,
        dtype="bfloat16",
    )
    assert safeview.diff(half, brain).findings[0].kind == "dtype"


def test_diff_of_two_1000_layer_manifests_names_every_moved_layer() -> None:
    names = [f"model.layers.{i}.self_attn" for i in range(1000)]
    hnd = assumed(
        "NB_NH_BS_2HS",
        layers=names,
        num_blocks=2000,
        block_tokens=16,
        num_heads=8,
        head_size=128,
        dtype="bfloat16",
    )
    nhd = assumed(
        "NB_BS_NH_2HS",
        layers=names,
        num_blocks=2000,
        block_tokens=16,
        num_heads=8,
        head_size=128,
        dtype="bfloat16",
    )
    read_back = Manifest.from_json(hnd.to_json())
    # how long it takes is measured in benchmarks/bench_diff.py, with its spread, not here
    layout_diff._CACHE.clear()
    same = safeview.diff(hnd, read_back)
    other = safeview.diff(hnd, nhd)
    assert same.compatible
    assert len(other.findings) == 1000
    assert sorted(f.layer for f in other.findings if f.layer) == sorted(names)


FORMAT_AXES = {"TWO": "kv", "NB": "block", "BS": "token", "NH": "head", "HS": "element"}


def lmcache_buffer(parts: list[str], sizes: dict[str, int]) -> np.ndarray:
    """A dense int32 buffer in ``parts``'s axis order, every element its own code."""
    shape = [sizes[FORMAT_AXES[part]] for part in parts]
    index = np.indices(shape)
    axis = {FORMAT_AXES[part]: index[at] for at, part in enumerate(parts)}
    token = axis["block"] * sizes["token"] + axis["token"]
    values = (((axis["kv"] * 4096 + token) * 64 + axis["head"]) * 64) + axis["element"] + 1
    flat: np.ndarray = values.astype(np.int32).ravel()
    return flat


@settings(max_examples=60, deadline=None)
@given(
    sender=st.permutations(list(FORMAT_AXES)),
    receiver=st.permutations(list(FORMAT_AXES)),
    blocks=st.sampled_from([1, 2, 3, 5]),
    heads=st.sampled_from([1, 2]),
)
def test_in_place_diff_agrees_with_the_byte_oracle(
    sender: list[str], receiver: list[str], blocks: int, heads: int
) -> None:
    sizes = {"kv": 2, "block": blocks, "token": 2, "head": heads, "element": 2}
    written = lmcache_buffer(sender, sizes)  # what the engine wrote, in its format
    expected_there = lmcache_buffer(receiver, sizes)  # what the connector takes it to be
    ok = bool(np.array_equal(written, expected_there))
    common = dict(
        layers=["l"],
        num_blocks=blocks,
        block_tokens=2,
        num_heads=heads,
        head_size=2,
        dtype="int32",
    )
    report = safeview.diff(
        assumed("_".join(sender), **common),  # type: ignore[arg-type]
        assumed("_".join(receiver), **common),  # type: ignore[arg-type]
        rule="in_place",
    )
    assert report.compatible == ok, [f.message for f in report.findings]


def test_diff_reports_through_the_one_finding_type() -> None:
    """A diff finding is a safeview.Finding of a kind of the one vocabulary, its sentence made by
    findings.py; its JSON is the object `safeview diff --json` documents."""
    from safeview.findings import DIFF_KINDS, KINDS, Finding

    def fp16(format: str, layers: list[str], dtype: str = "float16") -> Manifest:
        return assumed(
            format,
            layers=layers,
            num_blocks=2,
            block_tokens=4,
            num_heads=2,
            head_size=2,
            dtype=dtype,
        )

    report = safeview.diff(
        fp16("NB_NH_BS_2HS", ["a", "b", "c"]),
        fp16("NB_BS_NH_2HS", ["a", "c", "d"]),
    )
    kinds = [(f.kind, f.layer) for f in report.findings]
    assert kinds == [("missing_layer", "b"), ("missing_layer", "d"), ("byte", "a"), ("byte", "c")]
    assert layout_diff.Mismatch is Finding
    for finding in report.findings:
        assert isinstance(finding, Finding)
        assert finding.kind in DIFF_KINDS
        assert set(DIFF_KINDS) <= set(KINDS)
        assert finding.views == (finding.layer,)
    byte = report.findings[2]
    assert byte.receiver_reads is not None
    assert byte.sender_wrote is not None
    assert byte.receiver_reads != byte.sender_wrote
    assert (
        byte.message
        == Finding.diff_byte(
            "a",
            byte=byte.byte or 0,
            receiver_reads=byte.receiver_reads,
            sender_wrote=byte.sender_wrote,
            receiver_rank=0,
            sender_ranks=(0,),
        ).message
    )
    assert set(byte.to_json()) == {
        "kind",
        "layer",
        "byte",
        "block",
        "receiver_rank",
        "sender_ranks",
        "receiver_reads",
        "sender_wrote",
        "message",
    }
    assert byte.to_json()["receiver_reads"]["words"] == byte.receiver_reads.words()
    dtype = safeview.diff(fp16("NB_NH_BS_2HS", ["a"]), fp16("NB_NH_BS_2HS", ["a"], "bfloat16"))
    [finding] = dtype.findings
    assert (finding.kind, finding.byte) == ("dtype", 0)
    assert finding.message == "a: the receiver reads bfloat16, the sender wrote float16"


# -- in place, one tensor per layer (issue 26, point 10) ----------------------------------------


def vllm_layers(storage: str, layers: int = 3) -> dict[str, torch.Tensor]:
    """vLLM's HND caches, [B, H, N, K|V] int32, every element its code: one tensor per layer
    (``per_layer``) or views of one buffer, layer after layer (``one_buffer``, vLLM 0.33)."""
    blocks, heads, tokens = 3, 2, 2
    shape = (blocks, heads, tokens, 2 * D)
    size = blocks * heads * tokens * 2 * D
    buffer = torch.zeros(layers * size, dtype=torch.int32)
    caches = {}
    for layer in range(layers):
        if storage == "per_layer":
            tensor = torch.zeros(shape, dtype=torch.int32)
        else:
            tensor = buffer[layer * size : (layer + 1) * size].view(shape)
        for b, h, t, c in itertools.product(*(range(n) for n in shape)):
            kv, element = divmod(c, D)
            tensor[b, h, t, c] = code(layer, kv, b * tokens + t, h, element)
        caches[f"layers.{layer}"] = tensor
    return caches


CONNECTOR_PARTS = {"NB": "block", "NH": "head", "BS": "token", "TWO": "kv", "HS": "element"}


def connector_reads_right(caches: dict[str, torch.Tensor], format: str) -> bool:
    """The oracle: the connector is handed each layer's tensor (its first byte) and reads the
    bytes there as a dense tensor in ``format``; each element must be what the engine meant."""
    parts = format.removeprefix("NL_X_").split("_")
    for layer, tensor in enumerate(caches.values()):
        blocks, heads, tokens, width = tensor.shape
        sizes = {"block": blocks, "head": heads, "token": tokens, "kv": 2, "element": width // 2}
        shape = [sizes[CONNECTOR_PARTS[part]] for part in parts]
        whole = torch.empty(0, dtype=torch.int32).set_(tensor.untyped_storage())
        read = whole[tensor.storage_offset() :][: tensor.numel()].view(shape)
        for index in itertools.product(*(range(n) for n in shape)):
            at = {CONNECTOR_PARTS[part]: i for part, i in zip(parts, index)}
            meant = code(layer, at["kv"], at["block"] * tokens + at["token"], at["head"],
                         at["element"])  # fmt: skip
            if int(read[index]) != meant:
                return False
    return True


@pytest.mark.parametrize("storage", ["per_layer", "one_buffer"])
@pytest.mark.parametrize(
    "format", ["NL_X_NB_NH_BS_TWO_HS", "NL_X_NB_BS_NH_TWO_HS", "NL_X_TWO_NB_NH_BS_HS"]
)
def test_in_place_over_per_layer_tensors_agrees_with_the_byte_oracle(
    storage: str, format: str
) -> None:
    caches = vllm_layers(storage)
    engine = describe(caches, axes=vllm_axes())
    connector = assumed(format, layers=list(caches), num_blocks=3, block_tokens=2,
                        num_heads=2, head_size=D, dtype="int32")  # fmt: skip
    report = safeview.diff(engine, connector, rule="in_place")
    right = connector_reads_right(caches, format)
    assert report.compatible == right, [f.message for f in report.findings]
    assert right == (format == "NL_X_NB_NH_BS_TWO_HS")
    if not right:  # every layer is read the same wrong way, each from its own first byte
        assert [f.layer for f in report.findings] == list(caches)
        assert len({(f.byte, f.receiver_reads, f.sender_wrote) for f in report.findings}) == 1


# -- which global head a byte is (the TP rank's share) ------------------------------------------


def test_a_page_copy_to_a_rank_of_other_heads_names_the_head() -> None:
    # the same layout, the same page size: only the global heads differ (rank 0 holds heads 0
    # and 1, rank 1 heads 2 and 3); a copy of rank 0's pages into rank 1's is wrong everywhere
    tensor = torch.zeros(4, 2, 16, 2 * D, dtype=torch.float16, device="meta")

    def rank(r: int) -> Manifest:
        return describe({"l": tensor}, axes=vllm_axes(),
                        topology={"tp_rank": r, "tp_size": 2, "total_kv_heads": 4})  # fmt: skip

    assert rank(0).layers["l"].heads == (0, 1)
    assert rank(1).layers["l"].heads == (2, 3)
    report = safeview.diff(rank(0), rank(1))
    [finding] = report.findings
    assert (finding.kind, finding.byte) == ("byte", 0)
    assert finding.receiver_reads == Meaning("data", 0, 0, 2, 0, 0, None, "float16")
    assert finding.sender_wrote == Meaning("data", 0, 0, 0, 0, 0, None, "float16")
    assert finding.message == (
        "l: receiver page byte 0 reads K token 0 head 2 element 0, the sender wrote K token 0 "
        "head 0 element 0 there"
    )
    # vLLM's NIXL connector reads rank 1's heads from P's rank 1: told the truth, compatible
    assert safeview.diff([rank(0), rank(1)], [rank(0), rank(1)], rule="vllm_nixl").compatible
    swapped = [rank(1).model_copy(update={"topology": rank(0).topology}), rank(1)]
    assert not safeview.diff(swapped, [rank(0), rank(1)], rule="vllm_nixl").compatible


# -- ranks: which were judged, which are missing (newcomer point 5) ------------------------------


def ranks_of(tp: int, ranks: list[int], connector: str | None = None) -> list[Manifest]:
    return [
        assumed(
            "NB_NH_BS_2HS",
            layers=["l"],
            num_blocks=4,
            block_tokens=16,
            num_heads=4 // tp,
            head_size=D,
            dtype="float16",
            topology={"tp_rank": r, "tp_size": tp, "total_kv_heads": 4, "connector": connector},
        )
        for r in ranks
    ]


def test_a_rank_missing_on_either_side_is_a_finding_and_the_ranks_judged_are_said() -> None:
    whole = safeview.diff(ranks_of(2, [0, 1]), ranks_of(4, [0, 1, 2, 3]), rule="vllm_nixl")
    assert whole.compatible
    assert whole.ranks() == "sender ranks 0-1 of TP 2, receiver ranks 0-3 of TP 4"
    assert (whole.to_json()["receiver_ranks"], whole.to_json()["receiver_tp_size"]) == (
        [0, 1, 2, 3],
        4,
    )
    half = safeview.diff(ranks_of(2, [0, 1]), ranks_of(2, [0]))
    [finding] = half.findings
    assert (finding.kind, finding.receiver_rank, finding.layer) == ("missing_rank", 1, None)
    assert finding.message == (
        "the receiver declares TP 2 but no manifest of its rank 1 was given: rank 1 is not judged"
    )
    assert half.ranks() == "sender ranks 0-1 of TP 2, receiver rank 0 of TP 2"
    sender_half = safeview.diff(ranks_of(2, [1]), ranks_of(2, [0, 1]), rule="vllm_nixl")
    kinds = [(f.kind, f.sender_ranks, f.receiver_rank) for f in sender_half.findings]
    assert kinds == [("missing_rank", (0,), None)]  # once, not once per layer and rank
    # one Manifest is one rank, judged alone (the plugin judges one decode rank at a time)
    assert safeview.diff(ranks_of(2, [0, 1]), ranks_of(2, [1])[0], rule="vllm_nixl").compatible


# -- the rule of the connector that wrote the manifests (newcomer point 4) ----------------------


def test_without_a_rule_the_diff_uses_the_rule_of_the_connector_the_manifests_name() -> None:
    p, d = ranks_of(2, [0, 1], "NixlConnector"), ranks_of(4, [0, 1, 2, 3], "NixlConnector")
    report = safeview.diff(p, d)
    assert (report.rule, report.rule_from) == ("vllm_nixl", "connector NixlConnector")
    assert report.compatible
    assert not safeview.diff(p, d, rule="page_copy").compatible
    plain = safeview.diff(ranks_of(2, [0, 1]), ranks_of(2, [0, 1]))
    assert (plain.rule, plain.rule_from) == ("page_copy", "default")
    other = safeview.diff(ranks_of(1, [0], "LMCacheConnectorV1"), ranks_of(1, [0]))
    assert (other.rule, other.rule_from) == ("page_copy", "connector LMCacheConnectorV1")
