"""One memory model (issue 19, point 6): the manifest that ``describe`` reads off a cache's strides
gives the checker the same block views that ``safeview.kv.block_views`` plans from the same
tensors, the checker finds the same things in both (overlaps and views past their storage's end
included), and the transfer side's ``MemoryMap`` built from the manifest is the one built from
the registration. Real tensors: on meta for the random layouts (where torch lets a view reach
past its storage), on cpu where addresses matter."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from safeview import ArgumentError, ManifestError
from safeview.check import StorageRecord, check_views
from safeview.kv import block_views
from safeview.manifest import describe
from safeview.transfer import MemoryMap, check_descriptors, memory_map

DTYPES = {1: torch.int8, 2: torch.float16, 4: torch.float32}
FUSED = ("block", "head", "token", "kv|element")
KV_FIRST = ("kv", "block", "token", "head", "element")


def layer_tensor(
    base: torch.Tensor, kind: str, order: tuple[int, ...], blocks: int, heads: int,
    tokens: int, width: int, pad: int, offset: int,
) -> torch.Tensor:  # fmt: skip
    """A cache over ``base`` from element ``offset``: ``fused`` is vLLM's logical
    ``[B, H, N, 2D]`` whose inner axes lie in physical ``order`` (a permutation of H, N, C,
    innermost last), blocks ``pad`` elements apart beyond their page; ``kv_first`` is
    ``(2, B, N, H, D)`` with K of every block, then V of every block."""
    if kind == "fused":
        inner = (heads, tokens, 2 * width)
        strides = [0, 0, 0]
        step = 1
        for axis in reversed(order):
            strides[axis] = step
            step *= inner[axis]
        return base.as_strided((blocks, *inner), (step + pad, *strides), offset)
    page = tokens * heads * width
    block = page + pad
    shape = (2, blocks, tokens, heads, width)
    return base.as_strided(shape, (blocks * block, block, heads * width, width, 1), offset)


@st.composite
def caches(draw: Any) -> dict[str, Any]:
    """Random layers over one or two storages, at random offsets: pages that may overlap another
    layer's, and layers that may reach past their storage's end."""
    itemsize = draw(st.sampled_from(sorted(DTYPES)))
    blocks = draw(st.integers(2, 5))
    storages = [
        torch.empty(draw(st.integers(64, 2048)), dtype=DTYPES[itemsize], device="meta")
        for _ in range(draw(st.integers(1, 2)))
    ]
    layers: dict[str, Any] = {}
    for index in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["fused", "kv_first"]))
        heads, tokens, width = (draw(st.integers(1, 3)) for _ in range(3))
        tensor = layer_tensor(
            storages[draw(st.integers(0, len(storages) - 1))],
            kind,
            draw(st.permutations([0, 1, 2])),
            blocks,
            heads,
            tokens,
            width,
            draw(st.integers(0, 3)),
            draw(st.integers(0, 600)),
        )
        layers[f"layers.{index}"] = {
            "tensor": tensor,
            "kind": kind,
            "page": heads * tokens * 2 * width * itemsize,
            "group": draw(st.sampled_from([None, 0, 1])),
        }
    return {"blocks": blocks, "layers": layers}


def storage_names(tensors: list[torch.Tensor]) -> dict[int, str]:
    """``storage0``, ``storage1``, ... in order of first appearance, as a registration names
    them (written out again here)."""
    names: dict[int, str] = {}
    for tensor in tensors:
        names.setdefault(tensor.untyped_storage()._cdata, f"storage{len(names)}")
    return names


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=caches())
def test_manifest_records_are_the_registrations_views_and_find_the_same(
    case: dict[str, Any],
) -> None:
    layers = case["layers"]
    tensors = {name: layer["tensor"] for name, layer in layers.items()}
    groups = {name: layer["group"] for name, layer in layers.items() if layer["group"] is not None}
    axes = {name: FUSED if layer["kind"] == "fused" else KV_FIRST for name, layer in layers.items()}
    try:
        manifest = describe(tensors, axes=axes, groups=groups)
    except ManifestError as error:  # a layout describe cannot read: only a fused one whose
        # K|V axis is not innermost with another axis inside it can be refused
        assert "nest" in str(error) or "overlaps" in str(error), error
        event("describe refuses the layout")
        return
    registration = block_views(
        {
            name: [t[0], t[1]] if layers[name]["kind"] == "kv_first" else t
            for name, t in tensors.items()
        },
        {name: layer["page"] for name, layer in layers.items()},
        num_blocks=case["blocks"],
        packed=list(layers),
        groups=groups,
        policy="warn",
    )
    names = storage_names(list(tensors.values()))
    storage_of = {name: names[t.untyped_storage()._cdata] for name, t in tensors.items()}
    sizes = {
        names[key]: StorageRecord(t.untyped_storage().nbytes())
        for t in tensors.values()
        for key in [t.untyped_storage()._cdata]
    }
    storages, views = manifest.records(storage_of, sizes)
    assert views == list(registration.report.views)
    assert {name: record.nbytes for name, record in storages.items()} == dict(
        registration.report.storages
    )
    found = check_views(storages, views)
    assert found.findings == registration.report.findings
    event("found: " + (", ".join(sorted({f.kind for f in found.findings})) or "nothing"))


def test_cases_with_overlap_and_past_the_end_are_found_the_same_way() -> None:
    """The property above, on two fixed cases it must cover: two layers sharing pages, and a
    layer past its storage's end."""
    base = torch.empty(4096, dtype=torch.float16, device="meta")
    tensors = {
        "a": layer_tensor(base, "fused", (0, 1, 2), 4, 2, 4, 4, 0, 0),
        "b": layer_tensor(base, "fused", (1, 0, 2), 4, 2, 4, 4, 0, 100),
        "c": layer_tensor(base, "kv_first", (0, 1, 2), 4, 2, 4, 4, 8, 3800),
    }
    manifest = describe(tensors, axes={"a": FUSED, "b": FUSED, "c": KV_FIRST})
    registration = block_views(
        {"a": tensors["a"], "b": tensors["b"], "c": [tensors["c"][0], tensors["c"][1]]},
        {name: 2 * 4 * 8 * 2 for name in tensors},
        num_blocks=4,
        packed=list(tensors),
        policy="warn",
    )
    storages, views = manifest.records("storage0", {"storage0": 8192})
    assert [v.name for v in views] == ["a", "b", "c[0]", "c[1]"]
    found = check_views(storages, views).findings
    assert found == registration.report.findings
    assert {f.kind for f in found} == {"overlap", "out_of_bounds"}
    assert ("a", "b") in {f.views for f in found if f.kind == "overlap"}


def test_memory_map_from_a_manifest_is_the_registrations_and_judges_the_same() -> None:
    storage = torch.zeros(3 * 4 * 2 * 4 * 8, dtype=torch.float16)
    fused = storage[: 4 * 2 * 4 * 8].view(4, 4, 2, 8).permute(0, 2, 1, 3)  # [B, H, N, C], NHD
    rest = storage[256:512].view(2, 4, 4, 2, 4)  # (2, B, N, H, D): K/V first
    tensors = {"a": fused, "b": rest}
    manifest = describe(tensors, axes={"a": FUSED, "b": KV_FIRST})
    registration = block_views(
        {"a": fused, "b": [rest[0], rest[1]]},
        {"a": 128, "b": 128},
        num_blocks=4,
        packed=["a", "b"],
    )
    address = storage.untyped_storage().data_ptr()
    built = MemoryMap.from_manifest(
        manifest, addresses={"storage0": address}, nbytes={"storage0": storage.nbytes}
    )
    assert built == memory_map(registration)
    rows = [
        (address + offset, length)
        for offset, length in itertools.product(range(0, 768, 32), (32, 64, 128))
    ]
    for row in rows:
        assert check_descriptors([row], built, policy="warn") == check_descriptors(
            [row], registration, policy="warn"
        )
    with pytest.raises(ArgumentError, match="storage0"):
        MemoryMap.from_manifest(manifest, addresses={})


def test_records_name_a_layer_without_a_storage_and_a_storage_without_a_size() -> None:
    base = torch.empty(1024, dtype=torch.float16, device="meta")
    manifest = describe(
        {"a": layer_tensor(base, "fused", (0, 1, 2), 2, 1, 4, 4, 0, 0)}, axes={"a": FUSED}
    )
    with pytest.raises(ManifestError, match=r"storage_of\['a'\]"):
        manifest.records({})
    with pytest.raises(ManifestError, match=r"storages\['kv'\]"):
        manifest.records("kv", {"other": 10})
    storages, [view] = manifest.records("kv")
    assert storages["kv"].nbytes == view.extent_bytes == 2 * 4 * 8 * 2
