"""Process groups along dimensions of a device mesh, and the replicas that average gradients over one."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def rows_group(mesh, dims: tuple[str, ...]):
    """A new process group of this rank's ranks along the mesh dimensions ``dims`` (its "row"), for traffic of its own
    apart from the mesh's groups. A collective: every rank makes every row's group, in one order."""
    grid = mesh.mesh
    axes = [mesh.mesh_dim_names.index(name) for name in dims]
    rest = [axis for axis in range(grid.ndim) if axis not in axes]
    rows = grid.permute(*rest, *axes).reshape(-1, math.prod(grid.shape[axis] for axis in axes))
    mine = None
    for row in rows.tolist():
        group = dist.new_group(ranks=row)
        if dist.get_rank() in row:
            mine = group
    return mine


def replicate(model: torch.nn.Module, device_type: str, group) -> torch.nn.Module:
    """``model`` in DistributedDataParallel over ``group``, gradients averaged after each step's last microbatch.

    Buffers are not broadcast from rank 0 before each forward: snnfw's BatchNorm running statistics are equal on every
    replica already (:mod:`snnfw.distributed.running_stats`). Gradients are views of DDP's all-reduce buckets, which
    saves copying every gradient into its bucket and back, and a gradient's worth of memory."""
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [next(model.parameters()).device.index] if device_type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids, process_group=group, forward_sync_buffers=False,
                                   gradient_as_bucket_view=True)
