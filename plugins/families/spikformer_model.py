"""The modules of the ``spikformer`` family (imported when a model is built or split)."""

import torch
from torch import nn


class SpikformerNet(nn.Module):
    """Frames ``[N, T, C, H, W]`` -> logits ``[T, N, classes]``; ``net`` is the zoo model."""

    def __init__(self, **kwargs):
        super().__init__()
        from spikingjelly.activation_based.model.spikformer import Spikformer

        self.net = Spikformer(**kwargs)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        return self.net(frames.transpose(0, 1).contiguous())


class MeanOverTokens(nn.Module):
    """``[T, N, C, H, W]`` -> ``[T, N, C]``: the zoo's pooling before the head."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(3).mean(dim=-1)
