"""Autograd-aware collectives of tensor parallelism, with per-step counters.

Tensors that flow between tensor-parallel units are replicated on every rank
of the ``tp`` group, and so are their gradients. Inside a unit they are
sharded. Three functions cross the boundary:

- ``copy_in``: a replicated input entering a sharded unit (backward sums the
  partial input gradients with an all-reduce);
- ``reduce_out``: partial sums leaving a row-parallel layer (forward all-reduce);
- ``gather_out``: a channel shard leaving a unit (forward all-gather, in int8
  when the shard holds spikes; backward keeps this rank's slice of the
  replicated gradient).

Units that torch's DTensor styles parallelize (``ColwiseParallel`` then
``RowwiseParallel``) run DTensor's own collectives; :func:`count_dtensor_mlp`
counts them into the same counters.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class CommCounter:
    """Collective calls and bytes of tensor parallelism since the last ``take()``, per rank."""

    def __init__(self):
        self.all_reduce = self.all_gather = 0
        self.bytes = 0

    def take(self) -> dict[str, float]:
        out = {"tp_allreduce_calls": self.all_reduce, "tp_allgather_calls": self.all_gather, "tp_comm_mb": self.bytes / 2**20}
        self.__init__()
        return out


COUNTER = CommCounter()


def all_reduce(tensor: torch.Tensor, group) -> torch.Tensor:
    """An in-place sum over ``group``, counted; plugins that add tensor-parallel collectives (a neuron's
    shard rule, say) call it so the step's counters see them."""
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
        return all_reduce(grad.clone(), ctx.group), None


class _ReduceOut(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherOut(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.dim, ctx.local, ctx.rank = dim, x.shape[dim], dist.get_rank(group)
        inner = x.movedim(dim, -1)
        ctx.channels_last = inner.is_contiguous()
        if ctx.channels_last:  # gathered in x's layout, so the pooling and convolutions after it keep their fast kernels
            return torch.cat(_all_gather_exact(inner, group), dim=-1).to(x.dtype).movedim(-1, dim)
        return torch.cat(_all_gather_exact(x.contiguous(), group), dim=dim).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        part = grad.narrow(ctx.dim, ctx.rank * ctx.local, ctx.local)
        if ctx.channels_last:
            return part.movedim(ctx.dim, -1).contiguous().movedim(-1, ctx.dim), None, None
        return part.contiguous(), None, None


def _all_gather_exact(x: torch.Tensor, group) -> list[torch.Tensor]:
    """Every rank's ``x``, gathered as int8 when every rank's values are small integers (spikes: a quarter of
    float32's bytes, returned as int8), else in ``x``'s dtype.

    Each rank sends its int8 copy with one more byte saying whether that copy is exact; if any is not, all ranks
    gather again in ``x``'s dtype, so the result is always exact and every rank takes the same path."""
    size = dist.get_world_size(group)
    small = x.to(torch.int8)
    exact = torch.equal(small.to(x.dtype), x)
    payload = torch.cat([small.reshape(-1), small.new_tensor([int(exact)])])
    parts = [torch.ones_like(payload) for _ in range(size)]  # a backend that writes nothing (the dry run's) reads exact
    COUNTER.all_gather += 1
    COUNTER.bytes += payload.numel() * size
    dist.all_gather(parts, payload, group=group)
    if all(part[-1].item() for part in parts):
        return [part[:-1].view(x.shape) for part in parts]
    parts = [torch.empty_like(x) for _ in range(size)]
    COUNTER.all_gather += 1
    COUNTER.bytes += x.numel() * x.element_size() * size
    dist.all_gather(parts, x.contiguous(), group=group)
    return parts


def copy_in(x: torch.Tensor, group) -> torch.Tensor:
    return _CopyIn.apply(x, group)


def reduce_out(x: torch.Tensor, group) -> torch.Tensor:
    return _ReduceOut.apply(x, group)


def gather_out(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    return _GatherOut.apply(x, group, dim)


def count_dtensor_mlp(module: torch.nn.Module) -> None:
    """Counts the collectives of a Colwise-then-Rowwise DTensor unit: the forward all-reduce of the
    row-parallel output and, where its input needs a gradient, the backward all-reduce of that gradient."""

    def count_all_reduce(tensor: torch.Tensor) -> None:
        COUNTER.all_reduce += 1
        COUNTER.bytes += tensor.numel() * tensor.element_size()

    def before(m, args):
        if args[0].requires_grad:
            args[0].register_hook(count_all_reduce)

    module.register_forward_pre_hook(before)
    module.register_forward_hook(lambda m, args, out: count_all_reduce(out))
