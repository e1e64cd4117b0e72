"""``snnfw export --format nir``: a network as a Neuromorphic Intermediate Representation graph, and back.

The network is read as the chain of its layers in the order they are registered (containers such as
``nn.Sequential`` and SpikingJelly's ``SeqToANNContainer`` opened), one time step a sample:

- ``Linear`` -> ``nir.Affine`` (``nir.Linear`` without a bias), ``Conv1d``/``Conv2d`` -> ``nir.Conv1d``/``Conv2d``,
  a ``BatchNorm`` right after one folded into its weight and bias (eval statistics);
- SpikingJelly's ``LIFNode``/``ParametricLIFNode`` -> ``nir.LIF``, ``IFNode`` -> ``nir.IF`` (hard reset only);
- ``Flatten`` -> ``nir.Flatten``, and one before a ``Linear`` that receives a feature map (the model's
  ``torch.flatten``); ``AvgPool2d`` -> ``nir.AvgPool2d``; ``Dropout`` and ``Identity`` left out.

Anything else is refused naming the layer, and so is what the forward computes beside the layers (a residual add:
:mod:`snnfw.components.nir_forward`). Neurons: SpikingJelly's discrete step with ``tau`` is
``v += (x - (v - v_reset)) / tau`` (``decay_input``) or ``v += x - (v - v_reset) / tau``, NIR's LIF is
``tau_nir dv/dt = (v_leak - v) + r x``: with ``tau_nir = tau * DT``, ``v_leak = v_reset`` and ``r = 1``
(``decay_input``) or ``tau``, its Euler step of ``DT`` is SpikingJelly's step; an IF's ``r = 1 / DT``. Where the
synapse before a neuron is a ``Linear`` or ``Conv``, ``r`` is folded into its weight and bias and the neuron's
``r`` is 1 (what readers that take ``r`` as 1 read); ``DT`` is the graph's ``metadata["dt"]``. A neuron spikes
where ``v >= v_threshold`` and is then set to ``v_reset``. :func:`simulate` runs a graph so, and :func:`export`
writes a graph only once its simulation gives the output of every layer of the model, and every spike, on inputs
on which every neuron layer fires.
"""

from __future__ import annotations

import copy
from pathlib import Path

import attrs
import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from snnfw.components import nir_forward
from snnfw.errors import CheckpointError

DT = 1e-4  # seconds a time step, as SpikingJelly's own NIR exchange
SYNAPSES = (nn.Linear, nn.Conv1d, nn.Conv2d)
NORMS = (nn.BatchNorm1d, nn.BatchNorm2d)
_SKIPPED = (nn.Dropout, nn.Identity)


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().cpu().double().numpy()


def _refuse(name: str, module: nn.Module, why: str) -> CheckpointError:
    return CheckpointError(f"layer {name} ({type(module).__name__}) cannot be expressed in NIR: {why}; export it as a "
                           "state dict (without --format nir), or replace the layer")


def _neuron_kind(module: nn.Module) -> str | None:
    """``lif`` or ``if`` for the neurons NIR maps (their own classes: a subclass steps otherwise), ``other`` for
    another SpikingJelly neuron, None for anything else."""
    from spikingjelly.activation_based import neuron

    for kind, classes in (("lif", (neuron.LIFNode, neuron.ParametricLIFNode)), ("if", (neuron.IFNode,))):
        if type(module) in classes:
            return kind
    return "other" if isinstance(module, neuron.BaseNode) else None


def layers(model: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module]]:
    """The chain of layers NIR maps, in registration order; refuses a layer NIR cannot express, by name."""
    chain = []
    for name, child in model.named_children():
        full = f"{prefix}{name}"
        kind = _neuron_kind(child)
        known = isinstance(child, (*SYNAPSES, *NORMS, nn.Flatten, nn.AvgPool2d)) or kind in ("lif", "if")
        if isinstance(child, _SKIPPED) or type(child).__name__ == "Dropout":  # SpikingJelly's Dropout is its own
            continue
        if known:
            chain.append((full, child))
        elif kind == "other":
            raise _refuse(full, child, "NIR has SpikingJelly's LIFNode, ParametricLIFNode and IFNode, not this one")
        elif any(True for _ in child.children()):
            chain += layers(child, f"{full}.")
        else:
            raise _refuse(full, child, "NIR has no such layer")
    return chain


def _folded(layer: nn.Module, named_norm: tuple[str, nn.Module] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight and bias of ``layer`` with the batch norm ``named_norm`` (name, module) after it folded in."""
    weight, bias = layer.weight.detach().double(), None if layer.bias is None else layer.bias.detach().double()
    if named_norm is None:
        return weight, bias
    name, norm = named_norm
    if norm.running_mean is None:
        raise _refuse(name, norm, "without running statistics (track_running_stats=False) it normalises by each batch")
    scale = torch.rsqrt(norm.running_var.double() + norm.eps)
    scale = scale if norm.weight is None else norm.weight.detach().double() * scale
    shift = -norm.running_mean.double() * scale + (0 if norm.bias is None else norm.bias.detach().double())
    weight = weight * scale.view(-1, *[1] * (weight.dim() - 1))
    return weight, shift if bias is None else bias * scale + shift


def _synapse(name: str, layer: nn.Module, norm: tuple[str, nn.Module] | None, shape: tuple[int, ...], gain: float):
    """The NIR node of ``layer`` with ``norm`` folded in, its weight and bias times ``gain``."""
    import nir

    weight, bias = _folded(layer, norm)
    weight, bias = weight * gain, None if bias is None else bias * gain
    if isinstance(layer, nn.Linear):
        return nir.Linear(_numpy(weight)) if bias is None else nir.Affine(_numpy(weight), _numpy(bias))
    if layer.padding_mode != "zeros" or isinstance(layer.padding, str):
        raise _refuse(name, layer, f"padding {layer.padding!r} in mode {layer.padding_mode!r} (NIR pads with zeros by size)")
    bias = _numpy(bias) if bias is not None else np.zeros(weight.shape[0])
    conv, spatial = (nir.Conv1d, shape[-1]) if isinstance(layer, nn.Conv1d) else (nir.Conv2d, shape[-2:])
    single = isinstance(layer, nn.Conv1d)
    pick = (lambda value: value[0]) if single else tuple
    return conv(input_shape=spatial if single else tuple(spatial), weight=_numpy(weight), stride=pick(layer.stride),
                padding=pick(layer.padding), dilation=pick(layer.dilation), groups=layer.groups, bias=bias)


def _resistance(module: nn.Module) -> float:
    """NIR's ``r`` of a SpikingJelly neuron: ``1 / DT`` (IF), 1 (LIF with ``decay_input``) or ``tau``."""
    if _neuron_kind(module) == "if":
        return 1 / DT
    return 1.0 if module.decay_input else _tau(module)


def _tau(module: nn.Module) -> float:
    return 1 / module.w.sigmoid().item() if hasattr(module, "w") else float(module.tau)


def _neuron(name: str, module: nn.Module, shape: tuple[int, ...], r: float):
    import nir

    if module.v_reset is None:
        raise _refuse(name, module, "a soft reset (v_reset = None); NIR's neurons reset to v_reset")
    if not getattr(module.surrogate_function, "spiking", True):
        raise _refuse(name, module, "its surrogate function has spiking=False, so it emits analog values, not spikes")
    full = lambda value: np.full(shape, float(value))  # noqa: E731
    if _neuron_kind(module) == "if":
        return nir.IF(r=full(r), v_threshold=full(module.v_threshold), v_reset=full(module.v_reset))
    return nir.LIF(tau=full(_tau(module) * DT), r=full(r), v_leak=full(module.v_reset),
                   v_threshold=full(module.v_threshold), v_reset=full(module.v_reset))


def to_nir(model: nn.Module, shape: tuple[int, ...]) -> "nir.NIRGraph":
    """The NIR graph of ``model`` (in eval mode) for one sample's frame of ``shape`` a time step."""
    return _graph(layers(model), tuple(shape))[0]


def _graph(chain: list[tuple[str, nn.Module]], shape: tuple[int, ...]
           ) -> tuple["nir.NIRGraph", dict[str, tuple[str, float]]]:
    """The NIR graph of the layers ``chain``, and for each node that stands for a layer the layer whose output it
    gives (a batch norm folded into the node before it: the batch norm) and the gain folded into it."""
    import nir

    nodes, order, sources = {"input": nir.Input(input_type=np.array(shape))}, ["input"], {}
    i = 0
    while i < len(chain):
        name, module = chain[i]
        if isinstance(module, NORMS):
            raise _refuse(name, module, "a BatchNorm is exported folded into the Linear or Conv before it, and none is")
        if isinstance(module, nn.Linear) and len(shape) > 1:
            nodes[f"{name}.flatten"] = nir.Flatten(input_type=np.array(shape), start_dim=0, end_dim=-1)
            order.append(f"{name}.flatten")
            shape = (int(np.prod(shape)),)
        if isinstance(module, SYNAPSES):
            norm = chain[i + 1] if i + 1 < len(chain) and isinstance(chain[i + 1][1], NORMS) else None
            after = chain[i + 1 + (norm is not None)][1] if i + 1 + (norm is not None) < len(chain) else None
            gain = _resistance(after) if _neuron_kind(after) in ("lif", "if") else 1.0
            nodes[name] = _synapse(name, module, norm, shape, gain)
            sources[name] = (norm[0] if norm else name, gain)
            i += norm is not None
        elif isinstance(module, nn.Flatten):
            offset = 1 if hasattr(module, "step_mode") else 2  # SpikingJelly's sees [N, ...], a plain one [T, N, ...]
            start, end = (dim - offset if dim > 0 else dim for dim in (module.start_dim, module.end_dim))
            nodes[name] = nir.Flatten(input_type=np.array(shape), start_dim=start, end_dim=end)
        elif isinstance(module, nn.AvgPool2d):
            if module.ceil_mode or module.divisor_override is not None or (np.any(module.padding) and not module.count_include_pad):
                raise _refuse(name, module, "ceil_mode, divisor_override or padding left out of the average")
            pair = lambda value: (value, value) if isinstance(value, int) else tuple(value)  # noqa: E731
            nodes[name] = nir.AvgPool2d(kernel_size=np.array(pair(module.kernel_size)),
                                        stride=np.array(pair(module.stride)), padding=np.array(pair(module.padding)))
        else:  # a neuron: r folded into the synapse right before it
            folded = isinstance(chain[i - 1][1], (*SYNAPSES, *NORMS)) if i else False
            nodes[name] = _neuron(name, module, shape, 1.0 if folded else _resistance(module))
        sources.setdefault(name, (name, 1.0))
        order.append(name)
        shape = tuple(_step(nodes[name], torch.zeros(1, *shape, dtype=torch.float64), {}).shape[1:])
        i += 1
    nodes["output"] = nir.Output(output_type=np.array(shape))
    order.append("output")
    return nir.NIRGraph(nodes=nodes, edges=list(zip(order, order[1:])), metadata={"dt": DT}), sources


def _step(node, x: torch.Tensor, state: dict) -> torch.Tensor:
    """One time step of NIR node ``node`` on ``x`` ``[N, ...]``; a neuron's voltage is kept in ``state``."""
    import nir

    tensor = lambda value: torch.as_tensor(np.asarray(value), dtype=x.dtype)  # noqa: E731
    if isinstance(node, nir.Affine):
        return F.linear(x, tensor(node.weight), tensor(node.bias))
    if isinstance(node, nir.Linear):
        return F.linear(x, tensor(node.weight))
    if isinstance(node, (nir.Conv1d, nir.Conv2d)):
        conv = F.conv1d if isinstance(node, nir.Conv1d) else F.conv2d
        as_tuple = lambda value: int(value) if np.ndim(value) == 0 else tuple(int(v) for v in value)  # noqa: E731
        return conv(x, tensor(node.weight), tensor(node.bias), as_tuple(node.stride), as_tuple(node.padding),
                    as_tuple(node.dilation), int(node.groups))
    if isinstance(node, nir.AvgPool2d):
        return F.avg_pool2d(x, tuple(int(k) for k in node.kernel_size), tuple(int(s) for s in node.stride),
                            tuple(int(p) for p in node.padding))
    if isinstance(node, nir.Flatten):
        end = int(node.end_dim)
        return x.flatten(int(node.start_dim) + 1, end + 1 if end >= 0 else end)
    if isinstance(node, (nir.LIF, nir.IF)):
        v = state.get("v", tensor(node.v_reset).expand_as(x))
        if isinstance(node, nir.LIF):
            v = v + DT / tensor(node.tau) * (tensor(node.v_leak) - v + tensor(node.r) * x)
        else:
            v = v + DT * tensor(node.r) * x
        spikes = (v >= tensor(node.v_threshold)).to(x.dtype)
        state["v"] = torch.where(spikes.bool(), tensor(node.v_reset).expand_as(x), v)
        return spikes
    return x  # Input, Output


def simulate(graph, frames: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Runs a chain ``graph`` over ``frames`` ``[T, N, ...]`` one time step at a time: its output ``[T, N, ...]``
    and every node's output ``[T, N, ...]`` by node name."""
    import nir

    following = dict(graph.edges)
    order, name = [], next(n for n, node in graph.nodes.items() if isinstance(node, nir.Input))
    while name is not None:
        order.append(name)
        name = following.get(name)
    states, outputs = {name: {} for name in order}, {name: [] for name in order}
    for frame in frames:
        x = frame
        for name in order:
            x = _step(graph.nodes[name], x, states[name])
            outputs[name].append(x)
    return torch.stack(outputs[order[-1]]), {name: torch.stack(steps) for name, steps in outputs.items()}


@attrs.frozen
class Checked:
    """What :func:`export` compared: the samples simulated (``test`` of them test samples, the others random frames
    scaled up to ``scale`` times), the layers whose outputs were compared and the spikes, all equal."""

    samples: int
    test: int
    scale: int
    layers: int
    spikes: int

    def line(self) -> str:
        random = f" and {self.samples - self.test} random frames scaled up to {self.scale} times" if self.scale else ""
        return (f"checked on {self.test} test samples{random}, on which every neuron layer fires: simulated, the graph "
                f"gives the output of each of the model's {self.layers} layers and its {self.spikes:,} spikes")


def export(model: nn.Module, test_frames: torch.Tensor, out: str | Path) -> tuple["nir.NIRGraph", Checked]:
    """Writes ``model``'s NIR graph to ``out`` once its simulation gives the output of every layer of the model and
    every spike (float64) on ``test_frames`` ``[N, T, ...]`` and random frames that make every neuron layer fire;
    refuses, in one line naming the layer, what the graph cannot give as the model computes it."""
    import nir

    model = copy.deepcopy(model).double().eval()  # the caller's model left as it is
    test_frames = test_frames.double()
    chain = layers(model)
    graph, sources = _graph(chain, tuple(test_frames.shape[2:]))
    names = [name for name, _ in chain]
    leaves = {name for name, module in model.named_modules() if name in names or isinstance(module, _SKIPPED)
              or type(module).__name__ == "Dropout"}
    neurons = [name for name, module in chain if _neuron_kind(module)]
    frames, scale = nir_forward.firing_frames(model, test_frames, names, leaves, neurons)
    want, outputs = nir_forward.run(model, frames, names, leaves)
    got, simulated = simulate(graph, frames.transpose(0, 1))
    for node, (name, gain) in sources.items():
        if not _matches(simulated[node], outputs[name], gain, name in neurons):
            raise CheckpointError(f"the NIR graph does not give the output of layer {name} "
                                  f"({type(model.get_submodule(name)).__name__}) on inputs on which every layer fires: "
                                  f"the model's forward is not the chain of its layers (a reshape or reordering in "
                                  f"forward); {nir_forward.AS_STATE_DICT}")
    if not _matches(got, want, 1.0, False):
        raise CheckpointError("the NIR graph does not give the model's output on inputs on which every layer fires: its "
                              f"forward is not the chain of its layers; {nir_forward.AS_STATE_DICT}")
    nir.write(str(out), graph)
    spikes = int(sum(outputs[name].sum().item() for name in neurons))
    return graph, Checked(len(frames), len(test_frames), scale, len(sources), spikes)


def _matches(simulated: torch.Tensor, recorded: torch.Tensor, gain: float, spikes: bool) -> bool:
    """Whether a node's output ``[T, N, ...]`` is a layer's (``[T, N, ...]`` or ``[T * N, ...]``) times ``gain``:
    spikes equal, other values within float64 rounding of the layer's largest."""
    if simulated.numel() != recorded.numel():
        return False
    expected = recorded.reshape(simulated.shape) * gain
    if spikes:
        return torch.equal(simulated, expected)
    largest = float(expected.abs().max()) if expected.numel() else 0.0
    return torch.allclose(simulated, expected, rtol=1e-9, atol=1e-12 * max(largest, 1.0))
