"""NIR export: the graph read back and simulated step by step gives the model's spikes; what NIR lacks is refused."""

import sys
from pathlib import Path

import nir
import pytest
import torch
from torch import nn

from snnfw.cli import main
from snnfw.components.nir_export import model_spikes, simulate, to_nir
from snnfw.config import build_config
from snnfw.plan.prepare import prepare
from snnfw.plugin.manager import Plugins

ROOT = Path(__file__).resolve().parents[2]
T = 4


def build() -> nn.Module:
    """An own model: Conv-BN-IF, average pooling, SpikingJelly's Flatten, Linear-LIF (decay_input), Linear."""
    from spikingjelly.activation_based import functional, layer, neuron

    net = nn.Sequential(
        layer.Conv2d(2, 6, 3, padding=1, stride=2), layer.BatchNorm2d(6), neuron.IFNode(v_threshold=0.5),
        layer.AvgPool2d(2), layer.Flatten(), layer.Linear(6 * 4 * 4, 16), neuron.LIFNode(tau=2.0), layer.Dropout(0.1),
        layer.Linear(16, 10),
    )
    functional.set_step_mode(net, "m")
    return net


def spiking_mlp() -> nn.Module:
    sys.path.insert(0, str(ROOT / "examples" / "spiking_mlp_plugin"))
    from snnfw_spiking_mlp.model import SpikingMLP

    return SpikingMLP(2 * 16 * 16, 32, 48, 2, 10)


def family(name: str) -> nn.Module:
    model = {"family": name, "flavor": "tiny"} if name != "own" else {
        "builder": f"{__file__}:build", "input_shape": [2, 16, 16], "num_classes": 10, "input_layout": "TN"}
    return prepare(build_config({"model": {**model, "time_steps": T}, "data": {"name": "synthetic_dvs"}}), 1,
                   Plugins()).model


def trained_like(model: nn.Module) -> nn.Module:
    """Batch-norm statistics and scales of a trained network, so that every layer spikes."""
    torch.manual_seed(1)
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.running_mean.uniform_(-0.2, 0.2), module.running_var.uniform_(0.5, 2.0)
            module.weight.data.uniform_(2.0, 4.0), module.bias.data.uniform_(-0.2, 0.5)
        if isinstance(module, nn.Linear):
            module.weight.data *= 4
    return model.double().eval()


@pytest.mark.parametrize("make, shape", [(lambda: family("cifar10dvs_vgg"), (2, 32, 32)), (spiking_mlp, (2, 16, 16)),
                                         (lambda: family("own"), (2, 16, 16))], ids=["vgg_tiny", "spiking_mlp", "own"])
def test_the_graph_read_back_gives_the_models_spikes(tmp_path, make, shape):
    model = trained_like(make())
    nir.write(str(tmp_path / "m.nir"), to_nir(model, shape))
    graph = nir.read(str(tmp_path / "m.nir"))
    frames = (torch.rand(3, T, *shape, generator=torch.Generator().manual_seed(0)) < 0.3).double()
    want, spikes = model_spikes(model, frames)
    got, simulated = simulate(graph, frames.transpose(0, 1))
    assert set(simulated) == set(spikes) and spikes
    for name, value in spikes.items():
        assert value.sum() > 0, name
        assert torch.equal(simulated[name], value), name
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_batch_norm_is_folded_into_the_conv_before_it():
    graph = to_nir(trained_like(family("own")), (2, 16, 16))
    assert [type(node).__name__ for node in graph.nodes.values()] == [
        "Input", "Conv2d", "IF", "AvgPool2d", "Flatten", "Affine", "LIF", "Affine", "Output"]


def test_cli_exports_weights_as_nir(tmp_path, capsys):
    config = tmp_path / "vgg.toml"
    config.write_text('[model]\nfamily = "cifar10dvs_vgg"\nflavor = "tiny"\n[data]\nname = "synthetic_dvs"\n')
    weights = tmp_path / "w.pt"
    torch.save(trained_like(family("cifar10dvs_vgg")).float().state_dict(), weights)
    status = main(["export", str(weights), "--format", "nir", "--config", str(config), "--out", str(tmp_path / "m.nir")])
    assert status == 0, capsys.readouterr().err
    assert "spikes" in capsys.readouterr().out
    assert sum(isinstance(node, nir.LIF) for node in nir.read(str(tmp_path / "m.nir")).nodes.values()) == 8


def test_a_layer_nir_cannot_express_is_refused_by_name(tmp_path, capsys):
    config = tmp_path / "own.toml"
    config.write_text(f'[model]\nbuilder = "{ROOT / "examples" / "train_own_model.py"}:build"\ninput_shape = [2, 16, 16]\n'
                      'num_classes = 10\ninput_layout = "TN"\n')
    weights = tmp_path / "w.pt"
    torch.save(prepare(build_config({"model": {"builder": f"{ROOT / 'examples' / 'train_own_model.py'}:build",
                                               "input_shape": [2, 16, 16], "num_classes": 10, "input_layout": "TN"}}),
                       1, Plugins()).model.state_dict(), weights)
    status = main(["export", str(weights), "--format", "nir", "--config", str(config), "--out", str(tmp_path / "m.nir")])
    err = capsys.readouterr().err
    assert status == 2 and err.strip().count("\n") == 0
    assert "layer 2 (MaxPool2d) cannot be expressed in NIR" in err and not (tmp_path / "m.nir").exists()


def test_nir_export_needs_the_config(tmp_path, capsys):
    status = main(["export", str(tmp_path), "--format", "nir", "--out", str(tmp_path / "m.nir")])
    assert status == 2 and "--config" in capsys.readouterr().err
