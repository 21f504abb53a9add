"""``safeview diff SENDER RECEIVER``: exit 0 compatible, 1 mismatch, 2 bad input in one line."""

from __future__ import annotations

import http.server
import importlib.util
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from safeview.manifest import MANIFEST_SCHEMA, Manifest, assumed
from safeview.manifest.wire import to_wire


def run(*arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "safeview", "diff", *arguments], capture_output=True, text=True
    )


def engine(folder: Path, tp: int, layout: str = "NB_NH_BS_2HS", name: str = "vllm") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for rank in range(tp):
        manifest = assumed(
            layout,
            layers=[f"model.layers.{i}.self_attn" for i in range(4)],
            num_blocks=32,
            block_tokens=16,
            num_heads=8 // tp,
            head_size=16,
            dtype="bfloat16",
            topology={"tp_rank": rank, "tp_size": tp, "total_kv_heads": 8, "engine": name},
        )
        (folder / manifest.file_name()).write_text(manifest.to_json())
    return folder


def test_valid_heterogeneous_pair_is_compatible(tmp_path: Path) -> None:
    result = run(str(engine(tmp_path / "p", 2)), str(engine(tmp_path / "d", 4)), "--rule",
                 "vllm_nixl")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("COMPATIBLE ")
    assert "4 layers, rule vllm_nixl" in result.stdout


def test_mismatch_names_layer_and_byte_exit_1(tmp_path: Path) -> None:
    result = run(str(engine(tmp_path / "p", 1)), str(engine(tmp_path / "d", 1, "NB_BS_NH_2HS")))
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert lines[0].startswith("MISMATCH ")
    assert lines[1] == (
        "  byte  model.layers.0.self_attn: receiver page byte 64 reads K token 0 head 1 "
        "element 0, the sender wrote K token 1 head 0 element 0 there"
    )
    assert len(lines) == 5


def test_json_is_one_document_with_schema(tmp_path: Path) -> None:
    result = run(str(engine(tmp_path / "p", 1)), str(engine(tmp_path / "d", 1, "NB_BS_NH_2HS")),
                 "--json")  # fmt: skip
    assert result.returncode == 1
    document = json.loads(result.stdout)
    assert document["$schema"] == "urn:safeview:diff:1"
    assert document["verdict"] == "mismatch"
    assert document["exit_code"] == 1
    first = document["findings"][0]
    assert (first["layer"], first["byte"]) == ("model.layers.0.self_attn", 64)
    assert first["receiver_reads"]["words"] == "K token 0 head 1 element 0"
    assert first["sender_wrote"]["head"] == 0


def bad_inputs(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    good = engine(tmp_path / "good", 1) / "vllm.tp0of1.manifest.json"
    text = good.read_text()
    other_schema = tmp_path / "v2.json"
    other_schema.write_text(text.replace(MANIFEST_SCHEMA, "urn:safeview:manifest:2"))
    truncated = tmp_path / "cut.json"
    truncated.write_text(text[: len(text) // 3])
    unknown = tmp_path / "axis.json"
    data = json.loads(text)
    data["layers"]["model.layers.0.self_attn"]["axes"][1]["axis"] = "tokens"
    unknown.write_text(json.dumps(data))
    elsewhere = tmp_path / "elsewhere.json"
    lonely = assumed("NB_NH_BS_2HS", layers=["other"], num_blocks=2, block_tokens=4, num_heads=8,
                     head_size=16, dtype="bfloat16")  # fmt: skip
    elsewhere.write_text(lonely.to_json())
    empty = tmp_path / "empty"
    empty.mkdir()
    return {
        "other schema version": (other_schema, "$schema"),
        "truncated file": (truncated, "is not JSON"),
        "unknown axis": (unknown, "axes[1].axis"),
        "no common layer": (elsewhere, "no name in common"),
        "missing file": (tmp_path / "nowhere.json", "cannot be read"),
        "empty folder": (empty, "no *.json"),
    }


@pytest.mark.parametrize(
    "case",
    ["other schema version", "truncated file", "unknown axis", "no common layer", "missing file",
     "empty folder"],
)  # fmt: skip
def test_bad_input_is_one_line_exit_2_never_compatible(tmp_path: Path, case: str) -> None:
    path, words = bad_inputs(tmp_path)[case]
    good = tmp_path / "good" / "vllm.tp0of1.manifest.json"
    result = run(str(good), str(path))
    assert result.returncode == 2
    assert result.stdout == ""
    assert len(result.stderr.splitlines()) == 1
    assert result.stderr.startswith("safeview: ")
    assert words in result.stderr
    assert "Traceback" not in result.stderr
    as_json = run(str(good), str(path), "--json")
    assert as_json.returncode == 2
    assert json.loads(as_json.stdout)["verdict"] == "error"


@pytest.mark.slow
def test_upgrade_diff_of_two_folders(tmp_path: Path) -> None:
    old = engine(tmp_path / "old", 2)
    same = run(str(old), str(engine(tmp_path / "new", 2)))
    assert same.returncode == 0
    moved = run(str(old), str(engine(tmp_path / "moved", 2, "NB_BS_NH_2HS")), "-q")
    assert moved.returncode == 1
    assert moved.stdout == ""


@pytest.mark.slow
def test_the_example_shows_a_valid_pair_then_the_layer_that_moved() -> None:
    example = Path(__file__).parent.parent / "examples" / "two_engines.py"
    result = subprocess.run([sys.executable, str(example)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "COMPATIBLE " in result.stdout
    assert (
        "model.layers.3.self_attn: receiver page byte 512 reads K token 0 head 1" in result.stdout
    )


def test_a_folder_of_two_engines_is_bad_input(tmp_path: Path) -> None:
    shared = engine(tmp_path / "shared", 1, name="prefill")
    engine(shared, 2, name="decode")
    result = run(str(shared), str(shared))
    assert result.returncode == 2
    assert "several engines" in result.stderr


# -- the folders the vLLM plugin writes (newcomer point 4) ---------------------------------------


def plugin_engine(root: Path, name: str, tp: int, *, heads: int = 8, tokens: int = 16,
                  mla: bool = False, layout: str = "LBHNC") -> Path:  # fmt: skip
    """One engine's manifests as the vLLM plugin writes them with SAFEVIEW_MANIFEST_DIR=root:
    ``root/ENGINE/ENGINE.tpRofN.manifest.json``, naming vLLM's NIXL connector."""
    import torch

    from safeview.manifest import describe, vllm_axes
    from safeview.vllm._layout import write_manifest

    for rank in range(tp):
        local = 1 if mla else max(1, heads // tp)
        shape = (12, local, tokens, 64 if mla else 32)
        caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(shape, device="meta")
                  for i in range(3)}  # fmt: skip
        topology = {"tp_rank": rank, "tp_size": tp, "total_kv_heads": 1 if mla else heads,
                    "engine": name, "layout": layout, "connector": "NixlConnector",
                    "engine_version": "vllm 0.33.0"}  # fmt: skip
        manifest = describe(caches, axes=vllm_axes("mla" if mla else "attention"),
                            topology=topology)  # fmt: skip
        write_manifest(manifest, root)
    return root


@pytest.mark.slow
@pytest.mark.parametrize(
    ("p", "d"),
    [
        ({"tp": 2}, {"tp": 4}),
        ({"tp": 4}, {"tp": 2}),
        ({"tp": 8, "heads": 8}, {"tp": 16, "heads": 8}),
        ({"tp": 1, "mla": True}, {"tp": 2, "mla": True}),
        ({"tp": 2, "tokens": 16}, {"tp": 2, "tokens": 32}),
    ],
    ids=["tp2_to_4", "tp4_to_2", "h8_tp8_to_16", "mla_tp1_to_2", "blocks_x2"],
)
def test_the_plugins_folders_diff_by_the_connectors_rule_without_a_flag(
    tmp_path: Path, p: dict[str, Any], d: dict[str, Any]
) -> None:
    prefill = plugin_engine(tmp_path / "m-of-P", "prefill", **p)
    decode = plugin_engine(tmp_path / "m-of-D", "decode", **d)
    result = run(str(prefill), str(decode))
    assert result.returncode == 0, result.stdout + result.stderr
    first = result.stdout.splitlines()[0]
    assert "rule vllm_nixl of connector NixlConnector" in first
    senders = f"ranks 0-{p['tp'] - 1}" if p["tp"] > 1 else "rank 0"
    assert f"sender {senders} of TP {p['tp']}" in first
    document = json.loads(run(str(prefill), str(decode), "--json").stdout)
    assert (document["rule"], document["rule_from"]) == ("vllm_nixl", "connector NixlConnector")
    assert document["receiver_ranks"] == list(range(d["tp"]))
    if p != d:  # a page copy is not how these bytes move
        assert run(str(prefill), str(decode), "--rule", "page_copy").returncode == 1


@pytest.mark.slow
def test_a_layout_in_vllms_older_words_is_read_and_a_typo_is_named(tmp_path: Path) -> None:
    """``HND`` (vLLM's older word for LBHNC, and FlashInfer's) is the block-contiguous layout
    heterogeneous TP needs: TP 2 -> 4 is compatible, as with LBHNC. A string vLLM would not
    take is bad input: one line naming it and the names accepted, not a refusal per layer."""
    prefill = plugin_engine(tmp_path / "m-of-P", "prefill", 2, layout="HND")
    decode = plugin_engine(tmp_path / "m-of-D", "decode", 4, layout="HND")
    result = run(str(prefill), str(decode))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("COMPATIBLE ")
    typo = plugin_engine(tmp_path / "typo", "decode", 4, layout="foo")
    result = run(str(prefill), str(typo))
    assert result.returncode == 2, result.stdout
    [line] = result.stderr.splitlines()
    assert (
        "topology.layout: 'foo' is not a layout of vLLM's (kv_cache_layout): expected one "
        "of LBHNC, LBNHC, LHBNC, BLHNC, BLNHC, BHLNC, or HND (LBHNC), NHD (LBNHC)" in line
    ), line


def test_a_folder_of_several_engines_folders_says_which_and_how_to_name_one(
    tmp_path: Path,
) -> None:
    shared = plugin_engine(tmp_path / "m", "prefill", 1)
    plugin_engine(shared, "decode", 2)
    result = run(str(shared), str(shared))
    assert result.returncode == 2
    [line] = result.stderr.splitlines()
    assert "holds 2 engines' folders (decode, prefill): give one, such as " in line
    assert line.endswith(f"{shared / 'decode'}\n".rstrip())
    assert "None" not in line


def test_unreadable_and_empty_paths_are_named_without_none(tmp_path: Path) -> None:
    good = engine(tmp_path / "good", 1)
    (tmp_path / "empty").mkdir()
    for path, words in (
        (tmp_path / "nowhere", "cannot be read: No such file or directory"),
        (tmp_path / "empty", "is a folder that holds no *.json manifest"),
    ):
        result = run(str(good), str(path))
        assert result.returncode == 2
        assert result.stderr == f"safeview: {path}: {words}" + (
            ", nor one engine's folder of them\n" if path.name == "empty" else "\n"
        )
        assert "None" not in result.stderr


# -- errors in one short line (newcomer point 2) -------------------------------------------------


def test_a_renamed_layer_in_a_100_layer_manifest_is_one_short_line(tmp_path: Path) -> None:
    names = [f"model.layers.{i}.self_attn" for i in range(100)]
    manifest = assumed("NB_NH_BS_2HS", layers=names, num_blocks=32, block_tokens=16, num_heads=8,
                       head_size=16, dtype="bfloat16")  # fmt: skip
    good, edited = tmp_path / "good.json", tmp_path / "edited.json"
    good.write_text(manifest.to_json())
    data = json.loads(manifest.to_json())
    data["layers"]["model.layers.renamed"] = data["layers"].pop(names[42])
    edited.write_text(json.dumps(data))
    result = run(str(good), str(edited))
    assert result.returncode == 2
    [line] = result.stderr.splitlines()
    renamed = Manifest.from_json(edited.read_text().replace(manifest.fingerprint, ""))
    assert line == (
        f"safeview: {edited}: fingerprint: {manifest.fingerprint[:12]}... does not match the "
        f"layers ({renamed.fingerprint[:12]}...): a layer was renamed, added or edited"
    )
    assert len(line.removeprefix(f"safeview: {edited}")) < 120, line
    document = json.loads(run(str(good), str(edited), "--json").stdout)
    assert document["error"] == line.removeprefix("safeview: ")


# -- ranks (newcomer point 5) and heads --------------------------------------------------------


def test_a_receiver_folder_missing_a_rank_is_a_mismatch_naming_it(tmp_path: Path) -> None:
    prefill = engine(tmp_path / "p", 2)
    decode = engine(tmp_path / "d", 2)
    (decode / "vllm.tp1of2.manifest.json").unlink()
    result = run(str(prefill), str(decode))
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert "sender ranks 0-1 of TP 2, receiver rank 0 of TP 2" in lines[0]
    assert lines[1] == (
        "  missing_rank  the receiver declares TP 2 but no manifest of its rank 1 was given: "
        "rank 1 is not judged"
    )
    whole = run(str(prefill), str(engine(tmp_path / "d2", 2)))
    assert whole.returncode == 0
    assert "sender ranks 0-1 of TP 2, receiver ranks 0-1 of TP 2" in whole.stdout


def test_a_page_copy_between_ranks_of_other_heads_is_a_mismatch_naming_the_head(
    tmp_path: Path,
) -> None:
    engine(tmp_path / "e", 2)
    rank0, rank1 = (tmp_path / "e" / f"vllm.tp{r}of2.manifest.json" for r in range(2))
    result = run(str(rank0), str(rank1))  # rank 0 holds heads 0-3, rank 1 heads 4-7
    assert result.returncode == 1
    assert "reads K token 0 head 4 element 0, the sender wrote K token 0 head 0" in result.stdout
    assert "sender rank 0 of TP 2, receiver rank 1 of TP 2" in result.stdout.splitlines()[0]


# -- sources across machines: a wire payload, a handshake payload, a metadata store (issue 28) --


def rank_manifest(tp: int = 2, rank: int = 0, layout: str = "NB_NH_BS_2HS") -> Manifest:
    return assumed(
        layout,
        layers=[f"model.layers.{i}.self_attn" for i in range(4)],
        num_blocks=32,
        block_tokens=16,
        num_heads=8 // tp,
        head_size=16,
        dtype="bfloat16",
        topology={"tp_rank": rank, "tp_size": tp, "total_kv_heads": 8, "engine": "vllm"},
    )


def handshake_payload(manifest: Manifest | None) -> bytes:
    """What vLLM 0.33's NIXL side channel serves for one rank (NixlHandshakePayload, msgpack
    through msgspec: a map of its fields), with safeview's manifest under its own key on P."""
    # vLLM's own dependency; the `test` extra brings it, and without it the test says so
    msgspec = pytest.importorskip("msgspec", reason="needs msgspec: pip install -e '.[test]'")

    metadata = {"engine_id": "vllm", "block_lens": [4096], "kv_cache_layout": "HND"}
    agent = msgspec.msgpack.encode(metadata)
    payload: dict[str, Any] = {"compatibility_hash": "ab" * 32, "agent_metadata_bytes": agent}
    if manifest is not None:
        payload["safeview_manifest"] = to_wire(manifest)
    encoded: bytes = msgspec.msgpack.encode(payload)
    return encoded


def test_a_wire_payload_and_a_handshake_payload_saved_to_files_are_sides(tmp_path: Path) -> None:
    decode = engine(tmp_path / "d", 4)
    wire = tmp_path / "p.rank0.wire"
    wire.write_bytes(to_wire(rank_manifest()))
    result = run(str(wire), str(decode), "--rule", "vllm_nixl")
    assert result.returncode == 1  # rank 0 alone: D ranks reading P rank 1 are not judged
    assert "sender rank 0 of TP 2, receiver ranks 0-3 of TP 4" in result.stdout
    assert "missing_rank" in result.stdout
    single = run(str(wire), str(decode / "vllm.tp1of4.manifest.json"), "--rule", "vllm_nixl")
    assert single.returncode == 0, single.stdout + single.stderr  # D rank 1 reads P rank 0
    payload = tmp_path / "p.rank0.handshake"
    payload.write_bytes(handshake_payload(rank_manifest()))
    same = run(str(payload), str(decode / "vllm.tp1of4.manifest.json"), "--rule", "vllm_nixl")
    assert same.returncode == 0, same.stderr
    assert same.stdout.startswith(f"COMPATIBLE {payload} -> ")
    moved = tmp_path / "moved.handshake"
    moved.write_bytes(handshake_payload(rank_manifest(layout="NB_BS_NH_2HS")))
    wrong = run(str(moved), str(decode / "vllm.tp1of4.manifest.json"), "--rule", "vllm_nixl")
    assert wrong.returncode == 1
    assert "  byte  model.layers.0.self_attn: receiver page byte" in wrong.stdout


def bad_wire_sources(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    good = to_wire(rank_manifest())
    cases = {
        "forged.wire": (good.replace(b'"layers":[["0"', b'"layers":[["9"'), "fingerprint: "),
        "cut.wire": (good[: len(good) // 2], "is not JSON"),
        "plain.handshake": (handshake_payload(None), "safeview_manifest: is absent"),
        "garbled.handshake": (handshake_payload(rank_manifest())[:40], "not a msgpack"),
        "forged.handshake": (
            handshake_payload(rank_manifest()).replace(b'"layers":[["0"', b'"layers":[["7"'),
            "safeview_manifest: fingerprint: ",
        ),
    }
    found = {}
    for name, (data, words) in cases.items():
        (tmp_path / name).write_bytes(data)
        found[name] = (tmp_path / name, words)
    return found


@pytest.mark.parametrize(
    "case", ["forged.wire", "cut.wire", "plain.handshake", "garbled.handshake", "forged.handshake"]
)
def test_a_bad_wire_or_handshake_file_is_one_line_exit_2(tmp_path: Path, case: str) -> None:
    path, words = bad_wire_sources(tmp_path)[case]
    result = run(str(path), str(engine(tmp_path / "d", 2)))
    assert result.returncode == 2, result.stdout
    [line] = result.stderr.splitlines()
    assert line.startswith(f"safeview: {path}")
    assert words in line, line
    assert "Traceback" not in result.stderr


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def metadata_server() -> Iterator[str]:
    """Mooncake's own HTTP metadata server (its wheel's ``mooncake.http_metadata_server``) on
    127.0.0.1, as a Mooncake deployment runs it; its ``/metadata`` URL."""
    if importlib.util.find_spec("mooncake") is None:
        if os.environ.get("SAFEVIEW_REQUIRE_ENGINES") == "1":
            pytest.fail("SAFEVIEW_REQUIRE_ENGINES=1 but Mooncake is not installed")
        pytest.skip("Mooncake is not installed here: its HTTP metadata server with it")
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "mooncake.http_metadata_server", "--host", "127.0.0.1",
         "--port", str(port), "--log-level", "WARNING"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}/metadata"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{url}?key=probe", timeout=2)
            except urllib.error.HTTPError:
                break  # 404: it answers
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    why = server.stderr.read().decode() if server.stderr else ""
                    raise RuntimeError(f"the metadata server did not start: {why}") from None
                time.sleep(0.1)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=30)


def put(url: str, key: str, data: bytes) -> None:
    request = urllib.request.Request(f"{url}?key={key}", data=data, method="PUT")
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200


@pytest.mark.slow
def test_a_manifest_in_mooncakes_metadata_server_is_a_side(
    tmp_path: Path, metadata_server: str
) -> None:
    decode = engine(tmp_path / "d", 2) / "vllm.tp0of2.manifest.json"
    # where a Mooncake sender publishes it: a key of its own beside its segment's
    key = "mooncake/safeview/127.0.0.1:7001"
    put(metadata_server, key, to_wire(rank_manifest()))
    source = f"{metadata_server}?key={key}"
    result = run(source, str(decode))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"COMPATIBLE {source} -> ")
    quoted = f"{metadata_server}?key=mooncake%2Fsafeview%2F127.0.0.1%3A7001"
    assert run(quoted, str(decode)).returncode == 0
    as_receiver = run(str(decode), quoted.replace("127.0.0.1:", "localhost:", 1))
    assert as_receiver.returncode == 0, as_receiver.stderr
    put(metadata_server, "mooncake/safeview/moved", to_wire(rank_manifest(layout="NB_BS_NH_2HS")))
    moved = run(f"{metadata_server}?key=mooncake/safeview/moved", str(decode))
    assert moved.returncode == 1
    assert "  byte  model.layers.0.self_attn: receiver page byte" in moved.stdout
    # a full manifest file's text, stored there, is read too
    put(metadata_server, "mooncake/safeview/file", rank_manifest().to_json().encode())
    assert run(f"{metadata_server}?key=mooncake/safeview/file", str(decode)).returncode == 0


@pytest.mark.slow
def test_a_store_url_that_fails_is_one_line_exit_2(tmp_path: Path, metadata_server: str) -> None:
    decode = str(engine(tmp_path / "d", 2))
    put(metadata_server, "mooncake/safeview/forged",
        to_wire(rank_manifest()).replace(b'"layers":[["0"', b'"layers":[["5"'))  # fmt: skip
    closed = f"http://127.0.0.1:{_free_port()}/metadata?key=k"
    cases = {
        f"{metadata_server}?key=mooncake/safeview/nobody": "HTTP 404 (nothing is stored under "
        "that key)",
        f"{metadata_server}?key=mooncake/safeview/forged": "fingerprint: ",
        closed: "cannot be fetched: ",
        "http://10.0.0.1:8080/metadata?key=k": "names host 10.0.0.1: only a store on this machine",
        "http://example.com/metadata?key=k": "names host example.com",
        "https://127.0.0.1:1/metadata?key=k": "is not an http:// URL",
        "etcd://127.0.0.1:2379": "is not an http:// URL",
        "http://127.0.0.1:99999/metadata": "is not a URL",
    }
    for url, words in cases.items():
        result = run(url, decode)
        assert result.returncode == 2, (url, result.stdout)
        [line] = result.stderr.splitlines()
        assert line.startswith("safeview: "), line
        assert words in line, line
        assert "Traceback" not in result.stderr


class _Redirecting(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(302)
        self.send_header("Location", "http://10.0.0.1/metadata?key=k")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def test_a_redirect_off_the_machine_is_not_followed(tmp_path: Path) -> None:
    # beside the real store above: a loopback server that redirects elsewhere
    server = http.server.HTTPServer(("127.0.0.1", 0), _Redirecting)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        result = run(f"http://127.0.0.1:{server.server_port}/metadata?key=k",
                     str(engine(tmp_path / "d", 2)))  # fmt: skip
    finally:
        server.shutdown()
        server.server_close()
    assert result.returncode == 2
    [line] = result.stderr.splitlines()
    assert "cannot be fetched: HTTP 302 (a redirect to 'http://10.0.0.1/metadata?key=k': not " \
        "followed" in line, line  # fmt: skip


class Trickle:
    """A server on 127.0.0.1 that answers every request a byte at a time, one every half
    second, for as long as it runs: from the status line on (``headers``), or after a status
    line and headers sent at once that promise a megabyte (``body``). urllib's timeout is per
    read, and each byte renews it: such a server kept a fetch reading for days."""

    def __init__(self, phase: str) -> None:
        self.phase = phase
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.1)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/metadata?key=k"
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> Trickle:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.listener.close()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                client, _ = self.listener.accept()
            except TimeoutError:
                continue
            threading.Thread(target=self._answer, args=(client,), daemon=True).start()

    def _answer(self, client: socket.socket) -> None:
        head = b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n"
        with client:
            client.recv(65536)
            if self.phase == "body":
                client.sendall(head)
            slow = head + b"{" * 1000000 if self.phase == "headers" else b"{" * 1000000
            for at in range(len(slow)):
                if self.stop.wait(0.5):
                    return
                try:
                    client.sendall(slow[at : at + 1])
                except OSError:  # the reader gave up: what a bounded fetch does
                    return


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["headers", "body"])
def test_a_store_url_that_trickles_its_answer_is_given_up_at_10_s(
    tmp_path: Path, phase: str
) -> None:
    """The whole fetch is bounded, not each read: exit 2 within about 10 s, naming the URL and
    the bound, whether the server trickles its headers or its body."""
    from safeview.cli._diff import FETCH_TIMEOUT_S

    decode = str(engine(tmp_path / "d", 2))
    with Trickle(phase) as server:
        started = time.monotonic()
        try:
            result = subprocess.run(
                [sys.executable, "-m", "safeview", "diff", server.url, decode],
                capture_output=True, text=True, timeout=FETCH_TIMEOUT_S + 20,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            pytest.fail(f"safeview diff was still reading after {FETCH_TIMEOUT_S + 20:g} s")
        elapsed = time.monotonic() - started
    assert result.returncode == 2, result.stdout
    assert FETCH_TIMEOUT_S <= elapsed < FETCH_TIMEOUT_S + 5, elapsed
    [line] = result.stderr.splitlines()
    assert line.startswith(f"safeview: {server.url}"), line
    assert "cannot be fetched: no whole answer within 10 s" in line, line
