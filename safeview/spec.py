"""Layout specs: what a view is, validated before anything touches a tensor.

``BlockLayout`` is the KV-cache case, ``num_blocks`` pages of ``page_bytes`` int8 bytes, one every
``block_stride_bytes``, starting at ``byte_offset``. ``StridedLayout`` is the general typed case.
Both are frozen pydantic models; a layout that exists is in int64 range and does not overlap itself.
No torch in here: dtypes are known by name.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import (
    TYPE_CHECKING,
    Annotated,
    Any,
    ClassVar,
    Generic,
    Literal,
    SupportsIndex,
    TypeAlias,
    TypeVar,
    cast,
    get_args,
    overload,
)

from pydantic import (
    BaseModel,
    ConfigDict,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import InitErrorDetails, PydanticCustomError, core_schema
from typing_extensions import Self

from safeview import _arith
from safeview.check import self_overlap
from safeview.errors import ArgumentError

if TYPE_CHECKING:
    import torch

__all__ = [
    "DTYPE_ITEMSIZE",
    "BlockLayout",
    "DTypeName",
    "Layout",
    "Region",
    "SpecError",
    "StridedLayout",
    "packed_layouts",
    "region_span",
]

INT64_MAX = _arith.INT64_MAX

# Item sizes of the dtypes a byte view can take, by torch's canonical name.
DTypeName = Literal[
    "bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64",
    "float16", "bfloat16", "float32", "float64", "complex32", "complex64", "complex128",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
]  # fmt: skip
DTYPE_ITEMSIZE: dict[str, int] = {
    "bool": 1, "uint8": 1, "int8": 1, "uint16": 2, "int16": 2, "uint32": 4, "int32": 4,
    "uint64": 8, "int64": 8, "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
    "complex32": 4, "complex64": 8, "complex128": 16, "float8_e4m3fn": 1, "float8_e4m3fnuz": 1,
    "float8_e5m2": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
}  # fmt: skip
assert set(DTYPE_ITEMSIZE) == set(get_args(DTypeName))


def _index(value: Any) -> int:
    """An integer scalar of any library (numpy, torch, anything with ``__index__``) as ``int``;
    ``bool`` in any of its forms, ``float``, ``str`` and the rest are refused."""
    if isinstance(value, (bool, float, str, bytes)) or value is None:
        raise ValueError("not an integer")
    if getattr(value, "ndim", 0) != 0:  # a one-element tensor or array is not a scalar
        raise ValueError("not an integer")
    dtype = getattr(value, "dtype", None)
    if dtype is not None and str(dtype) in ("bool", "torch.bool"):
        raise ValueError("not an integer")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError("not an integer") from None


class _Integer:
    """``Annotated[int, _Integer(ge=...)]``: a plain ``int`` passes at pydantic-core's speed;
    other integer scalars go through ``operator.index``; then the range is checked."""

    def __init__(self, ge: int) -> None:
        self.ge = ge

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        return core_schema.chain_schema(
            [
                core_schema.union_schema(
                    [
                        core_schema.int_schema(strict=True),
                        core_schema.no_info_plain_validator_function(_index),
                    ],
                    mode="left_to_right",
                    custom_error_type="integer_type",
                    custom_error_message="Input should be an integer (int, or an integer scalar "
                    "such as numpy.int64); bool, float and str are refused",
                ),
                core_schema.int_schema(strict=True, ge=self.ge, le=INT64_MAX),
            ]
        )

    def __get_pydantic_json_schema__(
        self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        return {"type": "integer", "minimum": self.ge, "maximum": INT64_MAX}


Count = Annotated[int, _Integer(ge=0)]
Positive = Annotated[int, _Integer(ge=1)]


T = TypeVar("T")


class _Derived(Generic[T]):
    """A number derived from a layout's fields, computed once by its validator and kept in the
    instance's ``__dict__`` (where plain attribute lookup finds it first)."""

    def __init__(self, doc: str) -> None:
        self.__doc__ = doc

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, instance: None, owner: type) -> _Derived[T]: ...
    @overload
    def __get__(self, instance: object, owner: type) -> T: ...
    def __get__(self, instance: object, owner: type) -> _Derived[T] | T:
        if instance is None:
            return self
        raise AttributeError(f"{self.name} is set when the layout is validated")


def field_error(
    model: BaseModel, loc: tuple[str | int, ...], value: Any, kind: str, message: str
) -> ValidationError:
    """A ``ValidationError`` located at ``loc``, raised from a validator that sees all fields."""
    return ValidationError.from_exception_data(
        type(model).__name__,
        [InitErrorDetails(type=PydanticCustomError(kind, message), loc=loc, input=value)],
    )


class SpecError(ArgumentError, ValidationError):
    """A field of a safeview model (``BlockLayout``, ``StridedLayout``, ``Region``, ``Plan``,
    ``LayerSpec``) given a value it refuses: a ``SafeViewError`` (and an ``ArgumentError``) that
    is also pydantic's ``ValidationError``, with the same ``errors()``, each naming the field
    (``loc``), the value (``input``) and the rule or limit it breaks (``msg``)."""


def _line_error(found: Any) -> Any:
    """One of pydantic's error dictionaries as what builds it again: its own kind and context
    where pydantic knows the kind, else a custom error with the same kind and message."""
    line: Any = {"type": found["type"], "loc": found["loc"], "input": found["input"]}
    if found.get("ctx"):
        line["ctx"] = found["ctx"]
    try:
        ValidationError.from_exception_data("check", [line])
    except Exception:  # a kind of safeview's own (pages_overlap, ...), or a context it rebuilds
        message = found["msg"].replace("{", "{{").replace("}", "}}")
        line = {"type": PydanticCustomError(found["type"], message), "loc": found["loc"],
                "input": found["input"]}  # fmt: skip
    return line


def spec_error(error: ValidationError) -> SpecError:
    """pydantic's ``ValidationError`` from a safeview model as a ``SpecError``."""
    if isinstance(error, SpecError):
        return error
    return SpecError.from_exception_data(
        error.title, [_line_error(found) for found in error.errors(include_url=False)]
    )


if TYPE_CHECKING:
    from pydantic._internal._model_construction import ModelMetaclass as _ModelMetaclass
else:
    _ModelMetaclass = type(BaseModel)


class _Checked(_ModelMetaclass):
    """The constructor of safeview's models: fields may be given in their declared order
    (``BlockLayout(4, 16, 16)``), and a refused value is a ``SpecError``."""

    def __call__(cls, /, *args: Any, **fields: Any) -> Any:  # noqa: N805
        if args:
            names = list(cast("type[BaseModel]", cls).model_fields)
            if len(args) > len(names):
                raise ArgumentError(
                    f"{cls.__name__} takes at most {len(names)} positional arguments "
                    f"({', '.join(names)}); got {len(args)}"
                )
            for name, value in zip(names, args):
                if name in fields:
                    raise ArgumentError(
                        f"{cls.__name__}: {name} given twice, by position and by name"
                    )
                fields[name] = value
        try:
            return super().__call__(**fields)
        except ValidationError as error:
            raise spec_error(error) from None


class Spec(BaseModel, metaclass=_Checked):
    """Base of safeview's models: frozen, no unknown keys, integers strictly, fields by name or
    in order, refusals as ``SpecError``, and ``model_copy`` validates its changes (pydantic's
    own does not, and the derived numbers are cached)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    @classmethod
    def model_validate(cls, obj: Any, **options: Any) -> Self:
        try:
            return super().model_validate(obj, **options)
        except ValidationError as error:
            raise spec_error(error) from None

    @classmethod
    def model_validate_json(cls, json_data: str | bytes | bytearray, **options: Any) -> Self:
        try:
            return super().model_validate_json(json_data, **options)
        except ValidationError as error:
            raise spec_error(error) from None

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        fields = {name: getattr(self, name) for name in type(self).model_fields}
        return self.model_validate({**fields, **(update or {})})


def _as_tuple(value: Any) -> Any:
    """Any sequence (list, ``torch.Size``) of shape or strides becomes a tuple."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        return value
    return tuple(value)


def _dtype_name(value: Any) -> Any:
    """``torch.float16``, ``"torch.float16"`` and ``"float16"`` all name the same dtype."""
    if type(value).__module__ == "torch" and type(value).__name__ == "dtype":
        value = str(value)
    if isinstance(value, str):
        value = value.strip()
        return value[len("torch.") :] if value.startswith("torch.") else value
    return value


_MAX_INTERNED = 4_096
_UNSET: Any = type("_Unset", (), {"__repr__": lambda self: "<unset>"})()


class _Interned(_Checked):
    """Builds ``BlockLayout`` without pydantic's machinery when every value is a plain ``int``,
    and hands the same frozen instance back for values it has built before.

    A layout built inside a per-layer loop costs the checks and an object, not a validation: new
    values are checked here, by the rules of ``BlockLayout``'s fields and validator, and only a
    layout that passes them all is built this way; anything else,
    ``True``, ``numpy.int64``, a value out of range, a name that is not a field, goes to
    pydantic's validation, which gives the same layout or the same ``ValidationError`` as
    always. Values built a second time are remembered (by the values, and whether ``byte_offset``
    was given), up to ``_MAX_INTERNED`` of them, so that a loop that rebuilds equal values costs
    a dictionary look-up and gets the same frozen instance from then on."""

    def __call__(
        cls,  # noqa: N805
        num_blocks: Any = _UNSET,
        page_bytes: Any = _UNSET,
        block_stride_bytes: Any = _UNSET,
        byte_offset: Any = _UNSET,
        *args: Any,
        **extra: Any,
    ) -> Any:
        # the fields by name or in their declared order
        last = _LAST[0]
        if (
            # the very objects of the last look-up that found a layout (a loop that rebuilds
            # the same values from the same variables): the same values, ints all
            num_blocks is last[0]
            and page_bytes is last[1]
            and block_stride_bytes is last[2]
            and byte_offset is last[3]
            and cls is BlockLayout
            and not args
            and not extra
        ):
            return last[4]
        if (
            type(num_blocks) is int
            and type(page_bytes) is int
            and type(block_stride_bytes) is int
            and (type(byte_offset) is int or byte_offset is _UNSET)
            and cls is BlockLayout
            and not args
            and not extra
        ):
            key = (num_blocks, page_bytes, block_stride_bytes, byte_offset)
            layout = _INTERNED.get(key)
            if layout is not None:
                _LAST[0] = (*key, layout)
                return layout
            # New values: BlockLayout's rules, as its fields and validator state them; a value
            # any of them refuses goes on to pydantic below, for pydantic's own error.
            offset = 0 if byte_offset is _UNSET else byte_offset
            if (
                0 <= num_blocks <= INT64_MAX
                and 0 < page_bytes <= INT64_MAX
                and 0 < block_stride_bytes <= INT64_MAX
                and 0 <= offset <= INT64_MAX
                and (num_blocks < 2 or block_stride_bytes >= page_bytes)
            ):
                end = offset + (num_blocks - 1) * block_stride_bytes + page_bytes
                if not num_blocks:
                    end = offset
                if end <= INT64_MAX:
                    # built as validation builds it: the same fields, derived numbers, set of
                    # given fields, no extra and no private attributes
                    layout = _new_layout(BlockLayout)
                    _set_dict(layout, {
                        "num_blocks": num_blocks,
                        "page_bytes": page_bytes,
                        "block_stride_bytes": block_stride_bytes,
                        "byte_offset": offset,
                        "shape": (num_blocks, page_bytes),
                        "strides": (block_stride_bytes, 1),
                        "extent_bytes": end,
                        "element_offset": offset,
                    })  # fmt: skip
                    _set_fields_set(layout, (
                        _GIVEN_FOUR if byte_offset is not _UNSET else _GIVEN_THREE
                    ).copy())  # fmt: skip
                    _set_extra(layout, None)
                    _set_private(layout, None)
                    # Remembered from its second build on: values built once (a per-layer
                    # loop) leave no object behind for the cyclic collector to scan again and
                    # again; values built again (a loop that rebuilds them) are looked up.
                    # Values seen once are kept as the hash of their key: an int, which the
                    # collector does not track (a kept tuple starts a collection every few
                    # hundred layouts); two keys of one hash only get remembered a build early.
                    seen = hash(key)
                    if seen in _SEEN:
                        if len(_INTERNED) >= _MAX_INTERNED:
                            _INTERNED.clear()  # cheaper than evicting one by one: a cache
                        _INTERNED[key] = layout
                    else:
                        if len(_SEEN) >= _MAX_INTERNED:
                            _SEEN.clear()
                        _SEEN.add(seen)
                    return layout
        given = {
            field: value
            for field, value in (
                ("num_blocks", num_blocks),
                ("page_bytes", page_bytes),
                ("block_stride_bytes", block_stride_bytes),
                ("byte_offset", byte_offset),
            )
            if value is not _UNSET
        }
        if args:
            raise ArgumentError(
                f"{cls.__name__} takes at most 4 positional arguments (num_blocks, page_bytes, "
                f"block_stride_bytes, byte_offset); got {4 + len(args)}"
            )
        return super().__call__(**given, **extra)


_INTERNED: dict[tuple[int, int, int, int], Any] = {}
# The arguments and layout of the last look-up that found one; none to start with.
_LAST: list[tuple[Any, ...]] = [(_UNSET, _UNSET, _UNSET, object(), None)]
_SEEN: set[int] = set()  # hashes of the values built once, not remembered yet
_new_layout = object.__new__
# BaseModel's own slots, set through their descriptors: what object.__setattr__ finds, less the
# look-up
_set_dict = BaseModel.__dict__["__dict__"].__set__
_set_fields_set = BaseModel.__dict__["__pydantic_fields_set__"].__set__
_set_extra = BaseModel.__dict__["__pydantic_extra__"].__set__
_set_private = BaseModel.__dict__["__pydantic_private__"].__set__
_GIVEN_THREE = {"num_blocks", "page_bytes", "block_stride_bytes"}
_GIVEN_FOUR = {*_GIVEN_THREE, "byte_offset"}


class BlockLayout(Spec, metaclass=_Interned):
    """``num_blocks`` pages of ``page_bytes`` bytes, one every ``block_stride_bytes`` bytes, the
    first at ``byte_offset`` of the storage: the int8 view ``(num_blocks, page_bytes)`` with strides
    ``(block_stride_bytes, 1)`` that a KV-cache connector registers per layer.

    >>> layer_1 = BlockLayout(
    ...     num_blocks=10, page_bytes=16_384, block_stride_bytes=49_152, byte_offset=16_384
    ... )
    >>> layer_1.extent_bytes  # 16_384 + 9 * 49_152 + 16_384
    475136

    Integers only (``int`` and integer scalars such as ``numpy.int64``); pages must not overlap each
    other (``block_stride_bytes >= page_bytes`` whenever ``num_blocks > 1``); every number and the
    extent fit in int64.
    """

    num_blocks: Count
    page_bytes: Positive
    block_stride_bytes: Positive
    byte_offset: Count = 0

    if TYPE_CHECKING:
        # What the constructor accepts, for type checkers: any integer scalar.
        def __init__(
            self,
            num_blocks: SupportsIndex,
            page_bytes: SupportsIndex,
            block_stride_bytes: SupportsIndex,
            byte_offset: SupportsIndex = 0,
        ) -> None: ...

    @model_validator(mode="after")
    def _pages_apart_and_in_int64(self) -> BlockLayout:
        fields = self.__dict__
        num_blocks, page_bytes = fields["num_blocks"], fields["page_bytes"]
        block_stride_bytes, byte_offset = fields["block_stride_bytes"], fields["byte_offset"]
        shape = (num_blocks, page_bytes)
        strides = (block_stride_bytes, 1)
        if num_blocks > 1 and block_stride_bytes < page_bytes:
            overlap = self_overlap(
                None, storage=None, byte_offset=byte_offset, shape=shape, strides=strides,
                itemsize=1, block=True,
            )  # fmt: skip
            assert overlap is not None
            raise field_error(
                self, ("block_stride_bytes",), block_stride_bytes, "pages_overlap", overlap.message
            )
        end = _arith.extent_bytes(byte_offset, shape, strides, 1)
        if end > INT64_MAX:
            raise ValueError(
                f"extent_bytes = byte_offset + (num_blocks - 1) * block_stride_bytes + page_bytes "
                f"= {end} exceeds the int64 limit {INT64_MAX} by {end - INT64_MAX}"
            )
        # Derived numbers are computed once, here; make_view reads them on every call.
        fields["shape"] = shape
        fields["strides"] = strides
        fields["extent_bytes"] = end
        fields["element_offset"] = byte_offset
        return self

    # Filled in by the validator; declared here for readers and type checkers.
    extent_bytes: ClassVar[_Derived[int]] = _Derived(
        "Exclusive end byte: ``byte_offset + (num_blocks - 1) * block_stride_bytes + "
        "page_bytes``, or ``byte_offset`` when ``num_blocks == 0``."
    )
    shape: ClassVar[_Derived[tuple[int, int]]] = _Derived("``(num_blocks, page_bytes)``")
    strides: ClassVar[_Derived[tuple[int, int]]] = _Derived(
        "``(block_stride_bytes, 1)``: strides in elements, which for int8 are bytes"
    )
    element_offset: ClassVar[_Derived[int]] = _Derived("``byte_offset`` in elements")
    dtype: ClassVar[DTypeName] = "int8"
    itemsize: ClassVar[int] = 1

    @property
    def nbytes(self) -> int:
        """Bytes the view holds (``num_blocks * page_bytes``), not counting the gaps."""
        return self.num_blocks * self.page_bytes

    def to_strided(self) -> StridedLayout:
        """The same view as a ``StridedLayout``."""
        return StridedLayout(
            shape=self.shape, strides=self.strides, byte_offset=self.byte_offset, dtype="int8"
        )


class StridedLayout(Spec):
    """A typed view: ``shape`` and ``strides`` in elements of ``dtype``, ``byte_offset`` in bytes (a
    multiple of the item size), counted from byte 0 of the storage.

    >>> layout = StridedLayout(
    ...     shape=(2, 4, 8), strides=(64, 8, 1), byte_offset=256, dtype="float16"
    ... )
    >>> layout.extent_bytes  # 256 + 2 * (64 + 3 * 8 + 7 + 1)
    448

    Same rules as ``BlockLayout``: integers only, strides not negative, no element touched twice
    (Rust ndarray's rule), every number and the extent within int64.
    """

    shape: tuple[Count, ...]
    strides: tuple[Count, ...]
    byte_offset: Count = 0
    dtype: DTypeName = "int8"

    if TYPE_CHECKING:

        def __init__(
            self,
            shape: Sequence[SupportsIndex],
            strides: Sequence[SupportsIndex],
            byte_offset: SupportsIndex = 0,
            dtype: str | torch.dtype = "int8",
        ) -> None: ...

    @model_validator(mode="before")
    @classmethod
    def _normalise(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        data = dict(data)
        for field in ("shape", "strides"):
            if field in data:
                data[field] = _as_tuple(data[field])
        if "dtype" in data:
            data["dtype"] = _dtype_name(data["dtype"])
        return data

    @field_validator("strides")
    @classmethod
    def _one_stride_per_axis(
        cls, strides: tuple[int, ...], info: ValidationInfo
    ) -> tuple[int, ...]:
        shape = info.data.get("shape")
        if shape is not None and len(strides) != len(shape):
            raise ValueError(
                f"strides has {len(strides)} entries but shape {shape} has {len(shape)} axes"
            )
        return strides

    @model_validator(mode="after")
    def _aligned_and_in_int64(self) -> StridedLayout:
        overlap = self_overlap(
            None,
            storage=None,
            byte_offset=self.byte_offset,
            shape=self.shape,
            strides=self.strides,
            itemsize=self.itemsize,
        )
        if overlap is not None:
            raise field_error(self, ("strides",), self.strides, "elements_overlap", overlap.message)
        if self.byte_offset % self.itemsize:
            raise ValueError(
                f"byte_offset={self.byte_offset} is not a multiple of the {self.itemsize}-byte "
                f"item size of {self.dtype}"
            )
        for axis, (size, stride) in enumerate(zip(self.shape, self.strides)):
            if size and stride * self.itemsize > INT64_MAX:
                raise ValueError(
                    f"strides[{axis}]={stride} elements of {self.itemsize} bytes exceeds the "
                    f"int64 limit {INT64_MAX} in bytes"
                )
        end = _arith.extent_bytes(self.byte_offset, self.shape, self.strides, self.itemsize)
        self.__dict__.update(extent_bytes=end, element_offset=self.byte_offset // self.itemsize)
        if end > INT64_MAX:
            raise ValueError(
                f"extent_bytes={end} exceeds the int64 limit {INT64_MAX} by {end - INT64_MAX}"
            )
        return self

    extent_bytes: ClassVar[_Derived[int]] = _Derived(
        "Exclusive end byte; ``byte_offset`` for an empty view."
    )
    element_offset: ClassVar[_Derived[int]] = _Derived("``byte_offset`` in elements of ``dtype``")

    @property
    def itemsize(self) -> int:
        return DTYPE_ITEMSIZE[self.dtype]

    @property
    def nbytes(self) -> int:
        """Bytes the view holds, not counting the gaps."""
        count = 1
        for size in self.shape:
            count *= size
        return count * self.itemsize


Layout: TypeAlias = BlockLayout | StridedLayout


class Region(Spec):
    """A byte range ``[start_byte, end_byte)`` of a storage that a view must stay inside: the slot
    of its layer or group. A 2-tuple ``(start, end)`` is accepted wherever a ``Region`` is."""

    start_byte: Count
    end_byte: Count

    if TYPE_CHECKING:

        def __init__(self, start_byte: SupportsIndex, end_byte: SupportsIndex) -> None: ...

    @model_validator(mode="before")
    @classmethod
    def _from_pair(cls, data: Any) -> Any:
        if isinstance(data, Sequence) and not isinstance(data, (str, bytes)):
            if len(data) != 2:
                raise ValueError(f"a region is (start_byte, end_byte); got {len(data)} values")
            data = {"start_byte": data[0], "end_byte": data[1]}
        return data

    @model_validator(mode="after")
    def _ordered(self) -> Region:
        if self.end_byte < self.start_byte:
            raise ValueError(f"end_byte={self.end_byte} is before start_byte={self.start_byte}")
        return self

    @classmethod
    def coerce(cls, value: Region | Sequence[int]) -> Region:
        return value if isinstance(value, Region) else cls.model_validate(value)

    def as_list(self) -> list[int]:
        return [self.start_byte, self.end_byte]

    def as_tuple(self) -> tuple[int, int]:
        return (self.start_byte, self.end_byte)


def region_span(value: object, argument: str = "region") -> tuple[int, int]:
    """``(start_byte, end_byte)`` of a function's region argument: a ``Region``, a 2-sequence
    or a mapping of its fields. Anything else raises ``ArgumentError`` naming the argument, the
    value and the rule it breaks (``Region(...)`` itself raises pydantic's ``ValidationError``).
    """
    if type(value) is Region:
        return value.start_byte, value.end_byte
    try:
        region = Region.coerce(value)  # type: ignore[arg-type]
    except ValidationError as error:
        raise ArgumentError(
            f"{argument}={value!r} is not a byte range (start_byte, end_byte) with "
            f"0 <= start_byte <= end_byte <= {INT64_MAX}: {_reason(error)}"
        ) from None
    return region.start_byte, region.end_byte


def _reason(error: ValidationError) -> str:
    """pydantic's first complaint, as ``field: message``."""
    first = error.errors(include_url=False)[0]
    where = ".".join(str(part) for part in first["loc"])
    message = first["msg"].removeprefix("Value error, ")
    return f"{where}: {message}" if where else message


def _argument(value: object, what: str, minimum: int) -> int:
    """An integer argument from ``minimum`` to ``INT64_MAX``, or an ``ArgumentError`` naming
    it, its value and those limits."""
    try:
        number = _index(value)
    except ValueError:
        number = None
    if number is None or not minimum <= number <= INT64_MAX:
        raise ArgumentError(
            f"{what} must be an integer from {minimum} to {INT64_MAX}; "
            f"got {value!r} ({type(value).__name__})"
        )
    return number


def packed_layouts(
    page_bytes: Mapping[str, int], num_blocks: int, *, byte_offset: int = 0
) -> dict[str, BlockLayout]:
    """Layouts of a block-major ("packed") group: every block holds one page of each view, back to
    back, in the mapping's order, so the block stride is the sum of the pages.

    >>> views = packed_layouts({"k": 4, "v": 4}, num_blocks=3)
    >>> views["v"].byte_offset, views["v"].block_stride_bytes
    (4, 8)

    Arguments of the wrong kind or value (a page of ``-1`` bytes, a ``num_blocks`` of ``True``,
    a group whose extent passes the int64 limit) raise ``ArgumentError``.
    """
    if not isinstance(page_bytes, Mapping):
        raise ArgumentError(
            "page_bytes must be a mapping of view names to page sizes in bytes "
            f"({{name: bytes}}); got {type(page_bytes).__name__}"
        )
    blocks = _argument(num_blocks, "num_blocks", 0)
    offset = _argument(byte_offset, "byte_offset", 0)
    pages = {name: _argument(page, f"page_bytes[{name!r}]", 1) for name, page in page_bytes.items()}
    block_stride_bytes = sum(pages.values())
    if block_stride_bytes > INT64_MAX:
        raise ArgumentError(
            f"page_bytes: the pages sum to {block_stride_bytes} bytes, the block stride, which "
            f"exceeds the int64 limit {INT64_MAX} by {block_stride_bytes - INT64_MAX}"
        )
    layouts = {}
    for name, page in pages.items():
        try:
            layouts[name] = BlockLayout(
                num_blocks=blocks,
                page_bytes=page,
                block_stride_bytes=block_stride_bytes,
                byte_offset=offset,
            )
        except ValidationError as error:
            raise ArgumentError(f"packed_layouts: view {name!r}: {_reason(error)}") from None
        offset += page
    return layouts
