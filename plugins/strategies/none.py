"""``none``: one rank, no parallelism; the reference every strategy is compared with."""

from snnfw import hookimpl
from snnfw.api import Proposal, Strategy, estimate

NAME = "none"


class Single(Strategy):
    """One rank: the model as it is, its blocks compiled where ``compile.enable`` asks."""

    def propose(self, request):
        return _propose(request)

    @hookimpl
    def snnfw_parallelize(self, model, plan, mesh, hooks):
        hooks.compile(model, plan)
        return model


@hookimpl
def snnfw_register_strategies(register):
    register(NAME, Single(), "single process, no parallelism (the reference for equivalence)")


def _propose(request) -> Proposal:
    if request.topology.world_size != 1:
        return Proposal.refuse(
            NAME, f"it runs on one rank, not {request.topology.world_size}; use --nproc 1, or strategy dp"
        )
    mesh = request.config.parallel.mesh
    if mesh not in (None, (("dp", 1),)):
        return Proposal.refuse(NAME, f"its mesh is {{dp = 1}}, got {dict(mesh)}; remove parallel.mesh")
    return Proposal(
        NAME,
        mesh=(("dp", 1),),
        dp_dims=("dp",),
        rationale=("one rank: no parallelism",),
        estimate=estimate(request, samples=request.config.data.batch_size),
    )

