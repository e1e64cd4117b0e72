"""What one rank computes in a training or evaluation step; the losses are in :mod:`snnfw.components.losses`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import attrs

from snnfw.components.phases import PhaseTimes
from snnfw.components.precision import LossScale

if TYPE_CHECKING:
    import torch


@attrs.frozen
class RunState:
    """What one trainer's steps carry from one to the next: the clock of its phases, fp16's loss scale, what
    plugins keep for the run (``kept``, by plugin name), and where its ranks build only their shards from a
    recorded build, each tensor's initial value by name (``initial``) and ``materialize(module)``, which gives the
    parallelized meta model storage and its initial values once (a wrapper that reads the parameters as it wraps
    them, such as DistributedDataParallel, calls it first; else the trainer after parallelizing). Hooks see it as
    ``hooks.run``."""

    phases: PhaseTimes
    loss_scale: LossScale
    kept: dict = attrs.field(factory=dict)
    initial: Callable[[str], torch.Tensor] | None = None
    materialize: Callable[[torch.nn.Module], None] | None = None


@attrs.frozen
class StepOutput:
    """One rank's share of a step.

    ``loss`` is the mean loss over the ``samples`` whose loss this rank holds
    (0 samples on a pipeline stage without the loss); ranks that hold the same
    samples (tensor-parallel peers) each report them, which the weighted mean
    over ranks absorbs. A training step's ``loss`` and ``correct`` may be
    tensors on the device, which the trainer reads when the step logs.
    """

    loss: float | torch.Tensor
    correct: int | torch.Tensor
    samples: int
    top5: int = 0  # samples whose label is among the 5 largest logits (evaluation)
    logits: torch.Tensor | None = None  # evaluation: the time-averaged logits [N, classes], on the CPU


def hits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """How many samples the time-averaged ``logits`` classify right, on their device (reading it waits for it);
    against a soft target (mixup, cutmix), its largest class. A language model's sample (labels ``[N, S]``) counts
    the share of its positions whose next token is the largest logit (rows past the labels' S, a training loss
    the model carries, are not scored)."""
    if labels.is_floating_point():
        labels = labels.argmax(-1)
    return _per_sample(positions(logits, labels).mean(0).argmax(-1) == labels).sum()


def positions(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``logits`` ``[T, N, classes]``, or a language model's ``[T, N, S, vocab]`` cut to the labels' S positions."""
    return logits[:, :, : labels.shape[-1]] if labels.dim() > 1 and not labels.is_floating_point() else logits


def _per_sample(right: torch.Tensor) -> torch.Tensor:
    """``right`` ``[N]``, or ``[N, S]`` per position: each sample's share of right answers."""
    return right if right.dim() == 1 else right.flatten(1).double().mean(1)


def scored(logits: torch.Tensor, labels: torch.Tensor, loss_of) -> StepOutput:
    """An evaluation batch's mean loss (``loss_of``), top-1 and top-5 counts from logits ``[T, N, classes]`` (a
    language model's ``[T, N, S, vocab]``: each sample's share of positions)."""
    rate = positions(logits, labels).mean(0)
    top5 = rate.topk(min(5, rate.shape[-1]), dim=-1).indices
    return StepOutput(
        loss=float(loss_of(logits, labels)), correct=float(hits(logits, labels)), samples=len(labels),
        top5=float(_per_sample((top5 == labels.unsqueeze(-1)).any(-1)).sum()), logits=rate.detach().cpu(),
    )
