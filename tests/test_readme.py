"""The README and docs/ stay true: every Python block runs as written, the event table names every
key emitted, the commands shown print what is shown, the shipped plans are judged as their table
says, every SAFEVIEW_* variable is documented, and every link between the pages resolves."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import safeview
from safeview import BlockLayout, BoundsError, Plan, Region, StridedLayout, make_view
from safeview.guard.sanitize import Sanitizer
from safeview.kv import block_views
from safeview.testing import capture_events
from safeview.transfer import check_descriptors
from safeview.vllm import register_plugin

ROOT = Path(__file__).parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
ALWAYS = {"event", "level", "timestamp", "logger"}
# What a fenced block may be tagged; only ``python`` blocks are run.
LANGUAGES = {"python", "sh", "text", "json"}
FENCE = re.compile(r"^```(\S*)\n(.*?)^```$", re.M | re.S)


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _blocks(path: Path, language: str) -> list[tuple[int, str]]:
    """The fenced blocks of one language in a page: (line of the opening fence, code)."""
    text = _read(path)
    return [
        (text.count("\n", 0, match.start()) + 1, match.group(2))
        for match in FENCE.finditer(text)
        if match.group(1) == language
    ]


def _sh_lines(path: Path) -> list[str]:
    """Every line of every ``sh`` block of a page."""
    return [line for _, code in _blocks(path, "sh") for line in code.splitlines()]


def _section(text: str, title: str) -> str:
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def _table(text: str) -> list[list[str]]:
    """The cells of the first Markdown table in ``text`` (the first run of lines that start with
    "|"), header and separator left out."""
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[first + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def _clean_env() -> dict[str, str]:
    """This environment without any SAFEVIEW_* variable, as a reader's shell would have it."""
    return {k: v for k, v in os.environ.items() if not k.startswith("SAFEVIEW_")}


# -- every Python block runs as written ------------------------------------------------------------

# Each block runs in a fresh namespace, in a process of its own page, from the repository root;
# a traceback points at the page and the line of the block.
_RUNNER = """
import json, sys, traceback
for path, line, code in json.load(sys.stdin):
    try:
        exec(compile("\\n" * line + code, path, "exec"), {"__name__": "__main__"})
    except BaseException:
        print(f"{path}, the block at line {line}:\\n{traceback.format_exc()}", file=sys.stderr)
        sys.exit(1)
"""


def test_every_page_has_python_blocks_to_run() -> None:
    assert {page.name for page in PAGES if _blocks(page, "python")} >= {
        "README.md",
        "api.md",
        "errors.md",
        "events.md",
        "policies.md",
    }


@pytest.mark.parametrize(
    "page",
    [
        # the README's blocks in the quick run; each docs page starts its own interpreters
        pytest.param(page, marks=() if page.name == "README.md" else pytest.mark.slow)
        for page in PAGES
        if _blocks(page, "python")
    ],
    ids=lambda page: page.name,
)
def test_every_python_block_runs_as_written(page: Path) -> None:
    blocks = [(str(page.relative_to(ROOT)), line, code) for line, code in _blocks(page, "python")]
    before = set(os.listdir(ROOT))
    result = subprocess.run(
        [sys.executable, "-c", _RUNNER],
        input=json.dumps(blocks),
        cwd=ROOT,
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    # a block writes what it makes to a temporary folder, never into the reader's checkout
    assert set(os.listdir(ROOT)) - before == set()


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_fenced_block_names_a_known_language(page: Path) -> None:
    # an untagged or "py" block would escape the run above
    tags = [match.group(1) for match in FENCE.finditer(_read(page))]
    assert set(tags) <= LANGUAGES, tags
    assert _read(page).count("```") == 2 * len(tags)  # every fence is closed, none is nested


# -- the event table is the contract ---------------------------------------------------------------


def _documented_keys() -> dict[str, set[str]]:
    """Event name -> the keys the table in docs/events.md lists for it."""
    keys = {}
    for cells in _table(_read(DOCS / "events.md")):
        if len(cells) == 3 and cells[0].startswith("`"):
            keys[cells[0].strip("`")] = set(re.findall(r"`([a-z_]+)`", cells[2]))
    return keys


class _FailingEngine:
    """An engine with Mooncake's methods that fails what it is asked (return codes)."""

    def register_memory(self, buffer_addr: int, capacity: int) -> int:
        return -1

    def transfer_sync_read(self, target: str, buffer: int, peer: int, length: int) -> int:
        return -1

    def transfer_sync_write(self, target: str, buffer: int, peer: int, length: int) -> int:
        return 0

    unregister_memory = batch_transfer_sync_write = batch_transfer_sync_read = register_memory


def _engine_failures(registration: Any, address: int) -> None:
    """``coverage_violation`` (nothing prepared), ``registration_failed``, ``transfer_failed``
    and ``failure_ignored`` (a write of bytes whose read failed), under warn."""
    from safeview.transfer import mooncake
    from safeview.transfer.coverage import check_coverage

    check_coverage([], registration, policy="warn")
    engine = mooncake.guard(_FailingEngine(), registration, policy="warn")
    engine.register_memory(address, 64)
    engine.transfer_sync_read("peer", address, 0, 32)
    engine.transfer_sync_write("peer", address, 0, 32)


def _emitted(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    kv = torch.zeros(128, dtype=torch.int8)
    meta = torch.empty(64, dtype=torch.int8, device="meta")
    block = BlockLayout(num_blocks=3, page_bytes=16, block_stride_bytes=32, byte_offset=8)
    with capture_events() as events:
        make_view(kv, block, name="a", region=(0, 128))
        make_view(kv, StridedLayout(shape=(2, 3), strides=(4, 1), dtype="float16"))
        make_view(meta, block.model_copy(update={"num_blocks": 4}), policy="warn", region=(0, 8))
        with pytest.raises(BoundsError):
            make_view(meta, block.model_copy(update={"num_blocks": 4}))
        raw = torch.zeros(4 * 64, dtype=torch.int8)
        caches = {
            "x": torch.as_strided(raw, (4, 32), (64, 1), 0),
            "y": torch.as_strided(raw, (4, 32), (64, 1), 16),
        }
        registration = block_views(
            caches, {"x": 32, "y": 32}, num_blocks=4, packed=caches, policy="warn"
        )
        address = raw.untyped_storage().data_ptr()
        check_descriptors([(address + 8, 32)], registration, policy="warn")  # across two pages
        _engine_failures(registration, address)  # coverage and failures the engine reports
        with safeview.sanitize(policy="warn"):  # a view past the end, seen at the dispatcher
            torch.as_strided(meta, (5, 16), (16, 1))
            torch.as_strided(meta.view(torch.float16), (4, 9), (8, 1))
        shared = torch.zeros(8)  # an out= whose size cannot be worked out: unproven_write
        with safeview.sanitize(policy="warn"), pytest.raises(RuntimeError):
            torch.nonzero(torch.ones(4), out=shared[:2])  # float32 where nonzero writes int64
        register_plugin()  # without vLLM installed here: integration_unavailable
        with monkeypatch.context() as patch:  # a failure of safeview's own inside the guard

            def broken(self: object, op: object) -> None:
                raise RuntimeError("boom")

            patch.setattr(Sanitizer, "_judge", broken)
            with safeview.sanitize():
                torch.as_strided(meta, (2, 2), (2, 1))
        _process_guard(kv)  # started, a raw view past the end under warn, stopped
        _digests_compared()  # agree, not judged, and a mismatch under warn
    return events


def _digests_compared() -> None:
    from safeview.manifest.digest import Digest, judge, not_judged

    sent = Digest(16, {"layers.0": {0: 1, 1: 2}})
    changed = Digest(16, {"layers.0": {0: 1, 1: 3}})
    for request, received in (("r1", sent), ("r2", changed)):
        judge(sent, received, policy="warn", request=request, engine="D", tp_rank=0, tp_size=1,
              remote_engine="P", remote_tp_size=1)  # fmt: skip
    not_judged("P's digests did not come", policy="warn", request="r3", engine="D", tp_rank=0,
               tp_size=1, remote_engine="P", remote_tp_size=1)  # fmt: skip


def _process_guard(kv: torch.Tensor) -> None:
    import ctypes

    from safeview.guard import process

    process.start("warn")
    try:
        torch.as_strided(kv, (128,), (1,))  # kv's storage: known memory
        torch.frombuffer((ctypes.c_uint8 * 160).from_address(kv.data_ptr()), dtype=torch.uint8)
    finally:
        process.stop()
        process._memory.clear()


# Emitted only where vLLM is installed; tests/test_vllm.py and tests/test_vllm_layout.py check
# their keys against this table.
NEEDS_VLLM = {
    "integration_installed", "layout_checked", "layout_mismatch", "canonical_mismatch",
    "layout_judged", "kv_not_received", "kv_not_read",
}  # fmt: skip


def test_event_table_documents_every_key_that_is_emitted(monkeypatch: pytest.MonkeyPatch) -> None:
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("here vLLM is installed: integration_unavailable cannot be provoked")
    documented = _documented_keys()
    assert set(documented) == {
        "view_created",
        "bounds_violation",
        "overlap_violation",
        "unproven_write",
        "address_violation",
        "coverage_violation",
        "canonical_mismatch",
        "registration_failed",
        "transfer_failed",
        "failure_ignored",
        "registration_checked",
        "layout_checked",
        "layout_mismatch",
        "digest_checked",
        "digest_mismatch",
        "layout_judged",
        "kv_not_received",
        "kv_not_read",
        "integration_installed",
        "integration_unavailable",
        "internal_error",
        "process_guard_started",
        "process_guard_stopped",
    }
    # bounds_violation has "the keys of view_created" plus its own
    documented["bounds_violation"] |= documented["view_created"]
    documented["digest_mismatch"] |= documented["digest_checked"]
    events = _emitted(monkeypatch)
    assert {event["event"] for event in events} == set(documented) - NEEDS_VLLM
    for event in events:
        undocumented = set(event) - documented[event["event"]] - ALWAYS
        assert not undocumented, (event["event"], undocumented)


def test_the_json_event_shown_has_only_documented_keys() -> None:
    [(_, shown)] = _blocks(DOCS / "events.md", "json")
    event = json.loads(shown)
    documented = _documented_keys()
    keys = documented[event["event"]] | documented["view_created"] | ALWAYS
    assert set(event) <= keys, set(event) - keys


# -- the commands shown ----------------------------------------------------------------------------

TEST_COMMAND = 'pip install -e ".[test]" && python -m pytest'


def test_the_readme_test_command_is_one_line_and_the_one_ci_runs() -> None:
    assert _sh_lines(README).count(TEST_COMMAND) == 1
    assert TEST_COMMAND in _read(ROOT / ".ci" / "run")


def test_the_readme_installs_a_cpu_torch_from_pytorchs_own_index() -> None:
    [line] = [line for line in _sh_lines(README) if line.startswith("pip install torch")]
    assert "--index-url https://download.pytorch.org/whl/cpu" in line
    version = re.search(r"torch==([\d.]+)", line)
    assert version is not None
    # the pinned CPU build satisfies the range the project declares
    assert 'torch>=2.13"' in _read(ROOT / "pyproject.toml")
    assert tuple(int(part) for part in version.group(1).split(".")) >= (2, 13)


def test_the_readme_main_command_prints_what_the_readme_shows(tmp_path: Path) -> None:
    install = _section(_read(README), "Install")
    main = 'pip install -e ".[plot]" && safeview check'
    [main] = [line for line in _sh_lines(README) if line.startswith(main)]
    arguments = main.split(" && safeview ", 1)[1].split()
    (tmp_path / "examples").symlink_to(ROOT / "examples")  # run as written, from a checkout
    result = subprocess.run(
        [sys.executable, "-m", "safeview", *arguments],
        cwd=tmp_path,
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1  # "It exits 1 because it found a violation"
    [shown] = re.findall(r"```text\n(.*?)```", install, re.S)
    assert result.stdout == shown
    assert (tmp_path / arguments[-1]).stat().st_size > 0


def test_the_readme_stays_short_and_says_how_long_its_test_command_takes() -> None:
    # the reference lives in docs/: the README is read whole, before anything else
    assert len(README.read_bytes()) < 12_000
    # a newcomer is told what the plain run costs and how to run everything
    text = _read(README)
    assert re.search(r"The\s+run\s+takes\s+about\s+\d+\s+minutes\s+on\s+2\s+cores", text)
    assert "python -m pytest --slow" in text


def test_the_readme_names_the_version_command_and_the_changelog() -> None:
    readme = _read(README)
    assert "`safeview --version`" in readme
    assert "(CHANGELOG.md)" in readme
    result = subprocess.run(
        [sys.executable, "-m", "safeview", "--version"],
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.stdout.strip() == f"safeview {safeview.__version__}"
    assert f"\n## {safeview.__version__}" in _read(ROOT / "CHANGELOG.md")


# -- the plan reference ----------------------------------------------------------------------------


def test_the_shipped_plans_table_is_what_safeview_check_says() -> None:
    rows = _table(_section(_read(DOCS / "command.md"), "The shipped plans"))
    expected = {}
    for name, _, verdict in rows:
        kinds = re.findall(r"`([a-z_]+)`", verdict)
        expected[f"examples/plans/{name.strip('`')}"] = kinds or [verdict.split()[0]]
    shipped = {str(path.relative_to(ROOT)) for path in (ROOT / "examples" / "plans").glob("*.json")}
    assert set(expected) == shipped  # the table lists every shipped plan, and no other
    result = subprocess.run(
        [sys.executable, "-m", "safeview", "check", "--json", *sorted(expected)],
        cwd=ROOT,
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1, result.stderr
    found = {plan["plan"]: plan["status"] for plan in json.loads(result.stdout)["plans"]}
    assert found == expected


@pytest.mark.slow
def test_every_key_of_the_json_document_is_described(tmp_path: Path) -> None:
    section = _section(_read(DOCS / "command.md"), "`--json`")
    version = re.search(r'"schema_version": (\d+)', section)
    assert version is not None
    plan = "examples/plans/broken_aliasing.json"
    result = subprocess.run(
        [sys.executable, "-m", "safeview", "check", "--json", plan, "--map", tmp_path / "m.png"],
        cwd=ROOT,
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    document = json.loads(result.stdout)
    assert document["schema_version"] == int(version.group(1))
    [checked] = document["plans"]
    statuses = {row["name"]: row["status"] for row in checked["views"]}
    assert statuses["model.layers.7.self_attn"] == ["overlap"]
    assert statuses["model.layers.0.self_attn"] == ["ok"]
    printed = set(document) | set(checked) | set(checked["views"][0]) | set(document["map"])
    # a key is described as `key` in the text or as "key" inside a JSON fragment
    words = re.findall(r"`([a-z_]+)`|\"([a-z_]+)\"", section)
    described = {word for pair in words for word in pair if word}
    assert printed <= described, printed - described


def test_the_plan_shown_validates_against_the_published_schema() -> None:
    jsonschema = importlib.import_module("jsonschema")  # untyped; the `test` extra installs it
    [(_, shown)] = _blocks(DOCS / "command.md", "json")
    example = json.loads(shown)
    jsonschema.Draft202012Validator(Plan.model_json_schema()).validate(example)
    assert Plan.model_validate(example).views[0].region == Region(start_byte=0, end_byte=163840)


def test_every_safeview_variable_the_code_reads_is_documented() -> None:
    read = set()
    for source in (ROOT / "safeview").rglob("*.py"):
        read |= set(re.findall(r"\"(SAFEVIEW_[A-Z_]+)\"", _read(source)))
    rows = _table(_section(_read(DOCS / "policies.md"), "Environment variables"))
    documented = {cells[0].strip("`") for cells in rows}
    assert read >= {"SAFEVIEW_BOUNDS_POLICY", "SAFEVIEW_LOG_FORMAT", "SAFEVIEW_VLLM"}
    assert read <= documented, read - documented


# -- links -----------------------------------------------------------------------------------------


def _anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, blanks as -."""
    headings = re.findall(r"^#+ (.+)$", re.sub(FENCE, "", _read(path)), re.M)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_link_to_a_file_or_heading_resolves(page: Path) -> None:
    text = re.sub(FENCE, "", _read(page))
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    for link in links:
        if re.match(r"[a-z]+://", link):
            continue
        target, _, anchor = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        assert path.exists(), f"{page.name}: {link}"
        if anchor:
            assert anchor in _anchors(path), f"{page.name}: {link}"
