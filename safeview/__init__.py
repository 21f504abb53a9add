"""safeview: checked byte-level views over shared tensor storage.

A layout spec goes in (``BlockLayout`` or ``StridedLayout``); its exact byte extent is checked
against the storage, a declared region and the policy in force; an ``as_strided`` view comes out,
never a copy, never a resized storage; and each decision leaves a structured log event.

The core, at the root, one module each: ``spec`` (layouts) -> ``check`` (the one checker, with
``findings`` and the ``overlap`` sweeps) -> ``view`` (``make_view``, through the torch boundary
``_torch``) -> ``log`` (events); ``kv`` makes whole registrations from live tensors. A folder per
face and per engine stands on it: ``guard`` (``sanitize()`` and the process guard), ``transfer``
(descriptors judged against the views they must hit; NIXL and Mooncake guards), ``manifest``
(what each page byte means, and ``diff``), ``cli`` (the ``safeview`` command), ``vllm`` (vLLM's
names and its plugin); docs/architecture.md draws it. Only the torch boundary imports torch;
importing safeview does not: the names that need torch load it on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from safeview.check import Report
from safeview.errors import (
    AddressError,
    ArgumentError,
    BoundsError,
    ConfigError,
    CoverageError,
    DigestMismatchError,
    FailureIgnoredError,
    LayoutMismatchError,
    ManifestError,
    OverlapError,
    SafeViewError,
    UnprovenWriteError,
)
from safeview.findings import Finding
from safeview.log import configure_from_env, configure_logging, reset_logging
from safeview.overlap import find_overlaps
from safeview.policy import Policy, current_policy, policy_scope

if TYPE_CHECKING:
    from safeview import kv, vllm
    from safeview.guard.sanitize import sanitize
    from safeview.manifest import Manifest, describe
    from safeview.manifest.diff import diff
    from safeview.manifest.digest import Digest, digest, verify
    from safeview.plan import Plan, PlanStorage, PlanView
    from safeview.spec import BlockLayout, Layout, Region, SpecError, StridedLayout, packed_layouts
    from safeview.view import make_view

__version__ = "0.9.4"

__all__ = [
    "AddressError",
    "ArgumentError",
    "BlockLayout",
    "BoundsError",
    "ConfigError",
    "CoverageError",
    "Digest",
    "DigestMismatchError",
    "FailureIgnoredError",
    "Finding",
    "Layout",
    "LayoutMismatchError",
    "Manifest",
    "ManifestError",
    "OverlapError",
    "Plan",
    "PlanStorage",
    "PlanView",
    "Policy",
    "Region",
    "Report",
    "SafeViewError",
    "SpecError",
    "StridedLayout",
    "UnprovenWriteError",
    "__version__",
    "configure_logging",
    "current_policy",
    "describe",
    "diff",
    "digest",
    "find_overlaps",
    "kv",
    "make_view",
    "packed_layouts",
    "policy_scope",
    "reset_logging",
    "sanitize",
    "verify",
    "vllm",
]

# Names whose modules import torch, loaded on first use so that the command line stays light.
_NEEDS_TORCH = {"make_view": "safeview.view", "kv": "safeview.kv", "vllm": "safeview.vllm"}
# Layout manifests and their diff (no torch until describe() reads tensors), loaded on first use
# too: a process that never compares two engines does not build their models.
_LATER = {
    # layouts, plans and sanitize() are pydantic models (or build them): the process guard,
    # which imports this package when torch is imported, never needs them (docs/costs.md)
    **dict.fromkeys(
        ("BlockLayout", "Layout", "Region", "SpecError", "StridedLayout", "packed_layouts"),
        "safeview.spec",
    ),
    **dict.fromkeys(("Plan", "PlanStorage", "PlanView"), "safeview.plan"),
    "sanitize": "safeview.guard.sanitize",
    "describe": "safeview.manifest",
    "Manifest": "safeview.manifest",
    "diff": "safeview.manifest.diff",
    "digest": "safeview.manifest.digest",
    "Digest": "safeview.manifest.digest",
    "verify": "safeview.manifest.digest",
}


def __getattr__(name: str) -> Any:
    module_name = _NEEDS_TORCH.get(name) or _LATER.get(name)
    if module_name is None:
        raise AttributeError(f"module 'safeview' has no attribute {name!r}")
    import importlib

    module = importlib.import_module(module_name)
    value = module if name in ("kv", "vllm") else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def _running_the_command() -> bool:
    """Whether this process is the ``safeview`` command, which reports a bad environment
    variable itself, in one line, with exit status 2: its console script, or
    ``python [OPTIONS] -m safeview`` whatever the options (``-X importtime``, ``-u``)."""
    import os
    import sys

    if os.path.splitext(os.path.basename(sys.argv[0]))[0] == "safeview":
        return True
    # the module that `python [OPTIONS] -m MODULE` runs, read from the interpreter's arguments
    rest = iter(getattr(sys, "orig_argv", sys.argv)[1:])
    for argument in rest:
        if argument in ("-", "--") or not argument.startswith("-"):
            return False  # a script, or standard input
        if argument == "--check-hash-based-pycs":
            next(rest, None)
        if argument.startswith("--"):
            continue
        flags = argument[1:]  # one-letter options, maybe with a value: -u, -um, -Ximporttime
        for at, flag in enumerate(flags):
            if flag in "cmWX":
                value = flags[at + 1 :] or next(rest, None)
                if flag in "cm":
                    return flag == "m" and value in ("safeview", "safeview.cli")
                break
    return False


try:
    configure_from_env()
except ConfigError:
    if not _running_the_command():
        raise
