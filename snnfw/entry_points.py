"""Which installed ``snnfw`` entry points load: the groups, and what the environment says.

Plugins (group ``snnfw``) and the config sections they declare (group
``snnfw.config``) follow the same rules: snnfw's own always load, third-party
ones unless ``SNNFW_DISABLE_PLUGIN_AUTOLOAD=1``, and ``SNNFW_BLOCK_PLUGINS``
names plugins that do not load.
"""

from __future__ import annotations

import functools
import os
import sys
from importlib import metadata

GROUP = "snnfw"
SECTIONS_GROUP = "snnfw.config"  # a plugin's config section: name = "module:AttrsClass"
ENV_DISABLE_AUTOLOAD = "SNNFW_DISABLE_PLUGIN_AUTOLOAD"
ENV_BLOCK = "SNNFW_BLOCK_PLUGINS"


def blocked() -> set[str]:
    """The plugin names ``SNNFW_BLOCK_PLUGINS`` lists."""
    return {name.strip() for name in os.environ.get(ENV_BLOCK, "").split(",") if name.strip()}


def autoload() -> bool:
    """Whether third-party plugins load (``SNNFW_DISABLE_PLUGIN_AUTOLOAD`` is not set)."""
    return os.environ.get(ENV_DISABLE_AUTOLOAD, "").lower() not in ("1", "true", "yes")


def is_builtin(ep: metadata.EntryPoint) -> bool:
    return ep.dist is not None and ep.dist.name == "snnfw"


def installed(group: str) -> tuple[metadata.EntryPoint, ...]:
    """The entry points of ``group`` that the installed distributions declare: read once for each ``sys.path``
    (a read scans every distribution, about 65 ms here), again once it changes."""
    return _installed(group, tuple(sys.path))


@functools.lru_cache(maxsize=16)
def _installed(group: str, path: tuple[str, ...]) -> tuple[metadata.EntryPoint, ...]:
    return tuple(metadata.entry_points(group=group))
