"""The start-up hook's second half: how a watched module's import is found and then handed to the
guard. ``safeview.guard._startup`` holds to ``os`` and ``sys`` (a hook of 0.6.2 still loads it at
every start); its ``Finder`` loads this module, with the imports it needs, the first time torch,
NIXL or Mooncake is looked up.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

__all__ = ["watched_spec"]


class _Loader:
    """Runs a watched module's own loader, then hands the module to the guard."""

    def __init__(self, inner: Any, name: str, on_import: Callable[[str, ModuleType], None]):
        self.inner = inner
        self.name = name
        self.on_import = on_import

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        create = getattr(self.inner, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: ModuleType) -> None:
        try:
            self.inner.exec_module(module)
        finally:
            # the module is its own loader's again, whatever happens next
            spec = getattr(module, "__spec__", None)
            if spec is not None and spec.loader is self:
                spec.loader = self.inner
            if getattr(module, "__loader__", None) is self:
                module.__loader__ = self.inner
        self.on_import(self.name, module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def watched_spec(
    finder: Any,
    name: str,
    path: Sequence[str] | None,
    target: ModuleType | None,
    on_import: Callable[[str, ModuleType], None],
) -> ModuleSpec | None:
    """The spec the rest of ``sys.meta_path`` (every entry but ``finder`` and its kind) finds for
    the watched module ``name``, its loader wrapped so that ``on_import`` hears when the module
    has run; ``None`` when none finds it."""
    kind = type(finder)
    spec: ModuleSpec | None = None
    for other in list(sys.meta_path):
        if other is finder or type(other) is kind:
            continue
        find = getattr(other, "find_spec", None)
        if find is None:
            continue
        spec = find(name, path, target)
        if spec is not None:
            break
    if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
        return spec
    spec.loader = _Loader(spec.loader, name, on_import)  # type: ignore[assignment]
    return spec
