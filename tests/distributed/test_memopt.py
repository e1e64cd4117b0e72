"""memopt level 1 trains to the losses of level 0, with a lower tracked peak memory, in every strategy.

Multi-rank runs compare the tracked peak of one step through memopt's
checkpoint wrappers with the same step with the wrappers calling their
modules directly (level 0's computation), and their losses with ``none``'s
on the same chunks.
"""

import pytest
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from snnfw.errors import PlanError
from snnfw.plan.prepare import prepare
from snnfw.plugin.manager import Plugins
from snnfw.run.loop import run_training
from snnfw.testing import run_on_ranks, tiny_config, tracked_peak_bytes

# strategy: (ranks, microbatches of the none run on the same chunks)
STRATEGIES = {"dp": (2, 2), "tp": (2, 1), "fsdp2": (2, 2), "fsdp2_tp": (4, 2), "mesh": (4, 2)}
MESH = {"dp_replicate": 2, "tp": 2}  # strategy mesh: replicas of tensor-parallel pairs
BLOCKS = 8  # of the tiny spiking VGG


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SNNFW_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def plain():
    """none at level 0 by microbatches, with its tracked peak."""
    config = {micro: tiny_config("none", micro, train={"steps": 2}) for micro in (1, 2)}
    return {micro: run_training(config[micro], on_finish=tracked_peak_bytes) for micro in config}


def assert_same_losses(reference, summary):
    assert len(summary["losses"]) == len(reference["losses"])
    assert max(abs(a - b) for a, b in zip(reference["losses"], summary["losses"])) <= 1e-5


def _call_directly(module, *args, **kwargs):
    return module(*args, **kwargs)


def peaks_with_and_without_checkpointing(trainer):
    """Tracked peaks of one step through memopt's wrappers, then with each wrapper calling its module directly."""
    wrappers = [m for m in trainer.model.modules() if isinstance(m, CheckpointWrapper)]
    checkpointed = tracked_peak_bytes(trainer)
    functions = [w.checkpoint_fn for w in wrappers]
    for wrapper in wrappers:
        wrapper.checkpoint_fn = _call_directly
    direct = tracked_peak_bytes(trainer)
    for wrapper, function in zip(wrappers, functions):
        wrapper.checkpoint_fn = function
    return checkpointed, direct


def test_none_level_1_keeps_losses_lowers_the_peak_and_is_cached(plain, cache_dir):
    level0 = plain[1]
    first, second = (run_training(tiny_config("none", train={"steps": 2}, memopt={"level": 1}), on_finish=tracked_peak_bytes)
                     for _ in range(2))
    assert "memopt_s" not in level0
    for summary in (first, second):
        assert_same_losses(level0, summary)
        assert summary["spike_rates"] == pytest.approx(level0["spike_rates"], abs=1e-7)
        assert summary["inspect"] < level0["inspect"], f"tracked peak {summary['inspect']} B not below {level0['inspect']} B"
        assert summary["memopt_wrappers"] == BLOCKS
    assert (first["memopt_searched"], second["memopt_searched"]) == (1.0, 0.0)
    assert len(list(cache_dir.glob("memopt/*.json"))) == 1
    assert second["memopt_s"] < first["memopt_s"]


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_level_1_in_strategy_keeps_losses_and_lowers_the_peak(strategy, plain):
    ranks, micro = STRATEGIES[strategy]
    parallel = {"strategy": strategy, "device": "cpu", **({"mesh": MESH} if strategy == "mesh" else {})}
    config = tiny_config(strategy, train={"steps": 2}, memopt={"level": 1}, parallel=parallel)
    for summary in run_on_ranks(config, ranks, inspect=peaks_with_and_without_checkpointing):
        assert_same_losses(plain[micro], summary)
        checkpointed, direct = summary["inspect"]
        assert checkpointed < direct, f"tracked peak {checkpointed} B not below {direct} B without checkpointing"
        assert summary["memopt_wrappers"] == BLOCKS and summary["memopt_s"] > 0


def test_pipeline_checkpoints_the_stages_with_the_largest_inputs(plain):
    config = tiny_config("pp", None, train={"steps": 2}, pipeline={"layout": "3|6"}, memopt={"level": 1, "stage_ratio": 0.5})
    first, second = run_on_ranks(config, 2, inspect=peaks_with_and_without_checkpointing)
    for summary in (first, second):
        assert_same_losses(plain[2], summary)
    assert first["inspect"][0] < first["inspect"][1], "stage 0 (the largest inputs) was not checkpointed"
    assert second["inspect"][0] == second["inspect"][1], "stage 1 is outside the stage_ratio of 0.5"


def test_searching_levels_are_refused_on_cpu():
    with pytest.raises(PlanError, match="memopt.level 2 searches by measured CUDA peak memory"):
        prepare(tiny_config("dp", memopt={"level": 2}), 2, Plugins())


@pytest.mark.parametrize(
    "strategy, world, memopt, subject",
    [
        ("none", 1, {"budget": "speed"}, "memopt.budget is"),
        ("dp", 2, {"compress": True}, "memopt.compress is"),
        ("pp", 2, {"level": 0, "stage_ratio": 0.5, "budget": "memory"}, "memopt.budget, memopt.stage_ratio are"),
        ("auto", 2, {"compress": False}, "memopt.compress is"),
    ],
)
def test_memopt_options_at_level_0_are_refused_in_the_plan(strategy, world, memopt, subject):
    with pytest.raises(PlanError) as err:
        prepare(tiny_config(strategy, microbatches=None, memopt=memopt), world, Plugins())
    expected = f"strategy {strategy!r} cannot run: {subject} applied only with memopt.level 1 or more; set memopt.level"
    assert expected in str(err.value)


def test_memopt_options_plan_at_level_1():
    memopt = {"level": 1, "budget": "balanced", "compress": False}
    assert prepare(tiny_config("dp", memopt=memopt), 2, Plugins()).plan.config.memopt.budget == "balanced"
