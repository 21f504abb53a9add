"""The README stays true: its API tour runs, and its event table names every key emitted."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import safeview
from safeview import BlockLayout, BoundsError, StridedLayout, make_view
from safeview.kv import block_views
from safeview.sanitize import Sanitizer
from safeview.testing import capture_events
from safeview.vllm import register_plugin

README = (Path(__file__).parent.parent / "README.md").read_text()
ALWAYS = {"event", "level", "timestamp", "logger"}


def _section(title: str) -> str:
    start = README.index(f"## {title}")
    end = README.find("\n## ", start + 1)
    return README[start:end]


def test_api_tour_runs() -> None:
    [code] = re.findall(r"```python\n(.*?)```", _section("API tour"), re.S)
    exec(compile(code, "README.md", "exec"), {})


def _documented_keys() -> dict[str, set[str]]:
    # the table is the first run of lines that start with "|" (a blank line would end it)
    lines = _section("Log events").splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("|"))
    table = []
    for line in lines[first:]:
        if not line.startswith("|"):
            break
        table.append(line)
    keys = {}
    for line in table:
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`"):
            keys[cells[0].strip("`")] = set(re.findall(r"`([a-z_]+)`", cells[2]))
    return keys


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
        block_views(caches, {"x": 32, "y": 32}, num_blocks=4, packed=caches, policy="warn")
        with safeview.sanitize(policy="warn"):  # a view past the end, seen at the dispatcher
            torch.as_strided(meta, (5, 16), (16, 1))
            torch.as_strided(meta.view(torch.float16), (4, 9), (8, 1))
        register_plugin()  # without vLLM installed here: integration_unavailable
        with monkeypatch.context() as patch:  # a failure of safeview's own inside the guard

            def broken(self: object, op: object) -> None:
                raise RuntimeError("boom")

            patch.setattr(Sanitizer, "_judge", broken)
            with safeview.sanitize():
                torch.as_strided(meta, (2, 2), (2, 1))
    return events


# Emitted only where vLLM is installed; tests/test_vllm.py checks its keys against this table.
NEEDS_VLLM = {"integration_installed"}


def test_event_table_documents_every_key_that_is_emitted(monkeypatch: pytest.MonkeyPatch) -> None:
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("here vLLM is installed: integration_unavailable cannot be provoked")
    documented = _documented_keys()
    assert set(documented) == {
        "view_created",
        "bounds_violation",
        "overlap_violation",
        "registration_checked",
        "integration_installed",
        "integration_unavailable",
        "internal_error",
    }
    # bounds_violation has "the keys of view_created" plus its own
    documented["bounds_violation"] |= documented["view_created"]
    events = _emitted(monkeypatch)
    assert {event["event"] for event in events} == set(documented) - NEEDS_VLLM
    for event in events:
        undocumented = set(event) - documented[event["event"]] - ALWAYS
        assert not undocumented, (event["event"], undocumented)
