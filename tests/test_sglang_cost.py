"""What keeps safeview's SGLang hooks cheap (issue 39's cost) without changing a verdict: a
pool's layers of one geometry read once and each ``Layer`` checked once, P's manifest put on the
wire once, a Mooncake batch proven right in one numpy pass before any row is explained, a
registration proven inside its buffers in one sorted sweep. Each proof is held against the full
judge it stands in front of (``check_descriptors``, ``check_transfer``). CPU pools built as
SGLang 0.5.23 allocates them; no SGLang needed (``tests/test_sglang.py`` runs the real
managers)."""

from __future__ import annotations

import random
import types
from typing import Any

import pytest
import torch
from pydantic import ValidationError

import safeview._torch
import safeview.manifest._model as model
import safeview.sglang
from safeview.errors import AddressError
from safeview.manifest import Layer, Manifest
from safeview.manifest.wire import to_wire
from safeview.policy import Policy
from safeview.sglang import _mooncake as mooncake
from safeview.sglang import describe_pool, pool_buffers, pool_memory_map
from safeview.testing import capture_events
from safeview.transfer import check_descriptors

PAGE, HEADS, HEAD_DIM, LAYERS, PAGES = 4, 2, 8, 3, 6
ITEM = PAGE * HEADS * HEAD_DIM * 2  # bytes of one page of one K or V buffer (bf16)
SESSION = "127.0.0.1:9"


def _pool() -> Any:
    """An MHA pool as SGLang 0.5.23 allocates one: per layer, K and V as the two halves of one
    CPU allocation, ``[slots, heads, head_dim]`` each."""
    shape = (2, PAGES * PAGE, HEADS, HEAD_DIM)
    fused = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(LAYERS)]
    return types.SimpleNamespace(
        k_buffer=[both[0] for both in fused], v_buffer=[both[1] for both in fused],
        page_size=PAGE, head_num=HEADS, dtype=torch.bfloat16, start_layer=0, keep=fused,
    )  # fmt: skip


def _pair(whole_pages: bool = True) -> tuple[Any, Any, mooncake._Side]:
    """P's pool, D's pool, and P's side with D's session registered as SGLang would."""
    prefill, decode = _pool(), _pool()
    side = mooncake._Side(Policy.STRICT, prefill, describe_pool(prefill))
    pointers = [buffer.tensor.data_ptr() for buffer in pool_buffers(decode)]
    peer = mooncake.peer_memory_map(describe_pool(decode), pointers)
    assert peer is not None
    side.peers[SESSION] = (peer, whole_pages)
    return prefill, decode, side


def _page(pool: Any, buffer: int, page: int) -> int:
    return int(pool_buffers(pool)[buffer].tensor.data_ptr()) + page * ITEM


def _judged(side: mooncake._Side, rows: list[tuple[int, int, int]]) -> tuple[bool, bool]:
    """(the proof's verdict, the full judge's) on one batch of ``(src, dst, length)`` rows."""
    sources, destinations, lengths = (list(column) for column in zip(*rows, strict=True))
    proven = mooncake._proven_batch(side, SESSION, sources, destinations, lengths)
    return proven, mooncake.check_transfer(None, side, SESSION, rows)


def test_describe_pool_reads_one_page_per_geometry_and_keeps_the_manifest() -> None:
    pool = _pool()
    manifest = describe_pool(pool)
    assert list(manifest.layers) == ["layers.0", "layers.1", "layers.2"]
    # one Layer for the three alike layers: read once, not per layer
    assert manifest.layers["layers.0"] is manifest.layers["layers.2"]
    each = {
        f"layers.{i}": describe_pool(
            types.SimpleNamespace(**{**vars(pool), "k_buffer": [k], "v_buffer": [v]})
        ).layers["layers.0"]
        for i, (k, v) in enumerate(zip(pool.k_buffer, pool.v_buffer, strict=True))
    }
    assert dict(manifest.layers) == each  # the same meaning as each layer read alone


def test_a_layer_of_another_geometry_is_read_as_its_own() -> None:
    pool = _pool()
    odd = torch.zeros(2, PAGES * PAGE, HEADS, 2 * HEAD_DIM, dtype=torch.bfloat16)
    pool.k_buffer[1], pool.v_buffer[1] = odd[0], odd[1]
    manifest = describe_pool(pool)
    assert manifest.layers["layers.0"] is manifest.layers["layers.2"]
    assert manifest.layers["layers.1"].page_bytes == 2 * manifest.layers["layers.0"].page_bytes


def test_the_own_manifest_goes_on_the_wire_once() -> None:
    _, _, side = _pair()
    assert side.manifest is not None
    first = mooncake._own_wire(side, side.manifest)
    assert mooncake._own_wire(side, side.manifest) is first


def test_whole_pages_into_the_same_layer_are_proven_without_the_row_by_row_judge() -> None:
    prefill, decode, side = _pair()
    rows = [(_page(prefill, b, 2 * p), _page(decode, b, 2 * p + 1), ITEM)
            for b in range(2 * LAYERS) for p in range(3)]  # fmt: skip
    rows.append((_page(prefill, 0, 0), _page(decode, 0, 4), 2 * ITEM))  # a run of two pages
    assert _judged(side, rows) == (True, True)


@pytest.mark.parametrize(
    ("case", "row"),
    [
        ("one byte into the page", lambda p, d: (_page(p, 0, 1) + 1, _page(d, 0, 1), ITEM)),
        ("short of a page", lambda p, d: (_page(p, 0, 1), _page(d, 0, 1), ITEM - 2)),
        ("past D's last page", lambda p, d: (_page(p, 0, 1), _page(d, 0, PAGES), ITEM)),
        ("K's page into D's V", lambda p, d: (_page(p, 0, 1), _page(d, LAYERS, 1), ITEM)),
        ("two pages past P's end", lambda p, d: (_page(p, 0, PAGES - 1), _page(d, 0, 0), 2 * ITEM)),
        ("into no D buffer", lambda p, d: (_page(p, 0, 1), 8, ITEM)),
    ],
)  # fmt: skip
def test_a_wrong_row_is_left_to_the_judge_that_refuses_it(case: str, row: Any) -> None:
    prefill, decode, side = _pair()
    good = (_page(prefill, 1, 0), _page(decode, 1, 0), ITEM)
    assert _judged(side, [good, row(prefill, decode)]) == (False, False), case


def test_rows_of_no_pool_read_are_left_to_sglang_by_both() -> None:
    _, _, side = _pair()
    metadata = torch.zeros(64, dtype=torch.uint8)
    rows = [(metadata.data_ptr(), 8, 16)]
    assert _judged(side, rows) == (True, True)


def test_slices_inside_one_page_are_proven_at_another_tp_and_a_slice_across_two_is_not() -> None:
    prefill, decode, side = _pair(whole_pages=False)
    inside = (_page(prefill, 0, 1) + 32, _page(decode, 0, 2) + 64, 64)
    across = (_page(prefill, 0, 1) + ITEM - 32, _page(decode, 0, 2), 64)
    assert _judged(side, [inside]) == (True, True)
    assert _judged(side, [inside, across]) == (False, False)


def test_the_proof_never_passes_a_batch_the_judge_refuses() -> None:
    prefill, decode, side = _pair()
    chooser = random.Random(39)
    passed = 0
    for _ in range(300):
        rows = []
        for _ in range(chooser.randint(1, 12)):
            buffer, page = chooser.randrange(2 * LAYERS), chooser.randrange(PAGES + 1)
            other = buffer if chooser.random() < 0.9 else chooser.randrange(2 * LAYERS)
            shift = chooser.choice([0] * 12 + [1, -1, ITEM // 2])
            length = chooser.choice([ITEM] * 12 + [2 * ITEM, ITEM - 1, ITEM + 1])
            rows.append((_page(prefill, buffer, page), _page(decode, other, page) + shift, length))
        proven, judged = _judged(side, rows)
        assert judged or not proven, rows
        passed += proven
    assert passed > 30  # the clean batches drawn are proven, not all sent to the judge


def test_a_registration_inside_its_buffers_is_proven_and_one_past_is_refused() -> None:
    pool = _pool()
    buffers = pool_buffers(pool)
    rows = [(int(b.tensor.data_ptr()), int(b.tensor.nbytes)) for b in buffers]
    assert mooncake._inside_buffers(rows, buffers)
    whole = pool_memory_map(pool, whole_buffers=True)
    names: list[str | None] = [b.name for b in buffers]
    assert check_descriptors(rows, whole, layers=names, whole_pages=False, policy="strict") == []
    past = [(rows[0][0], rows[0][1] + 1), *rows[1:]]
    assert not mooncake._inside_buffers(past, buffers)
    side = mooncake._Side(Policy.STRICT, pool, describe_pool(pool))
    kv_args = types.SimpleNamespace(
        kv_data_ptrs=[r[0] for r in past], kv_data_lens=[r[1] for r in past]
    )
    with pytest.raises(AddressError) as raised:
        mooncake.check_registration(types.SimpleNamespace(kv_args=kv_args), side)
    assert "layers.0.k" in str(raised.value)


def test_a_layer_nested_in_a_manifest_is_checked_once(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = describe_pool(_pool()).layers["layers.0"]
    checked: list[Layer] = []
    real = model._layer_fingerprint

    def counted(layer: Layer) -> str:
        checked.append(layer)
        return real(layer)

    monkeypatch.setattr(model, "_layer_fingerprint", counted)
    manifest = Manifest(layers={f"layers.{i}": layer for i in range(61)})
    assert checked == []  # pydantic's after-validator met the checked instance 61 times
    assert manifest.fingerprint == Manifest.model_validate_json(manifest.to_json()).fingerprint
    assert len(checked) == 61  # each layer read from text: new instances, each checked


def test_a_layer_made_without_its_checks_is_still_refused_in_a_manifest() -> None:
    layer = describe_pool(_pool()).layers["layers.0"]
    forged = Layer.model_construct(**{**dict(layer), "chunk_bytes": layer.chunk_bytes + 2})
    with pytest.raises(ValidationError, match="chunk_bytes"):
        Manifest(layers={"layers.0": forged})


class _Remembered(types.SimpleNamespace):
    """A pool ``remember_pool`` can keep a weak reference to."""


def _registering(kv: Any, state: list[tuple[str, list[tuple[int, int]]]]) -> Any:
    """A manager about to register ``kv``'s buffers and the state components ``state`` (a kind
    and its regions each), as SGLang's ``KVArgs`` lists them."""
    buffers = pool_buffers(kv)
    kv_args = types.SimpleNamespace(
        kv_data_ptrs=[int(b.tensor.data_ptr()) for b in buffers],
        kv_data_lens=[int(b.tensor.nbytes) for b in buffers],
        total_kv_head_num=HEADS,
        state_types=[kind for kind, _ in state],
        state_data_ptrs=[[address for address, _ in rows] for _, rows in state],
        state_data_lens=[[length for _, length in rows] for _, rows in state],
    )
    return types.SimpleNamespace(
        kv_args=kv_args, attn_tp_rank=0, attn_tp_size=1, disaggregation_mode="prefill",
        local_ip="127.0.0.1", rank_port=9,
    )  # fmt: skip


def test_a_registration_reads_each_buffer_once_for_its_manifest_and_its_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pool = _Remembered(**vars(_pool()))  # remember_pool keeps a weak reference
    safeview.sglang.remember_pool(pool)
    buffers = pool_buffers(pool)
    manager = _registering(pool, [])
    kv_args = manager.kv_args
    read: list[torch.Tensor] = []
    real = safeview._torch.geometry

    def counted(tensor: torch.Tensor) -> Any:
        read.append(tensor)
        return real(tensor)

    monkeypatch.setattr(safeview._torch, "geometry", counted)
    side = mooncake._side(manager)
    mooncake.check_registration(manager, side)
    assert len(read) == len(buffers) == 2 * LAYERS  # once each, not once per use
    assert side.listed is None  # forgotten after the check: a later one reads them anew
    mooncake.check_registration(manager, side)
    assert len(read) == 4 * LAYERS
    monkeypatch.setattr(safeview._torch, "geometry", real)
    assert side.manifest is not None
    alone = describe_pool(pool, topology=mooncake._topology(manager))
    assert side.manifest.fingerprint == alone.fingerprint  # the same manifest as read alone
    past = [*kv_args.kv_data_lens]
    past[3] += 1
    kv_args.kv_data_lens = past
    with pytest.raises(AddressError, match=r"layers\.0\.v"):
        mooncake.check_registration(manager, mooncake._side(manager))


def test_a_window_pools_state_regions_are_checked_inside_its_buffers_and_others_left(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(safeview.sglang, "_stepped_aside", set())  # said once per process
    kv, window = _Remembered(**vars(_pool())), _Remembered(**vars(_pool()))
    for pool in (kv, window):  # as SGLang asks each pool for its buffer infos
        safeview.sglang.remember_pool(pool)
    regions = [(int(b.tensor.data_ptr()), int(b.tensor.nbytes)) for b in pool_buffers(window)]
    mamba = torch.zeros(4, 64, dtype=torch.uint8)  # a state buffer of no pool safeview read
    loose = [(int(mamba.data_ptr()), 256)]
    with capture_events() as events:
        manager = _registering(kv, [("swa", regions), ("mamba", loose)])
        mooncake.check_registration(manager, mooncake._side(manager))  # all inside: no raise
        assert not [e for e in events if e["event"] == "address_violation"]
        said = [e["reason"] for e in events if e["event"] == "integration_unavailable"]
        assert [r.split(":")[0] for r in said] == ["mamba state regions left unchecked"]
        # the window pool's regions in another order are not its buffers in order: left alone
        swapped = [regions[1], regions[0], *regions[2:]]
        manager = _registering(kv, [("swa", swapped)])
        mooncake.check_registration(manager, mooncake._side(manager))
        assert "swa state regions left unchecked" in events[-1]["reason"]
    past = [*regions]
    past[LAYERS] = (past[LAYERS][0], past[LAYERS][1] + 1)  # the window's layers.0.v, a byte on
    manager = _registering(kv, [("swa", past)])
    with pytest.raises(AddressError, match=r"meant for layer 'swa\.layers\.0\.v'"):
        mooncake.check_registration(manager, mooncake._side(manager))
    with capture_events() as events:  # under warn: the event, and SGLang registers it
        manager = _registering(kv, [("swa", past)])
        side = mooncake._side(manager)
        side.policy = Policy.WARN
        mooncake.check_registration(manager, side)
    [violation] = [e for e in events if e["event"] == "address_violation"]
    assert violation["layer"] == "swa.layers.0.v"
    assert violation["kind"] == "outside_memory"


def _decode_registration(decode: Any, window: Any | None) -> Any:
    """What P holds of a decode peer once SGLang read its registration (``KVArgsRegisterInfo``)
    and safeview its frames: D's pointers, item lengths and manifests (``window``: D's window
    pool, SGLang's ``swa`` state, and its manifest)."""
    states = {}
    pointers, items = [], []
    if window is not None:
        buffers = pool_buffers(window, prefix="swa.")
        pointers = [[int(b.tensor.data_ptr()) for b in buffers]]
        items = [[int(b.item_bytes) for b in buffers]]
        states["swa"] = to_wire(describe_pool(window, prefix="swa."))
    return types.SimpleNamespace(
        _safeview_manifest=to_wire(describe_pool(decode)), _safeview_states=states,
        dst_kv_ptrs=[int(b.tensor.data_ptr()) for b in pool_buffers(decode)],
        dst_state_data_ptrs=pointers, dst_state_item_lens=items, dst_tp_rank=0,
        dst_attn_tp_size=1, dst_kv_item_len=ITEM, dst_dcp_size=1,
    )  # fmt: skip


def test_window_rows_are_judged_in_the_window_d_described_and_left_where_it_did_not() -> None:
    kv, window = _Remembered(**vars(_pool())), _Remembered(**vars(_pool()))
    for pool in (kv, window):
        safeview.sglang.remember_pool(pool)
    regions = [(int(b.tensor.data_ptr()), int(b.tensor.nbytes)) for b in pool_buffers(window)]
    manager = _registering(kv, [("swa", regions)])
    manager.kv_args.page_size = PAGE
    manager.kv_args.state_item_lens = [[ITEM] * len(regions)]
    manager.dcp_size = 1
    side = mooncake._side(manager)
    assert sorted(side.states) == ["swa"]
    decode, decode_window = _pool(), _pool()
    with capture_events() as events:
        error, _ = mooncake.judge_decode_peer(
            manager, SESSION, _decode_registration(decode, decode_window)
        )
    assert error is None
    assert [e["event"] for e in events] == ["layout_checked", "layout_checked"]
    assert side.kinds[SESSION] == frozenset({"swa"})

    def window_page(pool: Any, buffer: int, page: int) -> int:
        return int(pool_buffers(pool)[buffer].tensor.data_ptr()) + page * ITEM

    # a window page into D's window page of the same buffer: proven and judged right
    inside = [(window_page(window, 1, 2), window_page(decode_window, 1, 4), ITEM)]
    assert _judged(side, inside) == (True, True)
    # past D's window buffer (its pool's 6 pages), and into D's KV in place of its window
    past = [(window_page(window, 1, 2), window_page(decode_window, 1, PAGES), ITEM)]
    crossed = [(window_page(window, 1, 2), window_page(decode, 1, 4), ITEM)]
    for rows in (past, crossed):
        with capture_events() as events:
            assert _judged(side, rows) == (False, False)
        [violation] = [e for e in events if e["event"] == "address_violation"]
        assert violation["layer"] == "swa.layers.1.k", violation
    # a D that described no window (no safeview state frame): its window rows are SGLang's
    with capture_events() as events:
        mooncake.judge_decode_peer(manager, SESSION, _decode_registration(decode, None))
    verdicts = [e.get("verdict") for e in events if e["event"] == "layout_checked"]
    assert verdicts == ["compatible", "not_judged"]
    assert side.kinds[SESSION] == frozenset()
    assert _judged(side, past) == (True, True)
    # the KV rows are judged as before, in the map without the window
    assert _judged(side, [(_page(kv, 0, 1), _page(decode, 0, PAGES), ITEM)]) == (False, False)


class _MambaStates:
    """State tensors laid out as SGLang 0.5.23's ``MambaPool`` lays them out (per field a
    ``[layers, slots, ...]`` tensor; what SGLang registers is each layer's ``[slots, ...]``)."""

    def __init__(self, conv: torch.Tensor, temporal: torch.Tensor) -> None:
        self.mamba_cache = types.SimpleNamespace(conv=[conv], temporal=temporal)
        self.layer_ids = [0, 2]

    def _iter_transfer_state_entries(self) -> Any:
        for field, tensors in (("conv", self.mamba_cache.conv), ("temporal", [
            self.mamba_cache.temporal
        ])):  # fmt: skip
            for tensor in tensors:
                for index, layer_id in enumerate(self.layer_ids):
                    yield field, tensor[index], 0, layer_id


def test_a_mamba_pools_states_are_read_a_slot_a_page_and_a_slot_with_gaps_is_refused() -> None:
    from safeview.errors import ManifestError

    conv = torch.zeros(2, 9, 40, 3, dtype=torch.bfloat16)
    temporal = torch.zeros(2, 9, 4, 8, 4, dtype=torch.float32)
    manifest = describe_pool(_MambaStates(conv, temporal), prefix="mamba.")
    assert list(manifest.layers) == [
        "mamba.conv.layers.0", "mamba.conv.layers.2",
        "mamba.temporal.layers.0", "mamba.temporal.layers.2",
    ]  # fmt: skip
    first, second = manifest.layers["mamba.conv.layers.0"], manifest.layers["mamba.conv.layers.2"]
    assert (first.kind, first.num_blocks, first.chunk_bytes) == ("state", 9, 240)
    assert first.block_stride_bytes == 240
    assert second.byte_offset == 9 * 240  # the second layer's slots follow the first's
    assert manifest.layers["mamba.temporal.layers.0"].chunk_bytes == 4 * 8 * 4 * 4
    # the conv state as SGLang lays it out on AMX CPUs (channels innermost): still one dense
    # run a slot, read the same
    amx = conv.as_strided(conv.shape, (conv.stride(0), conv.stride(1), 1, 40))
    other = describe_pool(_MambaStates(amx, temporal), prefix="mamba.")
    assert other.layers["mamba.conv.layers.0"].chunk_bytes == 240
    # a slot that is not one dense run (every other channel): refused, naming the layer
    gaps = torch.zeros(2, 9, 80, 3, dtype=torch.bfloat16)[:, :, ::2]
    with pytest.raises(ManifestError, match=r"mamba\.conv\.layers\.0"):
        describe_pool(_MambaStates(gaps, temporal), prefix="mamba.")


def test_mamba_state_at_another_attention_tp_is_not_judged_but_its_slots_mapped() -> None:
    conv = torch.zeros(2, 9, 40, 3, dtype=torch.bfloat16)
    temporal = torch.zeros(2, 9, 4, 8, 4, dtype=torch.float32)
    mine = describe_pool(_MambaStates(conv, temporal), prefix="mamba.", topology={"tp_size": 1})
    state = mooncake._State(0, "mamba", None, [], mine)
    side = mooncake._Side(Policy.STRICT, None, None)
    theirs = describe_pool(_MambaStates(conv, temporal), prefix="mamba.")
    info = types.SimpleNamespace(
        _safeview_states={"mamba": to_wire(theirs)}, dst_attn_tp_size=2, dst_tp_rank=0,
        dst_state_data_ptrs=[[1 << 20] * 4], dst_state_item_lens=[[240] * 4],
    )  # fmt: skip
    fields = {  # what judge_decode_peer hands it: the pair, as the KV's event names it
        "engine": "sglang-prefill@127.0.0.1:9", "tp_rank": 0, "tp_size": 1,
        "remote_engine": f"sglang-decode session {SESSION}", "remote_tp_size": 2,
        "when": "handshake", "fingerprint": mine.fingerprint,
    }  # fmt: skip
    with capture_events() as events:
        error, copy, pages = mooncake._judge_decode_state(None, side, state, SESSION, info, fields)
    assert (error, copy) == (None, None)  # its meaning is not judged: no refusal
    [said] = events
    assert (said["event"], said["verdict"]) == ("layout_checked", "not_judged")
    assert "_send_mamba_state_slice" in said["reason"]
    # D's slots still mapped: each of its sliced rows is checked inside one slot
    assert pages is not None
    assert [(view.num_blocks, view.page_bytes) for view in pages.views][:2] == [(9, 240)] * 2
    # at equal attention TP the same pair is judged, and D's slots mapped
    info.dst_attn_tp_size = 1
    manager = types.SimpleNamespace(kv_args=types.SimpleNamespace(page_size=PAGE))
    with capture_events() as events:
        error, _, pages = mooncake._judge_decode_state(manager, side, state, SESSION, info, fields)
    assert error is None
    assert pages is not None
    assert [view.num_blocks for view in pages.views] == [9] * 4
    assert [e["verdict"] for e in events] == ["compatible"]


def test_a_state_pool_that_cannot_be_read_is_left_and_the_kv_still_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(safeview.sglang, "_stepped_aside", set())  # said once per process
    kv = _Remembered(**vars(_pool()))
    flat = [torch.zeros(64, dtype=torch.bfloat16) for _ in range(2)]  # not [slots, ...]
    odd = _Remembered(k_buffer=flat[:1], v_buffer=flat[1:], page_size=PAGE, keep=flat)
    for pool in (kv, odd):
        safeview.sglang.remember_pool(pool)
    regions = [(int(t.data_ptr()), int(t.nbytes)) for t in flat]
    manager = _registering(kv, [("swa", regions)])
    past = [*manager.kv_args.kv_data_lens]
    past[0] += 1
    manager.kv_args.kv_data_lens = past
    with capture_events() as events:
        side = mooncake._side(manager)
        assert side.states == {}
        with pytest.raises(AddressError, match=r"layers\.0\.k"):
            mooncake.check_registration(manager, side)
    said = [e["reason"] for e in events if e["event"] == "integration_unavailable"]
    assert [r.split(":")[0] for r in said] == ["swa state not read"]
    assert "ArgumentError" in said[0]
