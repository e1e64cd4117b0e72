"""``mesh``: the dimensions ``parallel.mesh`` names, composed (:mod:`snnfw.plan.compose`); a config that sets
``parallel.mesh`` and no strategy gets it."""

import attrs

from snnfw import hookimpl
from snnfw.api import (COMPOSED, IN_PLACE, REPLICATED, SHARDED, STAGES, Strategy, apply_mesh, candidate_meshes,
                       owners, propose_mesh)


class Composed(Strategy):
    """Each dimension applied by the strategy that owns it, in the core's order."""

    def builds_shards(self, config, plugins):
        """Where a dimension shards parameters, no DistributedDataParallel wraps the model (it reads the parameters
        as it wraps them, which a meta build cannot: replicas without FSDP2 or a pipeline, which averages its
        stages' gradients itself), and no dimension that runs the model to apply it (a pipeline's split) meets one
        applied in place before it (tp's layers and time's neurons exchange with their peers as the split is
        measured). Dimensions that replicate parameters in place (time) keep whatever the others shard."""
        strategies = self._strategies(config, plugins)
        roles, orders = {s.parameters for s in strategies}, {s.order for s in strategies}
        wraps_ddp = REPLICATED in roles and SHARDED not in roles and STAGES not in orders
        return (any(s.shards_parameters for s in strategies) and not wraps_ddp
                and not (any(s.reads_values(config, plugins) for s in strategies) and IN_PLACE in orders))

    def reads_values(self, config, plugins):
        return any(s.reads_values(config, plugins) for s in self._strategies(config, plugins))

    @staticmethod
    def _strategies(config, plugins) -> list:
        """The strategies of the mesh's dimensions of more than one rank."""
        owned = owners(plugins)
        return [plugins.strategy(owned[name]) for name, size in config.parallel.mesh or () if size > 1 and name in owned]

    def propose(self, request):
        """The mesh asked for; under ``auto`` without one, every mesh of two or three dimensions of the world (each
        refusal carries its mesh, so it rules out that mesh alone)."""
        if request.strategy == COMPOSED:
            return propose_mesh(request)
        if request.config.parallel.mesh:
            return None
        meshes = candidate_meshes(request.topology.world_size, list(owners(request.plugins)))
        return [attrs.evolve(p, mesh=p.mesh or mesh) for mesh in meshes for p in _listed(propose_mesh(request, mesh))]

    def label(self, config, plan):
        if plan.get("preset"):
            return None
        return " x ".join(f"{name}={size}" for name, size in plan["mesh"].items())

    @hookimpl
    def snnfw_parallelize(self, model, plan, mesh, hooks):
        return apply_mesh(model, plan, mesh, hooks)


@hookimpl
def snnfw_register_strategies(register):
    register(COMPOSED, Composed(), "any mix of the mesh dimensions parallel.mesh names (dp_replicate, dp_shard, tp, pp, "
                                   "time), composed in one order")


def _listed(answer) -> list:
    return answer if isinstance(answer, list) else [answer]
