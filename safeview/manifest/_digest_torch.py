"""``safeview.digest``'s arithmetic on tensors (the formula is in ``safeview.manifest.digest``).

Per layer: an int8 ``as_strided`` view of the layer's storage with one row per (block, K/V,
token, head, piece) and the row's bytes last, read straight from the pages where the request's
blocks form a few runs of consecutive ids, else gathered with ``index_select`` on the tensor's
device (on CPU a few pages at a time, in address order); the rows times ``R``, exactly, two
lanes per row: ``torch._int_mm`` (int8 x int8 -> int32) on CUDA and where the CPU has VNNI or
AMX, else the rows widened to int32 a few pages at a time and multiplied by torch's int32
product (``_cpu_kernel``); on CPU ``torch._int_mm`` reads a run of pages (or a strided view)
copied into a kept buffer 2 MiB at a time, faster than where they lie, and takes ``R``
transposed on its left for rows of at most 1 KiB where that is exact and faster
(``_row_kernel``: about twice as fast with VNNI), each lane's values then in a row of their
own. Per page shape, for all its layers at once: the lanes times the position keys, summed per
head, as float64 products with the keys' 16-bit halves (exact: cut where a sum would pass
``2**53``), modulo ``PRIME``: one product per block where each block's tokens lie in one run of
the token values (its sums give the layers' and, weighed by layer, the runs'), else one over
all rows and one more for the runs; the K/V, head, element type and layer keys on the few sums
left. Part of the torch boundary
(tests/test_architecture.py).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from safeview.errors import ArgumentError
from safeview.manifest._digest_model import (
    LANES,
    NO_HEAD,
    PRIME,
    WEIGHT_BOUND,
    Digest,
    chunk_tokens,
    key,
    layer_key,
    layer_meaning,
    piece_count,
    row_weights,
    type_key,
)
from safeview.manifest._model import Layer, Manifest
from safeview.manifest.canonical import token_positions

__all__ = ["digest"]

_CHUNK_BYTES = 2 << 20  # pages gathered at a time on CPU (they stay in the cores' caches)
_MAX_RUNS = 8  # more runs of consecutive block ids than this: one gather is cheaper
# on CPU pages are gathered whatever their runs, a batch at a time in address order, as 8-byte
# words: faster than copying a run's strided view in batches (benchmarks/bench_digest.py, 128
# consecutive pages: 1.09x a copy against 1.19x)
_GATHER_ON_CPU = True
_R_CACHE: dict[tuple[int, int, str], torch.Tensor] = {}
_SCRATCH = threading.local()
_BATCH_BYTES = 8 << 20  # float64 values weighed in one product (layers of one plan)
_KEEP_BYTES = 8 << 20  # scratch a thread keeps between calls, per use


def _scratch(
    use: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A tensor for work inside one call, on CPU from memory the calling thread keeps between
    calls (up to ``_KEEP_BYTES`` per use, five uses): fresh memory costs a page fault per 4 KiB
    the first time it is written, which for a request of 128 blocks was a tenth of the digest
    (benchmarks/bench_digest.py)."""
    if device.type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    held = getattr(_SCRATCH, use, None)
    if held is None or held.numel() < nbytes:
        held = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        if nbytes <= _KEEP_BYTES:
            setattr(_SCRATCH, use, held)
    return held[:nbytes].view(dtype).view(shape)


_GROUP = 4  # rows multiplied together: 8 output columns, 2 lanes each


def _r_matrix(length: int, device: torch.device, group: int = 1) -> torch.Tensor:
    """``R`` for ``group`` consecutive rows of ``length`` bytes read as one row, as
    ``torch._int_mm`` takes it: ``(group * length, 8)`` int8, block-diagonal, row ``s``'s two
    lanes in columns ``2s`` and ``2s + 1`` (with one row, the other six columns zero: the kernel
    wants 8). A longer row is read faster by the kernel (about 1.05x a copy for 1 KiB, 1.4x for
    256 bytes, on CPU) and every output column is used. Row-major on CPU (its kernel reads it
    faster so), column-major elsewhere (cuBLASLt's int8 form)."""
    found = _R_CACHE.get((length, group, str(device)))
    if found is None:
        weights = torch.tensor(row_weights(length), dtype=torch.int8)  # (length, lanes)
        matrix = torch.zeros(8, group * length, dtype=torch.int8)
        for row in range(group):
            part = slice(row * length, (row + 1) * length)
            matrix[row * LANES : (row + 1) * LANES, part] = weights.t()
        if len(_R_CACHE) > 64:
            _R_CACHE.clear()
        found = matrix.t().contiguous() if device.type == "cpu" else matrix.to(device).t()
        _R_CACHE[(length, group, str(device))] = found
    return found


def _r_lanes(length: int) -> torch.Tensor:
    """``R`` transposed for ``"int_mm_t"``: int8 ``(lanes, length)``, contiguous."""
    found = _R_CACHE.get((length, 0, "cpu"))
    if found is None:
        found = _r_matrix(length, torch.device("cpu"))[:, :LANES].t().contiguous()
        _R_CACHE[(length, 0, "cpu")] = found
    return found


def _rows_times_r(
    rows: torch.Tensor, length: int, out: torch.Tensor, kernel: str = "int_mm"
) -> None:
    """``rows @ R`` exactly into ``out`` (int32 ``(M, 2)``, contiguous; one column per lane;
    for ``"int_mm_t"`` ``(2, M)``, each lane's row contiguous): ``torch._int_mm`` where it runs
    (on CUDA more than 16 rows and a multiple of 8 bytes, padded with zeros, which add
    nothing), ``R`` transposed times the rows transposed for ``"int_mm_t"`` (two output rows,
    none wasted), ``_GROUP`` rows at a time where they lie one after another, else a float64
    product, exact below ``2**53``."""
    count = rows.shape[0]
    device = rows.device
    try:
        if kernel == "int_mm_t":
            if out.is_contiguous():
                torch._int_mm(_r_lanes(length), rows.t(), out=out)
            else:  # a run of rows inside a layer's lanes: each lane's part is contiguous
                found = _scratch("lanes_t", (LANES, count), torch.int32, device)
                torch._int_mm(_r_lanes(length), rows.t(), out=found)
                out.copy_(found)
            return
        if device.type == "cuda" and (count <= 16 or length % 8):
            matrix = _r_matrix(length, device)
            padded = torch.zeros(
                max(count, 17), -(-length // 8) * 8, dtype=torch.int8, device=device
            )
            padded[:count, :length] = rows
            wide = torch.zeros(padded.shape[1], 8, dtype=torch.int8, device=device)
            wide[:length] = matrix
            found = torch._int_mm(padded, wide)[:count, :LANES]
        elif (
            count % _GROUP == 0
            and rows.is_contiguous()
            and (device.type != "cuda" or (count // _GROUP > 16 and length % 8 == 0))
        ):
            grouped = rows.view(count // _GROUP, _GROUP * length)
            matrix = _r_matrix(length, device, _GROUP)
            torch._int_mm(grouped, matrix, out=out.view(count // _GROUP, 8))
            return
        else:
            found = torch._int_mm(rows, _r_matrix(length, device))[:, :LANES]
    except (RuntimeError, NotImplementedError):
        matrix = _r_matrix(length, device)
        found = (rows.to(torch.float64) @ matrix[:, :LANES].to(torch.float64)).to(torch.int64)
        if kernel == "int_mm_t":
            found = found.t()
    out.copy_(found)


_WIDEN_BYTES = 512 << 10  # bytes widened to int32 at a time (a few pages; four times that)
_KERNELS: dict[bool, str] = {}  # per "oneDNN enabled": the CPU's kernel, probed once
_R_WIDE: dict[int, torch.Tensor] = {}


def _int_mm_exact(transposed: bool = False) -> bool:
    """Whether ``torch._int_mm`` gives the exact product here for the operands the digest
    multiplies (any bytes, weights at most ``WEIGHT_BOUND`` in magnitude), probed with those
    that strain it most: bytes of 127 and -128 against weights of +-64, and random ones.
    oneDNN's int8 kernels without VNNI (AVX2, AVX-512 without VNNI, or ``ONEDNN_MAX_CPU_ISA``
    below it) read the bytes as unsigned and add pairs of products into int16 with
    saturation: exact for such weights (``2 * 255 * 64`` fits), wrong for larger ones.
    ``transposed``: the product as ``"int_mm_t"`` takes it, the weights on the left (read as
    unsigned there: not exact on such CPUs)."""
    generator = torch.Generator().manual_seed(35)
    rows = torch.randint(-128, 128, (64, 1024), dtype=torch.int8, generator=generator)
    rows[:16] = 127
    rows[16:32] = -128
    rows[8:16, ::3] = -128
    rows[24:32, ::5] = 127
    bound = WEIGHT_BOUND
    weights = torch.randint(-bound, bound + 1, (1024, 8), dtype=torch.int8, generator=generator)
    weights[:, 0] = bound
    weights[:, 1] = -bound
    weights[::2, 2] = bound
    weights[1::2, 2] = -bound
    try:
        if transposed:
            found = torch._int_mm(weights.t().contiguous(), rows.t()).t()
        else:
            found = torch._int_mm(rows, weights)
    except (RuntimeError, NotImplementedError):
        return False
    exact = rows.to(torch.float64) @ weights.to(torch.float64)  # below 2**53
    return bool(torch.equal(found.to(torch.float64), exact))


def _cpu_kernel() -> str:
    """The kernel of the rows' products on this CPU, chosen once per process (and per
    ``torch.backends.mkldnn.enabled``; off, ``"widen"``): ``"int_mm"`` (``torch._int_mm``,
    int8 x int8 -> int32) where oneDNN is on, its probe is exact (``_int_mm_exact``) and not
    3x as slow here as ``"widen"`` (the bytes turned into int32 a few pages at a time and
    multiplied by ``R`` with torch's int32 product; exact, a row's sum is below ``2**27``),
    timed on 1 MiB of rows, best of five.
    What ``torch._int_mm`` runs depends on the CPU and on torch: oneDNN's VNNI or AMX kernels
    (faster than ``"widen"``), its AVX2 or AVX-512 kernels without VNNI (exact for ``R``'s
    weights, about as fast as ``"widen"`` on one thread, and shared out over torch's threads,
    which ``"widen"``'s int32 product is not), or ATen's plain loop (exact, about 20x slower
    than ``"widen"``)."""
    enabled = torch._C._has_mkldnn and torch._C._get_mkldnn_enabled()  # mkldnn.enabled
    found = _KERNELS.get(enabled)
    if found is None:
        found = "widen"
        # with oneDNN off, torch._int_mm is ATen's plain loop whatever the CPU: not timed
        if enabled and _int_mm_exact():
            times = _kernel_seconds(("int_mm", "widen"))
            int_mm, widen = times["int_mm"], times["widen"]
            # oneDNN's kernels take 0.5x to 1x "widen"'s time, ATen's plain loop 9x to 11x
            # (an EPYC, quiet): the cut between them, with both timed in turn, so that a noisy
            # moment at the first digest does not settle the process on the slower kernel
            found = "int_mm" if int_mm < 3 * widen else "widen"
        _KERNELS[enabled] = found
    return found


_TRANSPOSE_BYTES = 1024  # longest row "int_mm_t" takes: past it the 4-row groups were faster
_TRANSPOSED: dict[bool, bool] = {}  # per "oneDNN enabled": whether "int_mm_t" is used


def _row_kernel(kernel: str, length: int) -> str:
    """The kernel for rows of ``length`` bytes on CPU, ``kernel`` being ``_cpu_kernel()``'s:
    ``"int_mm_t"`` (``R`` transposed times the rows transposed: two output rows rather than
    eight, of which the 4-row groups use all but compute three quarters of as zeros) where
    ``kernel`` is ``"int_mm"``, the row is at most ``_TRANSPOSE_BYTES``, that form is exact
    here (oneDNN's VNNI and AMX kernels; not its AVX2 ones) and not slower than the groups
    (about 2x faster for rows of 128 to 512 bytes on an EPYC with VNNI; AMX's tiles may favour
    the groups), timed once per process."""
    if kernel != "int_mm" or length > _TRANSPOSE_BYTES:
        return kernel
    enabled = torch._C._has_mkldnn and torch._C._get_mkldnn_enabled()
    found = _TRANSPOSED.get(enabled)
    if found is None:
        found = _int_mm_exact(transposed=True)
        if found:
            times = _kernel_seconds(("int_mm", "int_mm_t"))
            found = times["int_mm_t"] <= times["int_mm"]
        _TRANSPOSED[enabled] = found
    return "int_mm_t" if found else kernel


def _kernel_seconds(kernels: tuple[str, ...]) -> dict[str, float]:
    """The best of five times each of ``kernels`` takes for 1 MiB of rows of 256 bytes, a
    batch of pages, timed in turn (after a first call each, which may build the kernel), so
    that a noisy moment weighs on each."""
    generator = torch.Generator().manual_seed(35)
    rows = torch.randint(-128, 128, (16, 256, 256), dtype=torch.int8, generator=generator)
    out = torch.empty(4096, LANES, dtype=torch.int32)
    wide = torch.empty(rows.shape, dtype=torch.int32)
    best = dict.fromkeys(kernels, math.inf)
    for _ in range(6):
        for kernel in best:
            start = time.perf_counter()
            into = out.view(LANES, -1) if kernel == "int_mm_t" else out
            _blocks_times_r(rows, 256, kernel, into, wide if kernel == "widen" else None)
            best[kernel] = min(best[kernel], time.perf_counter() - start)
    return best


def _r_wide(length: int) -> torch.Tensor:
    """``R`` for the widened kernel: int32 ``(length, lanes)``, each lane's weights one after
    another (the product's fast form: about 18x slower with ``R`` row-major on an EPYC)."""
    found = _R_WIDE.get(length)
    if found is None:
        if len(_R_WIDE) > 64:
            _R_WIDE.clear()
        found = torch.tensor(row_weights(length), dtype=torch.int32).t().contiguous().t()
        _R_WIDE[length] = found
    return found


def _blocks_times_r(
    view: torch.Tensor,
    length: int,
    kernel: str,
    out: torch.Tensor,
    wide: torch.Tensor | None = None,
) -> None:
    """The rows of ``view`` (int8, blocks first; each block's bytes, in its row-major order,
    are rows of ``length`` bytes) times ``R``, exactly, into ``out`` (int32 ``(rows, lanes)``,
    contiguous; for ``"int_mm_t"`` ``(lanes, rows)``, each lane's row contiguous).
    ``"widen"``: ``_WIDEN_BYTES`` of blocks at a time (a page at least; all of
    them into ``wide``, an int32 buffer of ``view``'s shape, where given) copied into int32,
    in the rows' order whatever the view's strides, and multiplied while they are in the
    core's cache."""
    if kernel != "widen":
        small = view.numel() <= _CHUNK_BYTES and view.is_contiguous()
        if view.device.type != "cpu" or small:
            _rows_times_r(view.reshape(-1, length), length, out=out, kernel=kernel)
            return
        # in batches of ``_CHUNK_BYTES`` copied into a kept buffer first: ``torch._int_mm``
        # reads its operand slower from memory than from the core's cache, and a strided view
        # would be reshaped into fresh memory whole
        blocks, tail = view.shape[0], view.shape[1:]
        per_block = math.prod(tail)
        step = max(1, _CHUNK_BYTES // max(per_block, 1))
        stage = _scratch("stage", (min(step, blocks) * per_block,), torch.int8, view.device)
        for at in range(0, blocks, step):
            count = min(step, blocks - at)
            part = stage[: count * per_block]
            part.view(count, *tail).copy_(view[at : at + count])
            rows = slice(at * per_block // length, (at + count) * per_block // length)
            into = out[:, rows] if kernel == "int_mm_t" else out[rows]
            _rows_times_r(part.view(-1, length), length, out=into, kernel=kernel)
        return
    weights = _r_wide(length)
    if wide is not None:
        wide.copy_(view)
        torch.mm(wide.view(-1, length), weights, out=out)
        return
    blocks, tail = view.shape[0], view.shape[1:]
    per_block = math.prod(tail)
    rows_per_block = per_block // length
    step = max(1, _WIDEN_BYTES // max(per_block, 1))
    buffer = _scratch("wide", (min(step, blocks) * per_block,), torch.int32, view.device)
    for at in range(0, blocks, step):
        count = min(step, blocks - at)
        part = buffer[: count * per_block]
        part.view(count, *tail).copy_(view[at : at + count])
        rows = slice(at * rows_per_block, (at + count) * rows_per_block)
        torch.mm(part.view(-1, length), weights, out=out[rows])


_LAYER_KEYS: dict[tuple[str, int], int] = {}


def _layer_key(name: str, lane: int) -> int:
    found = _LAYER_KEYS.get((name, lane))
    if found is None:
        if len(_LAYER_KEYS) > 65536:
            _LAYER_KEYS.clear()
        found = _LAYER_KEYS[(name, lane)] = layer_key(name, lane)
    return found


def _int8_base(tensor: torch.Tensor) -> torch.Tensor:
    """An int8 tensor over ``tensor``'s whole storage, for ``as_strided`` with byte offsets:
    the tensor itself viewed as int8 where torch allows it (no ``set_``), else a fresh tensor
    on its storage (one-argument ``set_``: views it whole, never resizes it)."""
    if tensor.dtype is torch.int8:
        return tensor
    try:
        return tensor.view(torch.int8)
    except RuntimeError:
        return torch.empty(0, dtype=torch.int8, device=tensor.device).set_(tensor.untyped_storage())


def _runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """Runs of consecutive block ids: (first id, count, position of the run in ``ids``)."""
    runs: list[tuple[int, int, int]] = []
    for at, block in enumerate(ids):
        if runs and runs[-1][0] + runs[-1][1] == block:
            first, count, where = runs[-1]
            runs[-1] = (first, count + 1, where)
        else:
            runs.append((block, 1, at))
    return runs


def _tensor_of(kv_caches: Any, index: int, name: str) -> torch.Tensor:
    if isinstance(kv_caches, Mapping):
        if name not in kv_caches:
            raise ArgumentError(f"kv_caches has no tensor for layer {name!r} of the manifest")
        tensor = kv_caches[name]
    elif isinstance(kv_caches, Sequence) and not isinstance(kv_caches, (str, bytes)):
        if index >= len(kv_caches):
            raise ArgumentError(
                f"kv_caches holds {len(kv_caches)} tensors; layer {name!r} is the manifest's "
                f"layer {index}"
            )
        tensor = kv_caches[index]
    else:
        raise ArgumentError(
            f"kv_caches is a {type(kv_caches).__name__}, not a mapping of layer name to tensor "
            "or a sequence of tensors"
        )
    if not isinstance(tensor, torch.Tensor) or tensor.layout is not torch.strided:
        raise ArgumentError(
            f"kv_caches[{name!r}] is a {type(tensor).__name__}, not a strided tensor"
        )
    return tensor


def _extent(layer: Layer) -> int:
    last = layer.byte_offset + max(layer.num_blocks - 1, 0) * layer.block_stride_bytes
    return last + sum((a.size - 1) * a.stride_bytes for a in layer.axes) + layer.itemsize


def _positions(
    blocks: int, slots: tuple[int, ...], cp_size: int, device: torch.device
) -> torch.Tensor:
    """The request position of each (request block, local slot): block ``b`` stands for the
    request's tokens ``b * T * W`` to ``(b + 1) * T * W - 1`` (``T`` slots, ``W`` ranks of
    context parallelism), its slot ``s`` for ``slots[s]`` of them (``token_positions``):
    ``(blocks, T)`` int64."""
    tokens = len(slots)
    first = torch.arange(blocks, dtype=torch.int64, device=device).view(-1, 1) * tokens * cp_size
    return first + torch.tensor(slots, dtype=torch.int64, device=device).view(1, -1)


def _position_keys(lane: int, positions: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Key of each position for ``lane``, 0 at and past ``num_tokens`` (not the request's
    meaning, on any rank)."""
    keys = key(positions, "token", lane)
    return torch.where(positions < num_tokens, keys, torch.zeros_like(keys))


_SPLIT = 1 << 16  # keys cut into 16-bit halves: a lane times a half is below 2**45
_EXACT = 1 << 53  # float64 sums of integers stay exact below this


def _key_matrix(keys: torch.Tensor) -> torch.Tensor:
    """The keys of ``(rows, post, lanes)`` positions as the right-hand side of one float64
    product: ``(rows, post * lanes, 2 * lanes)``, column ``half * lanes + lane`` holding the
    low (``half`` 0) or high 16 bits of the key of lane ``lane``'s value, zero for the other
    lane's."""
    rows, post, _ = keys.shape
    halves = (keys % _SPLIT, keys // _SPLIT)
    matrix = torch.zeros(rows, post, LANES, 2, LANES, dtype=torch.float64, device=keys.device)
    for lane in range(LANES):
        for half, part in enumerate(halves):
            matrix[:, :, lane, half, lane] = part[:, :, lane]
    return matrix.view(rows, post * LANES, 2 * LANES)


class _Step(NamedTuple):
    """One batch of a CPU gather: its block ids, the part of one buffer that holds their
    pages (and the same bytes as 8-byte words, where they fall on them), those pages as the
    page's axes, for the widened kernel an int32 buffer of that shape, and the batch's first
    row and row count among the request's rows; for ``"int_mm_t"`` where the pages' rows are
    one matrix, that matrix transposed and a buffer for its lanes (made once per call, not
    once per layer)."""

    ids: torch.Tensor
    pages: torch.Tensor
    words: torch.Tensor | None
    rows: torch.Tensor
    wide: torch.Tensor | None
    first_row: int
    count_rows: int
    rows_t: torch.Tensor | None
    lanes: torch.Tensor | None


class _Plan:
    """What a layer's geometry and the request's shape decide, made once per call for every
    layer of one ``Layer`` (the layers of one page shape share it): the row view's shape and
    strides, and the keys of the rows of one head as ``_key_matrix`` (block rows before the
    head, rows after it: the rows' own order; a row's key never depends on its head), and how
    many terms one float64 product sums exactly."""

    def __init__(
        self,
        layer: Layer,
        blocks: int,
        num_tokens: int,
        place: tuple[int, tuple[int, ...]],
        device: torch.device,
    ) -> None:
        placed = next((a for a in layer.axes if a.outer and a.size > 1 and a.axis != "kv"), None)
        self.placed = placed.axis if placed is not None else None
        itemsize = layer.itemsize
        element = next((a for a in layer.axes if a.axis == "element"), None)
        size_e, stride_e = (element.size, element.stride_bytes) if element else (1, itemsize)
        row_bytes = size_e * itemsize
        pieces = piece_count(row_bytes)
        self.piece_bytes = row_bytes // pieces
        outer = [a for a in layer.axes if a.outer and a.size > 1]
        # the page's axes in the order its bytes lie (the rows' order: a whole page is then
        # one matrix of rows, read as it lies, where its view's order would need a copy)
        inner = [a for a in layer.axes if not a.outer and a.size > 1 and a.axis != "element"]
        inner.sort(key=lambda a: -a.stride_bytes)
        tokens = layer.size_of("token")
        self.heads = layer.heads or (NO_HEAD,)
        dims = ["block", *(a.axis for a in inner), "piece"]
        self.shape_tail = [*(a.size for a in inner), size_e, itemsize]
        self.stride_tail = [*(a.stride_bytes for a in inner), stride_e, 1]
        self.span = sum((s - 1) * t for s, t in zip(self.shape_tail, self.stride_tail)) + 1
        # one head's rows (the head axis, where there is one, at size 1: keys do not vary by it)
        sizes = [blocks, *(1 if d == "head" else a.size for d, a in zip(dims[1:], inner)), pieces]
        cp_size, slots = place
        assert len(slots) == tokens
        positions = _positions(blocks, slots, cp_size, device)
        view = [blocks if d == "block" else tokens if d == "token" else 1 for d in dims]
        runs = -(-num_tokens // chunk_tokens(num_tokens))
        # each row's run of tokens (``runs``: past the request), in the rows' order
        run = torch.where(positions < num_tokens, positions // chunk_tokens(num_tokens), runs)
        self.runs = runs
        self.run_of_row = torch.zeros(sizes, dtype=torch.int64, device=device) + run.view(view)
        per_lane = []
        for lane in range(LANES):
            keys = torch.ones(sizes, dtype=torch.int64, device=device)
            keys = keys * _position_keys(lane, positions, num_tokens).view(view)
            for at, meaning in enumerate(dims):
                if meaning in ("kv", "piece"):
                    count = sizes[at]
                    coordinate = key(
                        torch.arange(count, dtype=torch.int64, device=device), meaning, lane
                    )
                    shape = [count if i == at else 1 for i in range(len(dims))]
                    keys = keys * coordinate.view(shape) % PRIME
            per_lane.append(keys)
        at = dims.index("head") if "head" in dims else len(dims)
        self.pre = math.prod(sizes[1:at])  # rows of a block before its head index changes
        self.post = math.prod(sizes[at + 1 :])  # rows of one head index in a row
        keys = torch.stack(per_lane, dim=-1).reshape(blocks * self.pre, self.post, LANES)
        self.row_keys = keys
        self.run_of_row = self.run_of_row.reshape(blocks * self.pre, self.post)
        self.keys = _key_matrix(keys)
        # the keys and runs in a gather's order, once made
        self.gathered: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.per_block: tuple[torch.Tensor, torch.Tensor] | None = None
        self.by_block: bool | None = None  # whether the sums are taken block by block
        self.steps: list[_Step] | None = None
        self.blocks = blocks
        self.rows_per_block = math.prod(self.shape_tail) // self.piece_bytes
        self.kernel = "int_mm"
        if device.type == "cpu":
            self.kernel = _row_kernel(_cpu_kernel(), self.piece_bytes)
        # the rows' lanes each lane's after the other (``"int_mm_t"``'s output), else row by row
        self.lane_major = self.kernel == "int_mm_t"
        largest = 128 * WEIGHT_BOUND * self.piece_bytes  # |<row, R>|
        self.terms = max(1, (_EXACT - 1) // (largest * (_SPLIT - 1)))
        self.outer_offsets: list[tuple[int, dict[str, int]]] = [(0, {})]
        for axis in outer:
            self.outer_offsets = [
                (at + i * axis.stride_bytes, {**coords, axis.axis: i})
                for at, coords in self.outer_offsets
                for i in range(axis.size)
            ]
        self.outer_keys = []
        for _, coords in self.outer_offsets:
            outer_key = [1] * LANES
            for lane in range(LANES):
                for meaning, index in coords.items():
                    outer_key[lane] = outer_key[lane] * key(index, meaning, lane) % PRIME
            self.outer_keys.append(torch.tensor(outer_key, dtype=torch.int64, device=device))

    def in_order(
        self, order: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The keys (``_key_matrix``'s and each row's), and each row's run of tokens, with the
        blocks in ``order`` (request positions; ``None``: the request's own), made once per
        call."""
        if order is None:
            return self.keys, self.row_keys, self.run_of_row
        if self.gathered is None:
            blocks = order.shape[0]
            keys, row_keys, run_of_row = (
                t.view(blocks, -1).index_select(0, order).view(t.shape)
                for t in (self.keys, self.row_keys, self.run_of_row)
            )
            self.gathered = (keys, row_keys, run_of_row)
        return self.gathered

    def block_keys(self, order: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The keys of each block's rows as the right-hand side of one float64 product per
        block (``(blocks, rows of one head * lanes, 2 * lanes)``, the rows in the values'
        order: ``_block_sums``) and each block's run of tokens (``runs`` where none of its
        tokens is in the request), blocks in ``order``; ``None`` where a block's tokens
        inside the request fall in more than one run (a block of more tokens than a run, or
        context parallelism's interleaving) or its rows are more terms than one exact
        product sums: then the sums are taken row by row (``_weighted_sums``,
        ``_TokenSums``). Made once per call."""
        if self.by_block is None:
            keys, _, run_of_row = self.in_order(order)
            blocks, width = self.blocks, self.pre * self.post * LANES
            runs = run_of_row.view(blocks, -1)
            inside = runs < self.runs
            low = torch.where(inside, runs, self.runs).amin(dim=1)
            high = torch.where(inside, runs, -1).amax(dim=1)
            alike = bool(((high == low) | (high < 0)).all()) if blocks else False
            self.by_block = alike and width <= self.terms
            if self.by_block:
                keys = keys.view(blocks, self.pre, self.post, LANES, 2 * LANES)
                if self.lane_major:
                    keys = keys.permute(0, 3, 1, 2, 4)
                self.per_block = (keys.reshape(blocks, width, 2 * LANES).contiguous(), low)
        return self.per_block

    def gather_steps(self, ids: torch.Tensor) -> list[_Step]:
        """The CPU gather's batches, made once per call for every layer of the plan. The
        buffer is ``_CHUNK_BYTES`` (a few pages; for the widened kernel ``_WIDEN_BYTES`` at
        most, as their int32 copy is four times that): it stays in the core's cache between
        the gather and the product."""
        if self.steps is None:
            nbytes = _CHUNK_BYTES
            if self.kernel == "widen":
                nbytes = min(nbytes, _WIDEN_BYTES)
            chunk = max(1, nbytes // self.span)
            blocks = ids.shape[0]
            buffer = _scratch("pages", (min(chunk, blocks), self.span), torch.int8, ids.device)
            per_block = math.prod(self.shape_tail)
            wide = None
            if self.kernel == "widen":
                wide = _scratch("wide", (min(chunk, blocks) * per_block,), torch.int32, ids.device)
            self.steps = []
            per = self.rows_per_block
            lanes = None
            if self.kernel == "int_mm_t":
                shape = (LANES * min(chunk, blocks) * per,)
                lanes = _scratch("step_lanes", shape, torch.int32, ids.device)
            for at in range(0, blocks, chunk):
                count = min(chunk, blocks - at)
                pages = buffer[:count]
                rows = torch.as_strided(
                    pages, [count, *self.shape_tail], [self.span, *self.stride_tail]
                )
                widened = None
                if wide is not None:
                    widened = wide[: count * per_block].view(count, *self.shape_tail)
                rows_t = step_lanes = None
                if lanes is not None and rows.is_contiguous():
                    rows_t = rows.view(-1, self.piece_bytes).t()
                    step_lanes = lanes[: LANES * count * per].view(LANES, count * per)
                step = _Step(
                    ids[at : at + count],
                    pages,
                    _as_words(pages),
                    rows,
                    widened,
                    at * per,
                    count * per,
                    rows_t,
                    step_lanes,
                )
                self.steps.append(step)
        return self.steps


def _weighted_sums(values: torch.Tensor, plan: _Plan, keys: torch.Tensor) -> torch.Tensor:
    """Per entry (a layer's K/V part, or the layer), head and lane, the sum of each row's lane
    times its key, modulo ``PRIME``: int64 ``(entries, heads, lanes)``. ``values``: per entry
    and head the lanes of its rows (``_blocks_times_r``'s, as float64, exact), rows in the order
    of ``keys`` (the plan's keys, in the request's order or a gather's). One float64 product for
    every entry and head, with the keys' 16-bit halves, cut where its sums would pass ``2**53``:
    a few large operations rather than a few per layer. ``keys`` transposed, ``(4, rows)``,
    on the left: the product's short side first is read 2x to 2.5x faster on CPU (MKL) than the
    values times a 4-column right-hand side."""
    entries, heads = values.shape[:2]
    values = values.reshape(entries * heads, -1)
    total = torch.zeros(2 * LANES, entries * heads, dtype=torch.int64, device=values.device)
    for start in range(0, values.shape[1], plan.terms):
        end = start + plan.terms
        total += (keys[:, start:end] @ values[:, start:end].t()).to(torch.int64) % PRIME
    total = (total.t() % PRIME).reshape(entries, heads, 2, LANES)
    return (total[:, :, 0] + total[:, :, 1] * _SPLIT) % PRIME


def _layer_lanes(
    name: str,
    layer: Layer,
    tensor: torch.Tensor,
    runs: list[tuple[int, int, int]],
    gather: tuple[torch.Tensor, torch.Tensor | None] | None,
    plan: _Plan,
    out: torch.Tensor,
    by_step: bool = False,
) -> None:
    """A layer's rows times ``R``, into ``out`` (int32 ``(outer parts, rows * lanes)``: one
    entry per K/V part outside the page, else one), rows in the request's order, or in a CPU
    gather's. ``gather``: on CPU (``_GATHER_ON_CPU``), or for more than ``_MAX_RUNS`` runs, the
    ids to gather pages by and, on CPU, the request position of each gathered block
    (``_gather_order``). ``by_step`` (``"int_mm_t"`` on a CPU gather whose batches' rows are
    each one matrix): ``out`` holds the batches' lanes one batch after another, each
    ``(lanes, the batch's rows)`` and as long as the first batch's (``_step_lanes``), so that
    the product writes them where they stay rather than into a buffer they are copied from."""
    nbytes = tensor.untyped_storage().nbytes()
    if _extent(layer) > nbytes:
        raise ArgumentError(
            f"layer {name!r}: the manifest's pages reach byte {_extent(layer):,}, its tensor's "
            f"storage holds {nbytes:,}: the manifest is not this tensor's"
        )
    if plan.placed is not None:
        raise ArgumentError(
            f"layer {name!r}: its {plan.placed} axis lies outside the block axis; a digest "
            "reads pages whose only such axis is K/V"
        )
    base = _int8_base(tensor)
    blocks = plan.blocks
    per = plan.rows_per_block
    for part, (offset, _) in enumerate(plan.outer_offsets):
        start = layer.byte_offset + offset
        into = out[part].view(LANES, -1) if plan.lane_major else out[part].view(-1, LANES)
        if gather is None:
            for first, count, where in runs:
                view = torch.as_strided(
                    base,
                    [count, *plan.shape_tail],
                    [layer.block_stride_bytes, *plan.stride_tail],
                    start + first * layer.block_stride_bytes,
                )
                rows = _rows_of(into, where * per, (where + count) * per, plan.lane_major)
                _blocks_times_r(view, plan.piece_bytes, plan.kernel, out=rows)
            continue
        # the pages' bytes gathered whole (a row copy per block), then read as rows
        whole = torch.as_strided(
            base, [layer.num_blocks, plan.span], [layer.block_stride_bytes, 1], start
        )
        assert gather is not None
        ids_tensor, order = gather
        if order is None:
            gathered = whole.index_select(0, ids_tensor)
            view = torch.as_strided(
                gathered, [blocks, *plan.shape_tail], [plan.span, *plan.stride_tail]
            )
            _blocks_times_r(view, plan.piece_bytes, plan.kernel, out=into)
            continue
        # gathered a few blocks at a time, in address order, each batch's rows multiplied
        # while its pages are in the core's cache: the pages read once; as 8-byte words
        # where they fall on them (torch's int8 index_select copies on one thread, about half
        # as fast)
        words = _as_words(whole)
        weights = _r_lanes(plan.piece_bytes) if plan.kernel == "int_mm_t" else None
        steps = plan.gather_steps(ids_tensor)
        for number, step in enumerate(steps):
            if words is not None and step.words is not None:
                torch.index_select(words, 0, step.ids, out=step.words)
            else:
                torch.index_select(whole, 0, step.ids, out=step.pages)
            if by_step:  # every batch's rows one matrix (``_block_sums`` checked)
                assert weights is not None
                assert step.rows_t is not None
                first = number * LANES * steps[0].count_rows
                lanes = out[part, first : first + LANES * step.count_rows]
                lanes = lanes.view(LANES, step.count_rows)
                try:
                    torch._int_mm(weights, step.rows_t, out=lanes)
                except (RuntimeError, NotImplementedError):
                    _blocks_times_r(step.rows, plan.piece_bytes, plan.kernel, lanes)
                continue
            lanes = _rows_of(
                into, step.first_row, step.first_row + step.count_rows, plan.lane_major
            )
            if weights is not None and step.rows_t is not None and step.lanes is not None:
                try:  # R transposed times the rows transposed, then into the layer's lanes
                    torch._int_mm(weights, step.rows_t, out=step.lanes)
                    lanes.copy_(step.lanes)
                    continue
                except (RuntimeError, NotImplementedError):
                    pass
            _blocks_times_r(step.rows, plan.piece_bytes, plan.kernel, lanes, step.wide)


def _as_words(pages: torch.Tensor) -> torch.Tensor | None:
    """``pages`` (int8 ``(blocks, span)``, rows contiguous) as int64 words, or ``None`` where
    its bytes do not fall on 8-byte boundaries (the span, the stride, the first byte)."""
    if pages.shape[-1] % 8 or pages.storage_offset() % 8 or pages.data_ptr() % 8:
        return None
    try:
        return pages.view(torch.int64)
    except RuntimeError:  # a stride not a multiple of 8 bytes
        return None


def _rows_of(lanes: torch.Tensor, start: int, stop: int, lane_major: bool) -> torch.Tensor:
    """Rows ``start`` to ``stop`` of a layer's lanes, laid out row by row or lane by lane."""
    return lanes[:, start:stop] if lane_major else lanes[start:stop]


def _plan_sums(
    members: list[tuple[str, Layer, torch.Tensor]],
    runs: list[tuple[int, int, int]],
    gather: tuple[torch.Tensor, torch.Tensor | None] | None,
    plan: _Plan,
    blocks: int,
    token_sums: torch.Tensor,
) -> list[torch.Tensor]:
    """Per layer of one plan, its per-head, per-lane sums (int64 ``(heads, lanes)``): each
    layer's lanes made into one small buffer and copied from there, as float64 and head by
    head, into its batch's values; each batch (as many layers as ``_BATCH_BYTES`` holds) then
    weighed at once. Into ``token_sums`` (int64 ``(heads, runs + 1, lanes)``, the plan's
    heads) each batch's sums per head and run of tokens (``_TokenSums``, once per plan). Where
    each block's tokens lie in one run, ``_block_sums`` instead (``_Plan.block_keys``)."""
    parts = len(plan.outer_offsets)
    per_entry = blocks * plan.rows_per_block * LANES
    per_batch = max(1, _BATCH_BYTES // max(8 * per_entry * parts, 1))
    device = members[0][2].device
    order = gather[1] if gather is not None else None
    outer = torch.stack(plan.outer_keys).view(1, parts, 1, LANES)
    per_block = plan.block_keys(order)
    if per_block is not None:
        return _block_sums(members, runs, gather, plan, per_block, outer, token_sums)
    lanes = _scratch("lanes", (parts, per_entry), torch.int32, device)
    keys, row_keys, run_of_row = plan.in_order(order)
    heads, rows = len(plan.heads), keys.shape[0]
    found: list[torch.Tensor] = []
    if plan.lane_major:  # values (entries, heads, lanes, rows, post), keys in that order
        by_head = lanes.view(parts, LANES, rows, heads, plan.post).permute(0, 3, 1, 2, 4)
        shape_tail: tuple[int, ...] = (LANES, rows, plan.post)
        keys = keys.view(rows, plan.post, LANES, 2 * LANES).permute(2, 0, 1, 3).contiguous()
    else:  # values (entries, heads, rows, post, lanes)
        by_head = lanes.view(parts, rows, heads, plan.post, LANES).permute(0, 2, 1, 3, 4)
        shape_tail = (rows, plan.post, LANES)
    keys_t = keys.reshape(-1, 2 * LANES).t().contiguous()  # (4, values of one entry and head)
    tokens = _TokenSums(row_keys, run_of_row, token_sums)
    for at in range(0, len(members), per_batch):
        batch = members[at : at + per_batch]
        shape = (len(batch) * parts, heads, *shape_tail)
        values = _scratch("values", shape, torch.float64, device)
        for index, (name, layer, tensor) in enumerate(batch):
            _layer_lanes(name, layer, tensor, runs, gather, plan, lanes)
            # as float64, head by head, while the lanes are in the core's cache
            values[index * parts : (index + 1) * parts].copy_(by_head)
        sums = _weighted_sums(values, plan, keys_t).view(len(batch), parts, -1, LANES)
        per_layer = (sums * outer % PRIME).sum(dim=1) % PRIME  # (layers, heads, lanes)
        found.extend(per_layer.unbind(0))
        layer_keys = torch.tensor(
            [[_layer_key(name, lane) for lane in range(LANES)] for name, _, _ in batch],
            dtype=torch.int64,
            device=device,
        )
        weights = (layer_keys.view(-1, 1, LANES) * outer.view(1, parts, LANES) % PRIME).view(
            -1, LANES
        )  # per entry (layer, K/V part) and lane
        tokens.add(values, weights, plan.lane_major)
    tokens.flush()
    return found


def _block_sums(
    members: list[tuple[str, Layer, torch.Tensor]],
    runs: list[tuple[int, int, int]],
    gather: tuple[torch.Tensor, torch.Tensor | None] | None,
    plan: _Plan,
    per_block: tuple[torch.Tensor, torch.Tensor],
    outer: torch.Tensor,
    token_sums: torch.Tensor,
) -> list[torch.Tensor]:
    """``_plan_sums`` where each block's tokens in the request lie in one run
    (``_Plan.block_keys``): per batch of layers, the values laid out block first (``(blocks,
    entries, heads, rows of one head * lanes)``, each layer's copied there from its lanes as
    float64), and per block one float64 product of its rows with their keys' halves (exact:
    at most ``plan.terms`` terms). Per block, entry and head that gives the sum of the rows'
    lanes times their keys; summed over blocks it is the weighted sums, and weighed by entry
    and added into the block's run, the token sums: one small product for both, where
    ``_weighted_sums`` and ``_TokenSums`` each read every value."""
    keys, block_run = per_block
    parts = len(plan.outer_offsets)
    blocks, width = keys.shape[:2]
    heads = len(plan.heads)
    device = members[0][2].device
    steps = None
    if plan.lane_major and gather is not None and gather[1] is not None:
        steps = plan.gather_steps(gather[0])
        if any(step.rows_t is None for step in steps):
            steps = None
    if steps is not None:  # each batch's lanes where the product wrote them
        chunk = steps[0].ids.shape[0]
        size = len(steps) * chunk * plan.rows_per_block * LANES
        lanes = _scratch("lanes", (parts, size), torch.int32, device)
        sources = _step_lanes(lanes, plan, blocks, chunk)
    else:
        size = blocks * plan.rows_per_block * LANES
        lanes = _scratch("lanes", (parts, size), torch.int32, device)
        if plan.lane_major:  # lanes (parts, lanes, blocks, pre, heads, post)
            shaped = lanes.view(parts, LANES, blocks, plan.pre, heads, plan.post)
            sources = [(0, blocks, shaped.permute(2, 0, 4, 1, 3, 5))]
        else:  # lanes (parts, blocks, pre, heads, post, lanes)
            shaped = lanes.view(parts, blocks, plan.pre, heads, plan.post, LANES)
            sources = [(0, blocks, shaped.permute(1, 0, 3, 2, 4, 5))]
    per_batch = max(1, _BATCH_BYTES // max(8 * parts * blocks * plan.rows_per_block * LANES, 1))
    found: list[torch.Tensor] = []
    for at in range(0, len(members), per_batch):
        batch = members[at : at + per_batch]
        entries = len(batch) * parts
        values = _scratch("values", (blocks, entries, heads, width), torch.float64, device)
        for index, (name, layer, tensor) in enumerate(batch):
            _layer_lanes(name, layer, tensor, runs, gather, plan, lanes, steps is not None)
            for first, stop, source in sources:
                part = values[first:stop, index * parts : (index + 1) * parts]
                part.view(source.shape).copy_(source)
        # (blocks, entries * heads, 4) -> per block, entry, head and lane, below 2**33
        product = torch.bmm(values.view(blocks, entries * heads, width), keys)
        halves = product.to(torch.int64).view(blocks, entries, heads, 2, LANES)
        per_row = _fold(halves[:, :, :, 0] + _fold(halves[:, :, :, 1]) * _SPLIT)
        sums = per_row.sum(dim=0) % PRIME  # (entries, heads, lanes)
        sums = sums.view(len(batch), parts, heads, LANES)
        found.extend(((sums * outer % PRIME).sum(dim=1) % PRIME).unbind(0))
        layer_keys = torch.tensor(
            [[_layer_key(name, lane) for lane in range(LANES)] for name, _, _ in batch],
            dtype=torch.int64,
            device=device,
        )
        weights = layer_keys.view(-1, 1, LANES) * outer.view(1, parts, LANES) % PRIME
        # per block, head and lane: the entries' sums times their weights, into its run
        weighed = _fold(per_row * weights.view(1, entries, 1, LANES)).sum(dim=1)
        token_sums.index_add_(1, block_run, (weighed % PRIME).transpose(0, 1))
        token_sums.remainder_(PRIME)
    return found


def _step_lanes(
    lanes: torch.Tensor, plan: _Plan, blocks: int, chunk: int
) -> list[tuple[int, int, torch.Tensor]]:
    """Where ``_layer_lanes(by_step=True)`` left a layer's lanes (``lanes``: int32 ``(parts,
    steps * lanes * chunk blocks' rows)``, each batch's ``(lanes, its rows)`` from the start of
    its part), as ``(first block, block after the last, view)``: the full batches' lanes, then
    the last, shorter one's, each view in ``_block_sums``' values order ``(blocks, parts, heads,
    lanes, pre, post)`` (the blocks of full batches as ``(batches, chunk)``)."""
    parts, heads = lanes.shape[0], len(plan.heads)
    shape = (plan.pre, heads, plan.post)
    per_step = LANES * chunk * plan.rows_per_block
    full, last = divmod(blocks, chunk)
    found = []
    if full:
        shaped = lanes[:, : full * per_step].view(parts, full, LANES, chunk, *shape)
        found.append((0, full * chunk, shaped.permute(1, 3, 0, 5, 2, 4, 6)))
    if last:
        start = full * per_step
        shaped = lanes[:, start : start + LANES * last * plan.rows_per_block]
        shaped = shaped.view(parts, LANES, last, *shape)
        found.append((full * chunk, blocks, shaped.permute(2, 0, 4, 1, 3, 5)))
    return found


_ENTRIES = 512  # entries weighed in one float64 product: 512 * 2**16 * 2**27 < 2**53


class _TokenSums:
    """Each head's sum, per run of tokens, of every entry's rows (the row's lane times its key
    times its entry's weight: the layer's key times the K/V part's), added into ``into``
    (int64 ``(heads, runs + 1, lanes)``) modulo ``PRIME``. ``add`` takes a batch's values
    (float64 ``(entries, heads, rows, post, lanes)``, or ``(entries, heads, lanes, rows,
    post)`` lane by lane; exact) and their ``weights`` (int64 ``(entries, lanes)``): one
    float64 product of the weights' 16-bit halves (both lanes) with the values where they lie
    (each lane's weights applied to both lanes' values, the other lane's products left: no copy
    of the values), added up over batches while the sums stay exact (``_ENTRIES`` entries);
    ``flush`` (then, and at the end) takes each lane's own products to int64, multiplies them by
    the rows' keys and adds them per run into ``into``: once per plan rather than per batch."""

    def __init__(self, row_keys: torch.Tensor, run_of_row: torch.Tensor, into: torch.Tensor):
        self.row_keys, self.run_of_row, self.into = row_keys, run_of_row, into
        self.product: torch.Tensor | None = None
        self.entries = 0
        self.lane_major = False

    def add(self, values: torch.Tensor, weights: torch.Tensor, lane_major: bool) -> None:
        entries, heads = values.shape[:2]
        flat = values.view(entries, heads * self.run_of_row.numel() * LANES)
        self.lane_major = lane_major
        for start in range(0, entries, _ENTRIES):
            part = weights[start : start + _ENTRIES]  # (entries, lanes)
            if self.entries + part.shape[0] > _ENTRIES:
                self.flush()
            halves = torch.stack((part % _SPLIT, part // _SPLIT))  # (half, entry, lane)
            left = halves.permute(0, 2, 1).reshape(2 * LANES, -1).to(torch.float64)
            product = left @ flat[start : start + _ENTRIES]
            if self.product is None:
                self.product = product
            else:  # integers below 2**53 while at most _ENTRIES entries: exact
                self.product += product
            self.entries += part.shape[0]

    def flush(self) -> None:
        if self.product is None:
            return
        heads, count = self.into.shape[0], self.run_of_row.numel()
        # each lane's weights with its own lane's values
        if self.lane_major:
            by_lane = self.product.view(2, LANES, heads, LANES, count)
            mine = torch.diagonal(by_lane, dim1=1, dim2=3).to(torch.int64)
            mine = mine.reshape(2, heads * count, LANES)  # (half, head and row, lane)
        else:
            by_row = self.product.view(2, LANES, heads * count, LANES)
            mine = torch.diagonal(by_row, dim1=1, dim2=3).to(torch.int64)  # (half, rows, lane)
        total = _fold(mine[0] + _fold(mine[1]) * _SPLIT)
        keys = self.row_keys.reshape(1, count, LANES)
        weighed = _fold(_fold(total)).view(heads, count, LANES) * keys
        self.into.index_add_(1, self.run_of_row.reshape(count), _fold(weighed))
        self.into.remainder_(PRIME)
        self.product, self.entries = None, 0


def _fold(x: torch.Tensor) -> torch.Tensor:
    """A number congruent to ``x`` (int64) modulo ``PRIME = 2**31 - 1`` and below ``2**33`` in
    magnitude, with two bit operations and an add (``2**31`` is 1 modulo ``PRIME``), where
    torch's int64 remainder divides element by element."""
    return (x & PRIME) + (x >> 31)


def _gather_order(ids: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The block ids to gather pages by, and the request position of each block gathered
    (``None``: they are the request's order). On CPU in ascending order: pages read in address
    order are read faster (the prefetcher follows them) than in a request's order."""
    if device.type != "cpu":
        return torch.tensor(ids, dtype=torch.int64, device=device), None
    order = sorted(range(len(ids)), key=ids.__getitem__)
    return (
        torch.tensor([ids[at] for at in order], dtype=torch.int64),
        torch.tensor(order, dtype=torch.int64),
    )


_HEAD_KEYS: dict[int, tuple[int, ...]] = {}


def _head_keys(head: int) -> tuple[int, ...]:
    found = _HEAD_KEYS.get(head)
    if found is None:
        if len(_HEAD_KEYS) > 65536:
            _HEAD_KEYS.clear()
        lanes = range(LANES)
        found = (1,) * LANES if head == NO_HEAD else tuple(key(head, "head", n) for n in lanes)
        _HEAD_KEYS[head] = found
    return found


_ROW_KEYS: dict[tuple[Any, ...], torch.Tensor] = {}  # (typed, layers) -> (3, heads, lanes)
_ROW_KEYS_BYTES = 16 << 20  # at most 64 lists and this many bytes kept (1,000 layers of 8 heads:
# 384 KB a list)


def _values(
    layers: list[tuple[str, Layer, tuple[int, ...]]], sums: torch.Tensor, typed: bool
) -> dict[str, dict[int, int]]:
    """Each layer's values per head from its per-head, per-lane sums (``sums``: int64
    ``(heads, lanes)``, the layers' heads one after another, each below ``PRIME``): times the
    head's key, plus the key of what its bytes mean (``layer_meaning``: its element type, its
    parts'; ``typed``: on the rank at context-parallel position 0 only, so that the ranks'
    values add up to one), times the layer's key; the two lanes as one number. At once for
    every layer. The keys of one such list of layers (their names, meanings and heads) are
    made once and kept (``_ROW_KEYS``, bounded): a manifest is digested request after request."""
    described = (typed, tuple((name, layer_meaning(layer), heads) for name, layer, heads in layers))
    keys = _ROW_KEYS.get(described)
    if keys is None:
        head_keys, type_keys, layer_keys = [], [], []
        for name, meaning, heads in described[1]:
            typed_as = tuple(type_key(meaning, n) if typed else 0 for n in range(LANES))
            named = tuple(_layer_key(name, lane) for lane in range(LANES))
            for head in heads:
                head_keys.append(_head_keys(head))
                type_keys.append(typed_as)
                layer_keys.append(named)
        keys = torch.tensor([head_keys, type_keys, layer_keys], dtype=torch.int64)
        kept = sum(t.nbytes for t in _ROW_KEYS.values())
        if len(_ROW_KEYS) >= 64 or kept + keys.nbytes > _ROW_KEYS_BYTES:
            _ROW_KEYS.clear()
        if keys.nbytes <= _ROW_KEYS_BYTES:
            _ROW_KEYS[described] = keys
    lanes = sums * keys[0] % PRIME
    lanes = (lanes + keys[1]) % PRIME
    lanes = lanes * keys[2] % PRIME
    joined = ((lanes[:, 0] << 31) | lanes[:, 1]).tolist()
    result: dict[str, dict[int, int]] = {}
    at = 0
    for name, _, heads in layers:
        result[name] = dict(zip(heads, joined[at : at + len(heads)]))
        at += len(heads)
    return result


def digest(
    manifest: Manifest,
    kv_caches: Any,
    block_ids: Any,
    layers: Sequence[str] | None,
    num_tokens: int | None,
) -> Digest:
    if not isinstance(manifest, Manifest):
        raise ArgumentError(f"manifest is a {type(manifest).__name__}, not a safeview Manifest")
    if isinstance(block_ids, torch.Tensor):
        block_ids = block_ids.tolist()
    try:
        ids = [int(b) for b in block_ids]
    except (TypeError, ValueError):
        raise ArgumentError(f"block_ids {block_ids!r} is not a sequence of block ids") from None
    names = list(manifest.layers) if layers is None else list(layers)
    for name in names:
        if name not in manifest.layers:
            raise ArgumentError(f"layers names {name!r}, which the manifest does not have")
    topology = manifest.topology
    cp_size = topology.cp_size
    token_counts = {manifest.layers[n].size_of("token") for n in names}
    positions = len(ids) * min(token_counts, default=1) * cp_size
    if num_tokens is None:
        num_tokens = positions
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise ArgumentError(f"num_tokens {num_tokens!r} is not a non-negative integer")
    if num_tokens > positions:
        held = f" over {cp_size} context-parallel ranks" if cp_size > 1 else ""
        raise ArgumentError(
            f"num_tokens {num_tokens:,} is more than the {len(ids)} blocks hold ({positions:,} "
            f"positions{held})"
        )
    low, high = (min(ids), max(ids)) if ids else (0, -1)
    runs = _runs(ids)
    index = {name: at for at, name in enumerate(manifest.layers)}
    values: dict[str, dict[int, int]] = {}
    sums: dict[str, tuple[torch.Tensor, tuple[int, ...]]] = {}
    plans: dict[tuple[Any, ...], tuple[_Plan, list[tuple[str, Layer, torch.Tensor]]]] = {}
    ids_tensors: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
    for name in names:
        layer = manifest.layers[name]
        tensor = _tensor_of(kv_caches, index[name], name)
        if low < 0 or high >= layer.num_blocks:
            bad = next(b for b in ids if not 0 <= b < layer.num_blocks)
            raise ArgumentError(
                f"block_ids holds {bad}, outside the {layer.num_blocks:,} blocks of layer "
                f"{name!r} (0 to {layer.num_blocks - 1:,})"
            )
        device_name = str(tensor.device)
        gathered = len(runs) > _MAX_RUNS or (_GATHER_ON_CPU and tensor.device.type == "cpu")
        if gathered and device_name not in ids_tensors:
            ids_tensors[device_name] = _gather_order(ids, tensor.device)
        # what a plan depends on: the page's axes and heads (layers of one shape share it)
        shape = (
            tuple((a.axis, a.size, a.stride_bytes, a.outer) for a in layer.axes),
            layer.itemsize,
            layer.heads,
            device_name,
        )
        if shape not in plans:
            tokens = layer.size_of("token")
            place = (cp_size, token_positions(topology, tokens))
            plans[shape] = (_Plan(layer, len(ids), num_tokens, place, tensor.device), [])
        plans[shape][1].append((name, layer, tensor))
    chunks = -(-num_tokens // chunk_tokens(num_tokens))
    token_parts: dict[str, list[tuple[tuple[int, ...], torch.Tensor]]] = {}  # by device
    for shape, (plan, members) in plans.items():
        gather = ids_tensors.get(shape[-1])
        device = members[0][2].device
        shape_sums = (len(plan.heads), chunks + 1, LANES)
        token_sums = torch.zeros(shape_sums, dtype=torch.int64, device=device)
        found = _plan_sums(members, runs, gather, plan, len(ids), token_sums)
        for (name, _, _), total in zip(members, found):
            sums[name] = (total, plan.heads)
        token_parts.setdefault(str(device), []).append((plan.heads, token_sums[:, :chunks]))
    # one transfer to the host per device, after every layer's work is queued (a per-layer
    # transfer would wait for each layer's kernels in turn on a GPU)
    by_device: dict[str, list[str]] = {}
    for name, (total, _) in sums.items():
        by_device.setdefault(str(total.device), []).append(name)
    typed = topology.cp_rank == 0
    for names_here in by_device.values():
        stacked = torch.cat([sums[name][0] for name in names_here]).cpu()
        layer_heads = [(name, manifest.layers[name], sums[name][1]) for name in names_here]
        values.update(_values(layer_heads, stacked, typed))
    values = {name: values[name] for name in names}  # the manifest's order
    dtypes = {name: manifest.layers[name].dtype for name in names}
    by_head: dict[int, torch.Tensor] = {}  # per head, (runs, lanes) summed over plans
    for parts in token_parts.values():  # one transfer to the host per device, as above
        host = torch.cat([sums for _, sums in parts]).cpu()
        at = 0
        for heads_of_plan, _ in parts:
            for head in heads_of_plan:
                summed = by_head.get(head)
                by_head[head] = host[at] if summed is None else summed + host[at]
                at += 1
    token_values = _token_values(by_head)
    return Digest(
        num_tokens,
        values,
        topology.tp_rank,
        topology.tp_size,
        manifest.fingerprint,
        dtypes=dtypes,
        cp_size=cp_size,
        cp_rank=topology.cp_rank,
        cp_interleave=topology.cp_kv_cache_interleave_size,
        tokens=token_values,
    )


def _token_values(by_head: dict[int, torch.Tensor]) -> dict[int, tuple[int, ...]]:
    """Each head's token values from its per-run, per-lane sums (int64 ``(runs, lanes)``,
    summed over the plans that hold the head): times the head's key, the two lanes as one
    number, at once for every head."""
    heads = sorted(by_head)
    if not heads:
        return {}
    sums = torch.stack([by_head[head] for head in heads]) % PRIME  # (heads, runs, lanes)
    keys = torch.tensor([_head_keys(head) for head in heads], dtype=torch.int64)
    lanes = sums * keys.view(len(heads), 1, LANES) % PRIME
    joined = (lanes[..., 0] << 31) | lanes[..., 1]
    return {head: tuple(values) for head, values in zip(heads, joined.tolist())}
