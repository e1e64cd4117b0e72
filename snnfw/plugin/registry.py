"""Named things that plugins contribute: strategies, model families, data sets, schedules, optimizers, lr schedules, losses."""

from __future__ import annotations

import difflib
from typing import Any, Callable

import attrs

from snnfw.errors import PluginError, UnknownNameError


@attrs.frozen
class Entry:
    """One registered name, the object behind it and the plugin that registered it.

    ``overrides`` declares that it replaces an entry of the same name from
    another plugin; ``replaced`` then names that plugin.
    """

    name: str
    value: Any
    description: str
    plugin: str
    overrides: bool = False
    replaced: str | None = None


class Registry:
    """Names of one kind ("strategy", "model family", ...) mapped to plugin objects."""

    def __init__(self, kind: str, choosers: tuple[str, ...] = (), failed: tuple = ()):
        """``choosers``: names the core takes beside the registered ones (``auto`` for a strategy); ``failed``: the
        plugins that failed to import (:class:`snnfw.entry_points.ImportFailure`), named where a name is unknown."""
        self.kind, self.choosers, self.failed = kind, choosers, failed
        self._entries: dict[str, Entry] = {}
        self.losers: list[Entry] = []

    def registrar(self, plugin: str) -> Callable[..., None]:
        """A ``register(name, value, description="", overrides=False)`` callable bound to ``plugin``."""

        def register(name: str, value: Any = None, description: str = "", overrides: bool = False) -> None:
            self.add(Entry(name, value, description, plugin, overrides))

        return register

    def add(self, entry: Entry) -> None:
        """Adds ``entry``; of two with one name, the one that declares ``overrides`` wins, whatever the order."""
        old = self._entries.get(entry.name)
        if old is None:
            self._entries[entry.name] = entry
        elif entry.overrides and not old.overrides:
            self._entries[entry.name] = attrs.evolve(entry, replaced=old.plugin)
            self.losers.append(old)
        elif old.overrides and not entry.overrides:
            self._entries[entry.name] = attrs.evolve(old, replaced=entry.plugin)
            self.losers.append(entry)
        else:
            raise PluginError(
                f"{self.kind} {entry.name!r} is registered by two plugins, {old.plugin!r} and {entry.plugin!r}"
                + (", and both declare overrides=True" if entry.overrides else "")
                + f"; uninstall or block one (SNNFW_BLOCK_PLUGINS={entry.plugin}), or let exactly one pass "
                "overrides=True to register()"
            )

    def entry(self, name: str) -> Entry:
        try:
            return self._entries[name]
        except KeyError:
            known = sorted(self._entries) + [name for name in self.choosers if name not in self._entries]
            close = difflib.get_close_matches(str(name), known, n=1)
            raise UnknownNameError(
                f"unknown {self.kind} {name!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
                + f"; registered {self.kind} names: {', '.join(known) or 'none'}"
                + "".join(f"; plugin {failure}, and may be the one that registers it: fix or uninstall it"
                          for failure in self.failed)
            ) from None

    def get(self, name: str) -> Any:
        return self.entry(name).value

    def names(self) -> list[str]:
        return sorted(self._entries)

    def entries(self) -> list[Entry]:
        return [self._entries[n] for n in self.names()]
