"""safeview.describe and the Manifest model: read off strides, never off the shape's order."""

from __future__ import annotations

import json
import subprocess
import sys

import jsonschema  # type: ignore[import-untyped]
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import safeview
from safeview import Manifest, ManifestError
from safeview.manifest import (
    MANIFEST_SCHEMA,
    assumed,
    derive,
    heads_of_rank,
    layer_from_geometry,
    vllm_axes,
)


def vllm_cache(layout: str, blocks: int = 10, heads: int = 4, tokens: int = 16, size: int = 64,
               device: str = "cpu") -> torch.Tensor:  # fmt: skip
    """vLLM 0.33's [B, H, N, C] view of one layer, C = K|V, physical order per layout."""
    if layout == "LBHNC":
        return torch.zeros(blocks, heads, tokens, 2 * size, dtype=torch.float16, device=device)
    physical = torch.zeros(blocks, tokens, heads, 2 * size, dtype=torch.float16, device=device)
    return physical.permute(0, 2, 1, 3)


def test_physical_order_comes_from_strides_not_from_the_shape() -> None:
    # the same shape [10, 4, 16, 128] in both: HND and NHD differ only by strides
    hnd = safeview.describe({"l": vllm_cache("LBHNC")}, axes=vllm_axes())
    nhd = safeview.describe({"l": vllm_cache("LBNHC")}, axes=vllm_axes())
    assert [(a.axis, a.stride_bytes) for a in hnd.layers["l"].axes] == [
        ("head", 4096), ("token", 256), ("kv", 128), ("element", 2)
    ]  # fmt: skip
    assert [(a.axis, a.stride_bytes) for a in nhd.layers["l"].axes] == [
        ("token", 1024), ("head", 256), ("kv", 128), ("element", 2)
    ]  # fmt: skip
    assert hnd.fingerprint != nhd.fingerprint
    layer = hnd.layers["l"]
    assert (layer.page_bytes, layer.block_stride_bytes, layer.num_blocks) == (16384, 16384, 10)


def test_lmcache2374_strides_give_kv_block_head_token_element() -> None:
    # shape [2, 7286, 64, 8, 128] with strides (477495296, 65536, 128, 8192, 1) (scaled down)
    base = torch.empty(2 * 6 * 8 * 4 * 16, dtype=torch.float16, device="meta")
    tensor = base.as_strided((2, 6, 4, 8, 16), (6 * 512, 512, 16, 64, 1))
    manifest = safeview.describe({"l": tensor}, axes=("kv", "block", "token", "head", "element"))
    layer = manifest.layers["l"]
    assert [(a.axis, a.outer) for a in layer.axes] == [
        ("kv", True), ("head", False), ("token", False), ("element", False)
    ]  # fmt: skip
    assert layer.chunk_bytes == 1024
    assert layer.page_bytes == 2048


@pytest.mark.slow
def test_same_layout_same_fingerprint_anywhere_and_on_meta() -> None:
    cpu = safeview.describe({"a": vllm_cache("LBHNC")}, axes=vllm_axes())
    meta = safeview.describe({"a": vllm_cache("LBHNC", device="meta")}, axes=vllm_axes())
    assert cpu.fingerprint == meta.fingerprint
    code = (
        "import torch, safeview\n"
        "from safeview.manifest import vllm_axes\n"
        "t = torch.zeros(10, 4, 16, 128, dtype=torch.float16, device='meta')\n"
        "print(safeview.describe({'a': t}, axes=vllm_axes()).fingerprint)\n"
    )
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert other.stdout.strip() == cpu.fingerprint
    again = assumed("NB_NH_BS_2HS", layers=["a"], num_blocks=10, block_tokens=16, num_heads=4,
                    head_size=64, dtype="float16")  # fmt: skip
    assert again.fingerprint == cpu.fingerprint


def test_fingerprint_changes_when_any_byte_means_something_else() -> None:
    base = safeview.describe({"a": vllm_cache("LBHNC")}, axes=vllm_axes())
    rank1 = safeview.describe({"a": vllm_cache("LBHNC")}, axes=vllm_axes(),
                              topology={"tp_rank": 1, "tp_size": 2})  # fmt: skip
    renamed = safeview.describe({"b": vllm_cache("LBHNC")}, axes=vllm_axes())
    more_blocks = safeview.describe({"a": vllm_cache("LBHNC", blocks=20)}, axes=vllm_axes())
    assert rank1.layers["a"].heads == (4, 5, 6, 7)
    assert len({base.fingerprint, rank1.fingerprint, renamed.fingerprint}) == 3
    assert more_blocks.fingerprint == base.fingerprint  # where pages lie is not what they mean


def test_an_axis_of_unknown_meaning_is_an_error_naming_it() -> None:
    with pytest.raises(ManifestError, match=r"layers\['l'\]\.axes\[2\]: 'tokens' is an axis"):
        safeview.describe({"l": vllm_cache("LBHNC")}, axes=("block", "head", "tokens", "element"))
    with pytest.raises(ManifestError, match="names 3 axes; the tensor has 4"):
        safeview.describe({"l": vllm_cache("LBHNC")}, axes=("block", "head", "token"))
    with pytest.raises(ManifestError, match="no meaning given"):
        safeview.describe({"l": vllm_cache("LBHNC")}, axes={"other": vllm_axes()})


def test_overlapping_strides_are_refused() -> None:
    base = torch.empty(4096, dtype=torch.float16, device="meta")
    tensor = base.as_strided((4, 2, 8, 16), (256, 8, 16, 1))  # head stride inside the row
    with pytest.raises(ManifestError, match="strides do not nest"):
        safeview.describe({"l": tensor}, axes=("block", "head", "token", "element"))
    blocks_overlap = base.as_strided((4, 2, 8, 16), (128, 128, 16, 1))
    with pytest.raises(ManifestError):
        safeview.describe({"l": blocks_overlap}, axes=("block", "head", "token", "element"))


def test_heads_follow_vllm_sharding_and_replication() -> None:
    assert heads_of_rank(1, 4, 8) == (2, 3)
    assert heads_of_rank(5, 16, 8) == (2,)
    with pytest.raises(ManifestError, match="total_kv_heads"):
        heads_of_rank(0, 3, 8)


def test_json_round_trip_schema_and_bad_files() -> None:
    topology = {"engine": "vllm", "engine_version": "0.33.0"}
    manifest = safeview.describe({"l": vllm_cache("LBNHC")}, axes=vllm_axes(), topology=topology)
    text = manifest.to_json()
    data = json.loads(text)
    assert data["$schema"] == MANIFEST_SCHEMA
    jsonschema.validate(data, Manifest.model_json_schema(by_alias=True))
    assert Manifest.from_json(text) == manifest
    with pytest.raises(ManifestError, match=r"\$schema"):
        Manifest.from_json(text.replace(MANIFEST_SCHEMA, "urn:safeview:manifest:2"))
    with pytest.raises(ManifestError, match="is not JSON"):
        Manifest.from_json(text[: len(text) // 2])
    edited = data
    edited["layers"]["l"]["axes"][0]["axis"] = "heads"
    with pytest.raises(ManifestError, match="axes"):
        Manifest.from_json(json.dumps(edited))
    tampered = json.loads(text)
    tampered["layers"]["l"]["heads"] = [0, 1, 2, 9]
    with pytest.raises(ManifestError, match="does not match the layer "):
        Manifest.from_json(json.dumps(tampered))
    padded = json.loads(text)
    padded["layers"]["l"]["page_bytes"] = 1
    with pytest.raises(ManifestError, match="are not what the axes make"):
        Manifest.from_json(json.dumps(padded))
    overlapping = json.loads(text)
    overlapping["layers"]["l"]["axes"][1]["stride_bytes"] = 4
    with pytest.raises(ManifestError, match="overlaps the axes inside it"):
        Manifest.from_json(json.dumps(overlapping))


def test_model_is_frozen_and_forbids_extra_keys() -> None:
    manifest = assumed("NB_NH_BS_2HS", layers=["l"], num_blocks=2, block_tokens=4, num_heads=1,
                       head_size=2, dtype="float16")  # fmt: skip
    with pytest.raises(ValueError, match="frozen"):
        manifest.layers["l"].page_bytes = 3
    data = json.loads(manifest.to_json())
    data["extra"] = 1
    with pytest.raises(ManifestError, match="extra"):
        Manifest.from_json(json.dumps(data))


def test_assumed_formats_lmcache_style() -> None:
    manifest = assumed("NL_X_TWO_NB_BS_NH_HS", layers=["l0", "l1"], num_blocks=3, block_tokens=4,
                       num_heads=2, head_size=8, dtype="bfloat16")  # fmt: skip
    layer = manifest.layers["l1"]
    assert layer.byte_offset == 2 * 3 * 4 * 2 * 8 * 2
    assert [a.axis for a in layer.axes] == ["kv", "token", "head", "element"]
    assert layer.axes[0].outer
    flat = assumed("NL_X_TWO_NBBS_NH_HS", layers=["l0", "l1"], num_blocks=3, block_tokens=4,
                   num_heads=2, head_size=8, dtype="bfloat16")  # fmt: skip
    assert flat.fingerprint == manifest.fingerprint  # the same bytes, the same meanings
    with pytest.raises(ManifestError, match=r"format\[1\]"):
        assumed("NB_XX", layers=["l"], num_blocks=1, block_tokens=1, num_heads=1, head_size=1,
                dtype="float16")  # fmt: skip


def test_describe_does_not_import_torch_for_the_model() -> None:
    code = (
        "import sys, json, safeview\n"
        "from safeview.manifest import assumed\n"
        "m = assumed('NB_NH_BS_2HS', layers=['l'], num_blocks=2, block_tokens=4, num_heads=1,"
        " head_size=2, dtype='float16')\n"
        "safeview.diff(m, safeview.Manifest.from_json(m.to_json()))\n"
        "print('torch' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"


def test_mamba_state_layers_are_state_and_not_judged_under_vllm_nixl() -> None:
    state = torch.empty(4, 1, 1, 1000, dtype=torch.int8, device="meta")
    attention = vllm_cache("LBHNC", device="meta")
    manifest = safeview.describe(
        {"mamba.0": state, "attn.0": attention},
        axes=lambda name, shape: vllm_axes("mamba" if name.startswith("mamba") else "attention"),
    )
    assert manifest.layers["mamba.0"].kind == "state"
    report = safeview.diff(manifest, manifest, rule="vllm_nixl")
    assert report.compatible
    assert list(report.skipped) == ["mamba.0"]


_LAYOUTS = ("LBHNC", "LBNHC")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    names=st.lists(st.text(max_size=12), min_size=1, max_size=6, unique=True),
    layouts=st.lists(st.sampled_from(_LAYOUTS), min_size=6, max_size=6),
    heads=st.sampled_from((1, 2, 4)),
    engine=st.one_of(st.none(), st.text(max_size=8)),
    groups=st.booleans(),
)
def test_the_text_written_at_registration_is_the_manifests_own(
    names: list[str], layouts: list[str], heads: int, engine: str | None, groups: bool
) -> None:
    # derive() writes its JSON text from one Layer per page shape; it must be the text the
    # Manifest itself writes, byte for byte, and read back as the same manifest
    storage = torch.empty(len(names) * 10 * 4 * 16 * 128, dtype=torch.float16, device="meta")
    caches = {}
    for index, name in enumerate(names):
        cache = vllm_cache(layouts[index], heads=heads, device="meta")
        at = index * cache.untyped_storage().nbytes() // 2
        caches[name] = storage[at:].as_strided(cache.shape, cache.stride())
    topology = {"tp_size": 2, "tp_rank": 1, "total_kv_heads": 2 * heads, "engine": engine}
    group_of = {name: index % 2 for index, name in enumerate(names)} if groups else None
    derived = derive(caches, axes=vllm_axes(), topology=topology, groups=group_of)
    described = safeview.describe(caches, axes=vllm_axes(), topology=topology, groups=group_of)
    text = derived.to_json()
    assert text == described.to_json(indent=None)
    assert Manifest.from_json(text) == described == derived.manifest()
    assert derived.fingerprint == described.fingerprint
    assert derived.file_name() == described.file_name()


def test_a_page_text_that_cannot_be_split_is_written_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import safeview.manifest as manifest

    caches = {"a": vllm_cache("LBHNC"), "b": vllm_cache("LBNHC")}
    expected = safeview.describe(caches, axes=vllm_axes()).to_json(indent=None)
    # the mark that says where a layer's first byte goes, also the page size: it cannot
    # be told apart, so the text is the whole Manifest's
    monkeypatch.setattr(manifest, "_MARK", caches["a"][0].nbytes)
    assert manifest._around_offset(derive(caches, axes=vllm_axes()).manifest().layers["a"]) is None
    assert derive(caches, axes=vllm_axes()).to_json() == expected


# -- the canonical form, pinned: manifests travel between machines and versions ------------------

PINNED_PAGE = (
    '{"axes":[["head",1,0],["token",2,8],["kv",2,4],["element",2,2]],"chunk_bytes":16,'
    '"dtype":"float16","heads":[0],"kind":"attention","page_bytes":16}'
)
PINNED_OUTER_PAGE = (
    '{"axes":[["token",1,0],["head",1,0],["element",1,0],["kv",2,"outer"]],"chunk_bytes":1,'
    '"dtype":"int8","heads":[1],"kind":"attention","page_bytes":2}'
)
PINNED_LAYER = "99a052e1d659534754b88e0182995540ddfefab91489bd4f966b8cd58887b4e3"
PINNED_OUTER_LAYER = "2a092a08097e6285c87b9a278c7030ee1a5b59a406f94a873aa86eff6bed56fe"
PINNED_MANIFEST = "ecaa43cab8935cc44f780d1ecb12bb99786ce0f98ee555420c71fcb7eee2cc7a"


def test_the_fingerprint_canonical_form_is_pinned() -> None:
    """docs/layouts.md#fingerprints: a change here rejects every manifest written before."""
    import hashlib

    from safeview.manifest._model import _canonical, _page_meaning

    plain = assumed("NB_NH_BS_2HS", layers=["l"], num_blocks=2, block_tokens=2, num_heads=1,
                    head_size=2, dtype="float16")  # fmt: skip
    apart = assumed("TWO_NB_BS_NH_HS", layers=["k"], num_blocks=2, block_tokens=1, num_heads=1,
                    head_size=1, dtype="int8",
                    topology={"tp_rank": 1, "tp_size": 2, "total_kv_heads": 2})  # fmt: skip
    manifest = Manifest(layers={"l": plain.layers["l"], "k": apart.layers["k"]})
    assert _canonical(_page_meaning(manifest.layers["l"])) == PINNED_PAGE
    assert _canonical(_page_meaning(manifest.layers["k"])) == PINNED_OUTER_PAGE
    # the documented recipe, computed here without safeview: sha256 of those texts
    assert hashlib.sha256(PINNED_PAGE.encode()).hexdigest() == PINNED_LAYER
    assert hashlib.sha256(PINNED_OUTER_PAGE.encode()).hexdigest() == PINNED_OUTER_LAYER
    assert (manifest.layers["l"].fingerprint, manifest.layers["k"].fingerprint) == (
        PINNED_LAYER,
        PINNED_OUTER_LAYER,
    )
    pairs = f'[["k","{PINNED_OUTER_LAYER}"],["l","{PINNED_LAYER}"]]'  # by name, no spaces
    assert hashlib.sha256(pairs.encode()).hexdigest() == PINNED_MANIFEST
    assert manifest.fingerprint == PINNED_MANIFEST
    # neither where pages lie nor the topology's other fields take part
    moved = assumed("NB_NH_BS_2HS", layers=["l"], num_blocks=9, block_tokens=2, num_heads=1,
                    head_size=2, dtype="float16", layer_bytes=64,
                    topology={"engine": "x", "connector": "NixlConnector"})  # fmt: skip
    assert moved.layers["l"].fingerprint == PINNED_LAYER


# -- bad input is a ManifestError naming field, value and limit (issue 26, point 11) -------------


def test_deeply_nested_json_is_a_manifest_error() -> None:
    with pytest.raises(ManifestError, match="nests deeper") as caught:
        Manifest.from_json("[" * 100_000, source="deep.json")
    assert caught.value.field == "deep.json"
    assert len(str(caught.value)) < 160


def test_describe_arguments_of_the_wrong_kind_are_manifest_errors() -> None:
    cache = {"l": vllm_cache("LBHNC", device="meta")}
    cases: list[tuple[dict[str, object], str, str]] = [
        ({"axes": None}, "axes", "is not axis names"),
        ({"axes": vllm_axes(), "groups": ["l"]}, "groups", "is not a mapping by layer name"),
        ({"axes": vllm_axes(), "kinds": {"l": "bogus"}}, "kinds['l']", "attention, latent, state"),
        ({"axes": vllm_axes(), "topology": [1]}, "topology", "is not a Topology or a mapping"),
        ({"axes": vllm_axes(), "topology": {"tp_rank": "1"}}, "topology.tp_rank", "integer"),
        ({"axes": lambda name, shape: 3}, "axes('l', (10, 4, 16, 128))", "is not axis names"),
    ]
    for arguments, field, limit in cases:
        with pytest.raises(ManifestError) as caught:
            safeview.describe(cache, **arguments)  # type: ignore[arg-type]
        assert caught.value.field == field, arguments
        assert limit in caught.value.limit, arguments


def test_counts_past_2_62_are_refused_before_any_arithmetic() -> None:
    with pytest.raises(ManifestError, match=r"num_blocks: 10{30} is not a count from 1 to 2\*\*62"):
        assumed("NB_NH_BS_2HS", layers=["l"], num_blocks=10**30, block_tokens=4, num_heads=1,
                head_size=2, dtype="float16")  # fmt: skip
    with pytest.raises(ManifestError, match=r"layers\['l'\]\.num_blocks: 10{30} Input should be "):
        layer_from_geometry("l", axes=("block", "element"), shape=(10**30, 2),
                            strides_elements=(2, 1), byte_offset=0, dtype="float16")  # fmt: skip
    fine = assumed("NB_NH_BS_2HS", layers=["l"], num_blocks=4, block_tokens=4, num_heads=1,
                   head_size=2, dtype="float16")  # fmt: skip
    data = json.loads(fine.to_json())
    data["layers"]["l"]["num_blocks"] = 10**30
    data["layers"]["l"]["fingerprint"] = ""
    with pytest.raises(ManifestError, match=r"layers\['l'\]\.num_blocks"):
        Manifest.from_json(json.dumps(data))
    data["layers"]["l"]["num_blocks"] = 2**61  # each count fits; the last byte does not
    with pytest.raises(ManifestError, match="past the"):
        Manifest.from_json(json.dumps(data))


def test_a_renamed_layer_is_named_in_one_short_line() -> None:
    names = [f"model.layers.{i}.self_attn" for i in range(100)]
    manifest = assumed("NB_NH_BS_2HS", layers=names, num_blocks=4, block_tokens=4, num_heads=1,
                       head_size=2, dtype="float16")  # fmt: skip
    data = json.loads(manifest.to_json())
    data["layers"]["renamed"] = data["layers"].pop(names[7])
    with pytest.raises(ManifestError) as caught:
        Manifest.from_json(json.dumps(data), source="p/vllm.tp0of1.manifest.json")
    message = str(caught.value)
    assert message.startswith("p/vllm.tp0of1.manifest.json: fingerprint: ")
    assert "a layer was renamed, added or edited" in message
    assert len(message) < 160, message


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=4),
    max_leaves=12,
)  # fmt: skip


def _leaves(value: object, path: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
    if isinstance(value, dict):
        return [p for key, item in value.items() for p in _leaves(item, (*path, key))]
    if isinstance(value, list):
        return [p for at, item in enumerate(value) for p in _leaves(item, (*path, at))]
    return [path]


_FUZZED = assumed("TWO_NB_BS_NH_HS", layers=["a", "b"], num_blocks=3, block_tokens=2,
                  num_heads=2, head_size=2, dtype="float16",
                  topology={"tp_rank": 1, "tp_size": 2, "total_kv_heads": 4})  # fmt: skip


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), junk=JSON, keep_fingerprints=st.booleans())
def test_any_json_read_or_diffed_raises_only_safeview_errors(
    data: st.DataObject, junk: object, keep_fingerprints: bool
) -> None:
    """Random JSON, and a real manifest with one value replaced by random JSON: reading it,
    and diffing what reads under every rule, raise nothing but a SafeViewError."""
    document = json.loads(_FUZZED.to_json())
    leaves = _leaves(document)
    path = data.draw(st.sampled_from(leaves))
    target: object = document
    for key in path[:-1]:
        target = target[key]  # type: ignore[index]
    target[path[-1]] = junk  # type: ignore[index]
    if not keep_fingerprints:
        document.pop("fingerprint")
        layers = document.get("layers")
        for layer in layers.values() if isinstance(layers, dict) else ():
            if isinstance(layer, dict):
                layer.pop("fingerprint", None)
    for text in (json.dumps(junk), json.dumps(document)):
        try:
            manifest = Manifest.from_json(text, source="fuzz.json")
        except safeview.SafeViewError as error:
            assert len(str(error)) < 400, str(error)
            continue
        for rule in ("page_copy", "vllm_nixl", "in_place"):
            try:
                safeview.diff(_FUZZED, manifest, rule=rule)
                safeview.diff(manifest, _FUZZED, rule=rule)
            except safeview.SafeViewError:
                pass


@settings(max_examples=200, deadline=None)
@given(
    num_blocks=st.integers(-2, 2**64) | st.none() | st.text(max_size=3),
    heads=st.integers(-1, 2**20) | st.floats(),
    kinds=st.none() | st.dictionaries(st.text(max_size=3), st.text(max_size=9)) | JSON,
    groups=st.none() | JSON,
    topology=st.none() | JSON,
)
def test_any_arguments_to_assumed_and_describe_raise_only_safeview_errors(
    num_blocks: object, heads: object, kinds: object, groups: object, topology: object
) -> None:
    expected = _anything() if isinstance(num_blocks, int) else pytest.raises(safeview.SafeViewError)
    with expected:
        assumed("NB_NH_BS_2HS", layers=["l"], num_blocks=num_blocks, block_tokens=2,  # type: ignore[arg-type]
                num_heads=heads, head_size=2, dtype="float16", topology=topology)  # type: ignore[arg-type]  # fmt: skip
    with _anything():
        safeview.describe({"l": vllm_cache("LBHNC", device="meta")}, axes=vllm_axes(),
                          kinds=kinds, groups=groups, topology=topology)  # type: ignore[arg-type]  # fmt: skip


class _anything:  # noqa: N801  (a context manager read as a phrase)
    """Lets a SafeViewError pass, and nothing else."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> bool:
        return kind is None or issubclass(kind, safeview.SafeViewError)


# -- heads belong to the layer (issue 26, point 12) --------------------------------------------


def test_layers_of_other_head_counts_each_hold_their_own_share_of_heads() -> None:
    # a model of 4 KV heads (its config's) with one layer of 8: at TP 2, rank 1 holds heads
    # 2, 3 of the 4-head layers and heads 4..7 of the 8-head one
    caches = {"a": vllm_cache("LBHNC", heads=2, device="meta"),
              "b": vllm_cache("LBHNC", heads=4, device="meta")}  # fmt: skip
    topology = {"tp_rank": 1, "tp_size": 2, "total_kv_heads": 4}
    manifest = safeview.describe(caches, axes=vllm_axes(), topology=topology)
    assert manifest.layers["a"].heads == (2, 3)
    assert manifest.layers["b"].heads == (4, 5, 6, 7)
    with pytest.raises(ManifestError, match=r"layers\['b'\]\.heads"):  # heads given are the law
        safeview.describe(caches, axes=vllm_axes(), topology={"heads": (2, 3)})


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sides=st.lists(
        st.lists(
            st.tuples(
                st.integers(0, 9),  # rank
                st.sampled_from([1, 2, 3, 4, 8, 16, 1 << 16]),  # TP size
                st.sampled_from([None, 1, 2, 4, 8, 3]),  # total KV heads
                st.sampled_from([None, "LBHNC", "LBNHC", "NL_X_NB_NH_BS_2HS"]),
                st.sampled_from([None, "NixlConnector", "Other"]),
                st.sampled_from(["NB_NH_BS_2HS", "NB_BS_NH_2HS", "TWO_NB_BS_NH_HS"]),
            ),
            min_size=1,
            max_size=3,
        ),
        min_size=2,
        max_size=2,
    ),
    rule=st.sampled_from([None, "page_copy", "vllm_nixl", "in_place"]),
)
def test_any_pair_of_rank_lists_diffs_or_raises_a_safeview_error(
    sides: list[list[tuple[int, int, int | None, str | None, str | None, str]]], rule: str | None
) -> None:
    built: list[list[Manifest]] = [[], []]
    for at, side in enumerate(sides):
        for rank, tp, heads, layout, connector, format in side:
            topology = {"tp_rank": rank, "tp_size": tp, "total_kv_heads": heads,
                        "layout": layout, "connector": connector}  # fmt: skip
            try:
                built[at].append(
                    assumed(
                        format,
                        layers=["a", "b"],
                        num_blocks=3,
                        block_tokens=4,
                        num_heads=2,
                        head_size=2,
                        dtype="float16",
                        topology=topology,
                    )
                )
            except safeview.SafeViewError:
                continue
    with _anything():
        report = safeview.diff(built[0], built[1], rule=rule)  # type: ignore[arg-type]
        assert report.compatible == (not report.findings)
        json.dumps(report.to_json())


def test_a_layer_at_another_offset_keeps_its_page_and_checks_its_last_byte() -> None:
    from safeview.manifest import Layer

    layer = layer_from_geometry(
        "layers.0", axes=("block", "state"), shape=(9, 120), strides_elements=(120, 1),
        byte_offset=0, dtype="bfloat16", kind="state",
    )  # fmt: skip
    moved = layer.at_offset(9 * 240)
    assert (moved.byte_offset, moved.fingerprint) == (9 * 240, layer.fingerprint)
    assert moved == layer.model_copy(update={"byte_offset": 9 * 240})
    assert Manifest(layers={"a": layer, "b": moved}).layers["b"].byte_offset == 9 * 240
    with pytest.raises(ManifestError, match=r"byte_offset.*2\*\*62"):
        layer.at_offset(2**62)
    with pytest.raises(ManifestError, match=r"byte_offset.*must be an int >= 0"):
        layer.at_offset(-1)
    # a layer made without its checks is checked whole on the way, not vouched for
    forged = Layer.model_construct(**{**dict(layer), "chunk_bytes": layer.chunk_bytes + 2})
    with pytest.raises(ManifestError, match="chunk_bytes"):
        forged.at_offset(240)
