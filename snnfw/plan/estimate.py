"""Cost estimates that strategy plugins attach to their proposals, so ``auto`` can rank them.

The core measures the model once (:func:`measure_cost`); each strategy turns
that into per-rank memory, communication and compute for its layout with
:func:`estimate`. The figures are coarse: they order candidates;
:mod:`snnfw.plan.cost_model` predicts milliseconds from them.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import statistics
import time
from typing import TYPE_CHECKING, Callable

import attrs

from snnfw.components.losses import cross_entropy, next_token
from snnfw.components.precision import full_precision

if TYPE_CHECKING:
    import torch

BYTES = 4  # fp32
LARGER = 4  # the larger batch measure_cost times, in examples


@attrs.frozen
class ModelCost:
    """What the model costs per sample on one process."""

    parameters: int
    activation_bytes: float  # tensors saved for backward
    neuron_state_bytes: float
    step_ms: float  # forward + backward, each sample's
    optimizer_ms: float = 0.0  # one optimizer step over every parameter (0: not measured)
    threads: int = 0  # the threads it was timed at
    fixed_ms: float = 0.0  # forward + backward whatever the samples (each layer's calls), once a step
    neuron_share: float = 0.0  # the share of a forward spent in the neurons, taken as their share of backward too

    @property
    def parameter_bytes(self) -> float:
        return self.parameters * BYTES


@attrs.frozen
class Estimate:
    """Per-rank memory, communication and compute of one candidate plan for one step."""

    parameter_bytes: float
    gradient_bytes: float
    optimizer_bytes: float
    activation_bytes: float
    neuron_state_bytes: float
    comm_bytes: float
    compute_ms: float
    samples: float  # per rank per step
    bubble: float = 0.0
    calls: float = 0.0  # collective calls per step (their latency adds up where messages are small)

    @property
    def memory_bytes(self) -> float:
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_bytes + self.activation_bytes + self.neuron_state_bytes

    @property
    def static_bytes(self) -> float:
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_bytes

    def capacity(self, memory: float, replicas: int) -> float:
        """The largest global batch whose activations fit beside the static memory."""
        per_sample = (self.activation_bytes + self.neuron_state_bytes) / self.samples
        return max(memory - self.static_bytes, 0.0) / per_sample * replicas

    def summary(self) -> str:
        bubble = f", bubble {self.bubble:.0%}" if self.bubble else ""
        return (
            f"~{self.memory_bytes / 2**20:.1f} MB/rank (static {self.static_bytes / 2**20:.1f}), "
            f"comm {self.comm_bytes / 2**20:.1f} MB/step{bubble}"
        )


def estimate(
    request,
    *,
    samples: float,
    parameter_shards: float = 1,
    gradient_shards: float | None = None,
    optimizer_shards: float | None = None,
    activation_shards: float = 1,
    comm_bytes: float = 0.0,
    compute_shards: float = 1,
    bubble: float = 0.0,
    calls: float = 0.0,
) -> Estimate | None:
    """Scales the measured per-sample cost to ``samples`` per rank and the given shard factors.

    None when the request carries no measured cost (only ``auto`` measures).
    """
    cost = request.cost
    if cost is None:
        return None
    moments = request.plugins.optimizers.get(request.config.train.optimizer).state_tensors
    params = cost.parameter_bytes
    return Estimate(
        parameter_bytes=params / parameter_shards,
        gradient_bytes=params / (gradient_shards or parameter_shards),
        optimizer_bytes=moments * params / (optimizer_shards or parameter_shards),
        activation_bytes=samples * cost.activation_bytes / activation_shards,
        neuron_state_bytes=samples * cost.neuron_state_bytes / activation_shards,
        comm_bytes=comm_bytes,
        compute_ms=cost.fixed_ms + samples * cost.step_ms / compute_shards,
        samples=samples,
        bubble=bubble,
        calls=calls,
    )


def ddp_buckets(nbytes: float) -> int:
    """All-reduces DDP makes of ``nbytes`` of gradients: a first bucket of 1 MiB, then 25 MiB ones."""
    return 0 if nbytes <= 0 else 1 + math.ceil(max(nbytes - 2**20, 0) / (25 * 2**20))


def ring_bytes(nbytes: float, ranks: int) -> float:
    """Bytes each rank sends in a ring all-reduce of ``nbytes`` over ``ranks``."""
    return 2 * (ranks - 1) / ranks * nbytes if ranks > 1 else 0.0


def device_memory_bytes(device_type: str, local_ranks: int) -> float:
    """Memory one rank may use: the GPU's, or an even share of host memory."""
    if device_type == "cuda":
        import torch

        return torch.cuda.get_device_properties(0).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(local_ranks, 1)


def measure_cost(model: torch.nn.Module, example: torch.Tensor, labels: torch.Tensor, reset,
                 optimizer: Callable | None = None, threads: int | None = None,
                 precision: Callable = contextlib.nullcontext, transform: Callable | None = None) -> ModelCost:
    """Times one forward and backward on a copy of ``model`` of ``example`` and of it repeated :data:`LARGER` times,
    which tells the time each sample adds from the time a step takes whatever its samples (each layer's calls:
    the larger part of a small model's step on a few samples), and a step of ``optimizer(parameters)`` where
    given, at ``threads`` threads (default: this process's); the neurons' share of a forward; counts
    saved-for-backward and neuron-state bytes.
    Forward and backward run under ``precision()`` (``train.precision``'s autocast), on the copy as
    ``transform(copy, example)`` leaves it where given (the run's model transforms and compilation)."""
    import torch

    model = copy.deepcopy(model)
    if transform is not None:
        transform(model, example)
    saved = 0

    def pack(tensor):
        nonlocal saved
        saved += tensor.numel() * tensor.element_size()
        return tensor

    def forward(frames):
        reset(model)
        with precision():
            return model(frames)

    loss = next_token({}) if labels.dim() > 1 else cross_entropy({"label_smoothing": 0.0})  # a language model's

    def step(frames, targets):
        loss(full_precision(forward(frames)), targets).backward()

    larger = example.repeat(LARGER, *(1,) * (example.dim() - 1)), labels.repeat(LARGER, *(1,) * (labels.dim() - 1))
    samples, before = len(labels), torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        model.train()
        small, large = _median_ms(lambda: step(example, labels)), _median_ms(lambda: step(*larger))
        each = max(large - small, 0.0) / (samples * (LARGER - 1)) or large / (samples * LARGER)
        fixed = max(small - each * samples, 0.0)
        optimizer_ms = 0.0
        if optimizer is not None:
            optimizer_ms = _median_ms(optimizer([p for p in model.parameters() if p.requires_grad]).step)
        share = _neuron_share(model, lambda: forward(larger[0]))
    finally:
        torch.set_num_threads(before)
    reset(model)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), precision():
        loss(full_precision(model(example)), labels)
    state = sum(v.numel() * v.element_size() for m in model.modules() if isinstance(v := getattr(m, "v", None), torch.Tensor))
    return ModelCost(
        parameters=sum(p.numel() for p in model.parameters()),
        activation_bytes=saved / samples,
        neuron_state_bytes=state / samples,
        step_ms=each,
        optimizer_ms=optimizer_ms,
        threads=threads or before,
        fixed_ms=fixed,
        neuron_share=share,
    )


def _neuron_share(model: torch.nn.Module, forward: Callable, repeats: int = 3) -> float:
    """The share of ``forward()``'s time that ``model``'s neurons take (timed by hooks around each), the median of
    ``repeats`` calls."""
    from snnfw.model.analysis import is_neuron

    spent, started = [0.0], {}

    def before(module, args):
        started[id(module)] = time.perf_counter()

    def after(module, args, output):
        spent[0] += time.perf_counter() - started.pop(id(module))

    neurons = [m for m in model.modules() if is_neuron(m)]
    handles = [hook for m in neurons for hook in (m.register_forward_pre_hook(before), m.register_forward_hook(after))]
    shares = []
    try:
        for _ in range(repeats):
            spent[0], begun = 0.0, time.perf_counter()
            forward()
            shares.append(spent[0] / max(time.perf_counter() - begun, 1e-9))
    finally:
        for hook in handles:
            hook.remove()
    return statistics.median(shares)


def _median_ms(work: Callable, repeats: int = 3) -> float:
    """The median of ``repeats`` timed calls of ``work`` after one untimed (first calls allocate lazily)."""
    work()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)
