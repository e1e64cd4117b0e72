"""``[compile]``: ``torch.compile`` of the family's blocks, and what compiling costs.

With ``compile.enable``, the forward of every block in ``analysis.blocks`` is
compiled (``compile.backend``, ``compile.mode``, ``compile.fullgraph``) for
static shapes (``reduce-overhead`` and ``max-autotune`` replay them as CUDA
graphs on CUDA: ``reduce-overhead`` is refused off CUDA, both with a last
evaluation batch of another size and under the strategies that run
collectives inside the blocks), each block with recompiles of its own (blocks share their
code, and sizes seen in one block would otherwise make the next one's
dynamic). Strategies ask for it at one fixed point of ``snnfw_parallelize``:
after tensor parallel, before FSDP2, DDP or pipeline stage wrappers (as
torchtitan orders them), so hooks those put on a block stay outside its
graph. Whenever anything is compiled (this, or the ``inductor`` neuron
backend), each step's metrics hold ``compile_s`` (compiling time within the
step), ``compiles``, ``recompiles`` and ``graph_breaks``, and the summary
holds their totals over the run, evaluation included. Without
``compile.enable`` the plan refuses the other ``[compile]`` keys the user set.
"""

from __future__ import annotations

import attrs

from snnfw import hookimpl
from snnfw.api import Proposal, keys_phrase, refuse_meshes, submodule

MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@attrs.frozen
class CompileConfig:
    """The ``[compile]`` section (entry point ``snnfw.config``: ``compile``)."""

    enable: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    backend: str = attrs.field(default="inductor", validator=attrs.validators.instance_of(str))
    mode: str = attrs.field(default="default", validator=attrs.validators.in_(MODES))
    fullgraph: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))


def inductor_refusal(device_type: str) -> str | None:
    """Why Inductor cannot generate code on ``device_type`` here, or None."""
    from importlib.util import find_spec

    if device_type == "cuda":
        return None if find_spec("triton") else "Inductor on CUDA generates Triton kernels, and triton is not installed"
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception as err:
        return f"Inductor on CPU needs a C++ compiler (g++ or clang++, or $CXX): {err}"
    return None


def compiling(plan) -> bool:
    backend = getattr(plan.config.model, "neuron_backend", "torch")  # a key of plugin neuron_backend
    return plan.config.compile.enable or backend == "inductor"


OPTIONS = ("compile.backend", "compile.mode", "compile.fullgraph")


@hookimpl
def snnfw_plan(request):
    options = request.config.compile
    if not options.enable:
        if keys := [key for key in OPTIONS if key in request.config.explicit]:
            subject, pronoun = keys_phrase(keys)
            reason = (
                f"{subject} applied only with compile.enable = true (the inductor neuron backend has options of "
                f"its own); set compile.enable = true, or remove {pronoun}"
            )
            return Proposal.refuse(request.strategy, reason)
        return None
    if options.mode != "default" and options.backend != "inductor":
        reason = f"compile.mode {options.mode!r} is an Inductor mode; set compile.backend = \"inductor\""
        return Proposal.refuse(request.strategy, reason)
    if options.mode == "reduce-overhead" and request.topology.device_type != "cuda":
        return Proposal.refuse(request.strategy, (
            "compile.mode 'reduce-overhead' replays the compiled blocks as CUDA graphs, which need CUDA, and this run "
            "is on the CPU; use compile.mode \"default\" or \"max-autotune-no-cudagraphs\""))
    if options.backend == "inductor" and (reason := inductor_refusal(request.topology.device_type)):
        return Proposal.refuse(request.strategy, f"compile.enable: {reason}")
    if options.mode in GRAPH_MODES and request.topology.device_type == "cuda":
        return cuda_graph_refusals(request, options.mode)
    return None


GRAPH_MODES = ("reduce-overhead", "max-autotune")  # the Inductor modes that replay compiled code as CUDA graphs on CUDA
COLLECTIVES_IN_BLOCKS = {  # mesh dimensions whose collectives run inside the compiled blocks, where no graph captures them
    "tp": "tensor parallelism's all-reduces run inside the blocks (the sharded convolutions' backward, the neurons' shard rules)",
    "time": "the time chunks hand neuron state on by send and receive inside the blocks",
}


def cuda_graph_refusals(request, mode: str) -> list[Proposal]:
    """Where CUDA graphs of the compiled blocks cannot hold: a batch of another shape, collectives inside the blocks."""
    what, config = f"compile.mode {mode!r} replays the compiled blocks as CUDA graphs", request.config
    batch, samples = config.data.batch_size, config.data.test_samples
    if samples % batch:
        return [Proposal.refuse(request.strategy, (
            f"{what} for one batch shape, and the last evaluation batch holds {samples % batch} of {batch} samples "
            f"(data.test_samples = {samples}); set data.test_samples to a multiple of data.batch_size"))]

    def inside(dims) -> str | None:
        reasons = [reason for dim, reason in COLLECTIVES_IN_BLOCKS.items() if dim in dims]
        return f"{what}, and {'; '.join(reasons)}; use compile.mode \"max-autotune-no-cudagraphs\"" if reasons else None

    return refuse_meshes(request, inside)


class CompileStats:
    """Compiling time, graphs, recompiles and graph breaks since it was made, from dynamo's process-wide records."""

    def __init__(self):
        self.seen_us, self.recompiles = self._latest_us(), 0
        self.start = self.last = self._totals()

    def _latest_us(self) -> int:
        from torch._dynamo.utils import get_compilation_metrics

        return max((m.start_time_us or 0 for m in get_compilation_metrics()), default=0)

    def _totals(self) -> dict[str, float]:
        from torch._dynamo.utils import calculate_time_spent, counters, get_compilation_metrics

        new = [m for m in get_compilation_metrics() if (m.start_time_us or 0) > self.seen_us]
        self.seen_us = max([self.seen_us, *(m.start_time_us or 0 for m in new)])
        self.recompiles += sum(m.recompile_reason is not None for m in new)
        return {
            "compile_s": calculate_time_spent().get("total_wall_time", 0.0),
            "compiles": float(counters["stats"]["unique_graphs"]),
            "recompiles": float(self.recompiles),
            "graph_breaks": float(sum(counters["graph_break"].values())),
        }

    def take(self) -> dict[str, float]:
        """The increase since the last call."""
        now = self._totals()
        out = {key: now[key] - self.last[key] for key in now}
        self.last = now
        return out

    def total(self) -> dict[str, float]:
        """The increase since it was made."""
        now = self._totals()
        return {key: now[key] - self.start[key] for key in now}


NAME = "compile"  # what it keeps for a run: hooks.run.kept[NAME], the run's CompileStats


def _stats(hooks) -> CompileStats | None:
    return hooks.kept(NAME)


@hookimpl
def snnfw_transform_model(model, plan, example, hooks):
    if compiling(plan) and hooks.run is not None:
        hooks.run.kept[NAME] = CompileStats()


@hookimpl
def snnfw_compile(model, plan, hooks):
    options = plan.config.compile
    if not options.enable:
        return
    import inspect

    import torch

    # each block's recompiles counted against its own limit, where this torch offers it (2.11 does not)
    isolated = {"isolate_recompiles": True} if "isolate_recompiles" in inspect.signature(torch.compile).parameters else {}
    for name in plan.analysis.blocks:
        block = submodule(model, name)
        block.forward = torch.compile(
            block.forward,
            backend=options.backend,
            mode=None if options.mode == "default" else options.mode,
            fullgraph=options.fullgraph,
            dynamic=False,
            **isolated,
        )


@hookimpl
def snnfw_step_metrics(plan, hooks):
    stats = _stats(hooks)
    return stats.take() if stats else None


@hookimpl
def snnfw_summary(plan, hooks):
    stats = _stats(hooks)
    return stats.total() if stats else None
