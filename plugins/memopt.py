"""``[memopt]``: SpikingJelly's memory optimisation (``optimize_memory``) before parallelization.

``memopt.level`` 1 wraps the blocks the model family declares
(``analysis.blocks``) in SpikingJelly's checkpoint wrappers, the
``memopt.budget`` share of them with the largest inputs first, and stores
spike inputs as bits when ``memopt.compress``; levels 2 to 4 add its spatial
split, temporal split and greedy unwrapping, searched by measured CUDA peak
memory. Only the blocks of the pipeline stages that ``memopt.stage_ratio``
selects take part (see ``memopt_stages``). The wrappers chosen are cached as
JSON in ``$SNNFW_CACHE_DIR/memopt`` (default ``~/.cache/snnfw/memopt``),
keyed by model, input shape and options, and reapplied without a search on
the next run. ``memopt_s`` in the summary is the time it took.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import torch
from torch import nn

from snnfw import hookimpl
from snnfw.analysis import submodule
from snnfw.distributed import all_reduce
from snnfw.plan import Proposal

SEARCHING_LEVELS = (2, 3, 4)
_last_run: dict[str, float] = {}


def cache_dir() -> Path:
    return Path(os.environ.get("SNNFW_CACHE_DIR", Path.home() / ".cache" / "snnfw")) / "memopt"


@hookimpl
def snnfw_plan(request):
    memopt = request.config.memopt
    if memopt.level == 0:
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
            f"memopt checkpoints the blocks a model family declares, and {request.analysis.family!r} "
            "declares none; set memopt.level = 0",
        )
    return None


def _no_batch_norm(module: nn.Module) -> bool:
    """Whether ``module`` may run in time chunks: BatchNorm statistics span all time steps."""
    return not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())


def cache_key(model: nn.Module, example: torch.Tensor, memopt, blocks: tuple[str, ...]) -> str:
    from importlib.metadata import version

    text = json.dumps([
        repr(model), list(example.shape), str(example.dtype), example.device.type, memopt.level, memopt.budget,
        memopt.compress, list(blocks), torch.__version__, version("spikingjelly"),
    ])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def wrappers(model: nn.Module) -> list[dict]:
    """The checkpoint wrappers in ``model``, outermost first, with their options."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    out = []
    for path, module in model.named_modules():
        if isinstance(module, CheckpointWrapper):
            options = module.checkpoint_fn.keywords
            compressor = options["compressor"]
            out.append({
                "path": path,
                "compressor": type(compressor).__name__ if compressor is not None else None,
                "chunks": options["chunks"],
                "chunked_args": list(options["chunked_args"]),
                "time_dim": options["time_dim"],
            })
    return out


def reapply(model: nn.Module, chosen: list[dict]) -> None:
    """Wraps the modules a search chose, as it wrapped them."""
    from spikingjelly.activation_based import memopt

    for entry in chosen:
        module = model.get_submodule(entry["path"])
        compressor = getattr(memopt, entry["compressor"])() if entry["compressor"] else None
        wrapped = memopt.checkpoint_module(
            module, compressor=compressor, chunks=entry["chunks"],
            chunked_args=tuple(entry["chunked_args"]), time_dim=entry["time_dim"],
        )
        model.set_submodule(entry["path"], wrapped)


def _load(path: Path) -> list[dict] | None:
    try:
        return json.loads(path.read_text())["wrappers"]
    except (OSError, ValueError, KeyError):
        return None


def _save(path: Path, chosen: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps({"wrappers": chosen}, indent=1) + "\n")
    os.replace(partial, path)


def optimize(model: nn.Module, plan, example: torch.Tensor, hooks, blocks: tuple[str, ...]) -> bool:
    """Runs SpikingJelly's optimize_memory on ``blocks``, or reapplies its cached choice; True on a cache hit."""
    import torch.distributed as dist
    from spikingjelly.activation_based.memopt import optimize_memory

    memopt = plan.config.memopt
    path = cache_dir() / f"{cache_key(model, example, memopt, blocks)}.json"
    chosen = _load(path)
    hits = all_reduce([float(chosen is not None)])[0]
    if hits == plan.world_size:
        reapply(model, chosen)
        return True

    def forward(m):
        hooks.reset_state(m)
        return m(example)

    optimize_memory(
        model, instances_of(submodule(model, name) for name in blocks), forward, level=memopt.level,
        checkpoint_budget=memopt.budget, compress=memopt.compress, split_fn=lambda m: list(m.children()),
        can_chunk=_no_batch_norm, process_group=dist.group.WORLD if dist.is_initialized() else None,
    )
    if not dist.is_initialized() or dist.get_rank() == 0:
        _save(path, wrappers(model))
    return False


def instances_of(modules) -> type:
    """A type whose instances are exactly ``modules``: optimize_memory's ``targets`` selects by isinstance."""
    members = {id(m) for m in modules}

    class Members(type):
        def __instancecheck__(cls, obj) -> bool:
            return id(obj) in members

    return Members("Blocks", (), {})


@hookimpl
def snnfw_transform_model(model, plan, example, hooks):
    _last_run.clear()
    if plan.config.memopt.level == 0:
        return
    start = time.perf_counter()
    blocks = plan.analysis.blocks
    hit = optimize(model, plan, example, hooks, blocks)
    _last_run.update(memopt_s=time.perf_counter() - start, memopt_cache_hit=float(hit),
                     memopt_wrappers=float(len(wrappers(model))))


@hookimpl
def snnfw_summary(plan):
    return dict(_last_run) or None
