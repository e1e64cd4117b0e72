"""Composed meshes in the plan: parallel.mesh alone is strategy mesh; each dimension is checked by its owner and
placed in the core's order; what cannot run is refused naming the dimension."""

import json

import pytest

from snnfw.errors import PlanError
from snnfw.plan.compose import owners
from snnfw.plan.prepare import prepare
from snnfw.plugin.manager import Plugins
from snnfw.testing import tiny_config


@pytest.fixture(scope="module")
def plugins():
    return Plugins()


def mesh_config(mesh: dict, **sections):
    config = tiny_config(**sections)
    data = config.to_dict()
    del data["parallel"]["strategy"]
    data["explicit"] = [key for key in data["explicit"] if key != "parallel.strategy"] + ["parallel.mesh"]
    data["parallel"]["mesh"] = mesh
    from snnfw.config import build_config

    return build_config(data)


def test_a_mesh_alone_is_strategy_mesh_and_every_dimension_has_an_owner(plugins):
    assert mesh_config({"dp_shard": 2, "tp": 2}).parallel.strategy == "mesh"
    assert owners(plugins) == {"dp_replicate": "dp", "dp_shard": "fsdp2", "tp": "tp", "pp": "pp", "time": "tsp",
                               "cp": "cp", "ep": "ep"}


def test_dimensions_take_the_core_order_and_their_roles(plugins):
    plan = prepare(mesh_config({"tp": 2, "time": 2, "dp_shard": 2, "pp": 1}), 8, plugins).plan
    assert plan.strategy == "mesh" and plan.mesh == (("time", 2), ("dp_shard", 2), ("tp", 2))
    assert plan.strategies == ("tsp", "fsdp2", "tp")
    assert plan.dp_dims == ("dp_shard",) and plan.replicated_neuron_dims == ("tp",) and plan.stage_dims == ()
    assert plan.rationale[0] == "composed mesh time=2 x dp_shard=2 x tp=2 (outermost first); pp = 1 left out"
    assert "gradients: FSDP2 reduce-scatter over dp_shard, replicated over time (HSDP)" in plan.rationale


def test_a_pipeline_outermost_takes_its_microbatches(plugins):
    plan = prepare(mesh_config({"dp_replicate": 2, "pp": 2}, train={"microbatches": 2}), 4, plugins).plan
    assert plan.mesh == (("pp", 2), ("dp_replicate", 2)) and plan.stage_dims == ("pp",)
    assert plan.microbatches == 2 and plan.replica_batch == plan.global_batch // 2


@pytest.mark.parametrize("mesh, world, message", [
    ({"dp": 2, "tp": 2}, 4, "dimension 'dp', which no strategy owns (dp_replicate for DistributedDataParallel, "
                            "dp_shard for FSDP2)"),
    ({"dp_shard": 2, "tp": 3}, 6, "dimension tp (tp): features.0 (conv_bn_neuron)"),
    ({"dp_replicate": 2, "time": 3}, 6, "dimension time (tsp): model.time_steps = 4 does not split into 3"),
    ({"dp_shard": 2, "tp": 2}, 8, "has 4 ranks but the world has 8"),
    ({"tp": 1}, 1, "every dimension of parallel.mesh has size 1"),
])
def test_what_a_composed_mesh_cannot_run_is_refused_naming_the_dimension(plugins, mesh, world, message):
    with pytest.raises(PlanError) as refused:
        prepare(mesh_config(mesh), world, plugins)
    assert message in str(refused.value), str(refused.value)


def test_a_key_of_a_dimension_applies_in_a_mesh_that_has_it_and_is_refused_in_one_that_does_not(plugins):
    prepare(mesh_config({"dp_replicate": 2, "time": 2}, tsp={"slices": 2}), 4, plugins)
    with pytest.raises(PlanError, match="tsp.slices applies only to a time dimension"):
        prepare(mesh_config({"dp_replicate": 2, "tp": 2}, tsp={"slices": 2}), 4, plugins)


def test_auto_weighs_every_mesh_of_one_and_two_dimensions_once(plugins):
    """The presets are meshes: auto ranks each layout (mesh and settings) once, by one estimator."""
    from snnfw.plan.prepare import auto_candidates

    ranked = auto_candidates(tiny_config("auto", microbatches=2), 4, plugins)  # a pipeline's 2 stages need 2
    assert {c.strategy for c in ranked} == {"mesh"}
    composed = {tuple(c.mesh.items()) for c in ranked}
    assert (("dp_shard", 2), ("tp", 2)) in composed and (("pp", 2), ("dp_replicate", 2)) in composed
    assert (("dp_replicate", 4),) in composed and (("tp", 4),) in composed
    assert len(composed) == 14 and all(c.estimate is not None for c in ranked)  # of 15: pp = 4 needs 4 microbatches
    layouts = [(frozenset(c.mesh.items()), c.settings) for c in ranked]
    assert len(layouts) == len(set(layouts))


@pytest.mark.parametrize("mesh, why", [
    ({"pp": 2, "tp": 2}, "the pipeline's split runs the model"),
    ({"dp_shard": 2, "tp": 2}, None),
    ({"dp_replicate": 2, "tp": 2}, None),  # DDP wraps the shards once they are materialized
])
def test_the_plan_says_why_a_mesh_that_shards_parameters_builds_whole(plugins, mesh, why):
    plan = prepare(mesh_config(mesh, train={"microbatches": 2}), 4, plugins).plan
    said = [line.split(": ", 1)[1] for line in plan.rationale if "builds the whole model" in line]
    assert (len(said) == 1 and said[0].startswith(why)) if why else not said, plan.rationale


@pytest.mark.parametrize("dims, ddp, stage_averaged, sharded", [
    (("dp_replicate", "tp"), True, (), None),
    (("time",), True, (), None),
    (("pp", "dp_replicate", "time"), False, ("dp_replicate", "time"), None),
    (("pp", "dp_replicate", "dp_shard"), False, (), "dp_shard"),
    (("dp_replicate", "dp_shard", "tp"), False, (), "dp_shard"),
    (("pp", "tp"), False, (), None),
])
def test_one_decision_reduces_the_gradients(plugins, dims, ddp, stage_averaged, sharded):
    """DistributedDataParallel where replicas average and nothing shards or stages; a pipeline averages its stages'
    gradients itself unless FSDP2 reduces them (HSDP)."""
    from snnfw.plan.compose import Reduction

    owned = owners(plugins)
    reduction = Reduction.of({name: plugins.strategy(owned[name]) for name in dims})
    assert (reduction.ddp, reduction.stage_averaged, reduction.sharded) == (ddp, stage_averaged, sharded)


SPELLED = {  # each preset on 4 ranks, and the mesh (with the settings) it stands for
    "dp": ('{dp_replicate = 4}', ()),
    "zero": ('{dp_replicate = 4}', ("parallel.zero=true",)),
    "fsdp2": ('{dp_shard = 4}', ()),
    "tp": ('{tp = 4}', ()),
    "fsdp2_tp": ('{dp_shard = 2, tp = 2}', ()),
    "pp": ('{pp = 4}', ()),
    "tsp": ('{time = 4}', ()),
    "fsdp2_tsp": ('{dp_shard = 2, time = 2}', ()),
}
PLAN_FIELDS = ("mesh", "strategies", "dp_dims", "stage_dims", "replicated_neuron_dims", "microbatches",
               "microbatch_size", "global_batch", "world_size")


@pytest.mark.parametrize("name", SPELLED)
def test_each_preset_plans_as_the_mesh_it_names(name, capsys):
    """``snnfw plan --json`` of a preset on the quickstart equals that of its mesh, field for field; only the name
    the plan keeps tells them apart."""
    from snnfw.cli import main

    def plan(*sets):
        assert main(["plan", "examples/quickstart.toml", "--world-size", "4", "--json",
                     *(arg for key in sets for arg in ("--set", key))]) == 0
        return json.loads(capsys.readouterr().out)["plan"]

    mesh, settings = SPELLED[name]
    by_name = plan(f'parallel.strategy="{name}"')
    by_mesh = plan('parallel.strategy="mesh"', f"parallel.mesh={mesh}", *settings)
    assert {f: by_name[f] for f in PLAN_FIELDS} == {f: by_mesh[f] for f in PLAN_FIELDS}
    assert by_name["preset"] == name and by_mesh["preset"] == name
