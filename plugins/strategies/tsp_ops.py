"""What ``tsp`` changes in a model: each rank of a time group runs its chunk of the time steps, exactly.

- The model's input frames ``[N, T, ...]`` are cut to this rank's time steps
  before its forward; its logits ``[T / P, N, classes]`` are gathered along
  time after it (:class:`GatherTime`), so every rank computes the loss of all
  T steps as one process would, and backward hands each rank the gradient of
  its own steps.
- A multi-step neuron starts its chunk from the membrane potential that rank
  k - 1 ended its chunk with (:class:`ReceiveState`) and sends its own end
  state on (:class:`SendState`); in backward the gradient with respect to
  that state goes from k back to k - 1. It runs its chunk in slices of the
  batch (``tsp.slices``), each sent on as soon as it is done: rank k + 1
  starts on the first slice while rank k runs the next, a wavefront that
  shortens the wait of a layer's neurons from (P - 1) chunks to (P - 1) / S,
  and the same in backward. A neuron acts on each sample alone, so the
  slices change no number.
- BatchNorm normalizes by statistics over the whole T x N (sums all-reduced
  over the time group, their gradients all-reduced back: SyncBatchNorm's
  algebra), and its running statistics get the whole batch's values.

Every rank's parameter gradient is then P times its own steps' share of the
gradient of the loss, so that the average over the time group is the whole.
"""

from __future__ import annotations

import contextlib
import time as clock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from snnfw.api import hook_root


class Exchanges:
    """Host time this rank spent in the time group's messages and reductions, when ``enabled``
    (``log.phase_times``): on CPU ranks, where a receive blocks, most of it is waiting for the rank before or
    after, the price of running the neurons of a layer one rank after another."""

    def __init__(self):
        self.enabled, self.seconds = False, 0.0

    @contextlib.contextmanager
    def timed(self):
        if not self.enabled:
            yield
            return
        started = clock.perf_counter()
        try:
            yield
        finally:
            self.seconds += clock.perf_counter() - started

    def take(self) -> dict[str, float]:
        out, self.seconds = {"tsp_exchange_ms": self.seconds * 1e3}, 0.0
        return out


class TimeGroup:
    """This rank's place among the ``size`` ranks that split the time steps of the same samples."""

    def __init__(self, group, timed: bool = False):
        self.group, self.exchanges = group, Exchanges()  # its exchanges' time, with log.phase_times
        self.exchanges.enabled = timed
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        ranks = dist.get_process_group_ranks(group)
        self.previous = ranks[self.rank - 1] if self.rank > 0 else None
        self.next = ranks[self.rank + 1] if self.rank < self.size - 1 else None

    def chunk(self, steps: int) -> slice:
        return time_chunk(steps, self.rank, self.size)


def time_chunk(steps: int, rank: int, size: int) -> slice:
    """The time steps that the ``rank``-th of ``size`` ranks of a time group runs, of ``steps``."""
    length = steps // size
    return slice(rank * length, (rank + 1) * length)


class GatherTime(torch.autograd.Function):
    """``[T / P, ...]`` on each rank -> ``[T, ...]`` in time order on every rank; backward keeps this rank's steps'
    gradient, times P: DDP's average over the P ranks of a time group is then their sum."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, time: TimeGroup) -> torch.Tensor:
        ctx.time, ctx.length = time, local.shape[0]
        parts = [torch.empty_like(local) for _ in range(time.size)]
        with time.exchanges.timed():
            dist.all_gather(parts, local.contiguous(), group=time.group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        start = ctx.time.rank * ctx.length
        return grad[start:start + ctx.length] * ctx.time.size, None


class ReceiveState(torch.autograd.Function):
    """The neuron state rank k - 1 ended slice ``tag`` of its chunk with, shaped like ``like``; backward sends its
    gradient back."""

    @staticmethod
    def forward(ctx, like: torch.Tensor, time: TimeGroup, tag: int) -> torch.Tensor:
        ctx.time, ctx.tag = time, tag
        state = torch.empty_like(like)
        with time.exchanges.timed():
            dist.recv(state, src=time.previous, group=time.group, tag=tag)
        return state

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        with ctx.time.exchanges.timed():
            dist.send(grad.contiguous(), dst=ctx.time.previous, group=ctx.time.group, tag=ctx.tag)
        return None, None, None


class SendState(torch.autograd.Function):
    """Sends ``state`` (a neuron's at the end of slice ``tag`` of this rank's chunk) on to rank k + 1 and returns
    ``out`` as it is; backward receives the state's gradient from rank k + 1."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, state: torch.Tensor, time: TimeGroup, tag: int) -> torch.Tensor:
        ctx.time, ctx.tag, ctx.like = time, tag, (state.shape, state.dtype, state.device)
        with time.exchanges.timed():
            dist.send(state.detach().contiguous(), dst=time.next, group=time.group, tag=tag)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        shape, dtype, device = ctx.like
        grad_state = torch.empty(shape, dtype=dtype, device=device)
        with ctx.time.exchanges.timed():
            dist.recv(grad_state, src=ctx.time.next, group=ctx.time.group, tag=ctx.tag)
        return grad_out, grad_state, None, None


def chain_neuron(neuron: nn.Module, time: TimeGroup, slices: int) -> None:
    """Makes ``neuron`` (a SpikingJelly multi-step neuron) continue the membrane potential of the rank before, in
    ``slices`` slices of the batch (fewer where the batch is smaller).

    Backward meets the slices in the reverse order on every rank (autograd runs the latest recorded first), and each
    message carries its slice as its tag. The neuron's own steps are the chain's ``__wrapped__``, which a neuron
    backend installed later replaces (``lif_kernel.install``)."""

    def run_slice(x_seq: torch.Tensor, start, tag: int, args, kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        neuron.v = ReceiveState.apply(x_seq[0], time, tag) if time.previous is not None else start
        out = multi_step_forward.__wrapped__(x_seq, *args, **kwargs)
        if time.next is not None:
            out = SendState.apply(out, neuron.v, time, tag)
        return out, neuron.v

    def multi_step_forward(x_seq: torch.Tensor, *args, **kwargs):
        start = neuron.v  # the reset value: chunk 0 starts every slice from it
        parts = [run_slice(x, start, tag, args, kwargs) for tag, x in enumerate(x_seq.tensor_split(slices, dim=1))
                 if x.shape[1]]
        if len(parts) == 1:
            return parts[0][0]
        neuron.v = torch.cat([v for _, v in parts])  # [N, ...]: the state every slice ended with
        return torch.cat([out for out, _ in parts], dim=1)

    multi_step_forward.__wrapped__ = neuron.multi_step_forward
    neuron.multi_step_forward = multi_step_forward


class TimeBatchNorm(torch.autograd.Function):
    """Batch normalization of ``x`` ``[M, C, ...]`` by the statistics of every rank's time steps, saving what
    torch's own kernel saves (the input, the mean and the inverse deviation); SyncBatchNorm's backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, time: TimeGroup, eps: float):
        dims, shape = _reduced(x)
        count = x.numel() // x.shape[1] * time.size
        total = x.sum(dims)
        with time.exchanges.timed():
            dist.all_reduce(total, group=time.group)
        mean = total / count
        squares = ((x - mean.view(shape)) ** 2).sum(dims)
        with time.exchanges.timed():
            dist.all_reduce(squares, group=time.group)
        var = squares / count
        invstd = torch.rsqrt(var + eps)
        ctx.time, ctx.count = time, count
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.mark_non_differentiable(mean, var)
        out = (x - mean.view(shape)) * invstd.view(shape)
        if weight is not None:
            out = out * weight.view(shape) + bias.view(shape)
        return out, mean, var

    @staticmethod
    def backward(ctx, grad, grad_mean, grad_var):
        x, weight, mean, invstd = ctx.saved_tensors
        dims, shape = _reduced(x)
        normalized = (x - mean.view(shape)) * invstd.view(shape)
        grad_bias, grad_weight = grad.sum(dims), (grad * normalized).sum(dims)
        sums = torch.cat([grad_bias, grad_weight])
        with ctx.time.exchanges.timed():
            dist.all_reduce(sums, group=ctx.time.group)
        mean_grad, mean_grad_normalized = (sums / ctx.count).chunk(2)
        scale = invstd if weight is None else invstd * weight
        grad_x = (grad - mean_grad.view(shape) - normalized * mean_grad_normalized.view(shape)) * scale.view(shape)
        if weight is None:
            return grad_x, None, None, None, None
        return grad_x, grad_weight, grad_bias, None, None


def _reduced(x: torch.Tensor) -> tuple[list[int], list[int]]:
    """The dimensions a BatchNorm reduces over (all but channels, dim 1), and the shape a per-channel tensor takes."""
    return [d for d in range(x.dim()) if d != 1], [1, -1] + [1] * (x.dim() - 2)


def _time_synced_batch_norm(norm: nn.modules.batchnorm._BatchNorm, time: TimeGroup):
    """A forward for ``norm`` whose training statistics are over every rank's time steps."""

    def normalize(x: torch.Tensor) -> torch.Tensor:
        if not norm.training:
            return F.batch_norm(x, norm.running_mean, norm.running_var, norm.weight, norm.bias, False, 0.0, norm.eps)
        out, mean, var = TimeBatchNorm.apply(x, norm.weight, norm.bias, time, norm.eps)
        if norm.track_running_stats:
            count = x.numel() // x.shape[1] * time.size
            with torch.no_grad():
                norm.num_batches_tracked.add_(1)
                factor = 1.0 / float(norm.num_batches_tracked) if norm.momentum is None else norm.momentum
                norm.running_mean.mul_(1 - factor).add_(mean, alpha=factor)
                norm.running_var.mul_(1 - factor).add_(var * count / (count - 1), alpha=factor)
        return out

    def forward(x: torch.Tensor) -> torch.Tensor:
        if getattr(norm, "step_mode", "s") == "m":  # SpikingJelly's multi-step BatchNorm: [T, N, C, ...]
            return normalize(x.flatten(0, 1)).view(x.shape)
        return normalize(x)

    return forward


def split_time(model: nn.Module, neurons: list[nn.Module], time: TimeGroup, steps: int, slices: int) -> None:
    """Applies the changes the module docstring lists to ``model`` of ``steps`` time steps and its ``neurons``, in
    place. The model takes the whole samples' frames, or this rank's chunk of them (the loader's time view)."""
    for neuron in neurons:
        chain_neuron(neuron, time, slices)
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.forward = _time_synced_batch_norm(module, time)

    def own_steps(module, args):
        frames = args[0]  # [N, T, ...]: before a model taking [T, N, ...] transposes them
        if frames.shape[1] == steps // time.size:
            return None  # the chunk already
        return (frames[:, time.chunk(frames.shape[1])], *args[1:])

    hook_root(model, own_steps, lambda module, args, logits: GatherTime.apply(logits, time))
