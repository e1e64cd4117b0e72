"""The gradient norm of the whole model, whatever strategy holds its pieces, and clipping by it.

Each rank holds pieces of the gradient: whole (``none``, and replicas under
``dp`` and ``zero``), DTensor shards (FSDP2, DTensor tensor parallel),
channel slices (snnfw's tensor-parallel styles note them in
``snnfw_slices``), or only its pipeline stages' parameters. A piece held
alike by ``k`` ranks counts ``1 / k`` on each, so one sum over the world
counts every piece of every parameter once, as ``none`` would.
"""

from __future__ import annotations

import math

import torch

from snnfw.distributed.collectives import all_reduce

SLICES = "snnfw_slices"  # written by tensor-parallel styles: parameter name -> TensorSlice
EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s


def _pieces(grad: torch.Tensor, sliced_over) -> tuple[torch.Tensor, int]:
    """The local tensor of ``grad`` and how many distinct pieces the whole parameter's gradient is cut into."""
    from torch.distributed.tensor import DTensor

    pieces = 1
    if isinstance(grad, DTensor):
        if any(placement.is_partial() for placement in grad.placements):  # pending sums: make them whole first
            from torch.distributed.tensor import Replicate

            grad = grad.redistribute(placements=[Replicate() if p.is_partial() else p for p in grad.placements])
        mesh = grad.device_mesh
        # every placement but Replicate cuts the tensor (FSDP2 over TP shards with _StridedShard, which is no is_shard())
        pieces = math.prod(mesh.size(dim) for dim, placement in enumerate(grad.placements) if not placement.is_replicate())
        grad = grad.to_local()
    if sliced_over is not None:
        pieces *= torch.distributed.get_world_size(sliced_over)
    return grad, pieces


def global_grad_norm(model: torch.nn.Module, plan) -> float:
    """The L2 norm of the whole model's gradient (a collective over the world)."""
    stages = math.prod(dict(plan.mesh)[dim] for dim in plan.stage_dims)  # ranks holding different parameters
    holders = plan.world_size // stages  # ranks that hold any one parameter
    by_weight: dict[tuple[float, torch.dtype], list[torch.Tensor]] = {}  # (pieces / holders, dtype) -> local gradients
    for module in model.modules():
        slices = module.__dict__.get(SLICES, {})
        for name, parameter in module.named_parameters(recurse=False):
            if parameter.grad is not None:
                local, pieces = _pieces(parameter.grad, getattr(slices.get(name), "group", None))
                by_weight.setdefault((pieces / holders, local.dtype), []).append(local.detach())
    local_sum = 0.0
    for (weight, _), grads in by_weight.items():  # one foreach kernel per group, as torch's clip_grad_norm_
        norms = torch.stack(torch._foreach_norm(grads)).double()
        local_sum += float(norms.pow(2).sum()) * weight
    return math.sqrt(all_reduce([local_sum])[0])


def clip_gradients(model: torch.nn.Module, norm: float, max_norm: float) -> None:
    """Scales every gradient by ``max_norm / (norm + 1e-6)`` when below 1, as torch's clip_grad_norm_ does."""
    scale = max_norm / (norm + EPS)
    if scale < 1.0:
        scale_gradients(model, scale)


@torch.no_grad()
def scale_gradients(model: torch.nn.Module, factor: float) -> None:
    """Multiplies every gradient this rank holds by ``factor``."""
    for parameter in model.parameters():
        if parameter.grad is not None:
            parameter.grad.mul_(factor)
