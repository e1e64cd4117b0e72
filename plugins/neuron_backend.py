"""``model.neuron_backend``: which implementation runs SpikingJelly's neurons, for every family.

SpikingJelly 2.0 neurons have no per-module backend; its neuron operators
pick an implementation per device and process. ``torch`` (the default) runs
them eagerly as SpikingJelly dispatches them: its Torch reference on CPU; on
CUDA its own pick (native CUDA, else Triton, else the reference; its
``SJ_<NEURON>_CUDA_IMPLEMENTATION`` variables pin one). ``cuda`` (its native
CUDA kernels) and ``triton`` (its Triton kernels) need CUDA and pin that
implementation for every neuron operator before the first forward. Under
bf16 or fp16 autocast a neuron's voltage takes its input's dtype, and
SpikingJelly's kernels take only a float32 one: on CUDA ``torch`` then runs its
Torch reference, and ``cuda`` and ``triton`` are refused.
``inductor`` runs each multi-step LIF neuron as two Inductor kernels, its
whole sequence forward and its backward (:mod:`snnfw_plugins.lif_kernel`:
SpikingJelly's arithmetic, fused; 5x faster than its CPU operator for the
VGG's layers), and compiles the forward of every other neuron kind with
``torch.compile`` (one dynamic-shape graph per kind), at the point where
strategies compile (see ``compile``). A backend that cannot run here is
refused when planning, with the reason.
"""

from __future__ import annotations

import importlib
from importlib.util import find_spec

import attrs

from snnfw import hookimpl
from snnfw.api import Proposal
from snnfw_plugins.compile import inductor_refusal

BACKENDS = ("torch", "cuda", "triton", "inductor")


@attrs.frozen
class BackendKeys:
    """``model.neuron_backend`` (entry point ``snnfw.config``: ``model.neuron_backend``)."""

    neuron_backend: str = attrs.field(default="torch", validator=attrs.validators.in_(BACKENDS))

NEURON_OPERATORS = ("if_", "lif", "plif", "qif", "eif", "izhikevich", "ilif", "activation_aware_if", "stbif", "clif")
KERNELS = {"cuda": "native CUDA", "triton": "Triton"}


def refusal(backend: str, device_type: str, precision: str = "fp32") -> str | None:
    """Why ``backend`` cannot run the neurons on ``device_type`` under ``train.precision`` here, or None."""
    if backend == "torch":
        return None
    if backend == "inductor":
        return inductor_refusal(device_type)
    kernels = KERNELS[backend]
    if device_type != "cuda":
        return f"it runs SpikingJelly's {kernels} neuron kernels, which need CUDA; use \"torch\" or \"inductor\" on CPU"
    if precision in ("bf16", "fp16"):  # SpikingJelly keeps a neuron's voltage in its input's dtype
        return (f"SpikingJelly's {kernels} neuron kernels take a float32 voltage, and under train.precision = "
                f"\"{precision}\" a neuron's voltage takes its input's {precision}, which only SpikingJelly's Torch "
                "reference runs; use \"torch\" (that reference) or \"inductor\" (which computes the voltage in float32)")
    if backend == "triton" and find_spec("triton") is None:
        return "triton is not installed"
    if backend == "cuda":
        return _native_refusal()
    return None


def _native_refusal() -> str | None:
    """Why SpikingJelly's native LIF operator cannot load here (not built, or built for another torch, CUDA or
    operator ABI), or None; the GPU's architecture is checked when the neuron first runs."""
    from spikingjelly._ops.native_loader import _load_native

    try:
        _load_native("spikingjelly._ops.lif")
    except (ImportError, OSError) as error:
        return f"SpikingJelly's native CUDA operators cannot load: {error}"
    return None


@hookimpl
def snnfw_plan(request):
    backend = request.config.model.neuron_backend
    if reason := refusal(backend, request.topology.device_type, request.config.train.precision):
        return Proposal.refuse(request.strategy, f"model.neuron_backend = {backend!r}: {reason}")
    return None


@hookimpl
def snnfw_tune_settings(config, analysis, device_type):
    """Every backend that can run the neurons here (under the config's ``train.precision``)."""
    if not analysis.neurons:
        return None
    precision = config.train.precision
    return {"model.neuron_backend": tuple(b for b in BACKENDS if refusal(b, device_type, precision) is None)}


def select_cuda_implementation(name: str) -> None:
    """Makes every SpikingJelly neuron operator use implementation ``name`` on CUDA from now on."""
    for package in NEURON_OPERATORS:
        selection = importlib.import_module(f"spikingjelly._ops.{package}")._selection
        if selection._requested != name:
            selection._requested = name
            selection._selections.clear()
            selection._compiled_selections.clear()


@hookimpl(tryfirst=True)
def snnfw_transform_model(model, plan, example, hooks):
    backend = plan.config.model.neuron_backend
    if plan.device_type == "cuda" and backend in KERNELS:
        select_cuda_implementation(backend)


@hookimpl
def snnfw_compile(model, plan):
    if plan.config.model.neuron_backend != "inductor":
        return
    import torch
    from spikingjelly.activation_based.neuron import BaseNode

    from snnfw_plugins import lif_kernel

    neurons = [m for m in model.modules() if isinstance(m, BaseNode)]
    others = [neuron for neuron in neurons if not lif_kernel.fits(neuron)]
    limit = 2 * len(others) + 8  # the neurons share their class's code and its recompile budget
    for neuron in neurons:
        if neuron in others:
            neuron.forward = torch.compile(neuron.forward, backend="inductor", dynamic=True, recompile_limit=limit)
        else:
            lif_kernel.install(neuron)
