"""A strategy from outside snnfw, with a config section of its own, written against the public plugin API only:
planned, trained to none's losses on 2 ranks with its key applied, and refused in one line where misused."""

import textwrap

import pytest

from snnfw.entry_points import GROUP, SECTIONS_GROUP
from snnfw.testing import run_on_ranks, tiny_config
from snnfw.testing.checks import assert_same_losses
from snnfw.testing.distribution import install_distribution

# DDP with its bucket size as a key of the plugin's own [bucketed] section.
PLUGIN = """
    import attrs

    from snnfw.api import Proposal, Strategy, estimate, hookimpl, refuse_others

    NAME = "bucketed"


    @attrs.frozen
    class Section:
        cap_mb: float = attrs.field(default=25.0, validator=attrs.validators.gt(0))


    class Bucketed(Strategy):
        @hookimpl
        def snnfw_parallelize(self, model, plan, mesh, hooks):
            from torch.nn.parallel import DistributedDataParallel

            hooks.compile(model, plan)
            return DistributedDataParallel(model, process_group=mesh.get_group("dp"),
                                           bucket_cap_mb=plan.config.bucketed.cap_mb)


    @hookimpl
    def snnfw_register_strategies(register):
        register(NAME, Bucketed(), "data parallel with gradient buckets of [bucketed] cap_mb")


    @hookimpl
    def snnfw_plan(request):
        if "bucketed.cap_mb" in request.config.explicit and request.strategy != NAME:
            return refuse_others(request, (NAME,), "bucketed.cap_mb applies only to strategy bucketed; remove it")
        if not request.asks_for(NAME):
            return None
        world = request.topology.world_size
        cap = request.config.bucketed.cap_mb
        return Proposal(NAME, mesh=(("dp", world),), dp_dims=("dp",), rationale=(f"{world} replicas, {cap} MB buckets",),
                        estimate=estimate(request, samples=request.config.data.batch_size / world))
"""


@pytest.fixture
def bucketed(tmp_path, monkeypatch):
    """The plugin installed as pip would, with entry points in both groups."""
    return install_distribution(tmp_path, monkeypatch, "snnfw_bucketed", PLUGIN,
                                {GROUP: {"bucketed": "snnfw_bucketed"}, SECTIONS_GROUP: {"bucketed": "snnfw_bucketed:Section"}})


def bucket_bytes(trainer):
    return trainer.model.bucket_bytes_cap


def test_the_plugin_uses_only_the_public_plugin_api():
    imported = {line.split()[1] for line in textwrap.dedent(PLUGIN).splitlines() if line.startswith(("from ", "import "))}
    assert imported <= {"attrs", "snnfw.api"}, imported


def test_a_third_party_strategy_is_planned_and_trains_as_none_with_its_own_key(bucketed, tmp_path):
    from snnfw.plan.prepare import prepare
    from snnfw.plugin.manager import Plugins
    from snnfw.run.loop import run_training

    config = tiny_config("bucketed", bucketed={"cap_mb": 0.5})
    assert config.bucketed.cap_mb == 0.5 and config.to_dict()["bucketed"] == {"cap_mb": 0.5}
    plan = prepare(config, 2, Plugins()).plan
    assert plan.strategy == "bucketed" and "2 replicas, 0.5 MB buckets" in plan.rationale

    summaries = run_on_ranks(config, 2, tmp_path, inspect=bucket_bytes)
    reference = run_training(tiny_config("none", microbatches=2))  # BatchNorm sees each replica's half alone
    for summary in summaries:
        assert_same_losses(reference, summary)
        assert summary["inspect"] == int(0.5 * 1024 * 1024)


@pytest.mark.parametrize("sections, strategy, refused", [
    ({"bucketed": {"cap_mb": 0}}, "bucketed", r"invalid value in \[bucketed\]: 'cap_mb' must be > 0"),
    ({"bucketed": {"cap": 1}}, "bucketed",
     r"unknown config key bucketed.cap \(did you mean bucketed.cap_mb\?\); keys of \[bucketed\] are cap_mb"),
    ({"bucketed": {"cap_mb": 1}}, "dp", r"bucketed.cap_mb applies only to strategy bucketed; remove it"),
])
def test_a_third_party_section_is_refused_by_name(bucketed, sections, strategy, refused):
    from snnfw.errors import ConfigError, PlanError
    from snnfw.plan.prepare import prepare
    from snnfw.plugin.manager import Plugins

    with pytest.raises((ConfigError, PlanError), match=refused):
        prepare(tiny_config(strategy, **sections), 2, Plugins())


def test_without_the_plugin_its_section_is_unknown():
    from snnfw.errors import ConfigError

    with pytest.raises(ConfigError, match=r"unknown config section \[bucketed\]"):
        tiny_config("dp", bucketed={"cap_mb": 1})
