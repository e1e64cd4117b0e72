"""Install a plugin module as pip would, for a test: the module and its distribution's entry points on sys.path."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

from snnfw.entry_points import GROUP


def install_distribution(folder: Path, monkeypatch, name: str, source: str,
                         entry_points: dict[str, dict[str, str]] | None = None, version: str = "1.0") -> Path:
    """Writes module ``name`` from ``source`` into ``folder`` with a ``dist-info`` declaring ``entry_points``
    ({group: {entry: target}}; by default the module itself as plugin ``name`` in group ``snnfw``), and puts
    ``folder`` first on sys.path for the rest of the test."""
    entry_points = entry_points or {GROUP: {name: name}}
    (folder / f"{name}.py").write_text(textwrap.dedent(source))
    info = folder / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text("\n".join(
        f"[{group}]\n" + "".join(f"{entry} = {target}\n" for entry, target in entries.items())
        for group, entries in entry_points.items()))
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return folder
