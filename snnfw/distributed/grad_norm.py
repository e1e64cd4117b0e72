"""The gradient norm of the whole model, whatever strategy holds its pieces, and clipping by it.

Each rank holds pieces of the gradient: whole (``none``, and replicas under
``dp`` and ``zero``), DTensor shards (FSDP2, DTensor tensor parallel),
channel slices (snnfw's tensor-parallel styles note them in
``snnfw_slices``), parameters each rank of a group holds alone (an ``ep``
group's experts: ``snnfw_owned_over``), or only its pipeline stages' parameters. A piece held
alike by ``k`` ranks counts ``1 / k`` on each, so one sum over the world
counts every piece of every parameter once, as ``none`` would.
"""

from __future__ import annotations

import math

import torch

from snnfw.distributed.layout import Layout

SLICES = "snnfw_slices"  # written by tensor-parallel styles: parameter name -> TensorSlice
OWNED_OVER = "snnfw_owned_over"  # a process group whose ranks each hold other parameters in this module's place
EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s


def _pieces(grad: torch.Tensor, sliced_over, owned_over=None) -> tuple[torch.Tensor, int]:
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
    for group in (sliced_over, owned_over):
        if group is not None:
            pieces *= torch.distributed.get_world_size(group)
    return grad, pieces


def local_grad_squares(model: torch.nn.Module, layout: Layout, device: torch.device | None = None) -> torch.Tensor:
    """This rank's share of the squared L2 norm of the whole model's gradient, a float64 tensor on the device:
    added over the world, it counts every piece of every parameter once."""
    holders = layout.world_size // layout.size(layout.stage_dims)  # ranks that hold any one parameter
    by_weight: dict[tuple[float, torch.dtype], list[torch.Tensor]] = {}  # (pieces / holders, dtype) -> local gradients
    for module in model.modules():
        slices = module.__dict__.get(SLICES, {})
        for name, parameter in module.named_parameters(recurse=False):
            if parameter.grad is not None:
                local, pieces = _pieces(parameter.grad, getattr(slices.get(name), "group", None),
                                        module.__dict__.get(OWNED_OVER))
                by_weight.setdefault((pieces / holders, local.dtype), []).append(local)
    total = None
    with torch.no_grad():
        for (weight, _), grads in by_weight.items():  # one foreach kernel per group, as torch's clip_grad_norm_
            squares = torch.stack(torch._foreach_norm(grads)).double().pow(2).sum()
            squares = squares if weight == 1 else squares * weight
            total = squares if total is None else total + squares
    return total if total is not None else torch.zeros((), dtype=torch.float64, device=device)


def global_grad_norm(model: torch.nn.Module, layout: Layout, squares: torch.Tensor | None = None) -> torch.Tensor:
    """The L2 norm of the whole model's gradient, a float64 tensor on the device (a collective over the world);
    ``squares``: this rank's share where :func:`local_grad_squares` has already computed it."""
    squares = (local_grad_squares(model, layout) if squares is None else squares).clone()
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(squares)
    return squares.sqrt()


@torch.no_grad()
def clip_gradients(model: torch.nn.Module, norm: torch.Tensor, max_norm: float) -> None:
    """Scales every gradient by ``max_norm / (norm + 1e-6)`` when below 1, as torch's clip_grad_norm_ does; a
    non-finite ``norm`` leaves them alone. Decided on the device: no host synchronisation."""
    scale = (max_norm / (norm + EPS)).clamp(max=1.0)
    scale_gradients(model, torch.where(torch.isfinite(norm), scale, 1.0))


@torch.no_grad()
def scale_gradients(model: torch.nn.Module, factor: float | torch.Tensor) -> None:
    """Multiplies every gradient this rank holds by ``factor`` (one foreach kernel per device and dtype)."""
    grads = [_local(parameter.grad) for parameter in model.parameters() if parameter.grad is not None]
    if grads:
        torch._foreach_mul_(grads, factor)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this rank holds, sharing its storage: a DTensor's local tensor, else itself."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
