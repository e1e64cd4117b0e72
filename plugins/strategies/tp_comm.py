"""Autograd-aware collectives of tensor parallelism, with per-step counters.

Tensors that flow between tensor-parallel units are replicated on every rank
of the ``tp`` group, and so are their gradients. Inside a unit they are
sharded. Three functions cross the boundary:

- ``copy_in``: a replicated input entering a sharded unit (backward sums the
  partial input gradients with an all-reduce);
- ``reduce_out``: partial sums leaving a row-parallel layer (forward all-reduce);
- ``gather_out``: a channel shard leaving a unit (forward all-gather, backward
  keeps this rank's slice of the replicated gradient).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class CommCounter:
    """Collective calls and bytes since the last ``take()``."""

    def __init__(self):
        self.all_reduce = self.all_gather = 0
        self.bytes = 0

    def take(self) -> dict[str, float]:
        out = {"tp_allreduce_calls": self.all_reduce, "tp_allgather_calls": self.all_gather, "tp_comm_mb": self.bytes / 2**20}
        self.__init__()
        return out


COUNTER = CommCounter()


def _all_reduce(tensor: torch.Tensor, group) -> torch.Tensor:
    COUNTER.all_reduce += 1
    COUNTER.bytes += tensor.numel() * tensor.element_size()
    dist.all_reduce(tensor, group=group)
    return tensor


class _CopyIn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.contiguous().clone(), ctx.group), None


class _ReduceOut(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherOut(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        size = dist.get_world_size(group)
        ctx.dim, ctx.local, ctx.rank = dim, x.shape[dim], dist.get_rank(group)
        parts = [torch.empty_like(x) for _ in range(size)]
        COUNTER.all_gather += 1
        COUNTER.bytes += x.numel() * x.element_size() * size
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        return grad.narrow(ctx.dim, ctx.rank * ctx.local, ctx.local).contiguous(), None, None


def copy_in(x: torch.Tensor, group) -> torch.Tensor:
    return _CopyIn.apply(x, group)


def reduce_out(x: torch.Tensor, group) -> torch.Tensor:
    return _ReduceOut.apply(x, group)


def gather_out(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    return _GatherOut.apply(x, group, dim)
