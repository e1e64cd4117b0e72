"""SpikingJelly's multi-step LIF neuron as two Inductor kernels: the whole sequence forward, and its backward.

SpikingJelly runs a LIF layer on the CPU as eager ops, each a full pass over
one time step of the layer's activations (about 10 per step forward and 15
backward). Here the same arithmetic, in the same order, is written once in
torch ops over all T steps and compiled by Inductor into one loop forward and
one backward, which read the inputs and write the outputs once. Spikes and
the final voltage equal SpikingJelly's operator in float32, the input
gradient within 2 ulps (tests/test_lif_kernel.py). For backward it saves the
charged voltage of every step, as that operator does, but not the inputs,
which it also keeps for a double backward (this one has none). ``install``
gives this multi-step forward to a ``LIFNode`` with one of SpikingJelly's
surrogates, no voltage trace and no per-neuron precision (``fits``).
"""

from __future__ import annotations

import math
from functools import partial

import torch
from spikingjelly.activation_based import surrogate
from spikingjelly.activation_based.neuron import LIFNode
from torch._subclasses.fake_tensor import is_fake

SURROGATE_GRADIENTS = {  # SpikingJelly's surrogates by class name: d spike / d (h - threshold)
    "Sigmoid": lambda x, a: (1 - torch.sigmoid(a * x)) * torch.sigmoid(a * x) * a,
    "ATan": lambda x, a: (a / 2) / (1 + (x * (math.pi / 2 * a)) ** 2),
    "PiecewiseQuadratic": lambda x, a: (a - a * a * x.abs()).clamp_min(0),
    "PiecewiseExp": lambda x, a: (a / 2) * torch.exp(-a * x.abs()),
    "SoftSign": lambda x, a: 1 / (2 * a * (1 / a + x.abs()) ** 2),
    "SuperSpike": lambda x, a: a / (1 + x.abs()) ** 2,
    "Erf": lambda x, a: (a / math.sqrt(math.pi)) * torch.exp(-((a * x) ** 2)),
}


def _forward(x_seq, v, tau: float, decay_input: bool, threshold: float, reset: float | None):
    """Spikes ``[T, ...]`` in the input's dtype, the last voltage and the charged voltage of every step."""
    compute = torch.promote_types(torch.promote_types(x_seq.dtype, v.dtype), torch.float32)
    v, rest = v.to(compute), 0.0 if reset is None else reset
    spikes, charged = [], []
    for x in x_seq.to(compute):
        h = v + (x - (v - rest)) / tau if decay_input else v - (v - rest) / tau + x
        spike = (h >= threshold).to(compute)
        v = h - spike * threshold if reset is None else spike * reset + (1 - spike) * h
        spikes.append(spike.to(x_seq.dtype))
        charged.append(h)
    return torch.stack(spikes), v, torch.stack(charged)


def _backward(grad_spikes, grad_v, charged, tau: float, decay_input: bool, threshold: float, reset: float | None,
              detach_reset: bool, surrogate: str, alpha: float):
    """The gradients of the input sequence and of the initial voltage."""
    surrogate_gradient = SURROGATE_GRADIENTS[surrogate]
    grads, carry = [], grad_v.to(charged.dtype)
    for t in range(charged.shape[0] - 1, -1, -1):
        h = charged[t]
        slope = surrogate_gradient(h - threshold, alpha)
        if reset is None:
            through_reset = 1 if detach_reset else 1 - threshold * slope
        else:
            through_reset = 1 - (h >= threshold).to(h.dtype)
            if not detach_reset:
                through_reset = through_reset + (reset - h) * slope
        grad_h = grad_spikes[t].to(h.dtype) * slope + carry * through_reset
        grads.append(grad_h / tau if decay_input else grad_h)
        carry = grad_h - grad_h / tau
    return torch.stack(grads[::-1]).to(grad_spikes.dtype), carry


_compiled: dict[str, object] = {}


def _kernel(name: str, fn, example: torch.Tensor):
    """``fn`` compiled (dynamic shapes and scalars; a graph per dtype and set of neuron options), or ``fn``
    itself inside a compiled block (whose graph then holds it) and for fake tensors (the dry run).
    Past the recompile limit dynamo runs ``fn`` eagerly: the same values."""
    if torch.compiler.is_compiling() or is_fake(example):
        return fn
    if name not in _compiled:
        _compiled[name] = torch.compile(fn, backend="inductor", dynamic=True, recompile_limit=64)
    return _compiled[name]


class LIFSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_seq, v, tau, decay_input, threshold, reset, detach_reset, surrogate, alpha):
        spikes, v_last, charged = _kernel("forward", _forward, x_seq)(x_seq, v, tau, decay_input, threshold, reset)
        ctx.save_for_backward(charged)
        ctx.options = (tau, decay_input, threshold, reset, detach_reset, surrogate, alpha)
        ctx.v_dtype = v.dtype
        return spikes, v_last

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_spikes, grad_v_last):
        (charged,) = ctx.saved_tensors
        grad_x, grad_v = _kernel("backward", _backward, charged)(grad_spikes, grad_v_last, charged, *ctx.options)
        return grad_x, grad_v.to(ctx.v_dtype), None, None, None, None, None, None, None


def _multi_step_forward(neuron, x_seq: torch.Tensor) -> torch.Tensor:
    v = neuron.materialize_states((x_seq,), tuple(neuron._memories.values()), "m")[0]
    spikes, v = LIFSequence.apply(x_seq, v, neuron.tau, neuron.decay_input, neuron.v_threshold, neuron.v_reset,
                                  neuron.detach_reset, type(neuron.surrogate_function).__name__,
                                  float(neuron.surrogate_function.alpha))
    neuron._memories["v"] = v
    neuron.v_seq = None
    return spikes


def fits(neuron) -> bool:
    """Whether ``neuron`` is a LIF neuron this kernel computes as SpikingJelly's operator would."""
    function = neuron.surrogate_function
    return (
        type(neuron) is LIFNode
        and not neuron.store_v_seq
        and getattr(neuron, "_neuron_precision", None) is None
        and type(function).__module__ == surrogate.__name__
        and type(function).__name__ in SURROGATE_GRADIENTS
        and getattr(function, "spiking", True)
        and isinstance(function.alpha, (int, float))
    )


def install(neuron) -> None:
    """Runs ``neuron``'s multi-step forward on the two kernels (``fits(neuron)`` must hold). A wrapper already
    around the neuron's steps (tsp's chain over the time ranks) stays: the kernels replace what it wraps, its
    ``__wrapped__``."""
    forward = partial(_multi_step_forward, neuron)
    wrapper = vars(neuron).get("multi_step_forward")
    if not hasattr(wrapper, "__wrapped__"):
        neuron.multi_step_forward = forward
        return
    while hasattr(wrapper.__wrapped__, "__wrapped__"):
        wrapper = wrapper.__wrapped__
    wrapper.__wrapped__ = forward
