"""Build hook: install safeview's start-up hook (``safeview-guard.pth``) into site-packages.

A ``.pth`` file must sit at the top of site-packages to be read at interpreter start, outside the
package folder; hatchling copies it there for a regular wheel (``pip install .``) and for an
editable one (``pip install -e .``) alike. The hook's one line reads ``SAFEVIEW_GUARD`` and, when
it is unset or empty, imports nothing; set, it puts a placeholder on ``sys.meta_path`` that finds
and loads ``safeview/guard/_startup.py`` (with the import machinery the interpreter has already
loaded) at the first import of torch, NIXL or Mooncake (``safeview/guard/_import_hook.py`` and
``_startup.py`` say what they do).
"""

from __future__ import annotations

from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

SOURCE = "safeview/guard/_guard.pth"
INSTALLED = "safeview-guard.pth"


class CustomBuildHook(BuildHookInterface):  # type: ignore[type-arg]
    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel":
            return
        key = "force_include_editable" if version == "editable" else "force_include"
        build_data.setdefault(key, {})[SOURCE] = INSTALLED
