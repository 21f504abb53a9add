"""The layout manifest's model: what a ``Manifest`` file holds (``urn:safeview:manifest:1``), its
checks on reading (every count below 2**62, pages that nest, fingerprints that match), its JSON
round trip and its fingerprints, whose canonical text is a stable format (docs/layouts.md). Part
of ``safeview.manifest``, which derives manifests (from tensors, geometries and connectors'
formats) and is the module to import: every name here is re-exported there. No torch.
"""

from __future__ import annotations

import hashlib
import json
import re
import weakref
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from safeview.check import StorageRecord, ViewRecord
from safeview.errors import ManifestError
from safeview.manifest._parts import Companion, Part, parts_checked
from safeview.spec import DTYPE_ITEMSIZE, DTypeName

__all__ = [
    "CONNECTOR_RULES",
    "MANIFEST_SCHEMA",
    "MAX_BYTES",
    "MAX_HEADS",
    "MAX_RANKS",
    "Companion",
    "Layer",
    "LayerKind",
    "Manifest",
    "PageAxis",
    "Part",
    "Topology",
]

MANIFEST_SCHEMA: Literal["urn:safeview:manifest:1"] = "urn:safeview:manifest:1"
PageAxisName = Literal["kv", "token", "head", "element"]
LayerKind = Literal["attention", "latent", "state"]
# Every byte count, stride and number of a manifest stays below 2**62, so that a page's byte
# addresses (first byte + block * stride + page byte) are exact in numpy's int64 and in C.
MAX_BYTES = 1 << 62
Count = Annotated[int, Field(strict=True, ge=0, lt=MAX_BYTES)]
Positive = Annotated[int, Field(strict=True, ge=1, lt=MAX_BYTES)]
MAX_HEADS = 1 << 16  # KV heads of a model: a manifest lists each rank's; real models hold <= 128
MAX_RANKS = 1 << 16  # a TP size: diff walks the ranks one by one; real engines run <= 1,024
Ranks = Annotated[int, Field(strict=True, ge=1, le=MAX_RANKS)]
CONNECTOR_RULES: dict[str, str] = {"NixlConnector": "vllm_nixl"}
"""The ``safeview.diff`` rule of each connector a manifest can name (``topology.connector``);
a connector not listed moves pages by ``page_copy``."""

_FROZEN = ConfigDict(frozen=True, extra="forbid")


class PageAxis(BaseModel):
    """One logical axis of a page: its meaning, its length and its byte stride. ``outer`` marks
    an axis that lies outside the block axis (``(2, num_blocks, ...)``: K and V pages apart)."""

    model_config = _FROZEN

    axis: PageAxisName
    size: Positive
    stride_bytes: Count
    outer: bool = False


class Topology(BaseModel):
    """Where a manifest's engine sits: its tensor-parallel rank and size, the model's total KV
    heads and the global heads this rank holds (in its local head order), block tokens (the
    kernel's, and the engine's logical block), and the engine's name, version and own name for
    its layout (vLLM's ``LBHNC``; for ``assumed``, the connector's format), as reported; the
    connector that wrote it (vLLM's ``NixlConnector``), whose rule ``safeview.diff`` uses.

    Context parallelism, under vLLM's names and meaning (``docs/layouts.md``, where a token
    lives): ``dcp_size``/``dcp_rank`` and ``pcp_size``/``pcp_rank`` spread a block's tokens
    over ``W = dcp_size * pcp_size`` ranks, ``cp_kv_cache_interleave_size`` (``I``) tokens at
    a time; this rank's context-parallel position is ``c = pcp_rank * dcp_size + dcp_rank``,
    and its local slot ``s`` of a block holds the token at ``(s // I * W + c) * I + s % I`` of
    the ``block tokens * W`` the block stands for. The pipeline stage: ``pp_rank`` of
    ``pp_size``, and ``stage_layers``, the global (model) index of each of the manifest's
    layers in its layer order. All are written only when not their default, so a manifest
    without them reads as DCP = PCP = PP = 1 and keeps its text and fingerprint."""

    model_config = _FROZEN

    tp_rank: Count = 0
    tp_size: Annotated[int, Field(strict=True, ge=1, le=MAX_RANKS)] = 1
    total_kv_heads: Annotated[int, Field(strict=True, ge=1, le=MAX_HEADS)] | None = None
    heads: tuple[Count, ...] | None = None
    kernel_block_tokens: Positive | None = None
    logical_block_tokens: Positive | None = None
    engine: str | None = None
    engine_version: str | None = None
    layout: str | None = None
    # written only when known: a file without it stays readable by 0.4.1, which refuses keys
    # it does not know
    connector: str | None = Field(default=None, exclude_if=lambda value: value is None)
    # written only when not 1 (or 0): an old manifest's text, wire bytes and fingerprint stay
    dcp_size: Ranks = Field(default=1, exclude_if=lambda value: value == 1)
    dcp_rank: Count = Field(default=0, exclude_if=lambda value: value == 0)
    pcp_size: Ranks = Field(default=1, exclude_if=lambda value: value == 1)
    pcp_rank: Count = Field(default=0, exclude_if=lambda value: value == 0)
    cp_kv_cache_interleave_size: Positive = Field(default=1, exclude_if=lambda value: value == 1)
    pp_size: Ranks = Field(default=1, exclude_if=lambda value: value == 1)
    pp_rank: Count = Field(default=0, exclude_if=lambda value: value == 0)
    stage_layers: tuple[Count, ...] | None = Field(
        default=None, exclude_if=lambda value: value is None
    )

    @model_validator(mode="after")
    def _rank_in_range(self) -> Topology:
        for rank, size in (("tp_rank", "tp_size"), ("dcp_rank", "dcp_size"),
                           ("pcp_rank", "pcp_size"), ("pp_rank", "pp_size")):  # fmt: skip
            if getattr(self, rank) >= getattr(self, size):
                raise ValueError(
                    f"{rank} {getattr(self, rank)} is not below {size} {getattr(self, size)}"
                )
        if self.cp_size > MAX_RANKS:
            raise ValueError(
                f"dcp_size {self.dcp_size} times pcp_size {self.pcp_size} is more than "
                f"{MAX_RANKS:,} context-parallel ranks"
            )
        return self

    @property
    def cp_size(self) -> int:
        """``W``: the ranks a block's tokens are spread over (``dcp_size * pcp_size``)."""
        return self.dcp_size * self.pcp_size

    @property
    def cp_rank(self) -> int:
        """``c``: this rank's context-parallel position, ``pcp_rank * dcp_size + dcp_rank``."""
        return self.pcp_rank * self.dcp_size + self.dcp_rank

    def placement(self) -> dict[str, Any] | None:
        """What the topology adds to the meaning of a page byte (its fingerprint): the token
        placement under context parallelism and the stage's global layer indices; ``None``
        when neither is there (the fingerprint is then the one of before)."""
        found: dict[str, Any] = {}
        if self.cp_size > 1:
            found["cp"] = [self.cp_size, self.cp_rank, self.cp_kv_cache_interleave_size]
        if self.stage_layers is not None:
            found["stage_layers"] = list(self.stage_layers)
        return found or None


# Layers whose checks passed, by id (the instance itself kept, to tell a reused id). pydantic
# runs a model's after-validator again each time an instance is nested in another model (every
# Layer of a Manifest, at each Manifest made): a frozen instance gives the same verdict, so it
# is checked once.
_VALIDATED: weakref.WeakValueDictionary[int, Layer] = weakref.WeakValueDictionary()


class Layer(BaseModel):
    """One layer's page: ``axes`` in physical order (outermost first; size-1 axes first, with
    stride 0), ``page_bytes`` (the bytes one block holds: its chunks, each the span of the inner
    axes), where block 0 starts (``byte_offset``) and the distance between blocks
    (``block_stride_bytes``), the global KV heads its head axis holds, and a ``fingerprint`` of
    what every page byte means (its placement, offsets and block count left out)."""

    model_config = _FROZEN

    kind: LayerKind
    dtype: DTypeName
    itemsize: Positive
    group: int | str | None = None
    num_blocks: Count
    block_stride_bytes: Count
    byte_offset: Count
    page_bytes: Count
    chunk_bytes: Count
    axes: tuple[PageAxis, ...]
    heads: tuple[Count, ...] = ()
    # issue 37: written only when there (a layer without them is one ``data`` part of its
    # dtype, and keeps the text, wire bytes and fingerprint of 0.7.0)
    parts: tuple[Part, ...] = Field(default=(), exclude_if=lambda value: not value)
    companions: tuple[Companion, ...] = Field(default=(), exclude_if=lambda value: not value)
    scalars: dict[str, float] = Field(default_factory=dict, exclude_if=lambda value: not value)
    fingerprint: str = ""

    @model_validator(mode="after")
    def _consistent(self) -> Layer:
        if _VALIDATED.get(id(self)) is self:
            return self  # this frozen instance passed already (nested in a Manifest)
        if DTYPE_ITEMSIZE[self.dtype] != self.itemsize:
            raise ValueError(f"itemsize {self.itemsize} is not that of {self.dtype}")
        names = [axis.axis for axis in self.axes]
        if len(set(names)) != len(names):
            raise ValueError(f"axes name one meaning twice: {names}")
        head = next((axis for axis in self.axes if axis.axis == "head"), None)
        if self.kind == "attention" and "kv" not in names and not self._kv_in_parts():
            raise ValueError("an attention layer needs a kv axis")
        if head is not None and self.heads and len(self.heads) != head.size:
            raise ValueError(f"heads {list(self.heads)} do not match the head axis ({head.size})")
        # a page that a file describes must be one describe() could have derived: the inner
        # axes nest (innermost first, each holding the span inside it) and make the chunk
        span, chunks = self.itemsize, 1
        for axis in sorted((a for a in self.axes if a.size > 1), key=lambda a: a.stride_bytes):
            if axis.outer:
                chunks *= axis.size
                continue
            if axis.stride_bytes < span:
                raise ValueError(
                    f"axis {axis.axis} (stride {axis.stride_bytes} bytes) overlaps the axes "
                    f"inside it, which span {span} bytes"
                )
            span += (axis.size - 1) * axis.stride_bytes
        if (self.chunk_bytes, self.page_bytes) != (span, span * chunks):
            raise ValueError(
                f"chunk_bytes {self.chunk_bytes} and page_bytes {self.page_bytes} are not what "
                f"the axes make ({span} and {span * chunks})"
            )
        if self.parts or self.companions:
            self._parts_checked()
        fingerprint = _layer_fingerprint(self)
        if self.fingerprint and self.fingerprint != fingerprint:
            raise ValueError(
                f"fingerprint {self.fingerprint[:12]}... does not match the layer "
                f"({fingerprint[:12]}...): edited, or written by another version"
            )
        self._last_byte_checked()
        object.__setattr__(self, "fingerprint", fingerprint)
        _VALIDATED[id(self)] = self
        return self

    def at_offset(self, byte_offset: int) -> Layer:
        """This layer with block 0 at ``byte_offset`` (the same page, the same fingerprint): a
        layer of an alike tensor elsewhere in its storage, made without the page's checks,
        which it passed already; the one check the offset enters, the last byte's, is made.
        ``ManifestError`` naming ``byte_offset`` for an offset it cannot take."""
        if type(byte_offset) is not int or byte_offset < 0:
            raise ManifestError("byte_offset", byte_offset, "must be an int >= 0")
        if _VALIDATED.get(id(self)) is not self:  # never checked (model_construct): check it
            try:
                return Layer.model_validate({**dict(self), "byte_offset": byte_offset})
            except ValidationError as error:
                raise _refused(error, "layer") from None
        moved = self.model_copy(update={"byte_offset": byte_offset})
        try:
            moved._last_byte_checked()
        except ValueError as error:
            raise ManifestError("byte_offset", byte_offset, str(error)) from None
        _VALIDATED[id(moved)] = moved
        return moved

    def _last_byte_checked(self) -> None:
        last = self.byte_offset + max(self.num_blocks - 1, 0) * self.block_stride_bytes
        last += sum((axis.size - 1) * axis.stride_bytes for axis in self.axes) + self.itemsize
        if last > MAX_BYTES:
            raise ValueError(
                f"its last byte ({last:.3g}) lies past the {MAX_BYTES:,} bytes (2**62) a "
                "manifest can address"
            )

    def _kv_in_parts(self) -> bool:
        return any(axis == "kv" for part in self.parts for axis, _ in part.index or ())

    def _parts_checked(self) -> None:
        if self.parts:
            element = next((a for a in self.axes if a.axis == "element"), None)
            if element is None or (element.size > 1 and element.stride_bytes != self.itemsize):
                raise ValueError(
                    "parts lie in a row (the element axis, contiguous); this layer's element "
                    f"axis is {element}"
                )
            parts_checked(
                self.parts, self.row_bytes, self.kind, self.size_of("token"), self.scalars
            )
        for companion in self.companions:
            if companion.num_blocks not in (0, self.num_blocks):
                raise ValueError(
                    f"companions[{companion.name!r}] holds {companion.num_blocks} blocks; the "
                    f"layer holds {self.num_blocks}"
                )

    @property
    def row_bytes(self) -> int:
        """The bytes of one row: the element axis (one token's, head's, K or V's values)."""
        return self.size_of("element") * self.itemsize

    def parts_or_data(self) -> tuple[Part, ...]:
        """The layer's parts; without any, the one ``data`` part of its dtype filling the row."""
        if self.parts:
            return self.parts
        return (Part(name="data", offset_bytes=0, length_bytes=self.row_bytes, dtype=self.dtype),)

    def part_at(self, page_byte: int) -> tuple[Part, int] | None:
        """The part that page byte ``page_byte`` lies in, and its byte in the row; ``None`` for
        a byte past the page or in no part (padding). A layer without parts: its ``data``."""
        if not 0 <= page_byte < self.page_bytes:
            return None
        rest = page_byte % max(self.chunk_bytes, 1)
        row = rest
        for axis in sorted(self.axes, key=lambda a: -a.stride_bytes):
            if axis.outer or axis.size == 1 or axis.axis == "element":
                continue
            index, rest = divmod(rest, axis.stride_bytes)
            if index >= axis.size:
                return None
            row = rest
        kv = 0
        kv_axis = next((a for a in self.axes if a.axis == "kv"), None)
        if kv_axis is not None and not kv_axis.outer and kv_axis.stride_bytes:
            kv = page_byte % max(self.chunk_bytes, 1) // kv_axis.stride_bytes % kv_axis.size
        for part in self.parts_or_data():
            if part.kv is not None and part.kv != kv:
                continue
            relative = row - part.offset_bytes
            if relative < 0:
                continue
            run, within = divmod(relative, part.stride_bytes) if part.count > 1 else (0, relative)
            if run < part.count and within < part.length_bytes:
                return part, row
        return None

    def size_of(self, axis: str) -> int:
        """The length of a page axis, 1 when the page has none."""
        return next((a.size for a in self.axes if a.axis == axis), 1)

    def block_records(self, name: str, storage: str) -> list[ViewRecord]:
        """This layer's pages as the checker's int8 block views (``safeview.check``), as
        ``safeview.kv.block_views`` makes them: one ``(num_blocks, page_bytes)`` view with the
        block stride from the first byte; where axes lie outside the block axis (K and V pages
        apart, ``(2, num_blocks, ...)``), one view per chunk of the page, ``name[i]``, chunk
        ``i`` counted with the innermost outer axis fastest (K is ``[0]``, V ``[1]``)."""
        offsets = [self.byte_offset]
        for axis in (a for a in self.axes if a.outer):
            offsets = [at + i * axis.stride_bytes for at in offsets for i in range(axis.size)]
        split = len(offsets) > 1
        return [
            ViewRecord.block(
                f"{name}[{index}]" if split else name,
                storage,
                num_blocks=self.num_blocks,
                page_bytes=self.chunk_bytes,
                block_stride_bytes=self.block_stride_bytes,
                byte_offset=offset,
                group=self.group,
            )
            for index, offset in enumerate(offsets)
        ]


class Manifest(BaseModel):
    """What an engine's KV-cache bytes mean, per layer by name; see the module's docstring.

    ``Manifest.from_json(text)`` reads one (``ManifestError`` naming the field when it is not a
    manifest of this schema); ``to_json()`` writes it; ``fingerprint`` is the sha256 of the
    canonical JSON of every layer's name and page meaning (its global heads included) and, under
    context parallelism or a pipeline stage, of the token placement and the stage's layer
    indices (``Topology.placement``): the same layout gives the same fingerprint on any
    machine."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    schema_: Literal["urn:safeview:manifest:1"] = Field(default=MANIFEST_SCHEMA, alias="$schema")
    topology: Topology = Topology()
    layers: dict[str, Layer]
    fingerprint: str = ""

    @model_validator(mode="after")
    def _fingerprinted(self) -> Manifest:
        _stage_checked(self.topology, self.layers)
        fingerprint = _fingerprint_of(
            ((name, layer.fingerprint) for name, layer in self.layers.items()), self.topology
        )
        if self.fingerprint and self.fingerprint != fingerprint:
            raise ValueError(
                f"fingerprint {self.fingerprint[:12]}... does not match the layers "
                f"({fingerprint[:12]}...): a layer was renamed, added or edited"
            )
        object.__setattr__(self, "fingerprint", fingerprint)
        return self

    def to_json(self, indent: int | None = 2) -> str:
        return self.model_dump_json(by_alias=True, indent=indent)

    def records(
        self,
        storage_of: Mapping[str, str] | str = "storage0",
        storages: Mapping[str, StorageRecord | int] | None = None,
    ) -> tuple[dict[str, StorageRecord], list[ViewRecord]]:
        """The manifest as the checker's records (``safeview.check.check_views``), the one
        memory model that check, transfer (``MemoryMap.from_manifest``) and diff read: each
        layer's pages as ``Layer.block_records``, in layer order. ``storage_of`` names the
        storage each layer lies in (a mapping by layer name, or one name for all: a manifest
        says where a layer starts, not in which allocation); ``storages`` gives those storages'
        sizes or ``StorageRecord``s (default: each just large enough for its views).
        ``ManifestError`` names a layer without a storage, or a storage without a size."""
        views: list[ViewRecord] = []
        for name, layer in self.layers.items():
            if isinstance(storage_of, str):
                storage = storage_of
            elif name in storage_of:
                storage = storage_of[name]
            else:
                raise ManifestError(f"storage_of[{name!r}]", None, "is missing: no storage given")
            views += layer.block_records(name, storage)
        found: dict[str, StorageRecord] = {}
        for view in views:
            if storages is None:
                known = found.get(view.storage, StorageRecord(0))
                found[view.storage] = StorageRecord(max(known.nbytes, view.extent_bytes))
            elif view.storage not in storages:
                raise ManifestError(f"storages[{view.storage!r}]", None, "is missing: no size")
            else:
                size = storages[view.storage]
                found[view.storage] = (
                    size if isinstance(size, StorageRecord) else StorageRecord(size)
                )
        return found, views

    @classmethod
    def from_json(cls, text: str | bytes, source: str = "manifest") -> Manifest:
        """Read a manifest; ``ManifestError`` naming the field (and the file as ``source``)
        for anything that is not one of this schema: another ``$schema``, truncated JSON, an
        axis of unknown meaning."""
        if not isinstance(text, (str, bytes)):
            raise ManifestError(source, type(text).__name__, "is not JSON text (str or bytes)")
        try:
            data = json.loads(text)
        except (ValueError, UnicodeDecodeError) as error:
            raise ManifestError(source, _short(text), f"is not JSON ({error})") from None
        except RecursionError:  # a manifest is four levels deep; this is no manifest
            raise ManifestError(
                source, _short(text), "nests deeper than Python's JSON reader can follow"
            ) from None
        if not isinstance(data, dict):
            raise ManifestError(source, type(data).__name__, "is not a JSON object")
        schema = data.get("$schema")
        if schema != MANIFEST_SCHEMA:
            raise ManifestError(f"{source}: $schema", schema, f"is not {MANIFEST_SCHEMA!r}")
        manifest: Manifest = _validated(cls, data, source)
        return manifest

    @classmethod
    def read(cls, path: str | Path) -> Manifest:
        file = Path(path)
        try:
            text = file.read_bytes()
        except OSError as error:
            raise ManifestError(str(file), None, f"cannot be read: {error.strerror}") from None
        return cls.from_json(text, source=str(file))

    def file_name(self) -> str:
        """``ENGINE.tpRANKofSIZE.manifest.json``: one file per engine and rank, so that one
        folder can hold both engines of a pair."""
        return _file_name(self.topology)


def _validated(model: type[Any], data: Any, where: str, joint: str = ": ") -> Any:
    """``model.model_validate(data)``, its refusal a ``ManifestError`` that names the field
    (``where: layers['l'].axes[1].axis``), its value when it is short, and the limit."""
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise _refused(error, where, joint) from None


def _refused(error: ValidationError, where: str, joint: str = ": ") -> ManifestError:
    first = error.errors(include_url=False)[0]
    loc = first["loc"]
    field = "".join(
        f"[{part}]" if isinstance(part, int)
        else f"[{part!r}]" if at and loc[at - 1] == "layers"
        else f".{part}"
        for at, part in enumerate(loc)
    )  # fmt: skip
    value = first.get("input")
    # a whole layer, or the whole manifest, is no value to print: its field says which
    shown = None if isinstance(value, (dict, list, tuple)) else value
    message = str(first["msg"]).removeprefix("Value error, ")
    if message.startswith("fingerprint "):  # the check of the whole: name the field it reads
        field, message = f"{field}.fingerprint", message.removeprefix("fingerprint ")
    named, _, rest = message.partition(" ")
    if named in _NAMED_BY_MESSAGE:  # a check of several fields names the one it refuses
        field, message = f"{field}.{named}", rest
    elif named.startswith(("parts[", "companions[")):  # a part's check names the part
        field = re.sub(r"\.(parts|companions)\[\d+\]$", "", field)
        field, message = f"{field}.{named.rstrip(':')}", rest
    field = field.lstrip(".") or "(manifest)"
    return ManifestError(f"{where}{joint if field[0] != '[' else ''}{field}", shown, message)


# the fields a check of a whole model names first in its message (``_refused`` moves the name
# into the error's field)
_NAMED_BY_MESSAGE = frozenset(
    {"tp_rank", "dcp_rank", "pcp_rank", "pp_rank", "dcp_size", "topology.stage_layers",
     "topology.cp_kv_cache_interleave_size"}
)  # fmt: skip


def _file_name(topology: Topology) -> str:
    engine = (topology.engine or "engine").replace("/", "_")
    return f"{engine}.tp{topology.tp_rank}of{topology.tp_size}.manifest.json"


def _short(text: str | bytes) -> str:
    shown = text if isinstance(text, str) else text[:200].decode("utf-8", "replace")
    return shown[:40] + ("..." if len(shown) > 40 else "")


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _page_meaning(layer: Layer) -> dict[str, Any]:
    """What a page's bytes mean, and nothing about where pages lie: outer axes keep their order
    but not their strides (those depend on the number of blocks)."""
    return {
        "kind": layer.kind,
        "dtype": layer.dtype,
        "page_bytes": layer.page_bytes,
        "chunk_bytes": layer.chunk_bytes,
        "axes": [[a.axis, a.size, "outer" if a.outer else a.stride_bytes] for a in layer.axes],
        "heads": list(layer.heads),
        **_parts_meaning(layer),
    }


def _parts_meaning(layer: Layer) -> dict[str, Any]:
    """What the parts add to a page's meaning; nothing for a layer without them (its
    fingerprint is the one of 0.7.0)."""
    found: dict[str, Any] = {}
    if layer.parts:
        found["parts"] = [p.model_dump(mode="json", exclude_defaults=True) for p in layer.parts]
    if layer.companions:
        found["companions"] = [
            c.model_dump(mode="json", exclude_defaults=True) for c in layer.companions
        ]
    if layer.scalars:
        found["scalars"] = dict(sorted(layer.scalars.items()))
    return found


_FINGERPRINTS: dict[tuple[Any, ...], str] = {}


def _layer_fingerprint(layer: Layer) -> str:
    # layers of one shape are many (1,000 in a model): hash each page meaning once
    key = (
        layer.kind,
        layer.dtype,
        layer.page_bytes,
        layer.chunk_bytes,
        tuple((a.axis, a.size, a.stride_bytes, a.outer) for a in layer.axes),
        layer.heads,
        layer.parts,
        layer.companions,
        tuple(sorted(layer.scalars.items())),
    )
    found = _FINGERPRINTS.get(key)
    if found is None:
        if len(_FINGERPRINTS) > 4096:
            _FINGERPRINTS.clear()
        found = _FINGERPRINTS[key] = hashlib.sha256(
            _canonical(_page_meaning(layer)).encode()
        ).hexdigest()
    return found


def _fingerprint_of(pairs: Iterable[tuple[str, str]], topology: Topology | None = None) -> str:
    """sha256 of the canonical JSON of ``[[name, layer fingerprint], ...]`` in name order; with
    context parallelism or a pipeline stage (``Topology.placement``), of
    ``[[[name, layer fingerprint], ...], placement]``: another token placement or stage is
    another meaning of the same bytes."""
    ordered: Any = sorted(pairs)
    placement = None if topology is None else topology.placement()
    if placement is not None:
        ordered = [ordered, placement]
    return hashlib.sha256(_canonical(ordered).encode()).hexdigest()


def _stage_checked(topology: Topology, layers: Mapping[str, Layer]) -> None:
    """The topology against the layers it describes: ``stage_layers`` gives one global index
    per layer, none twice within one KV-cache group; under context parallelism the interleave
    divides every layer's block tokens (vLLM: ``block_size % cp_kv_cache_interleave_size``)."""
    named = ((name, layer.group) for name, layer in layers.items())
    _stage_layers_checked(topology, len(layers), named)
    if topology.cp_size > 1:
        for name, layer in layers.items():
            _interleave_checked(topology, name, layer.size_of("token"), layer.kind)


def _stage_layers_checked(topology: Topology, count: int, named: Iterable[tuple[str, Any]]) -> None:
    """``stage_layers`` against the ``count`` layers it describes: one index each, none twice
    within one KV-cache group. ``named``: each layer's name and group, in order, read only
    where an index is given twice (a lazy iterable: most stages repeat none)."""
    indices = topology.stage_layers
    if indices is None:
        return
    if len(indices) != count:
        raise ValueError(
            f"topology.stage_layers names {len(indices)} layers; the manifest holds {count}"
        )
    if len(set(indices)) == len(indices):
        return  # no index twice, in any group
    seen: dict[tuple[Any, int], str] = {}
    for (name, group), index in zip(named, indices):
        other = seen.setdefault((group, index), name)
        if other != name:
            raise ValueError(
                f"topology.stage_layers names global layer {index} twice (layers {other!r} and "
                f"{name!r}, one KV-cache group)"
            )


def _interleave_checked(topology: Topology, name: str, tokens: int, kind: str) -> None:
    interleave = topology.cp_kv_cache_interleave_size
    if kind != "state" and tokens % interleave:
        raise ValueError(
            f"topology.cp_kv_cache_interleave_size {interleave} does not divide the {tokens} "
            "block "
            f"tokens of layer {name!r}"
        )
