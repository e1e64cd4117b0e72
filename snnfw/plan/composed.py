"""Strategy ``mesh``: the composition (:mod:`snnfw.plan.compose`) as the strategy a plan of ``parallel.mesh`` or of
a preset runs. The core registers it itself, as plugin ``mesh`` (:data:`snnfw.plugin.manager.CORE_PLUGINS`)."""

from __future__ import annotations

import attrs

from snnfw.plan.compose import apply_mesh, candidate_meshes, owners, propose_mesh
from snnfw.plan.layout import COMPOSED
from snnfw.plugin.hookspecs import hookimpl
from snnfw.plugin.strategy import IN_PLACE, Strategy


class Composed(Strategy):
    """Each dimension applied by the strategy that owns it, in the core's order."""

    def builds_shards(self, config, plugins):
        """Where a dimension shards parameters and nothing makes the ranks build whole (:meth:`builds_whole`)."""
        shards = any(s.shards_parameters for s in _strategies(config, plugins).values())
        return shards and not self.builds_whole(config, plugins)

    def builds_whole(self, config, plugins):
        """Why the ranks of a mesh that shards parameters build the whole model first: a dimension that runs the
        model to apply it (a pipeline's split) meets one applied in place before it (tp's layers and time's neurons
        exchange with their peers as the split is measured). None where it builds only the shards (DDP's replicas
        of shards are materialized before it wraps them), or shards nothing."""
        strategies = _strategies(config, plugins)
        if not any(s.shards_parameters for s in strategies.values()):
            return None
        if self.reads_values(config, plugins) and any(s.order == IN_PLACE for s in strategies.values()):
            return "the pipeline's split runs the model, whose in-place dimensions exchange with their peers as it runs"
        return None

    def reads_values(self, config, plugins):
        return any(s.reads_values(config, plugins) for s in _strategies(config, plugins).values())

    def propose(self, request):
        """The mesh asked for; under ``auto`` without one, every mesh of one, two or three dimensions of the world
        (each refusal carries its mesh, so it rules out that mesh alone)."""
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
                                   "time, cp, ep), composed in one order")


def _strategies(config, plugins) -> dict:
    """The strategies of ``config``'s mesh dimensions of more than one rank, by dimension."""
    owned = owners(plugins)
    return {name: plugins.strategy(owned[name]) for name, size in config.parallel.mesh or () if size > 1 and name in owned}


def _listed(answer) -> list:
    return answer if isinstance(answer, list) else [answer]
