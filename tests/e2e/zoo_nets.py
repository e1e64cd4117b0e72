"""Networks for test_zoo_pipeline and test_zoo_tp: SpikingJelly's zoo networks adapted to 2-channel frames and 10
classes (ResNet-18s, VGG-11, as a user's ``model.builder`` builds them) or made small, and a network of one's own
whose forward flattens before its classifier.

The zoo's modules import torchvision only to download pretrained weights; where it is not installed (its PyPI
wheels do not load beside a CPU torch), that import is given a stand-in that refuses to download.
"""

import importlib.util
import sys
import types

import torch
from spikingjelly.activation_based import functional, layer, neuron, surrogate
from spikingjelly.activation_based.model import parametric_lif_net
from torch import nn


def _zoo_module(name: str) -> types.ModuleType:
    """The zoo's module ``name``, imported beside a stand-in for torchvision where it is not installed; the stand-in
    leaves with the import, so that nothing else sees it."""
    path = f"spikingjelly.activation_based.model.{name}"
    if "torchvision" in sys.modules or importlib.util.find_spec("torchvision") is not None:
        return importlib.import_module(path)

    def load_state_dict_from_url(*args, **kwargs):
        raise RuntimeError("no torchvision here: pretrained weights cannot be downloaded")

    stand_in = ("torchvision", "torchvision.models", "torchvision.models.utils")
    for module in stand_in:
        sys.modules[module] = types.ModuleType(module)
    sys.modules["torchvision.models.utils"].load_state_dict_from_url = load_state_dict_from_url
    try:
        return importlib.import_module(path)
    finally:
        for module in stand_in:
            del sys.modules[module]


sew_resnet, spiking_resnet, spiking_vgg = (_zoo_module(name) for name in ("sew_resnet", "spiking_resnet", "spiking_vgg"))


def sew_resnet18() -> nn.Module:
    """The zoo's sew_resnet18 (ADD connections, IF neurons) with its first conv taking 2 channels and its fc 10
    classes, in multi-step mode: [T, N, 2, H, W] -> [T, N, 10]."""
    net = sew_resnet.sew_resnet18(spiking_neuron=neuron.IFNode, surrogate_function=surrogate.ATan(),
                                  detach_reset=True, cnf="ADD")
    net.conv1 = layer.Conv2d(2, 64, kernel_size=3, stride=2, padding=1, bias=False)
    net.fc = layer.Linear(net.fc.in_features, 10)
    functional.set_step_mode(net, "m")
    return net


def spiking_resnet18() -> nn.Module:
    """The zoo's spiking_resnet18, adapted as ``sew_resnet18``."""
    net = spiking_resnet.spiking_resnet18(spiking_neuron=neuron.IFNode, surrogate_function=surrogate.ATan(),
                                          detach_reset=True)
    net.conv1 = layer.Conv2d(2, 64, kernel_size=3, stride=2, padding=1, bias=False)
    net.fc = layer.Linear(net.fc.in_features, 10)
    functional.set_step_mode(net, "m")
    return net


def spiking_vgg11() -> nn.Module:
    """The zoo's spiking_vgg11 (129M parameters, 120M of them in its classifier) with its first conv taking 2 channels
    and its last fc 10 classes, in multi-step mode: [T, N, 2, H, W] -> [T, N, 10], H and W 32 or more. Its IF neurons
    fire at 0.1, so that with no BatchNorm the spikes reach the classifier (at 1 none fire past the fourth conv)."""
    net = spiking_vgg.spiking_vgg11(spiking_neuron=neuron.IFNode, surrogate_function=surrogate.ATan(),
                                    detach_reset=True, v_threshold=0.1)
    net.features[0] = layer.Conv2d(2, 64, kernel_size=3, padding=1)
    net.classifier[-1] = layer.Linear(net.classifier[-1].in_features, 10)
    functional.set_step_mode(net, "m")
    return net


def narrow_spiking_vgg11(dropout: float = 0.5) -> nn.Module:
    """The zoo's SpikingVGG in ``spiking_vgg11``'s layout (its eight convs with IF neurons at 0.1, five poolings and
    classifier Linear, IF, Dropout, Linear, IF, Dropout, Linear), each conv a sixteenth as wide and the classifier 32
    wide: 83k parameters, not 129M, initialized by the zoo's own ``_initialize_weights``."""
    kwargs = {"surrogate_function": surrogate.ATan(), "detach_reset": True, "v_threshold": 0.1}
    widths = [v if v == "M" else v // 16 for v in spiking_vgg.cfgs["A"]]
    with torch.device("meta"):  # the zoo's classifier (120M parameters), replaced below
        net = spiking_vgg.SpikingVGG(widths, spiking_neuron=neuron.IFNode, num_classes=10, **kwargs)
    net.features[0] = layer.Conv2d(2, widths[0], kernel_size=3, padding=1)
    net.classifier = nn.Sequential(layer.Linear(widths[-2] * 7 * 7, 32), neuron.IFNode(**kwargs), layer.Dropout(dropout),
                                   layer.Linear(32, 32), neuron.IFNode(**kwargs), layer.Dropout(dropout),
                                   layer.Linear(32, 10))
    net.to_empty(device="cpu")
    net._initialize_weights()
    functional.set_step_mode(net, "m")
    return net


def narrow_spiking_vgg11_without_dropout() -> nn.Module:
    """``narrow_spiking_vgg11`` with its classifier's dropouts at p = 0: pp draws no dropout mask as none does (its
    ranks' random state at the first step is not none's)."""
    return narrow_spiking_vgg11(dropout=0.0)


def small_spiking_vgg() -> nn.Module:
    """The zoo's SpikingVGG (built on the meta device: its classifier has 120M parameters) with one conv of 512
    channels taking 2, and a classifier small enough to test, its layers in the zoo's order."""
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


def small_dvs_gesture_net() -> nn.Module:
    """The PLIF paper's DVS128 Gesture network (``examples/recipes/nets.py``) with 8 channels, not 128."""
    net = parametric_lif_net.DVSGestureNet(channels=8, spiking_neuron=neuron.LIFNode,
                                           surrogate_function=surrogate.ATan(), detach_reset=True)
    functional.set_step_mode(net, "m")
    return net


class PooledNet(nn.Module):
    """Conv-BN-IF, average pooling, and a classifier that its forward reaches through torch.flatten(x, 2)."""

    def __init__(self):
        super().__init__()
        self.conv = layer.Conv2d(2, 8, kernel_size=3, padding=1, bias=False)
        self.bn = layer.BatchNorm2d(8)
        self.sn = neuron.IFNode(surrogate_function=surrogate.ATan(), detach_reset=True)
        self.pool = layer.AdaptiveAvgPool2d((2, 2))
        self.fc = layer.Linear(32, 10)
        functional.set_step_mode(self, "m")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.sn(self.bn(self.conv(x)))), 2))


class ZooBlocksNet(nn.Module):
    """A stem, the zoo's spiking_resnet BasicBlock (its add before its last neuron) and sew_resnet Bottleneck (conv3
    after the pair), each with 16 channels, and a classifier: ``residual_conv_pair`` on both kinds of block, small."""

    def __init__(self):
        super().__init__()
        kwargs = {"spiking_neuron": neuron.IFNode, "surrogate_function": surrogate.ATan(), "detach_reset": True}
        self.stem = nn.Sequential(layer.Conv2d(2, 16, kernel_size=3, padding=1, bias=False), layer.BatchNorm2d(16),
                                  neuron.IFNode(surrogate_function=surrogate.ATan(), detach_reset=True))
        self.basic = spiking_resnet.BasicBlock(16, 16, **kwargs)
        self.bottleneck = sew_resnet.Bottleneck(16, 4, cnf="ADD", **kwargs)
        self.pool = layer.AdaptiveAvgPool2d((1, 1))
        self.fc = layer.Linear(16, 10)
        functional.set_step_mode(self, "m")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.bottleneck(self.basic(self.stem(x)))), 2))
