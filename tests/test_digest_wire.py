"""A digest from a peer (issue 35): ``Digest.from_wire`` bounds its work before it does any (a
header that inflates without bound, one nested past reading), refuses every header ``to_wire``
never writes with one ``ManifestError`` naming the field, and a P and a D of two digest schemes
are said not compared, never a storm of mismatches nor an agreement; ``verify`` and ``judge``
refuse what is not a digest with an ``ArgumentError``, and ``judge`` works as docs/layouts.md
calls it, whatever the logging.

The headers here are written by hand as JSON (no safeview code makes them), so that what is
refused is decided by the test, not by ``to_wire``."""

from __future__ import annotations

import io
import json
import logging
import struct
import time
import zlib
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import safeview
from safeview import configure_logging, policy_scope
from safeview.errors import ArgumentError, DigestMismatchError, ManifestError
from safeview.manifest.digest import (
    DIGEST_CAP_BYTES,
    DIGEST_HEADER_CAP_BYTES,
    DIGEST_SCHEME,
    Digest,
    judge,
    not_judged,
)
from safeview.testing import capture_events

PEER = "P 10.0.0.7:5600 rank 0"


def _wire(header: Any, values: list[int] | None = None, *, raw: bytes | None = None) -> bytes:
    """A digest payload around ``header`` (JSON, or ``raw`` text as it is), ``values`` after it."""
    text = raw if raw is not None else json.dumps(header).encode()
    packed = zlib.compress(text, 9)
    numbers = values or []
    return (
        b"SVD1"
        + struct.pack("<I", len(packed))
        + packed
        + struct.pack(f"<{len(numbers)}Q", *numbers)
    )


_DROP = object()  # a field left out of the header


def _header(**changes: Any) -> dict[str, Any]:
    """The header ``to_wire`` writes for two layers of heads 0 and 1, with ``changes``."""
    header: dict[str, Any] = {
        "scheme": DIGEST_SCHEME,
        "num_tokens": 16,
        "tp_rank": 0,
        "tp_size": 2,
        "fingerprint": "ab" * 32,
        "layers": ["model.layers.0.attn", "model.layers.1.attn"],
        "heads": [[0, 1]],
        "dtype": "bfloat16",
    }
    header.update(changes)
    return {k: v for k, v in header.items() if v is not _DROP}


def test_a_hand_written_header_is_read_as_to_wire_writes_it() -> None:
    """The fixture itself is a digest (so that each refusal below is the field's alone)."""
    found = Digest.from_wire(_wire(_header(), [1, 2, 3, 4]), peer=PEER)
    assert found == Digest(
        16,
        {"model.layers.0.attn": {0: 1, 1: 2}, "model.layers.1.attn": {0: 3, 1: 4}},
        0,
        2,
        "ab" * 32,
        dtypes={"model.layers.0.attn": "bfloat16", "model.layers.1.attn": "bfloat16"},
    )


# -- the work is bounded before it is done -------------------------------------------------------


def test_a_header_that_inflates_forty_megabytes_is_refused_at_the_cap_at_once() -> None:
    """A payload of about 40 KB (under 1% of ``DIGEST_CAP_BYTES``) whose header inflates to 40 MB
    of JSON (a list of 10 million zeros, what a layer's heads could be): refused within a
    second, naming the cap, not inflated whole (it took ~48 s and 1.2 GB before)."""
    zeros = b"[" + b"0," * 20_000_000 + b"0]"
    text = b'{"scheme":"' + DIGEST_SCHEME.encode() + b'","heads":[' + zeros + b"]}"
    wire = _wire(None, raw=text)
    assert len(text) > 40_000_000
    assert len(wire) < DIGEST_CAP_BYTES // 100
    started = time.perf_counter()
    with pytest.raises(ManifestError) as caught:
        Digest.from_wire(wire, peer=PEER)
    elapsed = time.perf_counter() - started
    assert elapsed < 1.0, elapsed
    message = str(caught.value)
    assert PEER in message
    assert f"inflates past {DIGEST_HEADER_CAP_BYTES:,} bytes" in message
    assert "DIGEST_HEADER_CAP_BYTES" in message


def test_a_real_header_of_a_thousand_layers_is_far_below_the_cap() -> None:
    """1,000 layers named as vLLM names them, 128 heads, two head lists (MLA-like layers
    without heads among them), per-layer element types: its header inflates to a few tens of
    KB, and the whole payload reads back in well under a second."""
    values = {
        f"model.layers.{i}.self_attn.attn": (
            {-1: i} if i % 3 == 0 else {h: i + h for h in range(128)}
        )
        for i in range(1000)
    }
    dtypes = {name: ("float8_e4m3fn" if i % 2 else "bfloat16") for i, name in enumerate(values)}
    digest = Digest(2048, values, 3, 8, "cd" * 32, dtypes=dtypes)
    wire = digest.to_wire()
    (length,) = struct.unpack("<I", wire[4:8])
    inflated = zlib.decompress(wire[8 : 8 + length])
    assert len(inflated) < DIGEST_HEADER_CAP_BYTES // 4
    assert len(wire) < DIGEST_CAP_BYTES
    started = time.perf_counter()
    assert Digest.from_wire(wire, peer=PEER) == digest
    assert time.perf_counter() - started < 1.0


def test_a_header_nested_a_hundred_thousand_deep_is_a_manifest_error() -> None:
    """A few hundred bytes from a peer; ``json`` raises ``RecursionError`` on it."""
    nested = b"[" * 100_000 + b"]" * 100_000
    text = b'{"scheme":"' + DIGEST_SCHEME.encode() + b'","layers":' + nested + b"}"
    wire = _wire(None, raw=text)
    assert len(wire) < 1000
    with pytest.raises(ManifestError, match="nested deeper") as caught:
        Digest.from_wire(wire, peer=PEER)
    assert PEER in str(caught.value)


def test_a_header_announcing_more_values_than_the_body_holds_builds_nothing() -> None:
    """320,000 values announced (one head list of 20,000 heads, 16 layers), 8 bytes sent:
    refused on the counts, naming both."""
    header = _header(layers=[f"l{i}" for i in range(16)], heads=[list(range(20_000))], dtype=_DROP)
    with pytest.raises(
        ManifestError, match=r"values: 8 bytes are not the 2,560,000 .* \(320,000 values\)"
    ):
        Digest.from_wire(_wire(header, [5]), peer=PEER)


# -- headers to_wire never writes ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"layers": "model.layers.0.attn"}, "layers"),
        ({"layers": ["a", 7]}, "layers"),
        ({"layers": ["model.layers.0.attn", "model.layers.0.attn"]}, "layers"),
        ({"num_tokens": -1}, "num_tokens"),
        ({"num_tokens": True}, "num_tokens"),
        ({"num_tokens": 16.0}, "num_tokens"),
        ({"num_tokens": "16"}, "num_tokens"),
        ({"tp_size": 0, "tp_rank": 7}, "tp_size"),
        ({"tp_size": 4, "tp_rank": 7}, "tp_rank"),
        ({"tp_rank": -1}, "tp_rank"),
        ({"heads": [[1, 0]]}, "heads[0]"),
        ({"heads": [[0, 0]]}, "heads[0]"),
        ({"heads": [[0, True]]}, "heads[0]"),
        ({"heads": [[-2, 0]]}, "heads[0]"),
        ({"heads": [0, 1]}, "heads"),
        ({"heads": [[0, 1], [0]], "layer_heads": [0, 2]}, "layer_heads[1]"),
        ({"heads": [[0, 1], [0]], "layer_heads": [0]}, "layer_heads"),
        ({"dtype": "float7"}, "dtypes[0]"),
        ({"dtype": _DROP, "dtypes": ["bfloat16"]}, "dtypes"),
        ({"dtypes": ["bfloat16", "bfloat16"]}, "header"),
        ({"fingerprint": 5}, "fingerprint"),
        ({"layers": _DROP}, "header"),
        ({"signature": "trust me"}, "header"),
    ],
)
def test_a_header_to_wire_never_writes_is_one_manifest_error_naming_the_field(
    changes: dict[str, Any], field: str
) -> None:
    wire = _wire(_header(**changes), [1, 2, 3, 4])
    with pytest.raises(ManifestError) as caught:
        Digest.from_wire(wire, peer=PEER)
    assert f"{PEER}: digest {field}" in str(caught.value)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from([*_header(), "layer_heads", "dtypes", "other"]),
    _JSON,
    st.lists(st.integers(0, 2**64 - 1), max_size=6),
)
def test_any_value_in_any_field_is_a_digest_or_one_manifest_error(
    field: str, value: Any, numbers: list[int]
) -> None:
    """Whatever JSON a peer puts in a field, and whatever values follow: a ``Digest`` that
    reads back as it came, or a ``ManifestError`` naming the peer; never another exception."""
    header = _header()
    header[field] = value
    try:
        found = Digest.from_wire(_wire(header, numbers), peer=PEER)
    except ManifestError as error:
        assert str(error).startswith(f"{PEER}: digest")
    else:
        assert Digest.from_wire(found.to_wire(), peer=PEER) == found


def test_a_key_given_twice_in_the_header_is_refused_not_taken_last() -> None:
    text = json.dumps(_header())[:-1] + ', "num_tokens": 32}'
    with pytest.raises(ManifestError, match="'num_tokens' is given twice"):
        Digest.from_wire(_wire(None, [1, 2, 3, 4], raw=text.encode()), peer=PEER)


def test_a_value_wider_than_62_bits_is_refused() -> None:
    with pytest.raises(ManifestError, match="62-bit"):
        Digest.from_wire(_wire(_header(), [1, 2, 3, 1 << 63]), peer=PEER)


def test_the_wire_round_trips_element_types_head_lists_and_nothing() -> None:
    several = Digest(
        7,
        {"a": {0: 1, 1: 2}, "mla": {-1: 3}, "b": {0: 4, 1: 5}},
        1,
        2,
        dtypes={"a": "float16", "mla": "float8_e4m3fn"},  # b's not said
    )
    for one in (several, Digest(0, {}), Digest(5, {"a": {0: 9}})):
        assert Digest.from_wire(one.to_wire(), peer=PEER) == one


# -- two schemes ---------------------------------------------------------------------------------


def test_a_peer_of_the_old_scheme_is_refused_by_name_and_said_not_judged() -> None:
    """A P of the release before (``sv-digest-1``: values without the element type) and a D of
    this one: ``from_wire`` refuses P's digest naming both schemes, and D says the request not
    judged (as the vLLM plugin does with what ``from_wire`` raised); never a mismatch."""
    old = {
        "scheme": "sv-digest-1",
        "num_tokens": 16,
        "tp_rank": 0,
        "tp_size": 1,
        "fingerprint": "",
        "layers": ["model.layers.0.attn"],
        "heads": [0, 1],
    }
    with pytest.raises(ManifestError) as caught:
        Digest.from_wire(_wire(old, [1, 2]), peer=PEER)
    message = str(caught.value)
    assert "'sv-digest-1'" in message
    assert DIGEST_SCHEME in message
    assert "cannot be compared" in message
    with capture_events() as events:
        not_judged(message, policy="strict", request="r1")
    assert [(e["event"], e["verdict"], e["reason"]) for e in events] == [
        ("digest_checked", "not_judged", message)
    ]


def test_digests_of_two_schemes_are_one_finding_not_compared_never_a_storm_or_agreement() -> None:
    """Values of two schemes mean different things: equal numbers are no agreement, different
    ones no mismatch."""
    values = {f"layer.{i}": {0: i, 1: i + 1} for i in range(8)}
    old = Digest(16, values, scheme="sv-digest-1")
    for received in (Digest(16, values), Digest(16, {k: {0: 0, 1: 0} for k in values})):
        findings = safeview.verify(old, received)
        assert [(f.kind, f.layer) for f in findings] == [("digest_unmatched", None)]
        assert "'sv-digest-1'" in findings[0].message
        assert "not compared" in findings[0].message
        assert safeview.verify(received, old) != []


# -- verify and judge refuse what is not a digest ------------------------------------------------


@pytest.mark.parametrize("bad", [[], None, (), "digest", [None], 5])
def test_verify_of_what_is_not_a_digest_is_an_argument_error_naming_the_side(bad: Any) -> None:
    one = Digest(16, {"a": {0: 1}})
    with pytest.raises(ArgumentError, match=r"^sent is .*not a Digest or a non-empty sequence"):
        safeview.verify(bad, one)
    with pytest.raises(ArgumentError, match=r"^received is .*not a Digest"):
        safeview.verify(one, bad)
    with pytest.raises(ArgumentError, match=r"^received is "):
        judge(one, bad, policy="warn")


# -- judge as docs/layouts.md calls it -----------------------------------------------------------


def _judged(logging_on: bool) -> tuple[list[Any], list[dict[str, Any]]]:
    """The doc's call, ``judge(sent, received, policy=..., request=...)``, on an agreeing pair,
    a disagreeing one under warn and under strict, and with no policy at all (the one in
    force: strict by default, warn inside a ``policy_scope``), with safeview's events
    configured as JSON lines at DEBUG or switched off entirely."""
    out = io.StringIO()
    if logging_on:
        configure_logging("json", level="DEBUG", stream=out)
    else:
        logging.getLogger("safeview").setLevel(logging.CRITICAL + 1)
    sent = [Digest(16, {"layers.0": {0: 1}}, 0, 2), Digest(16, {"layers.0": {1: 2}}, 1, 2)]
    same = Digest(16, {"layers.0": {0: 1, 1: 2}})
    other = Digest(16, {"layers.0": {0: 1, 1: 3}})
    results = [
        judge(sent, same, policy="warn", request="r1"),
        judge(sent, other, policy="warn", request="r2"),
        judge(sent, other, policy="strict", request="r3"),
        judge(sent, other),
    ]
    with policy_scope("warn"):
        results.append(judge(sent, other, request="r5"))
    return results, [json.loads(line) for line in out.getvalue().splitlines()]


@pytest.mark.parametrize("logging_on", [True, False])
def test_judge_as_the_docs_call_it_works_whatever_the_logging(logging_on: bool) -> None:
    results, events = _judged(logging_on)
    assert results[0] is None
    assert results[1] is None
    assert isinstance(results[2], DigestMismatchError)
    assert results[2].request == "r3"
    assert results[2].heads == (1,)
    assert isinstance(results[3], DigestMismatchError)  # strict: the default policy
    assert results[4] is None
    if not logging_on:
        assert events == []
        return
    assert [(e["event"], e["request"], e["policy"]) for e in events] == [
        ("digest_checked", "r1", "warn"),
        ("digest_mismatch", "r2", "warn"),
        ("digest_mismatch", "r3", "strict"),
        ("digest_mismatch", None, "strict"),
        ("digest_mismatch", "r5", "warn"),
    ]
    first = events[0]
    # the pair's fields, not given: the engines unknown, the ranks the digests' own
    assert (first["engine"], first["remote_engine"]) == (None, None)
    assert (first["tp_rank"], first["tp_size"], first["remote_tp_size"]) == (0, 1, 2)
    assert (first["verdict"], first["num_tokens"], first["layers"], first["heads"]) == (
        "agree",
        16,
        1,
        2,
    )
    # given, they are said as given
    one = Digest(16, {"layers.0": {0: 1}})
    with capture_events() as given:
        judge(one, one, policy="warn", engine="D", remote_engine="P", tp_rank=1)
    assert (given[0]["engine"], given[0]["remote_engine"], given[0]["tp_rank"]) == ("D", "P", 1)
