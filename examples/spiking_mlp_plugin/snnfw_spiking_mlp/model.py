"""The spiking MLP's modules, imported when a model is built (not when snnfw loads the plugin)."""

import math

import torch
from torch import nn


def plif():
    from spikingjelly.activation_based import neuron, surrogate

    return neuron.ParametricLIFNode(
        init_tau=2.0, decay_input=False, detach_reset=True, surrogate_function=surrogate.ATan(), step_mode="m"
    )


class MLPBlock(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        from spikingjelly.activation_based import layer

        self.fc1 = layer.Linear(dim, hidden, step_mode="m")
        self.lif1 = plif()
        self.fc2 = layer.Linear(hidden, dim, step_mode="m")
        self.lif2 = plif()

    def forward(self, x):
        return self.lif2(self.fc2(self.lif1(self.fc1(x))))


class SpikingMLP(nn.Module):
    """Frames ``[N, T, C, H, W]`` -> logits ``[T, N, classes]``."""

    def __init__(self, in_features: int, dim: int, hidden: int, depth: int, classes: int):
        super().__init__()
        from spikingjelly.activation_based import layer

        self.encoder = nn.Sequential(layer.Linear(in_features, dim, step_mode="m"), plif())
        self.blocks = nn.Sequential(*(MLPBlock(dim, hidden) for _ in range(depth)))
        self.head = layer.Linear(dim, classes, step_mode="m")
        for module in self.modules():  # wide enough that sparse spike inputs cross the threshold
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=3.0 / math.sqrt(module.in_features))

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        x = frames.transpose(0, 1).flatten(2)
        return self.head(self.blocks(self.encoder(x)))
