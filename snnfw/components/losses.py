"""Training losses by name (``train.loss``): a registry plugins extend.

A loss takes the model's logits ``[T, N, classes]`` and integer labels, or soft
targets ``[N, classes]`` (class probabilities: ``mixup`` and ``cutmix``), and
returns the mean over the microbatch, which every strategy averages over
microbatches and replicas alike. Plugins register a :class:`LossSpec` under
``snnfw_register_losses``; a ``[train]`` key of another loss is refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import attrs

from snnfw.components.precision import full_precision
from snnfw.config import TrainConfig
from snnfw.errors import ConfigError

if TYPE_CHECKING:
    import torch

LOSS_KEYS = ("label_smoothing", "tet_lambda")
Loss = Callable[["torch.Tensor", "torch.Tensor"], "torch.Tensor"]


@attrs.frozen
class LossSpec:
    """``build(options)`` returns the loss; ``options`` are the ``[train]`` keys it takes, from the config or ``defaults``."""

    build: Callable[[dict[str, Any]], Loss]
    options: tuple[str, ...] = ()
    defaults: dict[str, Any] = attrs.field(factory=dict)


def check_loss(train: TrainConfig, plugins) -> None:
    """Refuses an unknown loss and a loss key it does not take."""
    spec = plugins.losses.get(train.loss)
    for key in LOSS_KEYS:
        if getattr(train, key) is not None and key not in spec.options:
            takes = ", ".join(f"train.{k}" for k in spec.options) or "none of them"
            raise ConfigError(f"train.{key} does not apply to train.loss = {train.loss!r}, which takes {takes}; remove train.{key}")


def training_loss(train: TrainConfig, plugins) -> Loss:
    """The loss ``train.loss`` names, with its options (under fp16 its gradient carries the run's loss scale,
    ``plugins.run.loss_scale``)."""
    spec = plugins.losses.get(train.loss)
    set_keys = {key: getattr(train, key) for key in spec.options if getattr(train, key) is not None}
    loss = spec.build({**spec.defaults, **set_keys})
    if train.precision != "fp16":
        return loss
    scale = plugins.run.loss_scale
    return lambda logits, labels: scale.scaled(loss(logits, labels))


def targets(labels: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Integer labels as they are; soft targets in the dtype of ``like``, the logits they are scored against."""
    return labels.to(like.dtype) if labels.is_floating_point() else labels


def cross_entropy(options: dict[str, Any]) -> Loss:
    """Cross entropy of the time-averaged logits, with ``label_smoothing`` (on soft targets too: they become
    ``(1 - s) * target + s / classes``, as timm smooths mixed targets)."""
    import torch.nn.functional as F

    smoothing = options["label_smoothing"]

    def loss(logits, labels):
        rate = full_precision(logits).mean(0)
        return F.cross_entropy(rate, targets(labels, rate), label_smoothing=smoothing)

    return loss


def next_token(options: dict[str, Any]) -> Loss:
    """A language model's loss: cross entropy of the time-averaged logits ``[T, N, S, vocab]`` against the next
    tokens ``[N, S]``, averaged over the positions. A model may append rows past the ``S`` positions (``[T, N, S + r,
    vocab]``) that carry an auxiliary training loss in column 0 (a mixture of experts' load balancing), the same
    for every sample: their mean over the time steps is added."""
    import torch.nn.functional as F

    def loss(logits, labels):
        logits, length = full_precision(logits), labels.shape[-1]
        rate = logits[:, :, :length].mean(0)
        scored = F.cross_entropy(rate.flatten(0, -2), labels.flatten())
        if logits.shape[2] == length:
            return scored
        return scored + logits[:, :, length:, 0].mean(0).sum(-1).mean()

    return loss


def mse_rate(options: dict[str, Any]) -> Loss:
    """Mean squared error between the time-averaged output and one-hot targets (SpikingJelly's tutorial loss)."""
    import torch.nn.functional as F

    def loss(logits, labels):
        rate = full_precision(logits).mean(0)
        target = labels if labels.is_floating_point() else F.one_hot(labels, rate.shape[-1])
        return F.mse_loss(rate, target.to(rate.dtype))

    return loss


def tet(options: dict[str, Any]) -> Loss:
    """TET's loss (Deng et al., ICLR 2022): cross entropy at every time step, averaged, with ``tet_lambda``
    of the mean squared distance of the logits from 1 (SpikingJelly's TETLoss: ``(1 - l) * ce + l * mse``)."""
    import torch
    import torch.nn.functional as F

    weight = options["tet_lambda"]

    def loss(logits, labels):
        logits = full_precision(logits)
        steps = logits.shape[0]
        per_step = F.cross_entropy(logits.flatten(0, 1), targets(labels, logits).repeat(steps, *[1] * (labels.dim() - 1)))
        return (1 - weight) * per_step + weight * F.mse_loss(logits, torch.ones_like(logits))

    return loss
