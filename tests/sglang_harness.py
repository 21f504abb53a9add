"""A prefill (P) and a decode (D) process of SGLang 0.5.23's disaggregation on CPU, moving real
KV bytes over Mooncake TCP with SGLang's own managers (``tests/test_sglang.py`` runs them).

Run as ``python tests/sglang_harness.py ROLE PORT CASES_JSON [RANK]``; ROLE ``prefill`` or
``decode`` (a pair, below; RANK the attention-TP rank of a side whose ``tp_size`` is more
than 1), ``pools`` (SGLang's pools and their manifests, for ``describe_pool``) or
``register`` (a decode manager over a region SGLang reports too long). Each process publishes
SGLang's ``ServerArgs`` (``device="cpu"``, ``disaggregation_transfer_backend="mooncake"``,
``page_size=4``), builds a CPU ``MHATokenToKVPool``, fills ``KVArgs`` as SGLang's ``prefill.py``
does and starts a ``MooncakeKVManager``; P also starts the ``MooncakeKVBootstrapServer`` on
127.0.0.1. P has one pool; D builds a pool and a manager per case, as a decode engine of that
layout would, and they run the cases in order (one bootstrap room each): P writes a pattern
through its pool, SGLang's ``MooncakeKVSender`` sends the pages, D's ``MooncakeKVReceiver``
receives them, and D reports what its pool holds. Each process prints one JSON line per case
and ends with ``os._exit`` (SGLang 0.5.23's ``teardown`` aborts in libzmq).

With ``SAFEVIEW_HARNESS_INSTALL=1`` the process calls ``safeview.sglang.install()`` first, as
SGLang's plugin loader would. Per case (``tests/test_sglang_digest.py``): ``num_tokens`` (P's
sender says the request's tokens), ``decode_policy`` (D's manager made under that policy),
``corrupt`` (one byte of D rank 0's received pages changed once the transfer is done and
before SGLang's receiver reports it: ``_corrupt_when_done``), ``digest_fault`` (P's digest of
the room lost on the way, or never made: ``_digest_fault``); ``SAFEVIEW_HARNESS_FRAMES=1``:
D reports the first frame of every message its decode thread was offered.

What stands in for what SGLang would have (nothing else is changed):

- ``triton``: SGLang's own stub (``sglang/_platform_stubs.py``, the macOS one), loaded by path;
  ``import triton`` is reached from ``sglang/__init__.py`` and nothing here runs a kernel.
- ``torchvision``: an empty module visible only to modules under ``sglang.`` (its
  ``multimodal`` configs import it; PyPI's wheel is a CUDA build that cannot load here).
- ``pp_group``: the prefill manager stores ``get_parallel().pp_group``, which needs
  torch.distributed's groups; with one pipeline stage SGLang never uses it: ``None`` is
  stated with ``override_permanently``.
"""

from __future__ import annotations

import ast
import functools
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import time
import types
from pathlib import Path
from typing import Any

PAGE_SIZE = 4
POOL_TOKENS = 64  # 16 pages, and SGLang's padded page
LAYERS = 2
TIMEOUT_S = 120.0


# -- import stand-ins --------------------------------------------------------------------------


def _install_triton_stub() -> None:
    """SGLang's own triton stub, loaded by path: the triton block of its
    ``install_platform_stubs`` (the macOS one) without its MPS part. ``sglang/__init__`` would
    import triton; nothing here runs a kernel."""
    spec = importlib.util.find_spec("sglang")
    assert spec is not None
    assert spec.submodule_search_locations
    path = Path(next(iter(spec.submodule_search_locations))) / "_platform_stubs.py"
    loader_spec = importlib.util.spec_from_file_location("_sglang_platform_stubs", path)
    assert loader_spec is not None
    assert loader_spec.loader is not None
    stubs = importlib.util.module_from_spec(loader_spec)
    sys.modules[loader_spec.name] = stubs  # its dataclasses look their module up
    loader_spec.loader.exec_module(stubs)
    tree = ast.parse(path.read_text())
    install = next(
        node
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name == "install_platform_stubs"
    )
    block = next(
        node
        for node in install.body
        if isinstance(node, ast.If) and "'triton' not in sys.modules" in ast.unparse(node.test)
    )
    exec(compile(ast.Module([block], []), str(path), "exec"), vars(stubs))


class _TorchvisionForSglang(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import torchvision`` from a module under ``sglang.`` gets an empty module; any other
    importer (transformers' availability probe) still finds none."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != "torchvision" and not fullname.startswith("torchvision."):
            return None
        frame = sys._getframe(1)
        while frame is not None:
            name = frame.f_globals.get("__name__", "")
            if not name.startswith(("importlib", "_frozen_importlib")) and name != __name__:
                if name.startswith("sglang."):
                    return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
                return None
            frame = frame.f_back  # type: ignore[assignment]
        return None

    def create_module(self, spec: Any) -> Any:
        module = types.ModuleType(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: Any) -> None:
        return None


def _stand_ins() -> None:
    os.environ.setdefault("MC_FORCE_TCP", "1")
    os.environ.setdefault("SGLANG_HOST_IP", "127.0.0.1")
    _install_triton_stub()
    sys.meta_path.insert(0, _TorchvisionForSglang())


# -- one side ----------------------------------------------------------------------------------


def _server_args(mode: str, port: int, tp_size: int = 1, rank: int = 0) -> Any:
    from sglang.srt import runtime_context  # type: ignore[import-not-found,unused-ignore]
    from sglang.srt.server_args import ServerArgs  # type: ignore[import-not-found,unused-ignore]

    args = ServerArgs(
        model_path="dummy",
        device="cpu",
        disaggregation_mode=mode,
        disaggregation_transfer_backend="mooncake",
        disaggregation_bootstrap_port=port,
        host="127.0.0.1",
        page_size=PAGE_SIZE,
        tp_size=tp_size,
    )
    # one scheduler process, rank ``rank`` of ``tp_size``: its place, as SGLang's launcher
    # gives it (attention TP is the TP here: one attention DP group, no CP)
    runtime_context.publish(
        args, role="scheduler", ranks=runtime_context.SpawnRanks(world_rank=rank, gpu_id=0)
    )
    # the pp_group stand-in: torch.distributed's groups are never built here, and with one
    # pipeline stage the prefill manager never uses the group it stores
    runtime_context.get_parallel().override_permanently(pp_group=None)
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (  # type: ignore[import-not-found,unused-ignore]
        maybe_init_shared_mooncake_transfer_engine,
    )

    # SGLang's own start-up of the one Mooncake engine a process shares (parallel_state's)
    maybe_init_shared_mooncake_transfer_engine(gpu_id=0)
    return args


def _pool(case: dict[str, Any]) -> Any:
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # type: ignore[import-not-found,unused-ignore]

    return MHATokenToKVPool(
        size=POOL_TOKENS,
        page_size=PAGE_SIZE,
        dtype=getattr(torch, case.get("dtype", "bfloat16")),
        head_num=int(case.get("heads", 4)),
        head_dim=int(case.get("head_dim", 16)),
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
    )


def _manager(
    pool: Any,
    mode: str,
    server_args: Any,
    total_heads: int,
    extra_pages: int = 0,
    rank: int = 0,
    state_extra_pages: int = 0,
) -> Any:
    import torch
    from sglang.srt.disaggregation.base.conn import KVArgs  # type: ignore[import-not-found,unused-ignore]
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager  # type: ignore[import-not-found,unused-ignore]
    from sglang.srt.disaggregation.utils import DisaggregationMode, get_kv_transfer_buf_infos  # type: ignore[import-not-found,unused-ignore]

    kv_args = KVArgs()
    kv_args.engine_rank = rank
    kv_args.pp_rank = 0
    kv_args.system_dp_rank = 0
    kv_args.rust_http_port = None
    kv_args.kv_cache_dtype_str = "auto"
    kv_args.kv_layout = None
    kv_args.prefill_start_layer = 0
    ptrs, lens, item_lens = get_kv_transfer_buf_infos(pool)
    if extra_pages:  # a region that runs past its buffer (a pool that misreports its span)
        lens = [lens[0] + extra_pages * item_lens[0], *lens[1:]]
    kv_args.prefill_end_layer = LAYERS
    kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens = ptrs, lens, item_lens
    kv_args.num_draft_entries = 0
    kv_args.kv_layer_ids = list(range(LAYERS)) * 2
    kv_args.kv_head_num = pool.head_num
    kv_args.total_kv_head_num = total_heads
    kv_args.page_size = PAGE_SIZE
    aux = torch.zeros((8, 64), dtype=torch.uint8)  # SGLang's metadata buffers, one kind
    _KEEP.append(aux)
    kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens = (
        [aux.data_ptr()],
        [aux.numel()],
        [64],
    )
    kv_args.ib_device = None
    kv_args.gpu_id = 0
    kv_args.state_types = []
    kv_args.state_data_ptrs, kv_args.state_data_lens, kv_args.state_item_lens = [], [], []
    kv_args.state_layer_ids, kv_args.state_dim_per_tensor = [], []
    kv_args.state_slice_outer_counts, kv_args.state_conv_shard_groups = [], []
    kv_args.is_hybrid_mla_backend = False
    kv_args.swa_kv_cache_layout = None
    if hasattr(pool, "get_state_buf_infos"):  # a window pool's KV, as SGLang's scheduler sets it
        from sglang.srt.disaggregation.utils import setup_state_kv_args  # type: ignore[import-not-found,unused-ignore]

        setup_state_kv_args(kv_args, pool)
        if state_extra_pages:  # the first state region runs past its buffer
            lens, items = kv_args.state_data_lens[0], kv_args.state_item_lens[0]
            kv_args.state_data_lens[0] = [lens[0] + state_extra_pages * items[0], *lens[1:]]
    role = DisaggregationMode.PREFILL if mode == "prefill" else DisaggregationMode.DECODE
    return MooncakeKVManager(kv_args, role, server_args, False)


_KEEP: list[Any] = []


def _pattern(pool: Any, pages: list[int], salt: int = 0) -> None:
    """Write distinct bytes into ``pages`` of every K and V buffer of ``pool`` (``salt``: another
    pattern, for another pool)."""
    import torch

    for index, buffer in enumerate([*pool.k_buffer, *pool.v_buffer]):
        raw = buffer.view(torch.uint8).view(buffer.shape[0], -1)
        for page in pages:
            rows = raw[page * PAGE_SIZE : (page + 1) * PAGE_SIZE]
            values = torch.arange(rows.numel(), dtype=torch.int64) * 7 + index * 31 + page * 13
            values += salt * 17
            rows.copy_((values % 251 + 1).to(torch.uint8).view(rows.shape))


def _page_bytes(pool: Any, pages: list[int]) -> list[str]:
    """Each buffer's ``pages`` as hex, in registration order."""
    import torch

    found = []
    for buffer in [*pool.k_buffer, *pool.v_buffer]:
        raw = buffer.view(torch.uint8).view(buffer.shape[0], -1)
        found.append(
            b"".join(
                raw[p * PAGE_SIZE : (p + 1) * PAGE_SIZE].contiguous().numpy().tobytes()
                for p in pages
            ).hex()
        )
    return found


def _nonzero(pool: Any) -> int:
    import torch

    return int(sum(int((b.view(torch.uint8) != 0).sum()) for b in [*pool.k_buffer, *pool.v_buffer]))


_POLL = {0: "Failed", 1: "Bootstrapping", 2: "WaitingForInput", 3: "Transferring", 4: "Success"}


def _wait(poll: Any, wanted: set[str], deadline: float) -> str:
    """Poll until a state in ``wanted`` (SGLang's ``KVPoll`` by name) or the deadline."""
    while True:
        state = _POLL.get(int(poll()), str(poll()))
        if state in wanted or time.monotonic() > deadline:
            return state
        time.sleep(0.02)


def _tp(side: dict[str, Any]) -> int:
    return int(side.get("tp_size", 1))


def _total_heads(side: dict[str, Any]) -> int:
    """The model's KV heads: ``total_heads``, else this rank's times the TP size."""
    return int(side.get("total_heads", int(side.get("heads", 4)) * _tp(side)))


def _meaning_pattern(pool: Any, pages: list[int], heads: list[int]) -> None:
    """Write into ``pages`` of every K and V buffer of ``pool`` a byte that says what it is:
    the buffer, the page's place in the request, the token, the global KV head (``heads``: this
    rank's) and the byte in the head (``_meaning_byte``). Any TP split of the same model writes
    the same byte for the same meaning."""
    import torch

    for index, buffer in enumerate([*pool.k_buffer, *pool.v_buffer]):
        raw = buffer.view(torch.uint8).view(buffer.shape[0], len(heads), -1)
        for place, page in enumerate(pages):
            rows = raw[page * PAGE_SIZE : (page + 1) * PAGE_SIZE]
            rows.copy_(_meaning_bytes(index, place, heads, rows.shape[-1]))


def _meaning_bytes(index: int, place: int, heads: list[int], head_bytes: int) -> Any:
    import torch

    token = torch.arange(PAGE_SIZE).view(-1, 1, 1)
    head = torch.tensor(heads).view(1, -1, 1)
    byte = torch.arange(head_bytes).view(1, 1, -1)
    code = index * 31 + place * 13 + token * 7 + head * 5 + byte * 3
    return (code % 251 + 1).to(torch.uint8)


def _meaning_mismatches(pool: Any, pages: list[int], heads: list[int]) -> int:
    """How many bytes of ``pages`` differ from what ``_meaning_pattern`` writes for them."""
    import torch

    wrong = 0
    for index, buffer in enumerate([*pool.k_buffer, *pool.v_buffer]):
        raw = buffer.view(torch.uint8).view(buffer.shape[0], len(heads), -1)
        for place, page in enumerate(pages):
            rows = raw[page * PAGE_SIZE : (page + 1) * PAGE_SIZE]
            wrong += int((rows != _meaning_bytes(index, place, heads, rows.shape[-1])).sum())
    return wrong


def _heads_of(side: dict[str, Any], rank: int) -> list[int]:
    count = int(side.get("heads", 4))
    return list(range(rank * count, (rank + 1) * count))


def prefill(port: int, cases: list[dict[str, Any]], rank: int = 0) -> None:
    import numpy as np
    from sglang.srt.disaggregation.mooncake.conn import (  # type: ignore[import-not-found,unused-ignore]
        MooncakeKVBootstrapServer,
        MooncakeKVSender,
    )

    layout = cases[0]["prefill"]
    if rank == 0:  # one bootstrap server for P's ranks, as SGLang's launcher starts one
        MooncakeKVBootstrapServer("127.0.0.1", port)
    server_args = _server_args("prefill", port, _tp(layout), rank)
    pool = _side_pool(layout)
    manager = _manager(pool, "prefill", server_args, _total_heads(layout), rank=rank)
    print(json.dumps({"side": "prefill", "ready": True}), flush=True)
    for room, case in enumerate(cases, start=1):
        sender = MooncakeKVSender(manager, f"127.0.0.1:{port}", room)
        deadline = time.monotonic() + TIMEOUT_S
        state = _wait(sender.poll, {"WaitingForInput", "Failed"}, deadline)
        result: dict[str, Any] = {"side": "prefill", "case": case["name"], "bootstrap": state}
        if state == "WaitingForInput":
            pages, kv = case["src_pages"], _kv_of(pool)
            if case.get("by_meaning"):
                _meaning_pattern(kv, pages, _heads_of(layout, rank))
            else:
                _pattern(kv, pages)
            result["sent"] = _page_bytes(kv, pages)
            window = None  # a window's pages, a Mamba slot: SGLang's state, on the last chunk
            if "src_state_pages" in case:
                window = [list(case["src_state_pages"])]
                if case.get("by_meaning"):  # a window's bytes say their global head too
                    _meaning_pattern(pool.swa_kv_pool, window[0], _heads_of(layout, rank))
                else:
                    _state_pattern(pool, window[0])
                result["state_sent"] = _state_bytes(pool, window[0])
            if case.get("digest_fault"):
                _digest_fault(case["digest_fault"], room)
            sender.init(len(pages), 0)
            if case.get("num_tokens"):  # the request's tokens, as SGLang's prefill says them
                sender.send(np.array(pages, dtype=np.int32), num_kv_tokens=case["num_tokens"])
            else:
                sender.send(np.array(pages, dtype=np.int32), state_indices=window)
            result["state"] = _wait(sender.poll, {"Success", "Failed"}, deadline)
            if result["state"] == "Failed":
                result["reason"] = _reason(sender)
        result["events"] = _new_events()
        print(json.dumps(result), flush=True)
        _done(room, rank)
    time.sleep(1.0)  # let D read the last status
    sys.stdout.flush()
    os._exit(0)


def _digest_fault(fault: str, room: int) -> None:
    """``digest_fault``, on P's side and for ``room`` only: ``"lost"``, P's digest message of
    the room never leaves P (as if the network dropped it); ``"unmade"``, P notes none of the
    room's pages as SGLang hands them to its transfer, so it has no digest to send and sends
    D its reason instead."""
    from safeview.sglang import _digest

    mine = str(room).encode("ascii")
    if fault == "lost":
        send = _digest._send

        def dropped(manager: Any, host: str, port: int, frames: list[bytes]) -> None:
            if frames[:2] != [_digest.DIGEST_FRAME, mine]:
                send(manager, host, port, frames)

        _digest._send = dropped
    elif fault == "unmade":
        note = _digest._note_chunk

        faulty = room

        def unnoted(manager: Any, room: int, pages: Any, index_slice: Any, tokens: Any) -> None:
            if room != faulty:
                note(manager, room, pages, index_slice, tokens)

        _digest._note_chunk = unnoted
    else:
        raise ValueError(f"digest_fault {fault!r}")


def _reason(party: Any) -> str:
    try:
        party.failure_exception()
    except Exception as error:
        return str(error)
    return ""


def _done(room: int, rank: int) -> None:
    """Say that P rank ``rank`` is through with ``room`` (``SAFEVIEW_HARNESS_SYNC``)."""
    folder = os.environ.get("SAFEVIEW_HARNESS_SYNC")
    if folder:
        (Path(folder) / f"prefill-{room}-{rank}").touch()


def _wait_prefill(room: int, ranks: int) -> None:
    """Wait until every P rank is through with ``room``: D's managers of one process share
    one Mooncake session, and P keeps its verdict per session, so the next case's D must not
    register before P has failed or finished this one."""
    folder = os.environ.get("SAFEVIEW_HARNESS_SYNC")
    deadline = time.monotonic() + TIMEOUT_S
    while folder and time.monotonic() < deadline:
        if all((Path(folder) / f"prefill-{room}-{rank}").exists() for rank in range(ranks)):
            return
        time.sleep(0.02)


def _cut_short(wire: Any, length: int, manifest: Any) -> bytes:
    return bytes(wire(manifest))[:length]


def _decode_policy(case: dict[str, Any]) -> Any:
    """``decode_policy``: D's manager of this case made under that policy (safeview's scope;
    a manager keeps the policy in force when it registered)."""
    import contextlib

    if not case.get("decode_policy"):
        return contextlib.nullcontext()
    from safeview.policy import policy_scope

    return policy_scope(case["decode_policy"])


def _corrupt_when_done(manager: Any, pool: Any, pages: list[int], where: list[int]) -> None:
    """``corrupt``: ``[buffer, place, byte]``: when SGLang's decode thread marks the room
    ``Success`` (every P rank reported its pages written), one byte of D's pool changes, in
    buffer ``buffer`` (K buffers, then V, as registered), page ``pages[place]``, byte ``byte``
    of that page; SGLang's receiver reports the room done only after (a stray write into
    received pages, after the transfer and before D reads them)."""
    import torch

    buffer_index, place, byte = (int(x) for x in where)
    original = manager.update_status

    def update_status(room: int, status: Any) -> Any:
        if int(status) == 4 and manager.request_status.get(room) not in (None, 0, 4):
            buffer = [*pool.k_buffer, *pool.v_buffer][buffer_index]
            raw = buffer.view(torch.uint8).view(buffer.shape[0], -1)
            page = raw[pages[place] * PAGE_SIZE : (pages[place] + 1) * PAGE_SIZE].view(-1)
            page[byte] ^= 0xFF
        return original(room, status)

    manager.update_status = update_status


_FRAMES: list[str] = []  # SAFEVIEW_HARNESS_FRAMES=1: the first frame of each message D got


def _record_frames() -> None:
    """Note the first frame of every message D's decode thread offers its handlers after
    ``AUX_DATA`` (``handle_chunk_ready``, SGLang's first), as text, at most 24 characters."""
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager  # type: ignore[import-not-found,unused-ignore]

    original = MooncakeKVManager.handle_chunk_ready

    def handle_chunk_ready(self: Any, msg: Any) -> Any:
        if msg:
            _FRAMES.append(bytes(msg[0])[:24].decode("latin-1"))
        return original(self, msg)

    MooncakeKVManager.handle_chunk_ready = handle_chunk_ready


def decode(port: int, cases: list[dict[str, Any]], rank: int = 0) -> None:
    import numpy as np
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVReceiver  # type: ignore[import-not-found,unused-ignore]

    if os.environ.get("SAFEVIEW_HARNESS_FRAMES") == "1":
        _record_frames()
    server_args = _server_args("decode", port, _tp(cases[0]["decode"]), rank)
    for room, case in enumerate(cases, start=1):
        if room > 1:
            _wait_prefill(room - 1, _tp(cases[0]["prefill"]))
        pool = _side_pool(case["decode"])
        _KEEP.append(pool)
        forged = case.get("forge_manifest")
        if forged:  # the manifest frame this D sends, for this case, is cut short (forged)
            judged = sys.modules["safeview.sglang._mooncake"]
            sent = judged.to_wire
            setattr(judged, "to_wire", functools.partial(_cut_short, sent, int(forged)))  # noqa: B010
        with _decode_policy(case):
            manager = _manager(pool, "decode", server_args, _total_heads(case["decode"]), rank=rank)
        _KEEP.append(manager)
        if case.get("corrupt") and rank == 0:
            _corrupt_when_done(manager, pool, case["dst_pages"], case["corrupt"])
        deadline = time.monotonic() + TIMEOUT_S
        address = f"127.0.0.1:{port}"
        # as the decode queue does before it makes a receiver: P's parallel info, once
        while not manager.try_ensure_parallel_info(address) and time.monotonic() < deadline:
            time.sleep(0.1)
        receiver = MooncakeKVReceiver(manager, address, room)
        receiver.init(0)
        pages = case["dst_pages"]
        window = [list(case["dst_state_pages"])] if "dst_state_pages" in case else None
        receiver.send_metadata(np.array(pages, dtype=np.int32), 0, state_indices=window)
        state = _wait(receiver.poll, {"Success", "Failed"}, deadline)
        result: dict[str, Any] = {"side": "decode", "case": case["name"], "state": state}
        if state == "Failed":
            result["reason"] = _reason(receiver)
        result["received"] = _page_bytes(_kv_of(pool), pages)
        result["nonzero_bytes"] = _nonzero(_kv_of(pool))
        if window is not None:  # the window pool: its pages D asked for, and any byte at all
            result["state_received"] = _state_bytes(pool, window[0])
            result["state_nonzero_bytes"] = _state_nonzero(pool)
            inside = sum(bytes.fromhex(part).count(0) for part in result["state_received"])
            asked = sum(len(part) // 2 for part in result["state_received"])
            # bytes written in the state pool outside the pages D asked for
            result["state_outside_bytes"] = result["state_nonzero_bytes"] - (asked - inside)
        if _FRAMES:
            result["frames"] = sorted(set(_FRAMES))
        if forged:
            setattr(judged, "to_wire", sent)  # noqa: B010
        if case.get("by_meaning"):
            heads = _heads_of(case["decode"], rank)
            result["wrong_bytes"] = _meaning_mismatches(_kv_of(pool), pages, heads)
            if window is not None:
                result["state_wrong_bytes"] = _meaning_mismatches(
                    pool.swa_kv_pool, window[0], heads
                )
        result["events"] = _new_events()
        print(json.dumps(result), flush=True)
    # P may still be moving the last case's pages when D has failed it (a refusal at D under
    # strict fails D's request, not P's transfer): D stays until P is through, or P's transfer
    # would fail on a D that is gone
    _wait_prefill(len(cases), _tp(cases[0]["prefill"]))
    sys.stdout.flush()
    os._exit(0)


def pools(cases: list[dict[str, Any]]) -> None:
    """For each case a pool (``kind`` ``mha`` or ``mla``), each element of every buffer
    holding its own code (``_code``), and one JSON line: the pool's manifest
    (``safeview.sglang.describe_pool``) and every buffer's storage as hex, with its first
    byte's offset in it; ``tests/test_sglang.py`` decodes the bytes by the manifest."""
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # type: ignore[import-not-found,unused-ignore]

    import safeview.sglang

    for case in cases:
        if case.get("kind") == "mla":
            pool = MLATokenToKVPool(
                size=POOL_TOKENS, page_size=PAGE_SIZE, dtype=torch.bfloat16,
                kv_lora_rank=int(case["latent"]) - 8, qk_rope_head_dim=8, layer_num=LAYERS,
                device="cpu", enable_memory_saver=False,
            )  # fmt: skip
            buffers = {f"kv.{i}": t for i, t in enumerate(pool.kv_buffer)}
        else:
            pool = MHATokenToKVPool(
                size=POOL_TOKENS, page_size=PAGE_SIZE,
                dtype=getattr(torch, case.get("dtype", "bfloat16")),
                head_num=int(case.get("heads", 4)), head_dim=int(case.get("head_dim", 16)),
                v_head_dim=case.get("v_head_dim"), layer_num=LAYERS, device="cpu",
                enable_memory_saver=False,
            )  # fmt: skip
            buffers = {f"k.{i}": t for i, t in enumerate(pool.k_buffer)}
            buffers |= {f"v.{i}": t for i, t in enumerate(pool.v_buffer)}
        for name, tensor in buffers.items():
            codes = _code_tensor(name, tensor)
            raw = tensor.view(codes.dtype) if tensor.element_size() > 1 else tensor
            raw.copy_(codes.view(raw.shape).to(raw.dtype))
        storages = {}
        for name, tensor in buffers.items():  # K and V may share one storage: read it whole
            storage = tensor.untyped_storage()
            storages[name] = {
                "offset": tensor.data_ptr() - storage.data_ptr(),
                "base": storage.data_ptr(),
                "hex": bytes(storage).hex(),
            }
        topology = {"tp_size": 1, "total_kv_heads": int(getattr(pool, "head_num", 1))}
        manifest = safeview.sglang.describe_pool(pool, topology=topology)
        print(json.dumps({"case": case, "manifest": manifest.to_json(),
                          "storages": storages}), flush=True)  # fmt: skip
    os._exit(0)


def _window_pool(side: dict[str, Any] | None = None) -> Any:
    """SGLang's sliding-window pool (``SWAKVPool``) on CPU: 2 full-attention layers and 2
    window layers of ``heads`` (4) heads of 16 bf16 values, the window half as many slots (8
    pages and SGLang's padded one); ``side``'s ``window_heads`` and ``window_head_dim`` make the
    window pool's heads another shape (through SGLang's own ``swa_kv_pool_kwargs``)."""
    import torch
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool  # type: ignore[import-not-found,unused-ignore]

    side = side or {}
    window = None
    if side.get("window_heads") or side.get("window_head_dim"):
        window = {
            "page_size": PAGE_SIZE, "enable_memory_saver": False, "device": "cpu",
            "head_num": int(side.get("window_heads", 4)),
            "head_dim": int(side.get("window_head_dim", 16)),
        }  # fmt: skip
    return SWAKVPool(
        size=POOL_TOKENS, size_swa=POOL_TOKENS // 2, page_size=PAGE_SIZE, dtype=torch.bfloat16,
        head_num=int(side.get("heads", 4)), head_dim=16, swa_attention_layer_ids=[0, 2],
        full_attention_layer_ids=[1, 3], device="cpu", enable_memory_saver=False,
        swa_kv_pool_kwargs=window,
    )  # fmt: skip


MAMBA_SLOTS = 8  # a Mamba pool's request slots (and SGLang's padded one)


def _mamba_pool(side: dict[str, Any] | None = None) -> Any:
    """SGLang's Mamba hybrid pool (``HybridLinearKVPool`` over a ``MambaPool``) on CPU: 2
    full-attention layers (ids 1 and 3) of 4 heads of 16 bf16 values and 2 Mamba2 layers (ids
    0 and 2: a conv state of 40 channels by 3 and a temporal state of 4 heads of 8 by 4, bf16
    and float32, SGLang's own shapes for that model, split over ``tp_size`` ranks as SGLang
    splits them: with ``groups`` (1) that TP does not divide, SGLang widens each rank's conv
    state); ``side``'s ``conv_dtype`` another conv dtype."""
    import torch
    from sglang.srt.configs.mamba_utils import (  # type: ignore[import-not-found,unused-ignore]
        Mamba2CacheParams,
        Mamba2StateDType,
        Mamba2StateShape,
    )
    from sglang.srt.mem_cache.memory_pool import (  # type: ignore[import-not-found,unused-ignore]
        HybridLinearKVPool,
        MambaPool,
    )

    side = side or {}
    shape = Mamba2StateShape.create(
        tp_world_size=_tp(side), intermediate_size=32, n_groups=int(side.get("groups", 1)),
        num_heads=4, head_dim=8,
        state_size=4, conv_kernel=4,
    )  # fmt: skip
    dtype = Mamba2StateDType(
        conv=getattr(torch, side.get("conv_dtype", "bfloat16")), temporal=torch.float32
    )
    params = Mamba2CacheParams(shape=shape, layers=[0, 2], dtype=dtype)
    mamba = MambaPool(
        size=MAMBA_SLOTS, spec_state_size=0, cache_params=params, mamba_layer_ids=[0, 2],
        device="cpu",
    )  # fmt: skip
    return HybridLinearKVPool(
        size=POOL_TOKENS, dtype=torch.bfloat16, page_size=PAGE_SIZE,
        head_num=int(side.get("heads", 4)), head_dim=16,
        full_attention_layer_ids=[1, 3], device="cpu", mamba_pool=mamba,
    )  # fmt: skip


def _side_pool(side: dict[str, Any]) -> Any:
    """The pool a side of a case has: an ``SWAKVPool`` with ``window``, a Mamba hybrid with
    ``mamba``, else an MHA pool."""
    if side.get("window"):
        return _window_pool(side)
    return _mamba_pool(side) if side.get("mamba") else _pool(side)


def _state_tensors(pool: Any) -> list[Any]:
    """The ``[slots or slot pages, ...]`` state tensors SGLang registers as the pool's state,
    in its order: a window pool's K then V buffers, or a Mamba pool's state entries."""
    if hasattr(pool, "swa_kv_pool"):
        return [*pool.swa_kv_pool.k_buffer, *pool.swa_kv_pool.v_buffer]
    return [entry[1] for entry in pool.mamba_pool._iter_transfer_state_entries()]


def _state_rows(pool: Any) -> int:
    """How many of a state tensor's first-axis rows make one of SGLang's state indices."""
    return PAGE_SIZE if hasattr(pool, "swa_kv_pool") else 1


def _rows_of(tensor: Any) -> Any:
    """A ``[rows, ...]`` tensor's rows as bytes, ``[rows, row bytes]``, whatever the order of
    the dimensions inside a row (SGLang lays a Mamba conv state out otherwise on AMX CPUs)."""
    import torch

    size = tensor.element_size()
    whole = torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())
    width = tensor.stride(0) * size
    return whole.as_strided((tensor.shape[0], width), (width, 1), tensor.storage_offset() * size)


def _state_pattern(pool: Any, pages: list[int]) -> None:
    """Distinct bytes into ``pages`` (window pages, Mamba slots) of every state tensor."""
    import torch

    rows = _state_rows(pool)
    for index, tensor in enumerate(_state_tensors(pool)):
        raw = _rows_of(tensor)
        for page in pages:
            part = raw[page * rows : (page + 1) * rows]
            values = torch.arange(part.numel(), dtype=torch.int64) * 11 + index * 29 + page * 7
            part.copy_((values % 249 + 3).to(torch.uint8).view(part.shape))


def _state_bytes(pool: Any, pages: list[int]) -> list[str]:
    """Each state tensor's ``pages`` as hex, in registration order (a page past it: empty)."""
    rows = _state_rows(pool)
    found = []
    for tensor in _state_tensors(pool):
        raw = _rows_of(tensor)
        parts = [raw[p * rows : (p + 1) * rows].contiguous().numpy().tobytes() for p in pages]
        found.append(b"".join(parts).hex())
    return found


def _state_nonzero(pool: Any) -> int:
    return int(sum(int((_rows_of(t) != 0).sum()) for t in _state_tensors(pool)))


def _kv_of(pool: Any) -> Any:
    """The MHA pool whose pages SGLang moves as KV (an ``SWAKVPool``'s full-attention one)."""
    return getattr(pool, "full_kv_pool", pool)


def state_pools() -> None:
    """SGLang's sliding-window pool (``SWAKVPool``) on CPU, its KV and state buffers asked for
    as the prefill's ``KVArgs`` asks: one JSON line, what ``describe_pool`` says of it and of
    its full-attention pool, and safeview's events."""
    import safeview.sglang

    pool = _window_pool()
    kv = pool.get_contiguous_buf_infos()
    state = pool.get_state_buf_infos()
    result: dict[str, Any] = {"kv_regions": len(kv[0]), "state_regions": len(state[0])}
    both = safeview.sglang.describe_pool(pool)
    full = safeview.sglang.describe_pool(pool.full_kv_pool)
    window = safeview.sglang.describe_pool(pool.swa_kv_pool, prefix="swa.")
    result["layers"] = sorted(both.layers)
    result["full_layers"] = sorted(full.layers)
    result["parts_agree"] = both.layers == {**full.layers, **window.layers}
    result["full_is_registered"] = sorted(
        int(t.data_ptr()) for t in [*pool.full_kv_pool.k_buffer, *pool.full_kv_pool.v_buffer]
    ) == sorted(int(p) for p in kv[0])
    result["window_is_state"] = [
        int(t.data_ptr()) for t in [*pool.swa_kv_pool.k_buffer, *pool.swa_kv_pool.v_buffer]
    ] == [int(p) for p in state[0]]
    # a Mamba hybrid: its states as SGLang registers them, and as safeview reads them
    hybrid = _mamba_pool()
    pointers, _lengths, items = hybrid.get_state_buf_infos()
    mamba = safeview.sglang.describe_pool(hybrid)
    states = {n: layer for n, layer in mamba.layers.items() if n.startswith("mamba.")}
    result["mamba_layers"] = list(states)
    result["mamba_pages"] = [[layer.num_blocks, layer.chunk_bytes] for layer in states.values()]
    result["mamba_items"] = [int(item) for item in items]
    result["mamba_is_state"] = [
        int(b.tensor.data_ptr()) for b in safeview.sglang.pool_buffers(hybrid.mamba_pool)
    ] == [int(p) for p in pointers]
    result["mamba_kinds"] = sorted({layer.kind for layer in states.values()})
    result["events"] = _new_events()
    print(json.dumps(result), flush=True)
    os._exit(0)


def _code_tensor(name: str, tensor: Any) -> Any:
    """Every element's code: its buffer (K 0, V 1, MLA 0), slot, and index inside the slot,
    ``((buffer * slots + slot) * per_slot + index) % 2**15``, in the buffer's item size."""
    import torch

    slots = tensor.shape[0]
    per_slot = tensor[0].numel()
    which = 1 if name.startswith("v.") else 0
    codes = (which * slots + torch.arange(slots).view(-1, 1)) * per_slot + torch.arange(per_slot)
    if tensor.element_size() == 1:
        return (codes % 251).to(torch.uint8)
    return (codes % 2**15).to(torch.int16)


def register(port: int, cases: list[dict[str, Any]]) -> None:
    """For each case a decode manager over a pool whose first region SGLang reports
    ``extra_pages`` pages longer than its buffer (with ``window``, an ``SWAKVPool`` whose first
    state region is ``state_extra_pages`` longer): one JSON line, whether the manager
    registered its regions with Mooncake or what refused them."""
    server_args = _server_args("decode", port)
    for case in cases:
        pool = _window_pool() if case.get("window") else _pool(case.get("decode", {}))
        _KEEP.append(pool)
        result: dict[str, Any] = {"case": case["name"]}
        try:
            extra, state_extra = int(case["extra_pages"]), int(case.get("state_extra_pages", 0))
            _KEEP.append(_manager(pool, "decode", server_args, 4, extra, 0, state_extra))
            result["registered"] = True
        except Exception as refusal:
            result["registered"] = False
            result["refused"] = f"{type(refusal).__name__}: {refusal}"
        result["events"] = _new_events()
        print(json.dumps(result), flush=True)
    os._exit(0)


_CAPTURED: list[list[dict[str, Any]]] = []  # the list capture_events fills, when installed


def _new_events() -> list[dict[str, Any]]:
    """safeview's events since the last call (JSON-ready)."""
    if not _CAPTURED:
        return []
    events = _CAPTURED[0]
    taken = len(events)
    found = [json.loads(json.dumps(event, default=str)) for event in events[:taken]]
    del events[:taken]
    return found


def main() -> None:
    role, port, cases = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    rank = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    _stand_ins()
    try:
        if os.environ.get("SAFEVIEW_HARNESS_INSTALL") == "1":
            import logging

            import safeview.sglang
            from safeview.testing import capture_events

            # every event of the process, to the end (os._exit closes nothing); the context
            # manager is kept, or its collection would end it
            capture = capture_events(logging.INFO)
            _KEEP.append(capture)
            _CAPTURED.append(capture.__enter__())
            safeview.sglang.install()
        if role == "pools":
            pools(cases)
        if role == "register":
            register(port, cases)
        if role == "state_pools":
            state_pools()
        (prefill if role == "prefill" else decode)(port, cases, rank)
    except BaseException as error:
        import traceback

        traceback.print_exc()
        print(json.dumps({"side": role, "error": f"{type(error).__name__}: {error}"}), flush=True)
        sys.stdout.flush()
        os._exit(3)


if __name__ == "__main__":
    main()
