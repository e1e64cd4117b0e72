"""``zero``: data parallel with optimizer state sharded (ZeroRedundancyOptimizer).

``strategy = "zero"`` is DDP plus the sharded optimizer; ``parallel.zero =
true`` adds the sharded optimizer to every layout whose ranks hold whole
replicas in DistributedDataParallel: ``dp``, ``tsp`` and composed meshes of
``dp_replicate`` and ``time``, sharded over the ranks DDP averages over.
Strategies that already shard optimizer state, or whose ranks hold different
parameters, refuse it, and ``zero`` refuses ``parallel.zero = false``. Each
rank checkpoints its own partition of the optimizer state by parameter name,
so a checkpoint resumes under any strategy.
"""

import attrs

from snnfw import hookimpl
from snnfw.api import (COMPOSED, REPLICATED, held_state, load_held_state, merge_optimizer_states, optimizer_options,
                       parameter_groups, refuse_meshes, refuse_others, trainable)


@attrs.frozen
class ZeroKeys:
    """``parallel.zero`` (entry point ``snnfw.config``: ``parallel.zero``): the sharded optimizer under ``dp``."""

    zero: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))


def _wanted(plan) -> bool:
    return plan.config.parallel.zero


@hookimpl
def snnfw_plan(request):
    """Refusals of the strategies parallel.zero = true does not apply to."""
    if "parallel.zero" not in request.config.explicit or not request.config.parallel.zero:
        return None
    reason = ("parallel.zero shards optimizer state across data-parallel replicas, on meshes of replicas only "
              "(dp_replicate, time); remove parallel.zero")
    return [*refuse_others(request, (COMPOSED,), reason), *refuse_meshes(request, _held_apart)]


def _held_apart(dims) -> str | None:
    """Why a composed mesh of the dimensions ``dims`` cannot shard its optimizer state with ZeRO, or None: every
    dimension must hold the parameters whole on each rank (``dp_replicate``, ``time``), so DDP averages them."""
    held = [name for name, strategy in dims.items() if strategy.parameters != REPLICATED]
    if held:
        return (f"parallel.zero shards the optimizer state of parameters every rank holds whole, and the mesh's "
                f"{', '.join(held)} ranks hold different parts (fsdp2's dp_shard shards optimizer state already); "
                "remove parallel.zero, or those dimensions")
    return None


@hookimpl
def snnfw_preference_defaults(config):
    """Under ``prefer = "memory"`` or ``"capacity"``, a mesh of replicas alone (strategy ``dp``) shards its
    optimizer state."""
    dims = {name for name, size in config.parallel.mesh or () if size > 1}
    if config.parallel.strategy == COMPOSED and dims == {"dp_replicate"} and config.parallel.prefer in ("memory", "capacity"):
        return {"parallel.zero": True}
    return None


@hookimpl
def snnfw_build_optimizer(model, plan, mesh, hooks):
    if not _wanted(plan):
        return None
    from torch.distributed.optim import ZeroRedundancyOptimizer

    optimizer_class, kwargs = optimizer_options(plan.config.train, hooks, trainable(model))
    return ZeroRedundancyOptimizer(
        parameter_groups(model, plan.config.train),
        optimizer_class=optimizer_class,
        process_group=model.process_group,  # the replicas DistributedDataParallel averages over
        **kwargs,
    )


@hookimpl
def snnfw_state_dict(model, optimizer, plan):
    """The replicated model and this rank's partition of the optimizer state, the param groups naming every
    rank's parameters."""
    if not _wanted(plan):
        return None
    import torch.distributed as dist

    held = held_state(model, optimizer.optim)
    parts = [None] * dist.get_world_size(optimizer.process_group)
    dist.all_gather_object(parts, {"param_groups": held["optimizer"]["param_groups"]}, group=optimizer.process_group)
    groups = merge_optimizer_states([{"state": {}, **part} for part in parts])["param_groups"]
    return {"model": held["model"], "optimizer": {**held["optimizer"], "param_groups": groups}}


@hookimpl
def snnfw_load_state_dict(model, optimizer, plan, state):
    if not _wanted(plan):
        return None
    load_held_state(model, optimizer.optim, state)
    return True
