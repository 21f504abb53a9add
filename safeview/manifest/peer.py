"""One judge for a peer's layout, whichever channel brought its manifest: the receiver's manifest
against the sender's (``safeview.diff``, the connector's rule), one event, and the error to act on.

Every integration that meets a peer (the vLLM plugin at a NIXL handshake or on a request's
token, a Mooncake receiver before its first transfer from a segment, a start-up look at a shared
folder) calls ``judge_peer`` with what it has: the verdict, the event and the error are the same
whatever brought the manifest. ``against`` says what the sender's manifest was:

- ``handshake``: the manifest the peer sent inside its handshake (``safeview.manifest.wire``);
- ``request``: the one a request's token named, judged before that request's transfer;
- ``store``: read from the transfer engine's metadata store (Mooncake's);
- ``folder``: the peer's own files in ``SAFEVIEW_MANIFEST_DIR``;
- ``nixl_metadata``: rebuilt from what vLLM's NIXL metadata reports (only the layers it names
  are judged: the receiver's others have no region there).

With no sender manifest (``senders`` ``None``), the verdict is ``not_judged`` with the reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from safeview import log
from safeview.errors import LayoutMismatchError, ManifestError
from safeview.findings import Finding
from safeview.manifest import Manifest
from safeview.manifest.diff import DiffReport, Rule, diff
from safeview.policy import Policy, PolicyArg, current_policy

__all__ = ["AGAINST", "Against", "judge_peer"]

Against = Literal["handshake", "request", "store", "folder", "nixl_metadata"]
AGAINST: tuple[Against, ...] = ("handshake", "request", "store", "folder", "nixl_metadata")
# a verdict made here is for the record only: the transfer it is about is not known yet
_EVENT_ONLY = {"startup"}


def _no_common_layer(senders: Sequence[Manifest], receiver: Manifest) -> DiffReport:
    """The report of a pair with no layer name in common (``diff`` refuses to compare them): a
    ``missing_layer`` finding per name, the sender's first. A peer whose layers are none of the
    receiver's is a mismatch, never a pair left unjudged."""
    sent = sorted({name for manifest in senders for name in manifest.layers})
    findings = [Finding.missing_layer(name, side="sender") for name in sent]
    findings += [Finding.missing_layer(name, side="receiver") for name in sorted(receiver.layers)]
    return DiffReport(
        "page_copy",
        tuple(findings),
        (),
        tuple(m.fingerprint for m in senders),
        (receiver.fingerprint,),
        rule_from="no layer in common",
        sender_ranks=tuple(sorted(m.topology.tp_rank for m in senders)),
        receiver_ranks=(receiver.topology.tp_rank,),
        sender_tp_size=senders[0].topology.tp_size,
        receiver_tp_size=receiver.topology.tp_size,
    )


def judge_peer(
    receiver: Manifest,
    senders: Sequence[Manifest] | None,
    *,
    against: Against | None,
    fields: dict[str, Any],
    rule: Rule | None = None,
    policy: PolicyArg | None = None,
    reason: str | None = None,
) -> LayoutMismatchError | None:
    """Judge a receiver rank against its peer's manifests; emit one event; return the error.

    ``senders``: the sender ranks at hand. One manifest is judged as that rank alone (a
    handshake brings one rank's: a layer the receiver reads from a rank not given is a
    ``missing_rank`` finding); several are one engine's ranks, and a rank its TP size declares
    that none holds is a finding. ``None``: nothing to judge against; a ``layout_checked`` event
    with verdict ``not_judged`` and ``reason``. Else ``safeview.diff(senders, receiver, rule)``
    (``rule`` ``None``: the rule of the connector the manifests name) and one event:
    ``layout_checked`` (``compatible``) or ``layout_mismatch``. A pair with no layer in common
    is a mismatch (a ``missing_layer`` finding per name); one ``diff`` cannot compare (a side
    whose ranks disagree on their TP size, a page over ``diff``'s limit) is ``not_judged`` with
    the error as the reason.

    ``fields``: the event's pair fields (``log.layout_checked``): ``engine``, ``tp_rank``,
    ``tp_size``, ``remote_engine``, ``remote_tp_size`` (default: the receiver's and the
    first sender's topology), ``when`` (required: ``handshake``, ``request``, ``transfer``,
    ``startup``), ``fingerprint`` (default: the receiver's), ``manifests`` (default: none),
    ``policy`` (default: the one in force). ``against`` and ``reason`` are set from the
    arguments.

    Returns the ``LayoutMismatchError`` under strict, for the caller to raise or to fail the
    request with (its event says ``action``: ``refused``); ``None`` under warn, under off (no
    event at all), for a compatible or unjudged pair, and at ``when`` ``startup`` (an event
    only: the transfer it is about is not known yet)."""
    in_force = current_policy(policy)
    if in_force is Policy.OFF:
        return None
    if against is not None and against not in AGAINST:
        raise ManifestError("against", against, f"is not one of {', '.join(AGAINST)}")
    topology = receiver.topology
    event: dict[str, Any] = {
        "engine": topology.engine,
        "tp_rank": topology.tp_rank,
        "tp_size": topology.tp_size,
        "remote_engine": None,
        "remote_tp_size": None,
        "policy": in_force.value,
        "fingerprint": receiver.fingerprint,
        "manifests": [],
    }
    if senders:
        event["remote_engine"] = senders[0].topology.engine
        event["remote_tp_size"] = senders[0].topology.tp_size
    event.update(fields)
    event["against"] = against
    event["reason"] = reason
    if senders is None:
        if event["reason"] is None:
            event["reason"] = "no manifest of the peer at hand"
        log.layout_checked(**event, verdict="not_judged")
        return None
    senders = list(senders)
    if not senders:
        raise ManifestError("senders", [], "holds no manifest: give None when there is none")
    if against == "nixl_metadata":
        # P's metadata names only the layers it registers regions for
        named = {name for manifest in senders for name in manifest.layers}
        common = {name: layer for name, layer in receiver.layers.items() if name in named}
        if common:
            receiver = Manifest(topology=receiver.topology, layers=common)
    sent: Manifest | list[Manifest] = senders[0] if len(senders) == 1 else senders
    try:
        report = diff(sent, receiver, rule=rule)
    except ManifestError as error:
        if error.field != "layers" or "no name in common" not in error.limit:
            event["reason"] = f"not judged: {error}"
            log.layout_checked(**event, verdict="not_judged")
            return None
        report = _no_common_layer(senders, receiver)
    return _verdict(report, event, in_force)


def _verdict(
    report: DiffReport, event: dict[str, Any], policy: Policy
) -> LayoutMismatchError | None:
    """One event for ``report``; the error under strict (not at start-up)."""
    event = {
        **event,
        "remote_fingerprints": report.sender_fingerprints,
        "layers": len(report.layers),
        "findings": len(report.findings),
    }
    if report.compatible:
        log.layout_checked(**event, verdict="compatible")
        return None
    strict = policy is Policy.STRICT
    refused = strict and event.get("when") not in _EVENT_ONLY
    log.layout_mismatch(report.findings[0], strict=strict, refused=refused, **event)
    return LayoutMismatchError(report) if refused else None
