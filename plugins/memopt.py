"""``[memopt]``: SpikingJelly's memory optimisation (``optimize_memory``) before parallelization.

``memopt.level`` 1 wraps the blocks the model family declares
(``analysis.blocks``) in SpikingJelly's checkpoint wrappers, the
``memopt.budget`` share of them with the largest inputs first, and stores
spike inputs as bits when ``memopt.compress``; levels 2 to 4 add its spatial
split, temporal split and greedy unwrapping, searched by measured CUDA peak
memory. In a pipeline (a ``pp`` mesh dimension) it acts once the split is
decided, on the blocks of the ``memopt.stage_ratio`` share of all stages
whose blocks take the most input bytes, each rank on its own stages. The
wrappers chosen are cached as JSON in ``$SNNFW_CACHE_DIR/memopt`` (default
``~/.cache/snnfw/memopt``), keyed by module, input shape and options, and
reapplied without a search on the next run. The summary holds the seconds it
took (``memopt_s``), whether any rank searched (``memopt_searched``) and the
most wrappers a rank holds (``memopt_wrappers``). At level 0 the plan refuses
the other ``[memopt]`` keys when the user set them.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

import attrs

from snnfw import hookimpl
from snnfw.api import Proposal, keys_phrase, submodule
from snnfw_plugins.memopt_cache import cache_dir, cache_key, load, reapply, save, wrappers

if TYPE_CHECKING:
    import torch
    from torch import nn


@attrs.frozen
class MemoptConfig:
    """The ``[memopt]`` section (entry point ``snnfw.config``: ``memopt``)."""

    level: int = attrs.field(default=0, validator=[attrs.validators.instance_of(int), attrs.validators.in_(range(5))])
    budget: str = attrs.field(default="memory", validator=attrs.validators.in_(("speed", "balanced", "memory")))
    compress: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    stage_ratio: float = attrs.field(default=1.0, converter=float, validator=[attrs.validators.gt(0),
                                                                             attrs.validators.le(1)])


SEARCHING_LEVELS = (2, 3, 4)
NAME = "memopt"  # what it keeps for a run: hooks.run.kept[NAME], the figures of its search


def _figures(hooks) -> dict[str, float]:
    """The run's figures for the summary (dropped outside a trainer, where there is no run)."""
    return hooks.run.kept.setdefault(NAME, {}) if hooks.run is not None else {}


OPTIONS = ("memopt.budget", "memopt.compress", "memopt.stage_ratio")


@hookimpl
def snnfw_plan(request):
    memopt = request.config.memopt
    if memopt.level == 0:
        if keys := [key for key in OPTIONS if key in request.config.explicit]:
            subject, pronoun = keys_phrase(keys)
            reason = f"{subject} applied only with memopt.level 1 or more; set memopt.level, or remove {pronoun}"
            return Proposal.refuse(request.strategy, reason)
        return None
    if memopt.level in SEARCHING_LEVELS and request.topology.device_type != "cuda":
        return Proposal.refuse(
            request.strategy,
            f"memopt.level {memopt.level} searches by measured CUDA peak memory and needs CUDA; "
            "use memopt.level = 1 (checkpointing without a search) on CPU",
        )
    if not request.analysis.blocks:
        return Proposal.refuse(
            request.strategy,
            f"memopt checkpoints the model's blocks: {request.analysis.missing('blocks', BLOCKS_EXAMPLE)}; "
            "declare them or set memopt.level = 0",
        )
    return None


BLOCKS_EXAMPLE = '["blocks.0", "blocks.1"]'


def _no_batch_norm(module: nn.Module) -> bool:
    """Whether ``module`` may run in time chunks: BatchNorm statistics span all time steps."""
    from torch import nn

    return not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())


def optimize(module: nn.Module, blocks: list[nn.Module], example: torch.Tensor, plan, hooks, collective: bool) -> bool:
    """Runs SpikingJelly's optimize_memory on ``blocks`` of ``module``, or reapplies its cached choice.

    ``collective``: every rank optimises the same module alike, searching
    together unless all of them hold the choice. True on a cache hit.
    """
    import torch.distributed as dist
    from spikingjelly.activation_based.memopt import optimize_memory

    from snnfw.api import all_reduce

    memopt = plan.config.memopt
    names = [name for name, m in module.named_modules() if any(m is block for block in blocks)]
    path = cache_dir() / f"{cache_key(module, example, memopt, names)}.json"
    chosen = load(path)
    missing = all_reduce([float(chosen is None)], op="max")[0] if collective else float(chosen is None)
    if not missing:
        reapply(module, chosen)
        return True

    def forward(m):
        hooks.reset_state(m)
        return m(example)

    group = dist.group.WORLD if collective and dist.is_initialized() else None
    optimize_memory(
        module, instances_of(blocks), forward, level=memopt.level, checkpoint_budget=memopt.budget,
        compress=memopt.compress, split_fn=lambda m: list(m.children()), can_chunk=_no_batch_norm, process_group=group,
    )
    if group is None or dist.get_rank() == 0:
        save(path, wrappers(module))
    return False


def instances_of(modules) -> type:
    """A type whose instances are exactly ``modules``: optimize_memory's ``targets`` selects by isinstance."""
    members = {id(m) for m in modules}

    class Members(type):
        def __instancecheck__(cls, obj) -> bool:
            return id(obj) in members

    return Members("Blocks", (), {})


def _pipelined(plan) -> bool:
    return "pp" in dict(plan.mesh)


@hookimpl
def snnfw_transform_runs_model(config):
    """optimize_memory runs the blocks it wraps (and its cache key reads the model)."""
    return config.memopt.level > 0 or None


@hookimpl
def snnfw_transform_model(model, plan, example, hooks):
    if plan.config.memopt.level == 0 or _pipelined(plan):
        return
    start = time.perf_counter()
    blocks = [submodule(model, name) for name in plan.analysis.blocks]
    searched = not optimize(model, blocks, example, plan, hooks, collective=True)
    _figures(hooks).update(memopt_s=time.perf_counter() - start, memopt_searched=float(searched),
                           memopt_wrappers=float(len(wrappers(model))))


@hookimpl
def snnfw_tune_settings(config, analysis, device_type):
    """Level 1 (checkpointing, no search) where the model declares its blocks: slower, in less memory."""
    return {"memopt.level": (0, 1)} if analysis.blocks else None


def input_bytes(module: nn.Module, blocks: list[nn.Module], example: torch.Tensor, hooks) -> int:
    """Bytes of the inputs that ``blocks`` receive while ``module`` runs ``example``: what checkpointing can save."""
    import torch

    seen = [0]

    def count(m, args):
        seen[0] += args[0].numel() * args[0].element_size()

    handles = [block.register_forward_pre_hook(count) for block in blocks]
    try:
        with torch.no_grad():
            hooks.reset_state(module)
            module(example)
    finally:
        for handle in handles:
            handle.remove()
    return seen[0]


@hookimpl
def snnfw_transform_stages(model, stages, local, plan, hooks):
    """The ``memopt.stage_ratio`` share of all stages, those whose blocks take the most input bytes first."""
    memopt = plan.config.memopt
    if memopt.level == 0:
        return
    start = time.perf_counter()
    ids = {id(submodule(model, name)) for name in plan.analysis.blocks}
    blocks = [[m for m in module.modules() if id(m) in ids] for module, _ in stages]
    costs = [input_bytes(module, members, example, hooks) for (module, example), members in zip(stages, blocks)]
    ranked = sorted(range(len(stages)), key=lambda index: (-costs[index], index))
    chosen = sorted(set(ranked[: math.ceil(memopt.stage_ratio * len(stages))]) & set(local))
    hits = [optimize(stages[i][0], blocks[i], stages[i][1], plan, hooks, collective=False) for i in chosen]
    _figures(hooks).update(memopt_s=time.perf_counter() - start, memopt_searched=float(not all(hits)),
                           memopt_wrappers=float(sum(len(wrappers(stages[i][0])) for i in local)))


@hookimpl
def snnfw_summary(plan, hooks):
    return dict(_figures(hooks)) or None
