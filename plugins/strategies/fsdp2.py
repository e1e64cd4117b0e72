"""``dp_shard``: fully sharded data parallel through ``fully_shard`` (FSDP2), the mesh dimension of strategy
``fsdp2`` (HSDP beside ``dp_replicate``), ``fsdp2_tp`` and ``fsdp2_tsp``.

Each block the model family declares (``analysis.blocks``) becomes one
sharding unit, then the root takes the remaining parameters. Parameters,
gradients and optimizer state are sharded on dim 0 over ``dp_shard`` and
replicated over the dimensions whose ranks average gradients (HSDP). With bf16
mixed precision (``MixedPrecisionPolicy``, CUDA and CPU), BatchNorm layers are
units of their own that keep fp32 parameters, matching their fp32 running
statistics. Only a mesh with ``dp_shard`` applies ``parallel.mixed_precision``
or ``parallel.reshard_after_forward``, so this plugin refuses the others when
these are set.
A unit whose output is a view returns a copy, so FSDP2's pre-backward hook on
it cannot be dropped by an in-place op. On a CPU, all-gathers are issued
asynchronously and the next block's is prefetched, which FSDP2 does through
CUDA streams on a GPU.
"""

import attrs

from snnfw import hookimpl
from snnfw.api import DATA, SHARDED, Proposal, Strategy, refuse_others, submodule

NAME = "fsdp2"


def reshard_after_forward(parallel) -> bool:
    """``parallel.reshard_after_forward``; its default where this plugin is blocked (the key is then unknown, as a
    blocked plugin's keys are)."""
    return getattr(parallel, "reshard_after_forward", True)


@attrs.frozen
class Fsdp2Keys:
    """``parallel.reshard_after_forward`` (entry point ``snnfw.config``: ``parallel.fsdp2``): fully_shard's own."""

    reshard_after_forward: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))


class FullyShard(Strategy):
    """Each declared block a unit of fully_shard over ``dp_shard``, then the root, replicated over the dimensions
    whose ranks average gradients (HSDP)."""

    dimension, parameters, splits_batch, order, shards_parameters = "dp_shard", SHARDED, True, DATA, True

    def propose_dimension(self, request, layout):
        size, blocks = dict(layout.mesh)[self.dimension], request.analysis.blocks
        units = f"{len(blocks)} block(s) of {request.analysis.family} then the root" if blocks else "the root only"
        return Proposal(NAME, rationale=(f"dp_shard = {size}: parameters, gradients and optimizer state sharded on dim 0 "
                                         f"by fully_shard on {units}; {fully_shard_options(request.config.parallel)}",
                                         *_one_block(request)))

    def apply_dimension(self, model, plan, mesh, hooks, wrap=None, group=None):
        """``mesh``: the one the core hands a sharded dimension, 1-D or HSDP's 2-D, as fully_shard takes it."""
        return apply_fully_shard(model, plan, mesh)


@hookimpl
def snnfw_register_strategies(register):
    register(NAME, FullyShard(), "the dp_shard dimension: fully sharded data parallel (FSDP2 fully_shard), HSDP beside "
                                 "dp_replicate")


def _scope_refusals(request) -> list[Proposal]:
    """Refusals of the strategies asked for that would ignore parallel.mixed_precision or parallel.reshard_after_forward."""
    parallel, refusals = request.config.parallel, []
    if parallel.mixed_precision != "none":
        reason = (
            f"parallel.mixed_precision = {parallel.mixed_precision!r} is applied only by a dp_shard dimension "
            "(fully_shard's MixedPrecisionPolicy: strategies fsdp2, fsdp2_tp, fsdp2_tsp); set parallel.mixed_precision "
            "= \"none\" (train.precision = \"bf16\" is autocast in every strategy), or shard over dp_shard"
        )
        refusals += refuse_others(request, (NAME,), reason)
    if "parallel.reshard_after_forward" in request.config.explicit:
        reason = (
            f"parallel.reshard_after_forward = {str(parallel.reshard_after_forward).lower()} is applied only by a "
            "dp_shard dimension (fully_shard: strategies fsdp2, fsdp2_tp, fsdp2_tsp); remove it, or shard over dp_shard"
        )
        refusals += refuse_others(request, (NAME,), reason)
    return refusals


@hookimpl
def snnfw_plan(request):
    return _scope_refusals(request)


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

