"""NIR export: the graph read back and simulated step by step gives the model's spikes; what NIR lacks is refused."""

import json
import sys
from pathlib import Path

import nir
import pytest
import torch
from torch import nn

from snnfw.cli import main
from snnfw.components import nir_forward
from snnfw.components.nir_export import layers, simulate, to_nir
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
    chain = [name for name, _ in layers(model)]
    want, outputs = nir_forward.run(model, frames, chain, set(chain))
    got, simulated = simulate(graph, frames.transpose(0, 1))
    neurons = [name for name, node in graph.nodes.items() if isinstance(node, (nir.LIF, nir.IF))]
    assert neurons and set(neurons) <= set(outputs)
    for name in neurons:
        assert outputs[name].sum() > 0, name
        assert torch.equal(simulated[name], outputs[name]), name
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


def test_weights_of_no_recorded_run_need_the_config(tmp_path, capsys):
    torch.save(trained_like(family("cifar10dvs_vgg")).float().state_dict(), tmp_path / "w.pt")
    status = main(["export", str(tmp_path / "w.pt"), "--format", "nir", "--out", str(tmp_path / "m.nir")])
    assert status == 2 and capsys.readouterr().err.splitlines() == [
        f"snnfw: error: {tmp_path} holds neither summary.json nor plan.json, which record the config of the run that "
        "wrote the weights; pass its config with --config CONFIG"]


class Residual(nn.Module):
    """``x + LIF(Linear(x))``: a spiking layer with a residual add around it."""

    def __init__(self, width: int):
        super().__init__()
        from spikingjelly.activation_based import layer, neuron

        self.fc, self.lif = layer.Linear(width, width), neuron.LIFNode(tau=2.0)

    def forward(self, x):
        return x + self.lif(self.fc(x))


def residual() -> nn.Module:
    """Flatten, Linear-LIF, a residual block, Linear."""
    from spikingjelly.activation_based import functional, layer, neuron

    net = nn.Sequential(layer.Flatten(), layer.Linear(2 * 16 * 16, 32), neuron.LIFNode(tau=2.0), Residual(32),
                        layer.Linear(32, 10))
    functional.set_step_mode(net, "m")
    return net


def silent() -> nn.Module:
    """A chain NIR expresses whose first neurons never fire (threshold 1e12): its check would compare silence."""
    from spikingjelly.activation_based import functional, layer, neuron

    net = nn.Sequential(layer.Flatten(), layer.Linear(2 * 16 * 16, 32), neuron.LIFNode(tau=2.0, v_threshold=1e12),
                        layer.Linear(32, 16), neuron.LIFNode(tau=2.0), layer.Linear(16, 10))
    functional.set_step_mode(net, "m")
    return net


def export_own(tmp_path, builder: str) -> int:
    """``snnfw export --format nir`` of the model ``builder`` of this file, as built, through the command."""
    model = {"builder": f"{__file__}:{builder}", "input_shape": [2, 16, 16], "num_classes": 10, "input_layout": "TN",
             "time_steps": T}
    config = tmp_path / "own.toml"
    config.write_text("[model]\n" + "".join(f"{key} = {json.dumps(value)}\n" for key, value in model.items())
                      + '[data]\nname = "synthetic_dvs"\n')
    weights = tmp_path / "w.pt"
    torch.save(prepare(build_config({"model": model, "data": {"name": "synthetic_dvs"}}), 1, Plugins()).model.state_dict(),
               weights)
    return main(["export", str(weights), "--format", "nir", "--config", str(config), "--out", str(tmp_path / "m.nir")])


def test_a_residual_add_is_refused_by_name(tmp_path, capsys):
    status = export_own(tmp_path, "residual")
    err = capsys.readouterr().err
    assert status == 2 and err.strip().count("\n") == 0, err
    assert "layer 3 (Residual) adds a residual in its forward (add)" in err
    assert not (tmp_path / "m.nir").exists()


def test_a_network_that_never_fires_is_refused(tmp_path, capsys):
    status = export_own(tmp_path, "silent")
    err = capsys.readouterr().err
    assert status == 2 and err.strip().count("\n") == 0, err
    assert "no input makes layer 2 (LIFNode) fire" in err
    assert not (tmp_path / "m.nir").exists()


class Twice(nn.Module):
    """One Linear run twice (shared weights)."""

    def __init__(self):
        super().__init__()
        from spikingjelly.activation_based import layer

        self.fc = layer.Linear(8, 8)

    def forward(self, x):
        return self.fc(self.fc(x))


class Doubled(nn.Module):
    """A spiking layer whose spikes the forward doubles."""

    def __init__(self):
        super().__init__()
        from spikingjelly.activation_based import layer, neuron

        self.fc, self.lif = layer.Linear(8, 8), neuron.LIFNode()

    def forward(self, x):
        return 2 * self.lif(self.fc(x))


class Swapped(nn.Module):
    """A spiking layer whose neuron the forward runs over the samples instead of the time steps."""

    def __init__(self):
        super().__init__()
        from spikingjelly.activation_based import layer, neuron

        self.fc, self.lif = layer.Linear(8, 8), neuron.LIFNode()

    def forward(self, x):
        return self.lif(self.fc(x).transpose(0, 1)).transpose(0, 1)


def around(*middle: nn.Module) -> nn.Module:
    """Flatten, Linear(32, 8), ``middle``, Linear(8, 3), in multi-step mode, taking snnfw's [N, T, ...] frames."""
    from spikingjelly.activation_based import functional, layer

    from snnfw.model.source import time_major_input

    net = nn.Sequential(layer.Flatten(), layer.Linear(32, 8), *middle, layer.Linear(8, 3))
    functional.set_step_mode(net, "m")
    time_major_input(net)
    return net


@pytest.mark.parametrize("middle, refusal", [
    (lambda n: [n.LIFNode(v_reset=None)], "layer 2 (LIFNode) cannot be expressed in NIR: a soft reset"),
    (lambda n: [n.LIAFNode(act=nn.ReLU(), threshold_related=False)], "layer 2 (LIAFNode) cannot be expressed in NIR: NIR has SpikingJelly's "
                                            "LIFNode, ParametricLIFNode and IFNode"),
    (lambda n: [n.LIFNode(surrogate_function=__import__("spikingjelly.activation_based.surrogate",
                                                         fromlist=["ATan"]).ATan(spiking=False))],
     "layer 2 (LIFNode) cannot be expressed in NIR: its surrogate function has spiking=False"),
    (lambda n: [nn.BatchNorm1d(8, track_running_stats=False), n.LIFNode()],
     "layer 2 (BatchNorm1d) cannot be expressed in NIR: without running statistics"),
    (lambda n: [Twice()], "layer 2.fc (Linear) runs 2 times in the model's forward"),
    (lambda n: [Doubled()], "layer 2 (Doubled) computes in its forward (mul)"),
    (lambda n: [Swapped()], "the NIR graph does not give the output of layer 2.lif (LIFNode) on inputs on which every "
                            "layer fires"),
], ids=["soft_reset", "liaf", "analog_surrogate", "batch_statistics", "shared_layer", "scaled_spikes", "swapped"])
def test_what_the_graph_would_drop_is_refused_by_name(tmp_path, middle, refusal):
    from spikingjelly.activation_based import neuron

    from snnfw.components.nir_export import export
    from snnfw.errors import CheckpointError

    torch.manual_seed(0)
    frames = torch.rand(2, T, 2, 4, 4) * 8
    with pytest.raises(CheckpointError) as refused:
        export(around(*middle(neuron)), frames, tmp_path / "m.nir")
    assert refusal in str(refused.value) and "\n" not in str(refused.value)
    assert not (tmp_path / "m.nir").exists()


def test_inputs_are_searched_until_every_layer_fires(tmp_path):
    """Test frames on which nothing fires (zeros, and no bias): random frames scaled up are added until both
    neuron layers fire, and the graph written is checked on them."""
    from spikingjelly.activation_based import layer, neuron

    from snnfw.components.nir_export import export

    torch.manual_seed(0)
    net = around(neuron.LIFNode(v_threshold=4.0), layer.Linear(8, 8, bias=False), neuron.LIFNode())
    net[1].bias.data.zero_()
    net[3].weight.data.fill_(0.5)  # eight spikes in cross the second threshold
    graph, checked = export(net, torch.zeros(2, T, 2, 4, 4), tmp_path / "m.nir")
    assert checked.test == 2 and checked.samples > 2 and checked.scale >= 4 and checked.spikes > 0
    assert checked.layers == 6 and nir.read(str(tmp_path / "m.nir")).metadata["dt"] == 1e-4


def test_snntorch_reads_the_quickstart_export_as_snnfw_runs_it(tmp_path, capsys):
    """snntorch's importer (``snntorch.import_nir.import_from_nir``) builds the quickstart's network from its NIR
    export: fed one sample at a time (its Flatten folds a batch away), one time step a call, it gives snnfw's logits
    within 1e-6 and every spike of every neuron layer, on the first test samples, on which every layer fires."""
    import snntorch.utils
    from snntorch.import_nir import import_from_nir

    from snnfw.components.nir_export import _neuron_kind, export
    from snnfw.config import load_config
    from snnfw.data import batches as datalib
    from snnfw.plan.prepare import build_datasets, build_model

    config = load_config(ROOT / "examples" / "quickstart.toml")
    model, spec = build_model(config, Plugins())
    model = trained_like(model).float()
    frames = datalib.load(build_datasets(config, spec, Plugins())[1], torch.arange(4), torch.device("cpu"))[0]
    export(model, frames, tmp_path / "q.nir")
    imported = import_from_nir(nir.read(str(tmp_path / "q.nir")))  # prints its threshold scaling: r*dt/tau = 1/tau
    capsys.readouterr()

    chain = [name for name, _ in layers(model)]
    neurons = [name for name, module in layers(model) if _neuron_kind(module)]
    want, outputs = nir_forward.run(model, frames, chain, set(chain))
    recorded = {}
    for name in neurons:
        imported.get_submodule(name.replace(".", "_")).register_forward_hook(
            lambda module, args, out, name=name: recorded[name].append(out))
    logits, spikes = [], {name: [] for name in neurons}
    for sample in frames:
        snntorch.utils.reset(imported)
        recorded.update({name: [] for name in neurons})
        with torch.no_grad():
            logits.append(torch.stack([imported(frame)[0] for frame in sample]).mean(0))
        for name in neurons:
            spikes[name].append(torch.stack(recorded[name]))
    assert len(neurons) == 8
    for name in neurons:
        assert outputs[name].sum() > 0, f"layer {name} does not fire: its spikes compare nothing"
        assert torch.equal(torch.stack(spikes[name], 1), outputs[name]), name
    assert (torch.stack(logits) - want.mean(0)).abs().max() <= 1e-6


def test_r_is_folded_into_the_synapse_and_dt_is_in_the_metadata(tmp_path):
    """Readers that take a neuron's r as 1 (norse) lose nothing: every neuron of the VGG follows a Conv or Linear,
    which carries its r; the time step is the graph's metadata["dt"]; the graph still gives the model's spikes."""
    model = trained_like(family("cifar10dvs_vgg"))
    nir.write(str(tmp_path / "m.nir"), to_nir(model, (2, 32, 32)))
    graph = nir.read(str(tmp_path / "m.nir"))
    neurons = {name: node for name, node in graph.nodes.items() if isinstance(node, (nir.LIF, nir.IF))}
    assert len(neurons) == 8 and all((node.r == 1).all() for node in neurons.values())
    assert graph.metadata["dt"] == 1e-4 and all((node.tau == 1.333 * 1e-4).all() for node in neurons.values())
    frames = (torch.rand(2, T, 2, 32, 32, generator=torch.Generator().manual_seed(0)) < 0.3).double()
    chain = [name for name, _ in layers(model)]
    outputs = nir_forward.run(model, frames, chain, set(chain))[1]
    simulated = simulate(graph, frames.transpose(0, 1))[1]
    assert all(outputs[name].any() and torch.equal(simulated[name], outputs[name]) for name in neurons)
