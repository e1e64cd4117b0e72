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
from snnfw.api import (COMPOSED, REPLICATED, Proposal, held_state, load_held_state, merge_optimizer_states,
                       optimizer_options, owners, parameter_groups, refuse_others, trainable)
from snnfw_plugins.strategies.dp import Replicas, propose_replicas

NAME = "zero"
COMPOSES_WITH = ("dp", NAME, "tsp")


@attrs.frozen
class ZeroKeys:
    """``parallel.zero`` (entry point ``snnfw.config``: ``parallel.zero``): the sharded optimizer under ``dp``."""

    zero: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))


def _wanted(plan_or_request) -> bool:
    return plan_or_request.config.parallel.zero or plan_or_request.strategy == NAME


class ShardedOptimizer(Replicas):
    """DDP's replicas, each rank's optimizer holding its partition of the state."""

    def propose(self, request):
        if "parallel.zero" in request.config.explicit and not request.config.parallel.zero:
            return Proposal.refuse(NAME, "parallel.zero = false asks for an unsharded optimizer, which strategy zero "
                                         "shards; remove it, or use dp")
        rationale = "gradients averaged by DDP, each rank keeps 1/N of the optimizer state"
        return propose_replicas(NAME, request, rationale, shard_optimizer=True)


@hookimpl
def snnfw_register_strategies(register):
    register(NAME, ShardedOptimizer(), "data parallel (DDP) with optimizer state sharded across replicas (ZeRO-1)")


@hookimpl
def snnfw_plan(request):
    """Refusals of the strategies parallel.zero = true does not apply to."""
    if "parallel.zero" not in request.config.explicit or not request.config.parallel.zero:
        return None
    reason = (
        f"parallel.zero shards optimizer state across data-parallel replicas and composes with "
        f"{', '.join(COMPOSES_WITH)} and composed meshes of replicas only (fsdp2 shards optimizer state already); "
        "remove parallel.zero"
    )
    refusals = refuse_others(request, (*COMPOSES_WITH, COMPOSED), reason)
    if request.asks_for(COMPOSED) and (why := _composed_refusal(request)):
        refusals.append(Proposal.refuse(COMPOSED, why))
    return refusals


def _composed_refusal(request) -> str | None:
    """Why a composed mesh cannot shard its optimizer state with ZeRO, or None: every dimension of more than one
    rank must hold the parameters whole on each (``dp_replicate``, ``time``), so DDP averages them over all."""
    mesh = request.config.parallel.mesh
    if not mesh:
        return ("under auto, parallel.zero composes with a mesh only where parallel.mesh names one of replicas "
                "(dp_replicate, time); set it, or remove parallel.zero")
    owned = owners(request.plugins)
    held = [name for name, size in mesh if size > 1 and name in owned
            and request.plugins.strategy(owned[name]).parameters != REPLICATED]
    if held:
        return (f"parallel.zero shards the optimizer state of parameters every rank holds whole, and the mesh's "
                f"{', '.join(held)} ranks hold different parts (fsdp2's dp_shard shards optimizer state already); "
                "remove parallel.zero, or those dimensions")
    return None


@hookimpl
def snnfw_preference_defaults(config):
    if config.parallel.strategy == "dp" and config.parallel.prefer in ("memory", "capacity"):
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
