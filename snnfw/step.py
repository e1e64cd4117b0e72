"""What one rank computes in a training or evaluation step; the losses are in :mod:`snnfw.losses`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    import torch


@attrs.frozen
class StepOutput:
    """One rank's share of a step.

    ``loss`` is the mean loss over the ``samples`` whose loss this rank holds
    (0 samples on a pipeline stage without the loss); ranks that hold the same
    samples (tensor-parallel peers) each report them, which the weighted mean
    over ranks absorbs.
    """

    loss: float
    correct: int
    samples: int


def count_correct(logits: torch.Tensor, labels: torch.Tensor) -> int:
    return int((logits.mean(0).argmax(1) == labels).sum())
