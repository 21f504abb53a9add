"""The digest's two CPU kernels of the rows' products (issue 35): ``torch._int_mm`` where a
probe finds it exact and it is not much slower than the other, else the bytes widened to int32
a few pages at a time and multiplied by torch's int32 product. Both give every row's exact
product with ``R`` (against int64 numpy here), so a digest is the formula's value whichever the
CPU picks; in a process held to AVX2 (``ONEDNN_MAX_CPU_ISA``, ``ATEN_CPU_CAPABILITY``) too,
where oneDNN's int8 product adds pairs into int16 (exact for ``R``'s weights of at most 64)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import safeview
from safeview.manifest import _digest_torch
from safeview.manifest.digest import row_weights

sys.path.insert(0, str(Path(__file__).parent))

from test_digest import _content, _reference, _side

AVX2_ONLY = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
X86 = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def _products(view: torch.Tensor, length: int) -> np.ndarray:
    """Each row of ``view`` (its bytes in row-major order, ``length`` a row) times ``R``, in
    int64 numpy."""
    rows = view.contiguous().view(-1, length).numpy().astype(np.int64)
    return rows @ np.array(row_weights(length), dtype=np.int64)


def _widened(view: torch.Tensor, length: int, wide: torch.Tensor | None = None) -> np.ndarray:
    out = torch.full((view.numel() // length, 2), -1, dtype=torch.int32)
    _digest_torch._blocks_times_r(view, length, "widen", out, wide)
    return out.numpy().astype(np.int64)


def test_the_widened_kernel_gives_each_rows_exact_product_in_any_page_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Head-major pages read in place, token-major ones (a strided view, each block's rows
    gathered in its own order), an MLA latent's rows (1,152 bytes, not a multiple of 256) and
    the longest piece (16 KiB, bytes at the lane's extremes): widened a few blocks
    at a time (a batch here of two pages, or of one page larger than a batch), or all at once
    into a gather's buffer, each row's product is numpy's."""
    monkeypatch.setattr(_digest_torch, "_WIDEN_BYTES", 2 * 4 * 16 * 64)  # two of the pages below
    generator = torch.Generator().manual_seed(35)
    pages = torch.randint(-128, 128, (7, 16, 4, 64), dtype=torch.int8, generator=generator)
    token_major = pages.permute(0, 2, 1, 3)  # rows of a head, tokens apart in memory
    assert not token_major.is_contiguous()
    for view in (pages, token_major):
        assert (_widened(view, 64) == _products(view, 64)).all()
        wide = torch.empty(view.shape, dtype=torch.int32)
        assert (_widened(view, 64, wide) == _products(view, 64)).all()
    latent = torch.randint(-128, 128, (5, 16, 1152), dtype=torch.int8, generator=generator)
    assert (_widened(latent, 1152) == _products(latent, 1152)).all()
    weights = np.array(row_weights(1 << 14), dtype=np.int64)[:, 0]
    extreme = np.where(weights > 0, 127, -128).astype(np.int8)  # lane 0 at its largest
    opposite = np.where(weights > 0, -128, 127).astype(np.int8)  # and at its smallest
    longest = torch.from_numpy(np.stack([extreme, opposite, extreme])).view(3, 1, 1 << 14)
    found = _widened(longest, 1 << 14)
    assert found[0, 0] == int(weights.clip(0).sum() * 127 + weights.clip(None, 0).sum() * -128)
    assert (found == _products(longest, 1 << 14)).all()


def test_the_int8_kernel_and_the_widened_one_agree_where_int_mm_is_exact() -> None:
    """Where this CPU's ``torch._int_mm`` is exact, the int8 kernel's products (rows four at
    a time, or one) are the widened kernel's."""
    if not _digest_torch._int_mm_exact():
        pytest.skip("torch._int_mm is not exact on this CPU: the int8 kernel is never used here")
    generator = torch.Generator().manual_seed(36)
    pages = torch.randint(-128, 128, (6, 2, 8, 256), dtype=torch.int8, generator=generator)
    for view in (pages, pages[:, :, :7]):  # 4-row groups where they lie in order, else one by one
        out = torch.empty(view.numel() // 256, 2, dtype=torch.int32)
        _digest_torch._blocks_times_r(view, 256, "int_mm", out)
        assert (out.numpy() == _widened(view, 256)).all()
        assert (out.numpy() == _products(view, 256)).all()


def test_the_transposed_int8_kernel_gives_each_rows_exact_product_lane_by_lane(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``"int_mm_t"`` (``R`` transposed times the rows transposed, where this CPU's oneDNN is
    exact so): each lane's products in a row of their own, numpy's, for head-major pages read
    in place, token-major ones and MLA rows of 576 bytes staged a few pages at a time, into a
    layer's lanes (a run of rows inside them: not contiguous) and into a buffer of their own."""
    if not _digest_torch._int_mm_exact(transposed=True):
        pytest.skip("the transposed product is not exact on this CPU: it is never used here")
    monkeypatch.setattr(_digest_torch, "_CHUNK_BYTES", 2 * 16 * 4 * 256)  # two pages below
    generator = torch.Generator().manual_seed(38)
    pages = torch.randint(-128, 128, (7, 16, 4, 256), dtype=torch.int8, generator=generator)
    pages[0] = 127
    pages[1] = -128
    latent = torch.randint(-128, 128, (5, 16, 576), dtype=torch.int8, generator=generator)
    small = pages[:1]  # one page: read without staging
    for view, length in (
        (pages, 256), (pages.permute(0, 2, 1, 3), 256), (latent, 576), (small, 256)
    ):  # fmt: skip
        rows = view.numel() // length
        lanes = torch.full((2, rows + 10), -1, dtype=torch.int32)
        _digest_torch._blocks_times_r(view, length, "int_mm_t", lanes[:, 5 : 5 + rows])
        assert (_products(view, length) == lanes[:, 5 : 5 + rows].numpy().T).all()
        assert (lanes[:, :5] == -1).all()  # nothing written past the run
        assert (lanes[:, 5 + rows :] == -1).all()
        own = torch.full((2, rows), -1, dtype=torch.int32)
        _digest_torch._blocks_times_r(view, length, "int_mm_t", own)
        assert (_products(view, length) == own.numpy().T).all()


def _hold_kernel(monkeypatch: pytest.MonkeyPatch, kernel: str) -> str:
    """The digest held to ``kernel`` (``"int_mm"``, ``"int_mm_t"`` or ``"widen"``; the test
    skipped where this CPU never uses it): ``_cpu_kernel``'s answer, which it returns, and
    ``_row_kernel``'s."""
    if kernel != "widen" and not _digest_torch._int_mm_exact(transposed=kernel == "int_mm_t"):
        pytest.skip(f"{kernel} is not exact on this CPU: it is never used here")
    base = "widen" if kernel == "widen" else "int_mm"
    monkeypatch.setattr(_digest_torch, "_KERNELS", {True: base, False: base})
    transposed = kernel == "int_mm_t"
    monkeypatch.setattr(_digest_torch, "_TRANSPOSED", {True: transposed, False: transposed})
    return base


@pytest.mark.parametrize("kernel", ["int_mm", "int_mm_t", "widen"])
def test_each_kernel_gives_the_formulas_digest_in_either_page_order_read_in_place_or_gathered(
    monkeypatch: pytest.MonkeyPatch, kernel: str
) -> None:
    """The whole digest held to each kernel (rows in 4-row groups, lane by lane, widened):
    the formula's value and the widened kernel's token values, head- and token-major pages,
    consecutive ids and scattered ones (gathered); rows longer than ``_TRANSPOSE_BYTES`` keep
    the 4-row groups."""
    base = _hold_kernel(monkeypatch, kernel)
    assert _digest_torch._row_kernel(base, 256) == kernel
    assert _digest_torch._row_kernel(base, _digest_torch._TRANSPOSE_BYTES + 1) == base
    content = _content(layers=2, positions=50, heads=2, size=64, dtype=torch.bfloat16, seed=91)
    expected = _reference(content, 50, heads=2)
    for layout in ("LBHNC", "LBNHC"):
        side = _side(content, tp=1, tokens=4, layout=layout, heads=2, seed=92)
        manifest, caches = side.manifests[0], side.caches[0]
        assert len(_digest_torch._runs(side.blocks)) > _digest_torch._MAX_RUNS  # gathered
        found = safeview.digest(manifest, caches, side.blocks, num_tokens=50)
        assert found.values == expected, (kernel, layout)
        # token values too: the widened kernel's (rows row by row, lanes beside each other)
        with monkeypatch.context() as held:
            held.setattr(_digest_torch, "_KERNELS", {True: "widen", False: "widen"})
            widened = safeview.digest(manifest, caches, side.blocks, num_tokens=50)
        assert found.tokens == widened.tokens, (kernel, layout)
        assert found == widened, (kernel, layout)
        blocks = list(range(len(side.blocks)))  # one run, read in place (other bytes there)
        assert safeview.digest(manifest, caches, blocks, num_tokens=50).values != expected


def test_a_gathers_batches_the_short_last_one_too_are_multiplied_in_their_own_buffers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With ``"int_mm_t"``, each batch of a CPU gather (the last, shorter than the others,
    too: its lanes a buffer of their own, not a strided part of a larger one, which
    ``torch._int_mm`` refuses) is multiplied straight from the gathered pages, never through
    the general kernel's copy; and the digest is the widened kernel's, in head- and token-major
    pages."""
    if not _digest_torch._int_mm_exact(transposed=True):
        pytest.skip("the transposed product is not exact on this CPU: it is never used here")
    monkeypatch.setattr(_digest_torch, "_KERNELS", {True: "int_mm", False: "int_mm"})
    monkeypatch.setattr(_digest_torch, "_TRANSPOSED", {True: True, False: True})
    content = _content(layers=2, positions=50, heads=2, size=64, dtype=torch.bfloat16, seed=93)
    general = _digest_torch._blocks_times_r
    calls: list[int] = []

    def counted(*args: object, **kwargs: object) -> None:
        calls.append(1)
        general(*args, **kwargs)  # type: ignore[arg-type]

    for layout in ("LBHNC", "LBNHC"):
        side = _side(content, tp=1, tokens=4, layout=layout, heads=2, seed=94)
        manifest, caches = side.manifests[0], side.caches[0]
        page = manifest.layers[next(iter(manifest.layers))].page_bytes
        monkeypatch.setattr(_digest_torch, "_CHUNK_BYTES", 3 * page)  # batches of 3 pages
        assert len(side.blocks) % 3  # a last batch shorter than the others
        calls.clear()
        with monkeypatch.context() as held:
            held.setattr(_digest_torch, "_blocks_times_r", counted)
            found = safeview.digest(manifest, caches, side.blocks, num_tokens=50)
        assert calls == [], layout
        with monkeypatch.context() as held:
            held.setattr(_digest_torch, "_KERNELS", {True: "widen", False: "widen"})
            assert found == safeview.digest(manifest, caches, side.blocks, num_tokens=50)


@pytest.mark.parametrize("in_place", [False, True])
def test_pages_whose_rows_leave_gaps_digest_as_the_widened_kernel_reads_them(
    in_place: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A page whose rows are not one matrix (each 64-byte row the first part of 80 bytes: a
    gap after every row) goes through the general kernel's copy, gathered or read in place,
    into a run of the layer's lanes: the digest is the widened kernel's."""
    generator = torch.Generator().manual_seed(39)
    cache = torch.randint(-128, 128, (40, 2, 3, 80), dtype=torch.int8, generator=generator)
    cache = cache[..., :64]
    assert not cache.is_contiguous()
    axes = ("block", "head", "token", "kv|element")
    topology = {"tp_rank": 0, "tp_size": 1, "total_kv_heads": 2}
    manifest = safeview.describe({"l0": cache}, axes=axes, topology=topology)
    ids = [int(b) for b in torch.randperm(40, generator=generator)[:17]]
    if in_place:
        monkeypatch.setattr(_digest_torch, "_GATHER_ON_CPU", False)
        ids = list(range(3, 20))
    general = _digest_torch._blocks_times_r
    calls: list[int] = []

    def counted(*args: object, **kwargs: object) -> None:
        calls.append(1)
        general(*args, **kwargs)  # type: ignore[arg-type]

    with monkeypatch.context() as held:
        held.setattr(_digest_torch, "_blocks_times_r", counted)
        found = safeview.digest(manifest, {"l0": cache}, ids)
    assert calls  # the general kernel ran
    with monkeypatch.context() as held:
        held.setattr(_digest_torch, "_KERNELS", {True: "widen", False: "widen"})
        assert found == safeview.digest(manifest, {"l0": cache}, ids)


@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")  # torch's, from flags
def test_a_digest_with_onednn_off_takes_the_widened_kernel_and_the_formulas_value(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With oneDNN off (``torch.backends.mkldnn.flags``) ``torch._int_mm`` is ATen's plain loop:
    the digest widens instead, and gives the formula's value, consecutive ids and gathered
    ones, as it does with oneDNN on (where this CPU may pick either kernel); its int32 buffer
    holds a gather's batch, ``_WIDEN_BYTES`` of pages, four times over."""
    monkeypatch.delattr(_digest_torch._SCRATCH, "wide", raising=False)  # another test's
    content = _content(layers=2, positions=50, heads=2, size=64, dtype=torch.bfloat16, seed=71)
    side = _side(content, tp=1, tokens=4, layout="LBNHC", heads=2, seed=72)
    manifest, caches = side.manifests[0], side.caches[0]
    both = (side.blocks, list(range(len(side.blocks))))
    assert len(_digest_torch._runs(side.blocks)) > _digest_torch._MAX_RUNS  # gathered
    with torch.backends.mkldnn.flags(enabled=False):
        assert _digest_torch._cpu_kernel() == "widen"
        off = [safeview.digest(manifest, caches, ids, num_tokens=50) for ids in both]
    on = [safeview.digest(manifest, caches, ids, num_tokens=50) for ids in both]
    assert off == on
    assert off[0].values == _reference(content, 50, heads=2)
    wide = getattr(_digest_torch._SCRATCH, "wide", None)
    assert wide is not None
    assert wide.numel() <= 4 * _digest_torch._WIDEN_BYTES  # bounded as a gather's batch


_AVX2_SCRIPT = """
import json, sys, torch
sys.path.insert(0, {tests!r})
from test_digest import _content, _digests, _side
from safeview.manifest import _digest_torch
content = _content(layers=2, positions=40, heads=4, size=64, dtype=torch.bfloat16, seed=81)
sides = [_side(content, tp=1, tokens=16, layout="LBHNC", heads=4, seed=82),
         _side(content, tp=1, tokens=4, layout="LBNHC", heads=4, seed=83)]
rows = torch.full((16, 256), 127, dtype=torch.int8)
rows[8:] = -128
wide = torch.full((256, 8), 127, dtype=torch.int8)  # weights past sv-digest-3's bound of 64
wide[:, 1::2] = -127
exact_127 = torch.equal(torch._int_mm(rows, wide).double(), rows.double() @ wide.double())
chosen = _digest_torch._cpu_kernel()
row_kernel = _digest_torch._row_kernel(chosen, 256)
values = {{}}
for kernel in ("int_mm", "widen"):
    _digest_torch._KERNELS.update({{True: kernel, False: kernel}})
    values[kernel] = [_digests(side, 40)[0].values for side in sides]
print(json.dumps({{
    "capability": torch.backends.cpu.get_cpu_capability(),
    "exact": _digest_torch._int_mm_exact(),
    "exact_transposed": _digest_torch._int_mm_exact(transposed=True),
    "row_kernel": row_kernel,
    "exact_127": exact_127,
    "kernel": chosen,
    "values": values,
}}))
"""


@pytest.mark.skipif(not X86, reason="AVX2 is an x86 instruction set")
def test_a_process_held_to_avx2_digests_as_the_formula_with_either_kernel() -> None:
    """A process whose oneDNN and ATen are held to AVX2 (as on an AVX2-only CPU): oneDNN's
    int8 product there reads the bytes as unsigned and adds pairs of products into int16 with
    saturation, so weights of 127 (``sv-digest-2``'s) come out wrong on a CPU with VNNI held
    so, and ``sv-digest-3``'s weights of at most 64 come out exact: the probe says so, and
    both kernels give the formula's values, head- and token-major, read in place and
    gathered."""
    script = _AVX2_SCRIPT.format(tests=str(Path(__file__).parent))
    env = {**os.environ, **AVX2_ONLY}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert found["capability"] == "AVX2"  # ATEN_CPU_CAPABILITY took effect
    content = _content(layers=2, positions=40, heads=4, size=64, dtype=torch.bfloat16, seed=81)
    expected = _reference(content, 40, heads=4)
    for kernel in ("int_mm", "widen"):
        for values in found["values"][kernel]:
            by_head = {name: {int(h): v for h, v in per.items()} for name, per in values.items()}
            assert by_head == expected, kernel
    assert found["exact"] is True
    assert found["kernel"] in ("int_mm", "widen")
    vnni = getattr(torch.cpu, "_is_vnni_supported", lambda: False)()
    if vnni and torch._C._has_mkldnn:
        assert found["exact_127"] is False  # ONEDNN_MAX_CPU_ISA took effect: saturation
        # the weights on the left are read as unsigned there: the transposed form is wrong,
        # and never used
        assert found["exact_transposed"] is False
    if not found["exact_transposed"]:
        assert found["row_kernel"] in ("int_mm", "widen")


def test_the_int8_kernel_reads_large_and_strided_views_through_a_bounded_kept_buffer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On CPU the int8 kernel copies a view larger than ``_CHUNK_BYTES`` (a run of consecutive
    pages) or strided (token-major pages) into a kept buffer of at most ``_CHUNK_BYTES``, a
    few pages at a time (``torch._int_mm`` reads it faster from the core's cache than from
    memory), and each row's product is numpy's: in batches of two pages, of one page larger
    than a batch, and of the last batch shorter than the others."""
    if not _digest_torch._int_mm_exact():
        pytest.skip("torch._int_mm is not exact on this CPU: the int8 kernel is never used here")
    monkeypatch.setattr(_digest_torch, "_CHUNK_BYTES", 2 * 16 * 4 * 256)  # two pages below
    monkeypatch.delattr(_digest_torch._SCRATCH, "stage", raising=False)  # another test's
    generator = torch.Generator().manual_seed(37)
    pages = torch.randint(-128, 128, (7, 16, 4, 256), dtype=torch.int8, generator=generator)
    token_major = pages.permute(0, 2, 1, 3)
    latent = torch.randint(-128, 128, (3, 64, 1152), dtype=torch.int8, generator=generator)
    for view, length in ((pages, 256), (token_major, 256), (latent, 1152)):
        out = torch.full((view.numel() // length, 2), -1, dtype=torch.int32)
        _digest_torch._blocks_times_r(view, length, "int_mm", out)
        assert (out.numpy() == _products(view, length)).all()
    stage = getattr(_digest_torch._SCRATCH, "stage", None)
    assert stage is not None  # the views were staged
    assert stage.numel() <= max(_digest_torch._CHUNK_BYTES, 64 * 1152)  # a batch, or one page


@pytest.mark.parametrize("in_place", [False, True])  # the one run gathered too, or read in place
@pytest.mark.parametrize("row", [64, 31, 132])  # spans of 8-byte words, and not
def test_scattered_blocks_gathered_as_words_or_bytes_digest_as_the_same_blocks_in_one_run(
    row: int, in_place: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request's blocks scattered over the cache (gathered, as 8-byte words where the pages
    fall on them, else as bytes) digest as the same pages copied in request order into one run
    of blocks (on CPU gathered as well, or read in place as on a GPU): the same meaning,
    whatever the path."""
    generator = torch.Generator().manual_seed(row)
    blocks, heads, tokens = 40, 2, 3
    cache = torch.randint(-128, 128, (blocks, heads, tokens, 2 * row), dtype=torch.int8,
                          generator=generator)  # fmt: skip
    ids = [int(b) for b in torch.randperm(blocks, generator=generator)[:17]]
    assert len(_digest_torch._runs(ids)) > _digest_torch._MAX_RUNS
    span = heads * tokens * 2 * row
    assert (span % 8 == 0) == (row != 31)
    in_order = torch.zeros_like(cache)
    in_order[: len(ids)] = cache[ids]
    axes = ("block", "head", "token", "kv|element")
    topology = {"tp_rank": 0, "tp_size": 1, "total_kv_heads": heads}
    gathered = safeview.digest(
        safeview.describe({"l0": cache}, axes=axes, topology=topology), {"l0": cache}, ids
    )
    monkeypatch.setattr(_digest_torch, "_GATHER_ON_CPU", not in_place)
    read = safeview.digest(
        safeview.describe({"l0": in_order}, axes=axes, topology=topology),
        {"l0": in_order},
        list(range(len(ids))),
    )
    assert gathered == read
    assert (
        gathered.values["l0"]
        != safeview.digest(
            safeview.describe({"l0": cache}, axes=axes, topology=topology),
            {"l0": cache},
            sorted(ids),
        ).values["l0"]
    )  # the blocks' order is meaning


@pytest.mark.parametrize("kernel", ["int_mm", "int_mm_t", "widen"])
def test_sums_taken_block_by_block_are_the_row_by_row_ones(
    monkeypatch: pytest.MonkeyPatch, kernel: str
) -> None:
    """Where each block's tokens in the request lie in one run of the token values, a plan's
    weighted sums and token sums are taken block by block (``_block_sums``: one float64
    product per block, then weighed by entry and added into the block's run), else row by row
    (``_weighted_sums``, ``_TokenSums``). Both give one digest, values and token values, for
    head- and token-major pages with K/V inside the page and outside it, scattered ids and
    consecutive ones, a request that ends inside a block and one that ends blocks before the
    last; a block of more tokens than a run takes the row-by-row sums, with the formula's
    value. The pages gathered on CPU a batch at a time, and as a GPU reads them (read in place
    where a few runs, else gathered whole in the request's order)."""
    _hold_kernel(monkeypatch, kernel)
    for on_cpu in (True, False):
        monkeypatch.setattr(_digest_torch, "_GATHER_ON_CPU", on_cpu)
        _sums_alike(monkeypatch)


def _sums_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    per_block = _digest_torch._block_sums
    calls: list[int] = []

    def counted(*args: object, **kwargs: object) -> list[torch.Tensor]:
        calls.append(1)
        return per_block(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(_digest_torch, "_block_sums", counted)
    content = _content(layers=2, positions=50, heads=2, size=64, dtype=torch.bfloat16, seed=95)
    for layout in ("LBHNC", "LBNHC", "NHD", "HND"):
        side = _side(content, tp=1, tokens=4, layout=layout, heads=2, seed=96)
        manifest, caches = side.manifests[0], side.caches[0]
        for ids in (side.blocks, list(range(len(side.blocks)))):
            for num_tokens in (50, 37):  # 13 blocks of 4: the last 3 past a request of 37
                calls.clear()
                found = safeview.digest(manifest, caches, ids, num_tokens=num_tokens)
                assert calls, (layout, num_tokens)
                with monkeypatch.context() as held:
                    held.setattr(_digest_torch._Plan, "block_keys", lambda self, order: None)
                    by_row = safeview.digest(manifest, caches, ids, num_tokens=num_tokens)
                assert found == by_row, (layout, num_tokens)
                assert found.tokens == by_row.tokens, (layout, num_tokens)
                if ids is side.blocks:
                    expected = _reference(content, num_tokens, heads=2)
                    assert found.values == expected, (layout, num_tokens)
    # blocks of 32 tokens against runs of 16 (a request of 50 tokens): row by row
    side = _side(content, tp=1, tokens=32, layout="LBNHC", heads=2, seed=97)
    calls.clear()
    found = safeview.digest(side.manifests[0], side.caches[0], side.blocks, num_tokens=50)
    assert calls == []
    assert found.values == _reference(content, 50, heads=2)
