"""pp on SpikingJelly's model zoo given by ``model.builder``: stage units inferred for its ResNets and VGGs, the
flatten between their average pooling and classifier carried as glue (``"flatten:fc"``), and a refusal whose
suggested units plan and train when pasted. Float64, 2 ranks, against ``none`` with the same microbatches."""

import json
import re
from pathlib import Path

import pytest
import torch
from spikingjelly.activation_based import functional

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
VGG11_STAGE_UNITS = (*(f"features.{i}" for i in range(21)), "avgpool", "flatten:classifier.0",
                     *(f"classifier.{i}" for i in range(1, 7)))


def zoo_config(builder: str, strategy: str, side: int = 16, train: dict | None = None, **model) -> object:
    return build_config({
        "model": {"builder": f"{NETS}:{builder}", "input_shape": [2, side, side], "num_classes": 10,
                  "input_layout": "TN", **model},
        "data": {"batch_size": 8, "train_samples": 32, "test_samples": 16},
        "train": {"steps": 3, "microbatches": 2, "dtype": "float64", "seed": 3, **(train or {})},
        "parallel": {"strategy": strategy},
    })


def assert_pp_trains_as_none(builder: str, side: int = 16, train: dict | None = None, **model) -> None:
    reference = run_training(zoo_config(builder, "none", side, train, **model))
    for summary in run_on_ranks(zoo_config(builder, "pp", side, train, **model), 2, timeout_s=TIMEOUT_S):
        assert_same_losses(reference, summary)  # the neurons fire, too
        for step, (got, want) in enumerate(zip(summary["losses"], reference["losses"]), start=1):
            assert_close(f"step {step}'s loss", got, want)


def test_pp_trains_the_zoo_sew_resnet18_with_no_units_declared_as_none():
    analysis = prepare(zoo_config("sew_resnet18", "pp"), 2, Plugins()).analysis
    assert "stage_units" in analysis.inferred
    assert analysis.stage_units[:5] == ("conv1", "bn1", "sn1", "maxpool", "layer1.0")
    assert analysis.stage_units[-3:] == ("layer4.1", "avgpool", "flatten:fc")
    assert_pp_trains_as_none("sew_resnet18")


def test_pp_trains_the_zoo_spiking_vgg11_layout_with_no_units_declared_as_none():
    """The zoo's SpikingVGG in VGG-11's layout, narrow (test_zoo_tp checks that the zoo's own 129M-parameter
    spiking_vgg11 infers these units too); 32x32 frames for its five poolings."""
    analysis = prepare(zoo_config("narrow_spiking_vgg11_without_dropout", "pp", 32), 2, Plugins()).analysis
    assert "stage_units" in analysis.inferred
    assert analysis.stage_units == VGG11_STAGE_UNITS
    assert_pp_trains_as_none("narrow_spiking_vgg11_without_dropout", 32)


def test_a_refusal_suggests_units_that_plan_and_train_when_pasted():
    with pytest.raises(PlanError, match="no stage_units") as refusal:
        prepare(zoo_config("PooledNet", "pp"), 2, Plugins())
    suggested = json.loads(re.search(r"model\.stage_units = (\[[^]]*\])", str(refusal.value)).group(1))
    assert suggested == ["conv", "bn", "sn", "pool", "flatten:fc"]
    assert_pp_trains_as_none("PooledNet", stage_units=suggested)


ZOO_UNITS = {
    "spiking_resnet18": ("conv1", "bn1", "sn1", "maxpool", *(f"layer{i}.{j}" for i in range(1, 5) for j in (0, 1)),
                         "avgpool", "flatten:fc"),
    "small_spiking_vgg": ("features.0", "features.1", "features.2", "avgpool", "flatten:classifier.0", "classifier.1",
                          "classifier.2", "classifier.3"),
    "small_dvs_gesture_net": tuple(f"conv_fc.{i}" for i in range(28)),  # its layer.Flatten is one of them
}


@pytest.mark.parametrize("builder, frames", [("spiking_resnet18", (4, 2, 2, 16, 16)), ("small_spiking_vgg", (4, 2, 2, 8, 8)),
                                             ("small_dvs_gesture_net", (2, 1, 2, 128, 128))])
def test_the_zoo_units_compute_its_forward_with_the_flatten_as_glue(builder, frames, monkeypatch):
    monkeypatch.syspath_prepend(str(NETS.parent))
    import zoo_nets

    net = getattr(zoo_nets, builder)()
    units, frames = zoo_stage_units(net), torch.rand(frames)
    assert units == ZOO_UNITS[builder]
    assert composition_error(net, [_stage_unit(net, unit) for unit in units], frames, functional.reset_net) is None
    if any(unit.startswith("flatten:") for unit in units):  # the error pp failed with before the glue
        unglued = [_stage_unit(net, unit.removeprefix("flatten:")) for unit in units]
        assert "mat1 and mat2 shapes cannot be multiplied" in composition_error(net, unglued, frames, functional.reset_net)
