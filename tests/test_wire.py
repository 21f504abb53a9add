"""A manifest on the wire (``safeview.manifest.wire``): the compact form round-trips byte for byte,
every bad payload a peer can send is one ``ManifestError`` naming the peer and the field (never
another exception, never a manifest), and the sizes the issue promises hold for a vLLM model."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from safeview.errors import ManifestError, SafeViewError
from safeview.manifest import Derived, Manifest, assumed, derive, describe, vllm_axes
from safeview.manifest.peer import judge_peer
from safeview.manifest.wire import (
    WIRE_CAP_BYTES,
    WIRE_SCHEMA,
    RequestToken,
    from_wire,
    parse_request_token,
    request_token,
    to_wire,
    token_matches,
)
from safeview.testing import capture_events

PEER = "prefill engine P-7 rank 1"


def vllm_model(
    layers: int = 100, *, rank: int = 1, tp: int = 2, blocks: int = 10_000, engine: str = "P-7"
) -> Derived:
    """A vLLM 0.33 attention model's caches as its NIXL worker holds them (meta tensors):
    ``[B, H, N, 2*C]`` bfloat16, one tensor per layer."""
    heads = 8 // tp
    caches = {
        f"model.layers.{i}.self_attn.attn": torch.empty(
            blocks, heads, 16, 256, dtype=torch.bfloat16, device="meta"
        )
        for i in range(layers)
    }
    topology = {
        "tp_rank": rank, "tp_size": tp, "total_kv_heads": 8, "logical_block_tokens": 16,
        "engine": engine, "engine_version": "vllm 0.33.0", "layout": "LBHNC",
        "connector": "NixlConnector",
    }  # fmt: skip
    return derive(caches, axes=vllm_axes(), topology=topology)


def mixed_model() -> Manifest:
    """Layers of three page shapes (attention, MLA, another dtype), names with nothing in
    common, and layers at several first bytes of one storage."""
    storage = torch.empty(4 * 1024 * 1024, dtype=torch.uint8, device="meta")
    attention = torch.empty(6, 2, 4, 16, dtype=torch.float16, device="meta")
    shared = torch.empty(0, dtype=torch.float16, device="meta").set_(
        storage.untyped_storage(), 1024, (6, 2, 4, 16), attention.stride()
    )
    caches = {
        "decoder.0.attn": attention,
        "x": shared,
        "mla.5": torch.empty(6, 1, 4, 32, dtype=torch.bfloat16, device="meta"),
        "y.float": torch.empty(6, 2, 4, 16, dtype=torch.float32, device="meta"),
    }
    axes = {name: vllm_axes("mla" if name.startswith("mla") else "attention") for name in caches}
    return describe(caches, axes=axes, topology={"tp_size": 1, "total_kv_heads": 2})


# -- the round trip ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "made",
    [
        pytest.param(lambda: vllm_model(100), id="vllm-100-layers-derived"),
        pytest.param(lambda: vllm_model(3).manifest(), id="vllm-manifest"),
        pytest.param(mixed_model, id="three-page-shapes-no-common-name"),
        pytest.param(
            lambda: assumed(
                "NL_X_TWO_NB_BS_NH_HS",
                layers=["a", "ab", "abc"],
                num_blocks=5,
                block_tokens=4,
                num_heads=2,
                head_size=8,
                dtype="int8",
            ),
            id="names-that-prefix-each-other",
        ),
    ],
)
def test_a_manifest_round_trips_byte_for_byte(made: Any) -> None:
    manifest = made()
    data = to_wire(manifest)
    received = from_wire(data, peer=PEER)
    assert isinstance(received, Manifest)
    assert received.fingerprint == manifest.fingerprint
    assert received.to_json(indent=None) == manifest.to_json(indent=None)
    assert received == Manifest.from_json(manifest.to_json())
    # the same text from str and bytes, and the Manifest and its Derived send the same bytes
    assert from_wire(data.decode(), peer=PEER) == received
    assert to_wire(received) == data


def test_the_compact_form_sends_one_page_per_shape() -> None:
    document = json.loads(to_wire(mixed_model()))
    assert document["$schema"] == WIRE_SCHEMA
    assert len(document["pages"]) == 3  # two layers share the float16 attention page
    assert {row[2] for row in document["layers"]} == {0, 2048}  # "x" starts 1,024 halves in
    vllm = json.loads(to_wire(vllm_model(100)))
    assert len(vllm["pages"]) == 1
    assert (vllm["prefix"], vllm["suffix"]) == ("model.layers.", ".self_attn.attn")
    assert vllm["layers"][:2] == [["0", 0, 0], ["1", 0, 0]]


def test_a_100_layer_vllm_manifest_is_a_few_kb_and_its_token_under_100_bytes() -> None:
    model = vllm_model(100)
    data = to_wire(model)
    full = model.to_json().encode()
    assert len(data) <= 3 * 1024, len(data)  # "at most a few KB" on the handshake
    assert len(data) * 10 < len(full)  # 100 identical layers cost one page and 100 short rows
    token = request_token(model)
    assert len(token.encode()) < 100
    assert len(token) <= 60
    # a 1,000-layer model of four page shapes still fits the cap many times over
    big = {
        f"model.layers.{i}.attn": torch.empty(
            100, 1 + i % 4, 16, 256, dtype=torch.bfloat16, device="meta"
        )
        for i in range(1000)
    }
    large = describe(big, axes=vllm_axes(), topology={"tp_size": 1, "total_kv_heads": 4})
    assert len(to_wire(large)) * 4 < WIRE_CAP_BYTES
    assert from_wire(to_wire(large), peer=PEER).fingerprint == large.fingerprint


def test_a_manifest_too_large_for_the_cap_is_refused_by_its_sender() -> None:
    # ~310 KB of names that share no prefix or suffix
    names = [hashlib.sha256(str(i).encode()).hexdigest() * 6 for i in range(800)]
    caches = {name: torch.empty(2, 1, 2, 4, device="meta") for name in names}
    manifest = derive(caches, axes=vllm_axes(), topology={"total_kv_heads": 1})
    with pytest.raises(ManifestError, match=r"more than the 262,144 bytes \(WIRE_CAP_BYTES\)"):
        to_wire(manifest)


def test_the_cap_counts_a_text_payloads_utf8_bytes_not_its_characters() -> None:
    """A str payload is held to the cap in the bytes it would be on the wire: one of fewer
    characters than the cap but more UTF-8 bytes is refused as a bytes payload of the same text
    is, with the same count; one of the cap's size is read."""
    text = to_wire(vllm_model(4)).decode()
    marker = '"engine":"P-7"'
    assert marker in text

    def engine_name_grown_to(size: int) -> str:
        """The payload with an engine name of 'é's (one character, two UTF-8 bytes each) that
        makes it ``size`` bytes."""
        twos, one = divmod(size - len(text.encode()), 2)
        return text.replace(marker, '"engine":"P-7' + "a" * one + "\u00e9" * twos + '"')

    over = engine_name_grown_to(WIRE_CAP_BYTES + 1)
    assert len(over) <= WIRE_CAP_BYTES < len(over.encode()) == WIRE_CAP_BYTES + 1
    for payload in (over, over.encode()):
        with pytest.raises(ManifestError) as refused:
            from_wire(payload, peer=PEER)
        assert refused.value.value == f"{WIRE_CAP_BYTES + 1:,} bytes"
        assert "more than the 262,144 bytes (WIRE_CAP_BYTES)" in str(refused.value)
    fits = engine_name_grown_to(WIRE_CAP_BYTES)
    assert len(fits.encode()) == WIRE_CAP_BYTES
    read = from_wire(fits, peer=PEER)  # the cap's own size is read
    assert str(read.topology.engine).endswith("\u00e9" * 100)


# -- bad input from a peer -----------------------------------------------------------------------


def _good() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(to_wire(vllm_model(4)))
    return loaded


def _edited(edit: Any) -> bytes:
    document = _good()
    edit(document)
    return json.dumps(document).encode()


def _set(path: tuple[Any, ...], value: Any) -> Any:
    def edit(document: dict[str, Any]) -> None:
        at: Any = document
        for part in path[:-1]:
            at = at[part]
        at[path[-1]] = value

    return edit


def _renamed(document: dict[str, Any]) -> None:
    document["layers"][1][0] = "9"  # keeps the fingerprint of the layers before


def _restrided(document: dict[str, Any]) -> None:
    page = document["pages"][0]
    del page["fingerprint"]  # a page edited with its own fingerprint dropped
    axes = page["axes"]
    axes[0]["axis"], axes[1]["axis"] = axes[1]["axis"], axes[0]["axis"]
    page["heads"] = list(range(axes[1]["size"]))


GOOD = to_wire(vllm_model(4))
OTHER_FINGERPRINT = vllm_model(4, rank=0).fingerprint

# case -> (payload, the field the error names, words of its limit)
BAD: dict[str, tuple[bytes | str | object, str, str]] = {
    "truncated": (GOOD[: len(GOOD) // 2], "manifest on the wire", "is not JSON"),
    "truncated-to-nothing": (b"", "manifest on the wire", "is not JSON"),
    "over-the-cap": (GOOD + b" " * WIRE_CAP_BYTES, "manifest on the wire", "WIRE_CAP_BYTES"),
    "over-the-cap-as-str": ("x" * (WIRE_CAP_BYTES + 1), "manifest on the wire", "262,144"),
    "another-schema-version": (
        _edited(_set(("$schema",), "urn:safeview:manifest-wire:2")),
        "$schema",
        WIRE_SCHEMA,
    ),
    "a-file-manifest-not-a-wire-one": (vllm_model(2).to_json(), "$schema", WIRE_SCHEMA),
    "forged-fingerprint": (
        _edited(_set(("fingerprint",), OTHER_FINGERPRINT)),
        "fingerprint",
        "forged",
    ),
    "layer-renamed-under-the-old-fingerprint": (_edited(_renamed), "fingerprint", "forged"),
    "page-edited-under-the-old-fingerprint": (_edited(_restrided), "fingerprint", "forged"),
    "page-fingerprint-forged": (
        _edited(_set(("pages", 0, "fingerprint"), "0" * 64)),
        "pages[0].fingerprint",
        "does not match the layer",
    ),
    "fingerprint-not-hex": (_edited(_set(("fingerprint",), "zz")), "fingerprint", "64 hex"),
    "not-utf8": (b"\xff\xfe{}", "manifest on the wire", "is not JSON"),
    "a-json-array": (b"[1, 2]", "manifest on the wire", "not a JSON object"),
    "not-bytes": (12345, "manifest on the wire", "not bytes or str"),
    "an-unknown-key": (_edited(_set(("extra",), 1)), "extra", "does not know"),
    "a-missing-key": (_edited(lambda d: d.pop("pages")), "pages", "is missing"),
    "topology-a-list": (_edited(_set(("topology",), [1])), "topology", "JSON object"),
    "rank-not-below-size": (
        _edited(_set(("topology", "tp_rank"), 5)),
        "topology",
        "is not below tp_size",
    ),
    "tp-size-a-str": (_edited(_set(("topology", "tp_size"), "2")), "topology.tp_size", "integer"),
    "pages-a-dict": (_edited(_set(("pages",), {})), "pages", "JSON array"),
    "page-an-int": (_edited(_set(("pages", 0), 7)), "pages[0]", "JSON object"),
    "page-with-a-first-byte": (
        _edited(_set(("pages", 0, "byte_offset"), 0)),
        "pages[0].byte_offset",
        "per layer",
    ),
    "axis-of-no-meaning": (
        _edited(_set(("pages", 0, "axes", 0, "axis"), "bogus")),
        "pages[0].axes[0].axis",
        "bogus",
    ),
    "layers-empty": (_edited(_set(("layers",), [])), "layers", "is empty"),
    "layer-a-dict": (_edited(_set(("layers", 0), {"a": 1})), "layers[0]", "[name, page"),
    "layer-of-two": (_edited(_set(("layers", 0), ["0", 0])), "layers[0]", "[name, page"),
    "name-an-int": (_edited(_set(("layers", 0, 0), 3)), "layers[0][0]", "is not a str"),
    "page-index-a-str": (_edited(_set(("layers", 0, 1), "0")), "layers[0][1]", "not an int"),
    "page-index-a-bool": (_edited(_set(("layers", 0, 1), False)), "layers[0][1]", "not an int"),
    "page-index-out-of-range": (_edited(_set(("layers", 0, 1), 1)), "layers[0][1]", "no page"),
    "offset-negative": (_edited(_set(("layers", 0, 2), -1)), "layers[0][2]", "2**62"),
    "offset-past-2-62": (_edited(_set(("layers", 0, 2), 1 << 62)), "layers[0][2]", "2**62"),
    "a-name-twice": (_edited(_set(("layers", 1, 0), "0")), "layers[1][0]", "second time"),
    "a-name-of-a-lone-surrogate": (
        _edited(_set(("layers", 1, 0), "\ud800")),
        "layers[1][0]",
        "is not UTF-8 text",
    ),
    "utf-16": (json.dumps(_good()).encode("utf-16"), "manifest on the wire", "is not JSON"),
    "prefix-an-int": (_edited(_set(("prefix",), 0)), "prefix", "is not a str"),
    "deep-nesting": (b"[" * 100_000 + b"]" * 100_000, "manifest on the wire", "nests deeper"),
    "deep-nesting-truncated": (b"[" * 60_000, "manifest on the wire", "JSON"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_manifest_error_naming_the_peer_and_the_field(case: str) -> None:
    payload, field, limit = BAD[case]
    with pytest.raises(ManifestError) as caught:
        from_wire(payload, peer=PEER)  # type: ignore[arg-type]
    error = caught.value
    assert error.field.startswith(f"{PEER}: "), error.field
    assert error.field.removeprefix(f"{PEER}: ").startswith(field), error.field
    assert limit in str(error), str(error)
    assert "\n" not in str(error)
    assert len(str(error)) < 400


def test_every_bad_case_was_good_before_its_edit() -> None:
    # the edits above break one field each: the untouched document is read
    assert from_wire(json.dumps(_good()), peer=PEER).fingerprint == vllm_model(4).fingerprint


def test_layers_the_receiver_does_not_have_are_a_finding_never_compatible() -> None:
    # the wire itself carries them faithfully; the judge finds them
    sender = from_wire(to_wire(vllm_model(6, rank=0, tp=1)), peer=PEER)
    receiver = vllm_model(4, rank=0, tp=1, engine="D").manifest()
    with capture_events() as events:
        error = judge_peer(
            receiver, [sender], against="handshake", fields={"when": "handshake"}, policy="strict"
        )
    assert error is not None
    assert [(f.kind, f.layer) for f in error.findings] == [
        ("missing_layer", "model.layers.4.self_attn.attn"),
        ("missing_layer", "model.layers.5.self_attn.attn"),
    ]
    [event] = events
    assert (event["event"], event["verdict"], event["action"]) == (
        "layout_mismatch", "mismatch", "refused"
    )  # fmt: skip
    # not one name in common: a mismatch too, not a pair left unjudged
    other = from_wire(to_wire(assumed("NB_NH_BS_2HS", layers=["q", "r"], num_blocks=4,
                      block_tokens=16, num_heads=4, head_size=128, dtype="bfloat16")),
                      peer=PEER)  # fmt: skip
    with capture_events() as events:
        error = judge_peer(receiver, [other], against="store", fields={"when": "transfer"},
                           policy="warn")  # fmt: skip
    assert error is None
    [event] = events
    assert (event["event"], event["kind"], event["findings"]) == ("layout_mismatch",
                                                                  "missing_layer", 6)  # fmt: skip


# -- the request token ---------------------------------------------------------------------------


def test_the_request_token_names_the_rank_and_the_fingerprint() -> None:
    model = vllm_model(4, rank=1, tp=2)
    token = request_token(model)
    assert token == f"sv1:1/2:{model.fingerprint[:24]}"
    parsed = parse_request_token(token, peer=PEER)
    assert parsed == RequestToken(1, 2, model.fingerprint[:24])
    assert token_matches(parsed, model)
    assert token_matches(parsed, from_wire(to_wire(model), peer=PEER))
    assert not token_matches(parsed, vllm_model(4, rank=0, tp=2))  # another rank's
    # the same layout with another block count (P restarted with more memory) is the same token
    assert token_matches(parsed, vllm_model(4, rank=1, tp=2, blocks=7).manifest())
    restarted = vllm_model(5, rank=1, tp=2)  # P restarted with another layer count
    assert not token_matches(parsed, restarted)
    assert not token_matches(RequestToken(1, 4, model.fingerprint[:24]), model)


def test_a_token_matches_the_start_of_the_fingerprint_only() -> None:
    """The token's 24 hex digits are the fingerprint's first 24: the same digits found
    anywhere else in it are another layout's."""
    model = vllm_model(4, rank=1, tp=2)
    fingerprint = model.fingerprint
    assert token_matches(RequestToken(1, 2, fingerprint[:24]), model)
    for start in (1, 8, 20, 40):
        inside = RequestToken(1, 2, fingerprint[start : start + 24])
        assert inside.fingerprint_prefix in fingerprint
        assert not token_matches(inside, model), start
        assert not token_matches(parse_request_token(f"sv1:1/2:{inside[2]}", peer=PEER), model)


@pytest.mark.parametrize(
    ("token", "limit"),
    [
        (None, "is not a str"),
        (7, "is not a str"),
        (b"sv1:0/1:" + b"a" * 24, "is not a str"),
        ("", "sv1:RANK/SIZE"),
        ("sv2:0/1:" + "a" * 24, "sv1:RANK/SIZE"),
        ("sv1:0/1:" + "a" * 23, "sv1:RANK/SIZE"),
        ("sv1:0/1:" + "a" * 25, "sv1:RANK/SIZE"),
        ("sv1:0/1:" + "A" * 24, "sv1:RANK/SIZE"),
        (" sv1:0/1:" + "a" * 24, "sv1:RANK/SIZE"),
        ("sv1:-1/1:" + "a" * 24, "sv1:RANK/SIZE"),
        ("sv1:2/2:" + "a" * 24, "not a rank of it"),
        ("sv1:0/0:" + "a" * 24, "not a rank of it"),
        ("sv1:0/99999:" + "a" * 24, "not a rank of it"),
        ("sv1:0/1:" + "a" * 24 + "\n", "sv1:RANK/SIZE"),
    ],
)
def test_a_bad_request_token_is_a_manifest_error_naming_the_peer(token: object, limit: str) -> None:
    with pytest.raises(ManifestError, match=rf"^{PEER}: request token: ") as caught:
        parse_request_token(token, peer=PEER)
    assert limit in str(caught.value)


# -- fuzz: nothing but SafeViewError leaves the readers --------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)


def _paths(value: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a JSON document a value can be put."""
    found = [at] if at else []
    if isinstance(value, dict):
        for key, inner in value.items():
            found += _paths(inner, (*at, key))
    elif isinstance(value, list):
        for index, inner in enumerate(value):
            found += _paths(inner, (*at, index))
    return found


PATHS = _paths(_good())


def _accepts_or_refuses(payload: Any) -> None:
    try:
        manifest = from_wire(payload, peer=PEER)
    except SafeViewError as error:
        assert str(error).startswith(f"{PEER}: ")
        return
    # what is accepted is a manifest whose fingerprint is that of its layers, and goes on
    assert Manifest.from_json(manifest.to_json()).fingerprint == manifest.fingerprint
    assert from_wire(to_wire(manifest), peer=PEER) == manifest


@given(st.binary(max_size=300) | st.text(max_size=300))
def test_fuzz_any_bytes_or_text(payload: bytes | str) -> None:
    _accepts_or_refuses(payload)


@given(st.sampled_from(PATHS), JSON)
def test_fuzz_any_value_in_any_field(path: tuple[Any, ...], value: Any) -> None:
    _accepts_or_refuses(_edited(_set(path, value)))


@given(st.integers(0, len(GOOD)), st.integers(0, 255), st.booleans())
def test_fuzz_a_byte_changed_or_the_payload_cut(at: int, byte: int, cut: bool) -> None:
    payload = GOOD[:at] if cut else GOOD[:at] + bytes([byte]) + GOOD[at + 1 :]
    _accepts_or_refuses(payload)


@given(JSON | st.binary(max_size=40) | st.text(max_size=60))
def test_fuzz_request_tokens(token: object) -> None:
    try:
        parsed = parse_request_token(token, peer=PEER)
    except SafeViewError as error:
        assert str(error).startswith(f"{PEER}: request token")
        return
    assert 0 <= parsed.tp_rank < parsed.tp_size
    assert len(parsed.fingerprint_prefix) == 24
