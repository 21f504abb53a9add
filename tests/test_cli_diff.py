"""``safeview diff SENDER RECEIVER``: exit 0 compatible, 1 mismatch, 2 bad input in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from safeview.manifest import MANIFEST_SCHEMA, assumed


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
        "unknown axis": (unknown, "axes.1.axis"),
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


def test_upgrade_diff_of_two_folders(tmp_path: Path) -> None:
    old = engine(tmp_path / "old", 2)
    same = run(str(old), str(engine(tmp_path / "new", 2)))
    assert same.returncode == 0
    moved = run(str(old), str(engine(tmp_path / "moved", 2, "NB_BS_NH_2HS")), "-q")
    assert moved.returncode == 1
    assert moved.stdout == ""


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
