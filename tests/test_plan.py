"""Plans: validation, the shipped examples, and the same verdicts as the checks on live layouts."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from safeview import Plan
from safeview.plan import PLAN_SCHEMA

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
    written = Plan.model_validate(make_plans.PLANS[file_name]()).to_json_text()
    assert (PLANS / file_name).read_text() == written


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
        ({"extra": 1}, ("extra",),
         "unknown key 'extra'; known keys: $schema, description, storages, views"),
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
         ("views", 0, "pages"), "unknown key 'pages'; did you mean 'page_bytes'?"),
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
        Plan.from_json(json.dumps(_plan(views=[{**_plan()["views"][0], "page_bytes": 0}])))
    [error] = caught.value.errors()
    assert (error["type"], error["loc"]) == ("greater_than_equal", ("views", 0, "page_bytes"))
    assert (error["msg"], error["ctx"]) == ("Input should be greater than or equal to 1", {"ge": 1})


@pytest.mark.parametrize(
    ("key", "where", "message"),
    [("block_stride", ("views", 0), "did you mean 'block_stride_bytes'?"),
     ("Page_Bytes", ("views", 0), "did you mean 'page_bytes'?"),
     ("offset", ("views", 0), "did you mean 'byte_offset'?"),
     ("size", ("storages", 0), "known keys: name, nbytes, device"),
     ("view", (), "did you mean 'views'?"),
     ("end", ("views", 0, "region"), "did you mean 'end_byte'?")],
)  # fmt: skip
def test_an_unknown_key_comes_first_with_the_key_meant(
    key: str, where: tuple[Any, ...], message: str
) -> None:
    data = _plan()
    data["views"][0]["region"] = {"start_byte": 0, "end_byte": 4096}
    target = data
    for part in where:
        target = target[part]
    meant = {"block_stride": "block_stride_bytes", "Page_Bytes": "page_bytes",
             "offset": "byte_offset", "end": "end_byte"}.get(key)  # fmt: skip
    target[key] = target.pop(meant) if meant in target else 1
    data["views"][1]["num_blocks"] = "4"  # an error of another kind, before it in the document
    with pytest.raises(ValidationError) as caught:
        Plan.from_json(json.dumps(data))
    first, *others = caught.value.errors()
    assert (first["type"], first["loc"]) == ("unknown_key", (*where, key))
    assert first["msg"] == f"unknown key {key!r}; {message}"
    assert ("views", 1, "num_blocks") in [error["loc"] for error in others]
    if meant in ("block_stride_bytes", "page_bytes", "end_byte"):  # required: also missing
        assert (*where, meant) in [error["loc"] for error in others]


def test_a_plan_names_its_schema_and_dump_writes_it(tmp_path: Path) -> None:
    plan = Plan.model_validate(_plan())
    assert plan.schema_uri == PLAN_SCHEMA == Plan.model_json_schema()["$id"]
    plan.dump(tmp_path / "plan.json")
    text = (tmp_path / "plan.json").read_text()
    assert text.startswith('{\n  "$schema": "urn:safeview:plan:1",\n')
    _schema_validator().validate(json.loads(text))
    mine = Plan.from_json(text.replace(PLAN_SCHEMA, "./plan.schema.json"))
    assert mine.schema_uri == "./plan.schema.json"
    mine.dump(tmp_path / "again.json")  # a plan's own pointer is kept
    assert json.loads((tmp_path / "again.json").read_text())["$schema"] == "./plan.schema.json"


def test_model_copy_of_a_plan_keeps_and_validates_every_field() -> None:
    plan = Plan.from_json(json.dumps({**_plan(), "$schema": "x.json"}))
    copy = plan.model_copy(update={"description": "copied"})
    assert (copy.schema_uri, copy.description, copy.views) == ("x.json", "copied", plan.views)
    with pytest.raises(ValidationError):
        plan.model_copy(update={"storages": []})


def _schema_validator() -> Any:
    jsonschema = importlib.import_module("jsonschema")  # untyped; the `test` extra installs it
    return jsonschema.Draft202012Validator(Plan.model_json_schema())


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
