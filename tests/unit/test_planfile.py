"""The plan file: what snnfw train writes once and every rank reads back, and what a rank refuses."""

import json
from types import SimpleNamespace

import attrs
import pytest

from snnfw.errors import PlanError
from snnfw.plan import planfile
from snnfw.plan.prepare import prepare
from snnfw.plugin.manager import Plugins
from snnfw.testing import tiny_config


@pytest.fixture(scope="module")
def plugins():
    return Plugins()


@pytest.mark.parametrize("strategy, world, sections", [
    ("none", 1, {}),
    ("auto", 2, {"parallel": {"prefer": "memory"}}),
    ("pp", 2, {"pipeline": {"schedule": "1f1b"}}),
    ("fsdp2_tp", 4, {}),
])
def test_a_plan_reads_back_as_it_was_written(tmp_path, plugins, strategy, world, sections):
    plan = prepare(tiny_config(strategy, microbatches=2, **sections), world, plugins).plan
    planfile.write(tmp_path / "plan.json", plan, plugins, "made-for")
    read = planfile.read(tmp_path / "plan.json", plugins, "made-for")
    assert read == plan and read.layout == plan.layout
    assert read.layout.world_size == world and read.layout.dp_size == plan.dp_size


def test_a_plan_file_changed_made_for_another_config_or_under_other_plugins_is_refused(tmp_path, plugins):
    path = tmp_path / "plan.json"
    plan = prepare(tiny_config("dp"), 2, plugins).plan
    planfile.write(path, plan, plugins, "made-for")

    def refusal(made_for="made-for", here=plugins) -> str:
        with pytest.raises(PlanError) as err:
            planfile.read(path, here, made_for)
        assert "\n" not in str(err.value)
        return str(err.value)

    assert refusal("another") == (f"the config changed after snnfw train planned this run ({path}); start the run "
                                  "with snnfw train again, which plans it anew")
    extra = Plugins(extra=(("extra_plugin", SimpleNamespace()),))
    assert refusal(here=extra).startswith(f"plugin 'extra_plugin' is loaded on this rank and was not when snnfw train "
                                          f"planned the run ({path}); install the same plugins on every node")
    older = [attrs.evolve(p, version="0.0") if p.name == "defaults" else p for p in plugins.info()]
    planfile.write(path, plan, SimpleNamespace(info=lambda: older), "made-for")
    version = next(p.version for p in plugins.info() if p.name == "defaults")
    assert refusal().startswith(f"plugin 'defaults' is version {version} on this rank and was version 0.0 when")
    planfile.write(path, plan, plugins, "made-for")
    document = json.loads(path.read_text())
    document["plan"]["global_batch"] = 16
    path.write_text(json.dumps(document))
    assert refusal() == f"{path} was changed after snnfw train wrote it; start the run with snnfw train again, which plans it anew"
    path.write_text("{")
    assert refusal() == f"{path} is not a plan file that snnfw train wrote; start the run with snnfw train again, which plans it anew"
    path.unlink()
    assert refusal().startswith(f"the plan file {path} does not exist")
