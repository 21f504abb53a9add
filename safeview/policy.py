"""What safeview does about a view that breaks its bounds: the policy and where it comes from.

Resolution order: the ``policy=`` argument of a call, then the innermost ``policy_scope``, then the
environment variable ``SAFEVIEW_BOUNDS_POLICY``, then ``strict``. Scopes live in a ``ContextVar``,
so each thread and each asyncio task sees its own.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from contextvars import ContextVar
from enum import Enum
from typing import Literal, TypeAlias

from safeview.errors import ConfigError

__all__ = ["ENV_POLICY", "Policy", "PolicyArg", "current_policy", "policy_scope"]

ENV_POLICY = "SAFEVIEW_BOUNDS_POLICY"


class Policy(str, Enum):
    """``STRICT`` raises before torch is called; ``WARN`` logs and lets torch decide; ``OFF`` checks
    nothing (torch's own behaviour)."""

    STRICT = "strict"
    WARN = "warn"
    OFF = "off"

    def __str__(self) -> str:
        return self.value


PolicyArg: TypeAlias = Literal["strict", "warn", "off"] | Policy
"""What a ``policy=`` parameter takes: a ``Policy`` or its name."""

_ALLOWED = tuple(p.value for p in Policy)
_BY_NAME = {p.value: p for p in Policy}


class _Scope:
    """One ``policy_scope``; compared by identity. ``open`` turns false when it closes, in
    whatever thread or context that happens."""

    __slots__ = ("open", "policy")

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.open = True


# The scopes of this context, innermost last. A scope leaves by marking itself closed (seen in
# every context that holds it) and removing itself from the context it closes in, so scopes may
# close in any order (a generator that is closed late) and from any thread without raising; once
# all have closed, the default is back.
_scopes: ContextVar[tuple[_Scope, ...]] = ContextVar("safeview_policy_scopes", default=())
# The environment is read once, at the first view, and kept: os.environ costs more than the check.
_from_env: Policy | None = None


def coerce_policy(value: object, *, source: str = "policy") -> Policy:
    """A ``Policy`` from a member or its name (case and surrounding blanks ignored)."""
    if isinstance(value, Policy):
        return value
    if isinstance(value, str):
        known = _BY_NAME.get(value)
        if known is not None:
            return known
        known = _BY_NAME.get(value.strip().lower())
        if known is not None:
            return known
    raise ConfigError(source, value, _ALLOWED)


def _env_policy() -> Policy:
    global _from_env
    if _from_env is None:
        raw = os.environ.get(ENV_POLICY)
        # set to nothing (or blanks) is unset, as for every SAFEVIEW_* variable
        unset = raw is None or not raw.strip()
        _from_env = Policy.STRICT if unset else coerce_policy(raw, source=ENV_POLICY)
    return _from_env


def current_policy(policy: PolicyArg | str | None = None) -> Policy:
    """The policy in force here: ``policy`` if given, else the innermost ``policy_scope``, else
    ``SAFEVIEW_BOUNDS_POLICY``, else ``Policy.STRICT``.

    Raises ``ConfigError`` when the one that decides has a value that is not a policy.
    """
    if policy is not None:
        known = _BY_NAME.get(policy) if type(policy) is str else None
        return known or coerce_policy(policy)
    scopes = _scopes.get()
    if scopes:
        for scope in reversed(scopes):
            if scope.open:
                return scope.policy
    return _from_env if _from_env is not None else _env_policy()


@contextlib.contextmanager
def policy_scope(policy: PolicyArg | str) -> Iterator[Policy]:
    """Use ``policy`` for every view made inside the ``with`` block (in this thread or task)::

        with safeview.policy_scope("warn"):
            view = safeview.make_view(kv_cache, layout)

    A scope opened inside a generator is seen by the generator's caller too while the generator
    is suspended inside it (generators share their caller's context): close the scope before
    yielding. Scopes may close in any order; once all have closed the default is in force again.
    """
    scope = _Scope(coerce_policy(policy))
    _scopes.set((*_scopes.get(), scope))
    try:
        yield scope.policy
    finally:
        scope.open = False
        _scopes.set(tuple(other for other in _scopes.get() if other.open))
