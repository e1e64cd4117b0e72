"""The plan file: a plan made once, before any rank starts, that every rank reads instead of planning again.

``snnfw train`` (``eval``, ``bench`` too) parses the config, builds and
analyses the model, resolves the plan (``auto``'s measurement and choice
included) and writes it whole into the run directory (``plan.json``): the
plan with its resolved config and analysis, a digest of the config as given
(the file's text and the ``--set`` overrides), the plugins and their versions
(and those that failed to import), and a digest of all of it. A rank refuses, in one line, a file changed since,
one made for a config that changed since, or one made under other plugins.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import attrs

from snnfw.config import Config, build_config
from snnfw.errors import ConfigError, PlanError
from snnfw.model.analysis import Analysis
from snnfw.plan.layout import Plan
from snnfw.rundir import write_text

AGAIN = "start the run with snnfw train again, which plans it anew"


def config_digest(config_path: str | Path, overrides: list[str]) -> str:
    """A digest of the config as given: the file's bytes and the ``--set`` overrides, in order."""
    try:
        digest = hashlib.sha256(Path(config_path).read_bytes())
    except OSError as err:
        raise ConfigError(f"config file {config_path} cannot be read ({err.strerror}); {AGAIN}") from None
    for item in overrides:
        digest.update(b"\0" + item.encode())
    return digest.hexdigest()


def write(path: Path, plan: Plan, plugins, made_for: str) -> None:
    """Writes ``plan``, made for the config whose :func:`config_digest` is ``made_for``, to ``path`` whole."""
    body = {"config_digest": made_for, "plugins": _versions(plugins), "failed_plugins": _failed(plugins),
            "plan": _plain(plan)}
    write_text(path, json.dumps({**body, "digest": _digest(body)}, indent=2) + "\n")


def read(path: Path, plugins, made_for: str) -> Plan:
    """The plan in ``path``, checked: unchanged since written, made for the config whose :func:`config_digest` is
    ``made_for``, and under the plugins and versions loaded here."""
    try:
        body = json.loads(Path(path).read_text())
        digest = body.pop("digest")
    except FileNotFoundError:
        raise PlanError(f"the plan file {path} does not exist; {AGAIN}") from None
    except (ValueError, KeyError, AttributeError, TypeError):
        raise PlanError(f"{path} is not a plan file that snnfw train wrote; {AGAIN}") from None
    if digest != _digest(body):
        raise PlanError(f"{path} was changed after snnfw train wrote it; {AGAIN}")
    if body["config_digest"] != made_for:
        raise PlanError(f"the config changed after snnfw train planned this run ({path}); {AGAIN}")
    _check_versions(body["plugins"], _versions(plugins), path, body.get("failed_plugins", {}), _failed(plugins))
    return _plan(body["plan"])


def _digest(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _versions(plugins) -> dict[str, str]:
    return {p.name: p.version for p in plugins.info() if not p.error}


def _failed(plugins) -> dict[str, str]:
    return {p.name: p.error for p in plugins.info() if p.error}


def _check_versions(planned: dict[str, str], here: dict[str, str], path: Path, planned_failed: dict[str, str],
                    failed_here: dict[str, str]) -> None:
    """Refuses, naming the first plugin that differs, a rank whose plugins are not those the plan was made under;
    where one of them failed to import, with its error."""
    when = f"when snnfw train planned the run ({path})"
    for name in sorted(planned.keys() | here.keys()):
        if name not in here:
            absent = f"failed to import on this rank ({failed_here[name]})" if name in failed_here else \
                "is not on this rank"
            found = f"was loaded{_version(planned[name])} {when} and {absent}"
        elif name not in planned:
            absent = f"failed to import {when} ({planned_failed[name]})" if name in planned_failed else f"was not {when}"
            found = f"is loaded on this rank{_version(here[name])} and {absent}"
        elif planned[name] != here[name]:
            found = f"is version {here[name] or 'none'} on this rank and was version {planned[name] or 'none'} {when}"
        else:
            continue
        raise PlanError(f"plugin {name!r} {found}; install the same plugins on every node and set the same SNNFW_* "
                        "variables")


def _version(version: str) -> str:
    return f" (version {version})" if version else ""


def _plain(plan: Plan) -> dict[str, Any]:
    """``plan``'s fields as JSON values: the config by :meth:`Config.to_dict`, the analysis by its fields."""
    fields = {}
    for field in attrs.fields(Plan):
        value = getattr(plan, field.name)
        fields[field.name] = value.to_dict() if isinstance(value, Config) else attrs.asdict(value) \
            if attrs.has(type(value)) else value
    return fields


def _plan(fields: dict[str, Any]) -> Plan:
    """The :class:`Plan` that :func:`_plain` wrote."""
    values = {name: _tuples(value) for name, value in fields.items() if name not in ("config", "analysis")}
    return Plan(**values, config=build_config(fields["config"]), analysis=Analysis(**_tuples(fields["analysis"])))


def _tuples(value):
    """``value`` with every list made a tuple, as the frozen plan holds its sequences."""
    if isinstance(value, list):
        return tuple(_tuples(item) for item in value)
    if isinstance(value, dict):
        return {key: _tuples(item) for key, item in value.items()}
    return value
