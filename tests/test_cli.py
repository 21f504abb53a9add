"""The safeview command: exit codes, the table, --json, --map, schema, and no torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from safeview.cli import main

PLANS = Path(__file__).parent.parent / "examples" / "plans"


def _safeview(*args: str, code: str | None = None) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-c", code, *args] if code else [
        sys.executable, "-m", "safeview", *args
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAFEVIEW_")}
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)


def test_clean_plan_exits_0_with_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(PLANS / "vllm_unit_test.json")]) == 0
    out = capsys.readouterr().out
    assert "storage 'kv': 491,520 bytes, 3 views" in out
    assert "layers.2" in out
    assert "327,680" in out
    assert out.strip().endswith("no two views of one group share a byte.")


def test_broken_plan_exits_1_and_says_what_is_wrong(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(PLANS / "broken_aliasing.json")]) == 1
    out = capsys.readouterr().out
    assert "1 violation(s) in 122 views over 1 storage:" in out
    assert (
        "overlap  views 'model.layers.6.self_attn' and 'model.layers.7.self_attn' (group 0) "
        "both use byte 302592 of storage 'kv'"
    ) in out


@pytest.mark.parametrize(
    ("file_name", "kinds"),
    [
        ("broken_kv_split_stride.json", {"self_overlap"}),
        ("broken_one_block_too_many.json", {"out_of_bounds"}),
        ("broken_aliasing.json", {"overlap"}),
        ("glm_5_2_fp8_packed.json", set()),
    ],
)
def test_json_report_lists_violations_by_kind(
    file_name: str, kinds: set[str], capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["check", str(PLANS / file_name), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == (1 if kinds else 0)
    assert report["ok"] is (not kinds)
    assert {v["kind"] for v in report["violations"]} == kinds
    for violation in report["violations"]:
        assert violation["views"]
        assert violation["message"]
    assert len(report["views"]) == len(json.loads((PLANS / file_name).read_text())["views"])


def test_unreadable_plan_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(tmp_path / "missing.json")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_invalid_plan_exits_2_with_the_location(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = json.loads((PLANS / "vllm_unit_test.json").read_text())
    plan["views"][2]["page_bytes"] = 0
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    assert main(["check", str(path), "--json"]) == 2
    captured = capsys.readouterr()
    assert "views.2.page_bytes: Input should be greater than or equal to 1 (got 0)" in captured.err
    details = json.loads(captured.out)
    assert details["ok"] is False
    assert details["details"][0]["loc"] == "views.2.page_bytes"


def test_not_json_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "plan.json"
    path.write_text("{not json")
    assert main(["check", str(path)]) == 2
    assert "is not a valid plan" in capsys.readouterr().err


def test_map_is_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "map.png"
    assert main(["check", str(PLANS / "broken_aliasing.json"), "--map", str(target)]) == 1
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert target.stat().st_size > 10_000
    assert f"map written to {target}" in capsys.readouterr().out


@pytest.mark.parametrize("file_name", ["vllm_unit_test.json", "qwen3_next_hybrid.json"])
def test_map_of_contiguous_and_hybrid_layouts(tmp_path: Path, file_name: str) -> None:
    target = tmp_path / "map.png"
    assert main(["check", str(PLANS / file_name), "--map", str(target), "--json"]) == 0
    assert target.read_bytes()[:4] == b"\x89PNG"


def test_map_without_matplotlib_says_how_to_install_it(tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from safeview.cli import main\n"
        "sys.exit(main(sys.argv[1:]))"
    )
    result = _safeview(
        "check", str(PLANS / "vllm_unit_test.json"), "--map", str(tmp_path / "m.png"), code=code
    )
    assert result.returncode == 2
    assert "pip install 'safeview[plot]'" in result.stderr
    assert not (tmp_path / "m.png").exists()


def test_schema_is_the_plan_json_schema() -> None:
    result = _safeview("schema")
    assert result.returncode == 0, result.stderr
    schema = json.loads(result.stdout)
    assert schema["title"] == "Plan"
    assert set(schema["required"]) == {"storages", "views"}
    assert schema["$defs"]["PlanView"]["properties"]["page_bytes"]["minimum"] == 1


def test_check_does_not_import_torch() -> None:
    result = _safeview("check", str(PLANS / "glm_5_2_fp8_packed.json"), code=(
        "import sys\nfrom safeview.cli import main\ncode = main(sys.argv[1:])\n"
        "print('torch' in sys.modules, file=sys.stderr)\nsys.exit(code)"
    ))  # fmt: skip
    assert result.returncode == 0
    assert result.stderr.strip().splitlines()[-1] == "False"


def test_importtime_of_the_command_shows_no_torch() -> None:
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "safeview", "check",
         str(PLANS / "vllm_unit_test.json")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0
    imported = [line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines()]
    assert "safeview.plan" in imported
    assert not [name for name in imported if name == "torch" or name.startswith("torch.")]


def test_console_script_is_installed() -> None:
    script = Path(sys.executable).parent / "safeview"
    result = subprocess.run(
        [str(script), "check", str(PLANS / "vllm_unit_test.json"), "--json"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["ok"] is True
