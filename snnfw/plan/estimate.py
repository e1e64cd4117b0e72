"""Cost estimates that strategy plugins attach to their proposals, so ``auto`` can rank them.

The core measures the model once (:func:`measure_cost`); each strategy turns
that into per-rank memory, communication and compute for its layout with
:func:`estimate`. The figures are coarse by design: they order candidates,
they do not predict milliseconds.
"""

from __future__ import annotations

import copy
import os
import time
from typing import TYPE_CHECKING

import attrs

from snnfw.components.losses import cross_entropy

if TYPE_CHECKING:
    import torch

BYTES = 4  # fp32
BANDWIDTH = {"cpu": 1e9, "cuda": 5e10}  # bytes/s of the collective backend, for ranking only


@attrs.frozen
class ModelCost:
    """What the model costs per sample on one process."""

    parameters: int
    activation_bytes: float  # tensors saved for backward
    neuron_state_bytes: float
    step_ms: float  # forward + backward

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

    @property
    def memory_bytes(self) -> float:
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_bytes + self.activation_bytes + self.neuron_state_bytes

    @property
    def static_bytes(self) -> float:
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_bytes

    def step_ms(self, device_type: str) -> float:
        return self.compute_ms / (1.0 - self.bubble) + self.comm_bytes / BANDWIDTH[device_type] * 1e3

    def capacity(self, memory: float, replicas: int) -> float:
        """The largest global batch whose activations fit beside the static memory."""
        per_sample = (self.activation_bytes + self.neuron_state_bytes) / self.samples
        return max(memory - self.static_bytes, 0.0) / per_sample * replicas

    def summary(self, device_type: str) -> str:
        bubble = f", bubble {self.bubble:.0%}" if self.bubble else ""
        return (
            f"~{self.memory_bytes / 2**20:.1f} MB/rank (static {self.static_bytes / 2**20:.1f}), "
            f"comm {self.comm_bytes / 2**20:.1f} MB/step, ~{self.step_ms(device_type):.0f} ms/step{bubble}"
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
        compute_ms=samples * cost.step_ms / compute_shards,
        samples=samples,
        bubble=bubble,
    )


def ring_bytes(nbytes: float, ranks: int) -> float:
    """Bytes each rank sends in a ring all-reduce of ``nbytes`` over ``ranks``."""
    return 2 * (ranks - 1) / ranks * nbytes if ranks > 1 else 0.0


def device_memory_bytes(device_type: str, local_ranks: int) -> float:
    """Memory one rank may use: the GPU's, or an even share of host memory."""
    if device_type == "cuda":
        import torch

        return torch.cuda.get_device_properties(0).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(local_ranks, 1)


def measure_cost(model: torch.nn.Module, example: torch.Tensor, labels: torch.Tensor, reset) -> ModelCost:
    """Times one forward and backward of ``example`` on a copy of ``model`` and counts
    saved-for-backward and neuron-state bytes."""
    import torch

    model = copy.deepcopy(model)
    saved = 0

    def pack(tensor):
        nonlocal saved
        saved += tensor.numel() * tensor.element_size()
        return tensor

    def step():
        reset(model)
        cross_entropy({"label_smoothing": 0.0})(model(example), labels).backward()

    samples = len(labels)
    model.train()
    step()  # warm-up: first calls allocate and initialise lazily
    started = time.perf_counter()
    step()
    elapsed_ms = (time.perf_counter() - started) * 1e3
    reset(model)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        cross_entropy({"label_smoothing": 0.0})(model(example), labels)
    state = sum(v.numel() * v.element_size() for m in model.modules() if isinstance(v := getattr(m, "v", None), torch.Tensor))
    return ModelCost(
        parameters=sum(p.numel() for p in model.parameters()),
        activation_bytes=saved / samples,
        neuron_state_bytes=state / samples,
        step_ms=elapsed_ms / samples,
    )
