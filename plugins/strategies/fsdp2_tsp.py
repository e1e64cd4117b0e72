"""``fsdp2_tsp``: temporal parallelism inside, FSDP2 across, on a 2-D ``time x dp`` mesh.

The ranks of a time group split the time steps of the same samples (``tsp``);
``fully_shard`` then shards the parameters over ``dp`` and replicates them over
``time`` (HSDP), so each rank holds 1/D of the parameters, gradients and
optimizer state and the activations of T/P steps. HSDP averages the gradients
over time x dp, each rank's being P times its steps' share (``tsp_ops``): the
sum over time, averaged over the dp replicas.
"""

import attrs

from snnfw import hookimpl
from snnfw.api import Proposal, Strategy, ring_bytes
from snnfw_plugins.strategies.fsdp2 import apply_fully_shard, fully_shard_options
from snnfw_plugins.strategies.tsp import slice_variants, slices, split_in_time, time_split_estimate, time_split_refusal

NAME = "fsdp2_tsp"


class TimeSplitFullyShard(Strategy):
    """The time steps split over ``time``, then fully_shard over time x dp."""

    def propose(self, request):
        return _propose(request)

    @hookimpl
    def snnfw_parallelize(self, model, plan, mesh, hooks):
        split_in_time(model, plan, mesh, hooks)
        return apply_fully_shard(model, plan, mesh)


@hookimpl
def snnfw_register_strategies(register):
    register(NAME, TimeSplitFullyShard(), "2-D: the time steps split over the time dimension, FSDP2 across dp")


def _propose(request) -> Proposal | list[Proposal]:
    world = request.topology.world_size
    mesh = request.config.parallel.mesh or (("time", 2), ("dp", world // 2))
    return slice_variants(request, NAME, mesh, lambda config: _proposal(request, config, mesh))


def _proposal(request, config, mesh) -> Proposal:
    world, sizes = request.topology.world_size, dict(mesh)
    if set(sizes) != {"time", "dp"}:
        return Proposal.refuse(NAME, f"its mesh is {{time = P, dp = D}}, got {sizes}; set parallel.mesh = "
                                     f"{{time = 2, dp = {max(world // 2, 2)}}}")
    if sizes["dp"] < 2:
        return Proposal.refuse(NAME, f"time = {sizes['time']} x dp = {sizes['dp']} shards nothing; use strategy tsp on "
                                     f"{world} ranks, or launch {2 * sizes['time']} or more so that dp is at least 2")
    if reason := time_split_refusal(attrs.evolve(request, config=config), sizes["time"]):
        return Proposal.refuse(NAME, reason)
    params = request.cost.parameter_bytes if request.cost else 0.0
    cost = time_split_estimate(request, config, sizes["time"], samples=config.data.batch_size / sizes["dp"],
                               parameter_shards=sizes["dp"], comm_bytes=1.5 * ring_bytes(params, world),
                               calls=3 * (len(request.analysis.blocks) + 1))
    steps = config.model.time_steps
    return Proposal(
        NAME,
        mesh=(("time", sizes["time"]), ("dp", sizes["dp"])),
        dp_dims=("dp",),
        rationale=(
            f"{sizes['time']} ranks split each sample's {steps} time steps inside each of {sizes['dp']} FSDP2 replicas",
            "fully_shard over time x dp (HSDP: sharded over dp, replicated over time); " +
            fully_shard_options(request.config.parallel),
            f"neurons pass their state on in {slices(config, mesh)} batch slices, a wavefront over the time ranks",
        ),
        estimate=cost,
    )

