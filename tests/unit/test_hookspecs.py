"""Every hook specification is documented in the plugin guide and implemented by a built-in or test plugin."""

import inspect
import re
from pathlib import Path

import pytest

from snnfw.plugin import hookspecs

ROOT = Path(__file__).resolve().parents[2]
HOOKS = [name for name, fn in inspect.getmembers(hookspecs, inspect.isfunction) if name.startswith("snnfw_")]
SOURCES = [p.read_text() for folder in ("plugins", "tests", "examples", "snnfw/testing") for p in (ROOT / folder).rglob("*.py")]


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_is_documented_and_implemented(hook):
    assert inspect.getdoc(getattr(hookspecs, hook)), f"{hook} has no docstring"
    assert f"`{hook}`" in (ROOT / "docs" / "plugins.md").read_text(), f"{hook} is missing from docs/plugins.md"
    pattern = re.compile(rf"def {hook}\(")
    assert any(pattern.search(source) for source in SOURCES), f"no plugin implements {hook}"
