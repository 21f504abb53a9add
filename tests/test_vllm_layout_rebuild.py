"""The plugin's layout pieces that need no vLLM: P's manifest rebuilt from what its NIXL metadata
reports, against the manifest ``describe`` derives from caches laid out as vLLM 0.33 lays them
out; the manifest folder; the fingerprint in ``registration_checked``.
(tests/test_vllm_layout.py runs the whole plugin against vLLM's real NIXL connector.)"""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from safeview.kv import check_tensors
from safeview.log import manifest_of_registration
from safeview.manifest import Manifest, Topology, describe, vllm_axes
from safeview.manifest.diff import diff
from safeview.testing import capture_events
from safeview.vllm import _layout as layout

HEADS, HEAD_SIZE, LAYERS = 4, 64, ("layers.0", "layers.1", "layers.2")
#: vLLM 0.33's physical order of a layer's [B, H, N, C] cache, by layout name (block-major
#: layouts have every layer's page in each block)
ORDERS = {"LBHNC": (0, 1, 2, 3), "LBNHC": (0, 2, 1, 3), "BLHNC": (0, 1, 2, 3)}


def _caches(layout_name: str, heads: int, tokens: int, blocks: int) -> dict[str, torch.Tensor]:
    """Each layer's fp16 cache as vLLM's allocator cuts it from one int8 buffer (on meta)."""
    row = 2 * HEAD_SIZE
    page = heads * tokens * row  # elements
    shape = (blocks, heads, tokens, row)
    order = ORDERS[layout_name]
    inner = [0, 0, 0, 0]
    stride = 1
    for axis in reversed(order[1:]):
        inner[axis] = stride
        stride *= shape[axis]
    block_major = layout_name.startswith("B")
    raw = torch.empty(len(LAYERS) * blocks * page, dtype=torch.float16, device="meta")
    caches = {}
    for index, name in enumerate(LAYERS):
        block_stride = len(LAYERS) * page if block_major else page
        offset = index * page if block_major else index * blocks * page
        strides = (block_stride, *inner[1:])
        caches[name] = torch.as_strided(raw, shape, strides, offset)
    return caches


def _metadata(caches: dict[str, torch.Tensor], engine: str, layout_name: str) -> Any:
    """What vLLM 0.33's NIXL worker reports of these caches (``NixlAgentMetadata``)."""
    first = next(iter(caches.values()))
    page = first[0].nelement() * first.element_size()
    return SimpleNamespace(
        engine_id=engine,
        block_lens=[page] * len(caches),
        block_strides=[c.stride(0) * c.element_size() for c in caches.values()],
        region_names=list(caches),
        region_num_blocks=None,
        num_blocks=first.shape[0],
        block_size=first.shape[2],
        kv_cache_layout=layout_name,
        packed_member_layouts={},
    )


def _derived(layout_name: str, rank: int, tp: int, tokens: int = 32, blocks: int = 10) -> Manifest:
    caches = _caches(layout_name, HEADS // tp, tokens, blocks)
    topology = Topology(
        tp_rank=rank,
        tp_size=tp,
        total_kv_heads=HEADS,
        kernel_block_tokens=tokens,
        engine="P",
        layout=layout_name,
    )
    return describe(caches, axes=vllm_axes(), topology=topology)


@pytest.mark.parametrize("layout_name", list(ORDERS))
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_the_manifest_rebuilt_from_metadata_is_the_one_derived_from_the_caches(
    layout_name: str, tp: int
) -> None:
    mine = _derived(layout_name, 0, tp)
    caches = _caches(layout_name, HEADS // tp, 32, 10)
    rebuilt = layout.rebuild(_metadata(caches, "P", layout_name), tp, mine)
    derived = [_derived(layout_name, rank, tp) for rank in range(tp)]
    assert [m.fingerprint for m in rebuilt] == [m.fingerprint for m in derived]
    assert [m.layers[LAYERS[0]].heads for m in rebuilt] == [
        tuple(range(r * HEADS // tp, (r + 1) * HEADS // tp)) for r in range(tp)
    ]


def test_a_block_length_that_is_not_whole_heads_is_left_to_vllm() -> None:
    mine = _derived("LBHNC", 0, 1)
    metadata = _metadata(_caches("LBHNC", HEADS, 32, 10), "P", "LBHNC")
    metadata.block_lens[1] -= 2
    with pytest.raises(layout._NotJudgedError, match=r"layers\.1: P's block length 32766"):
        layout.rebuild(metadata, 1, mine)


def test_a_page_of_heads_outside_the_block_is_left_to_vllm() -> None:
    mine = _derived("LBHNC", 0, 1)
    metadata = _metadata(_caches("LBHNC", HEADS, 32, 10), "P", "LHBNC")
    with pytest.raises(layout._NotJudgedError, match="LHBNC"):
        layout.rebuild(metadata, 1, mine)


def test_rebuilt_p_of_larger_blocks_is_refused_by_vllms_rule_naming_both_block_sizes() -> None:
    d = _derived("LBHNC", 0, 1, tokens=32)
    p = layout.rebuild(_metadata(_caches("LBHNC", HEADS, 64, 10), "P", "LBHNC"), 1, d)
    report = diff(p, d, rule="vllm_nixl")
    assert not report.compatible
    first = report.findings[0]
    assert (first.kind, first.layer) == ("refused", LAYERS[0])
    assert "D's block tokens 32 are not a multiple of P's 64" in first.message


def test_manifests_go_to_one_folder_per_engine(tmp_path: Path) -> None:
    topology = Topology(tp_rank=0, tp_size=2, engine="prefill/a")
    one = _derived("LBHNC", 0, 2).model_copy(update={"topology": topology})
    path = layout.write_manifest(one, tmp_path)
    assert path == tmp_path / "prefill_a" / "prefill_a.tp0of2.manifest.json"
    assert Manifest.read(path) == one
    (tmp_path / "prefill_a" / "broken.manifest.json").write_text("{", encoding="utf-8")
    assert [m for _, m in layout.read_engine_manifests(tmp_path)["prefill/a"]] == [one]
    # nothing else left behind (the file is written whole, then renamed)
    assert sorted(p.name for p in tmp_path.rglob("*")) == [
        "broken.manifest.json",
        "prefill_a",
        path.name,
    ]


def test_a_second_start_replaces_the_file_and_a_worker_skips_its_own_engine(
    tmp_path: Path,
) -> None:
    first = _derived("LBHNC", 0, 2).model_copy(update={"topology": Topology(tp_size=2, engine="D")})
    second = _derived("LBNHC", 0, 2).model_copy(update={"topology": first.topology})
    assert first.fingerprint != second.fingerprint
    path = layout.write_manifest(first, tmp_path)
    assert layout.write_manifest(second, tmp_path) == path
    assert Manifest.read(path) == second  # the previous run's manifest is gone, not merged
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no hidden file left
    peer = first.model_copy(update={"topology": Topology(tp_size=2, engine="P")})
    layout.write_manifest(peer, tmp_path)
    (tmp_path / "not-a-folder.manifest.json").write_text("{}", encoding="utf-8")
    assert list(layout.read_engine_manifests(tmp_path)) == ["D", "P"]
    assert list(layout.read_engine_manifests(tmp_path, but="D")) == ["P"]
    assert list(layout.read_engine_manifests(tmp_path, "P", but="D")) == ["P"]
    assert layout.read_engine_manifests(tmp_path / "missing") == {}


@pytest.mark.parametrize(
    ("engine", "folder"), [("..", "_.."), ("", "engine"), ("a b*[c]", "a_b__c_")]
)
def test_an_engine_id_is_one_folder_name_and_never_a_way_up(engine: str, folder: str) -> None:
    assert layout.engine_folder(Path("/m"), engine) == Path("/m") / folder


def test_registration_checked_carries_the_manifest_fingerprint_inside_the_block() -> None:
    kv = torch.zeros(64, dtype=torch.int8)
    with capture_events() as events:
        with manifest_of_registration("abc", "/m/P/P.tp0of1.manifest.json"):
            check_tensors({"a": kv[:32]}, policy="warn")
        check_tensors({"a": kv[:32]}, policy="warn")
    inside, outside = (e for e in events if e["event"] == "registration_checked")
    assert (inside["manifest_fingerprint"], inside["manifest_path"]) == (
        "abc",
        "/m/P/P.tp0of1.manifest.json",
    )
    assert "manifest_fingerprint" not in outside


def test_manifest_dir_is_unset_when_blank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(layout.ENV_MANIFEST_DIR, "  ")
    assert layout.manifest_dir() is None
    monkeypatch.setenv(layout.ENV_MANIFEST_DIR, "/tmp/m")
    assert layout.manifest_dir() == Path("/tmp/m")


# -- the handshake hook, on a stand-in worker (the real one: tests/test_vllm_layout.py) ----------


class _Worker:
    """Where vLLM 0.33's NIXL worker is met: ``add_remote_agent(metadata, rank, tp, dcp)``."""

    _TRANSFER_MODE = "pull"

    def __init__(self) -> None:
        self.calls: list[Any] = []

    def add_remote_agent(self, metadata: Any, rank: int = 0, tp: int = 1, dcp: int = 1) -> str:
        self.calls.append((metadata, rank, tp, dcp))
        return "agent"


#: the hooked handshake reads vLLM's msgpack payload (vLLM itself depends on msgspec; the `test`
#: extra brings it)
needs_msgspec = pytest.mark.skipif(
    find_spec("msgspec") is None, reason="needs msgspec: pip install -e '.[test]' brings it"
)


def _hooked(policy: str, folder: Path | None = None) -> _Worker:
    from safeview.policy import Policy

    worker = _Worker()
    mine = _derived("LBHNC", 0, 1).model_copy(
        update={"topology": Topology(total_kv_heads=HEADS, engine="D", layout="LBHNC")}
    )
    layout._guard_handshake(layout.WorkerLayout(worker, mine, folder, Policy(policy)))
    return worker


@needs_msgspec
def test_strict_refuses_a_larger_p_block_before_vllm_sees_the_metadata() -> None:
    from safeview import LayoutMismatchError

    worker = _hooked("strict")
    metadata = _metadata(_caches("LBHNC", HEADS, 64, 10), "P", "LBHNC")
    with capture_events() as events, pytest.raises(LayoutMismatchError) as caught:
        worker.add_remote_agent(metadata, 0, 1, 1)
    assert worker.calls == []  # vLLM never got to prepare a descriptor of P's
    assert caught.value.layer == LAYERS[0]
    [event] = events
    assert (event["event"], event["level"], event["action"]) == (
        "layout_mismatch",
        "error",
        "refused",
    )
    with pytest.raises(LayoutMismatchError):  # the next request's handshake: the same verdict
        worker.add_remote_agent(metadata, 0, 1, 1)
    assert len(events) == 1  # said once per P registration


@needs_msgspec
def test_warn_logs_the_mismatch_and_hands_vllm_the_metadata() -> None:
    worker = _hooked("warn")
    metadata = _metadata(_caches("LBHNC", HEADS, 64, 10), "P", "LBHNC")
    with capture_events() as events:
        assert worker.add_remote_agent(metadata, 0, 1, 1) == "agent"
    assert worker.calls == [(metadata, 0, 1, 1)]
    [event] = events
    assert (event["event"], event["level"], event["action"]) == (
        "layout_mismatch",
        "warning",
        "none",
    )


@needs_msgspec
def test_a_compatible_p_is_one_info_event_and_goes_on_untouched() -> None:
    worker = _hooked("strict")
    metadata = _metadata(_caches("LBHNC", HEADS, 32, 12), "P", "LBHNC")
    with capture_events() as events:
        assert worker.add_remote_agent(metadata, 0, 1, 1) == "agent"
    [event] = events
    assert (event["event"], event["verdict"], event["against"]) == (
        "layout_checked",
        "compatible",
        "nixl_metadata",
    )


def test_its_own_failure_leaves_the_handshake_to_vllm_with_one_warning() -> None:
    layout._stepped_aside.clear()
    worker = _hooked("strict")
    broken = SimpleNamespace(engine_id="P")  # metadata it cannot read
    with capture_events() as events:
        assert worker.add_remote_agent(broken, 0, 1, 1) == "agent"
        assert worker.add_remote_agent(broken, 0, 1, 1) == "agent"
    assert len(worker.calls) == 2
    [event] = events
    assert (event["event"], event["level"]) == ("integration_unavailable", "warning")
    assert "P/D layouts left unjudged" in event["reason"]
    layout._stepped_aside.clear()


def test_the_plugins_digest_of_a_request_names_each_layers_element_type() -> None:
    # P's float16 pages copied byte for byte into D's bfloat16 cache: the plugin's own digests
    # of the request disagree, and the finding names both element types
    from safeview.manifest.digest import verify
    from safeview.vllm._digest import _digest_blocks

    name = "model.layers.0.self_attn"
    sent = {name: torch.randn(4, 2, 16, 128).to(torch.float16)}
    received = {name: sent[name].view(torch.bfloat16).clone()}  # the same bytes
    assert received[name].untyped_storage().nbytes() == sent[name].untyped_storage().nbytes()
    digests = [
        _digest_blocks(describe(caches, axes=vllm_axes()), caches, [[0, 1]], 20)
        for caches in (sent, received)
    ]
    assert [d.dtypes for d in digests] == [{name: "float16"}, {name: "bfloat16"}]
    [finding] = verify(*digests)
    assert "float16" in finding.message
    assert "bfloat16" in finding.message
