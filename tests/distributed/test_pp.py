"""pp: every schedule trains to the per-step losses of one process with the same microbatches.

Multi-rank runs: all seven schedules on the VGG; on Spikformer one schedule
per stage placement (1f1b single, interleaved looped, zbv V-shaped with split
input and weight gradients); and a 4-rank pp x dp run. Each also checks the
test accuracy (forward-only evaluation across stages), that every parameter
of every stage moved from its initial value (so gradients reached it), and
that all ranks use the one split rank 0 measured.
"""

import functools
import json
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from snnfw.config import ConfigError, build_config
from snnfw.distributed.pipeline import balanced_layout
from snnfw.errors import PlanError, UnknownNameError
from snnfw.plan.prepare import build_model, prepare
from snnfw.plugin.manager import Plugins
from snnfw.run.loop import run_training
from snnfw.testing import local_parameters, run_on_ranks, tiny_config
from snnfw.testing.checks import assert_same_losses
from snnfw_plugins.strategies.pp_stages import measure_units

SPIKFORMER = {"family": "spikformer"}


@pytest.fixture(scope="module")
def plugins():
    return Plugins()


def pp_config(schedule="1f1b", virtual=1, microbatches=None, layout=None, **sections):
    pipeline = {"schedule": schedule, "virtual_stages": virtual} | ({"layout": layout} if layout else {})
    return tiny_config("pp", microbatches, pipeline=pipeline, **sections)


@functools.cache
def reference_run(family: str, microbatches: int) -> dict:
    summary = run_training(tiny_config("none", microbatches, model={"family": family}))
    return {"losses": summary["losses"], "test_accuracy": summary["test_accuracy"]}


def pipeline_report(trainer):
    """This rank's stages, the split, and the local parameters still equal to their initial values."""
    pipe = trainer.model
    fresh, _ = build_model(trainer.config, trainer.plugins)
    units = trainer.plugins.split_stages(fresh, trainer.plan, None)
    unchanged, count = [], 0
    for index, stage in zip(pipe.stage_indices, pipe.stages):
        initial = [p for u in pipe.split.unit_range(index) for p in units[u].parameters()]
        for (name, param), start in zip(stage.named_parameters(), initial, strict=True):
            count += 1
            if torch.equal(param.detach(), start):
                unchanged.append(f"stage {index} {name}")
    return {
        "stages": pipe.stage_indices,
        "layout": pipe.split.layout,
        "unit_ms": pipe.split.unit_ms,
        "boundaries": pipe.split.boundaries,
        "spikes": pipe.split.spikes,
        "microbatches": trainer.plan.microbatches,
        "parameters": count,
        "unchanged": unchanged,
        "values": local_parameters(trainer),
    }


def check_pipeline_run(config, nproc, run_dir=None, replicas=1):
    """Runs ``config``; asserts losses equal none's with replicas x microbatches, and a complete, shared, trained split."""
    plan = prepare(config, nproc, Plugins()).plan
    reference = reference_run(config.model.family, replicas * plan.microbatches)
    summaries = run_on_ranks(config, nproc, run_dir, inspect=pipeline_report, timeout_s=150)
    for summary in summaries:
        assert_same_losses(reference, summary)
        assert summary["test_accuracy"] == reference["test_accuracy"]
    reports = [s["inspect"] for s in summaries]
    assert len({r["layout"] for r in reports}) == 1, "ranks use different splits"
    first = reports[0]
    for stage, units in enumerate(first["layout"]):  # the summary says what split the run used
        assert summaries[0][f"pp_stage{stage}_units"] == units
    if first["unit_ms"]:
        assert first["layout"] == balanced_layout(first["unit_ms"], len(first["layout"]))
        stage_ms = [summaries[0][f"pp_stage{stage}_ms"] for stage in range(len(first["layout"]))]
        assert sum(stage_ms) == pytest.approx(sum(first["unit_ms"]))
    replica = reports[::replicas]  # the mesh is pp x dp_replicate: one replica's stages lie on every replicas-th rank
    assert sorted(i for r in replica for i in r["stages"]) == list(range(len(first["layout"])))
    model, _ = build_model(config, Plugins())
    assert sum(r["parameters"] for r in replica) == len(list(model.parameters()))
    for rank, report in enumerate(reports):
        assert not report["unchanged"], f"rank {rank}: no gradient reached {report['unchanged']}"
    return reports


SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zero_bubble", 2), ("looped_bfs", 2), ("zbv", 2), ("dualpipev", 2)]


@pytest.mark.parametrize("schedule, virtual", SCHEDULES)
def test_vgg_schedule_matches_none(schedule, virtual, tmp_path):
    reports = check_pipeline_run(pp_config(schedule, virtual, log={"phase_times": True}), 2, tmp_path)
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["pp_busy_ms"] > 0 and 0 <= record["pp_bubble"] < 1
    report = reports[0]
    assert report["spikes"] == (False, *[True] * (len(report["boundaries"]) - 3), False, False)  # VGG blocks' spikes
    if virtual == 1:  # one boundary crosses: each microbatch's spikes forward as bits, its gradient back in float32
        (shape, dtype), = [report["boundaries"][report["layout"][0]]]
        numel, micro = math.prod(shape), report["microbatches"]
        assert dtype == torch.float32 and report["spikes"][report["layout"][0]]
        assert record["pp_sent_mb"] * 2**20 == micro * (-(-numel // 8) + 4 * numel) / 2  # mean over the 2 ranks


@pytest.mark.parametrize("schedule, virtual", [("1f1b", 1), ("interleaved", 2), ("zbv", 2)])
def test_spikformer_schedule_matches_none(schedule, virtual):
    check_pipeline_run(pp_config(schedule, virtual, model=SPIKFORMER), 2)


def test_pp_by_dp_matches_none_and_keeps_stage_replicas_equal():
    config = pp_config("1f1b", parallel={"mesh": {"dp": 2, "pp": 2}})
    reports = check_pipeline_run(config, 4, replicas=2)
    for rank in (0, 2):  # the mesh is pp x dp_replicate: ranks 0 and 1 hold stage 0, ranks 2 and 3 stage 1
        mine, peer = reports[rank]["values"], reports[rank + 1]["values"]
        for name, tensor in mine.items():
            assert torch.equal(tensor, peer[name]), f"rank {rank}: replicas differ in {name}"


def test_given_layout_is_used_on_every_rank():
    reports = check_pipeline_run(pp_config("gpipe", microbatches=2, layout="2|7"), 2)
    assert [r["layout"] for r in reports] == [(2, 7), (2, 7)] and reports[0]["unit_ms"] == ()


def test_balanced_layout_minimises_the_slowest_stage():
    assert balanced_layout([1, 1, 100, 1, 1, 1], 3) == (2, 1, 3)
    assert balanced_layout([5, 1, 1, 1, 1, 5], 2) == (3, 3)
    assert max(map(sum, _stages([1.0] * 9, balanced_layout([1.0] * 9, 4)))) == 3
    assert balanced_layout([2, 2, 2], 3) == (1, 1, 1)
    with pytest.raises(ValueError, match="cannot split 2 units into 3"):
        balanced_layout([1, 1], 3)


def _stages(costs, layout):
    out, start = [], 0
    for count in layout:
        out.append(costs[start : start + count])
        start += count
    return out


def test_dry_run_times_uneven_units_and_the_split_isolates_the_heavy_one():
    light = [nn.Linear(16, 16) for _ in range(5)]
    heavy = nn.Sequential(nn.Linear(16, 1024), nn.Linear(1024, 1024), nn.Linear(1024, 1024), nn.Linear(1024, 16))
    units = light[:2] + [heavy] + light[2:]
    boundaries, unit_ms, _ = measure_units(units, torch.rand(4, 8, 16), lambda unit: None, passes=3)  # on one thread
    assert boundaries == tuple(((4, 8, 16), torch.float32) for _ in range(7))
    assert unit_ms[2] > 5 * max(unit_ms[:2] + unit_ms[3:])
    assert balanced_layout(unit_ms, 3) == (2, 1, 3)
    # each unit's gradients are dropped once timed: rank 0 never holds a whole model's gradients for the split
    assert all(p.grad is None for unit in units for p in unit.parameters())


def test_any_sequential_model_splits_into_its_children(plugins):
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    plan = SimpleNamespace(analysis=SimpleNamespace(family="an_unknown_sequential_family", own=False))
    assert plugins.split_stages(model, plan, None) == list(model)


def test_microbatches_are_chosen_when_absent_and_checked_when_given(plugins):
    def plan(config, world=2):
        return prepare(config, world, plugins).plan

    assert plan(pp_config("1f1b")).microbatches == 2
    assert plan(pp_config("interleaved", 2)).microbatches == 4
    assert plan(pp_config("1f1b", parallel={"mesh": {"dp": 2, "pp": 2}}), 4).microbatches == 2
    assert plan(pp_config("gpipe", microbatches=8)).microbatches == 8
    assert plan(tiny_config("none", microbatches=None), 1).microbatches == 1
    interleaved = plan(pp_config("interleaved", 2))
    assert interleaved.dp_dims == () and interleaved.mesh == (("pp", 2),)
    assert any("pp rank 0 holds stages [0, 2]; pp rank 1 holds stages [1, 3]" in line for line in interleaved.rationale)
    assert any("pp rank 0 holds stages [0, 3]" in line for line in plan(pp_config("zbv", 2)).rationale)


@pytest.mark.parametrize(
    "config, world, message",
    [
        (pp_config(layout="2|2|5"), 2,
         "pipeline.layout 2|2|5 has 3 stages, but pp 2 x virtual_stages 1 = 2 stages"),
        (pp_config(layout="2|6"), 2,
         "pipeline.layout 2|6 sums to 8 units, but the model has 9 (features.0,"),
        (pp_config("interleaved", 1), 2, "schedule interleaved runs 2 or more stages per rank; set pipeline.virtual_stages = 2"),
        (pp_config("zbv", 3), 2, "schedule zbv runs two stages per rank in a V; set pipeline.virtual_stages = 2, not 3"),
        (pp_config("gpipe", 2), 2, "schedule gpipe runs one stage per rank"),
        (pp_config("looped_bfs", 3, model=SPIKFORMER), 2,
         "the model has 4 units (net.patch_embed, net.blocks.0, net.blocks.1, net.head), fewer than pp 2 x virtual_stages 3 = 6 stages"),
        (pp_config(microbatches=1), 2, "train.microbatches 1 is fewer than the 2 stages"),
        (pp_config("interleaved", 2, microbatches=5, data={"batch_size": 10}), 2,
         "schedule interleaved: 5 microbatches do not form 2 equal rounds; use a multiple of pp = 2"),
        (pp_config("interleaved", 2, data={"batch_size": 3}), 2, "no divisor of the per-replica batch 3 is at least the 4 stages"),
        (pp_config(parallel={"mesh": {"tp": 2}}), 2, "strategy pp splits over pp, 2 ranks or more each, and its mesh "
                                                     "{tp = 2} names no pp"),
        (pp_config(parallel={"mesh": {"dp": 2, "pp": 1}}), 2, "its mesh has pp = 1; set each to 2 or more"),
        (pp_config(parallel={"mesh": {"pp": 4}}), 2, "mesh pp=4 has 4 ranks but the world has 2"),
    ],
)
def test_impossible_pipelines_fail_in_plan(plugins, config, world, message):
    with pytest.raises(PlanError) as err:
        prepare(config, world, plugins)
    assert message in str(err.value)


@pytest.mark.parametrize(
    "strategy, world, sections, keys",
    [
        ("none", 1, {"pipeline": {"schedule": "gpipe"}}, "pipeline.schedule is"),
        ("dp", 2, {"pipeline": {"virtual_stages": 1}}, "pipeline.virtual_stages is"),
        ("tp", 2, {"pipeline": {"layout": "4|5"}}, "pipeline.layout is"),
        ("fsdp2", 2, {"memopt": {"level": 1, "stage_ratio": 0.5}}, "memopt.stage_ratio is"),
        ("zero", 2, {"pipeline": {"schedule": "1f1b", "layout": "4|5"}}, "pipeline.schedule, pipeline.layout are"),
    ],
)
def test_pipeline_keys_are_refused_by_other_strategies(plugins, strategy, world, sections, keys):
    with pytest.raises(PlanError) as err:
        prepare(tiny_config(strategy, **sections), world, plugins)
    assert f"strategy {strategy!r} cannot run: {keys} applied only by a pp dimension; remove" in str(err.value)


def test_auto_with_a_pipeline_key_plans_only_pipelines(plugins):
    plan = prepare(tiny_config("auto", microbatches=None, pipeline={"layout": "4|5"}), 2, plugins).plan
    assert plan.preset == "pp" and plan.config.pipeline.layout == "4|5"
    refused = [line for line in plan.rationale if "applied only by a pp dimension" in line]
    assert refused and not any("pp=" in line.split(": cannot run")[0] for line in refused), plan.rationale
    kept = [line for line in plan.rationale if line.startswith("candidate") and "cannot run" not in line]
    assert all("pp=" in line.split("):")[0] for line in kept), plan.rationale


def test_unknown_schedule_lists_the_registered_ones(plugins):
    with pytest.raises(UnknownNameError) as err:
        prepare(pp_config("zb2"), 2, plugins)
    names = plugins.schedules.names()
    assert {"gpipe", "1f1b", "interleaved", "zero_bubble", "looped_bfs", "zbv", "dualpipev"} <= set(names)
    assert str(err.value) == f"unknown schedule 'zb2' (did you mean 'zbv'?); registered schedule names: {', '.join(names)}"


@pytest.mark.parametrize("layout", ["1,2", "0|3", "a"])
def test_malformed_layout_is_refused_by_config(layout):
    with pytest.raises(ConfigError, match="'layout' must be units per stage"):
        build_config({"pipeline": {"layout": layout}})


def test_auto_trains_the_pipeline_schedule_it_chose(tmp_path):
    """8 samples on 3 ranks: only a pipeline fits (no replica split, no 3-way channel split); auto picks
    its schedule, and the run uses and records it.

    SGD: with single-sample microbatches some gradients are ~1e-10 on one path and 0 on the other, which
    Adam can turn into whole steps; SGD shows the runs agree.
    """
    sgd = {"optimizer": "sgd"}
    config = tiny_config("auto", microbatches=None, data={"batch_size": 8}, train=sgd)
    reference = run_training(tiny_config("none", microbatches=8, data={"batch_size": 8}, train=sgd))
    summary = run_on_ranks(config, 3, tmp_path)[0]
    assert summary["plan"]["preset"] == "pp" and summary["plan"]["microbatches"] == 8
    chosen = summary["config"]["pipeline"]
    assert chosen["schedule"] in ("zbv", "zero_bubble") and chosen["virtual_stages"] == 2
    assert summary["plan"]["rationale"][0].startswith(f"auto, prefer speed: chose pp (pp=3, pipeline.schedule = '{chosen['schedule']}'")
    assert_same_losses(reference, summary)


def flatten_then_mlp():
    from spikingjelly.activation_based import layer, neuron

    return nn.Sequential(layer.Flatten(step_mode="m"), layer.Linear(2 * 8 * 8, 32, step_mode="m"),
                         neuron.LIFNode(v_threshold=0.25, step_mode="m"), layer.Linear(32, 10, step_mode="m"))


def test_a_stage_that_holds_no_parameters_trains_as_none():
    """A split may give a stage only units without parameters (a measured one did, under load): its optimizer
    steps nothing, and the run equals none."""
    def config(strategy):
        return build_config({
            "model": {"builder": f"{__file__}:flatten_then_mlp", "input_shape": [2, 8, 8], "num_classes": 10,
                      "input_layout": "TN", "time_steps": 4},
            "data": {"name": "synthetic_dvs", "batch_size": 8, "train_samples": 16, "test_samples": 8},
            "train": {"steps": 3, "lr": 0.01, "seed": 3, "dtype": "float64", "microbatches": 2},
            "parallel": {"strategy": strategy, "device": "cpu"},
            **({"pipeline": {"layout": "1|3"}} if strategy == "pp" else {}),
        })

    reference = run_training(config("none"))
    for summary in run_on_ranks(config("pp"), 2, timeout_s=150):
        assert_same_losses(reference, summary)
