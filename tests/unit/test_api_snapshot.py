"""The public API (snnfw.api) as released: its names, their signatures (an attrs class's fields, a class's public
attributes and methods) and the hook specifications' arguments, against the committed tests/unit/api_snapshot.json.

A change fails until the file is written anew (``python tests/unit/test_api_snapshot.py``) together with a version
bump and a CHANGELOG.md entry for that version.
"""

import inspect
import json
import re
import sys
import warnings
from pathlib import Path

import attrs

import snnfw
from snnfw import api
from snnfw.plugin import hookspecs

SNAPSHOT = Path(__file__).with_name("api_snapshot.json")
CHANGELOG = Path(__file__).resolve().parents[2] / "CHANGELOG.md"
HOW = ("update tests/unit/api_snapshot.json (python tests/unit/test_api_snapshot.py writes it) together with a version "
       "bump (pyproject.toml, snnfw.__version__) and a CHANGELOG.md entry for the new version")


def _shown(value) -> str:
    """``value`` as the snapshot records it: no memory addresses, a callable by its name."""
    if isinstance(value, attrs.Factory):
        return f"factory {_shown(value.factory)}"
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    return re.sub(r" at 0x[0-9a-f]+", "", repr(value))


def _signature(function) -> str:
    return re.sub(r" at 0x[0-9a-f]+", "", str(inspect.signature(function)))


def _members(cls) -> dict[str, str]:
    """A class's public attributes and methods, its own and those it inherits from snnfw."""
    out = {}
    for klass in reversed(cls.__mro__):
        if not klass.__module__.startswith("snnfw"):
            continue
        for name, value in vars(klass).items():
            if name.startswith("_") or (attrs.has(cls) and name in attrs.fields_dict(cls)):
                continue
            if isinstance(value, property):
                out[name] = "property"
            elif isinstance(value, (staticmethod, classmethod)):
                out[name] = f"{type(value).__name__} {_signature(value.__func__)}"
            elif inspect.isfunction(value):
                out[name] = _signature(value)
            else:
                out[name] = f"= {_shown(value)}"
    return dict(sorted(out.items()))


def _describe(value) -> dict:
    if inspect.isclass(value):
        described = {"kind": "class", "bases": [_shown(base) for base in value.__bases__]}
        if attrs.has(value):
            described["fields"] = [f"{f.name}: {f.type if isinstance(f.type, str) else _shown(f.type)}"
                                   + ("" if f.default is attrs.NOTHING else f" = {_shown(f.default)}")
                                   for f in attrs.fields(value)]
        elif not issubclass(value, BaseException):
            described["init"] = _signature(value)
        described["members"] = _members(value)
        return described
    if callable(value) and not isinstance(value, type(snnfw.hookimpl)):
        return {"kind": "function", "signature": _signature(value)}
    return {"kind": "value", "value": _shown(value)}


def _deprecated(name: str) -> dict:
    """A deprecated name's record: what it is, what replaces it and the release that removes it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        value = getattr(api, name)
    return {**_describe(value), "instead": api.DEPRECATED[name][1], "removed_in": api.REMOVED_IN}


def snapshot() -> dict:
    hooks = {name: list(inspect.signature(function).parameters)
             for name, function in sorted(vars(hookspecs).items()) if name.startswith("snnfw_")}
    return {"version": snnfw.__version__, "names": {name: _describe(getattr(api, name)) for name in api.__all__},
            "deprecated": {name: _deprecated(name) for name in sorted(api.DEPRECATED)}, "hooks": hooks}


def changes(now: dict, recorded: dict) -> list[str]:
    """The public names, deprecated names (``deprecated NAME``) and hooks whose record differs between two
    snapshots."""
    changed = []
    for section, prefix in (("names", ""), ("deprecated", "deprecated ")):
        mine, theirs = now[section], recorded.get(section, {})
        changed += [prefix + name for name in sorted(set(mine) | set(theirs)) if mine.get(name) != theirs.get(name)]
    return changed + [f"hook {name}" for name in sorted(set(now["hooks"]) | set(recorded["hooks"]))
                      if now["hooks"].get(name) != recorded["hooks"].get(name)]


def test_the_public_api_is_the_released_one():
    recorded = json.loads(SNAPSHOT.read_text())
    changed = changes(snapshot(), recorded)
    assert not changed, f"the public API changed ({', '.join(changed)}): {HOW}"
    assert recorded["version"] == snnfw.__version__, \
        f"api_snapshot.json records version {recorded['version']}, and snnfw is {snnfw.__version__}: {HOW}"


def test_the_version_has_a_changelog_entry():
    assert re.search(rf"^## {re.escape(snnfw.__version__)}(\s|$)", CHANGELOG.read_text(), re.MULTILINE), \
        f"CHANGELOG.md has no entry '## {snnfw.__version__}' for the version snnfw is: {HOW}"


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def test_a_deprecated_name_is_out_of_all_documented_and_removed_only_by_a_later_release():
    """A name leaves the API only after a release that deprecates it: while deprecated it is no public name (not
    in ``__all__``), docs/plugins.md says so, and the release that removes it comes after this one."""
    documented = (CHANGELOG.parent / "docs" / "plugins.md").read_text()
    assert _release(api.REMOVED_IN) > _release(snnfw.__version__)
    for name in api.DEPRECATED:
        assert name not in api.__all__, f"{name} is deprecated and still in snnfw.api.__all__"
        assert f"`{name}`" in documented, f"docs/plugins.md does not say that {name} is deprecated"


def test_every_public_name_is_importable_and_documented():
    documented = (CHANGELOG.parent / "docs" / "plugins.md").read_text()
    for name in api.__all__:
        assert getattr(api, name) is not None
        assert name == "__version__" or f"`{name}`" in documented, f"docs/plugins.md does not list {name}"


if __name__ == "__main__":  # writes the snapshot: python tests/unit/test_api_snapshot.py
    SNAPSHOT.write_text(json.dumps(snapshot(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {SNAPSHOT} for snnfw {snnfw.__version__}", file=sys.stderr)


def test_a_planted_signature_change_is_caught(monkeypatch):
    def estimate(cost, renamed_argument):  # planted: the public estimate with another signature
        return None

    def snnfw_summary(plan):  # planted: a hook specification that lost an argument
        """Planted."""

    def replicas(layout, renamed_argument):  # planted: a deprecated name with another signature
        return 1

    from snnfw.plan import compose

    monkeypatch.setattr(api, "estimate", estimate)
    monkeypatch.setattr(hookspecs, "snnfw_summary", snnfw_summary)
    monkeypatch.setattr(compose, "replicas", replicas)
    assert changes(snapshot(), json.loads(SNAPSHOT.read_text())) == ["estimate", "deprecated replicas",
                                                                     "hook snnfw_summary"]
