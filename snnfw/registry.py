"""Named things that plugins contribute: strategies, model families, data sets, schedules."""

from __future__ import annotations

from typing import Any, Callable

import attrs

from snnfw.errors import PluginError, UnknownNameError


@attrs.frozen
class Entry:
    """One registered name, the object behind it and the plugin that registered it."""

    name: str
    value: Any
    description: str
    plugin: str


class Registry:
    """Names of one kind ("strategy", "model family", ...) mapped to plugin objects."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, Entry] = {}

    def registrar(self, plugin: str) -> Callable[..., None]:
        """A ``register(name, value, description="")`` callable bound to ``plugin``."""

        def register(name: str, value: Any = None, description: str = "") -> None:
            self.add(Entry(name, value, description, plugin))

        return register

    def add(self, entry: Entry) -> None:
        if entry.name in self._entries:
            other = self._entries[entry.name].plugin
            raise PluginError(
                f"{self.kind} {entry.name!r} is registered by two plugins, {other!r} and "
                f"{entry.plugin!r}; uninstall or block one (SNNFW_BLOCK_PLUGINS={entry.plugin})"
            )
        self._entries[entry.name] = entry

    def entry(self, name: str) -> Entry:
        try:
            return self._entries[name]
        except KeyError:
            known = ", ".join(sorted(self._entries)) or "none"
            raise UnknownNameError(
                f"unknown {self.kind} {name!r}; registered {self.kind} names: {known}"
            ) from None

    def get(self, name: str) -> Any:
        return self.entry(name).value

    def names(self) -> list[str]:
        return sorted(self._entries)

    def entries(self) -> list[Entry]:
        return [self._entries[n] for n in self.names()]
