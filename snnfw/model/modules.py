"""Small torch modules that plugins compose, such as the glue before a pipeline's first unit."""

import torch
from torch import nn


class TimeMajor(nn.Module):
    """Frames ``[N, T, ...]`` -> ``[T, N, ...]``, contiguous: the glue before a family's first unit."""

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        return frames.transpose(0, 1).contiguous()
