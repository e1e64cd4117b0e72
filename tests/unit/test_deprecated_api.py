"""Deprecated names of snnfw.api (snnfw.api.DEPRECATED): each use warns what replaces it and the release that removes
it, the value still works, and none of snnfw's own plugins or examples uses one."""

import ast
import importlib
import warnings
from pathlib import Path

import pytest

from snnfw import api
from snnfw.plan.layout import Proposal
from snnfw.plugin.manager import Plugins

ROOT = Path(__file__).resolve().parents[2]
COMPOSITION = ("propose_mesh", "apply_mesh", "candidate_meshes", "owners", "replicas", "fsdp_mesh",
               "stage_averaged_dims")


def test_the_composition_internals_are_deprecated():
    assert set(COMPOSITION) <= set(api.DEPRECATED) and api.REMOVED_IN == "0.4.0"


@pytest.mark.parametrize("name", sorted(api.DEPRECATED))
def test_every_use_of_a_deprecated_name_warns_and_gives_the_same_object(name):
    module, instead = api.DEPRECATED[name]
    for _ in range(2):  # not cached: the second use warns too
        with pytest.warns(DeprecationWarning) as caught:
            value = getattr(api, name)
        assert value is getattr(importlib.import_module(module), name)
        message = str(caught[0].message)
        assert message == f"snnfw.api.{name} is deprecated and removed in snnfw 0.4.0; use {instead}"
    assert name not in dir(api)


def test_an_import_of_a_deprecated_name_warns_at_the_importer_and_still_works():
    with pytest.warns(DeprecationWarning, match=r"snnfw.api.replicas .* removed in snnfw 0.4.0; use Proposal.replicas"
                      ) as caught:
        from snnfw.api import replicas
    assert caught[0].filename == __file__
    layout = Proposal("mesh", mesh=(("pp", 2), ("dp_replicate", 2), ("dp_shard", 3)), dp_dims=("dp_replicate", "dp_shard"))
    assert replicas(layout) == layout.replicas == 6


def test_deprecated_functions_still_answer():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        owners, candidate_meshes = api.owners, api.candidate_meshes
    assert owners(Plugins())["dp_shard"] == "fsdp2"
    assert (("pp", 2), ("tp", 2)) in candidate_meshes(4, ["tp", "pp"])


def deprecated_uses(source: str) -> list[str]:
    """The deprecated names of snnfw.api that ``source`` imports or reads (``snnfw.api.NAME``, ``api.NAME``)."""
    uses = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module == "snnfw.api":
            uses += [alias.name for alias in node.names if alias.name in api.DEPRECATED]
        elif isinstance(node, ast.Attribute) and node.attr in api.DEPRECATED and ast.unparse(node.value) in (
                "snnfw.api", "api"):
            uses.append(node.attr)
    return uses


def test_no_plugin_or_example_of_snnfw_uses_a_deprecated_name():
    used = {str(path.relative_to(ROOT)): deprecated_uses(path.read_text())
            for folder in ("plugins", "examples", "snnfw", "benchmark") for path in (ROOT / folder).rglob("*.py")}
    assert not {path: names for path, names in used.items() if names}


def test_the_check_finds_a_planted_use():
    planted = "from snnfw.api import Proposal, replicas\nimport snnfw.api\n\ndef f(m):\n    return snnfw.api.fsdp_mesh(m)\n"
    assert deprecated_uses(planted) == ["replicas", "fsdp_mesh"]
