"""The parts of a page: what a row or a page holds besides one dtype's elements (issue 37).

A layer without parts reads as one ``data`` part of its own dtype filling each row (the bytes
of its ``element`` axis). A layer with parts names each: ``data``, ``scale``, ``rope``, ``pad``
or a state's ``segment``, each a run of bytes at ``offset_bytes`` from the row's first byte,
``length_bytes`` long, of its own element type, repeated ``count`` times ``stride_bytes``
apart (a Mamba conv state's ``x`` segment in ``SD``: one run per conv row). A part may carry
``index``, the logical axes its elements are laid over (outermost first, row-major), where it
is not the row's own (a page that holds all K data, then all K scales: vLLM's NVFP4).

A scale says what it scales: ``granularity`` (``tensor``, ``head``, ``token_head``, ``block``
of ``group_elements`` elements, ``tile`` of ``group_tokens`` tokens by ``group_elements``
elements), the part it scales (``scales``, default ``data``) and its ``order``: ``linear`` or
a named swizzle (``SWIZZLES``). A state's segment says how tensor parallelism splits it
(``tp``: ``heads``, ``segment``: each segment split by TP on its own, ``replicated``).

``Companion`` is a tensor tied to a layer (a scale pool, a per-head scale array), with its own
block count; ``Layer.scalars`` carries values by value (vLLM's ``k_scale``, ``v_scale``).

Plain Python and pydantic; ``part_fields`` (numpy) decodes page bytes for ``diff``. No torch.
"""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING, Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

from safeview.spec import DTYPE_ITEMSIZE, DTypeName

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    Array = npt.NDArray[np.int64]

__all__ = [
    "PART_DTYPE_ITEMSIZE",
    "SWIZZLES",
    "Companion",
    "Part",
    "PartDType",
    "PartRole",
    "parts_checked",
]

_FROZEN = ConfigDict(frozen=True, extra="forbid")
_MAX = 1 << 62
Count = Annotated[int, Field(strict=True, ge=0, lt=_MAX)]
Positive = Annotated[int, Field(strict=True, ge=1, lt=_MAX)]
PartRole = Literal["data", "scale", "rope", "pad", "segment"]
Granularity = Literal["tensor", "head", "token_head", "block", "tile"]
TpRule = Literal["heads", "segment", "replicated"]
IndexAxis = Literal["kv", "token", "head", "element"]
# torch's dtypes, and its two 4-bit pairs: float4_e2m1fn_x2 (two e2m1 values a byte) and
# quint4x2 (two unsigned 4-bit codes a byte, element 2i in the low nibble, read with a scale
# and a zero point: vLLM's int4_per_token_head, pack_int4_nibbles)
PartDType = DTypeName | Literal["float4_e2m1fn_x2", "quint4x2"]
PART_DTYPE_ITEMSIZE: dict[str, int] = {**DTYPE_ITEMSIZE, "float4_e2m1fn_x2": 1, "quint4x2": 1}
# elements one storage unit holds (a float4_e2m1fn_x2 or quint4x2 byte holds two)
_PER_UNIT = {"float4_e2m1fn_x2": 2, "quint4x2": 2}

SWIZZLES: dict[str, str] = {
    "linear": "element i at position i",
    "trtllm_4x4": (
        "vLLM's NVFP4 V scales for SM100's trtllm-gen kernel (csrc nvfp4_kv_cache_kernels.cu, "
        "swizzle_scale_offset): over a [T, S] grid of token by scale, (t, s) is stored at "
        "((t // 4) * 4 + s // (S / 4), (s % (S / 4)) * 4 + t % 4)"
    ),
    "ds_mla_8x4": (
        "vLLM's nvfp4_ds_mla NoPE scales (flashmla_sparse.py): the scale of element block s "
        "at byte 8 * (s & 3) + (s >> 2) of the 32"
    ),
}
"""The orders a scale part may be stored in, by name, with where each is defined."""


class Part(BaseModel):
    """One named part of a row (or, with ``index``, of a page): see the module's docstring."""

    model_config = _FROZEN

    name: Annotated[str, Field(min_length=1, max_length=64)]
    role: PartRole = "data"
    offset_bytes: Count
    length_bytes: Positive
    dtype: PartDType
    count: Positive = 1
    stride_bytes: Count = 0
    index: tuple[tuple[IndexAxis, Positive], ...] | None = None
    granularity: Granularity | None = None
    group_elements: Positive | None = None
    group_tokens: Positive | None = None
    scales: str | None = None
    order: str = "linear"
    tp: TpRule | None = None
    kv: Literal[0, 1] | None = None  # a part of K rows (0) or V rows (1) only

    @model_validator(mode="after")
    def _consistent(self) -> Part:
        unit = PART_DTYPE_ITEMSIZE[self.dtype]
        where = f"parts[{self.name!r}]"
        if self.length_bytes % unit:
            raise ValueError(
                f"{where}: length_bytes {self.length_bytes} is not a whole number of "
                f"{self.dtype} ({unit} bytes)"
            )
        if self.count > 1 and self.stride_bytes < self.length_bytes:
            raise ValueError(
                f"{where}: stride_bytes {self.stride_bytes} is shorter than one run "
                f"({self.length_bytes} bytes): its runs overlap"
            )
        if (self.role == "scale") != (self.granularity is not None):
            raise ValueError(f"{where}: a scale part, and only one, has a granularity")
        if self.granularity in ("block", "tile") and self.group_elements is None:
            raise ValueError(f"{where}: a {self.granularity} scale needs group_elements")
        if self.granularity == "tile" and self.group_tokens is None:
            raise ValueError(f"{where}: a tile scale needs group_tokens")
        if self.order not in SWIZZLES:
            raise ValueError(
                f"{where}: order {self.order!r} is not one safeview knows ({', '.join(SWIZZLES)})"
            )
        if self.order != "linear" and self.role != "scale":
            raise ValueError(f"{where}: only a scale part is stored in a swizzled order")
        if (self.role == "segment") != (self.tp is not None):
            raise ValueError(f"{where}: a segment part, and only one, has a tp rule")
        if self.index is not None:
            sizes = math.prod(size for _, size in self.index)
            if sizes != self.units:
                raise ValueError(
                    f"{where}: index {[list(a) for a in self.index]} holds {sizes} elements; "
                    f"the part holds {self.units}"
                )
        return self

    @property
    def units(self) -> int:
        """Storage units (``dtype``'s items) the part holds, over all its runs."""
        return self.count * self.length_bytes // PART_DTYPE_ITEMSIZE[self.dtype]

    @property
    def elements(self) -> int:
        """Values the part holds (two per byte for ``float4_e2m1fn_x2`` and ``quint4x2``)."""
        return self.units * _PER_UNIT.get(self.dtype, 1)

    @property
    def end_bytes(self) -> int:
        return self.offset_bytes + (self.count - 1) * self.stride_bytes + self.length_bytes

    def runs(self) -> list[tuple[int, int]]:
        return [
            (self.offset_bytes + j * self.stride_bytes, self.length_bytes)
            for j in range(self.count)
        ]


class Companion(BaseModel):
    """A tensor tied to a layer, not in its pages: a scale pool (``bytes_per_block`` per
    block, ``num_blocks`` blocks, which must be the layer's), a per-head scale array
    (``num_blocks`` 0: not per block), with its element type and what it scales."""

    model_config = _FROZEN

    name: Annotated[str, Field(min_length=1, max_length=64)]
    role: PartRole = "scale"
    dtype: PartDType
    num_blocks: Count
    bytes_per_block: Count
    granularity: Granularity | None = None
    group_elements: Positive | None = None


def parts_checked(
    parts: tuple[Part, ...], row_bytes: int, kind: str, tokens: int, scalars: Any = None
) -> None:
    """A layer's parts against its row (``row_bytes``): each inside the row, none overlapping
    another, names unique, each scale's group dividing the part it scales and as many scales
    as groups, a state's segments (with its pad) covering the whole state. ``ValueError``
    naming the part and the numbers (the model makes it a ``ManifestError``)."""
    names = [part.name for part in parts]
    for name in names:
        if names.count(name) > 1:
            raise ValueError(f"parts name {name!r} twice")
    runs: list[tuple[int, int, str]] = []
    for part in parts:
        if part.end_bytes > row_bytes:
            raise ValueError(
                f"parts[{part.name!r}] ends at byte {part.end_bytes}, past the {row_bytes} "
                "bytes of its row"
            )
        if part.count > 1 << 16:
            raise ValueError(f"parts[{part.name!r}]: count {part.count} is more than 65,536 runs")
    for side in (0, 1):  # K rows and V rows hold the parts of no side and their own
        runs = sorted(
            (start, start + length, part.name)
            for part in parts
            if part.kv in (None, side)
            for start, length in part.runs()
        )
        for (_, end, name), (start, _, other) in itertools.pairwise(runs):
            if start < end:
                raise ValueError(
                    f"parts[{other!r}] overlaps parts[{name!r}]: byte {start} is in both (it "
                    f"ends at {end})"
                )
    by_name = {part.name: part for part in parts}
    for part in parts:
        if part.role == "scale":
            _scale_checked(part, by_name, tokens)
    if any(part.role == "segment" for part in parts):
        covered = sum(end - start for start, end, _ in runs)
        if covered != row_bytes:
            first = _first_gap(runs, row_bytes)
            raise ValueError(
                f"parts (segments) cover {covered} of the {row_bytes} bytes of the state: "
                f"byte {first} is in no part"
            )


def _first_gap(runs: list[tuple[int, int, str]], row_bytes: int) -> int:
    at = 0
    for start, end, _ in runs:
        if start > at:
            return at
        at = max(at, end)
    return at if at < row_bytes else row_bytes


def _scale_checked(part: Part, by_name: dict[str, Part], tokens: int) -> None:
    target_name = part.scales or "data"
    target = by_name.get(target_name)
    where = f"parts[{part.name!r}]"
    if target is None:
        raise ValueError(f"{where} scales parts[{target_name!r}], which the layer does not have")
    if part.granularity == "token_head" and part.index is None:
        if part.units != target.count:  # one scale per run of data: per (token, head) row
            raise ValueError(
                f"{where} holds {part.units} scales a row; parts[{target_name!r}] has "
                f"{target.count} runs a row, one (token, head) each"
            )
        return
    if part.granularity not in ("block", "tile"):
        return
    group = part.group_elements or 1
    per_run = target.length_bytes // PART_DTYPE_ITEMSIZE[target.dtype]
    per_run *= _PER_UNIT.get(target.dtype, 1)
    if per_run % group:
        raise ValueError(
            f"{where}: group_elements {group} does not divide the {per_run} elements of "
            f"parts[{target_name!r}] it scales"
        )
    groups = target.elements // group // (part.group_tokens or 1)
    if part.units != groups:
        raise ValueError(
            f"{where} holds {part.units} scales; parts[{target_name!r}] has "
            f"{target.elements} elements, {groups} groups of {group}"
        )


# -- decoding page bytes (diff) ---------------------------------------------------------------

_CODES: dict[tuple[str, str, str], int] = {}
_NAMES: list[tuple[str, str, str]] = []


def part_code(name: str, role: str, dtype: str) -> int:
    """A number per (part name, role, element type), the same in every manifest of this
    process: two bytes agree in part only where their codes are equal."""
    key = (name, role, dtype)
    found = _CODES.get(key)
    if found is None:
        found = _CODES[key] = len(_NAMES)
        _NAMES.append(key)
    return found


def part_of_code(code: int) -> tuple[str, str, str]:
    return _NAMES[code]


def swizzled(
    order: str, token: Array, element: Array, tokens: int, per_row: int
) -> tuple[Array, Array]:
    """The logical (token, element) of the scale stored at physical (token, element)."""
    if order == "trtllm_4x4":
        group = max(per_row // 4, 1)
        logical_token = (token // 4) * 4 + element % 4
        logical_element = (token % 4) * group + element // 4
        return logical_token, logical_element
    if order == "ds_mla_8x4":
        tile, at = element // 32 * 32, element % 32
        return token, tile + 4 * (at % 8) + at // 8
    return token, element


PARTS_ROLES: tuple[str, ...] = get_args(PartRole)
