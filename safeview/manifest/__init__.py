"""What the bytes of a KV cache mean: a layout manifest, read off strides, never off shapes.

A ``Manifest`` says, per layer by name, which logical axis (K/V, token, head, head element) lies
at which byte stride of one block's page, how large the page is, where block 0 starts and how
far apart blocks are; and, for the engine, which tensor-parallel rank it is and which global KV
heads it holds. Two manifests are compared by ``safeview.diff``::

    manifest = safeview.describe(kv_caches, axes=vllm_axes(), topology={"tp_size": 2, ...})
    manifest.fingerprint   # sha256 of what every byte of every page means

``describe`` reads tensors (torch is imported only there, through ``safeview._torch``); the model,
``assumed`` (a manifest from a connector's assumed format, such as LMCache's
``NL_X_TWO_NB_BS_NH_HS``) and the JSON round trip need no torch. The model, its checks and its
fingerprints live in ``safeview.manifest._model``; every name of it is re-exported here. Where
every token lives under context parallelism (``token_positions``) and each page byte's place in
vLLM's canonical page (``canonical_bytes``) live in ``safeview.manifest.canonical``.

Axis names, one per tensor dimension in shape order: ``block``; ``kv`` (0 is K, 1 is V);
``token`` (within a block); ``head`` (local index, mapped to a global KV head by the topology);
``element`` (within a head, or of an MLA latent vector); ``kv|element`` (K and V side by side
in one axis, K first: vLLM 0.33's last axis); ``state`` (a Mamba state's bytes); ``unit`` (a
size-1 axis with no meaning). A layer with a ``kv`` axis is ``attention``; one with a ``state``
axis is ``state``; any other is ``latent`` (MLA: one vector per token, the same on every rank).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from pydantic import ValidationError

from safeview.errors import ManifestError
from safeview.manifest._formats import FORMATS, NamedFormat
from safeview.manifest._model import (
    CONNECTOR_RULES,
    MANIFEST_SCHEMA,
    MAX_BYTES,
    MAX_HEADS,
    MAX_RANKS,
    Companion,
    Layer,
    LayerKind,
    Manifest,
    PageAxis,
    Part,
    Topology,
    _file_name,
    _fingerprint_of,
    _interleave_checked,
    _refused,
    _short,
    _stage_layers_checked,
    _validated,
)
from safeview.spec import DTYPE_ITEMSIZE

if TYPE_CHECKING:
    import torch

__all__ = [
    "AXIS_NAMES",
    "CONNECTOR_RULES",
    "FORMATS",
    "MANIFEST_SCHEMA",
    "MAX_BYTES",
    "MAX_HEADS",
    "MAX_RANKS",
    "Companion",
    "Derived",
    "Layer",
    "LayerKind",
    "Manifest",
    "PageAxis",
    "Part",
    "Topology",
    "assumed",
    "canonical_bytes",
    "derive",
    "describe",
    "heads_of_rank",
    "layer_from_geometry",
    "layer_heads",
    "token_positions",
    "vllm_axes",
]

AXIS_NAMES = ("block", "kv", "token", "head", "element", "kv|element", "state", "unit")


def heads_of_rank(tp_rank: int, tp_size: int, total_kv_heads: int) -> tuple[int, ...]:
    """The global KV heads a rank holds, as vLLM shards them: ``max(1, H // TP)`` heads from
    ``rank * H // TP``; with more ranks than heads, each head is held by ``TP // H`` ranks."""
    if tp_size <= total_kv_heads:
        if total_kv_heads % tp_size:
            raise ManifestError(
                "topology.total_kv_heads", total_kv_heads, f"is not divisible by tp_size {tp_size}"
            )
        per_rank = total_kv_heads // tp_size
        return tuple(range(tp_rank * per_rank, (tp_rank + 1) * per_rank))
    return (tp_rank * total_kv_heads // tp_size,)


def token_positions(topology: Topology, block_tokens: int) -> tuple[int, ...]:
    """Each local slot's token position among the ``block_tokens * dcp_size * pcp_size``
    tokens a block stands for, under the topology's context parallelism (vLLM's placement:
    slot ``s`` of the rank at position ``c`` holds ``(s // I * W + c) * I + s % I``); see
    ``safeview.manifest.canonical``."""
    from safeview.manifest.canonical import token_positions as positions

    return positions(topology, block_tokens)


def canonical_bytes(manifest: Manifest, layer: str) -> Any:
    """For each byte of ``layer``'s local page, its byte in vLLM's canonical page (all KV
    heads, all ``block tokens * dcp * pcp`` tokens, in the page's own encoding), ``-1`` where
    it has none: a numpy int64 array of ``page_bytes``. See ``safeview.manifest.canonical``."""
    from safeview.manifest.canonical import canonical_bytes as mapping

    return mapping(manifest, layer)


# -- building a layer from a geometry (no torch) ---------------------------------------------

AxesSpec = (
    Sequence[str] | Mapping[str, Sequence[str]] | Callable[[str, Sequence[int]], Sequence[str]]
)


def _axes_for(axes: AxesSpec, layer: str, shape: Sequence[int]) -> tuple[str, ...]:
    where = "axes"
    if callable(axes):
        names = axes(layer, shape)
        where = f"axes({layer!r}, {tuple(shape)})"
    elif isinstance(axes, Mapping):
        if layer not in axes:
            raise ManifestError(f"axes[{layer!r}]", None, "is missing: no meaning given")
        names = axes[layer]
        where = f"axes[{layer!r}]"
    else:
        names = axes
    if isinstance(names, str):
        names = names.replace(",", " ").split()
    if not isinstance(names, Sequence) or not all(isinstance(name, str) for name in names):
        raise ManifestError(
            where,
            names if isinstance(names, Sequence) else type(names).__name__,
            "is not axis names (a sequence of str, a mapping of them by layer, or a callable "
            "(name, shape) -> them)",
        )
    return tuple(names)


def layer_from_geometry(
    name: str,
    *,
    axes: Sequence[str],
    shape: Sequence[int],
    strides_elements: Sequence[int],
    byte_offset: int,
    dtype: str,
    heads: Sequence[int] | None = None,
    kind: LayerKind | None = None,
    group: int | str | None = None,
    parts: PartsSpec | None = None,
    companions: Sequence[Companion | Mapping[str, Any]] = (),
    scalars: Mapping[str, float] | None = None,
) -> Layer:
    """A ``Layer`` from a tensor's geometry (shape, strides in elements, first byte) and the
    meaning of each of its dimensions; ``parts`` (``Part``s or their dicts) name what each
    row holds, ``companions`` the tensors tied to it, ``scalars`` values carried by value
    (``k_scale``). Errors name the layer and the axis, or the part."""
    where = f"layers[{name!r}]"
    if dtype not in DTYPE_ITEMSIZE:
        raise ManifestError(f"{where}.dtype", dtype, "is not a dtype safeview knows")
    itemsize = DTYPE_ITEMSIZE[dtype]
    if len(axes) != len(shape):
        raise ManifestError(
            f"{where}.axes", list(axes), f"names {len(axes)} axes; the tensor has {len(shape)}"
        )
    block: tuple[int, int] | None = None
    found: list[tuple[str, int, int]] = []  # (meaning, size, stride in bytes)
    for position, (meaning, size, stride) in enumerate(zip(axes, shape, strides_elements)):
        at = f"{where}.axes[{position}]"
        if meaning not in AXIS_NAMES:
            raise ManifestError(
                at, meaning, f"is an axis of unknown meaning (known: {', '.join(AXIS_NAMES)})"
            )
        stride_bytes = int(stride) * itemsize
        if meaning == "block":
            if block is not None:
                raise ManifestError(at, meaning, "is a second block axis")
            block = (int(size), stride_bytes)
        elif meaning == "unit":
            if size != 1:
                raise ManifestError(at, size, "is the size of a 'unit' axis; it must be 1")
        elif meaning == "state":  # a state's bytes: an element axis of a state layer
            found.append(("element", int(size), stride_bytes))
            kind = kind or "state"
        elif meaning == "kv|element":
            if size % 2:
                raise ManifestError(at, size, "is the size of a fused K|V axis; it must be even")
            found.append(("kv", 2, stride_bytes * (size // 2)))
            found.append(("element", size // 2, stride_bytes))
        else:
            found.append((meaning, int(size), stride_bytes))
    if block is None:
        raise ManifestError(f"{where}.axes", list(axes), "names no block axis")
    meanings = [meaning for meaning, _, _ in found]
    for meaning in set(meanings):
        if meanings.count(meaning) > 1:
            raise ManifestError(f"{where}.axes", list(axes), f"names {meaning!r} twice")
    if kind is None:
        kind = "attention" if "kv" in meanings else "latent"
    extras = _extras(where, parts, companions, scalars)
    try:
        return _layer(where, found, kind, dtype, itemsize, group, block, byte_offset, heads, extras)
    except ValidationError as error:  # a count past MAX_BYTES, a kind of no meaning
        raise _refused(error, where, ".") from None


PartsSpec = Sequence[Part | Mapping[str, Any]]


def _extras(
    where: str,
    parts: PartsSpec | None,
    companions: Sequence[Companion | Mapping[str, Any]],
    scalars: Mapping[str, float] | None,
) -> dict[str, Any]:
    """``parts``, ``companions`` and ``scalars`` as a ``Layer`` holds them; ``ManifestError``
    naming the layer and the part for one that is no part."""
    found: dict[str, Any] = {}
    if parts:
        if isinstance(parts, (str, Mapping)) or not isinstance(parts, Sequence):
            raise ManifestError(f"{where}.parts", type(parts).__name__, "is not a list of parts")
        found["parts"] = tuple(parts)  # validated by the Layer: its errors name the part
    if companions:
        found["companions"] = tuple(companions)
    if scalars:
        found["scalars"] = dict(scalars)
    return found


def _layer(
    where: str,
    found: list[tuple[str, int, int]],
    kind: LayerKind,
    dtype: str,
    itemsize: int,
    group: int | str | None,
    block: tuple[int, int],
    byte_offset: int,
    heads: Sequence[int] | None,
    extras: Mapping[str, Any] | None = None,
) -> Layer:
    num_blocks, block_stride = block
    page_axes, chunk, page = _nest(where, found, itemsize, num_blocks, block_stride)
    head_size = next((size for meaning, size, _ in found if meaning == "head"), None)
    if head_size is None:  # a page whose parts lay heads out themselves (vLLM's NVFP4)
        head_size = _part_heads((extras or {}).get("parts", ()))
    if head_size is not None and head_size > MAX_HEADS:
        raise ManifestError(f"{where}.axes", f"head {head_size}", f"holds more than {MAX_HEADS:,}")
    if kind == "latent":
        held: tuple[int, ...] = ()
    elif heads is not None:
        held = tuple(int(h) for h in heads)
        if head_size is not None and len(held) != head_size:
            raise ManifestError(
                f"{where}.heads",
                list(held),
                f"are not as many as the head axis holds ({head_size})",
            )
    else:
        held = tuple(range(head_size or 1))
    return Layer(
        kind=kind,
        dtype=dtype,
        itemsize=itemsize,
        group=group,
        num_blocks=num_blocks,
        block_stride_bytes=block_stride,
        byte_offset=int(byte_offset),
        page_bytes=page,
        chunk_bytes=chunk,
        axes=page_axes,
        heads=held if kind != "latent" else (),
        **(extras or {}),
    )


def _part_heads(parts: Iterable[Part | Mapping[str, Any]]) -> int | None:
    """The heads a page's parts lay out through their ``index``, where the page has no head
    axis of its own; ``None`` where none does."""
    found = None
    for part in parts:
        index = part.index if isinstance(part, Part) else (part or {}).get("index")
        for axis, size in index or ():
            if axis == "head" and isinstance(size, int):
                found = max(found or 0, size)
    return found


def _nest(
    where: str,
    found: list[tuple[str, int, int]],
    itemsize: int,
    num_blocks: int,
    block_stride: int,
) -> tuple[tuple[PageAxis, ...], int, int]:
    """Physical order from strides, innermost first: each axis must hold the whole span of the
    axes inside it (a page never overlaps itself); an axis whose stride reaches past every block
    lies outside the block axis (``outer``: K and V pages apart, ``(2, num_blocks, ...)``)."""
    units = sorted((m for m in found if m[1] == 1), key=lambda m: AXIS_NAMES.index(m[0]))
    real = sorted((m for m in found if m[1] > 1), key=lambda m: m[2])
    blocks_end = block_stride * num_blocks if num_blocks > 1 else None
    span = itemsize
    inner: list[tuple[str, int, int]] = []
    outer: list[tuple[str, int, int]] = []
    for meaning, size, stride in real:
        is_outer = blocks_end is not None and stride >= blocks_end
        if is_outer and not outer:
            if span > block_stride:
                raise ManifestError(
                    f"{where}.block_stride_bytes",
                    block_stride,
                    f"is smaller than one block's chunk ({span} bytes): blocks overlap",
                )
            span = (num_blocks - 1) * block_stride + span  # the blocks lie inside it
        if stride < span:
            raise ManifestError(
                f"{where}.axes",
                f"{meaning} (stride {stride} bytes)",
                f"overlaps the axes inside it, which span {span} bytes: strides do not nest",
            )
        (outer if is_outer else inner).append((meaning, size, stride))
        if not is_outer and outer:
            raise ManifestError(f"{where}.axes", meaning, "lies inside an axis outside the block")
        span = (size - 1) * stride + span
    chunk = itemsize
    for _, size, stride in inner:
        chunk = (size - 1) * stride + chunk
    if blocks_end is not None and not outer and chunk > block_stride:
        raise ManifestError(
            f"{where}.block_stride_bytes",
            block_stride,
            f"is smaller than one block's page ({chunk} bytes): blocks overlap",
        )
    chunks = 1
    for _, size, _ in outer:
        chunks *= size
    axes = [PageAxis(axis=m, size=s, stride_bytes=0) for m, s, _ in units]
    axes += [PageAxis(axis=m, size=s, stride_bytes=st, outer=True) for m, s, st in reversed(outer)]
    axes += [PageAxis(axis=m, size=s, stride_bytes=st) for m, s, st in reversed(inner)]
    return tuple(axes), chunk, chunk * chunks


# -- from tensors ---------------------------------------------------------------------------


def _topology(topology: Topology | Mapping[str, Any] | None) -> Topology:
    if topology is None:
        return Topology()
    if isinstance(topology, Topology):
        return topology
    if not isinstance(topology, Mapping):
        raise ManifestError("topology", type(topology).__name__, "is not a Topology or a mapping")
    validated: Topology = _validated(Topology, dict(topology), "topology", ".")
    return validated


def _held_heads(topology: Topology, head_size: int | None) -> tuple[int, ...] | None:
    if topology.heads is not None:
        return topology.heads
    if head_size is None:
        return None
    return layer_heads(topology.tp_rank, topology.tp_size, topology.total_kv_heads, head_size)


def layer_heads(
    tp_rank: int, tp_size: int, total_kv_heads: int | None, local_heads: int
) -> tuple[int, ...]:
    """The global KV heads of one layer that a rank holds, its head axis ``local_heads`` long:
    the rank's share of the model's ``total_kv_heads`` (``heads_of_rank``) when that is as many;
    else the layer has a head count of its own (a model whose layers hold different numbers of
    KV heads, two page sizes in one cache), and the rank holds its share of
    ``local_heads * tp_size`` (heads belong to the layer, not to the model)."""
    if total_kv_heads is not None:
        held = heads_of_rank(tp_rank, tp_size, total_kv_heads)
        if len(held) == local_heads:
            return held
    return heads_of_rank(tp_rank, tp_size, local_heads * tp_size)


def describe(
    kv_caches: Mapping[str, torch.Tensor],
    *,
    axes: AxesSpec,
    topology: Topology | Mapping[str, Any] | None = None,
    groups: Mapping[str, int | str] | None = None,
    kinds: Mapping[str, LayerKind] | None = None,
    parts: PartsSpec | Mapping[str, PartsSpec] | None = None,
    companions: Mapping[str, Sequence[Companion | Mapping[str, Any]]] | None = None,
    scalars: Mapping[str, float] | Mapping[str, Mapping[str, float]] | None = None,
) -> Manifest:
    """The manifest of an engine's KV caches (layer name -> tensor, as the engine holds them),
    read off each tensor's strides, storage offset and element size; works on ``meta``.

    ``axes`` gives the meaning of each dimension in shape order: one tuple for every layer
    (``("block", "head", "token", "kv|element")``, which is ``vllm_axes()``), a mapping by
    layer, or a callable ``(name, shape) -> axes``. ``topology`` (a ``Topology`` or a dict)
    says which rank this is; the global heads a rank holds default to vLLM's sharding over
    ``total_kv_heads`` (``heads_of_rank``). ``ManifestError`` names the layer and the axis of
    anything that cannot be derived.

    ``parts`` names what each row holds (``Part``s or their dicts: ``data``, ``scale``,
    ``rope``, ``pad``, a state's segments; one list for every layer, or a mapping by layer),
    ``companions`` the tensors tied to a layer (by layer), ``scalars`` values carried by value
    (``{"k_scale": 1.0}`` for every layer, or a mapping by layer); see ``safeview.manifest.
    _parts`` and docs/layouts.md. A layer without parts reads as one ``data`` part."""
    return derive(
        kv_caches, axes=axes, topology=topology, groups=groups, kinds=kinds, parts=parts,
        companions=companions, scalars=scalars,
    ).manifest()  # fmt: skip


def derive(
    kv_caches: Mapping[str, torch.Tensor],
    *,
    axes: AxesSpec,
    topology: Topology | Mapping[str, Any] | None = None,
    groups: Mapping[str, int | str] | None = None,
    kinds: Mapping[str, LayerKind] | None = None,
    parts: PartsSpec | Mapping[str, PartsSpec] | None = None,
    companions: Mapping[str, Sequence[Companion | Mapping[str, Any]]] | None = None,
    scalars: Mapping[str, float] | Mapping[str, Mapping[str, float]] | None = None,
) -> Derived:
    """What ``describe`` reads, before a ``Layer`` is built for each layer: see ``Derived``."""
    from safeview import _torch

    known = _topology(topology)
    if not isinstance(kv_caches, Mapping):
        raise ManifestError("kv_caches", type(kv_caches).__name__, "is not a mapping of tensors")
    _by_layer(groups, "groups", lambda value: isinstance(value, (int, str)), "an int or a str")
    _by_layer(kinds, "kinds", lambda value: value in _KINDS, f"one of {', '.join(_KINDS)}")
    entries: list[tuple[str, Layer, int]] = []
    fixed = None if callable(axes) or isinstance(axes, Mapping) else _axes_for(axes, "", ())
    # layers of one shape differ only in where they lie: each page is derived once
    seen: dict[tuple[Any, ...], Layer] = {}
    # parts, companions and scalars the same for every layer: resolved once, not per layer
    by_layer = (
        isinstance(parts, Mapping)
        or companions is not None
        or (isinstance(scalars, Mapping) and any(isinstance(v, Mapping) for v in scalars.values()))
    )
    shared = None if by_layer else _extras_of("", parts, None, scalars)
    shared_ids = () if shared is None else tuple(map(id, shared))
    for name, tensor in kv_caches.items():
        if not isinstance(name, str):
            raise ManifestError("kv_caches", name, "has a key that is not a layer name (a str)")
        if not _torch.is_strided_tensor(tensor):
            raise ManifestError(
                f"kv_caches[{name!r}]", type(tensor).__name__, "is not a strided torch.Tensor"
            )
        names = fixed if fixed is not None else _axes_for(axes, name, tuple(tensor.shape))
        kind = kinds.get(name) if kinds else None
        group = groups.get(name) if groups else None
        if shared is None:
            extra = _extras_of(name, parts, companions, scalars)
            ids = tuple(map(id, extra))
        else:
            extra, ids = shared, shared_ids
        key = (names, tensor.dtype, tensor.shape, tensor.stride(), kind, group, ids)
        template = seen.get(key)
        if template is None:
            geometry = _torch.geometry(tensor)
            head_size = next(
                (size for meaning, size in zip(names, geometry.shape) if meaning == "head"), None
            )
            template = seen[key] = layer_from_geometry(
                name,
                axes=names,
                shape=geometry.shape,
                strides_elements=geometry.strides,
                byte_offset=geometry.byte_offset,
                dtype=_torch.dtype_name(tensor.dtype),
                heads=_held_heads(known, head_size),
                kind=kind,
                group=group,
                parts=extra[0],
                companions=extra[1] or (),
                scalars=extra[2],
            )
        entries.append((name, template, _torch.byte_offset(tensor)))
    return Derived(_finished(known, seen.values()), entries)


_KINDS: tuple[str, ...] = ("attention", "latent", "state")


def _extras_of(name: str, parts: Any, companions: Any, scalars: Any) -> tuple[Any, Any, Any]:
    """A layer's parts, companions and scalars: ``parts`` and ``scalars`` given once for
    every layer or by layer name, ``companions`` by layer name. The very objects given, so
    that layers given the same ones share a page (``derive`` keys its templates by them)."""
    if isinstance(parts, Mapping):
        parts = parts.get(name)
    if isinstance(scalars, Mapping) and any(isinstance(v, Mapping) for v in scalars.values()):
        scalars = scalars.get(name)
    if companions is not None and not isinstance(companions, Mapping):
        raise ManifestError("companions", type(companions).__name__, "is not a mapping by layer")
    return parts, (companions or {}).get(name), scalars


def _by_layer(given: Any, what: str, valid: Callable[[Any], bool], limit: str) -> None:
    """``groups`` and ``kinds``: ``None`` or a mapping by layer name of valid values."""
    if given is None:
        return
    if not isinstance(given, Mapping):
        raise ManifestError(what, type(given).__name__, "is not a mapping by layer name")
    for name, value in given.items():
        if isinstance(value, bool) or not valid(value):
            raise ManifestError(f"{what}[{name!r}]", value, f"is not {limit}")


class Derived:
    """A manifest read off tensors, held as one ``Layer`` per page shape and each layer's name
    and first byte. Its ``fingerprint`` and its JSON text (``to_json()``: the text the
    ``Manifest`` writes, byte for byte) are made without a ``Layer`` per layer, which is what a
    registration pays for (the vLLM plugin writes the text at start-up); ``manifest()`` builds
    the ``Manifest`` on first use."""

    def __init__(self, topology: Topology, entries: list[tuple[str, Layer, int]]):
        self.topology = topology
        if topology.stage_layers is not None or topology.cp_size > 1:
            _placement_checked(topology, entries)
        self.fingerprint = _fingerprint_of(
            ((name, t.fingerprint) for name, t, _ in entries), topology
        )
        self._entries = entries
        self._manifest: Manifest | None = None

    def manifest(self) -> Manifest:
        if self._manifest is None:
            layers = {
                name: template if template.byte_offset == at else _at(template, at)
                for name, template, at in self._entries
            }
            self._manifest = Manifest.model_construct(
                topology=self.topology, layers=layers, fingerprint=self.fingerprint
            )
        return self._manifest

    def file_name(self) -> str:
        return _file_name(self.topology)

    def to_json(self, indent: int | None = None) -> str:
        if indent is not None or self._manifest is not None:
            return self.manifest().to_json(indent=indent)
        head = Manifest.model_construct(
            topology=self.topology, layers={}, fingerprint=self.fingerprint
        ).to_json(indent=None)
        before, _, after = head.partition('"layers":{}')
        pieces: dict[int, tuple[str, str] | None] = {}
        parts = []
        for name, template, at in self._entries:
            if id(template) not in pieces:  # its text, split where its first byte goes
                pieces[id(template)] = _around_offset(template)
            piece = pieces[id(template)]
            if piece is None:
                return self.manifest().to_json(indent=None)
            parts.append(f"{_json_string(name)}:{piece[0]}{at}{piece[1]}")
        return f'{before}"layers":{{{",".join(parts)}}}{after}'


def _placement_checked(topology: Topology, entries: list[tuple[str, Layer, int]]) -> None:
    """The checks ``Manifest`` makes of its topology against its layers (one global index per
    layer, none twice in a group; an interleave that divides every block), for a manifest
    built without validation; ``ManifestError`` naming the field."""
    try:
        named = ((name, template.group) for name, template, _ in entries)
        _stage_layers_checked(topology, len(entries), named)
        if topology.cp_size > 1:
            seen: set[int] = set()
            for name, template, _ in entries:
                if id(template) not in seen:  # layers of one page shape: checked once
                    seen.add(id(template))
                    _interleave_checked(topology, name, template.size_of("token"), template.kind)
    except ValueError as error:
        field, _, limit = str(error).partition(" ")
        raise ManifestError(field, None, limit) from None


_json_string = json.JSONEncoder(ensure_ascii=False).encode
# a first byte no layer has: it marks where each layer's goes in its page's text
_MARK = 8_070_450_532_247_928_831


def _around_offset(template: Layer) -> tuple[str, str] | None:
    text = _at(template, _MARK).model_dump_json()
    before, mark, after = text.partition(f'"byte_offset":{_MARK}')
    return None if not mark or str(_MARK) in after else (f'{before}"byte_offset":', after)


def _at(layer: Layer, byte_offset: int) -> Layer:
    """``layer`` at another first byte: a shallow copy made as pydantic's own ``__copy__``
    makes one (``model_copy`` costs 5 us, three times a whole layer's share of a
    registration); the page's meaning and its fingerprint do not depend on the offset."""
    clone = Layer.__new__(Layer)
    fields = layer.__dict__.copy()
    fields["byte_offset"] = byte_offset
    object.__setattr__(clone, "__dict__", fields)
    object.__setattr__(clone, "__pydantic_extra__", None)
    object.__setattr__(clone, "__pydantic_fields_set__", layer.__pydantic_fields_set__)
    object.__setattr__(clone, "__pydantic_private__", None)
    return clone


def _finished(topology: Topology, shapes: Iterable[Layer]) -> Topology:
    """``topology`` with the kernel's block tokens, when it does not say and the layers agree."""
    tokens = {layer.size_of("token") for layer in shapes}
    if topology.kernel_block_tokens is None and len(tokens) == 1:
        return topology.model_copy(update={"kernel_block_tokens": tokens.pop()})
    return topology


def vllm_axes(kind: Literal["attention", "mla", "mamba"] = "attention") -> tuple[str, ...]:
    """The meaning of vLLM 0.33's per-layer cache dimensions: every layout (``LBHNC``,
    ``LBNHC``, ``BLHNC``, ...) is a ``[B, H, N, C]`` view whose strides carry the physical
    order; attention packs K and V side by side in C, MLA stores one latent vector per token
    (H is 1), and a Mamba state is ``[B, 1, 1, state bytes]``."""
    if kind == "attention":
        return ("block", "head", "token", "kv|element")
    if kind == "mla":
        return ("block", "unit", "token", "element")
    return ("block", "unit", "unit", "state")


# -- a connector's assumed format -----------------------------------------------------------

_FORMAT_AXES = {
    "TWO": "kv",
    "NB": "block",
    "BS": "token",
    "NH": "head",
    "HS": "element",
    "2HS": "kv|element",
    "TWOHS": "kv|element",
}


def _format_axes(format: str) -> tuple[str, ...]:
    parts = format.upper().split("_")
    if parts[:2] == ["NL", "X"]:  # LMCache: a list of per-layer tensors
        parts = parts[2:]
    names = []
    for at, part in enumerate(parts):
        if part == "NBBS":  # blocks and their tokens flattened into one axis
            names += ["block", "token"]
            continue
        if part not in _FORMAT_AXES:
            raise ManifestError(
                f"format[{at}]",
                part,
                f"is not an axis safeview knows (known: {', '.join(_FORMAT_AXES)}, NBBS, "
                "after an optional NL_X_)",
            )
        names.append(_FORMAT_AXES[part])
    return tuple(names)


def assumed(
    format: str,
    *,
    layers: Iterable[str],
    num_blocks: int,
    block_tokens: int,
    num_heads: int,
    head_size: int,
    dtype: str,
    topology: Topology | Mapping[str, Any] | None = None,
    layer_bytes: int | None = None,
) -> Manifest:
    """The manifest of what a connector assumes: each layer a dense tensor in ``format``'s
    axis order (LMCache style, ``NL_X_TWO_NB_BS_NH_HS``: per layer, K/V outermost, then
    blocks, tokens, heads, elements; ``NBBS`` is blocks and tokens flattened into one axis;
    ``NB_NH_BS_2HS`` is vLLM's HND with K|V fused), diffable
    against an engine's derived manifest before a byte is copied. No torch.

    Layers are laid out one after another, each ``layer_bytes`` apart (default: dense). After
    ``NL_X_`` (a list of per-layer tensors) each layer is read from its own first byte,
    wherever the engine's lies: the topology's ``layout`` is the format (unless given), which
    tells ``diff``'s ``in_place`` rule so."""
    if not isinstance(format, str):
        raise ManifestError("format", type(format).__name__, "is not a str")
    named = _named_format(format)
    for field, value in (
        ("num_blocks", num_blocks),
        ("block_tokens", block_tokens),
        ("num_heads", num_heads),
        ("head_size", head_size),
        ("layer_bytes", 1 if layer_bytes is None else layer_bytes + 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value < MAX_BYTES:
            shown = layer_bytes if field == "layer_bytes" else value
            raise ManifestError(field, shown, "is not a count from 1 to 2**62 - 1")
    if isinstance(layers, str):
        raise ManifestError("layers", _short(layers), "is one str: give a list of layer names")
    if named is not None:
        return _assumed_named(
            format, named, list(layers), num_blocks, block_tokens, num_heads, head_size, dtype,
            _topology(topology), layer_bytes,
        )  # fmt: skip
    names = _format_axes(format)
    sizes = {
        "kv": 2,
        "block": num_blocks,
        "token": block_tokens,
        "head": num_heads,
        "element": head_size,
        "kv|element": 2 * head_size,
    }
    if dtype not in DTYPE_ITEMSIZE:
        raise ManifestError("dtype", dtype, "is not a dtype safeview knows")
    shape = [sizes[name] for name in names]
    strides = [1] * len(shape)
    for at in range(len(shape) - 2, -1, -1):
        strides[at] = strides[at + 1] * shape[at + 1]
    per_layer = strides[0] * shape[0] * DTYPE_ITEMSIZE[dtype] if shape else 0
    known = _topology(topology)
    if format.upper().startswith("NL_X_") and known.layout is None:
        known = known.model_copy(update={"layout": format.upper()})
    head_count = num_heads if "head" in names else None
    built: dict[str, Layer] = {}
    for index, name in enumerate(layers):
        if not isinstance(name, str):
            raise ManifestError(f"layers[{index}]", name, "is not a layer name (a str)")
        built[name] = layer_from_geometry(
            name,
            axes=names,
            shape=shape,
            strides_elements=strides,
            byte_offset=index * (layer_bytes if layer_bytes is not None else per_layer),
            dtype=dtype,
            heads=_held_heads(known, head_count),
        )
    if not built:
        raise ManifestError("layers", [], "is empty: a manifest needs a layer")
    entries = [(name, layer, layer.byte_offset) for name, layer in built.items()]
    return Derived(_finished(known, built.values()), entries).manifest()


# -- named formats (issue 37): Dynamo KVBM, FlexKV, vLLM, LMCache's other EngineKVFormat names --

_LMCACHE_DIMS = {"TWO": "K", "NB": "B", "BS": "T", "NH": "H", "HS": "E", "NBBS": "BT", "ONE": "1",
                 "CS": "C", "2HS": "C", "TWOHS": "C", "NL": "L"}  # fmt: skip


def _named_format(format: str) -> NamedFormat | None:
    """The ``NamedFormat`` of ``format``: a name of ``FORMATS``, or an LMCache
    ``EngineKVFormat`` name the plain axis reading (``_format_axes``) does not cover (a
    layer axis inside the block, ``ONE``, ``CS``, the DSA indexer's ``BSV_BSS``); ``None``
    for the plain ones. ``ManifestError`` for an LMCache name whose bytes are not one dense
    order per layer."""
    from safeview.manifest._formats import (
        FORMATS,
        LMCACHE_BSV_BSS,
        LMCACHE_BSV_BSS_FORMAT,
        LMCACHE_NOT_DENSE,
    )

    if format in FORMATS:
        return FORMATS[format]
    upper = format.upper()
    source = "lmcache/lmcache_native.pyi (EngineKVFormat, LMCache 0.5.6)"
    if upper in LMCACHE_NOT_DENSE:
        raise ManifestError(
            "format",
            format,
            f"is not one dense order of bytes per layer: {LMCACHE_NOT_DENSE[upper]}",
        )
    if upper == LMCACHE_BSV_BSS:
        return LMCACHE_BSV_BSS_FORMAT
    tokens = upper.split("_")
    per_layer = tokens[:2] == ["NL", "X"]
    body = tokens[2:] if per_layer else tokens
    if not ({"ONE", "CS", "NL"} & set(body)):
        return None  # the plain reading (_format_axes)
    dims = ""
    for at, token in enumerate(body):
        if token not in _LMCACHE_DIMS:
            raise ManifestError(
                f"format[{at}]",
                token,
                f"is not an axis safeview knows (known: {', '.join(_LMCACHE_DIMS)})",
            )
        dims += _LMCACHE_DIMS[token]
    latent = "K" not in dims and "C" not in dims
    return NamedFormat(dims, source, per_layer=per_layer, latent=latent)


def _assumed_named(
    format: str,
    named: NamedFormat,
    layers: list[str],
    num_blocks: int,
    block_tokens: int,
    num_heads: int,
    head_size: int,
    dtype: str,
    known: Topology,
    layer_bytes: int | None,
) -> Manifest:
    """The manifest of a named format (``_formats.FORMATS``): every layer a slice of one dense
    tensor in the format's dimension order (``L`` the layer), or, ``per_layer``, a dense tensor
    of its own, laid one after another ``layer_bytes`` apart (default: dense)."""
    if not layers:
        raise ManifestError("layers", [], "is empty: a manifest needs a layer")
    parts: list[dict[str, Any]] | None = None
    row = head_size
    if named.page is not None:  # parts over a block's tokens and heads (NVFP4, DSA indexer)
        parts, row = named.page(num_heads, block_tokens, head_size)
        dtype = "uint8"
    elif named.row is not None:
        parts, row = named.row(head_size, dtype)
        dtype = "uint8"
    if dtype not in DTYPE_ITEMSIZE:
        raise ManifestError("dtype", dtype, "is not a dtype safeview knows")
    sizes = {"L": len(layers), "B": num_blocks, "K": 2, "T": block_tokens, "H": num_heads,
             "E": row, "C": 2 * row, "1": 1}  # fmt: skip
    shape = [sizes[d] for d in named.dims]
    strides = [1] * len(shape)
    for at in range(len(shape) - 2, -1, -1):
        strides[at] = strides[at + 1] * shape[at + 1]
    itemsize = DTYPE_ITEMSIZE[dtype]
    whole = strides[0] * shape[0] * itemsize
    keep = [at for at, d in enumerate(named.dims) if d != "L"]
    axes = [_FORMAT_DIM_AXES[named.dims[at]] for at in keep]
    layer_at = named.dims.find("L")
    if known.layout is None:
        known = known.model_copy(update={"layout": format})
    head_count = num_heads if "H" in named.dims or named.page is not None else None
    built: dict[str, Layer] = {}
    for index, name in enumerate(layers):
        if not isinstance(name, str):
            raise ManifestError(f"layers[{index}]", name, "is not a layer name (a str)")
        if layer_at >= 0:
            offset = index * strides[layer_at] * itemsize
        else:
            offset = index * (layer_bytes if layer_bytes is not None else whole)
        built[name] = layer_from_geometry(
            name,
            axes=axes,
            shape=[shape[at] for at in keep],
            strides_elements=[strides[at] for at in keep],
            byte_offset=offset,
            dtype=dtype,
            heads=None if named.latent else _held_heads(known, head_count),
            kind="latent" if named.latent else None,
            parts=parts,
        )
    entries = [(name, layer, layer.byte_offset) for name, layer in built.items()]
    return Derived(_finished(known, built.values()), entries).manifest()


_FORMAT_DIM_AXES = {"B": "block", "K": "kv", "T": "token", "H": "head", "E": "element",
                    "C": "kv|element", "1": "unit"}  # fmt: skip
