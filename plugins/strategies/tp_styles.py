"""Tensor-parallel styles: how one named kind of module is sharded over the ``tp`` group.

A family plugin names a style per module in its ``tp_plan``; every style keeps
the module's input and output replicated and shards what lies between:
layer channels, BatchNorm channels and the state of the neurons in between,
which then only ever see (and keep) their local channels.

- ``conv_bn_neuron``: Conv-BN-neuron unit; conv output channels, BN and neuron
  state sharded, output all-gathered on the channel dim where the next layer
  needs all channels (as bits where the output is the neuron's spikes).
- ``conv_mlp``: a 1x1-conv MLP (``fc1``/``fc2`` containers with BN, neurons
  after each): fc1 column-parallel, fc2 row-parallel then all-reduce.
- ``self_attention_heads``: SpikingJelly's SpikingSelfAttention; every rank
  holds whole heads of q, k and v, the projection is row-parallel.
- ``residual_conv_pair``: a residual block's ``conv1``, ``bn1``, ``sn1``,
  ``conv2`` (SpikingJelly's zoo ``BasicBlock`` and ``Bottleneck``), as Megatron
  shards a pair of linears: conv1 column-parallel with bn1 and sn1's state,
  conv2 row-parallel, its partial outputs all-reduced before ``bn2``; the rest
  of the block (``bn2`` on, a Bottleneck's ``conv3``, the downsample path and
  the residual add) runs whole.
- ``linear_mlp``: Linear-neuron-Linear through torch's DTensor
  ``ColwiseParallel`` and ``RowwiseParallel``; a dropout between them draws
  its mask for every feature, as one rank would, and keeps its own.
- ``causal_attention_heads``, ``spiking_linear_mlp``, ``moe_experts``: the
  ``spiking_lm`` family's attention, MLP and mixture of experts over
  ``[T, N, S, H]`` (channels last): whole heads of q, k and v, the MLP's hidden
  layer and each expert's hidden layer column-parallel with their neurons, the
  projections back row-parallel; a MoE's router stays whole on every rank.

A plan entry names a module, or a run of an ``nn.Sequential``'s children as a
slice, ``"name.start:stop"`` (``"1:4"`` in a Sequential model): the layers of a
flat Sequential, sharded where they are (a :class:`Run`), their names unchanged.

Every sliced parameter and buffer is noted in its module's ``snnfw_slices``
(a :class:`TensorSlice` per name), so checkpoints can gather and re-slice it.
"""

from __future__ import annotations

from typing import Callable

import attrs
import torch
from torch import nn

from snnfw_plugins.strategies.spike_bits import NeuronOutputs
from snnfw_plugins.strategies.tp_comm import (
    all_reduce,
    column_convolution,
    copy_in,
    count_dtensor_mlp,
    gather_out,
    reduce_out,
)

CHANNEL_DIM = 2  # multi-step activations are [T, N, C, ...]
SLICES = "snnfw_slices"
_CONV = (nn.Conv1d, nn.Conv2d)
_BN = (nn.BatchNorm1d, nn.BatchNorm2d)


@attrs.frozen
class NeuronShard:
    """Where the state of neuron ``name`` is sharded: ``local`` of ``total`` entries of ``dim``, over the ranks of
    ``group``. A neuron's shard rule sums what its shards share with :meth:`all_reduce`."""

    dim: int
    local: int
    total: int
    name: str
    group: object = None

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums ``tensor`` in place over the shards' group, counted with tensor parallelism's other collectives."""
        return all_reduce(tensor, self.group)


@attrs.frozen
class Shard:
    """What a style needs: the tp group, this rank's place in it, and the hook facade."""

    mesh: object
    group: object
    rank: int
    size: int
    hooks: object
    names: dict[int, str]  # id(module) -> qualified name, for messages
    pack_spikes: bool = True  # parallel.pack_spikes: neuron outputs gathered as bits

    def block(self, total: int) -> torch.Tensor:
        """Indices of this rank's contiguous block of ``total`` channels."""
        local = total // self.size
        return torch.arange(self.rank * local, (self.rank + 1) * local)


@attrs.frozen
class TensorSlice:
    """A module's tensor holds entries ``index`` of dim ``dim`` of the whole, split over ``group``."""

    dim: int
    index: torch.Tensor
    group: object


@attrs.frozen(eq=False)
class Run:
    """Children of an ``nn.Sequential`` run one after another, taken by a style as it takes a container of them:
    a hook before it goes on the first, one after it on the last."""

    members: tuple[tuple[str, nn.Module], ...]

    def named_children(self):
        return iter(self.members)

    def children(self):
        return (member for _, member in self.members)

    def modules(self):
        return (module for member in self.children() for module in member.modules())

    def register_forward_pre_hook(self, hook):
        return self.members[0][1].register_forward_pre_hook(hook)

    def register_forward_hook(self, hook):
        return self.members[-1][1].register_forward_hook(hook)


def unit(model: nn.Module, name: str) -> nn.Module | Run:
    """What a tp_plan entry names: a module, or the run ``"parent.start:stop"`` of an ``nn.Sequential``'s children."""
    from snnfw.api import submodule

    parent, _, last = name.rpartition(".")
    if ":" not in last:
        return submodule(model, name)
    start, _, stop = last.partition(":")
    container = submodule(model, parent)
    if not (isinstance(container, nn.Sequential) and start.isdigit() and stop.isdigit()
            and int(start) < int(stop) <= len(container)):
        raise AttributeError(f"{name!r} is no run of an nn.Sequential's children (\"name.start:stop\")")
    return Run(tuple(list(container.named_children())[int(start):int(stop)]))


class Indivisible(str):
    """A style's reason that another tp size would answer."""


def _note(module: nn.Module, names: tuple[str, ...], dim: int, index: torch.Tensor, shard: Shard) -> None:
    slices = module.__dict__.setdefault(SLICES, {})
    for name in names:
        slices[name] = TensorSlice(dim, index, shard.group)


def _find(module: nn.Module, kinds) -> list[nn.Module]:
    return [m for m in module.modules() if isinstance(m, kinds)]


def _neurons(module: nn.Module) -> list[nn.Module]:
    from spikingjelly.activation_based.neuron import BaseNode

    return _find(module, BaseNode)


def _param(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor.detach().clone())


def column_conv(conv: nn.Module, index: torch.Tensor, shard: Shard) -> None:
    """Keeps output channels ``index``; the replicated input's gradient is summed over ranks."""
    conv.weight = _param(conv.weight[index])
    if conv.bias is not None:
        conv.bias = _param(conv.bias[index])
    conv.out_channels = len(index)
    _note(conv, ("weight", "bias") if conv.bias is not None else ("weight",), 0, index, shard)
    if conv.padding_mode == "zeros" and not isinstance(conv.padding, str):
        conv._conv_forward = column_convolution(conv, shard.group)  # overlaps the input gradient's all-reduce
    else:
        conv.register_forward_pre_hook(lambda m, args: (copy_in(args[0], shard.group), *args[1:]))


def row_conv(conv: nn.Module, index: torch.Tensor, shard: Shard) -> None:
    """Keeps input channels ``index``; partial outputs are all-reduced, the bias added once."""
    conv.weight = _param(conv.weight[:, index])
    conv.in_channels = len(index)
    _note(conv, ("weight",), 1, index, shard)

    def reduce(m, args, out):
        if m.bias is None:
            return reduce_out(out, shard.group)
        bias = m.bias.view(-1, *([1] * (m.weight.dim() - 2)))
        return reduce_out(out - bias, shard.group) + bias

    conv.register_forward_hook(reduce)


def shard_batch_norm(bn: nn.Module, index: torch.Tensor, shard: Shard) -> None:
    bn.weight, bn.bias = _param(bn.weight[index]), _param(bn.bias[index])
    bn.running_mean = bn.running_mean[index].clone()
    bn.running_var = bn.running_var[index].clone()
    bn.num_features = len(index)
    _note(bn, ("weight", "bias", "running_mean", "running_var"), 0, index, shard)


def shard_neuron(neuron: nn.Module, local: int, total: int, shard: Shard, dim: int = CHANNEL_DIM) -> None:
    """Gives ``neuron`` its shard rule (``snnfw_shard_neuron``), records the shard (of its input's dim ``dim``) on
    it and checks every input."""
    name = shard.names.get(id(neuron), type(neuron).__name__)
    placement = NeuronShard(dim, local, total, name, shard.group)
    if shard.hooks.shard_neuron(neuron, placement, shard.mesh) is not neuron:
        raise ValueError("a snnfw_shard_neuron implementation that replaces the module is not supported by tp styles")
    neuron.snnfw_shard = placement

    def check(module, args):
        received = args[0].shape[placement.dim]
        if received != placement.local:
            raise ValueError(
                f"sharded neuron {placement.name} expects {placement.local} of {placement.total} entries on dim "
                f"{placement.dim}, received {received} (input shape {tuple(args[0].shape)})"
            )

    neuron.register_forward_pre_hook(check)


def _channels(module: nn.Module, size: int, what: str, total: int) -> str | None:
    if total % size:
        return Indivisible(f"{what} has {total} channels, not divisible by tp={size}")
    return None


# conv_bn_neuron


def check_conv_bn_neuron(module: nn.Module, size: int) -> str | None:
    convs = _find(module, _CONV)
    if len(convs) != 1 or len(_find(module, _BN)) > 1:
        return "expects exactly one Conv1d/Conv2d and at most one BatchNorm"
    return _channels(module, size, "its conv", convs[0].out_channels)


def apply_conv_bn_neuron(module: nn.Module, shard: Shard) -> None:
    (conv,) = _find(module, _CONV)
    total = conv.out_channels
    index = shard.block(total)
    column_conv(conv, index, shard)
    for bn in _find(module, _BN):
        shard_batch_norm(bn, index, shard)
    for neuron in _neurons(module):
        shard_neuron(neuron, len(index), total, shard)
    outputs = NeuronOutputs(_neurons(module)) if shard.pack_spikes else None
    module.register_forward_hook(
        lambda m, args, out: gather_out(out, shard.group, CHANNEL_DIM, outputs is not None and outputs.produced(out)))


# conv_mlp


def check_conv_mlp(module: nn.Module, size: int) -> str | None:
    if not (hasattr(module, "fc1") and hasattr(module, "fc2")):
        return "expects fc1 and fc2 containers"
    return _channels(module, size, "its hidden layer", _find(module.fc1, _CONV)[0].out_channels)


def apply_conv_mlp(module: nn.Module, shard: Shard) -> None:
    (fc1,), (fc2,) = _find(module.fc1, _CONV), _find(module.fc2, _CONV)
    hidden = fc1.out_channels
    index = shard.block(hidden)
    column_conv(fc1, index, shard)
    for bn in _find(module.fc1, _BN):
        shard_batch_norm(bn, index, shard)
    shard_neuron(module.neuron1, len(index), hidden, shard)
    row_conv(fc2, index, shard)


# residual_conv_pair


def check_residual_conv_pair(module: nn.Module, size: int) -> str | None:
    from snnfw.api import is_neuron

    parts = [getattr(module, name, None) for name in ("conv1", "bn1", "sn1", "conv2")]
    kinds = (_CONV, _BN, nn.Module, _CONV)
    if not all(isinstance(part, kind) for part, kind in zip(parts, kinds)) or not is_neuron(parts[2]):
        return ("expects a residual block with conv1, bn1, sn1 (a neuron) and conv2 (SpikingJelly's BasicBlock, "
                "Bottleneck)")
    if parts[0].groups != 1 or parts[3].groups != 1:
        return "expects conv1 and conv2 without groups (a ResNeXt's grouped conv2 cannot be split by input channel)"
    return _channels(module, size, "its conv1", parts[0].out_channels)


def apply_residual_conv_pair(module: nn.Module, shard: Shard) -> None:
    total = module.conv1.out_channels
    index = shard.block(total)
    column_conv(module.conv1, index, shard)
    shard_batch_norm(module.bn1, index, shard)
    shard_neuron(module.sn1, len(index), total, shard)
    row_conv(module.conv2, index, shard)


# self_attention_heads


def check_self_attention(module: nn.Module, size: int) -> str | None:
    heads = getattr(module, "num_heads", None)
    if heads is None or not hasattr(module, "qkv_conv_bn"):
        return "expects SpikingJelly's SpikingSelfAttention (num_heads, qkv_conv_bn, proj_conv_bn)"
    if heads % size:
        return Indivisible(f"its {heads} heads are not divisible by tp={size}")
    return None


def apply_self_attention(module: nn.Module, shard: Shard) -> None:
    dim, heads = module.dim, module.num_heads
    local_heads = heads // shard.size
    channels = shard.block(dim)  # whole heads: a contiguous block of head_dim-channel groups
    qkv_index = torch.cat([part * dim + channels for part in range(3)])  # q, k and v of those heads
    (qkv,), (proj,) = _find(module.qkv_conv_bn, _CONV), _find(module.proj_conv_bn, _CONV)
    column_conv(qkv, qkv_index, shard)
    for bn in _find(module.qkv_conv_bn, _BN):
        shard_batch_norm(bn, qkv_index, shard)
    shard_neuron(module.qkv_lif, len(qkv_index), 3 * dim, shard)
    shard_neuron(module.attn_lif, local_heads, heads, shard)
    module.num_heads = local_heads
    row_conv(proj, channels, shard)


# linear_mlp


def check_linear_mlp(module: nn.Module, size: int) -> str | None:
    linears = [m for m in module.children() if isinstance(m, nn.Linear)]
    if len(linears) != 2:
        return "expects two Linear children (column- then row-parallel)"
    return _channels(module, size, "its hidden layer", linears[0].out_features)


def apply_linear_mlp(module: nn.Module | Run, shard: Shard) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    children = list(module.named_children())
    first, second = (i for i, (_, m) in enumerate(children) if isinstance(m, nn.Linear))
    hidden = children[first][1].out_features
    for _, child in children[first + 1 : second]:
        for neuron in _neurons(child):
            shard_neuron(neuron, hidden // shard.size, hidden, shard)
        for dropout in _dropouts(child):
            shard_dropout(dropout, shard.block(hidden), hidden)
    parallelize_module(children[first][1], shard.mesh, ColwiseParallel())
    parallelize_module(children[second][1], shard.mesh, RowwiseParallel())
    count_dtensor_mlp(module)


def _dropouts(module: nn.Module) -> list[nn.Module]:
    from spikingjelly.activation_based.layer import Dropout

    return _find(module, (nn.Dropout, Dropout))


def shard_dropout(dropout: nn.Module, index: torch.Tensor, total: int) -> None:
    """A dropout on features ``index`` of ``total`` (the last dim): its mask drawn for all of them, as one rank
    would draw it from the same random state, and sliced."""

    def mask(x: torch.Tensor) -> torch.Tensor:
        whole = torch.ones(*x.shape[:-1], total, dtype=x.dtype, device=x.device)
        return nn.functional.dropout(whole, dropout.p, training=True)[..., index]

    if isinstance(dropout, nn.Dropout):
        dropout.forward = lambda x: x * mask(x) if dropout.training and dropout.p > 0 else x
    else:  # SpikingJelly's Dropout: one mask for every time step
        dropout.create_mask = mask


# the spiking_lm family's units, channels last


TOKEN_CHANNELS = 3  # [T, N, S, H]


def column_linear(linear: nn.Linear, index: torch.Tensor, shard: Shard) -> None:
    """Keeps output features ``index``."""
    linear.weight = _param(linear.weight[index])
    if linear.bias is not None:
        linear.bias = _param(linear.bias[index])
    linear.out_features = len(index)
    _note(linear, ("weight", "bias") if linear.bias is not None else ("weight",), 0, index, shard)


def row_linear(linear: nn.Linear, index: torch.Tensor, shard: Shard) -> None:
    """Keeps input features ``index``; partial outputs are all-reduced, the bias added once."""
    linear.weight = _param(linear.weight[:, index])
    linear.in_features = len(index)
    _note(linear, ("weight",), 1, index, shard)

    def reduce(m, args, out):
        return reduce_out(out, shard.group) if m.bias is None else reduce_out(out - m.bias, shard.group) + m.bias

    linear.register_forward_hook(reduce)


def gradient_summed_after(module: nn.Module, shard: Shard) -> None:
    """``module``'s output (replicated) feeds only column-parallel layers: its gradient is summed over ranks."""
    module.register_forward_hook(lambda m, args, out: copy_in(out, shard.group))


def check_causal_attention(module: nn.Module, size: int) -> str | None:
    if not all(hasattr(module, name) for name in ("num_heads", "q", "k", "v", "proj", "input_lif")):
        return "expects the spiking_lm family's CausalSelfAttention (num_heads, input_lif, q, k, v, proj)"
    if module.num_heads % size:
        return Indivisible(f"its {module.num_heads} heads are not divisible by tp={size}")
    return None


def apply_causal_attention(module: nn.Module, shard: Shard) -> None:
    total = module.q.out_features
    channels = shard.block(total)  # whole heads: a contiguous block of head_dim-feature groups
    gradient_summed_after(module.input_lif, shard)
    for linear, neuron in ((module.q, module.q_lif), (module.k, module.k_lif), (module.v, module.v_lif)):
        column_linear(linear, channels, shard)
        shard_neuron(neuron, len(channels), total, shard, TOKEN_CHANNELS)
    module.num_heads //= shard.size
    row_linear(module.proj, channels, shard)


def check_spiking_linear_mlp(module: nn.Module, size: int) -> str | None:
    if not all(hasattr(module, name) for name in ("input_lif", "fc1", "hidden_lif", "fc2")):
        return "expects the spiking_lm family's SpikingMLP (input_lif, fc1, hidden_lif, fc2)"
    return _channels(module, size, "its hidden layer", module.fc1.out_features)


def apply_spiking_linear_mlp(module: nn.Module, shard: Shard) -> None:
    total = module.fc1.out_features
    index = shard.block(total)
    gradient_summed_after(module.input_lif, shard)
    column_linear(module.fc1, index, shard)
    shard_neuron(module.hidden_lif, len(index), total, shard, TOKEN_CHANNELS)
    row_linear(module.fc2, index, shard)


def check_moe_experts(module: nn.Module, size: int) -> str | None:
    if not (hasattr(module, "router") and isinstance(getattr(module, "experts", None), nn.ModuleList)):
        return "expects the spiking_lm family's MoEMLP (router, experts)"
    return _channels(module, size, "an expert's hidden layer", module.experts[0].fc1.out_features)


def apply_moe_experts(module: nn.Module, shard: Shard) -> None:
    """Each expert's hidden layer split; its output all-reduced before the router's weights scale it, so the
    router, whole on every rank, sees (and differentiates) the whole output."""
    for expert in module.experts:
        total = expert.fc1.out_features
        index = shard.block(total)
        expert.fc1.register_forward_pre_hook(lambda m, args: (copy_in(args[0], shard.group), *args[1:]))
        column_linear(expert.fc1, index, shard)
        shard_neuron(expert.lif, len(index), total, shard)  # [T, tokens, hidden]
        row_linear(expert.fc2, index, shard)


@attrs.frozen
class Style:
    check: Callable[[nn.Module, int], str | None]
    apply: Callable[[nn.Module, Shard], None]


STYLES = {
    "conv_bn_neuron": Style(check_conv_bn_neuron, apply_conv_bn_neuron),
    "conv_mlp": Style(check_conv_mlp, apply_conv_mlp),
    "self_attention_heads": Style(check_self_attention, apply_self_attention),
    "residual_conv_pair": Style(check_residual_conv_pair, apply_residual_conv_pair),
    "linear_mlp": Style(check_linear_mlp, apply_linear_mlp),
    "causal_attention_heads": Style(check_causal_attention, apply_causal_attention),
    "spiking_linear_mlp": Style(check_spiking_linear_mlp, apply_spiking_linear_mlp),
    "moe_experts": Style(check_moe_experts, apply_moe_experts),
}
