"""A training step's model FLOPs and the model FLOPs utilisation (MFU) of the devices that train it.

Model FLOPs count the synaptic layers' dense multiply-accumulates (``Linear``, ``Conv1d/2d/3d``, as
:func:`snnfw.components.ops.dense_macs` counts them: what a GPU computes, spikes or not), 2 FLOPs each, and the
backward pass as twice the forward, so a sample's step is ``6 x`` its forward MACs; the neurons', BatchNorm's and
the optimizer's elementwise work and activation recomputation are left out, as MFU's definition does. MFU is the
FLOP/s a step achieves over the peak of all ranks' devices, one device a rank: ``log.peak_tflops`` (a device's, in
TFLOP/s) or, on a GPU of :data:`PEAK_TFLOPS`, its data sheet's dense peak for the run's precision. On a CPU, or a GPU
not in the table, without ``log.peak_tflops``, there is no peak to divide by and MFU is left out.
"""

from __future__ import annotations

import re
from typing import Callable

import torch
from torch import nn

from snnfw.components.ops import SYNAPTIC, dense_macs

# NVIDIA's data sheets, dense (without sparsity), in TFLOP/s: (TF32 tensor cores, BF16 and FP16 tensor cores)
PEAK_TFLOPS = (
    (r"H200(?!.*NVL)", (494.5, 989.5)),  # H200 SXM
    (r"H100.*PCIe", (378.0, 756.0)),
    (r"H100(?!.*(PCIe|NVL))", (494.5, 989.5)),  # H100 SXM ("NVIDIA H100 80GB HBM3")
    (r"A100", (156.0, 312.0)),
    (r"L40S", (183.0, 362.0)),
    (r"\bL4\b", (60.0, 121.0)),
)


def device_peak_tflops(config, device: torch.device) -> float | None:
    """A device's peak TFLOP/s for this run: ``log.peak_tflops``, else the table's for its GPU and the run's
    precision (fp32 runs on TF32 tensor cores, which cuDNN's convolutions use by default), else None (a CPU, a GPU
    not in the table, float64)."""
    if config.log.peak_tflops is not None:
        return config.log.peak_tflops
    if device.type != "cuda" or config.train.dtype != "float32":
        return None
    name = torch.cuda.get_device_name(device)
    tf32, half = next((peaks for pattern, peaks in PEAK_TFLOPS if re.search(pattern, name)), (None, None))
    return half if config.train.precision in ("bf16", "fp16") else tf32


def training_flops_per_sample(model: nn.Module, time_steps: int, frame: tuple[int, ...],
                              reset: Callable[[nn.Module], None]) -> float | None:
    """A training step's model FLOPs a sample (``6 x`` the dense MACs of a forward pass), counted on one sample of
    zeros (``[1, T, C, H, W]``) in eval mode without gradients, on the device and dtype of the model's parameters
    (the meta device included, where shapes alone are computed); the model's modes, neuron state and random state
    are left as they were. None where the model does not run on the meta device."""
    first = next(iter(model.parameters()), None)
    device, dtype = (first.device, first.dtype) if first is not None else (torch.device("cpu"), torch.float32)
    macs = []

    def count(module, inputs, output) -> None:
        macs.append(dense_macs(module, inputs[0], output))

    hooks = [m.register_forward_hook(count) for m in model.modules() if isinstance(m, SYNAPTIC)]
    modes = {module: module.training for module in model.modules()}
    model.eval()
    forked = torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])
    try:
        with forked, torch.no_grad():
            model(torch.zeros(1, time_steps, *frame, device=device, dtype=dtype))
    except (NotImplementedError, RuntimeError):
        if device.type != "meta":
            raise
        return None
    finally:
        for hook in hooks:
            hook.remove()
        for module, training in modes.items():
            module.training = training
        reset(model)
    return 6.0 * sum(macs)
