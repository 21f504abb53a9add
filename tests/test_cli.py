"""The safeview command: exit codes, the output, --json, --map, schema, pipes, and no torch."""

from __future__ import annotations

import gc
import json
import os
import pty
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from safeview import overlap
from safeview.cli import main
from safeview.plan import PLAN_SCHEMA, Plan

PLANS = Path(__file__).parent.parent / "examples" / "plans"
CLEAN = str(PLANS / "vllm_unit_test.json")
ALIASING = str(PLANS / "broken_aliasing.json")
TOO_MANY = str(PLANS / "broken_one_block_too_many.json")
GLM = str(PLANS / "glm_5_2_fp8_packed.json")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAFEVIEW_")}
    return {**env, **extra}


def _safeview(
    *args: str, code: str | None = None, input: str | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-c", code, *args] if code else [
        sys.executable, "-m", "safeview", *args
    ]  # fmt: skip
    return subprocess.run(
        command, capture_output=True, text=True, timeout=120, input=input, env=env or _env()
    )


def _one_error_line(stderr: str) -> str:
    """The single ``safeview: ...`` line an error must be."""
    assert "Traceback" not in stderr
    [line] = stderr.splitlines()
    assert line.startswith("safeview: ")
    return line


def test_clean_plan_exits_0_with_the_verdict_and_a_summary(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["check", CLEAN]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"OK {CLEAN} (vLLM unit-test layout")
    assert len(lines) == 2  # no table unless asked for
    assert lines[1].startswith("3 views over 1 storage: every view stays inside")
    assert lines[1].endswith("no two views of one group share a byte.")


@pytest.mark.parametrize("flag", ["--table", "-v"])
def test_the_table_is_shown_only_with_table(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", CLEAN, flag]) == 0
    out = capsys.readouterr().out
    assert "storage 'kv': 491,520 bytes, 3 views" in out
    assert "327,680" in out
    assert out.strip().endswith("no two views of one group share a byte.")
    main(["check", CLEAN])
    assert "491,520" not in capsys.readouterr().out


def test_broken_plan_exits_1_and_says_what_is_wrong(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", ALIASING]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        f"FAIL {ALIASING} (DeepSeek-V3.2, broken: layer 7's MLA page placed on layer 6's)",
        "  overlap  1 pair of views that share bytes, at byte 302,592: "
        "'model.layers.6.self_attn' & 'model.layers.7.self_attn'",
        "1 violation (1 overlap) in 122 views over 1 storage.",
    ]
    assert main(["check", ALIASING, "-v"]) == 1
    assert (
        "      views 'model.layers.6.self_attn' and 'model.layers.7.self_attn' (group 0) "
        "both use byte 302,592 of storage 'kv'"
    ) in capsys.readouterr().out.splitlines()


def test_violations_of_one_kind_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", TOO_MANY]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    assert lines[0].startswith(f"FAIL {TOO_MANY} (GLM-5.2-FP8")
    assert lines[1] == (
        "  out_of_bounds  101 views past the end of their storage by 36,864..3,098,112 bytes: "
        "'model.layers.0.self_attn', 'model.layers.0.indexer', 'model.layers.1.self_attn' "
        "and 98 more"
    )
    assert lines[2] == "101 violations (101 out_of_bounds) in 101 views over 1 storage."


@pytest.mark.parametrize(
    ("limit", "ending", "sentences"),
    [("1", ": 'model.layers.0.self_attn' and 100 more", 1), ("0", " bytes, 101 more", 0),
     ("101", "'model.layers.78.self_attn'", 101), ("500", "'model.layers.78.self_attn'", 101)],
)  # fmt: skip
def test_max_violations_caps_what_is_listed(
    limit: str, ending: str, sentences: int, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["check", TOO_MANY, "--max-violations", limit]) == 1
    [group] = [line for line in capsys.readouterr().out.splitlines() if "out_of_bounds " in line]
    assert group.endswith(ending)
    assert main(["check", TOO_MANY, "-v", "--max-violations", limit]) == 1
    out = capsys.readouterr().out
    assert out.count("bytes past the end)") == sentences


@pytest.mark.parametrize(("plan", "code"), [(CLEAN, 0), (ALIASING, 1), ("missing.json", 2)])
def test_quiet_prints_nothing_and_sets_the_exit_code(plan: str, code: int) -> None:
    result = _safeview("check", "-q", plan)
    assert (result.returncode, result.stdout, result.stderr) == (code, "", "")


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
    document = json.loads(capsys.readouterr().out)
    assert code == (1 if kinds else 0)
    assert document["schema_version"] == 2
    assert document["exit_code"] == code
    assert document["status"] == (sorted(kinds) or ["clean"])
    [report] = document["plans"]
    assert report["plan"] == str(PLANS / file_name)
    assert report["status"] == document["status"]
    assert report["ok"] is (not kinds)
    assert {v["kind"] for v in report["violations"]} == kinds
    for violation in report["violations"]:
        assert violation["views"]
        assert violation["message"]
    assert len(report["views"]) == len(json.loads((PLANS / file_name).read_text())["views"])


def test_json_exit_code_is_the_worst_and_status_names_it(tmp_path: Path) -> None:
    result = _safeview("check", "--json", CLEAN, ALIASING, str(tmp_path / "missing.json"))
    document = json.loads(result.stdout)
    assert result.returncode == 2 == document["exit_code"]
    assert document["status"] == ["error", "overlap"]
    clean, aliasing, missing = document["plans"]
    assert (clean["status"], clean["ok"]) == (["clean"], True)
    assert (aliasing["status"], aliasing["ok"]) == (["overlap"], False)
    assert (missing["status"], missing["ok"]) == (["error"], False)
    assert missing["error"].startswith("cannot read")
    assert "views" not in missing
    assert _one_error_line(result.stderr).startswith("safeview: cannot read")


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
    assert captured.err == (
        f"safeview: {path} is not a valid plan: views.2.page_bytes: "
        "Input should be greater than or equal to 1 (got 0)\n"
    )
    [report] = json.loads(captured.out)["plans"]
    assert (report["ok"], report["status"]) == (False, ["error"])
    assert report["details"][0]["loc"] == "views.2.page_bytes"


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


@pytest.mark.parametrize(("suffix", "magic"), [(".svg", b"<?xml"), (".PDF", b"%PDF")])
def test_map_as_svg_or_pdf(suffix: str, magic: bytes, tmp_path: Path) -> None:
    target = tmp_path / f"map{suffix}"
    assert main(["check", CLEAN, "--map", str(target), "-q"]) == 0
    assert target.read_bytes().startswith(magic)


@pytest.mark.parametrize(
    ("target", "words"),
    [("map.jpg", "must end in .png, .svg, .pdf"), ("map", "must end in"),
     ("no/such/folder/map.png", "does not exist")],
)  # fmt: skip
def test_map_target_is_refused_before_any_plan_is_read(
    target: str, words: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    def wasted(*args: Any) -> None:
        raise AssertionError("a plan was read before the map target was checked")

    monkeypatch.setattr(Plan, "from_json", wasted)
    assert main(["check", ALIASING, "--map", str(tmp_path / target)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert words in _one_error_line(captured.err)
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
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
    # safeview is on no package index: the hint names what works from a checkout or a path
    assert "pip install -e '.[plot]'" in result.stderr
    assert "pip install '/path/to/safeview[plot]'" in result.stderr
    assert "pip install 'safeview[" not in result.stderr
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
    assert json.loads(result.stdout)["plans"][0]["ok"] is True


def _plan_text(**view_changes: Any) -> str:
    plan = json.loads(Path(CLEAN).read_text())
    plan["views"][0].update(view_changes)
    return json.dumps(plan)


@pytest.mark.parametrize(
    ("args", "words"),
    [(["check", "missing.json"], "cannot read missing.json: No such file or directory"),
     (["check", "-"], "<stdin> is not a valid plan: (plan): Invalid JSON"),
     (["check", "plan.json"], "plan.json is not a valid plan: views.0.page_bytes:"),
     (["check"], "the following arguments are required: PLAN (see 'safeview check --help')"),
     (["check", "-q", "--json", "x"], "not allowed with argument"),
     (["check", "x", "--max-violations", "-1"], "expected a count (0 or more), got '-1'"),
     (["check", "-", "-"], "standard input ('-') can be read only once"),
     (["check", CLEAN, ALIASING, "--map", "m.png"], "--map draws one plan; 2 were given"),
     (["frobnicate"], "invalid choice: 'frobnicate'")],
)  # fmt: skip
def test_every_error_is_one_line_and_exit_2(args: list[str], words: str, tmp_path: Path) -> None:
    args = [str(tmp_path / a) if a == "plan.json" else a for a in args]
    (tmp_path / "plan.json").write_text(_plan_text(page_bytes=0))
    result = _safeview(*args, input="{not json")
    assert result.returncode == 2
    assert result.stdout == ""
    assert words in _one_error_line(result.stderr)


def test_dash_reads_the_plan_from_standard_input() -> None:
    result = _safeview("check", "-", input=Path(ALIASING).read_text())
    assert result.returncode == 1, result.stderr
    assert result.stdout.startswith("FAIL <stdin> (DeepSeek-V3.2")
    assert "'model.layers.6.self_attn' & 'model.layers.7.self_attn'" in result.stdout


@pytest.mark.parametrize(
    ("plans", "code", "tally"),
    [([CLEAN, GLM], 0, "2 plans: 2 clean"),
     ([CLEAN, ALIASING, GLM], 1, "3 plans: 2 clean, 1 with violations"),
     ([ALIASING, "missing.json", CLEAN], 2, "3 plans: 1 clean, 1 with violations, 1 unusable")],
)  # fmt: skip
def test_several_plans_each_get_a_section_and_the_worst_exit_code(
    plans: list[str], code: int, tally: str
) -> None:
    result = _safeview("check", *plans)
    assert result.returncode == code
    verdicts = [line for line in result.stdout.splitlines() if line.startswith(("OK ", "FAIL "))]
    checked = [plan for plan in plans if plan != "missing.json"]
    assert [verdict.split()[1] for verdict in verdicts] == checked
    assert result.stdout.splitlines()[-1] == tally
    assert ("missing.json" in plans) == ("cannot read missing.json" in result.stderr)


@pytest.mark.parametrize("output", ["-v", "--json"])
def test_a_closed_pipe_ends_quietly_with_the_checks_exit_code(output: str) -> None:
    # 20 clean plans of 101 views each: far more than a pipe holds, so writes meet the closed end
    command = [sys.executable, "-m", "safeview", "check", output, *[GLM] * 20]
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env()
    ) as process:
        assert process.stdout is not None
        assert process.stderr is not None
        assert process.stdout.readline()
        process.stdout.close()  # what `| head -1` does
        stderr = process.stderr.read().decode()
        assert process.wait(timeout=120) == 0
    assert stderr == ""


_SLOW = (
    "import sys, time\n"
    "from safeview.plan import Plan\n"
    "from safeview.cli import main\n"
    "records = Plan.records\n"
    "Plan.records = lambda self: (time.sleep(float(sys.argv[1])), records(self))[1]\n"
    "sys.exit(main(sys.argv[2:]))"
)


def _with_terminal_stderr(*args: str) -> tuple[int, str]:
    """Run the command with standard error on a pseudo-terminal: its exit code and what it wrote
    there."""
    primary, secondary = pty.openpty()
    process = subprocess.Popen(
        [sys.executable, "-c", _SLOW, *args], stdout=subprocess.DEVNULL, stderr=secondary,
        env=_env(),
    )  # fmt: skip
    os.close(secondary)
    written = b""
    while True:
        ready, _, _ = select.select([primary], [], [], 60)
        if not ready:
            break
        try:
            chunk = os.read(primary, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        written += chunk
    os.close(primary)
    return process.wait(timeout=60), written.decode()


@pytest.mark.slow
def test_a_slow_check_shows_progress_on_a_terminal() -> None:
    code, written = _with_terminal_stderr("1.6", "check", GLM)
    assert code == 0
    assert "safeview: checking 101 views of " + GLM + "..." in written
    assert written.endswith("\r\x1b[K")  # erased when done


def test_a_quick_check_shows_no_progress_on_a_terminal() -> None:
    assert _with_terminal_stderr("0", "check", GLM) == (0, "")


def test_no_progress_when_standard_error_is_not_a_terminal() -> None:
    result = _safeview("1.6", "check", GLM, code=_SLOW)
    assert result.returncode == 0
    assert result.stderr == ""


def test_a_bad_log_format_variable_is_one_line_and_exit_2() -> None:
    # set after safeview was imported: main() reads the variable again, and reports it
    code = (
        "import os, sys\n"
        "from safeview.cli import main\n"
        "os.environ['SAFEVIEW_LOG_FORMAT'] = 'bogus'\n"
        "sys.exit(main(sys.argv[1:]))"
    )
    result = _safeview("check", CLEAN, code=code)
    assert result.returncode == 2
    assert result.stdout == ""
    assert _one_error_line(result.stderr) == (
        "safeview: SAFEVIEW_LOG_FORMAT='bogus' is not a valid value; allowed values: json, console"
    )


def test_a_bad_log_format_variable_from_the_start_is_one_line_and_exit_2() -> None:
    result = _safeview("check", CLEAN, env=_env(SAFEVIEW_LOG_FORMAT="bogus"))
    assert result.returncode == 2
    assert "SAFEVIEW_LOG_FORMAT='bogus'" in _one_error_line(result.stderr)
    script = Path(sys.executable).parent / "safeview"  # the console script, the same way
    installed = subprocess.run(
        [str(script), "check", CLEAN],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(SAFEVIEW_LOG_FORMAT="bogus"),
    )
    assert installed.returncode == 2
    assert "SAFEVIEW_LOG_FORMAT='bogus'" in _one_error_line(installed.stderr)


def test_duplicate_keys_are_refused_with_their_location(tmp_path: Path) -> None:
    text = _plan_text(num_blocks=10).replace(
        '"num_blocks": 10', '"num_blocks": "x", "num_blocks": 4'
    )
    assert '"num_blocks": "x", "num_blocks": 4' in text
    (tmp_path / "plan.json").write_text(text)
    result = _safeview("check", str(tmp_path / "plan.json"))
    assert result.returncode == 2
    assert _one_error_line(result.stderr) == (
        f"safeview: {tmp_path / 'plan.json'} is not a valid plan: views.0.num_blocks: "
        "key 'num_blocks' appears more than once (got 4)"
    )


@pytest.mark.parametrize(
    ("change", "where"),
    [({"pages": 3}, "views.0.pages: unknown key 'pages'; did you mean 'page_bytes'?"),
     ({"num_blocks": -1}, "views.0.num_blocks: Input should be greater than or equal to 0")],
)  # fmt: skip
def test_what_the_schema_refuses_check_refuses(
    change: dict[str, Any], where: str, tmp_path: Path
) -> None:
    text = _plan_text(**change)
    jsonschema: Any = __import__("jsonschema")  # untyped; the `test` extra installs it
    validator = jsonschema.Draft202012Validator(Plan.model_json_schema())
    assert not validator.is_valid(json.loads(text))
    (tmp_path / "plan.json").write_text(text)
    result = _safeview("check", str(tmp_path / "plan.json"))
    assert result.returncode == 2
    assert where in _one_error_line(result.stderr)


# -- every entry form, every subcommand: a bad SAFEVIEW_* variable is one line and exit 2 ----------

_BAD_FORMAT = (
    "safeview: SAFEVIEW_LOG_FORMAT='bogus' is not a valid value; allowed values: json, console"
)


@pytest.mark.parametrize(
    "entry",
    [["-m", "safeview"], ["-X", "importtime", "-m", "safeview"], ["-u", "-m", "safeview"],
     ["-um", "safeview"], ["-W", "ignore", "-msafeview"], ["script"]],
    ids=["-m", "-X importtime -m", "-u -m", "-um", "-W ignore -msafeview", "console script"],
)  # fmt: skip
def test_a_bad_log_format_is_one_line_and_exit_2_in_every_entry_form(entry: list[str]) -> None:
    # the variable is read when safeview is imported, before the command runs
    if entry == ["script"]:
        command = [str(Path(sys.executable).parent / "safeview")]
    else:
        command = [sys.executable, *entry]
    result = subprocess.run(
        [*command, "check", CLEAN], capture_output=True, text=True, timeout=120,
        env=_env(SAFEVIEW_LOG_FORMAT="bogus"),
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stdout == ""
    errors = [line for line in result.stderr.splitlines() if not line.startswith("import time:")]
    assert _one_error_line("\n".join(errors)) == _BAD_FORMAT


@pytest.mark.parametrize(
    ("variable", "value", "allowed"),
    [("SAFEVIEW_BOUNDS_POLICY", "lax", "strict, warn, off"),
     ("SAFEVIEW_LOG_FORMAT", "bogus", "json, console"),
     ("SAFEVIEW_LOG_LEVEL", "loud", "debug, info, warning, error, critical")],
)  # fmt: skip
@pytest.mark.parametrize("args", [["check", CLEAN], ["check", "--json", CLEAN], ["schema"]])
def test_a_bad_safeview_variable_exits_2_from_every_subcommand(
    variable: str, value: str, allowed: str, args: list[str], monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    monkeypatch.setenv(variable, value)
    assert main(args) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert _one_error_line(captured.err) == (
        f"safeview: {variable}={value!r} is not a valid value; allowed values: {allowed}"
    )


def test_the_policy_variable_exits_2_through_the_console_script() -> None:
    script = Path(sys.executable).parent / "safeview"
    result = subprocess.run(
        [str(script), "check", CLEAN], capture_output=True, text=True, timeout=120,
        env=_env(SAFEVIEW_BOUNDS_POLICY="lax"),
    )  # fmt: skip
    assert result.returncode == 2
    assert "SAFEVIEW_BOUNDS_POLICY='lax'" in _one_error_line(result.stderr)


# -- the console entry point pauses the collector for its own process; main() never does --------


def test_the_console_script_runs_command_which_pauses_the_collector() -> None:
    tomllib: Any = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"] == {"safeview": "safeview.cli:command"}
    code = (
        "import atexit, gc, sys\n"
        "atexit.register(lambda: print('collector on:', gc.isenabled(), file=sys.stderr))\n"
        "from safeview.cli import command\n"
        "sys.argv = ['safeview', 'schema']\n"
        "command()"
    )
    result = _safeview(code=code)
    assert result.returncode == 0
    assert result.stderr == "collector on: False\n"


def test_main_leaves_the_collector_of_its_caller_alone() -> None:
    assert gc.isenabled()
    assert main(["check", CLEAN, "-q"]) == 0
    assert gc.isenabled()
    gc.disable()
    try:
        assert main(["check", CLEAN, "-q"]) == 0
        assert not gc.isenabled()
    finally:
        gc.enable()


# -- a plan that cannot be checked: an error for it, the others still checked --------------------


def _interleaved(path: Path, per_stride: int) -> str:
    """A plan of ``2 * per_stride`` views of two block strides that do not divide one another,
    interleaved over the same bytes and sharing none (even bytes and odd bytes): only the exact
    pair test can tell, one pair at a time."""
    views = [
        {"name": f"{side}{i}", "storage": "kv", "num_blocks": 100, "page_bytes": 1,
         "block_stride_bytes": 2 * per_stride + 2 * odd, "byte_offset": 2 * i + odd}
        for odd, side in ((0, "even"), (1, "odd")) for i in range(per_stride)
    ]  # fmt: skip
    plan = {"storages": [{"name": "kv", "nbytes": 300 * per_stride}], "views": views}
    path.write_text(json.dumps(plan))
    return str(path)


def test_a_plan_past_the_exact_test_limit_is_an_error_and_the_others_are_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # the documented limit, lowered so that a small plan reaches it: 60 x 60 pairs to test
    monkeypatch.setattr(overlap, "MAX_EXACT_TESTS", 1_000)
    heavy = _interleaved(tmp_path / "heavy.json", 60)
    assert main(["check", "--json", heavy, ALIASING, CLEAN]) == 2
    captured = capsys.readouterr()
    document = json.loads(captured.out)
    assert (document["exit_code"], document["status"]) == (2, ["error", "overlap"])
    failed, aliasing, clean = document["plans"]
    assert (failed["plan"], failed["status"], failed["ok"]) == (heavy, ["error"], False)
    assert failed["error"].startswith(f"{heavy} could not be checked: views ")
    assert "more than 1,000 tests, the limit" in failed["error"]
    assert [detail["loc"] for detail in failed["details"]] == ["(plan)"]
    assert "the limit" in failed["details"][0]["message"]
    assert (aliasing["status"], clean["status"]) == (["overlap"], ["clean"])
    assert _one_error_line(captured.err).startswith(f"safeview: {heavy} could not be checked")
    # the same in text: an error line, and the other plans' sections and the tally
    assert main(["check", heavy, ALIASING, CLEAN]) == 2
    captured = capsys.readouterr()
    assert _one_error_line(captured.err).startswith(f"safeview: {heavy} could not be checked")
    verdicts = [line.split()[1] for line in captured.out.splitlines() if line[:3] in ("OK ", "FAI")]
    assert verdicts == [ALIASING, CLEAN]
    assert captured.out.splitlines()[-1] == "3 plans: 1 clean, 1 with violations, 1 unusable"


def test_json_is_one_document_whatever_fails(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text("{not json")
    result = _safeview(
        "check", "--json", str(tmp_path / "bad.json"), str(tmp_path / "missing.json"),
        str(tmp_path), CLEAN, "--max-violations", "1",
    )  # fmt: skip
    document = json.loads(result.stdout)  # one document, nothing else on standard output
    assert result.returncode == 2 == document["exit_code"]
    assert [plan["status"] for plan in document["plans"]] == [["error"]] * 3 + [["clean"]]
    assert len(result.stderr.splitlines()) == 3


# -- the picture: any valid plan, drawn in time proportional to what it draws --------------------


def _plan_file(path: Path, storages: list[dict[str, Any]], views: list[dict[str, Any]]) -> str:
    path.write_text(json.dumps({"storages": storages, "views": views}))
    return str(path)


@pytest.mark.slow
def test_map_of_a_view_ending_past_2_64_is_drawn(tmp_path: Path) -> None:
    top = 2**63 - 1
    plan = _plan_file(tmp_path / "plan.json", [{"name": "kv", "nbytes": top}], [
        {"name": "a", "storage": "kv", "num_blocks": top, "page_bytes": 8, "block_stride_bytes": 8}
    ])  # fmt: skip
    result = _safeview("check", plan, "--map", str(tmp_path / "map.png"), "--json")
    assert result.returncode == 1, result.stderr
    assert result.stderr == ""
    document = json.loads(result.stdout)
    assert document["map"] == {"path": str(tmp_path / "map.png"), "written": True}
    [view] = document["plans"][0]["views"]
    assert view["extent_bytes"] == top * 8 > 2**64
    assert (tmp_path / "map.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_map_of_one_view_of_a_billion_times_too_many_blocks_takes_seconds(tmp_path: Path) -> None:
    plan = _plan_file(tmp_path / "plan.json", [{"name": "kv", "nbytes": 42_072 * 3_098_112}], [
        {"name": "model.layers.0.self_attn", "storage": "kv", "num_blocks": 42_072 * 10**9,
         "page_bytes": 36_864, "block_stride_bytes": 3_098_112}
    ])  # fmt: skip
    started = time.perf_counter()
    result = _safeview("check", plan, "--map", str(tmp_path / "map.png"))
    assert result.returncode == 1, result.stderr
    assert time.perf_counter() - started < 60  # a block at a time: years
    assert (
        "1 view past the end of its storage by 130,343,767,933,653,170,688 bytes" in result.stdout
    )


def test_json_says_when_the_map_could_not_be_drawn(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text("{not json")
    result = _safeview("check", str(tmp_path / "bad.json"), "--json", "--map",
                       str(tmp_path / "map.png"))  # fmt: skip
    document = json.loads(result.stdout)
    assert document["map"] == {
        "path": str(tmp_path / "map.png"),
        "written": False,
        "error": "the plan could not be checked",
    }
    assert not (tmp_path / "map.png").exists()


# -- file names, folders ---------------------------------------------------------------------------


def test_a_file_name_with_a_newline_gives_one_line_everywhere(tmp_path: Path) -> None:
    odd = tmp_path / "a\nb.json"
    shutil.copy(CLEAN, odd)
    missing = tmp_path / "c\rd.json"
    result = _safeview("check", str(odd), str(missing))
    assert result.returncode == 2
    assert _one_error_line(result.stderr) == (
        f"safeview: cannot read {tmp_path}/c\\rd.json: No such file or directory"
    )
    assert result.stdout.splitlines()[0].startswith(f"OK {tmp_path}/a\\nb.json (vLLM unit-test")
    result = _safeview("check", "--json", str(odd))
    assert json.loads(result.stdout)["plans"][0]["plan"] == str(odd)  # JSON keeps the real name


def test_a_folder_checks_every_json_file_in_it_in_name_order(tmp_path: Path) -> None:
    for name, source in (("b.json", ALIASING), ("a.json", CLEAN), ("c.json.txt", ALIASING),
                         ("B.json", CLEAN)):  # fmt: skip
        shutil.copy(source, tmp_path / name)
    (tmp_path / "d.json").mkdir()  # a folder, whatever its name: not a plan
    result = _safeview("check", str(tmp_path), "--json")
    assert result.returncode == 1, result.stderr
    names = [Path(plan["plan"]).name for plan in json.loads(result.stdout)["plans"]]
    assert names == ["B.json", "a.json", "b.json"]


def test_the_examples_folder_is_checked_plan_by_plan() -> None:
    result = _safeview("check", str(PLANS))
    assert result.returncode == 1
    verdicts = [
        line.split()[:2] for line in result.stdout.splitlines() if line[:3] in ("OK ", "FAI")
    ]
    assert [Path(name).name for _, name in verdicts] == sorted(p.name for p in PLANS.glob("*.json"))
    assert result.stdout.splitlines()[-1] == "7 plans: 4 clean, 3 with violations"


def test_a_folder_without_plans_is_an_error(tmp_path: Path) -> None:
    result = _safeview("check", str(tmp_path), CLEAN)
    assert result.returncode == 2
    assert _one_error_line(result.stderr) == f"safeview: folder {tmp_path} holds no *.json file"
    # named on standard output too, where the other plans' sections and the tally are
    assert result.stdout.startswith(
        f"ERROR {tmp_path}\n  folder {tmp_path} holds no *.json file\n\nOK {CLEAN}"
    )


def test_a_folder_names_its_unreadable_plan_on_standard_output(tmp_path: Path) -> None:
    shutil.copy(CLEAN, tmp_path / "a.json")
    (tmp_path / "b.json").write_text("{not json")
    result = _safeview("check", str(tmp_path))
    assert result.returncode == 2
    bad = str(tmp_path / "b.json")
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"OK {tmp_path / 'a.json'} (vLLM unit-test layout")
    assert f"ERROR {bad}" in lines
    assert lines[lines.index(f"ERROR {bad}") + 1].startswith(f"  {bad} is not a valid plan:")
    assert lines[-1] == "2 plans: 1 clean, 1 unusable"


def test_json_prints_one_document_when_the_map_target_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "missing" / "x.png"
    result = _safeview("check", "--json", ALIASING, "--map", str(target))
    assert result.returncode == 2
    document = json.loads(result.stdout)
    why = f"--map {target}: folder {str(target.parent)!r} does not exist"
    assert document["map"] == {"path": str(target), "written": False, "error": why}
    assert (document["exit_code"], document["status"], document["plans"]) == (2, ["error"], [])
    assert document["error"] == why
    assert _one_error_line(result.stderr) == f"safeview: {why}"


@pytest.mark.slow
def test_json_prints_one_document_when_standard_input_is_named_twice() -> None:
    result = _safeview("check", "--json", "-", "-", input="{}")
    assert result.returncode == 2
    document = json.loads(result.stdout)
    assert document["error"] == "standard input ('-') can be read only once"
    assert "map" not in document


def test_json_details_keep_integers_as_integers(tmp_path: Path) -> None:
    (tmp_path / "plan.json").write_text(_plan_text(page_bytes=0))
    result = _safeview("check", "--json", str(tmp_path / "plan.json"))
    [plan] = json.loads(result.stdout)["plans"]
    [detail] = plan["details"]
    assert (detail["loc"], detail["input"]) == ("views.0.page_bytes", 0)


@pytest.mark.parametrize("variable", ["SAFEVIEW_BOUNDS_POLICY", "SAFEVIEW_LOG_LEVEL"])
@pytest.mark.parametrize("value", ["", "  "])
def test_a_safeview_variable_set_to_nothing_is_unset(variable: str, value: str) -> None:
    result = _safeview("check", CLEAN, env=_env(**{variable: value, "SAFEVIEW_LOG_FORMAT": ""}))
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""


def test_map_counts_the_plans_of_a_folder(tmp_path: Path) -> None:
    shutil.copy(CLEAN, tmp_path / "only.json")
    assert main(["check", str(tmp_path), "--map", str(tmp_path / "m.png"), "-q"]) == 0
    assert (tmp_path / "m.png").exists()
    shutil.copy(CLEAN, tmp_path / "other.json")
    result = _safeview("check", str(tmp_path), "--map", str(tmp_path / "m.png"))
    assert result.returncode == 2
    assert "--map draws one plan; 2 were given" in _one_error_line(result.stderr)


# -- the JSON document, version 2; words and numbers -----------------------------------------------


def test_json_view_status_is_a_list_of_kinds(tmp_path: Path) -> None:
    plan = json.loads(Path(CLEAN).read_text())
    plan["views"][1]["num_blocks"] = 11  # past its region, and onto layer 2
    plan["views"][1]["group"] = plan["views"][2]["group"] = 0
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    result = _safeview("check", "--json", str(tmp_path / "plan.json"))
    document = json.loads(result.stdout)
    assert document["schema_version"] == 2
    [report] = document["plans"]
    assert [view["status"] for view in report["views"]] == [
        ["ok"], ["out_of_region", "overlap"], ["overlap"]
    ]  # fmt: skip
    assert report["status"] == document["status"] == ["out_of_region", "overlap"]


@pytest.mark.parametrize(
    ("change", "line"),
    [({"num_blocks": 11}, "  out_of_region  1 view outside its region by 16,384 bytes: 'layers.0'"),
     ({"byte_offset": 327_681, "region": [327_681, 491_521]},
      "  out_of_bounds  1 view past the end of its storage by 1 byte: 'layers.0'")],
)  # fmt: skip
def test_one_of_a_thing_is_said_in_the_singular(
    change: dict[str, Any], line: str, tmp_path: Path
) -> None:
    plan = json.loads(Path(CLEAN).read_text())
    plan["views"][0].update(change)
    plan["views"] = plan["views"][:1]
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    result = _safeview("check", str(tmp_path / "plan.json"))
    lines = result.stdout.splitlines()
    assert lines[1:] == [line, f"1 violation (1 {line.split()[0]}) in 1 view over 1 storage."]


def test_an_unknown_key_is_reported_first_with_the_key_meant(tmp_path: Path) -> None:
    plan = json.loads(Path(CLEAN).read_text())
    plan["views"][0]["block_stride"] = plan["views"][0].pop("block_stride_bytes")
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    result = _safeview("check", str(tmp_path / "plan.json"), "--json")
    assert _one_error_line(result.stderr) == (
        f"safeview: {tmp_path / 'plan.json'} is not a valid plan: views.0.block_stride: unknown "
        "key 'block_stride'; did you mean 'block_stride_bytes'? (got 16384); 1 more at "
        "views.0.block_stride_bytes"
    )
    details = json.loads(result.stdout)["plans"][0]["details"]
    assert [detail["loc"] for detail in details] == [
        "views.0.block_stride", "views.0.block_stride_bytes"
    ]  # fmt: skip


def test_a_plan_with_a_schema_key_is_checked(tmp_path: Path) -> None:
    plan = json.loads(Path(CLEAN).read_text())
    assert plan["$schema"] == PLAN_SCHEMA  # the shipped plans name it
    plan["$schema"] = "./plan.schema.json"  # any other pointer an editor may want
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    assert _safeview("check", "-q", str(tmp_path / "plan.json")).returncode == 0


def test_the_schema_printed_is_the_one_plans_name() -> None:
    schema = json.loads(_safeview("schema").stdout)
    assert schema["$id"] == PLAN_SCHEMA == json.loads(Path(ALIASING).read_text())["$schema"]


def test_an_empty_log_level_with_a_log_format_is_the_default_level() -> None:
    result = _safeview("check", CLEAN, env=_env(SAFEVIEW_LOG_FORMAT="json", SAFEVIEW_LOG_LEVEL=""))
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""


def test_run_help_says_the_default_policy_is_strict_and_it_is() -> None:
    """``safeview run --help`` names the default policy, and the default is what it says: the
    command runs with ``SAFEVIEW_GUARD=strict``."""
    result = _safeview("run", "--help")
    assert result.returncode == 0, result.stderr
    options = result.stdout.split("options:", 1)[1]
    policy = " ".join(options.split("--policy {strict,warn}", 1)[1].split())
    assert policy.startswith("strict (the default): a bad call raises BoundsError"), policy
    assert "Under strict (the default)" in " ".join(result.stdout.split())
    shown = "import os; print(os.environ['SAFEVIEW_GUARD'])"
    ran = _safeview("run", "--", sys.executable, "-c", shown)
    assert (ran.returncode, ran.stdout) == (0, "strict\n"), ran.stderr
