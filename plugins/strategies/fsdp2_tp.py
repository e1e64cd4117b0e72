"""``fsdp2_tp``: tensor parallel inside, FSDP2 across, on a 2-D ``dp x tp`` mesh.

Every rank of a tp group sees the same batch; the family's tp_plan shards over
``tp``, then ``fully_shard`` over ``dp`` wraps the blocks and the root, so
every parameter, including those outside the blocks (a classifier head), has
its gradients reduced across the dp replicas, with ``parallel.mixed_precision``
and ``parallel.reshard_after_forward`` as under ``fsdp2``.
"""

from snnfw import hookimpl
from snnfw.api import Proposal, Strategy
from snnfw_plugins.strategies.fsdp2 import apply_fully_shard, fully_shard_options
from snnfw_plugins.strategies.tp import apply_tensor_parallel, check_tp_plan, tp_estimate

NAME = "fsdp2_tp"


class TensorParallelFullyShard(Strategy):
    """The tp_plan over the mesh's ``tp`` dimension, then fully_shard over ``dp``."""

    shards_parameters = True

    def propose(self, request):
        return _propose(request)

    @hookimpl
    def snnfw_parallelize(self, model, plan, mesh, hooks):
        apply_tensor_parallel(model, plan, mesh["tp"], hooks)
        hooks.compile(model, plan)
        return apply_fully_shard(model, plan, mesh["dp"])


@hookimpl
def snnfw_register_strategies(register):
    register(NAME, TensorParallelFullyShard(), "2-D: tensor parallel within nodes of the tp dimension, FSDP2 across dp")


def _propose(request) -> Proposal:
    world = request.topology.world_size
    mesh = request.config.parallel.mesh or (("dp", world // 2), ("tp", 2))
    sizes = dict(mesh)
    if set(sizes) != {"dp", "tp"}:
        return Proposal.refuse(NAME, f"its mesh is {{dp = D, tp = T}}, got {sizes}; set parallel.mesh = {{dp = {world // 2}, tp = 2}}")
    if world < 2 or world % sizes["tp"]:
        return Proposal.refuse(NAME, f"{world} ranks do not form a dp x tp mesh with tp = {sizes['tp']}; launch with an even --nproc of 4 or more")
    if sizes["dp"] < 2:
        return Proposal.refuse(
            NAME, f"dp = {sizes['dp']} x tp = {sizes['tp']} has no data parallelism; use strategy tp on {world} ranks, "
            f"or launch {2 * sizes['tp']} or more ranks so that dp is at least 2",
        )
    if reason := check_tp_plan(request, sizes["tp"]):
        return Proposal.refuse(NAME, reason)
    return Proposal(
        NAME,
        mesh=(("dp", sizes["dp"]), ("tp", sizes["tp"])),
        dp_dims=("dp",),
        replicated_neuron_dims=("tp",),
        rationale=(
            f"{sizes['tp']}-way tensor parallel inside each of {sizes['dp']} FSDP2 replicas; tp peers share a batch",
            "fully_shard over dp on the family blocks and the root: every parameter's gradients are reduced across dp; "
            + fully_shard_options(request.config.parallel),
        ),
        estimate=tp_estimate(request, sizes["tp"], sizes["dp"]),
    )

