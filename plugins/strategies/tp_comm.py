"""Autograd-aware collectives of tensor parallelism, with per-step counters.

Tensors that flow between tensor-parallel units are replicated on every rank
of the ``tp`` group, and so are their gradients. Inside a unit they are
sharded. Four functions cross the boundary:

- ``copy_in``: a replicated input entering a sharded unit (backward sums the
  partial input gradients with an all-reduce);
- ``column_convolution``: ``copy_in`` fused with the column-parallel
  convolution after it, whose backward computes the input gradient first and
  its weight gradient while that gradient's all-reduce runs (Megatron's
  overlap; a rank that waited for its peers at the all-reduce computes
  instead);
- ``reduce_out``: partial sums leaving a row-parallel layer (forward all-reduce);
- ``gather_out``: a channel shard leaving a unit (forward all-gather, as bits
  when the shard is a neuron's output, see ``spike_bits``; backward keeps this
  rank's slice of the replicated gradient).

Units that torch's DTensor styles parallelize (``ColwiseParallel`` then
``RowwiseParallel``) run DTensor's own collectives; :func:`count_dtensor_mlp`
counts them into the same counters.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from snnfw_plugins.strategies.spike_bits import check_binary, pack, unpack


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


def _count_all_reduce(tensor: torch.Tensor) -> None:
    COUNTER.all_reduce += 1
    COUNTER.bytes += tensor.numel() * tensor.element_size()


def all_reduce(tensor: torch.Tensor, group) -> torch.Tensor:
    """An in-place sum over ``group``, counted; plugins that add tensor-parallel collectives (a neuron's
    shard rule, say) call it so the step's counters see them."""
    _count_all_reduce(tensor)
    dist.all_reduce(tensor, group=group)
    return tensor


def start_all_reduce(tensor: torch.Tensor, group):
    """:func:`all_reduce` without waiting: returns the collective's work handle."""
    _count_all_reduce(tensor)
    return dist.all_reduce(tensor, group=group, async_op=True)


class _CopyIn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad.clone(), ctx.group), None


class _ColumnConvolution(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, conv, group):
        ctx.conv, ctx.group, ctx.bias_sizes, ctx.x_dtype = conv, group, None if bias is None else list(bias.shape), x.dtype
        device = x.device.type
        if torch.is_autocast_enabled(device):  # what autocast does to a convolution, done here: it sees none inside
            dtype = torch.get_autocast_dtype(device)
            x, weight, bias = (t.to(dtype) if t is not None and t.dtype != torch.float64 else t for t in (x, weight, bias))
        ctx.save_for_backward(x, weight)
        with torch.autocast(device, enabled=False):
            return torch.convolution(x, weight, bias, conv.stride, conv.padding, conv.dilation, False,
                                     [0] * len(conv.stride), conv.groups)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        conv, (wants_x, wants_weight, wants_bias) = ctx.conv, ctx.needs_input_grad[:3]

        def backward_of(*mask):
            return torch.ops.aten.convolution_backward(grad, x, weight, ctx.bias_sizes, conv.stride, conv.padding,
                                                       conv.dilation, False, [0] * len(conv.stride), conv.groups, list(mask))

        grad_x = work = grad_weight = grad_bias = None
        if wants_x:
            grad_x = backward_of(True, False, False)[0].to(ctx.x_dtype)  # summed in the input's dtype, as copy_in sums
            work = start_all_reduce(grad_x, ctx.group)
        if wants_weight or wants_bias:
            _, grad_weight, grad_bias = backward_of(False, wants_weight, wants_bias)
        if work is not None:
            work.wait()
        return grad_x, grad_weight, grad_bias, None, None


class _ReduceOut(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherOut(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, spikes):
        ctx.dim, ctx.local, ctx.rank = dim, x.shape[dim], dist.get_rank(group)
        inner = x.movedim(dim, -1)
        ctx.channels_last = inner.is_contiguous()
        gather = _all_gather_bits if spikes else _all_gather
        if ctx.channels_last:  # gathered in x's layout, so the pooling and convolutions after it keep their fast kernels
            return torch.cat(gather(inner, group), dim=-1).movedim(-1, dim)
        return torch.cat(gather(x.contiguous(), group), dim=dim)

    @staticmethod
    def backward(ctx, grad):
        part = grad.narrow(ctx.dim, ctx.rank * ctx.local, ctx.local)
        if ctx.channels_last:
            return part.movedim(ctx.dim, -1).contiguous().movedim(-1, ctx.dim), None, None, None
        return part.contiguous(), None, None, None


def _all_gather(x: torch.Tensor, group) -> list[torch.Tensor]:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    COUNTER.all_gather += 1
    COUNTER.bytes += x.numel() * x.element_size() * len(parts)
    dist.all_gather(parts, x, group=group)
    return parts


def _all_gather_bits(x: torch.Tensor, group) -> list[torch.Tensor]:
    """Every rank's spikes ``x``, sent as bits (``spike_bits``) and returned in ``x``'s dtype; no host sync."""
    check_binary(x, "tensor parallelism's all-gather")
    packed = pack(x)
    return [unpack(part, x.shape, x.dtype) for part in _all_gather(packed, group)]


def copy_in(x: torch.Tensor, group) -> torch.Tensor:
    return _CopyIn.apply(x, group)


def column_convolution(conv: torch.nn.Module, group):
    """What ``conv._conv_forward`` becomes in a column-parallel convolution: :class:`_ColumnConvolution`."""

    def forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return _ColumnConvolution.apply(x, weight, bias, conv, group)

    return forward


def reduce_out(x: torch.Tensor, group) -> torch.Tensor:
    return _ReduceOut.apply(x, group)


def gather_out(x: torch.Tensor, group, dim: int, spikes: bool = False) -> torch.Tensor:
    """``x``'s shards of dim ``dim`` joined from every rank; sent as bits when ``spikes`` (a neuron's output)."""
    return _GatherOut.apply(x, group, dim, spikes)


def count_dtensor_mlp(module: torch.nn.Module) -> None:
    """Counts the collectives of a Colwise-then-Rowwise DTensor unit: the forward all-reduce of the
    row-parallel output and, where its input needs a gradient, the backward all-reduce of that gradient."""

    def before(m, args):
        if args[0].requires_grad:
            args[0].register_hook(_count_all_reduce)

    module.register_forward_pre_hook(before)
    module.register_forward_hook(lambda m, args, out: _count_all_reduce(out))
