"""pp on SpikingJelly's model zoo given by ``model.builder``: stage units inferred for its ResNets and VGGs, the
flatten between their average pooling and classifier carried as glue (``"flatten:fc"``), and a refusal whose
suggested units plan and train when pasted. Float64, 2 ranks, against ``none`` with the same microbatches."""

import json
import re
from pathlib import Path

import pytest
import torch
from spikingjelly.activation_based import functional, layer, neuron
from torch import nn

from snnfw.config import build_config
from snnfw.errors import PlanError
from snnfw.model.source import zoo_stage_units
from snnfw.plan.prepare import prepare
from snnfw.plugin.manager import Plugins
from snnfw.run.loop import run_training
from snnfw.testing import run_on_ranks
from snnfw.testing.checks import assert_close, assert_same_losses
from snnfw_plugins.strategies.pp import _stage_unit
from snnfw_plugins.strategies.pp_stages import composition_error

NETS = Path(__file__).with_name("zoo_nets.py")
TIMEOUT_S = 300


def zoo_config(builder: str, strategy: str, **model) -> object:
    return build_config({
        "model": {"builder": f"{NETS}:{builder}", "input_shape": [2, 16, 16], "num_classes": 10, "input_layout": "TN",
                  **model},
        "data": {"batch_size": 8, "train_samples": 32, "test_samples": 16},
        "train": {"steps": 3, "microbatches": 2, "dtype": "float64", "seed": 3},
        "parallel": {"strategy": strategy},
    })


def assert_pp_trains_as_none(builder: str, **model) -> None:
    reference = run_training(zoo_config(builder, "none", **model))
    for summary in run_on_ranks(zoo_config(builder, "pp", **model), 2, timeout_s=TIMEOUT_S):
        assert_same_losses(reference, summary)  # the neurons fire, too
        for step, (got, want) in enumerate(zip(summary["losses"], reference["losses"]), start=1):
            assert_close(f"step {step}'s loss", got, want)


def test_pp_trains_the_zoo_sew_resnet18_with_no_units_declared_as_none():
    analysis = prepare(zoo_config("sew_resnet18", "pp"), 2, Plugins()).analysis
    assert "stage_units" in analysis.inferred
    assert analysis.stage_units[:5] == ("conv1", "bn1", "sn1", "maxpool", "layer1.0")
    assert analysis.stage_units[-3:] == ("layer4.1", "avgpool", "flatten:fc")
    assert_pp_trains_as_none("sew_resnet18")


def test_a_refusal_suggests_units_that_plan_and_train_when_pasted():
    with pytest.raises(PlanError, match="no stage_units") as refusal:
        prepare(zoo_config("PooledNet", "pp"), 2, Plugins())
    suggested = json.loads(re.search(r"model\.stage_units = (\[[^]]*\])", str(refusal.value)).group(1))
    assert suggested == ["conv", "bn", "sn", "pool", "flatten:fc"]
    assert_pp_trains_as_none("PooledNet", stage_units=suggested)


def small_spiking_vgg() -> nn.Module:
    """The zoo's SpikingVGG (built on the meta device: its classifier has 120M parameters) with one conv of 512
    channels, and a classifier small enough to run, its layers in the zoo's order."""
    from zoo_nets import spiking_vgg  # imported beside a torchvision stand-in, where it is not installed

    with torch.device("meta"):
        net = spiking_vgg.SpikingVGG([512, "M"], spiking_neuron=neuron.IFNode, num_classes=10)
    net.avgpool = layer.AdaptiveAvgPool2d((1, 1))
    net.classifier = nn.Sequential(layer.Linear(512, 16), neuron.IFNode(), layer.Dropout(), layer.Linear(16, 10))
    net.to_empty(device="cpu")
    for module in net.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    net.features[0] = layer.Conv2d(2, 512, kernel_size=3, padding=1)
    functional.set_step_mode(net, "m")
    return net


def test_the_zoo_vgg_units_compute_its_forward_with_the_flatten_as_glue(monkeypatch):
    monkeypatch.syspath_prepend(str(NETS.parent))
    net = small_spiking_vgg()
    units = zoo_stage_units(net)
    assert units == ("features.0", "features.1", "features.2", "avgpool", "flatten:classifier.0", "classifier.1",
                     "classifier.2", "classifier.3")
    frames = torch.rand(4, 2, 2, 8, 8)
    assert composition_error(net, [_stage_unit(net, unit) for unit in units], frames, functional.reset_net) is None
    unglued = [_stage_unit(net, unit.removeprefix("flatten:")) for unit in units]
    assert "mat1 and mat2 shapes cannot be multiplied" in composition_error(net, unglued, frames, functional.reset_net)
