"""A mesh dimension from outside snnfw, with a config key of its own: composed with tp and with dp_shard by the
core's order alone (no core, tool or other plugin names it), trained to none's losses in float64 on 4 ranks."""

import json

import pytest

from snnfw.config import build_config
from snnfw.entry_points import GROUP, SECTIONS_GROUP
from snnfw.testing import run_on_ranks
from snnfw.testing.checks import assert_steps_close
from snnfw.testing.distribution import install_distribution
from snnfw.testing.equivalence import case_config, reference_config
from snnfw.run.loop import run_training

# Data replicas under a name of the plugin's own; [replica] count_steps adds a metric of the steps it saw.
PLUGIN = """
    import attrs

    from snnfw.api import DATA, Proposal, Strategy, hookimpl


    @attrs.frozen
    class Section:
        count_steps: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))


    class Replica(Strategy):
        dimension, splits_batch, order = "replica", True, DATA

        def propose_dimension(self, request, layout):
            return Proposal("replica", rationale=(f"replica = {dict(layout.mesh)['replica']}: the batch split",))

        @hookimpl
        def snnfw_step_metrics(self, plan):
            return {"replica_steps": 1.0} if plan.config.replica.count_steps else None


    @hookimpl
    def snnfw_register_strategies(register):
        register("replica", Replica(), "data replicas of a plugin's own")
"""
STEPS = 6


@pytest.fixture
def replica(tmp_path, monkeypatch):
    return install_distribution(tmp_path, monkeypatch, "snnfw_replica", PLUGIN,
                                {GROUP: {"replica": "snnfw_replica"}, SECTIONS_GROUP: {"replica": "snnfw_replica:Section"}})


def composed(mesh: dict):
    data = case_config("cifar10dvs_vgg", None, "float64", STEPS).to_dict()
    data["parallel"] = {"mesh": mesh, "device": "cpu"}
    data["replica"] = {"count_steps": True}
    data["explicit"] = [k for k in data["explicit"] if k != "parallel.strategy"] + ["parallel.mesh", "replica.count_steps"]
    return build_config(data)


@pytest.mark.parametrize("mesh", [{"replica": 2, "tp": 2}, {"replica": 2, "dp_shard": 2}], ids=["tp", "dp_shard"])
def test_a_third_party_dimension_composes_and_trains_as_none(replica, tmp_path, mesh):
    from snnfw.plan.prepare import prepare
    from snnfw.plugin.manager import Plugins

    config = composed(mesh)
    plan = prepare(config, 4, Plugins()).plan
    assert plan.strategies[0] == "replica" and plan.dp_dims[0] == "replica", plan
    reference = run_training(reference_config("cifar10dvs_vgg", 4 if "dp_shard" in mesh else 2, "float64", STEPS))
    for rank, summary in enumerate(run_on_ranks(config, 4, tmp_path, timeout_s=300)):
        assert_steps_close(rank, summary, reference, ("losses", "spike_rates"), STEPS)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "loss" in row]
    assert [row["replica_steps"] for row in steps] == [1.0] * STEPS
