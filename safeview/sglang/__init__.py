"""Everything that knows SGLang's names: its KV pools read into a manifest, and its plugin.

``describe_pool(pool, topology=...)`` reads an SGLang 0.5.23 token-to-KV pool off its tensors'
strides into a ``safeview.Manifest``: an MHA pool (``MHATokenToKVPool``: ``k_buffer[i]`` and
``v_buffer[i]``, ``[slots, heads, head_dim]`` each) is one ``attention`` layer per model layer,
named ``layers.{layer_id}``, a page being ``page_size`` token slots, K and V its outer ``kv``
axis when both halves lie in one allocation (as 0.5.23 allocates them when K and V have one
shape); else K and V are two layers, ``layers.{layer_id}.k`` and ``.v``. An MLA pool
(``kv_buffer[i]``, ``[slots, 1, latent]``) is one ``latent`` layer per model layer. The dtype is
the pool's (``float8_e4m3fn`` where SGLang stores fp8 as ``uint8``). A sliding-window pool
(``SWAKVPool``) is its full-attention pool's layers and its window pool's, ``swa.layers.{i}``.

``install()`` is the entry point in SGLang's ``sglang.srt.plugins`` group, which SGLang's
``load_plugins()`` runs early in every scheduler process: it puts safeview on SGLang's Mooncake
disaggregation classes in the calling process (``safeview.sglang._mooncake``). ``SAFEVIEW_SGLANG=0``
turns it off; ``SAFEVIEW_BOUNDS_POLICY`` says strict, warn or off. SGLang is imported only when
one of these runs.
"""

from __future__ import annotations

import functools
import os
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from safeview import _torch, log
from safeview.errors import ArgumentError, ManifestError
from safeview.manifest import Layer, Manifest, Topology, layer_from_geometry
from safeview.transfer import MemoryMap, StorageSpan, ViewSpan

__all__ = [
    "ENV_SGLANG",
    "KNOWN_VERSIONS",
    "describe_pool",
    "install",
    "pool_buffers",
    "pool_memory_map",
]

ENV_SGLANG = "SAFEVIEW_SGLANG"
KNOWN_VERSIONS = ("0.5.23",)
"""SGLang releases whose pools and Mooncake manager ``safeview.sglang`` follows."""

_PATCHED = "__safeview_guarded__"


@functools.cache
def sglang_version() -> str:
    """The installed SGLang's version, or why there is none (for events; never raises; read
    once a process: the package metadata lookup costs milliseconds)."""
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:  # not installed is an unknown SGLang too
        return "not installed"


# -- the pools ---------------------------------------------------------------------------------


class Buffer:
    """One tensor SGLang registers for transfer: its name in the manifest's terms
    (``layers.3.k``), the tensor, the bytes of one page of it (SGLang's ``item_len``), its
    pages, and its place in its storage and that storage (``facts``: its address and length),
    as read when the buffer was listed: each buffer is read once per listing."""

    __slots__ = ("facts", "geometry", "item_bytes", "name", "pages", "tensor")

    def __init__(
        self,
        name: str,
        tensor: Any,
        item_bytes: int,
        pages: int,
        geometry: _torch.Geometry,
        facts: _torch.StorageFacts,
    ) -> None:
        self.name = name
        self.tensor = tensor
        self.item_bytes = item_bytes
        self.pages = pages
        self.geometry = geometry
        self.facts = facts


def _layer_ids(pool: Any, count: int) -> list[int]:
    start = getattr(pool, "start_layer", None) or 0
    return [int(start) + index for index in range(count)]


def _slots_geometry(name: str, tensor: Any) -> _torch.Geometry:
    """A ``[slots, ...]`` buffer's geometry; ``ArgumentError`` for anything else."""
    if not _torch.is_strided_tensor(tensor) or tensor.dim() < 2:
        raise ArgumentError(
            f"SGLang buffer {name!r} must be a [slots, ...] tensor; got "
            f"{type(tensor).__name__} {tuple(getattr(tensor, 'shape', ()))}"
        )
    return _torch.geometry(tensor)


def _pages_of(geometry: _torch.Geometry, page_size: int) -> tuple[int, list[int], list[int]]:
    """``(pages, page shape, page strides)`` of a ``[slots, ...]`` buffer, in elements: a page is
    ``page_size`` consecutive slots (SGLang's NHD rows)."""
    _, shape, strides, _ = geometry
    return int(shape[0]) // page_size, [page_size, *shape[1:]], [strides[0], *strides[1:]]


def _named_tensors(pool: Any) -> list[tuple[str, Any]]:
    """The tensors an SGLang pool registers for transfer, in the order of its
    ``get_contiguous_buf_infos()``, each with its name; ``ArgumentError`` for a pool of another
    kind."""
    if hasattr(pool, "k_buffer") and hasattr(pool, "v_buffer"):
        ids = _layer_ids(pool, len(pool.k_buffer))
        named = [(f"layers.{i}.k", t) for i, t in zip(ids, pool.k_buffer)]
        named += [(f"layers.{i}.v", t) for i, t in zip(ids, pool.v_buffer)]
        return named
    if hasattr(pool, "kv_buffer"):
        ids = _layer_ids(pool, len(pool.kv_buffer))
        return [(f"layers.{i}", t) for i, t in zip(ids, pool.kv_buffer)]
    if _is_mamba(pool):
        return _mamba_tensors(pool)
    raise ArgumentError(
        f"{type(pool).__name__} is not an SGLang MHA or MLA token-to-KV pool "
        "(no k_buffer/v_buffer, no kv_buffer)"
    )


def _is_mamba(pool: Any) -> bool:
    """Whether ``pool`` is an SGLang ``MambaPool`` (its per-request conv and temporal states)."""
    return hasattr(pool, "mamba_cache") and hasattr(pool, "_iter_transfer_state_entries")


def _mamba_tensors(pool: Any) -> list[tuple[str, Any]]:
    """A ``MambaPool``'s state tensors as SGLang registers them (``get_contiguous_buf_infos``:
    per field, per state tensor, per Mamba layer, ``[slots, ...]`` each), named
    ``{field}.layers.{layer id}`` (``conv.layers.0``, ``temporal.layers.0``; a field's second
    tensor ``conv1.layers.0``), the layer id SGLang's global one."""
    named: list[tuple[str, Any]] = []
    seen: dict[str, int] = {}
    for field, tensor, _axis, layer_id in pool._iter_transfer_state_entries():
        key = f"{field}.layers.{int(layer_id)}"
        count = seen[key] = seen.get(key, -1) + 1
        named.append((f"{field}{count or ''}.layers.{int(layer_id)}", tensor))
    return named


def pool_buffers(pool: Any, *, prefix: str = "") -> list[Buffer]:
    """The buffers an SGLang pool registers for transfer, in the order of its
    ``get_contiguous_buf_infos()`` (every K, then every V; an MLA pool's one per layer), named as
    ``describe_pool`` names the layers they belong to (``prefix`` first: ``swa.layers.0.k``). A
    ``MambaPool``'s pages are its request slots."""
    page_size = 1 if _is_mamba(pool) else _page_size(pool)
    found = []
    for name, tensor in _named_tensors(pool):  # a hot loop: once per buffer at registration
        name = prefix + name
        geometry = _slots_geometry(name, tensor)
        itemsize = geometry.itemsize
        item_bytes = page_size * geometry.strides[0] * itemsize
        facts = _torch.storage_facts(tensor.untyped_storage())  # a strided tensor's own
        pages = geometry.shape[0] // page_size
        found.append(Buffer(name, tensor, item_bytes, pages, geometry, facts))
    return found


def _page_size(pool: Any) -> int:
    page_size = getattr(pool, "page_size", None)
    if not isinstance(page_size, int) or page_size < 1:
        raise ArgumentError(f"pool.page_size must be a positive int; got {page_size!r}")
    return page_size


def _dtype_of(pool: Any, tensor: Any) -> str:
    """The pool's own dtype (SGLang stores fp8 caches as uint8: the meaning is the pool's)."""
    dtype = getattr(pool, "dtype", None)
    name = _torch.dtype_name(dtype) if dtype is not None else _torch.dtype_name(tensor.dtype)
    if dtype is not None and dtype.itemsize != tensor.element_size():
        name = _torch.dtype_name(tensor.dtype)  # a packed format: its stored elements
    return name


def _attention_layer(
    pool: Any,
    key: Buffer,
    value: Buffer,
    heads: Sequence[int] | None,
    memo: dict[tuple[Any, ...], Layer | None] | None = None,
) -> Layer | None:
    """K and V as one layer whose outer ``kv`` axis steps from K to V, when both lie in one
    storage with one geometry and V after K; else ``None``. ``memo``: the verdicts of layers
    already read, by geometry (a model's layers are alike: each page read once, not per layer;
    a layer names itself only in an error, and an error ends the reading)."""
    same_storage = key.facts.key == value.facts.key
    dtypes = (key.tensor.dtype, value.tensor.dtype)
    remembered = (key.geometry, value.geometry, same_storage, *dtypes)
    if memo is not None and remembered in memo:
        return memo[remembered]
    fused = _fused_layer(pool, key, value, heads, same_storage)
    if memo is not None:
        memo[remembered] = fused
    return fused


def _fused_layer(
    pool: Any, key: Buffer, value: Buffer, heads: Sequence[int] | None, same_storage: bool
) -> Layer | None:
    k_geometry, v_geometry = key.geometry, value.geometry
    gap_bytes = v_geometry.byte_offset - k_geometry.byte_offset
    if (
        not same_storage
        or key.tensor.dtype != value.tensor.dtype
        or k_geometry.shape != v_geometry.shape
        or k_geometry.strides != v_geometry.strides
        or gap_bytes <= 0
        or gap_bytes % k_geometry.itemsize
        or len(k_geometry.shape) != 3
    ):
        return None
    page_size = _page_size(pool)
    pages, shape, strides = _pages_of(k_geometry, page_size)
    name = key.name.removesuffix(".k")
    return layer_from_geometry(
        name,
        axes=("kv", "block", "token", "head", "element"),
        shape=(2, pages, *shape),
        strides_elements=(gap_bytes // k_geometry.itemsize, page_size * strides[0], *strides),
        byte_offset=k_geometry.byte_offset,
        dtype=_dtype_of(pool, key.tensor),
        heads=heads,
    )


def _state_layer(buffer: Buffer, memo: dict[tuple[Any, ...], Layer] | None = None) -> Layer:
    """One ``MambaPool`` state tensor ``[slots, ...]`` as a ``state`` layer: a page per request
    slot, holding the slot's elements as one run (``ManifestError`` where they are not one
    dense run: the slot's shape is not read, only its dtype, count and place). ``memo``: the
    layers already read, by shape, strides and dtype (a model's Mamba layers are alike slices
    of one tensor: each page read once, each layer that page at its own offset)."""
    _, shape, strides, _ = buffer.geometry
    key = (tuple(shape), tuple(strides), buffer.tensor.dtype)
    known = memo.get(key) if memo is not None else None
    if known is not None:
        return known.at_offset(buffer.geometry.byte_offset)
    inner = sorted(zip(strides[1:], shape[1:]))
    count, expected = 1, 1
    for stride, size in inner:
        if size > 1 and stride != expected:
            raise ManifestError(
                f"layers[{buffer.name!r}]", list(shape), "holds a slot that is not one dense run"
            )
        count *= size
        expected = count
    layer = layer_from_geometry(
        buffer.name,
        axes=("block", "state"),
        shape=(shape[0], count),
        strides_elements=(strides[0], 1),
        byte_offset=buffer.geometry.byte_offset,
        dtype=_torch.dtype_name(buffer.tensor.dtype),
        kind="state",
    )
    if memo is not None:
        memo[key] = layer
    return layer


def _separate_layer(pool: Any, buffer: Buffer) -> Layer:
    """One buffer as a layer of its own (K or V apart, or an MLA latent vector per token)."""
    page_size = _page_size(pool)
    pages, shape, strides = _pages_of(buffer.geometry, page_size)
    inner: tuple[str, ...] = (
        ("head", "element") if len(shape) == 3 and shape[1] > 1 else ("unit", "element")
    )
    if len(shape) == 2:
        inner = ("element",)
    return layer_from_geometry(
        buffer.name,
        axes=("block", "token", *inner),
        shape=(pages, *shape),
        strides_elements=(page_size * strides[0], *strides),
        byte_offset=buffer.geometry.byte_offset,
        dtype=_dtype_of(pool, buffer.tensor),
        kind="latent",
    )


WINDOW_PREFIX = "swa."
"""What the layers of an ``SWAKVPool``'s sliding-window pool are named after (``swa.layers.0``),
in a manifest and in findings: SGLang's ``StateType.SWA`` and the index in that pool."""
MAMBA_PREFIX = "mamba."
"""What the layers of a hybrid pool's Mamba states are named after (``mamba.conv.layers.0``):
SGLang's ``StateType.MAMBA``."""


def _hybrid_pools(pool: Any) -> tuple[Any, Any, str] | None:
    """An ``SWAKVPool``'s full-attention and sliding-window pools, or a ``HybridLinearKVPool``'s
    full-attention pool and ``MambaPool``, with the state's prefix; ``None`` for another pool."""
    full = getattr(pool, "full_kv_pool", None)
    window, mamba = getattr(pool, "swa_kv_pool", None), getattr(pool, "mamba_pool", None)
    if full is not None and window is not None:
        return full, window, WINDOW_PREFIX
    if full is not None and mamba is not None:
        return full, mamba, MAMBA_PREFIX
    return None


def describe_pool(
    pool: Any,
    *,
    topology: Topology | Mapping[str, Any] | None = None,
    buffers: Sequence[Buffer] | None = None,
    prefix: str = "",
) -> Manifest:
    """The manifest of an SGLang 0.5.23 token-to-KV pool (see the module's docstring), read off
    its tensors' strides: the pool may live on any device, ``meta`` included. ``topology`` says
    which attention-TP rank of how many this is and the model's total KV heads (SGLang's
    ``attn_tp_rank``, ``attn_tp_size``, ``total_kv_head_num``; DCP as ``dcp_size``/``dcp_rank``);
    the page size becomes the block tokens. ``ArgumentError`` for a pool it does not know;
    ``ManifestError`` naming the layer and axis for one whose strides it cannot read.
    ``prefix`` goes before every layer's name. A sliding-window pool (``SWAKVPool``) is both of
    its pools: the full-attention KV (``pool.full_kv_pool``, which SGLang registers as the KV
    regions) as ``layers.{i}``, the window KV (``pool.swa_kv_pool``, SGLang's SWA state) as
    ``swa.layers.{i}``, ``i`` the index in that pool. A Mamba hybrid (``HybridLinearKVPool``)
    is its full-attention KV and its ``MambaPool``'s states (SGLang's Mamba state), each state
    tensor a ``state`` layer of one page per request slot, ``mamba.conv.layers.{id}`` and
    ``mamba.temporal.layers.{id}`` (``id`` SGLang's global layer id); a ``MambaPool`` alone is
    its states. ``buffers``: what ``pool_buffers(pool)`` returned, when the caller has it (each
    buffer is then read once)."""
    hybrid = _hybrid_pools(pool)
    if hybrid is not None and buffers is None:
        full = describe_pool(hybrid[0], topology=topology, prefix=prefix)
        state = describe_pool(hybrid[1], topology=topology, prefix=prefix + hybrid[2])
        return Manifest(topology=full.topology, layers={**full.layers, **state.layers})
    if getattr(pool, "mamba_pool", None) is not None:
        raise ArgumentError(
            f"{type(pool).__name__} is not a KV pool: describe its MambaPool, pool.mamba_pool, "
            "or the HybridLinearKVPool that holds it"
        )
    mamba = _is_mamba(pool)
    page_size = 1 if mamba else _page_size(pool)  # a Mamba state's page: one request slot
    known = Topology.model_validate(dict(topology)) if isinstance(topology, Mapping) else topology
    known = known or Topology()
    known = known.model_copy(
        update={
            "kernel_block_tokens": known.kernel_block_tokens if mamba else page_size,
            "logical_block_tokens": known.logical_block_tokens if mamba else page_size,
            "engine_version": known.engine_version or f"sglang {sglang_version()}",
            "layout": known.layout or (None if mamba else "NHD"),
        }
    )
    if mamba:
        listed = pool_buffers(pool, prefix=prefix) if buffers is None else list(buffers)
        if not listed:
            raise ArgumentError(f"{type(pool).__name__} holds no state tensor")
        alike: dict[tuple[Any, ...], Layer] = {}
        layers = {buffer.name: _state_layer(buffer, alike) for buffer in listed}
        return Manifest(topology=known, layers=layers)
    layers = {}
    listed = pool_buffers(pool, prefix=prefix) if buffers is None else list(buffers)
    if hasattr(pool, "k_buffer") and hasattr(pool, "v_buffer"):
        head_num = int(getattr(pool, "head_num", 0) or 0)
        heads = None
        if head_num and known.total_kv_heads is not None:
            from safeview.manifest import layer_heads

            heads = layer_heads(known.tp_rank, known.tp_size, known.total_kv_heads, head_num)
        count = len(pool.k_buffer)  # pool_buffers lists every K, then every V
        memo: dict[tuple[Any, ...], Layer | None] = {}
        for key, value in zip(listed[:count], listed[count:]):
            fused = _attention_layer(pool, key, value, heads, memo)
            if fused is not None:
                layers[key.name.removesuffix(".k")] = fused
            else:
                layers[key.name] = _separate_layer(pool, key)
                layers[value.name] = _separate_layer(pool, value)
    else:
        for buffer in listed:
            layers[buffer.name] = _separate_layer(pool, buffer)
    if not layers:
        raise ArgumentError(f"{type(pool).__name__} holds no layer")
    return Manifest(topology=known, layers=layers)


def pool_memory_map(
    pool: Any, *, whole_buffers: bool = False, buffers: Sequence[Buffer] | None = None
) -> MemoryMap:
    """The pool's buffers as a ``safeview.transfer.MemoryMap``: each storage at its address,
    each buffer a view of pages of SGLang's ``item_len`` bytes (``whole_buffers``: one page
    holding the whole buffer, to judge what SGLang registers), named as ``pool_buffers`` names
    them (``buffers``: what ``pool_buffers(pool)`` returned, when the caller has it). Buffers
    on ``meta`` have no address and are left out."""
    storages: dict[int, StorageSpan] = {}
    views: list[ViewSpan] = []
    for buffer in pool_buffers(pool) if buffers is None else buffers:
        facts = buffer.facts
        if not facts.base:
            continue
        span = storages.get(facts.key)
        if span is None:
            span = storages[facts.key] = StorageSpan(
                f"storage{len(storages)}", facts.base, facts.nbytes, facts.device
            )
        geometry = buffer.geometry
        offset = geometry.byte_offset
        if whole_buffers:
            from safeview import _arith

            extent = _arith.extent_bytes(0, geometry.shape, geometry.strides, geometry.itemsize)
            views.append(ViewSpan(buffer.name, span.name, offset, extent, extent, 1, buffer.name))
        else:
            views.append(
                ViewSpan(
                    buffer.name,
                    span.name,
                    offset,
                    buffer.item_bytes,
                    buffer.item_bytes,
                    buffer.pages,
                    buffer.name,
                )
            )
    return MemoryMap(tuple(storages.values()), tuple(views))


# -- which pool a pointer came from ------------------------------------------------------------

# data_ptr of a registered buffer -> its pool: SGLang hands its managers pointers, never pools
_POOLS: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


def remember_pool(pool: Any) -> None:
    """Note that ``pool``'s buffers may be handed to a transfer manager (their addresses; the
    buffers are read when a manager registers them)."""
    try:
        for _name, tensor in _named_tensors(pool):
            _POOLS[int(tensor.data_ptr())] = pool
    except Exception as error:  # a pool it does not know: judged as SGLang judges it
        step_aside("pool not described", f"{type(error).__name__}: {error}")


def pool_of(pointers: Sequence[int]) -> Any:
    """The one pool whose buffers start at the first of ``pointers``, or ``None``."""
    return _POOLS.get(int(pointers[0])) if pointers else None


# -- the plugin --------------------------------------------------------------------------------

_stepped_aside: set[str] = set()


def step_aside(what: str, reason: str) -> None:
    """Say once per process and ``what`` why safeview leaves something of SGLang's alone."""
    if what not in _stepped_aside:
        _stepped_aside.add(what)
        log.integration(
            "integration_unavailable",
            integration="sglang",
            reason=f"{what}: {reason}",
            version=sglang_version(),
        )


def _wrap_pool_class(cls: type) -> None:
    """``cls.get_contiguous_buf_infos`` remembers its pool's buffers' addresses first."""
    original = cls.__dict__.get("get_contiguous_buf_infos")
    if original is None or getattr(original, _PATCHED, False):
        return

    @functools.wraps(original)
    def get_contiguous_buf_infos(self: Any, *args: Any, **kwargs: Any) -> Any:
        remember_pool(self)
        return original(self, *args, **kwargs)

    setattr(get_contiguous_buf_infos, _PATCHED, True)
    setattr(cls, "get_contiguous_buf_infos", get_contiguous_buf_infos)  # noqa: B010


def install() -> None:
    """The ``sglang.srt.plugins`` entry point: safeview on SGLang's Mooncake disaggregation in
    this process (``safeview.sglang._mooncake``), once; with ``SAFEVIEW_SGLANG=0`` nothing.
    Never raises: an SGLang whose internals are not the ones it knows gets one
    ``integration_unavailable`` event and no patching."""
    if os.environ.get(ENV_SGLANG, "1").strip().lower() in ("0", "false", "no", "off"):
        return
    try:
        from sglang.srt.mem_cache.memory_pool import (  # type: ignore[import-not-found,unused-ignore]
            MHATokenToKVPool,
            MLATokenToKVPool,
        )

        from safeview.sglang import _mooncake

        for cls in (MHATokenToKVPool, MLATokenToKVPool):
            _wrap_pool_class(cls)
        try:  # a Mamba hybrid's states (SGLang's MambaPool), where this SGLang has them
            from sglang.srt.mem_cache.memory_pool import (  # type: ignore[import-not-found,unused-ignore]
                MambaPool,
            )

            _wrap_pool_class(MambaPool)
        except ImportError:
            pass
        _mooncake.install_manager()
        try:  # SAFEVIEW_DIGEST's hooks, on top of the manager's (safeview.sglang._digest)
            from safeview.sglang._digest import install_digest

            install_digest()
        except Exception as error:
            step_aside("digests left off", f"{type(error).__name__}: {error}")
    except Exception as error:
        log.integration(
            "integration_unavailable",
            integration="sglang",
            reason=f"{type(error).__name__}: {error}",
            version=sglang_version(),
        )
        return
    from safeview.policy import current_policy

    log.integration(
        "integration_installed",
        integration="sglang",
        reason=(
            "MooncakeKVManager guarded (registration, peer manifests); "
            f"policy {current_policy().value}"
        ),
        version=sglang_version(),
    )
