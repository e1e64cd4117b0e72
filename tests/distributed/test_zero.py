"""zero: DDP with the optimizer state sharded; same losses as one process, 1/N of the state per rank."""

import pytest
import torch

from snnfw.errors import PlanError
from snnfw.plan.prepare import prepare
from snnfw.plugin.manager import Plugins
from snnfw.run.loop import run_training
from snnfw.testing import local_parameters, run_on_ranks, state_bytes, tiny_config
from snnfw.testing.checks import assert_same_losses


def parameters_and_bytes(trainer):
    return {"params": local_parameters(trainer), "bytes": state_bytes(trainer)}


@pytest.mark.parametrize("strategy, extra", [("zero", {}), ("dp", {"zero": True})])
def test_zero_matches_none_and_shards_optimizer_state(tmp_path, strategy, extra):
    reference = run_training(tiny_config("none", microbatches=2))
    summaries = run_on_ranks(tiny_config(strategy, parallel=extra), 2, tmp_path, inspect=parameters_and_bytes)
    for summary in summaries:
        assert_same_losses(reference, summary)
    first, second = (s["inspect"] for s in summaries)
    for name, tensor in first["params"].items():
        assert torch.equal(tensor, second["params"][name]), f"replicas differ in {name}"
    # ZeRO-1: parameters stay whole on every rank, Adam's moments are split between the ranks
    params = sum(t.numel() * t.element_size() for t in first["params"].values())
    moments = 2 * params
    optimizer = [s["inspect"]["bytes"]["optimizer"] for s in summaries]
    assert all(s["inspect"]["bytes"]["parameters"] == params for s in summaries)
    assert sum(optimizer) == moments + 4 * len(first["params"])  # plus one step counter per parameter
    assert max(optimizer) <= moments / 2 + 1024, f"optimizer state per rank {optimizer} is not half of {moments}"


def test_zero_is_refused_where_it_does_not_compose():
    plugins = Plugins()
    with pytest.raises(PlanError, match="parallel.zero shards optimizer state across data-parallel replicas, on meshes "
                                        "of replicas only"):
        prepare(tiny_config("none", parallel={"zero": True}), 1, plugins)
    with pytest.raises(PlanError, match="dp_shard shards optimizer state already"):
        prepare(tiny_config("fsdp2", parallel={"zero": True}), 2, plugins)


@pytest.mark.parametrize("mesh, held", [({"dp_replicate": 2, "tp": 2}, "tp"), ({"pp": 2, "dp_replicate": 2}, "pp"),
                                         ({"dp_replicate": 2, "dp_shard": 2}, "dp_shard")])
def test_a_composed_mesh_whose_ranks_hold_parts_refuses_parallel_zero_naming_the_dimension(mesh, held):
    config = tiny_config("mesh", microbatches=2, parallel={"mesh": mesh, "zero": True})
    with pytest.raises(PlanError, match=f"strategy 'mesh' cannot run: parallel.zero .* the mesh's {held} ranks hold "
                                        "different parts"):
        prepare(config, 4, Plugins())


@pytest.mark.parametrize("strategy, mesh", [("mesh", {"dp_replicate": 2, "time": 2}), ("tsp", {"dp": 2, "time": 2})])
def test_zero_shards_the_optimizer_state_of_replicas_split_in_time_and_matches_none(tmp_path, strategy, mesh):
    reference = run_training(tiny_config("none", microbatches=2))
    config = tiny_config(strategy, parallel={"mesh": mesh, "zero": True})
    summaries = run_on_ranks(config, 4, tmp_path, inspect=parameters_and_bytes, timeout_s=240)
    for summary in summaries:
        assert_same_losses(reference, summary)
    first = summaries[0]["inspect"]["params"]
    moments = 2 * sum(t.numel() * t.element_size() for t in first.values())
    optimizer = [s["inspect"]["bytes"]["optimizer"] for s in summaries]
    # the four ranks' partitions (whole parameters each, so not equal) make up one copy of Adam's state
    assert sum(optimizer) == moments + 4 * len(first), f"optimizer state per rank {optimizer}, Adam's {moments}"
    assert max(optimizer) < moments / 2, f"optimizer state per rank {optimizer}, Adam's {moments}"


def test_zero_refuses_parallel_zero_false():
    with pytest.raises(PlanError, match="strategy zero is {dp_replicate = 2} with parallel.zero = true, and the config "
                                        "sets parallel.zero = false; remove it"):
        prepare(tiny_config("zero", parallel={"zero": False}), 2, Plugins())


def test_auto_with_parallel_zero_keeps_the_candidates_it_composes_with():
    plan = prepare(tiny_config("auto", microbatches=None, parallel={"zero": True, "prefer": "memory"}), 4, Plugins()).plan
    assert plan.preset in ("zero", "tsp") and plan.config.parallel.zero is True
    held = [line for line in plan.rationale if "ranks hold different parts" in line]
    assert held and not any(line.startswith(("candidate zero", "candidate dp ", "candidate tsp")) for line in held)
    kept = [line for line in plan.rationale if line.startswith("candidate") and "cannot run" not in line]
    assert kept and not any(f"{dim}=" in line.split("):")[0] for line in kept for dim in ("dp_shard", "tp", "pp"))
    plan = prepare(tiny_config("auto", microbatches=None, parallel={"zero": False}), 2, Plugins()).plan
    assert plan.config.parallel.zero is False and not any("parallel.zero = True" in line for line in plan.rationale)
