"""``ep``: expert parallelism, the experts of every mixture-of-experts layer split across the ranks of the ``ep``
mesh dimension, tokens sent to their experts and back by all-to-all (``ep_dispatch``).

As torchtitan's, the ep ranks also carry data: they see different samples, and the dense layers (attention,
router, embeddings, head) are whole replicas on them, their gradients averaged over ep by the core as over
``dp_replicate`` (DistributedDataParallel, or HSDP's replication beside ``dp_shard``). Each rank holds
``experts / ep`` whole experts, under their own names (the other experts' places hold no parameters), so a
checkpoint names every expert once and resumes onto any mesh. The experts' gradients are the mean over the ep
replicas through the all-to-alls themselves (``ep_dispatch``); the core's reduction leaves them out of its
average over ep (DistributedDataParallel ignores them, HSDP's units leave them out): beside the data dimensions
each expert is a ``fully_shard`` unit of its own over them (``dp_shard``, with ``dp_replicate``: HSDP;
``dp_replicate`` alone: sharded over it), never over ep.
"""

from snnfw import hookimpl
from snnfw.api import IN_PLACE, REPLICATED, Proposal, Strategy

NAME = "ep"
COMPOSES_WITH = ("dp_replicate", "dp_shard")
ROWS_PER_EXCHANGE = 4  # all-to-alls of rows per layer and microbatch: dispatch and combine, forward and backward


class ExpertParallel(Strategy):
    """The ``ep`` dimension: experts split across its ranks, which see different samples and replicate the rest."""

    dimension, parameters, splits_batch, order = "ep", REPLICATED, True, IN_PLACE

    def propose(self, request):
        """Asked by name (``parallel.strategy = "ep"``), where a mesh is meant: how to ask for one. Under ``auto``
        it proposes through the composition only."""
        if request.strategy != NAME:
            return None
        return Proposal.refuse(NAME, f"ep is a dimension of parallel.mesh, not a strategy of its own; set "
                                     f"parallel.mesh = {{ep = {request.topology.world_size}}} (dp_shard or "
                                     "dp_replicate beside it if you like) and remove parallel.strategy")

    def propose_dimension(self, request, layout):
        sizes = dict(layout.mesh)
        size = sizes[self.dimension]
        if reason := refusal(request, sizes):
            return Proposal.refuse(NAME, reason)
        experts = _experts(request.model) if request.model is not None else None
        held = f"{experts // size} of each layer's {experts} experts" if experts else "experts / ep experts of a layer"
        comm, calls = exchange_cost(request, layout)
        return Proposal(NAME, rationale=(
            f"ep = {size}: {held} per rank, tokens dispatched and combined by all-to-all "
            f"({comm / 2**20:.3g} MiB a rank a step); dense layers replicated over ep, which splits the batch; "
            "experts' gradients averaged through the all-to-alls, not over ep",),
            added_comm_bytes=comm, added_calls=calls)

    def apply_dimension(self, model, plan, mesh, hooks, wrap=None, group=None):
        split_experts(model, plan, mesh)
        return model


def refusal(request, sizes: dict) -> str | None:
    """Why ``request``'s model cannot split its experts over an ep dimension on a mesh of ``sizes``, or None."""
    size, config = sizes["ep"], request.config
    others = sorted(name for name, count in sizes.items() if count > 1 and name not in (NAME, *COMPOSES_WITH))
    if others:
        return (f"ep composes with {' and '.join(COMPOSES_WITH)} only, not with {', '.join(others)}; keep ep beside "
                "the data dimensions")
    if getattr(config.parallel, "zero", False):
        return ("parallel.zero partitions the parameters' updates over the replicas, whose experts differ under ep; "
                "remove parallel.zero, or use dp_shard to shard the optimizer state")
    if config.parallel.mixed_precision != "none":
        return (f"ep does not apply parallel.mixed_precision = {config.parallel.mixed_precision!r} to its experts; set "
                "parallel.mixed_precision = \"none\" (train.precision = \"bf16\" is autocast)")
    if config.memopt.level:
        return "memopt recomputes forward passes, which would dispatch the tokens again; set memopt.level = 0"
    if config.compile.enable:
        return ("its all-to-alls run inside the forward pass, which torch.compile does not trace; set "
                "compile.enable = false")
    if request.model is None:
        return None
    experts = _experts(request.model)
    if experts is None:
        return (f"model {request.analysis.family!r} has no mixture-of-experts layer (a module with an experts "
                "ModuleList and a mix method) to split; remove ep from parallel.mesh")
    if experts % size:
        return (f"the {experts} experts of a layer do not split into {size} equal parts; use an ep size that divides "
                f"{experts}")
    return None


def _experts(model) -> int | None:
    """The experts of ``model``'s mixture-of-experts layers (the same in each), or None without one."""
    from snnfw_plugins.strategies.ep_dispatch import moe_layers

    layers = moe_layers(model)
    return len(layers[0][1].experts) if layers else None


def exchange_cost(request, layout) -> tuple[float, int]:
    """A rank's all-to-all bytes and calls a step: each MoE layer sends the rows (T x tokens x top_k) its experts
    do not hold, ``(ep - 1) / ep`` of them where routing is even, four times (dispatch and combine, forward and
    backward), and their positions (int64) once; two small exchanges of counts and positions besides."""
    from snnfw_plugins.strategies.ep_dispatch import moe_layers

    size, model, config = dict(layout.mesh)[NAME], request.model, request.config
    if model is None:
        return 0.0, 0
    layers = [layer for _, layer in moe_layers(model)]
    if not layers:
        return 0.0, 0
    micro = config.train.microbatches or layout.microbatches or 1
    samples = config.data.batch_size / layout.replicas
    hidden = layers[0].router.in_features if hasattr(layers[0], "router") else layers[0].experts[0].fc1.in_features
    element = config.train.torch_dtype.itemsize
    rows = config.model.time_steps * samples * getattr(model, "sequence_length", 1) * layers[0].top_k
    away = (size - 1) / size
    per_layer = rows * away * (ROWS_PER_EXCHANGE * hidden * element + 8)
    calls = len(layers) * micro * (ROWS_PER_EXCHANGE + 2)
    return per_layer * len(layers), calls


def split_experts(model, plan, mesh) -> None:
    """Keeps this rank's experts of every MoE layer, their gradients reduced over the data dimensions but ep."""
    from snnfw.api import rows_group
    from snnfw_plugins.strategies.ep_dispatch import OWNED_OVER, ExpertGroup, Placeholder, dispatched_mix, moe_layers

    sizes = dict(plan.mesh)
    group = ExpertGroup(rows_group(mesh, (NAME,)), mesh.get_local_rank(NAME), sizes[NAME])
    kept = []
    for _, layer in moe_layers(model):
        local = len(layer.experts) // group.size
        mine = range(group.rank * local, (group.rank + 1) * local)
        for index in range(len(layer.experts)):
            if index not in mine:
                layer.experts[index] = Placeholder()
        kept += [layer.experts[index] for index in mine]
        layer.mix = _bound(dispatched_mix, layer, group)
    for expert in kept:
        for module in expert.modules():
            vars(module)[OWNED_OVER] = group.group
    data = [name for name in COMPOSES_WITH if sizes.get(name, 1) > 1]
    if data:
        _shard_experts(kept, plan, mesh[tuple(data)] if len(data) > 1 else mesh[data[0]])
    if sizes.get("dp_shard", 1) == 1:  # DistributedDataParallel over ep (and dp_replicate) wraps the model
        from torch.nn.parallel import DistributedDataParallel

        ids = {id(p) for expert in kept for p in expert.parameters()}
        ignored = [name for name, p in model.named_parameters() if id(p) in ids]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)


def _bound(function, layer, group):
    """``function`` with its layer and ep group given: the layer's ``mix``."""

    def mix(spikes, chosen, weights, steps):
        return function(layer, group, spikes, chosen, weights, steps)

    return mix


def _shard_experts(experts, plan, expert_mesh) -> None:
    """Each expert a ``fully_shard`` unit over ``expert_mesh``: the data dimensions but ep (sharded over dp_shard,
    replicated over dp_replicate beside it: HSDP; sharded over dp_replicate alone, which DDP's replicas then
    average as FSDP2 reduce-scatters)."""
    from snnfw_plugins.strategies.fsdp2 import _fully_shard, reshard_after_forward

    for expert in experts:
        _fully_shard(expert, mesh=expert_mesh, reshard_after_forward=reshard_after_forward(plan.config.parallel))


@hookimpl
def snnfw_register_strategies(register):
    register(NAME, ExpertParallel(), "the ep dimension: experts split across its ranks, tokens sent by all-to-all")


@hookimpl
def snnfw_step_metrics(plan):
    """``ep_comm_mb`` and ``ep_alltoall_calls``: what this rank's all-to-alls sent to its ep peers in the step."""
    if NAME not in dict(plan.mesh):
        return None
    from snnfw_plugins.strategies.ep_dispatch import COUNTER

    return COUNTER.take()
