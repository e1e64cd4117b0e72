"""The spiking MLP of the ``sequence_mlp`` family (imported when a model is built)."""

import torch
from torch import nn


class ChannelSequence(nn.Module):
    """Frames ``[N, T, C, H, W]`` -> ``[T, N, C*H*W, 1]``: each time step's values as channels of length 1."""

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        return frames.transpose(0, 1).flatten(2).unsqueeze(-1).contiguous()


class SequenceMLP(nn.Module):
    """Frames ``[N, T, C, H, W]`` -> logits ``[T, N, classes]`` in multi-step mode: blocks of a 1x1 Conv1d (a
    Linear over the channels, so tp shards it by output channel as it shards a convolution), BatchNorm and LIF,
    then a Linear head."""

    def __init__(self, in_features: int, widths: tuple[int, ...], num_classes: int, tau: float = 2.0):
        super().__init__()
        from spikingjelly.activation_based import functional, layer, neuron, surrogate

        self.to_channels = ChannelSequence()
        blocks, channels = [], in_features
        for width in widths:
            lif = neuron.LIFNode(tau=tau, detach_reset=True, surrogate_function=surrogate.ATan(), step_mode="m")
            blocks.append(nn.Sequential(layer.Conv1d(channels, width, 1, bias=False), layer.BatchNorm1d(width), lif))
            channels = width
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Sequential(nn.Flatten(2), nn.Linear(channels, num_classes))
        functional.set_step_mode(self, "m")

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.to_channels(frames)))
