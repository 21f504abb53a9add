"""Two vLLM engines, one layout: the vLLM plugin's use of ``safeview.describe`` and ``diff``.

At registration, each KV connector worker's caches are described (``safeview.describe`` with
vLLM's axis names, the worker's tensor-parallel rank and size, total KV heads, kernel and logical
block tokens, layout name and engine id) into a ``Manifest``; its fingerprint goes into the
``registration_checked`` event, and with ``SAFEVIEW_MANIFEST_DIR`` set the manifest is written
there as ``ENGINE/ENGINE.tpRANKofSIZE.manifest.json`` (a folder per engine, files named by
``Manifest.file_name``), so one folder can hold every rank of both engines of a pair and
``safeview diff FOLDER/P FOLDER/D --rule vllm_nixl`` compares them.

With vLLM 0.33's NIXL connector, a decode worker (D) meets a prefill engine (P) in
``add_remote_agent(metadata, remote_tp_rank, remote_tp_size, ...)``, which the handshake thread
calls once per P rank with P's ``NixlAgentMetadata``, before it prepares a single descriptor of
P's and long before any READ. That method is wrapped on the worker instance: D's manifest is
diffed (rule ``vllm_nixl``) against P's, which is

- P's own manifest, which P's handshake payload carries when P has the plugin (``WorkerLayout.
  serve``; ``safeview.vllm._nixl``): the P ranks D reads (every rank of P when it reads
  several: the others are read from P's side channel at the first); or
- P's own derived manifests, when ``SAFEVIEW_MANIFEST_DIR`` holds them for P's engine id and
  its tensor-parallel size (both engines see one folder: one host, or a shared filesystem), and
  they agree with what P's metadata reports (block tokens, block count, layout name); or
- a manifest rebuilt from P's metadata: each region's layer name, block length, block stride,
  block count, block tokens and layout name, with D's dtype and head size (the compatibility
  hash vLLM checks first makes them equal), every P rank alike.

The event says which (``against``: ``handshake``, ``folder`` or ``nixl_metadata``). Each request
P's scheduler finishes names P's rank 0 layout with a token in its ``kv_transfer_params``; D's
worker checks it before the READ (``check_request``: one set lookup once judged), and a token
it has not judged (P restarted behind the same engine id and address, which vLLM 0.33 does not
handshake again) is judged then from P's current handshake (``against``: ``request``); under
strict a request that does not match or cannot be judged fails as vLLM fails a KV load.

Under strict a mismatch at the handshake fails that handshake with ``LayoutMismatchError`` (a
``SafeViewError`` naming the layer and the byte): vLLM fails the requests waiting for that P,
as it does for its own refusals, and the engine, its other requests and its other peers go on.
Under warn a ``layout_mismatch`` event,
and vLLM goes on as it would. Off: nothing. A compatible pair gets one ``layout_checked`` event.

At start-up, a D whose folder already holds other engines' manifests judges itself against each
(``when``: ``startup``): an event only, since the P it will meet is not known yet; the refusal,
if any, comes at that P's handshake.

Pairs the ``vllm_nixl`` rule does not model are left to vLLM, with a ``layout_checked`` event
whose ``verdict`` is ``not_judged`` and a reason (push mode, host staging buffers, a permute of
another layout, Mamba state when P's manifests are not at hand, packed MLA rows, pipeline or
context parallelism). safeview's own failure never stops the engine: one
``integration_unavailable`` event, and vLLM goes on unjudged.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from safeview import log
from safeview.errors import LayoutMismatchError, ManifestError
from safeview.manifest import (
    Derived,
    Layer,
    Manifest,
    Topology,
    derive,
    layer_from_geometry,
    layer_heads,
    vllm_axes,
)
from safeview.manifest.diff import diff
from safeview.manifest.peer import judge_peer
from safeview.manifest.wire import (
    check_transfer_params,
    from_wire,
    parse_request_token,
    request_token,
    to_wire,
    token_matches,
)
from safeview.policy import Policy
from safeview.vllm._background import Background
from safeview.vllm._parts import NVFP4_AXES as VLLM_NVFP4_AXES
from safeview.vllm._parts import mla_dims_of as vllm_mla_dims_of
from safeview.vllm._parts import nvfp4_page as vllm_nvfp4_page
from safeview.vllm._parts import parts_of as vllm_parts_of

__all__ = ["ENV_MANIFEST_DIR", "Registered", "at_registration", "manifest_dir"]

ENV_MANIFEST_DIR = "SAFEVIEW_MANIFEST_DIR"
_PATCHED = "__safeview_layout_guarded__"
_SUFFIX = ".manifest.json"


def manifest_dir() -> Path | None:
    """The folder ``SAFEVIEW_MANIFEST_DIR`` names, or ``None`` when it is unset or blank."""
    raw = os.environ.get(ENV_MANIFEST_DIR, "").strip()
    return Path(raw) if raw else None


def _vllm_version() -> str:
    try:
        import vllm

        return str(getattr(vllm, "__version__", "unknown"))
    except Exception:  # an import that fails is an unknown vLLM too
        return "not importable"


_stepped_aside: set[str] = set()


def _step_aside(what: str, error: BaseException) -> None:
    """Say once per process and ``what`` why safeview leaves the layouts unjudged."""
    if what not in _stepped_aside:
        _stepped_aside.add(what)
        log.integration(
            "integration_unavailable",
            integration="vllm",
            reason=f"{what}: {type(error).__name__}: {error}",
            version=_vllm_version(),
        )


# -- describing a worker's caches --------------------------------------------------------------


def _nixl_workers(connector: Any) -> list[Any]:
    """The NIXL workers of ``connector`` (or of the connectors a ``MultiConnector`` drives)."""
    parts = [connector, *getattr(connector, "_connectors", ())]
    workers = [getattr(part, "connector_worker", None) for part in parts]
    return [w for w in workers if w is not None and hasattr(w, "nixl_wrapper")]


def _kind(spec: Any) -> str | None:
    """``attention``, ``mla`` or ``mamba`` for a spec vLLM 0.33 gives per-layer views of."""
    from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec

    if isinstance(spec, MambaSpec):
        return "mamba"
    if isinstance(spec, AttentionSpec):
        return "mla" if "MLA" in type(spec).__name__ else "attention"
    return None


def describe_caches(
    kv_caches: Mapping[str, Any],
    kv_cache_config: Any,
    topology: Topology,
    model_config: Any = None,
) -> Derived:
    """The manifest of the layers of ``kv_caches`` that ``kv_cache_config`` gives a spec with
    per-layer views (attention, MLA, Mamba state) and a 4-d cache, read off their strides (its
    fingerprint and text at once, the ``Manifest`` when a peer is judged); the parts of each
    row (inline scales, MLA rope, a Mamba state's segments and padding) from the layer's spec
    (``safeview.vllm._parts``), a plain MLA row's latent and rope from vLLM's ``model_config``
    (without it, one ``data`` part)."""
    of_layer = _specs_and_groups(kv_cache_config)
    mla_dims: tuple[int, int] | None = None  # the model config's, read at the first MLA layer
    mla_read = False
    caches: dict[str, Any] = {}
    axes: dict[str, tuple[str, ...]] = {}
    kinds: dict[str, Any] = {}
    groups: dict[str, int] = {}
    parts: dict[str, Any] = {}
    parts_of_spec: dict[tuple[int, int, int], Any] = {}  # one list per spec and row
    kind_of: dict[type, str | None] = {}  # a model has a few spec types and many layers
    nvfp4_of_spec: dict[int, Any] = {}
    page_heads: dict[str, int] = {}  # NVFP4 layers: their heads are in parts, not on an axis
    page_tokens: set[int] = set()  # ... and their block tokens
    axes_of: dict[str, tuple[str, ...]] = {}
    for name, cache in kv_caches.items():
        spec, group = of_layer.get(name, (None, -1))  # no spec: no kind, left out below
        kind = kind_of.get(type(spec), "?")
        if kind == "?":
            kind = kind_of[type(spec)] = _kind(spec)
        if kind is None or getattr(cache, "ndim", 0) != 4:
            continue  # a flat byte view, a layer without views: nothing derivable
        groups[name] = group
        if kind == "attention" and id(spec) not in nvfp4_of_spec:
            nvfp4_of_spec[id(spec)] = vllm_nvfp4_page(spec, cache)
        nvfp4 = nvfp4_of_spec.get(id(spec)) if kind == "attention" else None
        if nvfp4 is not None:  # K's side then V's, parts over heads and tokens: as vLLM reads it
            side_parts, side = nvfp4
            caches[name] = cache.as_strided(
                (cache.shape[0], 2, side), (cache.stride(0), side, 1), cache.storage_offset()
            )
            axes[name] = axes_of.setdefault("nvfp4", VLLM_NVFP4_AXES)
            parts[name] = side_parts
            page_heads[name] = int(spec.num_kv_heads)
            page_tokens.add(int(cache.shape[2]))
            continue
        caches[name] = cache
        if kind not in axes_of:
            axes_of[kind] = vllm_axes(kind)  # type: ignore[arg-type]
        axes[name] = axes_of[kind]
        if kind == "mamba":
            kinds[name] = "state"
        # the row: one K or V half of the last axis for attention, the whole of it otherwise
        row = int(cache.shape[-1]) // (2 if kind == "attention" else 1) * cache.element_size()
        key = (id(spec), row, cache.element_size())
        if kind == "mla" and not mla_read:
            mla_dims, mla_read = vllm_mla_dims_of(model_config), True
        if key not in parts_of_spec:
            parts_of_spec[key] = vllm_parts_of(spec, row, mla_dims if kind == "mla" else None)
        if parts_of_spec[key] is not None:
            parts[name] = parts_of_spec[key]
    if not caches:
        raise ManifestError("kv_caches", len(kv_caches), "hold no attention, MLA or Mamba layer")
    if len(page_tokens) == 1 and topology.kernel_block_tokens is None:
        topology = topology.model_copy(update={"kernel_block_tokens": page_tokens.pop()})
    if topology.pp_size > 1 and topology.stage_layers is None:
        topology = topology.model_copy(update={"stage_layers": _stage_layers(caches)})
    # one tuple for every layer when they share it: describe reads it once
    shared = next(iter(axes_of.values())) if len(axes_of) == 1 else None
    derived = derive(
        caches, axes=shared or axes, topology=topology, groups=groups, kinds=kinds,
        parts=parts or None,
    )  # fmt: skip
    return _with_page_heads(derived, page_heads) if page_heads else derived


def _with_page_heads(derived: Derived, local_heads: Mapping[str, int]) -> Derived:
    """``derived`` with the global KV heads of each layer whose page lays its heads out in
    parts (NVFP4: ``local_heads`` of them), which ``derive`` reads from a head axis only."""
    topology = derived.topology
    entries = []
    for name, layer in derived.manifest().layers.items():
        if name in local_heads:
            held = layer_heads(
                topology.tp_rank, topology.tp_size, topology.total_kv_heads, local_heads[name]
            )
            layer = Layer.model_validate(
                {**layer.model_dump(exclude={"fingerprint"}), "heads": held}
            )
        entries.append((name, layer, layer.byte_offset))
    return Derived(topology, entries)


def _stage_layers(caches: Mapping[str, Any]) -> tuple[int, ...]:
    """Each layer's global index, as vLLM reads it from the layer's name
    (``extract_layer_index``: ``model.layers.17.self_attn.attn`` is layer 17, on any stage)."""
    from vllm.model_executor.models.utils import extract_layer_index

    return tuple(int(extract_layer_index(name)) for name in caches)


def _parallel(config: Any, worker: Any = None) -> dict[str, int]:
    """Context parallelism and the pipeline stage, under vLLM's names, where they are not
    1 (a manifest without them reads as 1): ``parallel_config``'s sizes and interleave, the
    worker's DCP and PCP ranks (vLLM's NIXL worker holds them; else vLLM's groups), the
    pipeline rank."""
    parallel = getattr(config, "parallel_config", None)
    found: dict[str, int] = {}
    dcp = int(getattr(parallel, "decode_context_parallel_size", 1) or 1)
    pcp = int(getattr(parallel, "prefill_context_parallel_size", 1) or 1)
    pp = int(getattr(parallel, "pipeline_parallel_size", 1) or 1)
    if dcp * pcp > 1:
        found["dcp_size"], found["pcp_size"] = dcp, pcp
        found["cp_kv_cache_interleave_size"] = int(
            getattr(parallel, "cp_kv_cache_interleave_size", 1) or 1
        )
        found["dcp_rank"] = _rank(worker, "dcp_rank", "get_dcp_group", dcp)
        found["pcp_rank"] = _rank(worker, "pcp_rank", "get_pcp_group", pcp)
    if pp > 1:
        found["pp_size"] = pp
        found["pp_rank"] = _rank(worker, "pp_rank", "get_pp_group", pp)
    return found


def _rank(worker: Any, attribute: str, group: str, size: int) -> int:
    if size == 1:
        return 0
    held = getattr(worker, attribute, None)
    if isinstance(held, int):
        return held
    from vllm.distributed import parallel_state

    return int(getattr(parallel_state, group)().rank_in_group)


def _specs_and_groups(kv_cache_config: Any) -> dict[str, tuple[Any, int]]:
    """Layer name -> its spec (uniform-type groups unwrapped) and its KV-cache group."""
    found: dict[str, tuple[Any, int]] = {}
    for index, group in enumerate(getattr(kv_cache_config, "kv_cache_groups", ())):
        spec = group.kv_cache_spec
        inner = getattr(spec, "kv_cache_specs", None)
        if isinstance(inner, Mapping):
            found.update((name, (inner.get(name, spec), index)) for name in group.layer_names)
        else:
            found.update(dict.fromkeys(group.layer_names, (spec, index)))
    return found


def _worker_topology(worker: Any) -> Topology:
    """What vLLM 0.33's NIXL worker says of itself before it registers."""
    use_mla = bool(getattr(worker, "use_mla", False))
    config = worker.vllm_config
    return Topology(
        tp_rank=int(worker.transfer_tp_rank),
        tp_size=int(worker.transfer_tp_size),
        total_kv_heads=1 if use_mla else int(worker.model_config.get_total_num_kv_heads()),
        kernel_block_tokens=int(worker.block_size),
        logical_block_tokens=int(config.cache_config.block_size),
        engine=str(worker.engine_id),
        engine_version=f"vllm {_vllm_version()}",
        layout=str(worker.kv_cache_layout),
        connector="NixlConnector",  # whose rule safeview diff applies: vllm_nixl
        **_parallel(config, worker),
    )


def _connector_topology(connector: Any) -> Topology:
    """What any other connector's process says: its tensor-parallel rank and size, the model's
    KV heads, the block tokens, the engine id."""
    from vllm.distributed.parallel_state import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    config = connector._vllm_config
    layout = getattr(config.cache_config, "kv_cache_layout", None)
    try:
        tp_rank, tp_size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    except AssertionError:  # no tensor-parallel group: one process, if the config says so
        parallel = getattr(config, "parallel_config", None)
        tp_size = getattr(parallel, "tensor_parallel_size", 1)
        if tp_size != 1:
            raise
        tp_rank = 0
    engine_id = getattr(getattr(config, "kv_transfer_config", None), "engine_id", None)
    return Topology(
        tp_rank=int(tp_rank),
        tp_size=int(tp_size),
        total_kv_heads=int(config.model_config.get_total_num_kv_heads()),
        logical_block_tokens=int(config.cache_config.block_size),
        engine=None if engine_id is None else str(engine_id),
        engine_version=f"vllm {_vllm_version()}",
        layout=None if layout is None else str(getattr(layout, "name", layout)),
        connector=type(connector).__name__,
        **_parallel(config),
    )


def engine_folder(folder: Path, engine: str | None) -> Path:
    """Where an engine's manifests go in ``folder``: a folder of its own, named after its
    engine id, so that ``safeview diff FOLDER/P FOLDER/D`` compares two engines that share one."""
    return folder / _safe(engine or "engine")


def write_manifest(manifest: Manifest | Derived, folder: Path) -> Path:
    """Write ``manifest`` into its engine's folder in ``folder``, under its own file name
    (``Manifest.file_name``); returns the path. A reader sees the previous file, none, or the
    new one whole, never half of one: the text goes to a hidden file renamed into place."""
    target = engine_folder(folder, manifest.topology.engine)
    target.mkdir(parents=True, exist_ok=True)
    path = target / manifest.file_name()
    partial = f"{target}/.{path.name}.{os.getpid()}.{threading.get_ident()}.partial"
    # compact: half the cost of an indented one, on the registration's path
    text = memoryview(manifest.to_json(indent=None).encode())
    handle = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        while text:  # a short write (a disk filling up) goes on until it raises
            text = text[os.write(handle, text) :]
    except BaseException:
        os.unlink(partial)  # nothing half-written left behind
        raise
    finally:
        os.close(handle)
    # A rename over an existing file makes ext4 (auto_da_alloc) write the new file's blocks
    # out before the rename returns: 0.2 to 1 ms on the registration's path. The previous
    # run's file goes first; the rename then only links a name.
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    os.replace(partial, path)
    return path


def read_engine_manifests(
    folder: Path, engine: str | None = None, *, but: str | None = None
) -> dict[str, list[tuple[Path, Manifest]]]:
    """Every readable manifest in the engine folders of ``folder`` (only ``engine``'s when
    given; never those in engine ``but``'s folder), by engine id; files that are not manifests
    of this schema are left out (another engine may be writing one right now)."""
    engines: dict[str, list[tuple[Path, Manifest]]] = {}
    skipped = None if but is None else _safe(but or "engine")  # engine_folder's name
    for path in _manifest_files(folder, None if engine is None else _safe(engine), skipped):
        try:
            manifest = Manifest.read(path)
        except ManifestError:
            continue
        engines.setdefault(manifest.topology.engine or "", []).append((path, manifest))
    return engines


def _manifest_files(folder: Path, only: str | None, skipped: str | None) -> list[Path]:
    """The manifest files in the engine folders of ``folder`` (``only``'s, or all but
    ``skipped``'s), in name order; none when ``folder`` is missing. ``os.scandir`` rather than
    ``Path.glob``: a worker looks at start-up, on its registration's path."""
    found: list[Path] = []
    engines = [only] if only is not None else _entries(folder, lambda entry: entry.is_dir())
    for name in sorted(set(engines) - {skipped}):
        files = _entries(folder / name, lambda entry: entry.name.endswith(_SUFFIX))
        found += [folder / name / file for file in sorted(files) if not file.startswith(".")]
    return found


def _entries(folder: Path, keep: Any) -> list[str]:
    """The names of the entries of ``folder`` that ``keep`` keeps; none when it cannot be read."""
    try:
        with os.scandir(folder) as entries:
            return [entry.name for entry in entries if keep(entry)]
    except OSError:  # no folder yet, or not one
        return []


# -- P's manifest from its NIXL metadata --------------------------------------------------------


class _NotJudgedError(Exception):
    """A pair the ``vllm_nixl`` rule does not model: left to vLLM, with the reason."""


def _page_order(layout: str) -> str:
    """The physical order of a page's axes in vLLM's layout name: ``HNC`` or ``NHC``."""
    order = layout.replace("L", "").replace("B", "")
    if not layout.startswith(("LB", "BL")) or order not in ("HNC", "NHC"):
        raise _NotJudgedError(f"a page of layout {layout} is not one run of [H, N, C] memory")
    return order


def _rebuilt_layer(
    name: str, mine: Layer, page: int, stride: int, blocks: int, tokens: int, layout: str,
    rank: tuple[int, int, int | None],
) -> Layer:  # fmt: skip
    """P's layer ``name`` as its metadata reports it, with D's dtype, head size and row parts
    (vLLM's compatibility hash, checked first, makes them P's); ``rank``: P's rank, TP size
    and the model's total KV heads (the layer's own, where its page says
    another number of heads: ``layer_heads``)."""
    itemsize = mine.itemsize
    element = mine.size_of("element")
    if stride % itemsize:
        raise _NotJudgedError(
            f"{name}: P's block stride {stride} is not a whole number of elements"
        )
    if mine.kind == "latent":
        row = element * itemsize
        if page != tokens * row:
            raise _NotJudgedError(
                f"{name}: P's block length {page} is not {tokens} tokens of {row} bytes"
            )
        return layer_from_geometry(
            name,
            axes=vllm_axes("mla"),
            shape=(blocks, 1, tokens, element),
            strides_elements=(stride // itemsize, tokens * element, element, 1),
            byte_offset=0,
            dtype=mine.dtype,
            group=mine.group,
            parts=mine.parts,  # D's rows, as its dtype: vLLM's compatibility hash holds both
        )
    row = 2 * element  # K|V side by side, in elements
    if page % (tokens * row * itemsize):
        raise _NotJudgedError(
            f"{name}: P's block length {page} is not whole heads of {tokens} tokens x {row} "
            f"values of {itemsize} bytes"
        )
    count = page // (tokens * row * itemsize)
    if _page_order(layout) == "HNC":
        strides = (stride // itemsize, tokens * row, row, 1)
    else:
        strides = (stride // itemsize, row, count * row, 1)
    return layer_from_geometry(
        name,
        axes=vllm_axes("attention"),
        shape=(blocks, count, tokens, row),
        strides_elements=strides,
        byte_offset=0,
        dtype=mine.dtype,
        heads=layer_heads(rank[0], rank[1], rank[2], count),
        group=mine.group,
        parts=mine.parts,
    )


def rebuild(metadata: Any, remote_tp_size: int, mine: Manifest) -> list[Manifest]:
    """P's manifests, one per P rank, as P's ``NixlAgentMetadata`` reports its regions (every
    rank laid out alike), for the layers D also has. ``_NotJudgedError`` for what it cannot say."""
    if getattr(metadata, "packed_member_layouts", None):
        raise _NotJudgedError("P registers packed MLA block rows")
    names = list(getattr(metadata, "region_names", None) or ())
    lens, strides = list(metadata.block_lens), list(metadata.block_strides)
    if not names or len(names) != len(lens) or len(strides) != len(lens):
        raise _NotJudgedError("P's metadata names no region for each block length")
    counts = list(metadata.region_num_blocks or [metadata.num_blocks] * len(names))
    tokens = int(metadata.block_size)
    layout = str(metadata.kv_cache_layout)
    total = mine.topology.total_kv_heads or 1
    manifests = []
    for rank in range(remote_tp_size):
        layers = {
            name: _rebuilt_layer(
                name,
                mine.layers[name],
                page,
                stride,
                blocks,
                tokens,
                layout,
                (rank, remote_tp_size, total),
            )
            for name, page, stride, blocks in zip(names, lens, strides, counts)
            if name in mine.layers and mine.layers[name].kind != "state"
        }
        if not layers:
            raise _NotJudgedError("P's regions name no layer D has")
        topology = Topology(
            tp_rank=rank,
            tp_size=remote_tp_size,
            total_kv_heads=total,
            kernel_block_tokens=tokens,
            engine=str(metadata.engine_id),
            layout=layout,
            connector="NixlConnector",
        )
        manifests.append(Manifest(topology=topology, layers=layers))
    return manifests


def _agrees(manifest: Manifest, metadata: Any) -> bool:
    """Whether a manifest from the folder describes the engine whose metadata came: its block
    tokens, block counts and layout name (a file left from an earlier start does not)."""
    topology = manifest.topology
    if topology.kernel_block_tokens not in (None, int(metadata.block_size)):
        return False
    if topology.layout is not None and topology.layout != str(metadata.kv_cache_layout):
        return False
    counts = set(metadata.region_num_blocks or [metadata.num_blocks])
    return all(layer.num_blocks in counts for layer in manifest.layers.values())


# -- the worker's state and the judgement ------------------------------------------------------


class WorkerLayout:
    """One NIXL worker's manifest, where it was written, the policy in force when it registered
    (the handshake runs in a thread of its own, outside any ``policy_scope``), and its last
    verdict per remote engine."""

    def __init__(
        self, worker: Any, manifest: Manifest | Derived, folder: Path | None, policy: Policy
    ):
        self.worker = worker
        self.derived = manifest
        self.folder = folder
        self.path: Path | None = None
        self.policy = policy
        self.lock = threading.Lock()
        self.verdicts: dict[str, tuple[Any, LayoutMismatchError | None]] = {}
        # per P engine met: its rank manifests judged, and the request tokens settled for it
        self.peers: dict[str, _Peer] = {}
        self.handshake = threading.local()  # the side channel of the handshake in this thread
        self.background = _JUDGE  # judges P while NIXL loads P's agent
        self.carried: set[str] = set()  # P engines whose handshake carried a manifest
        # P engines whose pair with this worker is left to vLLM (a layout vLLM converts on
        # receipt, push mode, ...): their requests' tokens are not judged either
        self.left_to_vllm: set[str] = set()
        # P engines whose side channel answers D's verdicts (their payload says so)
        self.listening: set[str] = set()

    @property
    def manifest(self) -> Manifest:
        """The worker's manifest, built from what registration derived when first judged."""
        derived = self.derived
        return derived.manifest() if isinstance(derived, Derived) else derived

    # the fields every layout event carries
    def _fields(self, remote: str, remote_tp_size: int | None, when: str) -> dict[str, Any]:
        topology = self.derived.topology
        return {
            "engine": topology.engine,
            "tp_rank": topology.tp_rank,
            "tp_size": topology.tp_size,
            "remote_engine": remote,
            "remote_tp_size": remote_tp_size,
            "when": when,
            "policy": self.policy.value,
            "fingerprint": self.derived.fingerprint,
        }

    def not_judged(self) -> str | None:
        """Why pairs of this worker are left to vLLM, or ``None``."""
        worker = self.worker
        if getattr(worker, "_TRANSFER_MODE", "pull") != "pull":
            return "push mode: the prefill worker writes into the decode worker's cache"
        if getattr(worker, "use_host_buffer", False):
            return "the worker stages transfers through host buffers"
        if getattr(worker, "enable_permute_local_kv", False) or getattr(
            getattr(worker, "kv_transfer_config", None), "enable_permute_local_kv", False
        ):
            return "enable_permute_local_kv: vLLM permutes another layout on receipt"
        if getattr(worker, "pp_size", 1) > 1 or getattr(
            worker, "_transfer_layer_region_indices", None
        ):
            return "pipeline-parallel transfer regions"
        if (getattr(worker, "dcp_size", 1) > 1 or getattr(worker, "pcp_size", 1) > 1) and not (
            self._mla()
        ):
            # vLLM 0.33 pairs context-parallel blocks for MLA only
            return "decode or prefill context parallelism of attention (not MLA) layers"
        return None

    def _mla(self) -> bool:
        return bool(getattr(self.worker, "use_mla", False))

    def _context_parallel(self, remote_dcp_size: int) -> bool:
        """Whether a pair with a P of ``remote_dcp_size`` places tokens by context parallelism
        on either side (an MLA pair: judged from P's manifests, which say P's placement)."""
        worker = self.worker
        return (
            remote_dcp_size > 1
            or getattr(worker, "dcp_size", 1) > 1
            or getattr(worker, "pcp_size", 1) > 1
        )

    def judge_handshake(
        self, metadata: Any, remote_tp_size: int, remote_dcp_size: int
    ) -> LayoutMismatchError | None:
        """The verdict on P (its ``metadata``), judged once per distinct P registration; the
        error to raise under strict, if any. Emits one event per judgement."""
        remote = str(metadata.engine_id)
        key = (
            remote_tp_size,
            remote_dcp_size,
            int(metadata.block_size),
            int(metadata.num_blocks),
            tuple(metadata.block_lens),
            str(metadata.kv_cache_layout),
            self._folder_key(remote),
        )
        with self.lock:
            known = self.verdicts.get(remote)
            if known is not None and known[0] == key:
                return known[1]
            error = self._judge(metadata, remote, remote_tp_size, remote_dcp_size)
            self.verdicts[remote] = (key, error)
            return error

    def _folder_key(self, remote: str) -> tuple[Any, ...]:
        if self.folder is None:
            return ()
        found = sorted(engine_folder(self.folder, remote).glob(f"*{_SUFFIX}"))
        return tuple((path.name, path.stat().st_mtime_ns) for path in found)

    def _judge(
        self, metadata: Any, remote: str, remote_tp_size: int, remote_dcp_size: int
    ) -> LayoutMismatchError | None:
        fields = self._fields(remote, remote_tp_size, "handshake")
        reason = self._reason_not_judged(metadata, remote_dcp_size)
        if reason is not None:
            self.left_to_vllm.add(remote)  # and so are its requests
            return judge_peer(self.manifest, None, against=None, fields=fields, reason=reason,
                              policy=self.policy)  # fmt: skip
        self.left_to_vllm.discard(remote)
        senders, against, paths, note = self._senders(
            metadata, remote, remote_tp_size, self._context_parallel(remote_dcp_size)
        )
        verdict = judge_peer(self.manifest, senders, against=against,  # type: ignore[arg-type]
                             fields={**fields, "manifests": paths}, rule="vllm_nixl",
                             policy=self.policy, reason=note)  # fmt: skip
        return _mended_by(verdict, self.manifest, senders or [])

    def _reason_not_judged(self, metadata: Any, remote_dcp_size: int) -> str | None:
        """Why the pair with the P of ``metadata`` is left to vLLM, or ``None``."""
        reason = self.not_judged()
        if reason is None and remote_dcp_size > 1 and not self._mla():
            reason = "P shards its KV cache by decode context parallelism"
        backend = getattr(metadata, "attn_backend_name", None)
        if reason is None and backend not in (None, getattr(self.worker, "backend_name", backend)):
            reason = f"P's attention backend {backend} differs: vLLM may repack pages on receipt"
        return reason

    def _senders(
        self, metadata: Any, remote: str, remote_tp_size: int, context_parallel: bool = False
    ) -> tuple[list[Manifest] | None, str | None, list[str], str | None]:
        """P's manifests, where they came from, the files read, and a note. Under context
        parallelism only P's own manifests say where its tokens lie: none from its metadata."""
        note = None
        if self.folder is not None:
            found = read_engine_manifests(self.folder, remote).get(remote, [])
            ranks = {
                m.topology.tp_rank: (p, m) for p, m in found if m.topology.tp_size == remote_tp_size
            }
            if (
                ranks
                and len(ranks) == remote_tp_size
                and all(_agrees(m, metadata) for _, m in ranks.values())
            ):
                ordered = [ranks[r] for r in sorted(ranks)]
                return [m for _, m in ordered], "folder", [str(p) for p, _ in ordered], None
            if found:
                note = (
                    f"P's manifests in {self.folder} are not those of its {remote_tp_size} "
                    "ranks as its metadata reports them; judged against the metadata"
                )
        if getattr(self.worker, "_has_mamba", False):
            return None, "nixl_metadata", [], "Mamba state regions: P's manifests are needed"
        if context_parallel:
            why = "context parallelism: P's manifests (its token placement) are needed"
            return None, "nixl_metadata", [], why
        try:
            return rebuild(metadata, remote_tp_size, self.manifest), "nixl_metadata", [], note
        except _NotJudgedError as why:
            return None, "nixl_metadata", [], str(why)

    # -- P's manifest from its handshake, and each request's token ---------------------------

    def serve(self) -> None:
        """P's side: this rank's manifest goes into what the worker serves at the handshake."""
        from safeview.vllm._nixl import serve_manifest

        serve_manifest(self.worker, to_wire(self.derived))

    def _target_ranks(self, remote_tp_size: int, remote_dcp_size: int) -> list[int]:
        """The P ranks this worker reads (vLLM's own ``handshake_target_ranks``)."""
        topo = self.worker.transfer_topo
        return [int(r) for r in topo.handshake_target_ranks(remote_tp_size, remote_dcp_size)]

    @staticmethod
    def _judged_ranks(targets: list[int], remote_tp_size: int) -> list[int]:
        """The P ranks D is judged against: the one it reads, or every rank of P when it reads
        several (``diff`` judges an engine's ranks together)."""
        return targets if len(targets) == 1 else list(range(remote_tp_size))

    def _fetch(
        self, remote: str, host: str, port: int, ranks: list[int], why: str
    ) -> dict[int, Manifest]:
        """P's manifests of ``ranks`` from its side channel now; ``ManifestError`` for a
        payload without one or with a bad one, what the socket raises otherwise."""
        from safeview.vllm._nixl import WIRE_KEY, fetch_payloads

        payloads = fetch_payloads(host, port, ranks) if ranks else {}
        return {
            rank: from_wire(
                payload.get(WIRE_KEY, b""), peer=f"P {remote} rank {rank} ({why})"
            )  # a payload without one is not JSON: refused by name
            for rank, payload in payloads.items()
        }

    def judge_handshake_wire(
        self, metadata: Any, wire: Any, remote_tp_rank: int, remote_tp_size: int,
        remote_dcp_size: int,
    ) -> Exception | None:  # fmt: skip
        """The verdict on P from the manifest its handshake carried (``wire``, P rank
        ``remote_tp_rank``'s), before vLLM prepares a descriptor of P's: the error to raise
        under strict, if any. When D reads several P ranks, the others' manifests are read
        from P's side channel at the first of them. One event per distinct P."""
        remote = str(metadata.engine_id)
        fields = self._fields(remote, remote_tp_size, "handshake")
        reason = self._reason_not_judged(metadata, remote_dcp_size)
        if reason is not None:
            return self.judge_handshake(metadata, remote_tp_size, remote_dcp_size)
        context = getattr(self.handshake, "context", None)
        have: dict[int, Manifest] = {} if context is None else context["manifests"]
        try:
            have[remote_tp_rank] = from_wire(
                wire, peer=f"P {remote} rank {remote_tp_rank} (handshake)"
            )
            judged = self._judged_ranks(
                self._target_ranks(remote_tp_size, remote_dcp_size), remote_tp_size
            )
            # rank 0 too: a request's token names P's rank 0
            wanted = sorted({*judged, 0} - set(have))
            if wanted:
                if context is None:
                    raise LookupError("P's side channel is not known in this thread")
                have.update(self._fetch(remote, context["host"], context["port"], wanted,
                                        "handshake"))  # fmt: skip
        except ManifestError as bad:
            judge_peer(self.manifest, None, against="handshake", fields=fields,
                       reason=f"P's manifest cannot be judged: {bad}",
                       policy=self.policy)  # fmt: skip
            return bad if self.policy is Policy.STRICT else None
        except Exception as failure:  # P's other ranks unreadable: judged as without a manifest
            why = f"{type(failure).__name__}: {failure}"
            note = f"P's other ranks' handshakes could not be read: {why}"
            verdict = self.judge_handshake(metadata, remote_tp_size, remote_dcp_size)
            log.integration("integration_unavailable", integration="vllm", reason=note,
                            version=_vllm_version())  # fmt: skip
            return verdict
        senders = [have[rank] for rank in judged]
        key = ("handshake", remote_tp_size, tuple((m.topology.tp_rank, m.fingerprint)
                                                   for m in senders))  # fmt: skip
        with self.lock:
            known = self.verdicts.get(remote)
            if known is not None and known[0] == key:
                return known[1]
            verdict = judge_peer(self.manifest, senders, against="handshake", fields=fields,
                                 rule="vllm_nixl", policy=self.policy)  # fmt: skip
            verdict = _mended_by(verdict, self.manifest, senders)
            self.verdicts[remote] = (key, verdict)
            self.peers[remote] = _Peer(dict(have), judged, verdict)
            self.left_to_vllm.discard(remote)
        if remote in self.listening and context is not None:
            self._tell(context, remote, senders)
        return verdict

    def _tell(self, context: dict[str, Any], remote: str, senders: list[Manifest]) -> None:
        """Tell P's side channel the pair's verdict, with both sides' fingerprints, for P to
        log it (``layout_judged``), in a thread of its own: the handshake does not wait."""
        from safeview.vllm._metrics import pair_verdict
        from safeview.vllm._nixl import tell_verdict

        topology = self.derived.topology
        said = {
            "engine": topology.engine,
            "tp_rank": topology.tp_rank,
            "tp_size": topology.tp_size,
            "fingerprint": self.derived.fingerprint,
            "remote_fingerprints": [m.fingerprint for m in senders],
            "verdict": pair_verdict(topology.engine, remote),
            "policy": self.policy.value,
        }
        _TELL.submit(tell_verdict, str(context["host"]), int(context["port"]), said)

    def judge_handshake_wire_in(
        self, context: dict[str, Any] | None, metadata: Any, wire: Any, remote_tp_rank: int,
        remote_tp_size: int, remote_dcp_size: int,
    ) -> Exception | None:  # fmt: skip
        """``judge_handshake_wire`` in another thread than the handshake's, given the
        handshake's side channel (``context``)."""
        self.handshake.context = context
        try:
            return self.judge_handshake_wire(
                metadata, wire, remote_tp_rank, remote_tp_size, remote_dcp_size
            )
        finally:
            self.handshake.context = None

    def check_request(self, request: str, token: Any, meta: Any) -> Exception | None:
        """Before D issues the READ of ``request`` from P (``meta.remote``): the request's
        ``token`` names a manifest of P's that D has judged, or it is judged now from P's
        current handshake (P restarted behind the same engine id and address: vLLM 0.33 does
        not handshake again). The error to fail the request with under strict, if any.

        The request's ``tp_size`` (from its ``kv_transfer_params``: the P TP size D maps its
        ranks by) must be the one P's token says (``check_transfer_params``, vllm#47764)."""
        remote = str(meta.remote.engine_id)
        if remote in self.left_to_vllm:
            return None
        claimed = getattr(meta, "tp_size", None)
        peer = self.peers.get(remote)
        if peer is not None:
            # the common case: one dict lookup and an int compare (0: not settled; None: a
            # token passed under warn that says no TP size)
            size = peer.settled.get(token, 0)
            if size == claimed or size is None:
                return None
            if size:
                return self._refuse_tp_size(request, token, claimed, remote, peer)
            refused = peer.refused.get(token)
            if refused is not None:
                return refused
        with self.lock:
            verdict = self._judge_request(request, token, meta, remote)
            peer = self.peers.get(remote)
        size = None if peer is None else peer.settled.get(token)
        if verdict is None and size is not None and size != claimed and peer is not None:
            return self._refuse_tp_size(request, token, claimed, remote, peer)
        return verdict

    def _refuse_tp_size(
        self, request: str, token: str, claimed: Any, remote: str, peer: _Peer
    ) -> Exception | None:
        """A request whose ``tp_size`` is not P's: one event per token and claimed size, the
        error to fail it with under strict."""
        key = (token, claimed)
        with self.lock:
            if key in peer.refused:
                return peer.refused[key]
            parsed = parse_request_token(token, peer=f"P {remote} (request {request})")
            reason = check_transfer_params({"tp_size": claimed}, parsed)
            if reason is None:  # no claim (vLLM's ReqMeta always has one), or P's own
                return None
            fields = self._fields(remote, parsed.tp_size, "request")
            why = ManifestError(
                f"P {remote}: request {request} kv_transfer_params['tp_size']", claimed,
                f"is not P's TP size {parsed.tp_size} (its layout token {token}): {reason}; "
                "what mends it: the P/D proxy must relay P's kv_transfer_params verbatim "
                "(tp_size is P's --tensor-parallel-size)",
            )  # fmt: skip
            judge_peer(self.manifest, None, against="request", fields=fields,
                       reason=f"the request's TP size cannot place its pages: {why}",
                       policy=self.policy)  # fmt: skip
            error = why if self.policy is Policy.STRICT else None
            peer.refused[key] = error
            return error

    def _judge_request(self, request: str, token: Any, meta: Any, remote: str) -> Exception | None:
        peer = self.peers.get(remote)
        remote_tp_size = int(getattr(meta, "tp_size", 1))
        fields = self._fields(remote, remote_tp_size, "request")
        strict = self.policy is Policy.STRICT
        try:
            parsed = parse_request_token(token, peer=f"P {remote} (request {request})")
        except ManifestError as bad:
            judge_peer(self.manifest, None, against="request", fields=fields,
                       reason=f"the request's layout token cannot be read: {bad}",
                       policy=self.policy)  # fmt: skip
            return self._settle(remote, peer, token, bad if strict else None, None)
        known = None if peer is None else peer.manifests.get(parsed.tp_rank)
        if known is not None and token_matches(parsed, known):
            assert peer is not None
            peer.settled[token] = parsed.tp_size
            return None
        host, port = str(meta.remote.host), int(meta.remote.port)
        before = (
            f"the layout D judged at the handshake (fingerprint {known.fingerprint[:12]}...)"
            if known is not None
            else "a layout D has judged"
        )
        restart = (
            f"P {remote} restarted behind the same engine id and address {host}:{port} "
            f"(vLLM 0.33 does not handshake again): the request's token {token} is not {before}"
        )
        now: Manifest | None = None
        try:
            judged = self._judged_ranks(
                self._target_ranks(remote_tp_size, int(getattr(meta, "dcp_size", 1))),
                remote_tp_size,
            )
            current = self._fetch(remote, host, port, sorted({*judged, parsed.tp_rank}),
                                  f"current handshake, for request {request}")  # fmt: skip
            now = current[parsed.tp_rank]
            if not token_matches(parsed, now):
                raise ManifestError(
                    f"P {remote} rank {parsed.tp_rank}: request token", token,
                    f"is not the manifest P's current handshake serves "
                    f"(fingerprint {now.fingerprint[:12]}...)",
                )  # fmt: skip
        except Exception as failure:
            why = failure if isinstance(failure, ManifestError) else ManifestError(
                f"P {remote}: current handshake at {host}:{port}", f"{type(failure).__name__}",
                f"cannot be read ({failure})",
            )  # fmt: skip
            if known is not None and now is not None and now.fingerprint == known.fingerprint:
                # P is the one D judged: the token is what is wrong, not P
                said = (
                    f"the request's token {token} is no layout of P {remote}: neither the "
                    "one D judged at the handshake nor the one P's current handshake serves"
                )
            else:
                said = f"{restart}; it cannot be judged"
            judge_peer(self.manifest, None, against="request", fields=fields,
                       reason=f"{said}: {why}", policy=self.policy)  # fmt: skip
            return self._settle(remote, peer, token, why if strict else None, parsed.tp_size)
        senders = [current[rank] for rank in judged]
        reason = (
            f"{restart}; judged against P's current handshake manifest of rank "
            f"{parsed.tp_rank} (fingerprint {now.fingerprint[:12]}...)"
        )
        verdict = judge_peer(self.manifest, senders, against="request", fields=fields,
                             rule="vllm_nixl", policy=self.policy, reason=reason)  # fmt: skip
        verdict = _mended_by(verdict, self.manifest, senders)
        if verdict is not None:  # the error says it too, where it is shown (Python 3.11+)
            getattr(verdict, "add_note", lambda _: None)(reason)
        self.peers[remote] = _Peer(current, judged, verdict)
        return self._settle(remote, self.peers[remote], token, verdict, parsed.tp_size)

    def _settle(
        self, remote: str, peer: _Peer | None, token: Any, error: Exception | None,
        tp_size: int | None,
    ) -> Exception | None:  # fmt: skip
        """Remember the verdict on ``token`` (one event per token, not one per request), and
        the P TP size it says (``None``: none to hold a request's ``tp_size`` to)."""
        if peer is None:
            peer = self.peers[remote] = _Peer({}, [])
        if isinstance(token, str):
            if error is None:
                peer.settled[token] = tp_size
            else:
                peer.refused[token] = error
        return error

    def judge_startup(self) -> None:
        """Judge this worker against every other engine whose manifests the folder holds."""
        if self.folder is None or self.not_judged() is not None:
            return
        role = getattr(getattr(self.worker, "kv_transfer_config", None), "kv_role", "kv_both")
        if role == "kv_producer":
            return  # it never reads
        mine = self.derived.topology.engine
        # not its own engine's files: no rank of an engine judges another rank of it
        for engine, found in sorted(read_engine_manifests(self.folder, but=mine or "").items()):
            if engine == mine or not engine:
                continue
            sizes = {m.topology.tp_size for _, m in found}
            if len(sizes) != 1 or len(found) != sizes.pop():
                continue  # not every rank written yet: the handshake will judge
            manifests = [m for _, m in sorted(found, key=lambda item: item[1].topology.tp_rank)]
            fields = self._fields(engine, manifests[0].topology.tp_size, "startup")
            try:
                diff(manifests, self.manifest, rule="vllm_nixl")
            except ManifestError:
                continue  # an engine of another model shares the folder: not a peer of this one
            paths = [str(path) for path, _ in found]
            judge_peer(self.manifest, manifests, against="folder", rule="vllm_nixl",
                       fields={**fields, "manifests": paths}, policy=self.policy)  # fmt: skip


def _mended_by(
    error: LayoutMismatchError | None, receiver: Manifest, senders: list[Manifest]
) -> LayoutMismatchError | None:
    """A refusal's message ends with the vLLM setting that mends it and the engine to set it
    on (``safeview.vllm._settings``), or says that none does: vLLM logs the message of the
    error that fails a handshake or a request."""
    if error is None or not error.findings:
        return error
    try:
        from safeview.vllm._settings import setting_for

        hint = setting_for(error.findings[0], receiver, senders)
        said = (
            f"what mends it: {hint}"
            if hint
            else "no vLLM setting mends it: the two engines lay these pages out otherwise "
            "behind the same dtype, layout name, block size and TP size"
        )
        error.args = (f"{error.args[0] if error.args else ''}; {said}", *error.args[1:])
    except Exception as failure:  # the refusal stands as it was
        _step_aside("refusals left without their setting", failure)
    return error


# One thread per process judges P's handshake manifests while NIXL loads P's agent; started
# when a NIXL worker has registered (``Registered.registered``), not at its first handshake
_JUDGE = Background("safeview-handshake")
# and one tells each P what D found, so that neither the handshake nor a judgement waits on it
_TELL = Background("safeview-verdict")


class _Peer:
    """What D holds of one P engine: P's rank manifests it was judged against (from P's
    handshake), the ranks judged, and the request tokens settled: passed (with the P TP
    size each says), or refused with their error (a token and the ``tp_size`` a request
    claimed with it: refused for that claim only)."""

    __slots__ = ("judged", "manifests", "refused", "settled")

    def __init__(
        self, manifests: dict[int, Manifest], judged: list[int], error: Exception | None = None
    ) -> None:
        self.manifests = manifests
        self.judged = judged
        tokens: dict[str, int | None] = {
            request_token(m): m.topology.tp_size for m in manifests.values()
        }
        self.settled: dict[str, int | None] = {} if error is not None else tokens
        self.refused: dict[Any, Exception | None] = dict.fromkeys(tokens, error) if error else {}


def token_of_payload(payload: Any) -> str | None:
    """The request token of the manifest a worker's handshake payload carries (P's scheduler
    reads rank 0's at start-up), or ``None`` when it carries none."""
    from safeview.vllm._nixl import WIRE_KEY

    wire = getattr(payload, WIRE_KEY, None)
    if not isinstance(wire, bytes):
        return None
    return request_token(from_wire(wire, peer="this engine's rank 0"))


_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


@functools.lru_cache(maxsize=64)  # a worker asks for its own engine's at every look
def _safe(engine: str) -> str:
    """An engine id as one folder name: nothing but letters, digits, ``_``, ``-`` and ``.``,
    and no leading dot (no hidden folder, no way up)."""
    name = _UNSAFE.sub("_", engine)
    return name if name and not name.startswith(".") else f"_{name}"


# -- the hooks -------------------------------------------------------------------------------


def _guard_handshake(layout: WorkerLayout) -> None:
    """Wrap ``worker.add_remote_agent`` on the instance: judge P, then let vLLM go on; and
    ``worker._nixl_handshake``, to know P's side channel while its ranks are added.

    A P whose handshake carried its manifest is judged while NIXL loads P's agent (which
    releases the GIL: the judgement costs the handshake next to nothing); vLLM's call that
    loads it (the agent's ``add_remote_agent``, before vLLM prepares any descriptor of P's)
    returns only once the verdict is in, and under strict a refused P's agent is removed again
    and the refusal raised there. A P without one is judged before vLLM goes on at all."""
    from safeview.vllm._nixl import take_decoded, take_listens

    worker = layout.worker
    original = worker.add_remote_agent
    if getattr(original, _PATCHED, False):
        return

    @functools.wraps(original)
    def add_remote_agent(
        nixl_agent_meta: Any,
        remote_tp_rank: int = 0,
        remote_tp_size: int = 1,
        remote_dcp_size: int = 1,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        refusal: Exception | None = None
        judgement: Callable[[], Exception | None] | None = None
        try:
            wire = take_decoded()  # what P's payload carried, decoded by vLLM just now
            if wire is not None:  # P runs the plugin: its side channel answers safeview too
                layout.carried.add(str(getattr(nixl_agent_meta, "engine_id", "")))
            if take_listens() and wire is not None:  # and it is told D's verdict
                layout.listening.add(str(getattr(nixl_agent_meta, "engine_id", "")))
            if wire is None:  # P without safeview: its folder, or its NIXL metadata
                refusal = layout.judge_handshake(nixl_agent_meta, remote_tp_size, remote_dcp_size)
            elif layout._reason_not_judged(nixl_agent_meta, remote_dcp_size) is not None:
                # left to vLLM: said now, from metadata vLLM may still rewrite
                refusal = layout.judge_handshake_wire(
                    nixl_agent_meta, wire, remote_tp_rank, remote_tp_size, remote_dcp_size
                )
            else:  # judged from P's manifest alone, while NIXL loads P's agent
                _judge_while_loading(layout)
                judgement = functools.partial(
                    layout.judge_handshake_wire_in,
                    getattr(layout.handshake, "context", None),
                    nixl_agent_meta, wire, remote_tp_rank, remote_tp_size, remote_dcp_size,
                )  # fmt: skip
        except Exception as error:  # safeview's own failure: vLLM goes on unjudged
            _step_aside("P/D layouts left unjudged", error)
        if refusal is not None:
            raise refusal
        if judgement is None:
            return original(nixl_agent_meta, remote_tp_rank, remote_tp_size, remote_dcp_size,
                            *args, **kwargs)  # fmt: skip
        layout.handshake.judgement = judgement  # the agent's add_remote_agent starts it
        try:
            name = original(nixl_agent_meta, remote_tp_rank, remote_tp_size, remote_dcp_size,
                            *args, **kwargs)  # fmt: skip
        except Exception:
            # vLLM stopped before loading P's agent: a refusal of P's layout is the reason
            # to give, if there is one
            refusal = _judged_now(layout, judgement)
            if refusal is not None:
                raise refusal from None
            raise
        refusal = _judged_now(layout, judgement)  # vLLM did not load P's agent through it
        if refusal is not None:
            raise refusal
        return name

    setattr(add_remote_agent, _PATCHED, True)
    worker.add_remote_agent = add_remote_agent

    handshake = getattr(worker, "_nixl_handshake", None)
    if handshake is None:
        return

    @functools.wraps(handshake)
    def _nixl_handshake(host: str, port: int, *args: Any, **kwargs: Any) -> Any:
        layout.handshake.context = {"host": host, "port": port, "manifests": {}}
        try:
            return handshake(host, port, *args, **kwargs)
        finally:
            layout.handshake.context = None

    worker._nixl_handshake = _nixl_handshake


def _verdict(judging: Future[Exception | None]) -> Exception | None:
    """The refusal a background judgement came to, once it is in; safeview's own failure
    there is reported and refuses nothing."""
    try:
        return judging.result()
    except Exception as error:
        _step_aside("P/D layouts left unjudged", error)
        return None


def _judged_now(
    layout: WorkerLayout, judgement: Callable[[], Exception | None]
) -> Exception | None:
    """``judgement``'s refusal, if it is still this thread's to make (vLLM did not load P's
    agent through the agent known here, or stopped before): judged here and now."""
    if getattr(layout.handshake, "judgement", None) is not judgement:
        return None  # the agent's add_remote_agent made it
    layout.handshake.judgement = None
    try:
        refusal: Exception | None = judgement()
    except Exception as error:
        _step_aside("P/D layouts left unjudged", error)
        return None
    return refusal


def _judge_while_loading(layout: WorkerLayout) -> None:
    """Make the NIXL agent's ``add_remote_agent`` (the call that loads a peer's agent, in C,
    without the GIL) judge that peer in the plugin's thread meanwhile, if a judgement is due in
    this thread, and return only once the verdict is in: under strict a refused peer's agent is
    removed again and the refusal raised there, before vLLM prepares a descriptor of it.
    Installed on whatever agent the worker holds now."""
    agent: Any = getattr(layout.worker, "nixl_wrapper", None)
    load = getattr(agent, "add_remote_agent", None)
    if load is None or getattr(load, _PATCHED, False):
        return

    @functools.wraps(load)
    def add_remote_agent(*args: Any, **kwargs: Any) -> Any:
        judgement = getattr(layout.handshake, "judgement", None)
        if judgement is None:
            return load(*args, **kwargs)
        layout.handshake.judgement = None
        judging = layout.background.submit(judgement)
        try:
            name = load(*args, **kwargs)
        except Exception:
            refusal = _verdict(judging)
            if refusal is not None:
                raise refusal from None
            raise
        refusal = _verdict(judging)
        if refusal is not None:
            with contextlib.suppress(Exception):  # P's agent is not kept for a refused P
                agent.remove_remote_agent(name)
            raise refusal
        return name

    setattr(add_remote_agent, _PATCHED, True)
    agent.add_remote_agent = add_remote_agent


def _guard_reads(layout: WorkerLayout) -> None:
    """Wrap ``worker._read_blocks_for_req`` (vLLM 0.33's pull worker: where D issues the READs
    of one request, once P's agent is loaded) on the instance: the request's token is checked
    first; a refusal under strict fails that request as vLLM fails a KV load (its blocks
    reported as failed, ``kv_load_failure_policy`` decides), and D goes on."""
    from safeview.vllm._nixl import TOKEN_ATTRIBUTE

    worker = layout.worker
    original = getattr(worker, "_read_blocks_for_req", None)
    if original is None or getattr(original, _PATCHED, False):
        return

    @functools.wraps(original)
    def _read_blocks_for_req(req_id: str, meta: Any, *args: Any, **kwargs: Any) -> Any:
        token = getattr(meta, TOKEN_ATTRIBUTE, None)
        remote = getattr(meta, "remote", None)
        # before the handshake, vLLM only starts it: the check waits for P's agent
        if token is None or remote is None or remote.engine_id not in worker._remote_agents:
            return original(req_id, meta, *args, **kwargs)
        refusal = None
        try:
            refusal = layout.check_request(req_id, token, meta)
        except Exception as error:  # safeview's own failure: vLLM goes on unjudged
            _step_aside("P/D request tokens left unchecked", error)
        if refusal is None:
            return original(req_id, meta, *args, **kwargs)
        # what vLLM does for a request it will not read (an invalid remote engine)
        with contextlib.suppress(Exception):
            worker._log_failure(failure_type="layout_refused", req_id=req_id, error=refusal,
                                meta=meta)  # fmt: skip
        from safeview.vllm._metrics import refused

        refused(worker, req_id)  # counted as safeview's refusal, not a failed READ
        worker._handle_failed_transfer(
            req_id, None, worker._recv_failures, record_failed_transfer=False
        )
        return None

    setattr(_read_blocks_for_req, _PATCHED, True)
    worker._read_blocks_for_req = _read_blocks_for_req
    worker._safeview_layout = layout  # what judges this worker's peers, for a look from outside


class Registered:
    """What ``at_registration`` derived: each worker's layout, and the first manifest (its
    fingerprint and file) for the ``registration_checked`` event."""

    def __init__(
        self, layouts: list[WorkerLayout], manifest: Manifest | Derived | None, path: Path | None
    ):
        self.layouts = layouts
        self.manifest = manifest
        self.path = path

    def in_summary(self) -> Any:
        """``with registered.in_summary():`` around the registration check."""
        import contextlib

        if self.manifest is None:
            return contextlib.nullcontext()
        path = None if self.path is None else str(self.path)
        # a NIXL worker's manifest goes out in its handshake (``registered``), and to the folder
        published = (["handshake"] if self.layouts else []) + (["folder"] if path else [])
        return log.manifest_of_registration(self.manifest.fingerprint, path, published)

    def registered(self) -> None:
        """After the connector's own ``register_kv_caches`` succeeded: guard each NIXL worker's
        handshake and judge it against the engines already in the folder. Never raises."""
        for layout in self.layouts:
            try:
                layout.background.start()
                _guard_handshake(layout)
                _guard_reads(layout)
                layout.serve()  # P's side: the manifest travels in its handshake
                layout.judge_startup()
            except Exception as error:  # safeview's own failure: vLLM goes on unjudged
                _step_aside("P/D layouts left unjudged", error)


def at_registration(
    connector: Any, kv_caches: Mapping[str, Any], kv_cache_config: Any, policy: Policy
) -> Registered:
    """Before a connector's ``register_kv_caches``: describe what each of its NIXL workers
    registers (and, with ``SAFEVIEW_MANIFEST_DIR`` set, what any other connector's process
    holds), and write it there. Never raises: safeview's own failure is one
    ``integration_unavailable`` event, and nothing is judged."""
    folder = manifest_dir()
    workers = _nixl_workers(connector)
    if policy is Policy.OFF or kv_cache_config is None or not (workers or folder):
        return Registered([], None, None)
    try:
        if workers:
            layouts = [
                WorkerLayout(
                    worker,
                    describe_caches(
                        kv_caches,
                        kv_cache_config,
                        _worker_topology(worker),
                        getattr(worker.vllm_config, "model_config", None),
                    ),
                    folder,
                    policy,
                )
                for worker in workers
            ]
            manifests = [layout.derived for layout in layouts]
        else:
            layouts = []
            topology = _connector_topology(connector)
            model_config = getattr(connector._vllm_config, "model_config", None)
            manifests = [describe_caches(kv_caches, kv_cache_config, topology, model_config)]
        paths = [None if folder is None else write_manifest(m, folder) for m in manifests]
        for layout, path in zip(layouts, paths):
            layout.path = path
    except Exception as error:  # safeview's own failure, or a vLLM it does not know
        _step_aside("layout manifest not derived", error)
        return Registered([], None, None)
    return Registered(layouts, manifests[0], paths[0])
