"""``snnfw export --format nir``: a network as a Neuromorphic Intermediate Representation graph, and back.

The network is read as the chain of its layers in the order they are registered (containers such as
``nn.Sequential`` and SpikingJelly's ``SeqToANNContainer`` opened), one time step a sample:

- ``Linear`` -> ``nir.Affine`` (``nir.Linear`` without a bias), ``Conv1d``/``Conv2d`` -> ``nir.Conv1d``/``Conv2d``,
  a ``BatchNorm`` right after one folded into its weight and bias (eval statistics);
- SpikingJelly's ``LIFNode``/``ParametricLIFNode`` -> ``nir.LIF``, ``IFNode`` -> ``nir.IF`` (hard reset only);
- ``Flatten`` -> ``nir.Flatten``, and one before a ``Linear`` that receives a feature map (the model's
  ``torch.flatten``); ``AvgPool2d`` -> ``nir.AvgPool2d``; ``Dropout`` and ``Identity`` left out.

Anything else is refused naming the layer. Neurons: SpikingJelly's discrete step with ``tau`` is
``v += (x - (v - v_reset)) / tau`` (``decay_input``) or ``v += x - (v - v_reset) / tau``, NIR's LIF is
``tau_nir dv/dt = (v_leak - v) + r x``: with ``tau_nir = tau * DT``, ``v_leak = v_reset`` and ``r = 1``
(``decay_input``) or ``tau``, its Euler step of ``DT`` is SpikingJelly's step; an IF's ``r = 1 / DT``. A neuron
spikes where ``v >= v_threshold`` and is then set to ``v_reset``. :func:`simulate` runs a graph so, and
:func:`export` refuses a graph whose simulation does not give the model's spikes on an example batch.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from snnfw.errors import CheckpointError

DT = 1e-4  # seconds a time step, as SpikingJelly's own NIR exchange
_SKIPPED = (nn.Dropout, nn.Identity)


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().cpu().double().numpy()


def _refuse(name: str, module: nn.Module, why: str) -> CheckpointError:
    return CheckpointError(f"layer {name} ({type(module).__name__}) cannot be expressed in NIR: {why}; export it as a "
                           "state dict (without --format nir), or replace the layer")


def _neuron_kind(module: nn.Module) -> str | None:
    from spikingjelly.activation_based import neuron

    for kind, classes in (("lif", (neuron.LIFNode, neuron.ParametricLIFNode)), ("if", (neuron.IFNode,))):
        if isinstance(module, classes):
            return kind
    return "other" if isinstance(module, neuron.BaseNode) else None


def layers(model: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module]]:
    """The chain of layers NIR maps, in registration order; refuses a layer NIR cannot express, by name."""
    chain = []
    for name, child in model.named_children():
        full = f"{prefix}{name}"
        known = isinstance(child, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.BatchNorm1d, nn.BatchNorm2d, nn.Flatten,
                                   nn.AvgPool2d)) or _neuron_kind(child) not in (None, "other")
        if isinstance(child, _SKIPPED) or type(child).__name__ == "Dropout":  # SpikingJelly's Dropout is its own
            continue
        if known:
            chain.append((full, child))
        elif _neuron_kind(child) == "other":
            raise _refuse(full, child, "NIR has LIF and IF neurons")
        elif any(True for _ in child.children()):
            chain += layers(child, f"{full}.")
        else:
            raise _refuse(full, child, "NIR has no such layer")
    return chain


def _folded(layer: nn.Module, norm: nn.Module | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight and bias of ``layer`` with the batch norm ``norm`` after it folded in."""
    weight, bias = layer.weight.detach().double(), None if layer.bias is None else layer.bias.detach().double()
    if norm is None:
        return weight, bias
    scale = norm.weight.detach().double() / torch.sqrt(norm.running_var.double() + norm.eps)
    shift = norm.bias.detach().double() - norm.running_mean.double() * scale
    weight = weight * scale.view(-1, *[1] * (weight.dim() - 1))
    return weight, shift if bias is None else bias * scale + shift


def _synapse(name: str, layer: nn.Module, norm: nn.Module | None, shape: tuple[int, ...]):
    import nir

    weight, bias = _folded(layer, norm)
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


def _neuron(name: str, module: nn.Module, shape: tuple[int, ...]):
    import nir

    if module.v_reset is None:
        raise _refuse(name, module, "a soft reset (v_reset = None); NIR's neurons reset to v_reset")
    full = lambda value: np.full(shape, float(value))  # noqa: E731
    if _neuron_kind(module) == "if":
        return nir.IF(r=full(1 / DT), v_threshold=full(module.v_threshold), v_reset=full(module.v_reset))
    tau = 1 / module.w.sigmoid().item() if hasattr(module, "w") else module.tau
    return nir.LIF(tau=full(tau * DT), r=full(1.0 if module.decay_input else tau), v_leak=full(module.v_reset),
                   v_threshold=full(module.v_threshold), v_reset=full(module.v_reset))


def to_nir(model: nn.Module, shape: tuple[int, ...]) -> "nir.NIRGraph":
    """The NIR graph of ``model`` (in eval mode) for one sample's frame of ``shape`` a time step."""
    import nir

    chain, nodes, order = layers(model), {}, []
    shape = tuple(shape)
    nodes["input"] = nir.Input(input_type=np.array(shape))
    order.append("input")
    i = 0
    while i < len(chain):
        name, module = chain[i]
        following = chain[i + 1][1] if i + 1 < len(chain) else None
        if isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d)):
            raise _refuse(name, module, "a BatchNorm is exported folded into the Linear or Conv before it, and none is")
        if isinstance(module, nn.Linear) and len(shape) > 1:
            nodes[f"{name}.flatten"] = nir.Flatten(input_type=np.array(shape), start_dim=0, end_dim=-1)
            order.append(f"{name}.flatten")
            shape = (int(np.prod(shape)),)
        if isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d)):
            norm = following if isinstance(following, (nn.BatchNorm1d, nn.BatchNorm2d)) else None
            nodes[name] = _synapse(name, module, norm, shape)
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
        else:
            nodes[name] = _neuron(name, module, shape)
        order.append(name)
        shape = tuple(_step(nodes[name], torch.zeros(1, *shape, dtype=torch.float64), {}).shape[1:])
        i += 1
    nodes["output"] = nir.Output(output_type=np.array(shape))
    order.append("output")
    return nir.NIRGraph(nodes=nodes, edges=list(zip(order, order[1:])))


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
    and every neuron node's spikes ``[T, N, ...]`` by node name."""
    import nir

    following = dict(graph.edges)
    order, name = [], next(n for n, node in graph.nodes.items() if isinstance(node, nir.Input))
    while name is not None:
        order.append(name)
        name = following.get(name)
    states = {name: {} for name in order}
    outputs, spikes = [], {name: [] for name in order if isinstance(graph.nodes[name], (nir.LIF, nir.IF))}
    for frame in frames:
        x = frame
        for name in order:
            x = _step(graph.nodes[name], x, states[name])
            if name in spikes:
                spikes[name].append(x)
        outputs.append(x)
    return torch.stack(outputs), {name: torch.stack(steps) for name, steps in spikes.items()}


def model_spikes(model: nn.Module, frames: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``model``'s output on ``frames`` ``[N, T, ...]`` and every NIR-mapped neuron's spikes ``[T, N, ...]``."""
    from spikingjelly.activation_based import functional

    recorded, handles = {}, []
    for name, module in layers(model):
        if _neuron_kind(module) is not None:
            handles.append(module.register_forward_hook(lambda m, args, out, name=name: recorded.__setitem__(name, out)))
    functional.reset_net(model)
    try:
        with torch.no_grad():
            out = model(frames)
    finally:
        for handle in handles:
            handle.remove()
        functional.reset_net(model)
    return out, recorded


def export(model: nn.Module, frames: torch.Tensor, out: str | Path) -> tuple["nir.NIRGraph", int]:
    """Writes ``model``'s NIR graph to ``out`` once its simulation gives the model's spikes on ``frames``
    ``[N, T, ...]`` (float64); returns the graph and the spikes compared."""
    import nir

    model = model.double().eval()
    frames = frames.double()
    graph = to_nir(model, tuple(frames.shape[2:]))
    want, spikes = model_spikes(model, frames)
    got, simulated = simulate(graph, frames.transpose(0, 1))
    for name, value in spikes.items():
        if not torch.equal(simulated[name], value):
            raise CheckpointError(f"the NIR graph does not reproduce the spikes of layer {name}: the model's forward "
                                  "is not the chain of its layers (a residual, a reshape in forward); export it as a "
                                  "state dict (without --format nir)")
    if not torch.allclose(got, want, rtol=1e-9, atol=1e-12):
        raise CheckpointError("the NIR graph does not reproduce the model's output: its forward is not the chain of "
                              "its layers; export it as a state dict (without --format nir)")
    nir.write(str(out), graph)
    return graph, int(sum(value.sum().item() for value in spikes.values()))
