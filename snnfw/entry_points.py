"""Which installed ``snnfw`` entry points load: the groups, and what the environment says.

Plugins (group ``snnfw``) and the config sections they declare (group
``snnfw.config``) follow the same rules: snnfw's own always load, third-party
ones unless ``SNNFW_DISABLE_PLUGIN_AUTOLOAD=1``, and ``SNNFW_BLOCK_PLUGINS``
names plugins that do not load. A third-party entry point whose import raises
is left out with one warning line (:func:`load`); the commands that need what
it would provide are refused, naming it. One that calls ``sys.exit`` while
being imported is refused, naming it.
"""

from __future__ import annotations

import functools
import os
import sys
from importlib import metadata
from typing import Any

import attrs

from snnfw import rundir
from snnfw.deprecation import removed_import
from snnfw.errors import PluginError, shown

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
    return tuple(ep for ep in _installed(tuple(sys.path)) if ep.group == group)


@functools.lru_cache(maxsize=16)
def _installed(path: tuple[str, ...]) -> tuple[metadata.EntryPoint, ...]:
    """snnfw's entry points (both groups: one scan of the distributions)."""
    read: dict[int, _Distribution] = {}
    every = metadata.entry_points()
    return tuple(ep if ep.dist is None else ep._for(read.setdefault(id(ep.dist), _Distribution(ep.dist)))
                 for group in (GROUP, SECTIONS_GROUP) for ep in every.select(group=group))


class _Distribution:
    """An entry point's distribution with its name and version read once: importlib's parses the whole metadata
    file at each read (about 5 ms; a process asked for them 138 times, 0.7 s, before it loaded its plugins)."""

    def __init__(self, dist: metadata.Distribution):
        self._dist, self.name, self.version = dist, dist.name, dist.version

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self._dist, attribute)


@attrs.frozen
class ImportFailure:
    """A third-party entry point whose import raised: left out, and named where a command needs what it provides."""

    name: str  # the entry point's name: a plugin's, or a config section's
    distribution: str  # "name version"
    error: str  # the exception, on one line

    def __str__(self) -> str:
        return f"{self.name!r} ({self.distribution}) failed to import: {self.error}"


def _distribution(ep: metadata.EntryPoint) -> str:
    return f"{ep.dist.name} {ep.dist.version}" if ep.dist is not None else "no distribution"


def load(ep: metadata.EntryPoint) -> Any:
    """The object ``ep`` names; for a third-party entry point whose import raises, an :class:`ImportFailure`,
    warned about once on stderr (by ``snnfw train``'s launcher, not again by its ranks; by rank 0 of a job started
    otherwise). A built-in's import error is a bug of snnfw's, and raises."""
    try:
        return ep.load()
    except SystemExit as err:  # would end the command, silently where its status is not 0
        raise PluginError(exited(f"{_kind(ep)} {ep.name!r} ({_distribution(ep)})", err, _remedy(ep))) from None
    except Exception as err:
        if is_builtin(ep):
            raise
        moved = removed_import(err)
        failure = ImportFailure(ep.name, _distribution(ep), " ".join(repr(err).split()) + (f"; {moved}" if moved else ""))
        _warn(failure, _kind(ep))
        return failure


def _kind(ep: metadata.EntryPoint) -> str:
    return "plugin" if ep.group == GROUP else "config section"


def _remedy(ep: metadata.EntryPoint) -> str:
    if ep.group == GROUP:
        return f"uninstall or block the plugin ({ENV_BLOCK}={ep.name})"
    return f"uninstall {ep.dist.name}" if ep.dist is not None else "uninstall it"


def exited(what: str, err: SystemExit, remedy: str) -> str:
    """The refusal of a module that ``what`` names and that called ``sys.exit`` while being imported."""
    code = 0 if err.code is None else err.code
    how = f"with status {code}" if isinstance(code, int) else f"saying {shown(code)}"
    return f"{what} exited {how} while being imported (sys.exit); fix it, or {remedy}"


def failure_of(distribution: str) -> ImportFailure | None:
    """The first plugin of ``distribution`` that loads (not blocked) and fails to import, if any."""
    off, third_party = blocked(), autoload()
    for ep in installed(GROUP):
        if ep.dist is not None and ep.dist.name == distribution and ep.name not in off and (third_party or is_builtin(ep)):
            if isinstance(found := load(ep), ImportFailure):
                return found
    return None


_warned: set[ImportFailure] = set()


def _warn(failure: ImportFailure, what: str) -> None:
    if failure in _warned or os.environ.get(rundir.LAUNCHED) or os.environ.get("RANK", "0") != "0":
        return
    _warned.add(failure)
    print(f"snnfw: warning: {what} {failure}; it is left out, and commands that need it are refused until it is "
          "fixed or uninstalled", file=sys.stderr, flush=True)
