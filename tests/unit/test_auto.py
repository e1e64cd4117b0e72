"""The auto planner: every strategy proposes with an estimate, the preference ranks, refusals say why."""

import json
import re
from pathlib import Path

import pytest

from snnfw import hookimpl
from snnfw.errors import ConfigError, PlanError
from snnfw.plan.estimate import estimate
from snnfw.plan.layout import Proposal
from snnfw.plan.prepare import prepare
from snnfw.plugin.manager import Plugins
from snnfw.testing import tiny_config


@pytest.fixture(scope="module")
def plugins():
    return Plugins()


def auto(world, prefer=None, family="cifar10dvs_vgg", batch=8, microbatches=None, parallel=None, **sections):
    parallel = {"strategy": "auto", **({"prefer": prefer} if prefer else {}), **(parallel or {})}
    return tiny_config(parallel=parallel, microbatches=microbatches, model={"family": family}, data={"batch_size": batch}, **sections)


@pytest.mark.parametrize("family", ["cifar10dvs_vgg", "spikformer"])
@pytest.mark.parametrize(
    "world, prefer, batch, expected",
    [
        (1, "speed", 8, {"none"}),
        (1, "memory", 8, {"none"}),
        (2, "speed", 8, {"dp"}),  # least communication among equal compute
        (2, "memory", 8, {"fsdp2", "fsdp2_tp", "tp", "pp"}),  # parameters and optimizer state sharded
        (4, "memory", 8, {"fsdp2", "fsdp2_tp", "tp", "pp", "mesh"}),  # mesh: a mix of them (pp x dp_shard)
        (2, "capacity", 8, {"fsdp2", "fsdp2_tp", "tp", "pp"}),
        (3, "speed", 9, {"dp", "zero", "fsdp2"}),  # 3 ranks: tp cannot split 8 channels or 4 heads
    ],
)
def test_auto_choice_table(plugins, family, world, prefer, batch, expected):
    plan = prepare(auto(world, prefer, family, batch), world, plugins).plan
    assert (plan.preset or plan.strategy) in expected
    if prefer != "speed" and world > 1:
        assert {"fsdp2", "tp", "pp"} & set(plan.strategies), plan.strategies
    assert plan.rationale[0].startswith(f"auto, prefer {prefer}: chose {plan.preset or plan.strategy}")
    assert plan.config.parallel.strategy == plan.strategy


def test_infeasible_candidates_are_listed_with_reasons(plugins):
    plan = prepare(auto(3, "speed", batch=9), 3, plugins).plan
    text = "\n".join(plan.rationale)
    assert "candidate none: cannot run: it runs on one rank, not 3" in text
    assert "candidate tp (tp=3): cannot run:" in text and "not divisible by tp=3" in text


def test_no_feasible_strategy_fails_with_every_reason(plugins):
    with pytest.raises(PlanError, match="auto found no strategy that can run on 3 rank\\(s\\):.*not divisible.*fewer than the 3 stages"):
        prepare(auto(3, "speed", batch=8, microbatches=1), 3, plugins)


class EchoStrategy:
    """A strategy from a test plugin: cheap on paper, so auto must pick it."""

    @hookimpl
    def snnfw_register_strategies(self, register):
        register("echo", None, "test strategy")

    @hookimpl
    def snnfw_plan(self, request):
        if not request.asks_for("echo"):
            return None
        world = request.topology.world_size
        cost = estimate(request, samples=0.001, parameter_shards=1e6, activation_shards=1e6)
        return Proposal("echo", mesh=(("dp", world),), dp_dims=("dp",), rationale=("echo",), estimate=cost)


def test_a_strategy_from_a_plugin_takes_part_in_auto():
    plugins = Plugins(extra=(("echo", EchoStrategy()),))
    for prefer in ("speed", "memory", "capacity"):
        assert prepare(auto(2, prefer), 2, plugins).plan.strategy == "echo"


def test_explicit_strategy_with_prefer_keeps_it_and_fills_defaults(plugins):
    plan = prepare(tiny_config("dp", parallel={"prefer": "memory"}), 2, plugins).plan
    assert plan.preset == "zero" and plan.config.parallel.zero is True
    assert "prefer memory: parallel.zero = True" in plan.rationale
    speed = prepare(tiny_config("dp", parallel={"prefer": "speed"}), 2, plugins).plan
    assert speed.config.parallel.zero is False


def test_a_value_the_user_set_is_kept_when_it_equals_the_default(plugins):
    plan = prepare(tiny_config("dp", parallel={"prefer": "memory", "zero": False}), 2, plugins).plan
    assert plan.config.parallel.zero is False
    assert not any("parallel.zero" in line for line in plan.rationale)
    plan = prepare(auto(4, "speed", pipeline={"schedule": "1f1b"}), 4, plugins).plan
    pp = [line for line in plan.rationale if "pp (pp=4" in line and "time" not in line]
    assert len(pp) == 1 and "pipeline.schedule" not in pp[0], pp  # the configured schedule only, as set
    assert plan.config.pipeline.schedule == "1f1b"


def pp_line(plan, schedule):
    """The rationale of the pp candidate with ``schedule``, chosen or not (named when auto chose among schedules)."""
    lines = [
        line.split(": chose ", 1)[-1].removeprefix("candidate ")
        for line in plan.rationale if re.match(r"(candidate |auto, prefer \w+: chose )pp \(pp=\d+[,)]", line)
    ]
    return next(line for line in lines if f"'{schedule}'" in line or len(lines) == 1)


@pytest.mark.parametrize("schedule, bubble", [("gpipe", "43%"), ("zero_bubble", "14%")])
def test_a_configured_schedule_leaves_only_pp_with_its_bubble(plugins, schedule, bubble):
    plan = prepare(auto(4, "speed", pipeline={"schedule": schedule}), 4, plugins).plan
    line = pp_line(plan, schedule)
    assert plan.preset == "pp" and line.startswith("pp (pp=4):")  # pp = 4, or pp = 2 x dp_replicate = 2
    assert line.endswith(f"bubble {bubble}")  # (P - 1) / (M + P - 1) with M = 4 microbatches, scaled for zero bubble


def test_with_default_pipeline_settings_auto_ranks_every_schedule(plugins):
    plan = prepare(auto(4, "speed"), 4, plugins).plan
    lines = [line for line in plan.rationale if line.startswith("candidate pp (pp=4,")]
    assert len(lines) == len(plugins.schedules.names()) == 7
    order = [line.split("pipeline.schedule = '")[1].split("'")[0] for line in lines]
    assert order.index("zbv") < order.index("interleaved") < order.index("1f1b")  # ranked by bubble at equal compute
    assert "pipeline.virtual_stages = 2" in pp_line(plan, "interleaved") and pp_line(plan, "1f1b").endswith("bubble 43%")


def test_auto_ranks_tsp_at_each_slice_count_and_keeps_a_set_one(plugins):
    """Under auto, tsp is proposed at 1, 2, 4 and 8 slices (8 samples on 2 time ranks); a set tsp.slices is kept."""
    lines = [line for line in prepare(auto(2, "speed"), 2, plugins).plan.rationale if line.startswith("candidate tsp (")
             or ": chose tsp (" in line]
    assert sorted(int(line.split("tsp.slices = ")[1].split(")")[0]) for line in lines) == [1, 2, 4, 8]
    plan = prepare(auto(2, "speed", tsp={"slices": 4}), 2, plugins).plan
    tsp = [line for line in plan.rationale if "tsp (time=2" in line]
    assert len(tsp) == 1 and "tsp (time=2):" in tsp[0]


def test_tsp_s_wavefront_waits_for_p_minus_1_slices_of_the_neurons_and_calls_them_once_a_slice():
    """Neurons taking half of a profile of 10 ms fixed and 1 ms a sample, 16 samples over P = 2 time ranks: one slice
    waits for the whole chunk of neurons (5 + 4 ms), 4 slices for a quarter of it, and call the neurons 3 more
    times."""
    from snnfw.plan.estimate import ModelCost
    from snnfw_plugins.strategies.tsp import wavefront_ms

    cost = ModelCost(parameters=1, activation_bytes=0, neuron_state_bytes=0, step_ms=1.0, fixed_ms=10.0,
                     neuron_share=0.5)
    assert wavefront_ms(cost, 16, 2, 1) == pytest.approx(5 + 4)
    assert wavefront_ms(cost, 16, 2, 4) == pytest.approx(3 * 5 + 5 + 1)
    assert wavefront_ms(cost, 16, 4, 1) == pytest.approx(3 * (5 + 2))


def test_a_time_split_computes_alike_whoever_holds_the_parameters_and_fsdp2_tsp_is_ranked_at_each_slice_count(
        plugins, monkeypatch):
    """FSDP2 or DDP around the same time split changes how a rank holds the parameters, not what it computes: with
    a planted profile, fsdp2_tsp on time=2 x dp=2 and a mesh of dp_replicate=2 x time=2 predict the compute of tsp
    on dp=2 x time=2 (T/P steps of 4 samples, and the wavefront); under auto fsdp2_tsp is proposed at 1, 2 and 4
    slices (4 samples a replica)."""
    from snnfw.plan import prepare as preparing
    from snnfw.plan.estimate import ModelCost
    from snnfw_plugins.strategies.tsp import wavefront_ms

    cost = ModelCost(parameters=1000, activation_bytes=100.0, neuron_state_bytes=10.0, step_ms=1.0, fixed_ms=10.0,
                     neuron_share=0.5)
    monkeypatch.setattr(preparing, "measure", lambda *args, **kwargs: cost)

    def compute(strategy, mesh):
        config = tiny_config(strategy, 1, parallel={"mesh": mesh}, data={"batch_size": 8})
        (best, *_), _, _ = preparing.costed_candidates(config, 4, plugins)
        return best.estimate.compute_ms

    tsp = compute("tsp", {"dp": 2, "time": 2})
    assert tsp == pytest.approx(10 + 4 * 1.0 / 2 + wavefront_ms(cost, 4, 2, 2))
    assert compute("fsdp2_tsp", {"time": 2, "dp": 2}) == pytest.approx(tsp)
    assert compute("mesh", {"dp_replicate": 2, "time": 2}) == pytest.approx(tsp)  # the dimension adds its wavefront
    ranked, refused, _ = preparing.costed_candidates(auto(4, "speed"), 4, plugins)
    slices = sorted(dict(c.settings)["tsp.slices"] for c in ranked if c.preset == "fsdp2_tsp")
    assert slices == [1, 2, 4], [c.describe("cpu") for c in refused if c.preset == "fsdp2_tsp"]


def test_gpipe_keeps_every_microbatch_alive_and_1f1b_at_most_pp(plugins):
    def pp_activations(schedule):
        plan = prepare(auto(2, "speed", batch=16, microbatches=8, pipeline={"schedule": schedule}), 2, plugins).plan
        return float(pp_line(plan, schedule).split("predicted, ~")[1].split(" MB")[0])

    assert pp_activations("gpipe") > pp_activations("1f1b")


def test_auto_chooses_a_pipeline_and_its_schedule_when_the_batch_does_not_split_over_replicas(plugins):
    plan = prepare(auto(3, "speed", batch=8), 3, plugins).plan  # 8 samples over 3 replicas: no dp, zero, fsdp2
    assert plan.preset == "pp" and dict(plan.mesh) == {"pp": 3}
    pipeline = plan.config.pipeline
    assert pipeline.schedule in ("zbv", "zero_bubble") and pipeline.virtual_stages == 2  # the smallest bubble
    assert plan.microbatches == 8  # the smallest divisor of 8 that feeds 6 stages
    assert "candidate dp (dp_replicate=3): cannot run: data.batch_size 8 is not divisible by 3 x 1" in plan.rationale


def test_schedules_refused_for_one_reason_are_listed_once(plugins):
    plan = prepare(auto(1, "speed"), 1, plugins).plan
    assert not any(line.startswith("candidate pp") for line in plan.rationale)  # one rank: no mesh of 2 or more


def _rank_one_measures_a_model_too_large_to_replicate(rank):
    """Rank 1's measurement says the model's parameters fill 1.5x a rank's memory unsharded: measuring for itself,
    it would choose a sharding strategy where rank 0 chooses dp."""
    import attrs

    import snnfw.plan.prepare as prepare_module
    from snnfw.plan.estimate import device_memory_bytes

    measured = prepare_module.measure

    def measure(model, spec, plugins, *args):
        cost = measured(model, spec, plugins, *args)
        return attrs.evolve(cost, parameters=int(1.5 * device_memory_bytes("cpu", 2) / 16)) if rank == 1 else cost

    prepare_module.measure = measure


def test_ranks_whose_measurements_differ_run_rank_0s_choice(plugins, monkeypatch):
    import snnfw.plan.prepare as prepare_module
    from snnfw.testing import run_on_ranks

    config = auto(2, "speed")
    alone = [None, None]
    for rank in (0, 1):  # each rank deciding for itself would part ways
        with monkeypatch.context() as patch:
            patch.setattr(prepare_module, "measure", prepare_module.measure)
            _rank_one_measures_a_model_too_large_to_replicate(rank)
            alone[rank] = prepare(config, 2, plugins).plan.preset
    assert alone[0] == "dp" and alone[1] in {"tp", "pp", "fsdp2_tp"}, alone
    summaries = run_on_ranks(config, 2, timeout_s=240, before=_rank_one_measures_a_model_too_large_to_replicate)
    assert [s["plan"]["preset"] for s in summaries] == ["dp", "dp"]
    assert summaries[0]["plan"] == summaries[1]["plan"]
    assert summaries[0]["plan"]["rationale"][0].startswith("auto, prefer speed: chose dp")


def test_auto_predicts_with_the_corrections_tune_learned_beside_its_records(plugins, tmp_path):
    """Records in which dp's steps took 50 times its terms and fsdp2's their terms make auto's speed ranking take
    fsdp2 over dp, which it picks without them."""
    records = tmp_path / "bench.jsonl"

    def record(strategy, step_ms):
        return {"device": "cpu", "nproc": 2, "plan": {"strategy": strategy, "mesh": {"dp": 2}}, "step_ms": step_ms,
                "predicted": {"ms": 100.0, "compute_ms": 90.0, "communication_ms": 10.0}}

    measured = [record("dp", 5000.0), record("dp", 5000.0), record("fsdp2", 100.0), record("fsdp2", 100.0)]
    records.write_text("".join(json.dumps(r) + "\n" for r in measured))
    assert prepare(auto(2, "speed"), 2, plugins).plan.preset == "dp"
    learned = prepare(auto(2, "speed", parallel={"tune_results": str(records)}), 2, plugins).plan
    assert learned.preset == "fsdp2", learned.rationale
    assert any(line.startswith("candidate dp (") for line in learned.rationale)


def test_tune_results_is_refused_under_a_named_strategy_and_where_it_names_no_file(plugins, tmp_path):
    with pytest.raises(ConfigError, match="parallel.tune_results is read by strategy auto only"):
        prepare(tiny_config("dp", parallel={"tune_results": str(tmp_path / "bench.jsonl")}), 2, plugins)
    with pytest.raises(ConfigError, match="which is not a file; run snnfw tune"):
        prepare(auto(2, "speed", parallel={"tune_results": str(tmp_path / "none.jsonl")}), 2, plugins)


def test_tune_refuses_a_config_that_sets_tune_results(tmp_path):
    from snnfw.errors import UserError
    from snnfw.tools.tune import tune

    quickstart = Path(__file__).resolve().parents[2] / "examples" / "quickstart.toml"
    with pytest.raises(UserError, match="sets parallel.tune_results, which auto reads; tune learns from --results"):
        tune(quickstart, 2, ['parallel.tune_results="bench.jsonl"'], 10.0, tmp_path / "bench.jsonl", tmp_path / "t.toml", 0)


def test_a_model_whose_measured_step_would_not_fit_this_host_is_refused_not_killed(monkeypatch):
    """auto measures a step of a copy of the model here: where that cannot fit (the 1.4B language model on a
    24 GB machine was killed with no word), it says so in one line and what to do instead."""
    from torch import nn

    from snnfw.plan import auto

    model = nn.Linear(1024, 1024)  # 4 MiB of parameters
    monkeypatch.setattr(auto, "_available_memory", lambda: 8 * 2**20)
    with pytest.raises(PlanError, match=r"would need ~0.0 GiB, and this host has 0.0 GiB available; name the layout"):
        auto.check_measurable(model)
    monkeypatch.setattr(auto, "_available_memory", lambda: 64 * 2**20)
    auto.check_measurable(model)
