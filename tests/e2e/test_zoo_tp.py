"""tp on SpikingJelly's model zoo given by ``model.builder``, with no tp_plan declared: sew_resnet18's residual blocks
(``residual_conv_pair``) and the convs and classifier of spiking_vgg11's layout (``conv_bn_neuron``, ``linear_mlp`` with
its dropout) sharded, most of each network's parameters with them (the VGG narrow; the zoo's own 129M-parameter
spiking_vgg11 is checked to infer the same plan); a small network holds the zoo's two other blocks (spiking_resnet's
BasicBlock, sew_resnet's Bottleneck). Float64, 2 ranks, against ``none``."""

from pathlib import Path

import pytest

from snnfw.config import build_config
from snnfw.plan.prepare import prepare
from snnfw.plugin.manager import Plugins
from snnfw.run.loop import run_training
from snnfw.testing import local_parameters, run_on_ranks
from snnfw.testing.checks import assert_close, assert_same_losses
from test_zoo_pipeline import VGG11_STAGE_UNITS

NETS = Path(__file__).with_name("zoo_nets.py")
TIMEOUT_S = 400


def zoo_config(builder: str, strategy: str, side: int) -> object:
    return build_config({
        "model": {"builder": f"{NETS}:{builder}", "input_shape": [2, side, side], "num_classes": 10,
                  "input_layout": "TN", "time_steps": 2},
        "data": {"batch_size": 4, "train_samples": 12, "test_samples": 4},
        "train": {"steps": 3, "dtype": "float64", "seed": 3, "optimizer": "sgd", "momentum": 0, "lr": 0.05},
        "parallel": {"strategy": strategy},
    })


def parameter_count(trainer) -> int:
    return sum(p.numel() for p in local_parameters(trainer).values())


SEW_RESNET18_PLAN = [(f"layer{i}.{j}", "residual_conv_pair") for i in range(1, 5) for j in (0, 1)]
BLOCKS_PLAN = [("stem", "conv_bn_neuron"), ("basic", "residual_conv_pair"), ("bottleneck", "residual_conv_pair")]
VGG11_RUNS = ("0:3", "3:6", "6:8", "8:11", "11:13", "13:16", "16:18", "18:21")  # conv, IF, and pooling after some
VGG11_PLAN = [*((f"features.{run}", "conv_bn_neuron") for run in VGG11_RUNS),
              ("classifier.0:5", "linear_mlp")]  # Linear, IF, Dropout, Linear, IF; the last Linear whole


@pytest.mark.parametrize("builder, side, plan", [("sew_resnet18", 16, SEW_RESNET18_PLAN),
                                                 ("narrow_spiking_vgg11", 32, VGG11_PLAN),  # 32: its five poolings
                                                 ("ZooBlocksNet", 8, BLOCKS_PLAN)])
def test_tp_trains_the_zoo_with_most_parameters_sharded_as_none(builder, side, plan, tmp_path):
    analysis = prepare(zoo_config(builder, "tp", side), 2, Plugins()).analysis
    assert "tp_plan" in analysis.inferred and list(analysis.tp_plan) == plan
    reference = run_training(zoo_config(builder, "none", side), on_finish=parameter_count)
    summaries = run_on_ranks(zoo_config(builder, "tp", side), 2, tmp_path, inspect=parameter_count,
                             timeout_s=TIMEOUT_S)
    whole = reference["inspect"]
    for summary in summaries:
        assert_same_losses(reference, summary)  # the neurons fire, too
        for step, (got, want) in enumerate(zip(summary["losses"], reference["losses"]), start=1):
            assert_close(f"step {step}'s loss", got, want)
        sharded = 2 * (whole - summary["inspect"])  # each rank holds half of every sharded parameter
        assert sharded / whole > 0.9, f"{builder}: {sharded} of {whole} parameters sharded"


def test_the_zoo_spiking_vgg11_infers_the_tp_plan_and_stage_units_of_its_narrow_layout():
    """The narrow VGG trained above and in test_zoo_pipeline stands for the zoo's own: the same plan and units."""
    analysis = prepare(zoo_config("spiking_vgg11", "tp", 32), 2, Plugins()).analysis
    assert list(analysis.tp_plan) == VGG11_PLAN and analysis.stage_units == VGG11_STAGE_UNITS
