"""``dp``: data parallel through DistributedDataParallel, one replica per rank."""

from snnfw import hookimpl
from snnfw.api import DATA, Proposal, Strategy, ddp_buckets, estimate, ring_bytes

NAME = "dp"


class Replicas(Strategy):
    """dp and zero: the model in DistributedDataParallel; ZeRO's optimizer holds its shard's state in its local
    optimizer."""

    @hookimpl
    def snnfw_parallelize(self, model, plan, mesh, hooks):
        return wrap_ddp(model, plan, mesh, hooks)

    def optimizer_state(self, optimizer):
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return super().optimizer_state(optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer)


class ReplicatedData(Replicas):
    """``dp``, and the ``dp_replicate`` dimension of a composed mesh: its ranks see different samples and hold the
    same parameters, whose gradients the core averages over them."""

    dimension, splits_batch, order = "dp_replicate", True, DATA

    def propose(self, request):
        return propose_replicas(NAME, request, "gradients averaged by DDP after each step's last microbatch")

    def propose_dimension(self, request, layout):
        size = dict(layout.mesh)[self.dimension]
        return Proposal(NAME, rationale=(f"dp_replicate = {size}: replicas on different samples",))

    def label(self, config, plan):
        return "+zero" if config["parallel"].get("zero") else None


@hookimpl
def snnfw_register_strategies(register):
    register(NAME, ReplicatedData(), "data parallel (DistributedDataParallel): every rank holds the whole model")


def propose_replicas(strategy: str, request, rationale: str, shard_optimizer: bool = False):
    """A 1-D ``dp`` mesh over the whole world, or the refusal that says what to change."""
    world = request.topology.world_size
    if world < 2:
        return Proposal.refuse(strategy, "it needs at least 2 ranks; launch with --nproc 2 or more, or use strategy none")
    mesh = request.config.parallel.mesh or (("dp", world),)
    if "tp" in dict(mesh):
        return Proposal.refuse(strategy, "data parallel with tensor parallel is strategy fsdp2_tp (DDP+TP is not offered)")
    if tuple(name for name, _ in mesh) != ("dp",):
        return Proposal.refuse(strategy, f"its mesh has one dimension named dp, got {dict(mesh)}; set parallel.mesh = {{dp = {world}}}")
    replicas = dict(mesh)["dp"]
    params = request.cost.parameter_bytes if request.cost else 0.0
    gathered = params * (replicas - 1) / replicas if shard_optimizer else 0.0
    cost = estimate(
        request,
        samples=request.config.data.batch_size / replicas,
        optimizer_shards=replicas if shard_optimizer else 1,
        comm_bytes=ring_bytes(params, replicas) + gathered,
        calls=ddp_buckets(params) + (len(list(request.model.parameters())) if shard_optimizer and request.model else 0),
    )
    return Proposal(strategy, mesh=mesh, dp_dims=("dp",), rationale=(f"{replicas} replicas, {rationale}",), estimate=cost)


def wrap_ddp(model, plan, mesh, hooks, group=None):
    """The model's blocks compiled (``hooks.compile``), then DistributedDataParallel over the mesh's ``dp`` dimension
    (or over ``group``)."""
    from snnfw.api import replicate

    hooks.compile(model, plan)
    return replicate(model, plan.device_type, group or mesh.get_group("dp"))
