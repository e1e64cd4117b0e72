"""``pp``: the pipeline mesh dimension (strategy ``pp``), on torch.distributed.pipelining, the schedule chosen by
name.

The model's units (``snnfw_split_stages``) are grouped into
P x ``pipeline.virtual_stages`` stages: by ``pipeline.layout`` if given, else
balanced by the forward+backward time that the last rank measures in a short dry run.
Then the stages go through ``snnfw_transform_stages`` (memory optimisation)
and the blocks through ``hooks.compile``. Every stage resets its neurons
before each microbatch. Checkpoints name the stages' state by the model's
names (``pp_state``). Microbatches split the batch, never the time axis:
torch's default chunking takes dim 0 of the frames
``[N, T, ...]`` and of the labels; activations cross stages as ``[T, N, ...]``
whole microbatches, and the last stage's loss function also counts correct
predictions, so outputs are not merged. The ``[pipeline]`` keys and
``memopt.stage_ratio`` apply to a ``pp`` dimension alone; set by the user, they
make every mesh without one refuse.
"""

from __future__ import annotations

import re

import attrs

from snnfw import hookimpl
from snnfw.api import (GLOO_CUDA_POINT_TO_POINT, SPLIT, STAGES, Proposal, Strategy, keys_phrase, parse_layout,
                       refuse_others)

NAME = "pp"


def _layout(instance, attribute, value) -> None:
    if not re.fullmatch(r"[1-9][0-9]*(\|[1-9][0-9]*)*", value):
        raise ValueError(f"'layout' must be units per stage like \"1|2|2|1\", got {value!r}")


@attrs.frozen
class PipelineConfig:
    """The ``[pipeline]`` section (entry point ``snnfw.config``: ``pipeline``)."""

    schedule: str = attrs.field(default="1f1b", validator=attrs.validators.instance_of(str))
    virtual_stages: int = attrs.field(default=1, validator=[attrs.validators.instance_of(int), attrs.validators.gt(0)])
    layout: str | None = attrs.field(default=None, validator=attrs.validators.optional(
        [attrs.validators.instance_of(str), _layout]))


class Pipeline(Strategy):
    """The model cut into stages run by the schedule ``pipeline.schedule`` names; the stages' state kept under
    the model's own names."""

    def for_fake_world(self, model, config):
        """The schedule skips torch's warm-up vote over point-to-point messages and uses the stages' static shapes
        (snnfw gives every stage its input and output examples); the split this rank used goes on to the next."""
        from torch.distributed.pipelining.stage import InferenceMode

        def static(stages, has_backward, p2p_done):
            for stage in stages:
                stage._inference_mode = InferenceMode.STATIC

        model.schedule._warmup_p2p = static
        layout = "|".join(map(str, model.split.layout))
        config = config.with_section("pipeline", attrs.evolve(config.pipeline, layout=layout))
        return attrs.evolve(config, explicit=config.explicit | {"pipeline.layout"})

    dimension, parameters, splits_stages, order, shards_parameters = "pp", SPLIT, True, STAGES, True

    def reads_values(self, config, plugins):
        """The split runs the model: the measuring rank times its units, every rank runs a microbatch through the
        stages (``pp_values``)."""
        return True

    def variants(self, request, layout):
        """Under ``auto`` with no ``[pipeline]`` key set: every registered schedule (looped ones with 2 stages per
        rank)."""
        if any(key.startswith("pipeline.") for key in request.config.explicit):
            return []
        out = []
        for name in request.plugins.schedules.names():
            spec = request.plugins.schedules.get(name)
            virtual = {"single": 1, "v": 2}.get(spec.placement, max(2, spec.min_virtual))
            out.append((("pipeline.schedule", name), ("pipeline.virtual_stages", virtual)))
        return out

    def label(self, config, plan):
        pipeline = config.get("pipeline") or {}
        virtual = pipeline.get("virtual_stages", 1)
        return pipeline.get("schedule", "1f1b") + (f" v{virtual}" if virtual > 1 else "")

    def propose_dimension(self, request, layout):
        pipeline = request.config.pipeline
        return _stages(request, pipeline.schedule, pipeline.virtual_stages, dict(layout.mesh)["pp"], layout.replicas)

    def apply_dimension(self, model, plan, mesh, hooks, wrap=None, group=None):
        """Each stage this rank keeps through ``wrap``; its gradients averaged over ``group`` after a step's last
        microbatch, where the core hands one."""
        from snnfw_plugins.strategies.pp_build import build_pipeline

        return build_pipeline(model, plan, mesh, hooks, wrap, group)

    @hookimpl
    def snnfw_forward_backward(self, model, batches, plan, hooks):
        return model.train_step(batches)

    @hookimpl
    def snnfw_evaluate(self, model, frames, labels, plan, hooks):
        return model.evaluate(frames, labels)

    @hookimpl
    def snnfw_state_dict(self, model, optimizer, plan):
        """The stages' state under the model's own names (``pp_state``), so any strategy resumes from it."""
        from snnfw_plugins.strategies.pp_state import named_state

        return named_state(model, optimizer)

    @hookimpl
    def snnfw_load_state_dict(self, model, optimizer, plan, state):
        from snnfw_plugins.strategies.pp_state import load_named_state

        load_named_state(model, optimizer, state)
        return True

    @hookimpl
    def snnfw_step_metrics(self, plan, hooks):
        """Bytes sent between stages (``pp_sent_mb``) and, with log.phase_times (timing a stage waits for its
        device), the schedule's busy time and bubble."""
        kept = hooks.kept(NAME)
        if kept is None:
            return None
        figures = kept["step_times"].take()
        return figures if plan.config.log.phase_times else {"pp_sent_mb": figures["pp_sent_mb"]}

    @hookimpl
    def snnfw_summary(self, plan, hooks):
        """Units per stage of the run's split and, where it was measured, each stage's forward+backward ms on one
        microbatch (the sum of its units')."""
        kept = hooks.kept(NAME)
        if kept is None:
            return None
        split, out = kept["split"], {}
        for stage, units in enumerate(split.layout):
            out[f"pp_stage{stage}_units"] = float(units)
            if split.unit_ms:
                out[f"pp_stage{stage}_ms"] = sum(split.unit_ms[u] for u in split.unit_range(stage))
        return out


@hookimpl
def snnfw_register_strategies(register):
    register(NAME, Pipeline(), "the pp dimension: consecutive pipeline stages on its ranks, schedules by name "
                               "(pipeline.schedule)")


def _unit_names(request) -> tuple[str, ...]:
    from torch import nn

    if request.analysis.stage_units or request.analysis.own:  # an own model's units are declared or already inferred
        return request.analysis.stage_units
    if isinstance(request.model, nn.Sequential):
        return tuple(name for name, _ in request.model.named_children())
    return ()


GLUE_HINT = '"flatten:NAME" where its forward flattens [T, N, ...] before NAME (torch.flatten(x, 2))'


def _units_example(model) -> str:
    """The model's own top-level children, in order, as a stage_units list to start from: a child that begins with a
    Linear, after one holding a convolution and not after a Flatten, behind the flatten glue (``"flatten:fc"``)."""
    from torch import nn

    names, convolved, previous = [], False, None
    for name, child in model.named_children() if model is not None else ():
        first = next((m for m in child.modules() if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d))), None)
        glued = isinstance(first, nn.Linear) and convolved and not isinstance(previous, nn.Flatten)
        names.append(f"flatten:{name}" if glued else name)
        convolved = convolved or isinstance(first, (nn.Conv1d, nn.Conv2d))
        previous = child
    return "[" + ", ".join(f'"{name}"' for name in names or ["stem", "blocks.0", "head"]) + "]"


def _microbatch_refusal(count: int, stages: int, pp: int, spec, schedule: str) -> str | None:
    if count < stages:
        return f"train.microbatches {count} is fewer than the {stages} stages; set at least {stages}"
    if spec.check_microbatches and (reason := spec.check_microbatches(count, pp)):
        return f"schedule {schedule}: {reason}"
    return None


def choose_microbatches(replica_batch: int, stages: int, pp: int, spec) -> int | None:
    """The smallest divisor of ``replica_batch``, at least ``stages``, that the schedule accepts."""
    divisors = (count for count in range(stages, replica_batch + 1) if replica_batch % count == 0)
    return next((count for count in divisors if not _microbatch_refusal(count, stages, pp, spec, "")), None)


def _layout_refusal(text: str | None, units: tuple[str, ...], stages: int, shape: str) -> str | None:
    if text is None:
        return None
    layout = parse_layout(text)
    if len(layout) != stages:
        return f"pipeline.layout {text} has {len(layout)} stages, but {shape}"
    if sum(layout) != len(units):
        return f"pipeline.layout {text} sums to {sum(layout)} units, but the model has {len(units)} ({', '.join(units)})"
    return None


def _stages(request, schedule: str, virtual: int, pp: int, dp: int) -> Proposal:
    """``pp`` ranks of stages in each of ``dp`` replicas: the schedule, split and microbatches, or a refusal."""
    config, pipeline = request.config, request.config.pipeline
    if request.topology.shares_gpus:
        return Proposal.refuse(NAME, f"its stages send activations point to point: {GLOO_CUDA_POINT_TO_POINT}")
    spec = request.plugins.schedules.get(schedule)  # an unknown name lists the registered ones
    if reason := spec.virtual_refusal(schedule, virtual):
        return Proposal.refuse(NAME, reason)
    stages, units = pp * virtual, _unit_names(request)
    shape = f"pp {pp} x virtual_stages {virtual} = {stages} stages"
    if not units:
        return Proposal.refuse(NAME, f"{request.analysis.missing('stage_units', _units_example(request.model))}, "
                                     f"in the order its forward calls them, {GLUE_HINT}; it is no nn.Sequential, "
                                     "whose children would be the units")
    if len(units) < stages:
        return Proposal.refuse(NAME, f"the model has {len(units)} units ({', '.join(units)}), fewer than {shape}")
    if reason := _layout_refusal(pipeline.layout, units, stages, shape):
        return Proposal.refuse(NAME, reason)
    replica_batch = config.data.batch_size // dp
    micro = config.train.microbatches or choose_microbatches(replica_batch, stages, pp, spec)
    if micro is None:
        return Proposal.refuse(
            NAME, f"no divisor of the per-replica batch {replica_batch} is at least the {stages} stages and suits "
            f"schedule {schedule}; raise data.batch_size or set train.microbatches"
        )
    if reason := _microbatch_refusal(micro, stages, pp, spec, schedule):
        return Proposal.refuse(NAME, reason)
    placement = "; ".join(f"pp rank {r} holds stages {list(spec.stage_indices(r, pp, virtual))}" for r in range(pp))
    split = f"units per stage {pipeline.layout}" if pipeline.layout else "units balanced by measured forward+backward time"
    rationale = (
        f"schedule {schedule} over {shape}; {placement}",
        f"{len(units)} units, {split}",
        f"{dp} pipeline replicas, stage gradients averaged over them" if dp > 1 else "one pipeline replica",
    )
    return attrs.evolve(_costed(request, spec, pp, dp, virtual, micro), rationale=rationale, microbatches=micro)


def _costed(request, spec, pp: int, dp: int, virtual: int, microbatches: int) -> Proposal:
    """What the schedule adds to the composed estimate: its bubble, its microbatches in flight (a rank holds their
    activations), each stage boundary's [T, N, ...] activation sent forward and its gradient back (sized as the
    mean neuron state times T), and a send and a receive each way per boundary of every virtual stage."""
    cost = request.cost
    if cost is None:
        return Proposal(NAME)
    replica_batch = request.config.data.batch_size / dp
    boundary = request.config.model.time_steps * cost.neuron_state_bytes / max(len(request.analysis.neurons), 1)
    return Proposal(NAME, bubble=spec.bubble(pp, virtual, microbatches),
                    activation_shards=microbatches / spec.microbatches_in_flight(pp, microbatches),
                    added_comm_bytes=2 * virtual * replica_batch * boundary, added_calls=4 * (virtual - 1) * microbatches)


PIPELINE_KEYS = ("pipeline.schedule", "pipeline.virtual_stages", "pipeline.layout", "memopt.stage_ratio")


def _scope_refusals(request) -> list[Proposal]:
    """Refusals of the other strategies asked for when the user set a key only a pipeline applies."""
    keys = [key for key in PIPELINE_KEYS if key in request.config.explicit]
    if not keys:
        return []
    subject, pronoun = keys_phrase(keys)
    reason = f"{subject} applied only by a pp dimension; remove {pronoun}, or split into pipeline stages"
    return refuse_others(request, (NAME,), reason)


@hookimpl
def snnfw_plan(request):
    return _scope_refusals(request)


@hookimpl(trylast=True)
def snnfw_schedule(stages, plan, loss_fn, hooks):
    """A schedule whose spec names a torch.distributed.pipelining class: one stage or a list, as it takes."""
    spec = hooks.schedules.get(plan.config.pipeline.schedule)
    if spec.torch_schedule is None:
        return None
    from torch.distributed import pipelining

    schedule = getattr(pipelining, spec.torch_schedule)
    return schedule(stages[0] if spec.placement == "single" else stages, plan.microbatches, loss_fn=loss_fn)


@hookimpl(trylast=True)
def snnfw_split_stages(model, plan):
    """A model of the user's own: the stage units it declares (or its children when it is an
    ``nn.Sequential``), the first behind the time-major transpose when it takes ``[T, N, ...]``.
    Any other ``nn.Sequential`` model: one unit per child."""
    from torch import nn

    from snnfw.api import TimeMajor

    analysis = plan.analysis
    if not analysis.own:
        return list(model) if isinstance(model, nn.Sequential) else None
    units = [_stage_unit(model, name) for name in analysis.stage_units]
    if units and plan.config.model.input_layout == "TN":
        units[0] = nn.Sequential(TimeMajor(), units[0])
    return units or None


def _stage_unit(model, unit: str):
    """The module a stage unit names; ``"flatten:NAME"`` (the only glue ``model.stage_units`` takes): NAME behind
    ``torch.flatten(x, 2)``, the flatten a forward does between pooling and a Linear on ``[T, N, ...]``."""
    from torch import nn

    from snnfw.api import submodule

    glue, _, name = unit.rpartition(":")
    return nn.Sequential(nn.Flatten(2), submodule(model, name)) if glue == "flatten" else submodule(model, unit)
