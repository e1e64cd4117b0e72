"""``time``: temporal parallelism, the time steps of one sample split across ranks, exactly (the mesh dimension of
strategies ``tsp`` and ``fsdp2_tsp``).

The P ranks of a ``time`` dimension see the same samples and rank k runs time
steps k T/P to (k+1) T/P - 1 of them (``tsp_ops``): per-step layers on its
chunk only, neurons continuing the membrane potential of rank k - 1, BatchNorm
over the whole T. Each rank holds the activations of T/P steps. Its ranks hold
the same parameters, each gradient P times its steps' share, so the core's
average over them (with the data replicas') is their sum over time; the time
group exchanges on process groups of its own, so that its messages never
interleave with the gradient reduction's inside backward.
"""

import attrs

from snnfw import hookimpl
from snnfw.api import GLOO_CUDA_POINT_TO_POINT, Proposal, Strategy, refuse_others, submodule

NAME = "tsp"


@attrs.frozen
class TspConfig:
    """The ``[tsp]`` section (entry point ``snnfw.config``: ``tsp``)."""

    # batch slices a neuron runs its chunk in, each passed on when done (0: one per rank of the time group)
    slices: int = attrs.field(default=0, validator=[attrs.validators.instance_of(int), attrs.validators.ge(0)])


def slices(config, mesh) -> int:
    """The batch slices of a neuron's chunk: ``tsp.slices``, or one per rank of the ``mesh``'s time group."""
    return config.tsp.slices or dict(mesh)["time"]


TIME_MIXING = ("RNNBase", "Conv3d", "MultiheadAttention")  # layers that mix time steps when given [T, N, ...]


def time_mixing_layer(model) -> str | None:
    """Why ``model`` cannot run its time steps in chunks (a layer that mixes them, a neuron that keeps more than
    its membrane potential or runs step by step), or None."""
    from snnfw.api import is_neuron

    for name, module in model.named_modules():
        kinds = {kind.__name__ for kind in type(module).__mro__}
        if mixing := kinds.intersection(TIME_MIXING):
            return f"{name} ({type(module).__name__}) mixes time steps, which a time chunk cannot see ({mixing.pop()})"
        if is_neuron(module):
            if getattr(module, "step_mode", "s") != "m":
                return f"neuron {name} runs step by step (step_mode 's'); tsp chains multi-step neurons (step_mode 'm')"
            kept = sorted(set(module._memories) - {"v"})
            if kept:
                return (f"neuron {name} keeps state besides its membrane potential ({', '.join(kept)}), which tsp "
                        "does not pass on")
    return None


def time_split_refusal(request, size: int, replicas: int | None = None) -> str | None:
    """Why the time steps of ``request``'s model cannot be split ``size`` ways among ``replicas`` data replicas
    (default: all the other ranks), or None."""
    config, steps = request.config, request.config.model.time_steps
    if request.topology.shares_gpus:
        return f"the time chunks hand neuron state on point to point: {GLOO_CUDA_POINT_TO_POINT}"
    if steps % size:
        return (f"model.time_steps = {steps} does not split into {size} equal chunks; use a time size that divides "
                f"it, or set model.time_steps to a multiple of {size}")
    if config.memopt.level:
        return "memopt recomputes forward passes, which would pass neuron state on twice; set memopt.level = 0"
    if config.compile.enable:
        return ("its neurons exchange state point to point inside the forward pass, which torch.compile does not "
                "trace; set compile.enable = false")
    replicas = replicas or request.topology.world_size // size
    microbatch = config.data.batch_size // replicas // (config.train.microbatches or 1)
    if config.tsp.slices > microbatch:
        return (f"tsp.slices = {config.tsp.slices} is more than the {microbatch} samples of a microbatch, which a "
                f"neuron runs in slices; set tsp.slices to {microbatch} or fewer")
    return time_mixing_layer(request.model) if request.model is not None else None


def split_in_time(model, plan, mesh, hooks) -> None:
    """Splits ``model``'s time steps over the mesh's ``time`` dimension (``tsp_ops``), exchanging on process groups
    of their own, apart from any collective of the strategy's gradient reduction; the time of its exchanges is kept
    for the run's step metrics."""
    from snnfw.api import rows_group
    from snnfw_plugins.strategies.tsp_ops import TimeGroup, split_time

    time_group = TimeGroup(rows_group(mesh, ("time",)), timed=plan.config.log.phase_times)
    if hooks.run is not None:
        hooks.run.kept[NAME] = time_group.exchanges
    split_time(model, [submodule(model, name) for name in plan.analysis.neurons], time_group,
               plan.config.model.time_steps, slices(plan.config, plan.mesh))


class TimeSplit(Strategy):
    """The ``time`` dimension: its ranks hold the same parameters, each gradient P times its steps' share, so the
    core's average over it is their sum."""

    dimension = "time"

    def variants(self, request, layout):
        """Under ``auto`` without ``tsp.slices``: each of :func:`slice_choices`."""
        if "tsp.slices" in request.config.explicit:
            return []
        return [(("tsp.slices", count),) for count in slice_choices(request, layout)]

    def propose_dimension(self, request, layout):
        size, steps = dict(layout.mesh)[self.dimension], request.config.model.time_steps
        if reason := time_split_refusal(request, size, layout.replicas):
            return Proposal.refuse(NAME, reason)
        count, samples = slices(request.config, layout.mesh), request.config.data.batch_size / layout.replicas
        wait = wavefront_ms(request.cost, samples, size, count) if request.cost is not None else 0.0
        return Proposal(NAME, rationale=(f"time = {size}: each sample's {steps} time steps split ({steps // size} per "
                                         f"rank), neurons pass their state on in {count} batch slices",),
                        added_compute_ms=wait, added_calls=2 * (count - 1) * len(request.analysis.neurons))

    def apply_dimension(self, model, plan, mesh, hooks, wrap=None):
        split_in_time(model, plan, mesh, hooks)
        return model


@hookimpl
def snnfw_register_strategies(register):
    register(NAME, TimeSplit(), "the time dimension: the time steps of each sample split across its ranks")


@hookimpl
def snnfw_plan(request):
    if "tsp.slices" in request.config.explicit:
        return refuse_others(request, (NAME,), "tsp.slices applies only to a time dimension (strategies tsp, fsdp2_tsp); "
                                               "remove it, or split over time")
    return None


def slice_choices(request, layout) -> tuple[int, ...]:
    """The slice counts ``auto`` tries on ``layout`` (a composed proposal): 1, 2, 4, ... up to four per rank of
    its time group and the microbatch."""
    config, size = request.config, dict(layout.mesh)["time"]
    microbatch = config.data.batch_size // layout.replicas // (config.train.microbatches or 1)
    top = max(min(4 * size, microbatch), 1)
    return tuple(2**k for k in range(top.bit_length()) if 2**k <= top)


def wavefront_ms(cost, samples: float, size: int, count: int) -> float:
    """What the wavefront adds to a rank's compute of its T/P steps (``cost``: the profile): a layer's neurons run
    one time rank after another, so the last waits for P - 1 slices of each layer's neurons (the neurons' share of
    their fixed time and of 1/S of the chunk's samples each); each slice past the first calls every neuron again."""
    neurons_fixed = cost.neuron_share * cost.fixed_ms
    neurons_chunk = cost.neuron_share * samples * cost.step_ms / size
    return (count - 1) * neurons_fixed + (size - 1) * (neurons_fixed + neurons_chunk / count)


@hookimpl
def snnfw_time_view(plan, mesh):
    """On a ``time`` mesh dimension of P ranks, coordinate k reads steps k T/P to (k+1) T/P only."""
    if mesh is None or "time" not in dict(plan.mesh):
        return None
    from snnfw_plugins.strategies.tsp_ops import time_chunk

    chunk = time_chunk(plan.config.model.time_steps, mesh.get_local_rank("time"), dict(plan.mesh)["time"])
    return chunk.start, chunk.stop


@hookimpl
def snnfw_step_metrics(plan, hooks):
    """With log.phase_times, ``tsp_exchange_ms``: the time spent in the time group's exchanges."""
    exchanges = hooks.kept(NAME)
    if "time" not in dict(plan.mesh) or not plan.config.log.phase_times or exchanges is None:
        return None
    return exchanges.take()
