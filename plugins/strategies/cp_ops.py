"""What ``cp`` changes in a model: each rank of a sequence group runs its consecutive slice of the positions, exactly.

- The data loader hands rank k positions k S/P to (k+1) S/P - 1 of every sample's token ids and next tokens
  (``snnfw_sequence_view``); the token embedding adds the positions' own embeddings (its ``first_position``).
- Causal attention: each layer's keys and values ``[T, N, heads, S/P, d]`` are all-gathered over the group in one
  collective (:class:`GatherKeysValues`), and rank k keeps those of positions 0 to (k+1) S/P - 1, its queries being
  the last of them (the family's attention masks by that offset). Backward reduce-scatters their gradients, summed
  over the ranks whose queries read them.
- A mixture of experts' load-balancing loss, a nonlinear function of each step's token means over the whole
  sequence, takes those means all-reduced over the group (:class:`MeanOverGroup`), so every rank holds the same
  loss.
- Neurons act on each position alone (their state is per position): nothing to change.

Every rank's loss is then the mean over its positions (plus the same balance loss): the average over the group, the
core's gradient average over a replicated dimension and the world's weighted mean of the reported losses, is the
whole sequence's.
"""

from __future__ import annotations

import contextlib
import time as clock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class CommCounter:
    """Bytes this rank received from its sequence peers since the last ``take()``: (P - 1) / P of each all-gathered
    and reduce-scattered tensor (a ring's share), 2 (P - 1) / P of each all-reduced one; and, where ``timed``
    (``log.phase_times``), the host time spent in those collectives."""

    def __init__(self, timed: bool = False):
        self.timed, self.bytes, self.seconds = timed, 0.0, 0.0

    @contextlib.contextmanager
    def collective(self, whole: torch.Tensor, share: float):
        self.bytes += share * whole.numel() * whole.element_size()
        started = clock.perf_counter()
        try:
            yield
        finally:
            self.seconds += clock.perf_counter() - started

    def take(self) -> dict[str, float]:
        out = {"cp_comm_mb": self.bytes / 2**20, **({"cp_exchange_ms": self.seconds * 1e3} if self.timed else {})}
        self.bytes = self.seconds = 0.0
        return out


class SequenceGroup:
    """This rank's place among the ``size`` ranks that split the positions of the same samples."""

    def __init__(self, group, timed: bool = False):
        self.group, self.counter = group, CommCounter(timed)
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)


def sequence_slice(length: int, rank: int, size: int) -> slice:
    """The positions that the ``rank``-th of ``size`` ranks of a sequence group runs, of ``length``."""
    part = length // size
    return slice(rank * part, (rank + 1) * part)


class GatherKeysValues(torch.autograd.Function):
    """``[..., L, c]`` on each rank -> ``[..., (k + 1) L, c]`` on rank k: every rank's positions up to its own, in
    order; backward sums each rank's gradient of them into the ranks that hold them (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, sequence: SequenceGroup) -> torch.Tensor:
        ctx.sequence, ctx.shape = sequence, local.shape
        gathered = local.new_empty(sequence.size * local.numel())
        with sequence.counter.collective(gathered, (sequence.size - 1) / sequence.size):
            dist.all_gather_single(gathered, local.reshape(-1), group=sequence.group)
        kept = gathered.view(sequence.size, *local.shape)[: sequence.rank + 1]  # [k + 1, ..., L, c]
        return kept.movedim(0, -3).flatten(-3, -2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        sequence, shape = ctx.sequence, ctx.shape
        length = shape[-2]
        whole = F.pad(grad, (0, 0, 0, (sequence.size - sequence.rank - 1) * length))  # zeros past this rank's positions
        parts = whole.unflatten(-2, (sequence.size, length)).movedim(-3, 0).reshape(-1)
        mine = grad.new_empty(shape)
        with sequence.counter.collective(parts, (sequence.size - 1) / sequence.size):
            dist.reduce_scatter_single(mine.view(-1), parts, group=sequence.group)
        return mine, None


class MeanOverGroup(torch.autograd.Function):
    """The mean of ``x`` over the group's ranks (each rank's mean over its tokens, of equal counts: the mean over
    all); backward all-reduces the gradient and divides it alike."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sequence: SequenceGroup) -> torch.Tensor:
        ctx.sequence = sequence
        return _mean(x.clone(), sequence)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _mean(grad.clone(), ctx.sequence), None


def _mean(x: torch.Tensor, sequence: SequenceGroup) -> torch.Tensor:
    with sequence.counter.collective(x, 2 * (sequence.size - 1) / sequence.size):
        dist.all_reduce(x, group=sequence.group)
    return x / sequence.size


def split_sequence(model: nn.Module, sequence: SequenceGroup, length: int) -> None:
    """Applies the changes the module docstring lists to ``model`` (of ``length`` positions), in place."""
    first = sequence_slice(length, sequence.rank, sequence.size).start
    for module in model.modules():
        if hasattr(module, "first_position"):
            module.first_position = first
        if hasattr(module, "keys_values"):
            module.keys_values = _gathered_keys_values(module.keys_values, sequence)
        if hasattr(module, "token_means"):
            module.token_means = _means_over_group(module.token_means, sequence)


def _gathered_keys_values(keys_values, sequence: SequenceGroup):
    """``keys_values`` whose k and v ``[T, N, heads, L, d]`` hold every position up to this rank's last, gathered in
    one collective."""

    def gathered(spikes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = keys_values(spikes)
        return GatherKeysValues.apply(torch.cat([k, v], -1), sequence).chunk(2, -1)

    return gathered


def _means_over_group(token_means, sequence: SequenceGroup):
    def means(values: torch.Tensor) -> torch.Tensor:
        return MeanOverGroup.apply(token_means(values), sequence)

    return means
