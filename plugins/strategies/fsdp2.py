"""``fsdp2``: fully sharded data parallel through ``fully_shard`` (FSDP2), or HSDP on a 2-D mesh.

Each block the model family declares (``analysis.blocks``) becomes one
sharding unit, then the root takes the remaining parameters. Parameters,
gradients and optimizer state are sharded on dim 0 over ``dp`` (FSDP), or
over ``dp_shard`` and replicated over ``dp_replicate`` (HSDP). With bf16
mixed precision (``MixedPrecisionPolicy``, CUDA and CPU), BatchNorm layers are
units of their own that keep fp32 parameters, matching their fp32 running
statistics. No strategy but this and ``fsdp2_tp`` applies
``parallel.mixed_precision`` or ``parallel.reshard_after_forward``, so this
plugin refuses the others when these are set.
A unit whose output is a view returns a copy, so FSDP2's pre-backward hook on
it cannot be dropped by an in-place op. On a CPU, all-gathers are issued
asynchronously and the next block's is prefetched, which FSDP2 does through
CUDA streams on a GPU.
"""

import attrs

from snnfw import hookimpl
from snnfw.api import DATA, SHARDED, Proposal, Strategy, estimate, refuse_others, ring_bytes, submodule

NAME = "fsdp2"


def reshard_after_forward(parallel) -> bool:
    """``parallel.reshard_after_forward``, for fsdp2_tp and fsdp2_tsp too; its default where this plugin is blocked
    (the key is then unknown, as a blocked plugin's keys are)."""
    return getattr(parallel, "reshard_after_forward", True)


@attrs.frozen
class Fsdp2Keys:
    """``parallel.reshard_after_forward`` (entry point ``snnfw.config``: ``parallel.fsdp2``): fully_shard's own."""

    reshard_after_forward: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
HSDP_DIMS = ("dp_replicate", "dp_shard")


class FullyShard(Strategy):
    """Each declared block a unit of fully_shard over the dp dimensions, then the root; in a composed mesh, over
    ``dp_shard``, replicated over the dimensions whose ranks average gradients (HSDP)."""

    dimension, parameters, splits_batch, order, shards_parameters = "dp_shard", SHARDED, True, DATA, True

    def propose(self, request):
        return _propose(request)

    def propose_dimension(self, request, layout):
        size = dict(layout.mesh)[self.dimension]
        return Proposal(NAME, rationale=(f"dp_shard = {size}: parameters, gradients and optimizer state sharded on dim 0 "
                                         f"by fully_shard; {fully_shard_options(request.config.parallel)}",
                                         *_one_block(request)))

    def apply_dimension(self, model, plan, mesh, hooks, wrap=None):
        from snnfw.api import fsdp_mesh

        return apply_fully_shard(model, plan, fsdp_mesh(plan, mesh, hooks, self.dimension))

    @hookimpl
    def snnfw_parallelize(self, model, plan, mesh, hooks):
        hooks.compile(model, plan)
        return apply_fully_shard(model, plan, mesh)


@hookimpl
def snnfw_register_strategies(register):
    register(NAME, FullyShard(), "fully sharded data parallel (FSDP2 fully_shard); HSDP with a dp_replicate x dp_shard mesh")


def _mesh(config_mesh, world):
    """The canonical mesh and its dp dimensions, or None for a mesh this strategy does not take."""
    if config_mesh is None:
        return (("dp", world),), ("dp",)
    sizes = dict(config_mesh)
    if set(sizes) == {"dp"}:
        return tuple(sizes.items()), ("dp",)
    if set(sizes) == set(HSDP_DIMS):
        return tuple((d, sizes[d]) for d in HSDP_DIMS), HSDP_DIMS
    return None


def _scope_refusals(request) -> list[Proposal]:
    """Refusals of the strategies asked for that would ignore parallel.mixed_precision or parallel.reshard_after_forward."""
    parallel, refusals = request.config.parallel, []
    if parallel.mixed_precision != "none":
        reason = (
            f"parallel.mixed_precision = {parallel.mixed_precision!r} is applied only by strategies fsdp2 and "
            "fsdp2_tp (fully_shard's MixedPrecisionPolicy); set parallel.mixed_precision = \"none\" (train.precision "
            "= \"bf16\" is autocast in every strategy), or use one of them"
        )
        refusals += refuse_others(request, (NAME, "fsdp2_tp"), reason)
    if "parallel.reshard_after_forward" in request.config.explicit:
        reason = (
            f"parallel.reshard_after_forward = {str(parallel.reshard_after_forward).lower()} is applied only by "
            "strategies fsdp2 and fsdp2_tp (fully_shard); remove it, or use one of them"
        )
        refusals += refuse_others(request, (NAME, "fsdp2_tp"), reason)
    return refusals


@hookimpl
def snnfw_plan(request):
    return _scope_refusals(request)


def _propose(request) -> Proposal:
    world, parallel = request.topology.world_size, request.config.parallel
    if world < 2:
        return Proposal.refuse(NAME, "it needs at least 2 ranks; launch with --nproc 2 or more, or use strategy none")
    resolved = _mesh(parallel.mesh, world)
    if resolved is None:
        return Proposal.refuse(
            NAME,
            f"its mesh is {{dp = N}} (FSDP) or {{dp_replicate = R, dp_shard = S}} (HSDP), got {dict(parallel.mesh)}; "
            f"set parallel.mesh = {{dp = {world}}}, or dp_replicate and dp_shard with product {world}",
        )
    mesh, dp_dims = resolved
    sizes = dict(mesh)
    blocks = request.analysis.blocks
    units = f"{len(blocks)} block(s) of {request.analysis.family} then the root" if blocks else "the root only"
    if dp_dims == HSDP_DIMS:
        layout = f"HSDP: sharded over dp_shard={sizes['dp_shard']}, replicated over dp_replicate={sizes['dp_replicate']}"
    else:
        layout = f"FSDP: sharded over dp={sizes['dp']}"
    return Proposal(
        NAME,
        mesh=mesh,
        dp_dims=dp_dims,
        rationale=(
            f"fully_shard on {units}; {layout}; parameters, gradients and optimizer state on dim 0",
            *_one_block(request),
            f"{fully_shard_options(parallel)}; gradients reduced after each step's last microbatch",
        ),
        estimate=_estimate(request, sizes.get("dp_shard", sizes.get("dp")), world),
    )


def _one_block(request) -> tuple[str, ...]:
    """The plan's line on a model of one block whose children could be blocks of their own."""
    blocks, analysis = request.analysis.blocks, request.analysis
    if len(blocks) != 1 or request.model is None:
        return ()
    inner = [f"{blocks[0]}.{name}" for name, child in submodule(request.model, blocks[0]).named_children()
             if any(True for _ in child.parameters())]
    if len(inner) < 2:
        return ()
    where = ("model.blocks = [" + ", ".join(f'"{name}"' for name in inner) + "]" if analysis.own else
             "more blocks in the family's snnfw_analyze")
    return (f"one block found ({blocks[0]}): each rank gathers all its parameters at once; declare {where} to "
            "gather one at a time",)


def fully_shard_options(parallel) -> str:
    """The plan's words for the FSDP2 options: resharding after forward, and the compute precision."""
    precision = "fp32"
    if parallel.mixed_precision == "bf16":
        precision = "bf16 compute (BatchNorm in fp32), fp32 gradient reduction and output"
    return f"reshard_after_forward={reshard_after_forward(parallel)}, {precision}"


def _estimate(request, shards: int, world: int):
    """Parameters, gradients and optimizer state split over the shard dimension; all-gathers
    before forward and backward and a reduce-scatter after it."""
    params = request.cost.parameter_bytes if request.cost else 0.0
    return estimate(
        request,
        samples=request.config.data.batch_size / world,
        parameter_shards=shards,
        comm_bytes=1.5 * ring_bytes(params, shards) + ring_bytes(params / shards, world // shards),
        calls=fsdp_calls(request, hybrid=world > shards),
    )


def fsdp_calls(request, hybrid: bool = False) -> int:
    """FSDP2's collectives a step: per unit (the blocks and the root) an all-gather before forward and one before
    backward, a reduce-scatter after it (and an all-reduce over replicas under HSDP)."""
    return (len(request.analysis.blocks) + 1) * (4 if hybrid else 3)


def _scalars_to_vectors(model) -> None:
    """FSDP2 cannot shard 0-dim parameters (a parametric LIF's ``w``): make them one-element vectors."""
    import torch

    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.dim() == 0:
                setattr(module, name, torch.nn.Parameter(param.detach().reshape(1), requires_grad=param.requires_grad))


def _own_output(module, args, output):
    """A view output that requires grad copied into a tensor of its own (a forward hook).

    FSDP2 registers its pre-backward hook on each unit's output, and warns when
    that output is a view (a Linear on ``[T, N, F]``, a closing reshape): an
    in-place op on the view would drop the hook and skip the all-gather.
    """
    return output.clone() if getattr(output, "requires_grad", False) and output._base is not None else output


def _fully_shard(module, **options):
    """``fully_shard`` on a unit whose view outputs are copied first (the hook runs before FSDP2's)."""
    from torch.distributed.fsdp import fully_shard

    module.register_forward_hook(_own_output)
    return fully_shard(module, **options)


def apply_fully_shard(model, plan, mesh):
    """``fully_shard`` on each family block, then the root, with the plan's FSDP2 options."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    _scalars_to_vectors(model)
    parallel = plan.config.parallel
    options = {"mesh": mesh, "reshard_after_forward": reshard_after_forward(parallel)}
    root_options = options
    if parallel.mixed_precision == "bf16":
        for norm in [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]:
            _fully_shard(norm, **options, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))
        bf16 = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
        options = {**options, "mp_policy": MixedPrecisionPolicy(**bf16)}
        root_options = {**options, "mp_policy": MixedPrecisionPolicy(**bf16, output_dtype=torch.float32)}
    units = [_fully_shard(submodule(model, name), **options) for name in plan.analysis.blocks]
    root = _fully_shard(model, **root_options)
    if plan.device_type == "cpu":
        _prefetch_asynchronously(root, units)
    return root


def _prefetch_asynchronously(root, units) -> None:
    """Each unit's all-gather issued asynchronously, the next block's while this one computes (a CPU's overlap).

    FSDP2 overlaps its all-gathers with compute through CUDA streams; on a CPU it
    issues each synchronously before the unit runs, and a rank waits for its
    peers there. Asynchronous all-gathers run on gloo's thread instead: in
    forward each unit starts the next block's (in the blocks' order), in backward
    FSDP2 starts the previous unit's as it does on a GPU. A prefetch that no unit
    uses in that pass is waited for and dropped by FSDP2 at the end of backward.
    """
    root._set_unshard_async_op(True)
    for unit, after in zip([root, *units], units):
        unit.set_modules_to_forward_prefetch([after])

