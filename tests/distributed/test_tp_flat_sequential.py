"""``tp`` on the models of SpikingJelly's tutorials: layers in one flat ``nn.Sequential``, no ``tp_plan`` declared.

snnfw infers a plan of runs of the Sequential's children (``"conv_fc.0:4"``),
which trains as ``none`` does in float64; a model with nothing ``tp`` can
shard, or a plan naming a container of several units, is refused with advice
that fits the model.
"""

import pytest

from snnfw.config import build_config
from snnfw.errors import PlanError
from snnfw.plan.prepare import prepare
from snnfw.plugin.manager import Plugins
from snnfw.run.loop import run_training
from snnfw.testing import run_on_ranks
from snnfw.testing.checks import assert_same_state, assert_steps_close, final_state

TUTORIALS = '''
from spikingjelly.activation_based import functional, layer, neuron, surrogate
from torch import nn


class CSNN(nn.Module):
    """SpikingJelly's convolutional tutorial network: one flat Sequential."""

    def __init__(self, channels=8):
        super().__init__()
        self.conv_fc = nn.Sequential(
            layer.Conv2d(2, channels, 3, padding=1, bias=False), layer.BatchNorm2d(channels),
            neuron.IFNode(surrogate_function=surrogate.ATan()), layer.MaxPool2d(2, 2),
            layer.Conv2d(channels, channels, 3, padding=1, bias=False), layer.BatchNorm2d(channels),
            neuron.IFNode(surrogate_function=surrogate.ATan()), layer.MaxPool2d(2, 2),
            layer.Flatten(),
            layer.Linear(channels * 4 * 4, 32, bias=False), neuron.IFNode(surrogate_function=surrogate.ATan()),
            layer.Linear(32, 10, bias=False), neuron.IFNode(surrogate_function=surrogate.ATan()),
        )
        functional.set_step_mode(self, "m")

    def forward(self, x):
        return self.conv_fc(x)


def mlp():
    """The fully connected tutorial network, the model itself a flat Sequential."""
    net = nn.Sequential(layer.Flatten(), layer.Linear(2 * 16 * 16, 32), neuron.IFNode(v_threshold=0.1),
                        layer.Linear(32, 10), neuron.IFNode(v_threshold=0.1))
    functional.set_step_mode(net, "m")
    return net


def one_layer():
    net = nn.Sequential(layer.Flatten(), layer.Linear(2 * 16 * 16, 10), neuron.LIFNode(tau=2.0))
    functional.set_step_mode(net, "m")
    return net
'''
STEPS = 6


@pytest.fixture(scope="module")
def tutorials(tmp_path_factory):
    path = tmp_path_factory.mktemp("tutorials") / "tutorials.py"
    path.write_text(TUTORIALS)
    return path


def config(tutorials, builder: str, strategy: str, **model):
    return build_config({
        "model": {"builder": f"{tutorials}:{builder}", "input_shape": [2, 16, 16], "num_classes": 10, "time_steps": 4,
                  "input_layout": "TN", **model},
        "data": {"name": "synthetic_dvs", "batch_size": 16, "train_samples": 96, "test_samples": 32},
        "train": {"steps": STEPS, "lr": 3e-3, "optimizer": "adam", "seed": 3, "dtype": "float64"},
        "parallel": {"strategy": strategy},
    })


@pytest.mark.parametrize("builder, plan", [
    ("CSNN", (("conv_fc.0:4", "conv_bn_neuron"), ("conv_fc.4:8", "conv_bn_neuron"), ("conv_fc.9:13", "linear_mlp"))),
    ("mlp", (("1:5", "linear_mlp"),)),
])
def test_a_flat_sequential_trains_under_tp_with_an_inferred_plan_as_under_none(tutorials, builder, plan):
    assert prepare(config(tutorials, builder, "tp"), 2, Plugins()).analysis.tp_plan == plan
    want = run_training(config(tutorials, builder, "none"), on_finish=final_state)
    assert max(want["spike_rates"]) > 0.01, f"the reference hardly spikes: {want['spike_rates']}"
    assert want["losses"][-1] < want["losses"][0], f"the reference does not learn: {want['losses']}"
    for rank, got in enumerate(run_on_ranks(config(tutorials, builder, "tp"), 2, inspect=final_state, timeout_s=240)):
        assert_steps_close(rank, got, want, ("losses", "spike_rates"), STEPS)
        assert_same_state(rank, got["inspect"], want["inspect"])


@pytest.mark.parametrize("builder, model, needle", [
    ("one_layer", {}, "has nothing tp can shard: no container, nor run of an nn.Sequential's layers"),
    ("CSNN", {"tp_plan": {"conv_fc": "conv_bn_neuron"}},
     'conv_fc (conv_bn_neuron): expects exactly one Conv1d/Conv2d and at most one BatchNorm; name the units inside '
     'it in model.tp_plan: "conv_fc.0:4" = "conv_bn_neuron", "conv_fc.4:8" = "conv_bn_neuron", '
     '"conv_fc.9:13" = "linear_mlp"'),
    ("CSNN", {"tp_plan": {"conv_fc.0:9": "conv_bn_neuron"}}, "conv_fc.0:9 (conv_bn_neuron): expects exactly one"),
    ("CSNN", {"tp_plan": {"blocks.0": "conv_bn_neuron"}}, "names module 'blocks.0', which the model does not have"),
    ("mlp", {"tp_plan": {}}, 'model.tp_plan is empty; name units in it ("1:5" = "linear_mlp"), or use strategy dp'),
])
def test_tp_advice_names_what_the_model_has(tutorials, builder, model, needle):
    with pytest.raises(PlanError) as refused:
        prepare(config(tutorials, builder, "tp", **model), 2, Plugins())
    assert needle in str(refused.value) and ("dp or fsdp2" in str(refused.value)) == (builder != "CSNN")


def test_fsdp2_says_it_found_one_block_and_which_to_declare(tutorials):
    rationale = prepare(config(tutorials, "CSNN", "fsdp2"), 2, Plugins()).plan.rationale
    assert ('one block found (conv_fc): each rank gathers all its parameters at once; declare model.blocks = '
            '["conv_fc.0", "conv_fc.1", "conv_fc.4", "conv_fc.5", "conv_fc.9", "conv_fc.11"] to gather one at a time'
            in rationale)
