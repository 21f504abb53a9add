"""Everything that knows vLLM's names: its own views from its ``KVCacheConfig``, and its plugin.

``check_registration(kv_caches, kv_cache_config)`` computes exactly the int8 views vLLM 0.33's
offloading worker (``OffloadingConnectorWorker.register_kv_caches``) makes, by its own rules, and
checks them: bounds, each view against itself, and aliasing within each KV-cache group.

``register_plugin`` is the entry point in the ``vllm.general_plugins`` group. vLLM calls it in
every process before any KV connector exists; it wraps ``KVConnectorFactory.create_connector`` so
that each connector's ``register_kv_caches`` first runs ``check_registration`` (or, with no
``KVCacheConfig`` known, the group-aware tensor check), then the connector's own method under
``sanitize()``. Each worker's layout manifest is derived there too, and a NIXL decode worker
judges every prefill engine it meets, in the handshake (``safeview.vllm._layout``).
``SAFEVIEW_VLLM=0`` turns it off. vLLM is imported only when one of these runs.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Hashable, Mapping
from typing import TYPE_CHECKING, Any

from safeview import _torch, log
from safeview.check import check_views
from safeview.errors import ArgumentError, BoundsError, CoverageError, OverlapError
from safeview.guard import process
from safeview.guard.sanitize import sanitize
from safeview.kv import Registration, _Planned, _register, _report, check_tensors
from safeview.policy import Policy, PolicyArg, current_policy
from safeview.vllm import _layout as _vllm_layout
from safeview.vllm._canonical import CanonicalMismatchError

if TYPE_CHECKING:
    import torch

__all__ = ["ENV_VLLM", "KNOWN_VERSIONS", "check_registration", "register_plugin"]

ENV_VLLM = "SAFEVIEW_VLLM"
KNOWN_VERSIONS = ("0.33",)
"""vLLM releases whose worker rules ``check_registration`` follows."""

_PATCHED = "__safeview_guarded__"


def _vllm_version() -> str:
    try:
        import vllm

        return str(getattr(vllm, "__version__", "unknown"))
    except Exception:  # an import that fails is an unknown vLLM too
        return "not importable"


def _unknown(what: str) -> ArgumentError:
    return ArgumentError(
        f"safeview.vllm follows the offloading worker of vLLM {', '.join(KNOWN_VERSIONS)}; "
        f"{what} (vLLM {_vllm_version()} is installed)"
    )


def _spec_classes() -> tuple[type, type]:
    try:
        from vllm.v1.kv_cache_interface import AttentionSpec, UniformTypeKVCacheSpecs
    except ImportError as error:
        raise _unknown(f"vllm.v1.kv_cache_interface cannot be imported ({error})") from None
    return AttentionSpec, UniformTypeKVCacheSpecs


def _selected_groups(kv_cache_config: Any) -> list[tuple[int, Any]]:
    """The groups the worker registers: the prefix-cacheable ones, or the HiSparse indexer groups
    when a HiSparse host pool exists (``get_offloading_group_ids``)."""
    groups = list(kv_cache_config.kv_cache_groups)
    if getattr(kv_cache_config, "hisparse_host_num_blocks", None) is None:
        ids = getattr(kv_cache_config, "prefix_cacheable_group_ids", None)
        if ids is None:
            ids = range(len(groups))
    else:
        ids = [
            index
            for index, group in enumerate(groups)
            if getattr(getattr(group, "role", None), "name", "") == "HISPARSE_INDEXER"
        ]
    return [(index, groups[index]) for index in ids]


def check_registration(
    kv_caches: Mapping[str, torch.Tensor],
    kv_cache_config: Any,
    *,
    policy: PolicyArg | None = None,
) -> Registration:
    """The int8 block views vLLM 0.33's offloading worker makes of ``kv_caches``, checked.

    For each layer of each registered group of ``kv_cache_config.kv_cache_groups``: the layer's
    spec (unwrapped from ``UniformTypeKVCacheSpecs``), its cache with kernel blocks folded into
    manager blocks (``group_kernel_blocks``), ``byte_offset = storage_offset * element_size``,
    page ``spec.page_size_bytes``, block stride ``stride(0) * element_size`` for an
    ``AttentionSpec`` layer and the page otherwise (Mamba), ``num_blocks`` of the config. Views of
    one group must not share a byte; views of different groups may (a block id belongs to one
    group at a time).

    Returns the ``Registration`` (``tensors_per_block`` are the worker's views: same storage,
    offset, shape and strides). Under strict, raises ``BoundsError`` (a layer past the end of its
    storage, with its name and numbers: where vLLM itself raises an empty ``AssertionError`` or
    reallocates the cache) or ``OverlapError``; under warn, logs and returns the views; off checks
    nothing. ``ArgumentError`` when the structures are not vLLM 0.33's, naming the version.
    """
    active = current_policy(policy)
    planned, page_bytes = _offloading_views(kv_caches, kv_cache_config)
    return _register(planned, page_bytes, active, source="vllm")


def _offloading_views(
    kv_caches: Mapping[str, torch.Tensor], kv_cache_config: Any
) -> tuple[_Planned, dict[str, int]]:
    """The offloading worker's views of ``kv_caches``, planned (not made)."""
    if not isinstance(kv_caches, Mapping):
        raise ArgumentError(
            f"kv_caches must map layer names to cache tensors; got {type(kv_caches).__name__}"
        )
    attention_spec, uniform_specs = _spec_classes()
    try:
        num_blocks = int(kv_cache_config.num_blocks)
        selected = _selected_groups(kv_cache_config)
        layers = [
            (group_id, layer, group.kv_cache_spec)
            for group_id, group in selected
            for layer in group.layer_names
        ]
    except (AttributeError, TypeError) as error:
        raise _unknown(f"its KVCacheConfig does not have the fields it knows ({error})") from None
    planned = _Planned()
    page_bytes: dict[str, int] = {}
    for group_id, layer, group_spec in layers:
        spec = group_spec
        if isinstance(group_spec, uniform_specs):
            spec = group_spec.kv_cache_specs.get(layer, group_spec)  # type: ignore[attr-defined]
        try:
            page = int(spec.page_size_bytes)
        except AttributeError:
            raise _unknown(f"the spec of layer {layer!r} has no page_size_bytes") from None
        cache = kv_caches.get(layer)
        if not _torch.is_strided_tensor(cache):
            raise ArgumentError(
                f"kv_caches[{layer!r}] must be the layer's cache tensor, as vLLM allocates it; "
                f"got {type(cache).__name__}"
            )
        assert cache is not None
        storage_object, byte_offset, block_stride_bytes = _manager_blocks(layer, cache, num_blocks)
        if not isinstance(spec, attention_spec):
            block_stride_bytes = page
        storage = planned.storages.name(storage_object)
        planned.add_block(
            layer,
            cache,
            name=layer,
            storage=storage,
            byte_offset=byte_offset,
            num_blocks=num_blocks,
            page_bytes=page,
            block_stride_bytes=block_stride_bytes,
            group=group_id,
        )
        page_bytes[layer] = page
    return planned, page_bytes


def _manager_blocks(
    layer: str, cache: torch.Tensor, num_blocks: int
) -> tuple[torch.UntypedStorage, int, int]:
    """The storage, ``byte_offset`` and manager-block stride of a layer's cache, as
    ``group_kernel_blocks`` folds it: a cache of ``ratio * num_blocks`` kernel blocks has a block
    stride of ``ratio`` kernel blocks. A cache with fewer blocks than ``num_blocks`` keeps its own
    stride, and the bounds check says by how much the view runs past the storage."""
    storage, byte_offset, kernel_stride, kernel_blocks = _torch.block_geometry(cache)
    if kernel_blocks <= num_blocks or num_blocks == 0:
        return storage, byte_offset, kernel_stride
    if kernel_blocks % num_blocks:
        raise ArgumentError(
            f"layer {layer!r}: its cache has {kernel_blocks} blocks, which do not fold into "
            f"num_blocks={num_blocks} manager blocks (vLLM would stop on an empty "
            "AssertionError in group_kernel_blocks)"
        )
    return storage, byte_offset, kernel_stride * (kernel_blocks // num_blocks)


# -- the plugin --------------------------------------------------------------------------------


def _is_offloading(connector: Any) -> bool:
    """Whether ``connector`` (or, for a ``MultiConnector``, one of the connectors it drives) is
    vLLM's ``OffloadingConnector``, whose worker makes the views ``check_registration`` computes."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
            OffloadingConnector,
        )
    except Exception:  # not in this vLLM: no connector follows those rules
        return False
    parts = [connector, *getattr(connector, "_connectors", ())]
    return any(isinstance(part, OffloadingConnector) for part in parts)


def _groups_of(config: Any) -> dict[str, Hashable]:
    """Layer name -> the index of its KV-cache group in ``config``."""
    return {
        layer: index
        for index, group in enumerate(config.kv_cache_groups)
        for layer in group.layer_names
    }


def _allocation(
    kv_caches: Mapping[str, Any], groups: Mapping[str, Hashable] | None
) -> dict[str, Any]:
    """The layers' cache tensors as vLLM allocated them. A layer that is in no KV-cache group and
    holds the very same tensor as another layer is left out: vLLM's cross-layer KV sharing hands
    such a layer its target's cache, which is one allocation, not two that alias. Layers of a
    group are all kept, so two of them on the same bytes are found."""
    seen: set[tuple[Any, ...]] = set()
    distinct: dict[str, Any] = {}
    ordered = sorted(kv_caches.items(), key=lambda item: groups is None or item[0] not in groups)
    for layer, value in ordered:
        tensors = value if isinstance(value, (list, tuple)) else (value,)
        key = tuple(
            (
                tensor.untyped_storage()._cdata,
                tensor.storage_offset(),
                tuple(tensor.shape),
                tensor.stride(),
                tensor.dtype,
            )
            if _torch.is_strided_tensor(tensor)
            else id(tensor)
            for tensor in tensors
        )
        grouped = groups is not None and layer in groups
        if grouped or key not in seen:
            distinct[layer] = value
        seen.add(key)
    return distinct


def _check_before_registration(connector: Any, kv_caches: Any, config: Any, active: Policy) -> Any:
    """Judge what ``connector`` is about to register, under ``active``, making no view; return
    the layers' groups for the sanitizer. Raises ``BoundsError`` or ``OverlapError`` under
    strict; anything else it raises is safeview's own failure or a vLLM it does not know."""
    if config is None:
        check_tensors(_allocation(kv_caches, None), policy=active)
        return None
    groups = _groups_of(config)
    if _is_offloading(connector):
        # the offloading worker's own views, judged before the worker makes any
        planned, page_bytes = _offloading_views(kv_caches, config)
        report = check_views(
            planned.storages.records(), planned.records, checks=active is not Policy.OFF
        )
        _report(report, planned.storages, active, layers=len(page_bytes), source="vllm")
        if not report.findings:  # every layer whole in the views (safeview.vllm._offload)
            from safeview.vllm._offload import check_offloading_coverage

            check_offloading_coverage(
                planned, lambda: _nixl_allocation(kv_caches, config), config, active
            )
            # with canonical_layout: its canonical page mapping against the strides
            from safeview.vllm._canonical import check_canonical

            packed = any(r.strides[0] != r.shape[1] for r in planned.records)
            check_canonical(connector, kv_caches, config, packed, active)
    else:
        # any other connector: the allocation it is handed (each layer in bounds, no two layers
        # of one group on the same bytes); its own views are judged as it makes them
        check_tensors(_allocation(kv_caches, groups), groups=groups, policy=active)
    return groups


def _guarded(connector: Any, kv_cache_config: Any) -> None:
    """Replace ``connector.register_kv_caches`` by the checked one, on this instance only."""
    original = connector.register_kv_caches
    if getattr(original, _PATCHED, False):
        return

    @functools.wraps(original)
    def register_kv_caches(kv_caches: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            active = current_policy()
            if active is Policy.OFF:
                return original(kv_caches, *args, **kwargs)
            config = kv_cache_config or getattr(connector, "_kv_cache_config", None)
            # the layout manifest (never raises): its fingerprint goes into the summary
            layout = _vllm_layout.at_registration(connector, kv_caches, config, active)
            with layout.in_summary():
                groups = _check_before_registration(connector, kv_caches, config, active)
            guard = sanitize(active, layers=kv_caches, groups=groups)
            process.learn_layers(kv_caches)  # raw addresses in them are judged (SAFEVIEW_GUARD)
        except (BoundsError, OverlapError, CoverageError, CanonicalMismatchError):
            raise  # a finding, under strict: the start-up stops with its numbers
        except Exception as error:  # safeview's own failure, or a vLLM it does not know
            _step_aside("register_kv_caches left unchecked", f"{type(error).__name__}: {error}")
            return original(kv_caches, *args, **kwargs)
        # the transfer engine's agent first, so that the sanitizer does not see safeview's own
        # guarding of it
        with _guard_nixl_agents(connector, kv_caches, config, active), guard:
            registered = original(kv_caches, *args, **kwargs)
        layout.registered()  # judge each P/D pair when D meets P (never raises)
        _digests_on_workers(connector, layout.layouts)
        _kv_accounted(layout.layouts)
        return registered

    setattr(register_kv_caches, _PATCHED, True)
    connector.register_kv_caches = register_kv_caches


def _digests_on_workers(connector: Any, layouts: list[Any]) -> None:
    """With ``SAFEVIEW_DIGEST`` on: each NIXL worker digests what P sends and what D receives
    (``safeview.vllm._digest``). Never raises."""
    sampling = _digest_sampling()
    if sampling.mode == "off" or not layouts:
        return
    try:
        from safeview.vllm._digest import guard_digest_worker

        parts = [connector, *getattr(connector, "_connectors", ())]
        for layout in layouts:
            owner = next(p for p in parts if getattr(p, "connector_worker", None) is layout.worker)
            guard_digest_worker(owner, layout.worker, _manifest_of(layout), layout.policy)
    except Exception as error:  # safeview's own failure, or a vLLM it does not know
        _step_aside("request digests left off", f"{type(error).__name__}: {error}")


def _kv_accounted(layouts: list[Any]) -> None:
    """Each NIXL worker counts its requests' KV (``safeview.vllm._metrics``), outermost of the
    plugin's wrappers, so that it sees what vLLM's scheduler will. Never raises."""
    try:
        from safeview.vllm import _metrics

        for layout in layouts:
            _metrics.guard_worker(layout.worker, _manifest_of(layout))
    except Exception as error:  # safeview's own failure, or a vLLM it does not know
        _step_aside("requests' KV left uncounted", f"{type(error).__name__}: {error}")


def _manifest_of(layout: Any) -> Any:
    """A worker's manifest, built from what its registration derived when first asked."""
    return lambda: layout.manifest


_SAMPLING: list[Any] = []


def _digest_sampling() -> Any:
    """``SAFEVIEW_DIGEST``, read once per process (a bad value: one warning, digests off)."""
    if not _SAMPLING:
        from safeview.manifest.digest import digest_sampling

        _SAMPLING.append(digest_sampling())
    return _SAMPLING[0]


def _metrics_on_connector_classes(factory: Any) -> None:
    """Count safeview's verdicts in this process, and wrap
    ``KVConnectorFactory.get_connector_class`` so that the class it gives (to vLLM's stat
    loggers in the front end, to the engine core) builds safeview's stats and Prometheus
    metrics beside its own (``safeview.vllm._metrics``). Never raises."""
    try:
        from safeview.vllm import _metrics

        sampling = _digest_sampling()
        fraction = {"off": 0.0, "all": 1.0}.get(sampling.mode, 1.0 / max(1, sampling.every))
        _metrics.install_counting(fraction)
        current = factory.__dict__.get("get_connector_class")
        if not isinstance(current, classmethod) or getattr(current.__func__, _PATCHED, False):
            return
        get_class = current.__func__

        @functools.wraps(get_class)
        def get_connector_class(cls: type, *args: Any, **kwargs: Any) -> Any:
            found = get_class(cls, *args, **kwargs)
            _metrics.patch_class(found)
            return found

        setattr(get_connector_class, _PATCHED, True)
        setattr(factory, "get_connector_class", classmethod(get_connector_class))  # noqa: B010
    except Exception as error:  # vLLM's metrics as they are, without safeview's
        _step_aside("metrics left out of vLLM's", f"{type(error).__name__}: {error}")


_stepped_aside: set[str] = set()


def _step_aside(what: str, reason: str) -> None:
    """Say once per process and ``what`` (``"register_kv_caches left unchecked"``, ``"NIXL agent
    left unguarded"``) why safeview leaves something of vLLM's alone."""
    if what not in _stepped_aside:
        _stepped_aside.add(what)
        log.integration(
            "integration_unavailable",
            integration="vllm",
            reason=f"{what}: {reason}",
            version=_vllm_version(),
        )


def _route_events_to_vllm() -> None:
    """safeview's events go where vLLM's own records go (its ``vllm`` logger, whose handler is
    set up when the engine starts and does not propagate), at INFO, unless the application or
    ``SAFEVIEW_LOG_FORMAT`` already chose where they go."""
    from safeview.log import ENV_LOG_FORMAT, configure_logging, stdlib_logger

    if os.environ.get(ENV_LOG_FORMAT) or log._installed:
        return
    configure_logging(forward_to="vllm", level=stdlib_logger.level or logging.INFO)


def register_plugin() -> None:
    """The ``vllm.general_plugins`` entry point. Wraps ``KVConnectorFactory.create_connector``
    once per process; with ``SAFEVIEW_VLLM=0`` does nothing. Never raises: a vLLM whose internals
    are not the ones it knows gets one ``integration_unavailable`` warning and no patching."""
    if os.environ.get(ENV_VLLM, "1").strip().lower() in ("0", "false", "no", "off"):
        return
    try:
        _route_events_to_vllm()
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        current = KVConnectorFactory.__dict__.get("create_connector")
        if not isinstance(current, classmethod):
            raise AttributeError("KVConnectorFactory.create_connector is not a classmethod")
        if getattr(current.__func__, _PATCHED, False):
            return
        create = current.__func__

        @functools.wraps(create)
        def create_connector(cls: type, *args: Any, **kwargs: Any) -> Any:
            connector = create(cls, *args, **kwargs)
            try:
                from safeview.vllm._metrics import guard_connector

                # safeview's counts ride the connector's own stats to vLLM's metrics
                guard_connector(connector)
            except Exception as error:  # the connector's own stats, and the checks, as before
                log.internal_error(where="vllm create_connector (metrics)", error=error)
            try:
                config = kwargs.get("kv_cache_config", args[2] if len(args) > 2 else None)
                _guarded(connector, config)
                if current_policy() is not Policy.OFF:
                    from safeview.vllm._nixl import guard_scheduler

                    # P's scheduler: each request it sends to a D names P's layout
                    guard_scheduler(connector, _vllm_layout.token_of_payload)
                    from safeview.vllm._digest import guard_digest_scheduler

                    # and, sampled (SAFEVIEW_DIGEST), is digested before D reads it; its
                    # side channel answers a D that asks for the digests
                    guard_digest_scheduler(connector, _digest_sampling())
            except Exception as error:  # never stop the server for our own failure
                log.internal_error(where="vllm create_connector", error=error)
            return connector

        setattr(create_connector, _PATCHED, True)
        # a classmethod looked up at call time: every connector vLLM creates passes through it
        setattr(KVConnectorFactory, "create_connector", classmethod(create_connector))  # noqa: B010
        _metrics_on_connector_classes(KVConnectorFactory)
        try:
            from safeview.vllm._nixl import install_channels

            # the manifest and the request token on the NIXL connector's own channels
            install_channels()
        except Exception as error:  # a NIXL connector it does not know: judged as before
            _step_aside(
                "layouts not carried on NIXL's channels", f"{type(error).__name__}: {error}"
            )
    except Exception as error:
        log.integration(
            "integration_unavailable",
            integration="vllm",
            reason=f"{type(error).__name__}: {error}",
            version=_vllm_version(),
        )
        return
    log.integration(
        "integration_installed",
        integration="vllm",
        reason=f"KVConnectorFactory.create_connector guarded; policy {current_policy().value}",
        version=_vllm_version(),
    )


# -- the NIXL connector's agent ----------------------------------------------------------------
#
# vLLM 0.33's NIXL connector worker (``kv_connector/v1/nixl/base_worker.py``) registers each
# storage of the KV cache with its NIXL agent (``worker.nixl_wrapper``) and prepares its local
# descriptor lists once, in ``register_kv_caches``: ``prep_xfer_dlist("NIXL_INIT_AGENT", rows)``
# with rows ``(address, length, device, stride, count)`` per region (one per layer; one per storage
# for packed MLA); per request it moves blocks by index. While its ``register_kv_caches`` runs, the
# agent is replaced by ``safeview.transfer.nixl.guard(agent, allocation)``, so every one of those
# rows is checked once, before NIXL sees it, against the caches as vLLM allocated them. Lists
# prepared later (at a handshake: slices of pages for a peer of another tensor-parallel size, pieces
# of pages for a peer with smaller blocks) are checked with sub-page slices allowed.

_NIXL_WORKER_ATTRIBUTE = "nixl_wrapper"  # where vLLM 0.33's NIXL worker keeps its agent


def _nixl_workers(connector: Any) -> list[Any]:
    """The NIXL workers of ``connector`` (or of the connectors a ``MultiConnector`` drives)."""
    parts = [connector, *getattr(connector, "_connectors", ())]
    workers = [getattr(part, "connector_worker", None) for part in parts]
    return [worker for worker in workers if hasattr(worker, _NIXL_WORKER_ATTRIBUTE)]


def _layer_page_bytes(config: Any, layer: str) -> int | None:
    """``page_size_bytes`` of ``layer``'s spec in ``config`` (unwrapping uniform-type groups)."""
    for group in getattr(config, "kv_cache_groups", ()):
        if layer in group.layer_names:
            spec = group.kv_cache_spec
            spec = getattr(spec, "kv_cache_specs", {}).get(layer, spec)
            return int(spec.page_size_bytes)
    return None


def _nixl_allocation(kv_caches: Mapping[str, Any], kv_cache_config: Any) -> Any:
    """The allocation a NIXL worker registers, as a ``safeview.transfer.MemoryMap``: each storage
    at its address, and each layer's cache as the worker counts its blocks, along the tensor's
    first axis (kernel blocks where the attention kernel splits vLLM's blocks): a page is the
    span of one block of the tensor, the block stride its ``stride(0)``. A flat byte cache (a
    layer without views of its own) is cut in pages of its spec. Layers of a ``kv_cache_config``
    group only, when one is given (the worker registers no other)."""
    from safeview import _arith
    from safeview.transfer import MemoryMap, StorageSpan, ViewSpan

    layers = set(_groups_of(kv_cache_config)) if kv_cache_config is not None else None
    storages: dict[int, StorageSpan] = {}
    views: list[ViewSpan] = []
    for layer, cache in kv_caches.items():
        if layers is not None and layer not in layers:
            continue
        if not _torch.is_strided_tensor(cache) or not cache.dim():
            raise ArgumentError(
                f"kv_caches[{layer!r}] must be the layer's cache tensor, as vLLM allocates it; "
                f"got {type(cache).__name__}"
            )
        facts = _torch.storage_facts(_torch.storage_of(cache))
        if not facts.base:
            continue  # no address (meta): no descriptor can hit it
        span = storages.get(facts.key)
        if span is None:
            span = storages[facts.key] = StorageSpan(
                f"storage{len(storages)}", facts.base, facts.nbytes, facts.device
            )
        byte_offset, shape, strides, itemsize = _torch.geometry(cache)
        if len(shape) > 1:
            page = _arith.extent_bytes(0, shape[1:], strides[1:], itemsize)
            block_stride, blocks = strides[0] * itemsize, shape[0]
        else:
            spec_page = _layer_page_bytes(kv_cache_config, layer)
            if not spec_page:
                raise ArgumentError(f"layer {layer!r}: a flat cache and no page size in its spec")
            page = block_stride = spec_page
            blocks = shape[0] * itemsize // spec_page
        views.append(ViewSpan(layer, span.name, byte_offset, page, block_stride, blocks, layer))
    return MemoryMap(tuple(storages.values()), tuple(views))


class _NixlAgentsGuarded:
    """``with _guard_nixl_agents(...)``: see ``_guard_nixl_agents``."""

    def __init__(
        self, connector: Any, kv_caches: Mapping[str, Any], kv_cache_config: Any, policy: Policy
    ) -> None:
        self.connector = connector
        self.kv_caches = kv_caches
        self.kv_cache_config = kv_cache_config
        self.policy = policy
        self.guarded: list[tuple[Any, Any, Any]] = []  # (worker, agent, allocation)

    def __enter__(self) -> None:
        try:
            workers = _nixl_workers(self.connector)
            if not workers:
                return
            from safeview.vllm._nixl import guard_worker

            allocation = _nixl_allocation(self.kv_caches, self.kv_cache_config)
            for worker in workers:
                if getattr(worker, "use_host_buffer", False):
                    # it registers host buffers it makes inside register_kv_caches, not these
                    _step_aside(
                        "NIXL agent left unguarded",
                        "the worker stages transfers through host buffers",
                    )
                    continue
                agent = getattr(worker, _NIXL_WORKER_ATTRIBUTE)
                # Mamba layers transfer conv and SSM state as slices of a page
                whole_pages = not getattr(worker, "_has_mamba", False)
                checked = guard_worker(worker, agent, allocation, self.policy, whole_pages)
                setattr(worker, _NIXL_WORKER_ATTRIBUTE, checked)
                self.guarded.append((worker, agent, allocation))
        except Exception as error:  # safeview's own failure, or a vLLM or NIXL it does not know
            self._restore()
            _step_aside("NIXL agent left unguarded", f"{type(error).__name__}: {error}")

    def __exit__(self, *exc_info: object) -> None:
        if exc_info[0] is None and self.guarded:
            self._check_coverage()
        # From now on the worker prepares lists only at handshakes, whose rows may be slices of
        # pages (a peer of another tensor-parallel size): those are allowed from here.
        try:
            from safeview.vllm._nixl import guard_worker

            for worker, agent, allocation in self.guarded:
                checked = guard_worker(worker, agent, allocation, self.policy, False)
                setattr(worker, _NIXL_WORKER_ATTRIBUTE, checked)
        except Exception as error:
            self._restore()
            _step_aside("NIXL agent left unguarded", f"{type(error).__name__}: {error}")

    def _check_coverage(self) -> None:
        """Every layer the worker is to transfer lies in the lists it prepared (under strict a
        ``CoverageError`` stops the start-up, before any transfer)."""
        try:
            from safeview.vllm._nixl import check_worker_coverage

            for worker, agent, allocation in self.guarded:
                check_worker_coverage(
                    worker, agent, allocation, self.kv_caches, self.kv_cache_config, self.policy
                )
        except CoverageError:
            self._restore()
            raise
        except Exception as error:  # safeview's own failure: the registration stands unchecked
            _step_aside("NIXL coverage left unchecked", f"{type(error).__name__}: {error}")

    def _restore(self) -> None:
        for worker, agent, _ in self.guarded:
            setattr(worker, _NIXL_WORKER_ATTRIBUTE, agent)
        self.guarded.clear()


def _guard_nixl_agents(
    connector: Any, kv_caches: Mapping[str, Any], kv_cache_config: Any, policy: Policy
) -> _NixlAgentsGuarded:
    """Around a connector's own ``register_kv_caches``: for each NIXL worker of ``connector``
    (vLLM 0.33's ``NixlConnector``, pull or push, alone or in a ``MultiConnector``), its agent is
    replaced by ``safeview.transfer.nixl.guard(agent, allocation, policy=policy)``, so every local
    descriptor list the worker prepares is checked against the caches vLLM allocated: whole
    pages only while it registers, slices of pages allowed afterwards. Never raises for
    safeview's own sake: a failure, or a worker or NIXL it does not know, leaves the agent as it
    was with one ``integration_unavailable`` event. Use::

        with _guard_nixl_agents(connector, kv_caches, kv_cache_config, policy):
            connector_register_kv_caches(kv_caches)
    """
    return _NixlAgentsGuarded(connector, kv_caches, kv_cache_config, policy)
