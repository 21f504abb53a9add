"""The start-up hook's code: what runs in a process whose environment sets ``SAFEVIEW_GUARD`` once
it looks up torch, NIXL or Mooncake. It imports nothing a bare ``python -c pass`` has not loaded
already (``os`` and ``sys``); ``tests/test_startup.py`` holds it to that.

``safeview-guard.pth`` (installed into site-packages with the package) reads ``SAFEVIEW_GUARD`` at
interpreter start. Unset or empty, it does nothing more. ``strict`` or ``warn``: it puts a
placeholder on ``sys.meta_path`` and loads nothing, so that a process which never imports torch
never reads, nor compiles, this file (``benchmarks/bench_startup.py`` measures both, with and
without cached bytecode). The first lookup of a watched module loads this file, and the
placeholder hands over to ``Finder`` (``hand_over``): when the module has run, the rest of the
hook (``safeview.guard._import_hook``) hands it to ``safeview.guard.process``, and the guard goes
on for it before the program's next line. Another value: this file is loaded to say so in one
line on standard error (``resolve``), and the process runs unguarded. A second read of the
``.pth`` (an editable and a regular install side by side) changes nothing.
"""

# ``os`` and ``sys`` only (loaded before any .pth is read); types for mypy only, annotations as
# strings (``typing`` and ``__future__`` cost milliseconds: test_startup.py lists them).
import os
import sys

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing; mypy reads the name
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from importlib.machinery import ModuleSpec
    from types import ModuleType

ENV_GUARD = "SAFEVIEW_GUARD"
POLICIES = ("strict", "warn", "off")
# torch's entry points, and the transfer engines' classes (``nixl._api`` is an alias the ``nixl``
# package makes of its CUDA build's module)
WATCHED = ("torch", "nixl_cu12._api", "nixl_cu13._api", "nixl_rocm._api", "mooncake.engine")


def resolve(raw: "str | None", *, report: bool = True) -> "str | None":
    """The policy ``SAFEVIEW_GUARD`` asks for (``"strict"`` or ``"warn"``), or ``None`` for no
    guard: unset, empty, ``off``, or a value that is not a policy (then one line on standard
    error, naming the accepted values, when ``report``). Case and surrounding blanks are ignored,
    as ``SAFEVIEW_BOUNDS_POLICY`` reads them."""
    value = (raw or "").strip().lower()
    if value in POLICIES:
        return None if value == "off" else value
    if value and report:
        _say(f"{ENV_GUARD}={raw!r} is not a valid value; allowed values: {', '.join(POLICIES)}")
    return None


def _say(problem: str) -> None:
    """One line on standard error; with no usable standard error, silence rather than a failure
    to start."""
    try:  # noqa: SIM105 (contextlib is not loaded at start-up)
        sys.stderr.write(f"safeview: {problem}; this process runs unguarded\n")
    except Exception:
        pass


class Finder:
    """A ``sys.meta_path`` entry that finds nothing itself: for a watched name it asks the rest of
    ``sys.meta_path`` for the spec and wraps its loader (``_import_hook.watched_spec``)."""

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
            from safeview.guard._import_hook import watched_spec
        except Exception as error:  # safeview cannot be imported: torch imports unguarded
            self._busy.discard(name)
            _say(f"the process guard cannot start on import of {name} ({error!r})")
            return None
        try:
            return watched_spec(self, name, path, target, self.on_import)
        except Exception:
            return None  # another finder's failure: the import goes on as without the hook
        finally:
            self._busy.discard(name)


# the placeholder's class name in safeview-guard.pth (process.stop takes it off sys.meta_path too)
HOOK = "SafeviewGuardHook"
_policy: list[str] = []


def hand_over(
    hook: object,
    policy: str,
    name: str,
    path: "Sequence[str] | None" = None,
    target: "ModuleType | None" = None,
) -> "ModuleSpec | None":
    """``safeview-guard.pth``'s placeholder (``hook``) saw the first lookup of a watched module:
    ``Finder`` takes its place on ``sys.meta_path`` with the policy read at start-up (unless one
    is there already: ``process.start`` put it), and answers for ``name``. Never raises."""
    if hook in sys.meta_path:  # else handed over already, in another thread
        sys.meta_path.remove(hook)
    try:
        if not any(isinstance(finder, Finder) for finder in sys.meta_path):
            install(policy)
        for finder in sys.meta_path:
            if isinstance(finder, Finder):
                return finder.find_spec(name, path, target)
    except Exception as error:
        _say(f"the process guard cannot start on import of {name} ({error!r})")
    return None


def is_hook(finder: object) -> bool:
    """Whether ``finder`` is the start-up hook's (``Finder``, or the ``.pth``'s placeholder)."""
    return isinstance(finder, Finder) or type(finder).__name__ == HOOK


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
            _say(f"the process guard cannot start on import of {name} ({error!r})")


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


# A safeview-guard.pth of 0.6.2 and before (an editable install updated without reinstalling)
# loads this file at start with ``_from_hook`` set: the finder goes on at once, as it did then.
# Loaded by today's placeholder, or imported, it only defines its functions.
if globals().get("_from_hook"):
    _chosen = resolve(os.environ.get(ENV_GUARD))
    if _chosen is not None:
        install(_chosen)
