"""Plans: validation, the shipped examples, and the same verdicts as the checks on live layouts."""

from __future__ import annotations

import importlib
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from safeview import Plan, Region

PLANS = Path(__file__).parent.parent / "examples" / "plans"
sys.path.insert(0, str(PLANS))
import make_plans  # noqa: E402


def _plan(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "storages": [{"name": "kv", "nbytes": 4096}],
        "views": [
            {"name": "k", "storage": "kv", "num_blocks": 4, "page_bytes": 256,
             "block_stride_bytes": 1024},
            {"name": "v", "storage": "kv", "num_blocks": 4, "page_bytes": 256,
             "block_stride_bytes": 1024, "byte_offset": 256},
        ],
    }  # fmt: skip
    base.update(changes)
    return base


@pytest.mark.parametrize("file_name", sorted(make_plans.PLANS))
def test_shipped_plans_are_what_the_generator_writes(file_name: str) -> None:
    on_disk = json.loads((PLANS / file_name).read_text())
    generated = Plan.model_validate(make_plans.PLANS[file_name]()).model_dump(
        mode="json", exclude_none=True
    )
    assert on_disk == generated


@pytest.mark.parametrize(
    "file_name",
    [
        "deepseek_v3_2_packed.json",
        "glm_5_2_fp8_packed.json",
        "qwen3_next_hybrid.json",
        "vllm_unit_test.json",
    ],
)
def test_good_plans_pass(file_name: str) -> None:
    report = Plan.load(PLANS / file_name).check()
    assert report.ok
    assert all(row["status"] == "ok" for row in report.rows())
    assert report.min_slack_bytes() == 0  # each fills its storage exactly


def test_glm_plan_has_the_real_numbers() -> None:
    plan = Plan.load(PLANS / "glm_5_2_fp8_packed.json")
    assert plan.storages[0].nbytes == 130_343_768_064
    assert len(plan.views) == 101
    assert {view.block_stride_bytes for view in plan.views} == {3_098_112}
    assert {view.num_blocks for view in plan.views} == {42_072}


@pytest.mark.parametrize(
    ("file_name", "kind", "views"),
    [
        ("broken_kv_split_stride.json", "self_overlap", [("layers.1",)]),
        ("broken_aliasing.json", "overlap",
         [("model.layers.6.self_attn", "model.layers.7.self_attn")]),
    ],
)  # fmt: skip
def test_broken_plans_are_caught_with_the_right_kind(
    file_name: str, kind: str, views: list[tuple[str, ...]]
) -> None:
    report = Plan.load(PLANS / file_name).check()
    assert not report.ok
    assert {finding.kind for finding in report.findings} == {kind}
    assert [finding.views for finding in report.findings] == views


def test_one_block_too_many_puts_every_view_past_the_end() -> None:
    report = Plan.load(PLANS / "broken_one_block_too_many.json").check()
    assert {finding.kind for finding in report.findings} == {"out_of_bounds"}
    assert len(report.findings) == 101
    last = report.findings[-1]
    assert last.views == ("model.layers.78.self_attn",)
    assert last.overflow_bytes == 3_098_112


def test_region_violations_are_out_of_region() -> None:
    plan = Plan.model_validate(
        _plan(views=[{"name": "k", "storage": "kv", "num_blocks": 4, "page_bytes": 256,
                      "block_stride_bytes": 1024, "region": [0, 2048]}])
    )  # fmt: skip
    [finding] = plan.check().findings
    assert finding.kind == "out_of_region"
    assert finding.overflow_bytes == 3328 - 2048


def test_groups_scope_the_overlap_check() -> None:
    views = [
        {"name": "attn", "storage": "kv", "num_blocks": 4, "page_bytes": 1024,
         "block_stride_bytes": 1024, "group": "attention"},
        {"name": "mamba", "storage": "kv", "num_blocks": 4, "page_bytes": 1024,
         "block_stride_bytes": 1024, "group": "mamba"},
    ]  # fmt: skip
    assert Plan.model_validate(_plan(views=views)).check().ok
    views[1]["group"] = "attention"
    [finding] = Plan.model_validate(_plan(views=views)).check().findings
    assert finding.kind == "overlap"
    assert (finding.byte, finding.group) == (0, "attention")


@pytest.mark.parametrize(
    ("changes", "location", "words"),
    [
        ({"extra": 1}, ("extra",), "Extra inputs are not permitted"),
        ({"storages": []}, ("storages",), "at least 1 item"),
        ({"storages": [{"name": "kv", "nbytes": 1}, {"name": "kv", "nbytes": 2}]},
         ("storages", 1, "name"), "storage name 'kv' appears 2 times"),
        ({"views": [{"name": "k", "storage": "gpu0", "num_blocks": 1, "page_bytes": 1,
                     "block_stride_bytes": 1}]},
         ("views", 0, "storage"), "names storage 'gpu0', which the plan does not list"),
        ({"views": [{"name": "k", "storage": "kv", "num_blocks": 1, "page_bytes": 0,
                     "block_stride_bytes": 1}]},
         ("views", 0, "page_bytes"), "greater than or equal to 1"),
        ({"views": [{"name": "k", "storage": "kv", "num_blocks": 1.5, "page_bytes": 1,
                     "block_stride_bytes": 1}]},
         ("views", 0, "num_blocks"), "Input should be an integer"),
        ({"views": [{"name": "k", "storage": "kv", "num_blocks": 1, "page_bytes": 1,
                     "block_stride_bytes": 1, "pages": 3}]},
         ("views", 0, "pages"), "Extra inputs are not permitted"),
    ],
)  # fmt: skip
def test_invalid_plans_are_refused_at_the_bad_field(
    changes: dict[str, Any], location: tuple[Any, ...], words: str
) -> None:
    with pytest.raises(ValidationError) as caught:
        Plan.model_validate_json(json.dumps(_plan(**changes)))
    [error] = caught.value.errors()
    assert error["loc"] == location
    assert words in error["msg"]


def test_plan_round_trips_through_a_file(tmp_path: Path) -> None:
    plan = Plan.model_validate(_plan())
    plan.dump(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == plan


@pytest.mark.parametrize(
    ("text", "location", "value"),
    [('{"storages": [{"name": "kv", "nbytes": 8}], "views": [{"name": "k", "storage": "kv", '
      '"num_blocks": "x", "num_blocks": 4, "page_bytes": 1, "block_stride_bytes": 1}]}',
      ("views", 0, "num_blocks"), 4),
     ('{"storages": [{"name": "kv", "nbytes": 8, "nbytes": 9}], "views": []}',
      ("storages", 0, "nbytes"), 9),
     ('{"views": [], "storages": [{"name": "kv", "nbytes": 8}], "views": []}', ("views",), [])],
)  # fmt: skip
def test_duplicate_keys_are_refused_where_they_are(
    text: str, location: tuple[Any, ...], value: Any
) -> None:
    with pytest.raises(ValidationError) as caught:
        Plan.from_json(text)
    [error] = caught.value.errors()
    assert (error["type"], error["loc"], error["input"]) == ("duplicate_key", location, value)
    assert error["msg"] == f"key {location[-1]!r} appears more than once"


@pytest.mark.parametrize(
    ("text", "words"),
    [("{not json", "Expecting property name"), ('{"storages": NaN}', "NaN is not JSON"),
     (b"\xff\xfe\x00", "codec can't decode")],
)  # fmt: skip
def test_text_that_is_not_json_is_refused_at_the_plan(text: str | bytes, words: str) -> None:
    with pytest.raises(ValidationError) as caught:
        Plan.from_json(text)
    [error] = caught.value.errors()
    assert (error["type"], error["loc"]) == ("json_invalid", ())
    assert words in error["msg"]


def test_other_errors_keep_pydantics_location() -> None:
    with pytest.raises(ValidationError) as caught:
        Plan.from_json(json.dumps(_plan(extra=1)))
    [error] = caught.value.errors()
    assert (error["loc"], error["msg"]) == (("extra",), "Extra inputs are not permitted")


def _schema_validator() -> Any:
    jsonschema = importlib.import_module("jsonschema")  # untyped; the `test` extra installs it
    return jsonschema.Draft202012Validator(Plan.model_json_schema())


def test_the_readme_plan_validates_against_the_published_schema() -> None:
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    start = readme.index("## Plans and the `safeview` command")
    section = readme[start : readme.index("\n## ", start + 1)]
    example = json.loads(re.findall(r"```json\n(.*?)```", section, re.S)[0])
    assert example["views"][0]["region"] == [0, 163840]
    _schema_validator().validate(example)
    assert Plan.model_validate(example).views[0].region == Region(start_byte=0, end_byte=163840)


@pytest.mark.parametrize(
    ("region", "valid"),
    [([0, 2048], True), ({"start_byte": 0, "end_byte": 2048}, True), ([0, 1, 2], False),
     ([-1, 2048], False), ({"start_byte": 0}, False), ("0-2048", False)],
)  # fmt: skip
def test_the_schema_publishes_both_forms_of_a_region(region: Any, valid: bool) -> None:
    data = _plan(views=[{"name": "k", "storage": "kv", "num_blocks": 1, "page_bytes": 1,
                         "block_stride_bytes": 1, "region": region}])  # fmt: skip
    assert _schema_validator().is_valid(data) is valid
    if valid:
        Plan.from_json(json.dumps(data))
    else:
        with pytest.raises(ValidationError):
            Plan.from_json(json.dumps(data))
