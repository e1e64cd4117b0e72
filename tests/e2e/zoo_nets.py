"""Networks for test_zoo_pipeline: SpikingJelly's zoo SEW-ResNet-18 adapted to 2-channel frames and 10 classes, as a
user's ``model.builder`` builds it, and a network of one's own whose forward flattens before its classifier.

The zoo's modules import torchvision only to download pretrained weights; where it is not installed (its PyPI
wheels do not load beside a CPU torch), that import is given a stand-in that refuses to download.
"""

import importlib.util
import sys
import types

import torch
from spikingjelly.activation_based import functional, layer, neuron, surrogate
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


sew_resnet, spiking_vgg = _zoo_module("sew_resnet"), _zoo_module("spiking_vgg")


def sew_resnet18() -> nn.Module:
    """The zoo's sew_resnet18 (ADD connections, IF neurons) with its first conv taking 2 channels and its fc 10
    classes, in multi-step mode: [T, N, 2, H, W] -> [T, N, 10]."""
    net = sew_resnet.sew_resnet18(spiking_neuron=neuron.IFNode, surrogate_function=surrogate.ATan(),
                                  detach_reset=True, cnf="ADD")
    net.conv1 = layer.Conv2d(2, 64, kernel_size=3, stride=2, padding=1, bias=False)
    net.fc = layer.Linear(net.fc.in_features, 10)
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
