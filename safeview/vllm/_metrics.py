"""What an operator sees: safeview's verdicts and each request's KV on vLLM 0.33's own metrics.

vLLM carries a connector's figures the same way for every connector: each worker's (and the
scheduler's) ``connector.get_kv_connector_stats()`` returns a ``KVConnectorStats``, which vLLM
aggregates over the workers, hands to the front end as a dict (``to_dict``), and rebuilds there
with the connector class's ``build_kv_connector_stats``: once for the periodic log line
(``KVConnectorLogging``: ``aggregate`` over the interval, then ``reduce``), once for
Prometheus (``KVConnectorProm``: the class's ``build_prom_metrics`` made the metrics, whose
``observe`` gets each dict).

The plugin rides that channel: every connector it creates returns a ``SafeviewKVConnectorStats``
holding the connector's own stats (``inner``) and safeview's counts of the step; its dict is the
connector's own with one more key, ``safeview``; and on the connector class,
``build_kv_connector_stats`` and ``build_prom_metrics`` take that key off before the connector's
own see the rest. So the connector's own figures are what they are without safeview, and
safeview's reach ``/metrics`` as ``vllm:safeview_...`` and the log line as ``safeview ...``.

Counting costs vLLM's step no lock: a verdict is one ``deque.append`` (atomic under the GIL)
where it is made, whatever the thread and the log level (``safeview.log.add_counter``); the
step's ``get_kv_connector_stats`` pops what is there.

Imported by ``safeview.vllm`` only; vLLM is imported when a class is first asked for.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import threading
from collections.abc import Iterable, Mapping
from typing import Any

from safeview import log

__all__ = ["COUNTERS", "STATS_KEY", "guard_connector", "install_counting", "patch_class"]

STATS_KEY = "safeview"  # the extra key of a connector's stats dict
_PATCHED = "__safeview_metrics__"

#: safeview's counters: key -> (Prometheus name, help, label name or None, its values). A
#: count's key in the stats dict is ``key`` or ``key|label value`` (``kv_requests`` has two
#: labels: ``kv_requests|verdict|kind``).
COUNTERS: dict[str, tuple[str, str, tuple[str, ...], tuple[tuple[str, ...], ...]]] = {
    "handshakes": (
        "vllm:safeview_handshakes_total",
        "P/D pairs judged at a NIXL handshake (D's side), by verdict.",
        ("verdict",),
        (("compatible",), ("mismatch",), ("refused",), ("not_judged",)),
    ),
    "requests": (
        "vllm:safeview_requests_judged_total",
        "Requests whose READ D issued or refused, by the verdict on P's layout they were read "
        "under (refused: safeview failed the request).",
        ("verdict",),
        (("compatible",), ("mismatch",), ("refused",), ("not_judged",)),
    ),
    "digests": (
        "vllm:safeview_digests_total",
        "Requests D compared with P's digest (SAFEVIEW_DIGEST), by verdict.",
        ("verdict",),
        (("agree",), ("mismatch",), ("refused",), ("not_judged",)),
    ),
    "descriptors": (
        "vllm:safeview_descriptor_violations_total",
        "Transfer descriptors that miss the pages they must hit (refused: under strict).",
        ("verdict", "kind"),
        (),
    ),
    "process_guard": (
        "vllm:safeview_process_guard_violations_total",
        "Views and raw addresses the process guard (SAFEVIEW_GUARD) judged out of bounds.",
        ("verdict",),
        (("refused",), ("mismatch",)),
    ),
    "internal_errors": (
        "vllm:safeview_internal_errors_total",
        "Times safeview failed itself and let vLLM go on unchecked.",
        ("kind",),
        (("internal_error",), ("integration_unavailable",)),
    ),
    "kv_requests": (
        "vllm:safeview_kv_requests_total",
        "Requests P marked for D to read, on D: their KV used, or the prompt recomputed or "
        "failed (kv_load_failure_policy), with why (kind: read, refused, read_failed, not_read).",
        ("verdict", "kind"),
        (("used", "read"),),
    ),
    "kv_blocks_expected": (
        "vllm:safeview_kv_blocks_expected_total",
        "D's blocks that requests P marked for transfer were to fill.",
        (),
        ((),),
    ),
    "kv_blocks_read": (
        "vllm:safeview_kv_blocks_read_total",
        "D's blocks filled by READs that completed and were used.",
        (),
        ((),),
    ),
    "kv_bytes_read": (
        "vllm:safeview_kv_bytes_read_total",
        "Bytes of D's pages filled by READs that completed and were used.",
        (),
        ((),),
    ),
    "kv_unread": (
        "vllm:safeview_kv_unread_requests_total",
        "Requests on P whose blocks were freed when their lease ran out, before every D "
        "worker read them (kind: never_read, partly_read).",
        ("kind",),
        (("never_read",), ("partly_read",)),
    ),
}
#: gauges: key -> (Prometheus name, help)
GAUGES = {
    "digest_sampled_fraction": (
        "vllm:safeview_digest_sampled_fraction",
        "The fraction of requests P digests for D to compare (SAFEVIEW_DIGEST: 0 off, 1 all).",
    ),
}

# -- counting --------------------------------------------------------------------------------

_pending: collections.deque[tuple[str, int]] = collections.deque()
#: the last layout verdict per (D engine, P engine), for the requests read under it
_pair_verdicts: dict[tuple[Any, Any], str] = {}
_guard_seen = [0, 0]  # the process guard's refused and warned counts already reported
_guard_lock = threading.Lock()  # only ever tried, never waited for
_sampled: list[float] = []


def add(key: str, amount: int = 1) -> None:
    """Count ``amount`` under ``key`` (one ``deque.append``: any thread, no lock)."""
    _pending.append((key, amount))


def _on_event(event: str, labels: dict[str, Any]) -> None:
    """``safeview.log``'s counter: each verdict event, as it is announced."""
    if event in ("layout_checked", "layout_mismatch"):
        verdict = str(labels.get("verdict"))
        when = labels.get("when")
        if when in ("handshake", "request"):
            _pair_verdicts[(labels.get("engine"), labels.get("remote_engine"))] = verdict
        if when == "handshake":
            add(f"handshakes|{verdict}")
    elif event in ("digest_checked", "digest_mismatch"):
        add(f"digests|{labels.get('verdict')}")
    elif event == "address_violation":
        verdict = "refused" if labels.get("strict") else "mismatch"
        add(f"descriptors|{verdict}|{labels.get('kind')}")
    elif event in ("internal_error", "integration_unavailable"):
        add(f"internal_errors|{event}")


def install_counting(sampled_fraction: float) -> None:
    """Once per process (the plugin's entry point): count safeview's verdict events, and say
    the fraction of requests digested."""
    _sampled[:] = [float(sampled_fraction)]
    log.add_counter(_on_event)


def pair_verdict(engine: Any, remote: Any) -> str:
    """The last layout verdict on the pair (``not_judged`` when none was made)."""
    return _pair_verdicts.get((engine, remote), "not_judged")


def _process_guard_counts() -> Iterable[tuple[str, int]]:
    """What the process guard refused and warned of since the last step that asked."""
    if not _guard_lock.acquire(blocking=False):
        return ()  # another thread's step reports them
    try:
        from safeview.guard import process

        counts = process.counts()
        refused, warned = counts.refused - _guard_seen[0], counts.warned - _guard_seen[1]
        _guard_seen[:] = [counts.refused, counts.warned]
    finally:
        _guard_lock.release()
    return [(key, n) for key, n in (("process_guard|refused", refused),
                                    ("process_guard|mismatch", warned)) if n]  # fmt: skip


def take() -> dict[str, int]:
    """The counts since the last ``take`` (of any connector of this process), summed."""
    found: dict[str, int] = {}
    while True:
        try:
            key, amount = _pending.popleft()
        except IndexError:
            break
        found[key] = found.get(key, 0) + amount
    for key, amount in _process_guard_counts():
        found[key] = found.get(key, 0) + amount
    return found


# -- vLLM's stats and Prometheus classes -------------------------------------------------------


def _stats_class() -> type:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

    @dataclasses.dataclass
    class SafeviewKVConnectorStats(KVConnectorStats):  # type: ignore[misc]
        """A connector's own stats (``inner``, ``None`` when it had none) and safeview's counts
        (``data``: key -> number, summed by ``aggregate``)."""

        inner: Any = None

        def to_dict(self) -> dict[str, Any]:
            own = dict(self.inner.to_dict()) if self.inner is not None else {}
            own[STATS_KEY] = dict(self.data)
            return own

        def reset(self) -> None:
            self.data: dict[str, Any] = {}
            if self.inner is not None:
                self.inner.reset()

        def aggregate(self, other: Any) -> Any:
            if isinstance(other, SafeviewKVConnectorStats):
                for key, value in other.data.items():
                    if key in GAUGES:
                        self.data[key] = value
                    else:
                        self.data[key] = self.data.get(key, 0) + value
                other = other.inner
            if other is not None:
                self.inner = other if self.inner is None else self.inner.aggregate(other)
            return self

        def reduce(self) -> dict[str, int | float]:
            own = self.inner
            found: dict[str, int | float] = {}
            if own is not None and not own.is_empty():
                found.update(own.reduce())
            found.update(_reduce(self.data))
            return found

        def is_empty(self) -> bool:
            counted = any(key not in GAUGES for key in self.data)
            return not counted and (self.inner is None or self.inner.is_empty())

    SafeviewKVConnectorStats.__module__ = __name__
    SafeviewKVConnectorStats.__qualname__ = "SafeviewKVConnectorStats"
    return SafeviewKVConnectorStats


def _reduce(counts: Mapping[str, Any]) -> dict[str, int | float]:
    """safeview's part of vLLM's periodic log line: each request's KV on D (when any), what P
    freed unread, and the verdicts counted (non-zero ones only)."""
    line: dict[str, int | float] = {}

    def total(prefix: str) -> int:
        return sum(int(v) for k, v in counts.items() if k == prefix or k.startswith(prefix + "|"))

    requests = total("kv_requests")
    if requests:
        line["safeview KV reqs"] = requests
        for verdict in ("used", "recomputed", "failed"):
            line[f"safeview KV {verdict}"] = total(f"kv_requests|{verdict}")
        line["safeview KV blocks expected"] = total("kv_blocks_expected")
        line["safeview KV blocks read"] = total("kv_blocks_read")
        line["safeview KV MB read"] = round(total("kv_bytes_read") / 2**20, 3)
    for key in sorted(counts):
        if key in GAUGES or key.split("|")[0] in ("kv_requests", "kv_blocks_expected",
                                                  "kv_blocks_read", "kv_bytes_read"):  # fmt: skip
            continue
        line["safeview " + key.replace("|", " ")] = int(counts[key])
    return line


_CLASSES: dict[str, type] = {}
_building = threading.local()  # inside a patched classmethod: a nested class's is vLLM's own


def stats_class() -> type:
    """The one ``SafeviewKVConnectorStats`` class of this process (made on first use)."""
    if "stats" not in _CLASSES:
        _CLASSES["stats"] = _stats_class()
    return _CLASSES["stats"]


def __getattr__(name: str) -> Any:
    # pickle finds the stats class by name (vLLM's executor pickles what workers return)
    if name == "SafeviewKVConnectorStats":
        return stats_class()
    raise AttributeError(name)


class SafeviewPromMetrics:
    """safeview's Prometheus metrics beside a connector's own (``inner``, or ``None``): made by
    the connector class's ``build_prom_metrics``, observed by vLLM's ``KVConnectorProm`` with
    each stats dict."""

    def __init__(
        self,
        inner: Any,
        metric_types: Mapping[type, type],
        labelnames: list[str],
        per_engine_labelvalues: Mapping[int, list[object]],
    ) -> None:
        from prometheus_client import Counter, Gauge

        self.inner = inner
        self.per_engine = dict(per_engine_labelvalues)
        self.counters: dict[str, Any] = {}
        self.gauges: dict[str, Any] = {}
        counter_cls, gauge_cls = metric_types[Counter], metric_types[Gauge]
        for key, (name, text, labels, values) in COUNTERS.items():
            metric = counter_cls(name=name, documentation=text,
                                 labelnames=[*labelnames, *labels])  # fmt: skip
            self.counters[key] = metric
            for engine in self.per_engine.values():
                for value in values:  # so that an alert sees a zero, not nothing
                    metric.labels(*engine, *value)
        for key, (name, text) in GAUGES.items():
            gauge = gauge_cls(name=name, documentation=text, labelnames=list(labelnames),
                              multiprocess_mode="mostrecent")  # fmt: skip
            self.gauges[key] = gauge
            for engine in self.per_engine.values():
                gauge.labels(*engine).set(_sampled[0] if _sampled else 0.0)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        own = {k: v for k, v in transfer_stats_data.items() if k != STATS_KEY}
        if self.inner is not None and own:
            self.inner.observe(own, engine_idx)
        counts = transfer_stats_data.get(STATS_KEY)
        if not counts:
            return
        engine = self.per_engine.get(engine_idx, [])
        for key, value in counts.items():
            name, *labels = str(key).split("|")
            if name in self.gauges:
                self.gauges[name].labels(*engine).set(float(value))
            elif name in self.counters and value:
                self.counters[name].labels(*engine, *labels).inc(value)


def patch_class(connector_cls: Any) -> None:
    """On ``connector_cls`` (the class vLLM's ``KVConnectorFactory.get_connector_class`` gives,
    in every process that logs or exposes metrics): its ``build_kv_connector_stats`` and
    ``build_prom_metrics`` see the connector's own part of a stats dict, and safeview's part is
    added to what they build. Once per class; never raises."""
    try:
        stats = getattr(connector_cls, "build_kv_connector_stats", None)
        prom = getattr(connector_cls, "build_prom_metrics", None)
        if stats is None or prom is None or getattr(stats, _PATCHED, False):
            return
        stats_fn, prom_fn = stats.__func__, prom.__func__
    except Exception as error:  # a connector class of another shape: its metrics alone
        log.internal_error(where="vllm metrics (connector class)", error=error)
        return

    @functools.wraps(stats_fn)
    def build_kv_connector_stats(cls: type, data: dict[str, Any] | None = None) -> Any:
        if data is None or STATS_KEY not in data or getattr(_building, "now", False):
            return stats_fn(cls, data)
        own = {k: v for k, v in data.items() if k != STATS_KEY}
        _building.now = True
        try:
            inner = stats_fn(cls, own) if own else None
        finally:
            _building.now = False
        return stats_class()(data=dict(data[STATS_KEY]), inner=inner)

    @functools.wraps(prom_fn)
    def build_prom_metrics(
        cls: type,
        vllm_config: Any,
        metric_types: Any,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> Any:
        if getattr(_building, "now", False):  # a connector a MultiConnector drives
            return prom_fn(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues)
        _building.now = True
        try:
            inner = prom_fn(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues)
        finally:
            _building.now = False
        return SafeviewPromMetrics(inner, metric_types, labelnames, per_engine_labelvalues)

    for wrapper in (build_kv_connector_stats, build_prom_metrics):
        setattr(wrapper, _PATCHED, True)
    connector_cls.build_kv_connector_stats = classmethod(build_kv_connector_stats)
    connector_cls.build_prom_metrics = classmethod(build_prom_metrics)


def guard_connector(connector: Any) -> None:
    """On a connector the plugin created (worker or scheduler side): ``get_kv_connector_stats``
    returns the connector's own stats inside a ``SafeviewKVConnectorStats`` with the counts of
    this process since the last step; ``None`` when neither has anything."""
    original = connector.get_kv_connector_stats
    if getattr(original, _PATCHED, False):
        return
    cls = stats_class()

    @functools.wraps(original)
    def get_kv_connector_stats(*args: Any, **kwargs: Any) -> Any:
        inner = original(*args, **kwargs)
        counts = take() if _pending or _guard_may_have_counted() else {}
        if not counts and inner is None:
            return None
        if _sampled:
            counts["digest_sampled_fraction"] = _sampled[0]  # type: ignore[assignment]
        return cls(data=counts, inner=inner)

    setattr(get_kv_connector_stats, _PATCHED, True)
    connector.get_kv_connector_stats = get_kv_connector_stats


def _guard_may_have_counted() -> bool:
    from safeview.guard import process

    return process.active()


# -- each request's KV, on D and on P (vLLM 0.33's NIXL pull worker) ----------------------------


class KvAccount:
    """One NIXL worker's requests: on D, those P marked for it to read (from the step's
    metadata), until vLLM reports them done or failed; on P, the leases that ran out."""

    def __init__(self, worker: Any, manifest: Any) -> None:
        self.worker = worker
        self.manifest = manifest  # () -> Manifest, or None
        self.expected: dict[str, tuple[int, Any]] = {}  # request -> (blocks, P engine)
        self.issued: dict[str, int] = {}  # request -> D's physical blocks in its READ
        self.refused: set[str] = set()  # requests safeview failed before their READ
        self.failed_in_vllm: set[str] = set()  # requests vLLM itself saw fail
        self._page_bytes: int | None = None
        config = getattr(worker, "kv_transfer_config", None)
        self.recompute = getattr(config, "kv_load_failure_policy", "fail") == "recompute"
        engine = getattr(worker, "engine_id", None)
        self.engine = None if engine is None else str(engine)
        self.tp_rank = getattr(worker, "tp_rank", None)

    def page_bytes(self) -> int:
        """Bytes of one of D's blocks on this rank, all layers (0 when unknown)."""
        if self._page_bytes is None:
            try:
                manifest = self.manifest() if self.manifest is not None else None
                layers = manifest.layers.values() if manifest is not None else ()
                self._page_bytes = sum(int(layer.page_bytes) for layer in layers)
            except Exception:  # bytes unknown: blocks are still counted
                self._page_bytes = 0
        return self._page_bytes

    # D
    def note(self, metadata: Any) -> None:
        for request, meta in (getattr(metadata, "reqs_to_recv", None) or {}).items():
            if request in self.expected or getattr(meta, "remote", None) is None:
                continue
            blocks = sum(len(group) for group in meta.local_block_ids)
            self.expected[str(request)] = (blocks, str(meta.remote.engine_id))
            add("kv_blocks_expected", blocks)

    def read(self, request: str, meta: Any) -> None:
        """After vLLM's ``_read_blocks_for_req`` (called again once a handshake it started is
        done): whether it issued the READ, counted once, under the verdict on P's layout."""
        if request in self.issued or request not in self.expected:
            return
        if request in getattr(self.worker, "_recving_transfers", {}):
            ids = getattr(meta, "local_physical_block_ids", None) or meta.local_block_ids
            self.issued[request] = sum(len(group) for group in ids)
            add(f"requests|{pair_verdict(self.engine, self.expected[request][1])}")

    def refuse(self, request: str) -> None:
        """safeview failed ``request`` before its READ (a layout token refused)."""
        self.refused.add(request)
        add("requests|refused")

    def settle(self, results: Any) -> None:
        """vLLM's ``get_transfer_results`` of this step, as the scheduler will read it."""
        done = getattr(results, "finished_recving", None) or ()
        failed = getattr(results, "failed_recving", None) or ()
        for request in done:
            found = self.expected.pop(request, None)
            if found is None:
                continue
            blocks, remote = found
            issued = self.issued.pop(request, None)
            refused = request in self.refused
            self.refused.discard(request)
            in_vllm = request in self.failed_in_vllm
            self.failed_in_vllm.discard(request)
            if request not in failed:
                add("kv_requests|used|read")
                add("kv_blocks_read", blocks)
                add("kv_bytes_read", (issued or 0) * self.page_bytes())
                continue
            if refused or (issued is not None and not in_vllm):
                kind = "refused"  # a layout token, or a digest after the READ
            elif issued is not None:
                kind = "read_failed"
            elif pair_verdict(self.engine, remote) == "refused":
                kind = "refused"  # the handshake with P was refused: so is the request
                add("requests|refused")
            else:
                kind = "not_read"  # vLLM never read it (its handshake failed): unjudged
                add("requests|not_judged")
            outcome = "recomputed" if self.recompute else "failed"
            add(f"kv_requests|{outcome}|{kind}")
            log.kv_not_received(engine=self.engine, tp_rank=self.tp_rank, remote_engine=remote,
                                request=request, reason=kind, outcome=outcome,  # type: ignore[arg-type]
                                blocks_expected=blocks, blocks_read=0)  # fmt: skip

    # P
    def expired(self, held: set[str], counts: Mapping[str, int]) -> None:
        """Requests P held for reading (``held``) that its lease reaper just freed."""
        gone = held - set(getattr(self.worker, "_reqs_to_send", {}))
        config: Any = getattr(self.worker, "kv_transfer_config", None)
        lease: float | None = None
        with contextlib.suppress(Exception):  # a config of another shape: no lease said
            lease = float(config.get_from_extra_config("kv_lease_duration", 30))
        for request in sorted(gone):
            reads = int(counts.get(request, 0))
            add(f"kv_unread|{'partly_read' if reads else 'never_read'}")
            log.kv_not_read(engine=self.engine, tp_rank=self.tp_rank, request=request,
                            reads=reads, lease_s=lease)  # fmt: skip


def guard_worker(worker: Any, manifest: Any) -> None:
    """Count each request's KV on ``worker`` (vLLM 0.33's NIXL pull worker), wrapping on the
    instance ``start_load_kv``, ``_read_blocks_for_req``, ``_handle_failed_transfer``,
    ``get_transfer_results`` and ``_reap_expired_send_leases``. Never raises."""
    if getattr(worker, "_TRANSFER_MODE", "pull") != "pull":
        return
    needed = ("start_load_kv", "_read_blocks_for_req", "_handle_failed_transfer",
              "get_transfer_results", "_reap_expired_send_leases")  # fmt: skip
    if not all(hasattr(worker, name) for name in needed):
        return
    if getattr(worker.get_transfer_results, _PATCHED, False):
        return
    account = KvAccount(worker, manifest)
    start, read = worker.start_load_kv, worker._read_blocks_for_req
    failed, results = worker._handle_failed_transfer, worker.get_transfer_results
    reap = worker._reap_expired_send_leases

    @functools.wraps(start)
    def start_load_kv(metadata: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            account.note(metadata)
        except Exception as error:
            log.internal_error(where="vllm metrics start_load_kv", error=error)
        return start(metadata, *args, **kwargs)

    @functools.wraps(read)
    def _read_blocks_for_req(req_id: str, meta: Any, *args: Any, **kwargs: Any) -> Any:
        done = read(req_id, meta, *args, **kwargs)
        try:
            account.read(str(req_id), meta)
        except Exception as error:
            log.internal_error(where="vllm metrics _read_blocks_for_req", error=error)
        return done

    @functools.wraps(failed)
    def _handle_failed_transfer(req_id: str, *args: Any, **kwargs: Any) -> Any:
        if str(req_id) not in account.refused:
            account.failed_in_vllm.add(str(req_id))
        return failed(req_id, *args, **kwargs)

    @functools.wraps(results)
    def get_transfer_results(*args: Any, **kwargs: Any) -> Any:
        found = results(*args, **kwargs)
        if account.expected:
            try:
                account.settle(found)
            except Exception as error:
                log.internal_error(where="vllm metrics get_transfer_results", error=error)
        return found

    @functools.wraps(reap)
    def _reap_expired_send_leases(done_sending: Any, *args: Any, **kwargs: Any) -> Any:
        held = getattr(worker, "_reqs_to_send", None)
        if not held:
            return reap(done_sending, *args, **kwargs)
        before = set(held)
        counts = dict(getattr(worker, "consumer_notification_counts_by_req", {}))
        done = reap(done_sending, *args, **kwargs)
        if len(held) < len(before):
            try:
                account.expired(before, counts)
            except Exception as error:
                log.internal_error(where="vllm metrics lease", error=error)
        return done

    for wrapper in (start_load_kv, _read_blocks_for_req, _handle_failed_transfer,
                    get_transfer_results, _reap_expired_send_leases):  # fmt: skip
        setattr(wrapper, _PATCHED, True)
    worker.start_load_kv = start_load_kv
    worker._read_blocks_for_req = _read_blocks_for_req
    worker._handle_failed_transfer = _handle_failed_transfer
    worker.get_transfer_results = get_transfer_results
    worker._reap_expired_send_leases = _reap_expired_send_leases
    worker._safeview_kv = account  # for a look from outside


def refused(worker: Any, request: str) -> None:
    """The plugin's layout check failed ``request`` on ``worker`` before its READ."""
    account = getattr(worker, "_safeview_kv", None)
    if account is not None:
        account.refuse(str(request))
