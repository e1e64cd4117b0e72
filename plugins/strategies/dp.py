"""``dp_replicate``: the mesh dimension whose ranks hold whole replicas on different samples (strategy ``dp``'s
mesh); the core averages their gradients (DistributedDataParallel, or HSDP's replication beside ``dp_shard``)."""

import math

from snnfw import hookimpl
from snnfw.api import DATA, REPLICATED, Proposal, Strategy

NAME = "dp"


class ReplicatedData(Strategy):
    """Replicas on different samples holding the same parameters; with ``parallel.zero`` each rank's optimizer
    holds its partition of the state (ZeroRedundancyOptimizer, the ``zero`` plugin)."""

    dimension, splits_batch, order = "dp_replicate", True, DATA

    def propose_dimension(self, request, layout):
        size = dict(layout.mesh)[self.dimension]
        if not getattr(request.config.parallel, "zero", False):
            return Proposal(NAME, rationale=(f"dp_replicate = {size}: replicas on different samples",))
        replicas = _replicated_ranks(request, layout)
        params = request.cost.parameter_bytes if request.cost else 0.0
        return Proposal(NAME, rationale=(f"dp_replicate = {size}: replicas on different samples, each rank keeping "
                                         f"1/{replicas} of the optimizer state (parallel.zero)",),
                        optimizer_shards=replicas, added_comm_bytes=params * (replicas - 1) / replicas,
                        added_calls=len(list(request.model.parameters())) if request.model is not None else 0)

    def variants(self, request, layout):
        """The optimizer sharded over the replicas (``parallel.zero``) and not, where every dimension holds whole
        replicas and the key is the zero plugin's and unset."""
        if not hasattr(request.config.parallel, "zero") or "parallel.zero" in request.config.explicit:
            return []
        if any(request.plugins.strategy(name).parameters != REPLICATED for name in layout.strategies):
            return []
        return [(), (("parallel.zero", True),)]

    def label(self, config, plan):
        return "+zero" if config["parallel"].get("zero") and plan.get("preset") != "zero" else None


def _replicated_ranks(request, layout) -> int:
    """The ranks DistributedDataParallel averages over on ``layout``: those of its dimensions of whole replicas."""
    sizes = dict(layout.mesh)
    return math.prod(sizes[name] for name, owner in zip(sizes, layout.strategies)
                     if request.plugins.strategy(owner).parameters == REPLICATED)


@hookimpl
def snnfw_register_strategies(register):
    register(NAME, ReplicatedData(), "the dp_replicate dimension: replicas on different samples, gradients averaged "
                                     "(DistributedDataParallel)")
