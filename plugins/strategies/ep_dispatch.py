"""Expert parallelism's dispatch and combine: a mixture-of-experts layer whose experts live on the ranks of an ``ep``
group, each rank holding ``experts / ep`` whole experts.

A layer the ``ep`` strategy takes (:func:`moe_layers`: a module with an ``experts`` ``nn.ModuleList`` and a
``mix(spikes, chosen, weights, steps)`` method, as ``spiking_lm``'s ``MoEMLP``) keeps its routing; its ``mix`` is
replaced by :func:`dispatched_mix`:

1. each rank counts the rows (time step, token) it routes to each expert and the tokens it has; the counts go to
   the experts' owners by one all-to-all;
2. the rows' positions (int64) and the rows themselves go to the owners by all-to-all, expert by expert in
   position order;
3. an owner runs each of its experts once on the rows of every peer, peer after peer: its neurons see one token
   axis of the peers' tokens side by side, so each token's membrane evolves as in one process (a token not routed
   at a step gets no current and only leaks);
4. the outputs go back by the reverse all-to-all, and each rank adds them, weighted, in expert order, as
   ``MoEMLP.mix`` does.

Gradients flow through both all-to-alls (:class:`AllToAll`). An expert's gradient gathers the contributions of
every ep peer's tokens, a sum over the ep replicas whose loss is their mean: the combine's backward scales the
gradients it sends to the owners by ``1 / ep`` and the dispatch's backward scales those it returns to the senders
by ``ep`` (exact for powers of two), so the experts' gradients are the mean and every other gradient is unchanged.
"""

from __future__ import annotations

import attrs
import torch
import torch.distributed as dist
from torch import nn

OWNED_OVER = "snnfw_owned_over"  # a module's note the core's gradient norm reads: each rank of this group holds its own

@attrs.define
class ExchangeCounter:
    """Bytes this rank sent to its ep peers (its own rows excluded) since the last ``take()``."""

    bytes: int = 0
    calls: int = 0

    def take(self) -> dict[str, float]:
        out = {"ep_comm_mb": self.bytes / 2**20, "ep_alltoall_calls": self.calls}
        self.bytes = self.calls = 0
        return out


COUNTER = ExchangeCounter()


@attrs.frozen(eq=False)
class ExpertGroup:
    """The ep group of a rank: its process ``group``, this rank's place in it and its size."""

    group: object
    rank: int
    size: int


def exchange(x: torch.Tensor, send: list[int], receive: list[int], group: ExpertGroup) -> torch.Tensor:
    """``x``'s rows, ``send[p]`` of them to peer ``p`` in order; returns the ``receive[p]`` rows of each peer."""
    COUNTER.calls += 1
    COUNTER.bytes += (sum(send) - send[group.rank]) * x[:1].numel() * x.element_size()
    out = x.new_empty((sum(receive), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), receive, send, group=group.group)
    return out


class AllToAll(torch.autograd.Function):
    """:func:`exchange` with autograd: the backward sends the gradients back the way the rows came, times
    ``grad_scale``."""

    @staticmethod
    def forward(ctx, x, send, receive, group, grad_scale):
        ctx.send, ctx.receive, ctx.group, ctx.grad_scale = send, receive, group, grad_scale
        return exchange(x, send, receive, group)

    @staticmethod
    def backward(ctx, grad):
        back = exchange(grad, ctx.receive, ctx.send, ctx.group)
        return back * ctx.grad_scale, None, None, None, None


def moe_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The mixture-of-experts layers of ``model`` by name: modules with an ``experts`` ModuleList and a ``mix``."""
    return [(name, module) for name, module in model.named_modules()
            if isinstance(getattr(module, "experts", None), nn.ModuleList) and callable(getattr(module, "mix", None))]


def dispatched_mix(layer: nn.Module, group: ExpertGroup, spikes: torch.Tensor, chosen: torch.Tensor,
                   weights: torch.Tensor, steps: int) -> torch.Tensor:
    """``layer.mix`` with its experts across ``group``: what one process computes, dispatched to the experts'
    owners and combined back (the module's docstring)."""
    peers, experts = group.size, len(layer.experts)
    local = experts // peers
    hits = [chosen == index for index in range(experts)]
    rows = [hit.any(-1).nonzero().squeeze(-1) for hit in hits]
    lengths = [len(r) for r in rows]
    tokens = spikes.shape[0] // steps
    counts = torch.tensor([[tokens, *lengths[p * local:(p + 1) * local]] for p in range(peers)], dtype=torch.int64,
                          device=spikes.device)
    received = exchange(counts.flatten(), [local + 1] * peers, [local + 1] * peers, group).view(peers, local + 1)
    received = received.tolist()  # per peer: its tokens, then its rows for each of this rank's experts
    send = [sum(lengths[p * local:(p + 1) * local]) for p in range(peers)]
    receive = [sum(peer[1:]) for peer in received]
    order = torch.cat(rows)
    positions = exchange(order, send, receive, group)
    inputs = AllToAll.apply(spikes.index_select(0, order), send, receive, group, float(peers))
    outputs = _run_experts(layer, group, inputs, positions, received, steps)
    returned = AllToAll.apply(outputs, receive, send, group, 1.0 / peers)
    out = torch.zeros_like(spikes)
    for index, y in enumerate(returned.split(lengths)):
        weight = (weights * hits[index]).sum(-1).index_select(0, rows[index]).unsqueeze(-1)
        out = out.index_add(0, rows[index], y * weight)
    return out


def _run_experts(layer, group: ExpertGroup, inputs: torch.Tensor, positions: torch.Tensor, received: list[list[int]],
                 steps: int) -> torch.Tensor:
    """Each of this rank's experts once on the rows every peer sent it (``inputs``, peer by peer, expert by expert,
    at ``positions`` in the peer's ``[T x tokens]``); the outputs in ``inputs``' order."""
    local = len(received[0]) - 1
    peer_tokens = [counts[0] for counts in received]
    total = sum(peer_tokens)
    offsets = torch.tensor([0, *peer_tokens[:-1]]).cumsum(0).tolist()
    starts, at = [], 0
    for counts in received:
        starts.append([])
        for count in counts[1:]:
            starts[-1].append(at)
            at += count
    taken, outputs = [], []
    for j in range(local):
        index = torch.cat([torch.arange(starts[p][j], starts[p][j] + received[p][j + 1]) for p in range(group.size)])
        spots = torch.cat([_on_joint_axis(positions[starts[p][j]:starts[p][j] + received[p][j + 1]], peer_tokens[p],
                                          offsets[p], total) for p in range(group.size)])
        expert = layer.experts[group.rank * local + j]
        outputs.append(expert(inputs.index_select(0, index.to(inputs.device)), spots.to(inputs.device), steps, total))
        taken.append(index)
    return torch.cat(outputs).index_select(0, torch.cat(taken).argsort().to(inputs.device))


def _on_joint_axis(rows: torch.Tensor, tokens: int, offset: int, total: int) -> torch.Tensor:
    """Rows of a peer's ``[T x tokens]`` as rows of ``[T x total]``, its tokens at ``offset`` of the joint axis."""
    return rows // tokens * total + offset + rows % tokens


class Placeholder(nn.Module):
    """Where an expert another ep rank holds sits: no parameters, so the state's names stay the whole model's."""

    def forward(self, *args):
        raise RuntimeError("this expert is held by another ep rank")
