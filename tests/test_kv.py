"""block_views and guard_registration on real tensors shaped like vLLM's KV caches."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from safeview import ArgumentError, BoundsError, OverlapError, Plan, configure_logging
from safeview.kv import LayerSpec, block_views, check_tensors, guard_registration
from safeview.testing import capture_events

GLM_NUM_BLOCKS, GLM_STRIDE, GLM_STORAGE = 42_072, 3_098_112, 130_343_768_064


@dataclass(frozen=True)
class FullAttentionSpec:
    """Shaped like vLLM's attention spec: what safeview reads is page_size_bytes."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    @property
    def page_size_bytes(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype.itemsize


@dataclass(frozen=True)
class MambaSpec:
    """Shaped like vLLM's MambaSpec: state shapes, dtypes and a padded page."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    page_size_padded: int

    @property
    def page_size_bytes(self) -> int:
        return self.page_size_padded


def packed_cache(pages: dict[str, int], num_blocks: int, device: str = "cpu") -> dict[str, Any]:
    """A block-major cache: one int8 storage, each layer an fp16 tensor over its pages."""
    stride = sum(pages.values())
    raw = torch.zeros(num_blocks * stride, dtype=torch.int8, device=device)
    halves = raw.view(torch.float16)
    caches, offset = {}, 0
    for name, page in pages.items():
        caches[name] = torch.as_strided(
            halves, (num_blocks, page // 2), (stride // 2, 1), offset // 2
        )
        offset += page
    return {"raw": raw, "caches": caches, "stride": stride}


@pytest.fixture
def events() -> Iterator[list[dict[str, Any]]]:
    with capture_events() as captured:
        yield captured


def test_packed_views_are_the_layers_own_bytes() -> None:
    pages = {"l0.mla": 96, "l0.idx": 32, "l1.mla": 96, "l1.idx": 32}
    cache = packed_cache(pages, num_blocks=6)
    registration = block_views(cache["caches"], pages, num_blocks=6, packed=set(pages))
    assert registration.report.ok
    assert registration.page_bytes == pages
    for name, (view,) in registration.tensors_per_block.items():
        layer = cache["caches"][name]
        assert view.dtype == torch.int8
        assert view.shape == (6, pages[name])
        assert view.stride() == (cache["stride"], 1)
        assert view.data_ptr() == layer.data_ptr()
        view.fill_(7)
        assert bool((layer.view(torch.int8) == 7).all())
        view.zero_()
    assert int(cache["raw"].abs().sum()) == 0


def test_glm_packed_on_meta_registers_all_101_layers(events: list[dict[str, Any]]) -> None:
    pages = {}
    for layer in range(79):
        pages[f"model.layers.{layer}.self_attn"] = 36_864
        if layer < 22:
            pages[f"model.layers.{layer}.indexer"] = 8_448
    cache = packed_cache(pages, GLM_NUM_BLOCKS, device="meta")
    assert cache["raw"].untyped_storage().nbytes() == GLM_STORAGE
    registration = block_views(cache["caches"], pages, num_blocks=GLM_NUM_BLOCKS, packed=pages)
    assert registration.report.ok
    assert len(registration.tensors_per_block) == 101
    [summary] = [e for e in events if e["event"] == "registration_checked"]
    assert summary["level"] == "info"
    assert summary["layers"] == 101
    assert summary["storages"] == 1
    assert summary["storage_nbytes"] == GLM_STORAGE
    assert summary["min_slack_bytes"] == 0
    assert summary["violations"] == 0


def test_one_block_too_many_on_meta_raises_where_torch_would_not() -> None:
    pages = {"a": 64, "b": 64}
    cache = packed_cache(pages, num_blocks=10, device="meta")
    with pytest.raises(BoundsError) as caught:
        block_views(cache["caches"], pages, num_blocks=11, packed=pages)
    assert caught.value.name == "a"
    assert caught.value.overflow_bytes == 64


def test_unit_test_layout_with_vllm_attention_specs_and_regions() -> None:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=64, dtype=torch.float16)
    assert spec.page_size_bytes == 16_384
    storage = torch.zeros(3 * 163_840, dtype=torch.int8).view(torch.float16)
    caches = {
        f"layers.{i}": storage[i * 81_920 : (i + 1) * 81_920].view(10, 16, 4, 2, 64)
        for i in range(3)
    }
    regions = {f"layers.{i}": (i * 163_840, (i + 1) * 163_840) for i in range(3)}
    registration = block_views(caches, dict.fromkeys(caches, spec), num_blocks=10, regions=regions)
    assert registration.report.ok
    assert [view.byte_offset for view in registration.report.views] == [0, 163_840, 327_680]
    specs = dict.fromkeys(caches, spec)
    # One block too many: on the CPU torch refuses the last layer even under warn ...
    with pytest.raises(BoundsError) as caught:
        block_views(caches, specs, num_blocks=11, regions=regions, policy="warn")
    assert caught.value.name == "layers.2"
    assert isinstance(caught.value.__cause__, RuntimeError)
    # ... and on meta, where torch checks nothing, warn reports every broken bound.
    meta = {
        f"layers.{i}": torch.empty(3 * 81_920, dtype=torch.float16, device="meta")[
            i * 81_920 : (i + 1) * 81_920
        ].view(10, 16, 4, 2, 64)
        for i in range(3)
    }
    broken = block_views(meta, specs, num_blocks=11, regions=regions, policy="warn")
    assert [(f.kind, f.views) for f in broken.violations] == [
        ("out_of_region", ("layers.0",)),
        ("out_of_region", ("layers.1",)),
        ("out_of_bounds", ("layers.2",)),
        ("out_of_region", ("layers.2",)),
    ]


def test_split_kv_lists_get_one_view_per_tensor() -> None:
    num_blocks, half = 4, 256
    kv = torch.zeros(2, num_blocks, half, dtype=torch.int8)
    registration = block_views(
        {"layer": [kv[0], kv[1]]}, {"layer": 2 * half}, num_blocks=num_blocks
    )
    k_view, v_view = registration.tensors_per_block["layer"]
    assert k_view.shape == v_view.shape == (num_blocks, half)
    assert v_view.storage_offset() == num_blocks * half
    assert [view.name for view in registration.report.views] == ["layer[0]", "layer[1]"]


def test_mamba_state_list_is_one_view_of_padded_pages() -> None:
    conv, ssm, padded, num_blocks = 48, 200, 256, 3
    raw = torch.zeros(num_blocks * padded, dtype=torch.int8)
    states = [
        torch.as_strided(raw, (num_blocks, conv), (padded, 1), 0),
        torch.as_strided(raw, (num_blocks, ssm), (padded, 1), conv),
    ]
    spec = MambaSpec(
        shapes=((conv,), (ssm,)), dtypes=(torch.int8, torch.int8), page_size_padded=padded
    )
    registration = block_views({"mamba.0": states}, {"mamba.0": spec}, num_blocks=num_blocks)
    (view,) = registration.tensors_per_block["mamba.0"]
    assert view.shape == (num_blocks, padded)
    assert view.stride() == (padded, 1)


def test_hybrid_layers_of_different_groups_may_share_a_tensor() -> None:
    page, num_blocks = 512, 4
    shared = torch.zeros(num_blocks * page, dtype=torch.int8)
    attention = shared.view(num_blocks, page)
    states = [torch.as_strided(shared, (num_blocks, 100), (page, 1), 0)]
    caches: dict[str, torch.Tensor | list[torch.Tensor]] = {"attn": attention, "mamba": states}
    specs = {"attn": page, "mamba": LayerSpec(page_bytes=page, kind="mamba")}
    registration = block_views(caches, specs, num_blocks=num_blocks, groups={"attn": 0, "mamba": 1})
    assert registration.report.ok
    with pytest.raises(OverlapError) as caught:
        block_views(caches, specs, num_blocks=num_blocks, groups={"attn": 0, "mamba": 0})
    assert [(*o.views, o.byte) for o in caught.value.findings] == [("attn", "mamba", 0)]


def test_aliasing_layers_strict_warn_off(events: list[dict[str, Any]]) -> None:
    raw = torch.zeros(8 * 128, dtype=torch.int8)
    a = torch.as_strided(raw, (8, 64), (128, 1), 0)
    b = torch.as_strided(raw, (8, 64), (128, 1), 32)  # lands on half of a's pages
    caches, specs = {"a": a, "b": b}, {"a": 64, "b": 64}
    with pytest.raises(OverlapError, match="views 'a' and 'b' both use byte 32"):
        block_views(caches, specs, num_blocks=8, packed=caches, policy="strict")
    registration = block_views(caches, specs, num_blocks=8, packed=caches, policy="warn")
    assert [f.kind for f in registration.violations] == ["overlap"]
    assert len(registration.tensors_per_block) == 2
    off = block_views(caches, specs, num_blocks=8, packed=caches, policy="off")
    assert off.violations == ()
    levels = [e["level"] for e in events if e["event"] == "overlap_violation"]
    assert levels == ["error", "warning"]
    summaries = [e for e in events if e["event"] == "registration_checked"]
    assert [s["overlaps"] for s in summaries] == [1, 1, 0]
    assert [s["checked"] for s in summaries] == [True, True, False]


def test_kernel_block_stride_is_a_self_overlap() -> None:
    raw = torch.zeros(4 * 256, dtype=torch.int8)
    layer = torch.as_strided(raw, (4, 256), (64, 1), 0)  # stride of a 64-byte kernel block
    with pytest.raises(OverlapError, match="block_stride_bytes=64 smaller than page_bytes=256"):
        block_views({"l": layer}, {"l": 256}, num_blocks=4, packed={"l"})
    warned = block_views({"l": layer}, {"l": 256}, num_blocks=4, packed={"l"}, policy="warn")
    assert warned.tensors_per_block["l"][0].stride() == (64, 1)
    assert [f.kind for f in warned.violations] == ["self_overlap"]


def test_to_plan_round_trips_to_the_same_verdict(tmp_path: Path) -> None:
    raw = torch.zeros(8 * 128, dtype=torch.int8)
    caches = {
        "a": torch.as_strided(raw, (8, 64), (128, 1), 0),
        "b": torch.as_strided(raw, (8, 64), (128, 1), 32),
    }
    registration = block_views(caches, {"a": 64, "b": 64}, num_blocks=8, packed=caches,
                               policy="warn", groups={"a": 0, "b": 0})  # fmt: skip
    path = tmp_path / "live.json"
    plan = registration.to_plan(path, description="captured")
    assert Plan.load(path) == plan
    assert plan.storages[0].device == "cpu"
    assert [f.to_json() for f in plan.check().findings] == [
        f.to_json() for f in registration.violations
    ]


def test_bad_arguments_are_refused() -> None:
    tensor = torch.zeros(4, 8, dtype=torch.int8)
    with pytest.raises(TypeError, match="specs has no entry for layer 'l'"):
        block_views({"l": tensor}, {}, num_blocks=4)
    with pytest.raises(TypeError, match=r"specs\['l'\] must be a page size"):
        block_views({"l": tensor}, {"l": "8"}, num_blocks=4)
    with pytest.raises(TypeError, match=r"kv_caches\['l'\]\[1\] must be a strided torch.Tensor"):
        block_views({"l": [tensor, None]}, {"l": 8}, num_blocks=4)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="does not split evenly over its 3 K/V tensors"):
        block_views({"l": [tensor] * 3}, {"l": 8}, num_blocks=4)


class Connector:
    """A connector written like vLLM's, guarded by safeview."""

    def __init__(self, layer_groups: dict[str, int]) -> None:
        self.layer_groups = layer_groups
        self.registered: dict[str, torch.Tensor] = {}

    @guard_registration(groups=lambda self: self.layer_groups)
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.registered = dict(kv_caches)


def test_guard_lets_a_clean_registration_through() -> None:
    raw = torch.zeros(2, 4, 64, dtype=torch.float16)
    connector = Connector({"k": 0, "v": 0})
    connector.register_kv_caches({"k": raw[0], "v": raw[1]})
    assert set(connector.registered) == {"k", "v"}


def test_guard_stops_aliasing_tensors_of_one_group_before_the_connector_runs() -> None:
    raw = torch.zeros(4, 64, dtype=torch.float16)
    connector = Connector({"k": 0, "v": 0})
    with pytest.raises(OverlapError, match="views 'k' and 'v'"):
        connector.register_kv_caches({"k": raw, "v": raw[1:]})
    assert connector.registered == {}
    other_groups = Connector({"k": 0, "v": 1})
    other_groups.register_kv_caches({"k": raw, "v": raw[1:]})
    assert set(other_groups.registered) == {"k", "v"}


def test_guard_reports_a_tensor_past_its_storage_on_meta() -> None:
    storage = torch.empty(64, dtype=torch.int8, device="meta")
    past = torch.as_strided(storage, (5, 16), (16, 1), 0)  # meta lets torch make it
    out = io.StringIO()
    configure_logging("json", level="WARNING", stream=out)
    with pytest.raises(BoundsError) as caught:
        check_tensors({"layer": past})
    assert caught.value.overflow_bytes == 16
    assert caught.value.layout is None
    [event] = [json.loads(line) for line in out.getvalue().splitlines()]
    assert event["event"] == "bounds_violation"
    assert event["shape"] == [5, 16]
    assert event["dtype"] == "int8"
    report = check_tensors({"layer": past}, policy="warn")
    assert [f.kind for f in report.findings] == ["out_of_bounds"]


def test_guard_flags_broadcast_tensors_as_self_overlap() -> None:
    broadcast = torch.zeros(1, 64, dtype=torch.float16).expand(4, 64)
    with pytest.raises(OverlapError, match="may touch some elements twice"):
        check_tensors({"layer": broadcast})


@pytest.mark.parametrize("num_blocks", [True, 1.5, -1, "4", None])
def test_bad_num_blocks_is_refused_naming_the_argument_and_value(num_blocks: object) -> None:
    raw = torch.zeros(256, dtype=torch.int8)
    with pytest.raises(ArgumentError, match=r"num_blocks must be a non-negative integer; got "):
        block_views({"layer.0": raw}, {"layer.0": 64}, num_blocks=num_blocks)  # type: ignore[arg-type]


@pytest.mark.parametrize("page", [-64, 1.5, 0, True])
def test_bad_page_size_is_refused_naming_the_layer_and_value(page: object) -> None:
    raw = torch.zeros(256, dtype=torch.int8)
    with pytest.raises(ArgumentError, match=r"'layer.0'.*page size|page size.*'layer.0'") as caught:
        block_views({"layer.0": raw}, {"layer.0": page}, num_blocks=4)
    assert repr(page) in str(caught.value) or "got 0" in str(caught.value)


def test_packed_view_past_the_end_and_self_overlapping_is_a_bounds_error_under_strict(
    events: list[dict[str, Any]],
) -> None:
    raw = torch.zeros(256, dtype=torch.int8)
    cache = torch.as_strided(raw, (8, 32), (32, 1), 0)
    # a page of 64 at a stride of 32: self-overlapping, and 8 blocks reach byte 288
    with pytest.raises(BoundsError) as caught:
        block_views({"l": cache}, {"l": 64}, num_blocks=8, packed={"l"})
    assert caught.value.overflow_bytes == 288 - 256
    assert {e["event"] for e in events} >= {"bounds_violation", "overlap_violation"}
    assert events[-1]["event"] == "registration_checked"  # the summary comes last
    assert raw.untyped_storage().nbytes() == 256


def test_packed_view_past_the_end_under_warn_chains_torchs_refusal(
    events: list[dict[str, Any]],
) -> None:
    raw = torch.zeros(256, dtype=torch.int8)
    cache = torch.as_strided(raw, (8, 32), (32, 1), 0)
    with pytest.raises(BoundsError) as caught:
        block_views({"l": cache}, {"l": 64}, num_blocks=8, packed={"l"}, policy="warn")
    assert isinstance(caught.value.__cause__, RuntimeError)  # torch's own refusal, chained
    [bounds] = [e for e in events if e["event"] == "bounds_violation"]
    assert bounds["level"] == "warning"
    assert bounds["overflow_bytes"] == 32


def test_strict_stops_before_any_view_is_made_and_warn_makes_them_all() -> None:
    raw = torch.zeros(4 * 64, dtype=torch.int8)
    caches = {
        "x": torch.as_strided(raw, (4, 32), (64, 1), 0),
        "y": torch.as_strided(raw, (4, 32), (64, 1), 16),
    }
    pages = {"x": 32, "y": 32}
    with pytest.raises(OverlapError):
        block_views(caches, pages, num_blocks=4, packed=caches, policy="strict")
    registration = block_views(caches, pages, num_blocks=4, packed=caches, policy="warn")
    assert [f.kind for f in registration.violations] == ["overlap"]
    assert {layer: len(views) for layer, views in registration.tensors_per_block.items()} == {
        "x": 1,
        "y": 1,
    }


def test_registration_checked_counts_the_bytes_the_views_hold(
    events: list[dict[str, Any]],
) -> None:
    pages = {"a": 96, "b": 32}
    cache = packed_cache(pages, num_blocks=5)
    block_views(cache["caches"], pages, num_blocks=5, packed=set(pages))
    [summary] = [e for e in events if e["event"] == "registration_checked"]
    assert summary["bytes_covered"] == 5 * (96 + 32)
    assert summary["storage_nbytes"] == 5 * 128
    assert summary["min_slack_bytes"] == 0
    assert summary["views"] == 2
    assert summary["violations"] == 0


# -- round four: what a new user trips on ---------------------------------------------------------


def test_a_kv_first_tensor_is_refused_and_k_and_v_as_two_tensors_are_cut_right() -> None:
    # FlashAttention's per-layer (2, num_blocks, block_tokens, heads, head_dim)
    num_blocks, tokens, heads, dim = 16, 16, 4, 64
    cache = torch.zeros(2, num_blocks, tokens, heads, dim, dtype=torch.float16)
    page = 2 * tokens * heads * dim * 2  # K+V of one block
    with pytest.raises(ArgumentError) as caught:
        block_views({"l0": cache}, {"l0": page}, num_blocks=num_blocks)
    message = str(caught.value)
    assert "shape (2, 16, 16, 4, 64) and strides (65536, 4096, 256, 64, 1)" in message
    assert "shape[0] == 2 != num_blocks=16" in message
    assert "kv_caches['l0'] = [cache[0], cache[1]]" in message
    registration = block_views({"l0": [cache[0], cache[1]]}, {"l0": page}, num_blocks=num_blocks)
    k, v = registration.tensors_per_block["l0"]
    cache[1, 0].fill_(1.0)  # V of block 0
    assert k.shape == v.shape == (num_blocks, page // 2)
    assert torch.equal(v[0].view(torch.float16), cache[1, 0].flatten())
    assert int(k.count_nonzero()) == 0
    assert int(v[1:].count_nonzero()) == 0


def test_a_blocks_first_tensor_of_two_blocks_is_not_taken_for_kv_first() -> None:
    cache = torch.zeros(2, 16, 4, 64, dtype=torch.float16)  # 2 blocks, blocks first
    registration = block_views({"l0": cache}, {"l0": 16 * 4 * 64 * 2}, num_blocks=2)
    assert registration.report.ok


@pytest.mark.parametrize("what", ["groups", "regions"])
def test_block_views_refuses_keys_that_name_no_layer(what: str) -> None:
    raw = torch.zeros(4 * 64, dtype=torch.int8)
    caches = {"model.layers.0.self_attn": raw[:128].view(2, 64), "model.layers.1.self_attn":
              raw[128:].view(2, 64)}  # fmt: skip
    value: object = 0 if what == "groups" else (0, 256)
    mapping = {"model.layers.0.self_attn": value, "model.layers.1.self_atn": value}
    with pytest.raises(ArgumentError) as caught:
        block_views(caches, dict.fromkeys(caches, 64), num_blocks=2, **{what: mapping})  # type: ignore[arg-type]
    assert str(caught.value) == (
        f"{what} names 1 layer that kv_caches does not have: 'model.layers.1.self_atn' "
        "(did you mean 'model.layers.1.self_attn'?)"
    )


def _packed_cache(num_blocks: int, layers: int = 4, page: int = 64) -> dict[str, torch.Tensor]:
    buffer = torch.zeros(num_blocks * layers * page, dtype=torch.int8)
    return {
        f"l{i}": torch.as_strided(buffer, (num_blocks, page), (layers * page, 1), i * page)
        for i in range(layers)
    }


def test_a_bounds_error_names_every_layer_past_the_end() -> None:
    caches = _packed_cache(16)
    with pytest.raises(BoundsError) as caught:
        block_views(caches, dict.fromkeys(caches, 64), num_blocks=17, packed=caches)
    error = caught.value
    assert [f.views[0] for f in error.findings] == ["l0", "l1", "l2", "l3"]
    assert str(error).endswith(
        "; and 3 more views outside their storage or region: 'l1', 'l2', 'l3'"
    )


def test_warn_on_cpu_warns_for_every_view_then_raises_naming_them_chained_to_torch(
    events: list[dict[str, Any]],
) -> None:
    # torch refuses a view past the end of a cpu storage, and safeview never grows one
    caches = _packed_cache(16)
    with pytest.raises(BoundsError) as caught:
        block_views(caches, dict.fromkeys(caches, 64), num_blocks=17, packed=caches, policy="warn")
    error = caught.value
    assert error.policy == "warn"
    assert isinstance(error.__cause__, RuntimeError)
    assert "setStorage" in str(error.__cause__)
    assert len(error.findings) == 4
    warned = [e["name"] for e in events if e["event"] == "bounds_violation"]
    assert warned == ["l0", "l1", "l2", "l3"]
    assert all(e["level"] == "warning" for e in events if e["event"] == "bounds_violation")


def test_warn_on_meta_makes_the_views_past_the_end() -> None:
    buffer = torch.empty(16 * 4 * 64, dtype=torch.int8, device="meta")
    caches = {f"l{i}": torch.as_strided(buffer, (16, 64), (256, 1), i * 64) for i in range(4)}
    registration = block_views(
        caches, dict.fromkeys(caches, 64), num_blocks=17, packed=caches, policy="warn"
    )
    assert [view.shape for (view,) in registration.tensors_per_block.values()] == [(17, 64)] * 4
    assert [f.kind for f in registration.violations] == ["out_of_bounds"] * 4


def test_the_readme_connector_pattern_holds_for_a_hybrid_model() -> None:
    # The README's pattern, copied for a hybrid model: attention and Mamba share each block's
    # bytes in groups 0 and 1; block_views is given the guard's groups.
    page, num_blocks = 512, 4
    groups = {"attn": 0, "mamba": 1}

    class Connector:
        @guard_registration(groups=groups)
        def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
            specs = {"attn": page, "mamba": LayerSpec(page_bytes=page, kind="mamba")}
            self.views = block_views(kv_caches, specs, num_blocks=num_blocks, groups=groups)

    shared = torch.zeros(num_blocks * page, dtype=torch.int8)
    caches: dict[str, Any] = {
        "attn": shared.view(num_blocks, page),
        "mamba": [torch.as_strided(shared, (num_blocks, 100), (page, 1), 0)],
    }
    connector = Connector()
    connector.register_kv_caches(caches)
    assert connector.views.report.ok
    # without the groups, the same bytes are a (false) overlap
    specs = {"attn": page, "mamba": LayerSpec(page_bytes=page, kind="mamba")}
    with pytest.raises(OverlapError):
        block_views(caches, specs, num_blocks=num_blocks)


@pytest.mark.parametrize("packed", [True, False])
def test_a_page_too_big_overflows_as_the_readme_troubleshooting_says(packed: bool) -> None:
    # README: by the difference of the two pages when packed, by num_blocks times it when each
    # layer's blocks lie together, layer after layer
    layers, num_blocks, allocated, spec = 3, 10, 4096, 8192
    raw = torch.zeros(layers * num_blocks * allocated, dtype=torch.int8)
    if packed:
        caches = {
            f"l{i}": torch.as_strided(raw, (num_blocks, allocated), (layers * allocated, 1),
                                      i * allocated)
            for i in range(layers)
        }  # fmt: skip
    else:
        caches = {
            f"l{i}": raw[i * num_blocks * allocated : (i + 1) * num_blocks * allocated].view(
                num_blocks, allocated
            )
            for i in range(layers)
        }
    with pytest.raises(BoundsError) as caught:
        block_views(
            caches, dict.fromkeys(caches, spec), num_blocks=num_blocks,
            packed=caches if packed else (),
        )  # fmt: skip
    expected = spec - allocated if packed else num_blocks * (spec - allocated)
    assert caught.value.overflow_bytes == expected


def test_one_wrong_page_in_every_layer_is_named_as_such_not_as_the_last_layer_only() -> None:
    # a packed group whose page size is 16 bytes too big in every layer: each page runs into the
    # next layer's, and the last one past the end of the storage
    layers, blocks, page = 4, 3, 64
    raw = torch.zeros(blocks * layers * page, dtype=torch.int8)
    caches = {
        f"layers.{n}": torch.as_strided(raw, (blocks, page), (layers * page, 1), n * page)
        for n in range(layers)
    }
    with pytest.raises(BoundsError) as caught:
        block_views(caches, dict.fromkeys(caches, page + 16), num_blocks=blocks, packed=caches)
    message = str(caught.value)
    assert caught.value.name == "layers.3"  # the view past the end, as before
    assert (
        "and 3 more views run into a neighbour's bytes ('layers.0' into 'layers.1', 'layers.1' "
        "into 'layers.2', 'layers.2' into 'layers.3'): all 4 views are wrong, so the page size "
        "is likely wrong in every layer, not in 'layers.3' alone"
    ) in message
    # one layer wrong: the message names it, and says nothing of the others
    pages = dict.fromkeys(caches, page)
    pages["layers.3"] = page + 16
    with pytest.raises(BoundsError) as one:
        block_views(caches, pages, num_blocks=blocks, packed=caches)
    assert "overlap" not in str(one.value)
    assert "every layer" not in str(one.value)
    # two of four wrong: the overlap is named, not every layer
    pages["layers.1"] = page + 16
    with pytest.raises(BoundsError) as two:
        block_views(caches, pages, num_blocks=blocks, packed=caches)
    assert "and 1 more view runs into a neighbour's bytes ('layers.1' into 'layers.2')" in str(
        two.value
    )
    assert "every layer" not in str(two.value)
