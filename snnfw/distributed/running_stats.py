"""BatchNorm running statistics that every strategy updates as one process would.

Left alone, each data-parallel replica updates its BatchNorm running mean and
variance from its own chunk of the batch, and the replicas drift apart (DDP
then copies rank 0's over the others). One process with ``D x M``
microbatches instead applies ``D x M`` running-average updates in the order of
the global batch. :class:`RunningStats` makes every strategy, ``none``
included, do exactly that, in a few ops per step whatever the number of
BatchNorm layers:

- with one replica, each BatchNorm's own kernel updates its running
  statistics in a training step, microbatch after microbatch, as one process
  would;
- with ``D`` replicas, the running statistics are set aside and zeroed when
  a step starts, so that each replica's BatchNorm kernels add up its own
  microbatches' share of the update; at the end of the step
  (:meth:`RunningStats.apply`) the shares of all replicas are gathered in one
  collective and weighed into the statistics set aside, as ``D x M``
  running-average updates in global-batch order would (they are linear in
  the batch statistics: the same up to rounding).

Forward passes outside a step (a strategy's shape probe, memopt's search,
activation recomputation in backward) leave the running statistics alone.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _in_backward() -> bool:
    """True inside an autograd backward pass (activation checkpointing recomputes forwards there).

    Inside a compiled block it is False without asking autograd, which would break the graph."""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


def _batch_norms(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]


class RunningStats:
    """Lets each BatchNorm update its running statistics in training steps only, and merges the replicas' updates.

    Made on the unparallelized ``model``, it guards every BatchNorm at once;
    :meth:`bind` then names the model this rank trains (a pipeline rank holds
    some of the layers), this rank's replica index and the replicas' process
    group (None with one replica).
    """

    def __init__(self, model: nn.Module):
        self.norms = _batch_norms(model)
        self.replica, self.replicas, self.group = 0, 1, None
        self.recording = False
        self.moves_nothing = False  # under a fake process group (the dry run): shares are gathered, not applied
        self._calls: dict[nn.Module, int] = {}  # each norm's training forwards in this step
        self._saved: dict[nn.Module, tuple] = {}
        self._start: torch.Tensor | None = None  # the statistics set aside when the step started, flat
        self._weights: dict[tuple, torch.Tensor] = {}
        for norm in self.norms:
            norm.register_forward_pre_hook(self._before)
            norm.register_forward_hook(self._after)

    def bind(self, model: nn.Module, replica: int, replicas: int, group) -> None:
        self.norms = _batch_norms(model)
        self.replica, self.replicas, self.group = replica, replicas, group
        if group is not None and dist.get_group_rank(group, dist.get_rank()) != replica:
            raise RuntimeError(f"replica {replica} is rank {dist.get_group_rank(group, dist.get_rank())} of its group; "
                               "the running statistics are gathered in replica order")

    def _buffers(self) -> list[torch.Tensor]:
        return [_local(b) for norm in self.norms for b in (norm.running_mean, norm.running_var)]

    @torch.no_grad()
    def start(self) -> None:
        """Begins a training step's microbatches (with several replicas, sets the statistics aside)."""
        self._calls = dict.fromkeys(self.norms, 0)
        self.recording = True
        if self.replicas > 1 and self.norms:
            buffers = self._buffers()
            self._start = torch.cat(buffers)
            torch._foreach_zero_(buffers)

    def _before(self, norm: nn.Module, args) -> None:
        if not norm.training:
            return
        if self.recording and norm in self._calls and not _in_backward():
            self._calls[norm] += 1  # a step's microbatch: the kernel updates the statistics
            return
        # Elsewhere the call updates copies (autograd may keep them for backward), and the buffers are put back.
        self._saved[norm] = (norm.running_mean, norm.running_var, norm.num_batches_tracked)
        norm.running_mean, norm.running_var = norm.running_mean.clone(), norm.running_var.clone()
        norm.num_batches_tracked = norm.num_batches_tracked.clone()

    def _after(self, norm: nn.Module, args, output) -> None:
        if norm in self._saved:
            norm.running_mean, norm.running_var, norm.num_batches_tracked = self._saved.pop(norm)

    @torch.no_grad()
    def apply(self) -> None:
        """Ends the step: with several replicas, weighs every replica's share into the statistics set aside."""
        self.recording = False
        if self.replicas == 1 or not self.norms:
            return
        calls = set(self._calls.values())
        if len(calls) != 1:
            raise RuntimeError(f"BatchNorm layers ran a different number of times in one step: {sorted(calls)}")
        calls, buffers, start = calls.pop(), self._buffers(), self._start
        mine = torch.cat(buffers)
        gathered = mine.new_empty(self.replicas * mine.numel())  # flat: gloo gathers into no other shape
        dist.all_gather_single(gathered, mine, group=self.group)
        gathered = gathered.view(self.replicas, -1)
        if self.moves_nothing:  # the dry run's shares hold no values
            merged = start
        elif len({norm.momentum for norm in self.norms}) == 1:
            merged = self._merged(self.norms[0], calls, start, gathered)
        else:  # one weighing per BatchNorm
            merged, offset = start.clone(), 0
            for norm in self.norms:
                width = 2 * _local(norm.running_mean).numel()
                part = slice(offset, offset + width)
                merged[part] = self._merged(norm, calls, start[part], gathered[:, part])
                offset += width
        torch._foreach_copy_(buffers, merged.split([b.numel() for b in buffers]))
        torch._foreach_add_([norm.num_batches_tracked for norm in self.norms], (self.replicas - 1) * calls)

    def _merged(self, norm: nn.Module, calls: int, start: torch.Tensor, shares: torch.Tensor) -> torch.Tensor:
        """``norm``'s statistics after ``replicas x calls`` updates in global-batch order: ``c * start + w @ shares``
        (a row of ``shares`` per replica: its statistics after its own updates from zero)."""
        weights, keep = self._weighing(norm, calls, start)
        return torch.addmv(start, shares.t(), weights, beta=keep)

    def _weighing(self, norm: nn.Module, calls: int, start: torch.Tensor) -> tuple[torch.Tensor, float]:
        """``(w, c)`` of :meth:`_merged`."""
        if norm.momentum is None:  # a cumulative average: its count so far decides the weights (read once per step)
            before = int(norm.num_batches_tracked) - calls
            total = before + self.replicas * calls
            weights = [(before + calls) / total] * self.replicas
            return torch.tensor(weights, dtype=start.dtype, device=start.device), before / total
        key = (norm.momentum, calls, start.dtype, start.device)
        if key not in self._weights:
            keep = 1.0 - norm.momentum
            self._weights[key] = torch.tensor([keep ** (calls * (self.replicas - 1 - r)) for r in range(self.replicas)],
                                              dtype=start.dtype, device=start.device)
        return self._weights[key], (1.0 - norm.momentum) ** (calls * self.replicas)
