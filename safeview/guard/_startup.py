"""What the start-up hook runs when ``SAFEVIEW_GUARD`` is set: nothing a bare ``python -c pass``
has not loaded already (``os`` and ``sys``), so that it costs a spawned process well under 3 ms
(``benchmarks/bench_startup.py``; ``tests/test_startup.py`` holds it to its imports).

``safeview-guard.pth`` (installed into site-packages with the package) loads this file in every
interpreter whose environment sets ``SAFEVIEW_GUARD``, without importing the ``safeview`` package
(whose import costs a tenth of a second) and without importing torch. It reads the variable once
and, for ``strict`` or ``warn``, puts a finder on ``sys.meta_path`` that hears when torch, NIXL
or Mooncake finishes importing: only then is ``safeview.guard.process`` imported and the guard put
on that library, before the program's next line. A value that is not a policy gets one line on
standard error and the process runs unguarded. Running this twice changes nothing.

When ``SAFEVIEW_GUARD`` is unset or empty, the ``.pth`` line reads one environment variable and
imports nothing.
"""

# Imports: ``os`` and ``sys`` only, which every interpreter has loaded before it reads a ``.pth``.
# Every process a guarded server spawns runs this file, so it must not load ``typing``, ``re``,
# ``enum``, ``contextlib`` or ``importlib.util`` (9 to 13 ms of start-up in 0.4.1): the types
# below exist for mypy only, and the annotations are strings (no ``from __future__ import
# annotations`` either: that line imports the ``__future__`` module).
import os
import sys

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing; mypy reads the name
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from importlib.machinery import ModuleSpec
    from types import ModuleType
    from typing import Any

ENV_GUARD = "SAFEVIEW_GUARD"
POLICIES = ("strict", "warn", "off")
# The modules whose import turns the guard on for them: torch's entry points, and the transfer
# engines' classes that safeview.transfer.nixl and safeview.transfer.mooncake guard (``nixl._api``
# is an alias the ``nixl`` package makes of its CUDA build's module).
WATCHED = ("torch", "nixl_cu12._api", "nixl_cu13._api", "nixl_rocm._api", "mooncake.engine")


def resolve(raw: str | None, *, report: bool = True) -> str | None:
    """The policy ``SAFEVIEW_GUARD`` asks for (``"strict"`` or ``"warn"``), or ``None`` for no
    guard: unset, empty, ``off``, or a value that is not a policy (then one line on standard
    error, naming the accepted values, when ``report``). Case and surrounding blanks are ignored,
    as ``SAFEVIEW_BOUNDS_POLICY`` reads them."""
    if raw is None:
        return None
    value = raw.strip().lower()
    if not value or value == "off":
        return None
    if value in POLICIES:
        return value
    if report:
        _say(
            f"safeview: {ENV_GUARD}={raw!r} is not a valid value; allowed values: "
            f"{', '.join(POLICIES)}; this process runs unguarded\n"
        )
    return None


def _say(line: str) -> None:
    """One line on standard error; with no usable standard error, silence rather than a failure
    to start."""
    try:  # noqa: SIM105 (contextlib is not loaded at start-up; importing it costs)
        sys.stderr.write(line)
    except Exception:
        pass


class _Loader:
    """Runs a watched module's own loader, then hands the module to the guard."""

    def __init__(self, inner: "Any", name: str) -> None:
        self.inner = inner
        self.name = name

    def create_module(self, spec: "ModuleSpec") -> "ModuleType | None":
        create = getattr(self.inner, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: "ModuleType") -> None:
        try:
            self.inner.exec_module(module)
        finally:
            # the module is its own loader's again, whatever happens next
            spec = getattr(module, "__spec__", None)
            if spec is not None and spec.loader is self:
                spec.loader = self.inner
            if getattr(module, "__loader__", None) is self:
                module.__loader__ = self.inner
        _imported(self.name, module)

    def __getattr__(self, name: str) -> "Any":
        return getattr(self.inner, name)


class Finder:
    """A ``sys.meta_path`` entry that finds nothing itself: for the watched module names it asks
    the rest of ``sys.meta_path`` for the spec and wraps its loader (``_Loader``)."""

    def __init__(
        self, watched: "Sequence[str]", on_import: "Callable[[str, ModuleType], None]"
    ) -> None:
        self.watched = frozenset(watched)
        self.on_import = on_import
        self._busy: set[str] = set()

    def find_spec(
        self, name: str, path: "Sequence[str] | None" = None, target: "ModuleType | None" = None
    ) -> "ModuleSpec | None":
        if name not in self.watched or name in self._busy:
            return None
        self._busy.add(name)
        try:
            for finder in sys.meta_path:
                if finder is self or isinstance(finder, Finder):
                    continue
                find = getattr(finder, "find_spec", None)
                if find is None:
                    continue
                spec: ModuleSpec | None = find(name, path, target)
                if spec is not None:
                    break
            else:
                return None
        except Exception:
            return None
        finally:
            self._busy.discard(name)
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _Loader(spec.loader, name)  # type: ignore[assignment]
        return spec


_policy: list[str] = []


def _imported(name: str, module: "ModuleType") -> None:
    """A watched module finished importing: the guard goes on for it. Never raises."""
    try:
        from safeview.guard import process

        process._on_import(name, module, _policy[0] if _policy else "strict")
    except Exception as error:  # safeview's own failure must not stop the host's import
        try:
            from safeview import log

            log.internal_error(where=f"process guard on import of {name}", error=error)
        except Exception:  # safeview itself cannot be imported: say so in one line
            _say(
                f"safeview: the process guard cannot start on import of {name} "
                f"({type(error).__name__}: {error}); this process runs unguarded\n"
            )


def install(policy: str) -> None:
    """Put the finder on ``sys.meta_path`` (once), and turn the guard on at once for watched
    modules that are already imported."""
    _policy[:] = [policy]
    if not any(isinstance(finder, Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, Finder(WATCHED, _imported))
    for name in WATCHED:
        module = sys.modules.get(name)
        if module is not None:
            _imported(name, module)


def main() -> None:
    """The start-up hook: read ``SAFEVIEW_GUARD`` and install the finder for its policy."""
    policy = resolve(os.environ.get(ENV_GUARD))
    if policy is not None:
        install(policy)


# The .pth loads this file as ``safeview.guard._startup`` (registered in ``sys.modules`` first, so
# that a second run of the .pth finds it and stops) with ``_from_hook`` set; imported in any other
# way, it only defines its functions.
if globals().get("_from_hook"):
    main()
