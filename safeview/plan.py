"""Layout plans: a registration written down as JSON, checked offline without torch.

A plan names its storages (``name``, ``nbytes``) and its block views (``name``, ``storage``,
``num_blocks``, ``page_bytes``, ``block_stride_bytes``, ``byte_offset``, optional ``group`` and
``region``), and may name the schema it follows with a ``"$schema"`` key (``Plan.dump`` writes
``PLAN_SCHEMA``, the ``$id`` of the schema ``safeview schema`` prints). ``safeview check PLAN.json``
validates it with ``Plan`` and judges it with the one checker (``safeview.check.check_views``);
``Registration.to_plan()`` and ``sanitize().to_plan()`` write one from a live process.
"""

from __future__ import annotations

import difflib
import json
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    GetJsonSchemaHandler,
    ValidationError,
    model_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import InitErrorDetails, PydanticCustomError, PydanticKnownError, core_schema

from safeview.check import Report, ViewRecord, check_views
from safeview.spec import INT64_MAX, Count, Positive, Region, Spec, field_error

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["PLAN_SCHEMA", "Plan", "PlanStorage", "PlanView"]

PLAN_SCHEMA = "urn:safeview:plan:1"
"""What ``Plan.dump`` writes as a plan's ``"$schema"``: the ``$id`` of the JSON Schema that
``safeview schema`` prints (``safeview schema > plan.schema.json`` keeps a copy for an editor).
A URN names the schema without claiming an address; any other string is accepted on reading."""

Name = Annotated[str, Field(min_length=1)]


class _RegionOrPair:
    """Publishes what ``Region`` accepts: its object, or a ``[start_byte, end_byte]`` pair."""

    def __get_pydantic_json_schema__(
        self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        byte = {"type": "integer", "minimum": 0, "maximum": INT64_MAX}
        pair = {"type": "array", "items": byte, "minItems": 2, "maxItems": 2}
        return {"anyOf": [handler(schema), pair]}


PlanRegion = Annotated[Region, _RegionOrPair()]


class PlanStorage(Spec):
    """One storage: its name in the plan and its size in bytes (``untyped_storage().nbytes()``)."""

    name: Name
    nbytes: Count
    device: str | None = None


class PlanView(Spec):
    """One block view of a plan. The numbers are integers in int64 range; whether they make sense
    (bounds, self-overlap) is what ``safeview check`` reports, so they are not refused here."""

    name: Name
    storage: Name
    num_blocks: Count
    page_bytes: Positive
    block_stride_bytes: Positive
    byte_offset: Count = 0
    group: str | int | None = None
    region: PlanRegion | None = None


class Plan(Spec):
    """A set of storages and the block views laid over them.

    >>> plan = Plan.model_validate({
    ...     "storages": [{"name": "kv", "nbytes": 1024}],
    ...     "views": [{"name": "k", "storage": "kv", "num_blocks": 4, "page_bytes": 128,
    ...                "block_stride_bytes": 256},
    ...               {"name": "v", "storage": "kv", "num_blocks": 4, "page_bytes": 128,
    ...                "block_stride_bytes": 256, "byte_offset": 128}]})
    >>> plan.check().ok
    True
    """

    model_config = ConfigDict(json_schema_extra={"$id": PLAN_SCHEMA})

    schema_uri: str = Field(
        default=PLAN_SCHEMA,
        alias="$schema",
        title="$schema",
        description="the schema this plan follows (an editor may point it at a copy)",
    )
    description: str | None = None
    storages: list[PlanStorage] = Field(min_length=1)
    views: list[PlanView]

    @model_validator(mode="wrap")
    @classmethod
    def _unknown_keys_first(cls, data: Any, handler: Callable[[Any], Plan]) -> Plan:
        # A misspelt key shows up twice, as an unknown key and as a missing field; the unknown
        # key is the cause, so it comes first, with the key that was probably meant.
        try:
            return handler(data)
        except ValidationError as error:
            raise _with_unknown_keys_first(error) from None

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Plan:
        fields = type(self).model_fields
        data = {fields[name].alias or name: getattr(self, name) for name in fields}
        for name, value in (update or {}).items():
            field = fields.get(name)
            data[field.alias or name if field is not None else name] = value
        return self.model_validate(data)

    @model_validator(mode="after")
    def _names_resolve(self) -> Self:
        names = {
            "storages": [storage.name for storage in self.storages],
            "views": [view.name for view in self.views],
        }
        for field, listed in names.items():
            counts = Counter(listed)
            seen: set[str] = set()
            for index, name in enumerate(listed):
                if name in seen:
                    raise field_error(
                        self,
                        (field, index, "name"),
                        name,
                        "duplicate_name",
                        f"{field[:-1]} name {name!r} appears {counts[name]} times",
                    )
                seen.add(name)
        known = {storage.name for storage in self.storages}
        for index, view in enumerate(self.views):
            if view.storage not in known:
                raise field_error(
                    self,
                    ("views", index, "storage"),
                    view.storage,
                    "unknown_storage",
                    f"view {view.name!r} names storage {view.storage!r}, which the plan does not "
                    f"list (storages: {', '.join(sorted(known))})",
                )
        return self

    @classmethod
    def from_views(
        cls,
        storages: Mapping[str, int],
        views: Iterable[ViewRecord],
        *,
        devices: Mapping[str, str] | None = None,
        description: str | None = None,
    ) -> Plan:
        """A plan of block views (``ViewRecord.is_block``) over ``storages`` (name -> bytes)."""
        return cls.model_validate(
            {
                "description": description,
                "storages": [
                    {"name": name, "nbytes": nbytes, "device": (devices or {}).get(name)}
                    for name, nbytes in storages.items()
                ],
                "views": [
                    {
                        "name": view.name,
                        "storage": view.storage,
                        "num_blocks": view.shape[0],
                        "page_bytes": view.shape[1],
                        "block_stride_bytes": view.strides[0],
                        "byte_offset": view.byte_offset,
                        "group": _plan_group(view.group),
                        "region": view.region,
                    }
                    for view in views
                ],
            }
        )

    def check(self) -> Report:
        """Every view and every pair, judged by ``safeview.check.check_views``."""
        return check_views(self.sizes(), self.records())

    def sizes(self) -> dict[str, int]:
        """Storage name -> bytes."""
        return {storage.name: storage.nbytes for storage in self.storages}

    def records(self) -> list[ViewRecord]:
        """The views as the checker's records, in order."""
        pairs: dict[tuple[int, int], tuple[int, int]] = {}  # equal shapes share one tuple
        records = []
        for view in self.views:
            shape = (view.num_blocks, view.page_bytes)
            strides = (view.block_stride_bytes, 1)
            records.append(
                ViewRecord(
                    view.name,
                    view.storage,
                    view.byte_offset,
                    pairs.setdefault(shape, shape),
                    pairs.setdefault(strides, strides),
                    1,
                    view.group,
                    view.region.as_tuple() if view.region is not None else None,
                )
            )
        return records

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Read and validate a plan file. Raises ``OSError`` or pydantic's ``ValidationError``."""
        return cls.from_json(Path(path).read_bytes())

    @classmethod
    def from_json(cls, text: str | bytes) -> Plan:
        """Validate a plan's JSON text. Text that is not JSON, or an object that names a key
        twice, raises ``ValidationError`` located like any bad field (``views.0.num_blocks``)."""
        twice: list[_Object] = []

        def pairs_to_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
            data = dict(pairs)
            if len(data) == len(pairs):  # the usual case: no key twice, a plain dict
                return data
            twice.append(_Object(pairs))
            return twice[-1]

        try:
            data = json.loads(text, object_pairs_hook=pairs_to_object, parse_constant=_no_constant)
        except (ValueError, RecursionError) as error:  # JSONDecodeError, bad UTF-8, NaN
            raise _plan_error((), text, "json_invalid", f"Invalid JSON: {error}") from None
        duplicate = _first_duplicate(data, ()) if twice else None
        if duplicate is not None:
            loc, key, value = duplicate
            raise _plan_error(loc, value, "duplicate_key", f"key {key!r} appears more than once")
        return cls.model_validate(data)

    def dump(self, path: str | Path) -> None:
        """Write the plan as indented JSON, its ``"$schema"`` first (``PLAN_SCHEMA`` unless the
        plan names another)."""
        Path(path).write_text(self.to_json_text())

    def to_json_text(self) -> str:
        """The text ``dump`` writes."""
        data = self.model_dump(mode="json", exclude_none=True, by_alias=True)
        return json.dumps(data, indent=2) + "\n"


class _Object(dict[str, Any]):
    """A JSON object that remembers the keys it was given more than once."""

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        super().__init__(pairs)
        counts = Counter(key for key, _ in pairs)
        self.duplicates = [key for key, count in counts.items() if count > 1]


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _first_duplicate(
    value: Any, loc: tuple[str | int, ...]
) -> tuple[tuple[str | int, ...], str, Any] | None:
    """Where the first key given twice is: its location, the key and its last value."""
    if isinstance(value, dict):
        if isinstance(value, _Object) and value.duplicates:
            twice = value.duplicates[0]
            return (*loc, twice), twice, value[twice]
        items: Iterable[tuple[str | int, Any]] = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return None
    for at, item in items:
        found = _first_duplicate(item, (*loc, at))
        if found is not None:
            return found
    return None


def _plan_error(loc: tuple[str | int, ...], value: Any, kind: str, message: str) -> ValidationError:
    error = PydanticCustomError(kind, "{message}", {"message": message})
    return ValidationError.from_exception_data(
        "Plan", [InitErrorDetails(type=error, loc=loc, input=value)]
    )


def _models_by_place() -> dict[tuple[str, ...], type[BaseModel]]:
    return {(): Plan, ("storages",): PlanStorage, ("views",): PlanView, ("views", "region"): Region}


def _unknown_key(loc: tuple[str | int, ...]) -> str:
    """The message for an unknown key at ``loc``: the known key it is closest to, or them all."""
    key = str(loc[-1])
    model = _models_by_place().get(tuple(str(part) for part in loc[:-1] if isinstance(part, str)))
    if model is None:
        return f"unknown key {key!r}"
    known = [field.alias or name for name, field in model.model_fields.items()]
    lowered = {name.lower(): name for name in known}
    # a key cut short ('end' for 'end_byte') first, then the closest spelling
    near = [name for name in known if name.lower().startswith(key.lower())]
    if len(near) != 1:
        near = [lowered[n] for n in difflib.get_close_matches(key.lower(), lowered, 1, 0.6)]
    if near:
        return f"unknown key {key!r}; did you mean {near[0]!r}?"
    return f"unknown key {key!r}; known keys: {', '.join(known)}"


def _with_unknown_keys_first(error: ValidationError) -> ValidationError:
    """``error`` with its unknown keys first, each saying which key was probably meant; the
    other errors as they were (same type, location, input and context)."""
    errors = error.errors(include_url=False)
    if not any(e["type"] == "extra_forbidden" for e in errors):
        return error
    details = []
    for e in sorted(errors, key=lambda e: e["type"] != "extra_forbidden"):
        kind: str | PydanticCustomError
        if e["type"] == "extra_forbidden":
            kind = PydanticCustomError(
                "unknown_key", "{message}", {"message": _unknown_key(e["loc"])}
            )
        else:
            kind = e["type"]
            try:
                PydanticKnownError(kind, e.get("ctx"))  # type: ignore[arg-type]
            except (KeyError, TypeError, ValueError):  # a custom error type: keep its message
                kind = PydanticCustomError(kind, "{message}", {"message": e["msg"]})
        detail = InitErrorDetails(type=kind, loc=e["loc"], input=e["input"])
        if isinstance(kind, str) and "ctx" in e:
            detail["ctx"] = e["ctx"]
        details.append(detail)
    return ValidationError.from_exception_data(error.title, details)


def _plan_group(group: Hashable | None) -> str | int | None:
    """Plans name groups by ``str`` or ``int``; other group keys are written as text."""
    if group is None or (isinstance(group, (str, int)) and not isinstance(group, bool)):
        return group
    return str(group)
