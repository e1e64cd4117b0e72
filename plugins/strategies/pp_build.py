"""Building one pipeline rank: split the model, keep this rank's stages, wrap them for the schedule."""

from __future__ import annotations

import functools

import attrs
import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from snnfw.api import IN_PLACE, PluginError, autocast, submodule, training_loss
from snnfw_plugins.strategies.pp_model import PipelineModel, ScoredLoss
from snnfw_plugins.strategies.pp_stages import Stage, Stopwatch, decide_split, pipeline_stage, pipeline_units
from snnfw_plugins.strategies.pp_state import model_names, tensor_names
from snnfw_plugins.strategies.pp_values import UnitValues, streamed

EXAMPLE_FIRING = 0.2  # share of active pixels in the dry run's frames


def example_frames(plan, hooks, device, mesh) -> torch.Tensor:
    """One microbatch of sparse random event frames ``[N, T, C, H, W]`` (a language model's random token ids
    ``[N, T, S]``) for splitting and the dry run, of the time steps and positions this rank reads (a time split's
    chunk, a sequence split's slice)."""
    config = plan.config
    flavor = None if config.model.input_shape else hooks.families.get(config.model.family).flavor(config.model.flavor)
    shape = config.model.input_shape or flavor.shape_for(config.model.sequence_length)
    if positions := hooks.sequence_view(plan, mesh):  # a sequence split's slice
        shape = (positions[1] - positions[0],)
    view = hooks.time_view(plan, mesh)
    steps = view[1] - view[0] if view else config.model.time_steps
    generator = torch.Generator().manual_seed(config.train.seed)
    if flavor is not None and flavor.vocab is not None:
        ids = torch.randint(flavor.vocab, (plan.microbatch_size, 1, *shape), generator=generator)
        return ids.expand(-1, steps, *shape).to(device)
    frames = torch.rand(plan.microbatch_size, steps, *shape, generator=generator) < EXAMPLE_FIRING
    return frames.to(device, config.train.torch_dtype)


def stage_inputs(stages: list[Stage], example: torch.Tensor, hooks, values: UnitValues | None = None
                 ) -> list[torch.Tensor]:
    """One microbatch of input for every stage: ``example`` through the stages before it, each unit holding its
    ``values`` as it runs where the stages are on the meta device. Every stage receives its input in the layout
    the stage before produced it (channels-last or not)."""

    def run() -> list[torch.Tensor]:
        inputs, x = [], example
        with torch.no_grad():
            for before, stage in zip([None, *stages], stages):
                stage.receives_channels_last = before is not None and before.sent_channels_last
                inputs.append(x)
                hooks.reset_state(stage)
                x = stage(x)
        return inputs

    return streamed(values, tuple(stages), run)


def build_pipeline(model: nn.Module, plan, mesh, hooks, wrap=None, dp_group=None) -> PipelineModel:
    """This rank's stages of ``model``, each passed through ``wrap`` (a composed mesh's data dimensions), their
    torch PipelineStages and the schedule; stage gradients averaged over ``dp_group`` where given."""
    pipeline, pp_mesh = plan.config.pipeline, mesh["pp"]
    spec = hooks.schedules.get(pipeline.schedule)
    pp, pp_rank, group = pp_mesh.size(), pp_mesh.get_local_rank(), pp_mesh.get_group()
    device, values = _device_and_values(model, mesh, hooks)
    names = tensor_names(model)
    example = example_frames(plan, hooks, device, mesh)
    units = pipeline_units(model, plan, hooks, example) or []
    declared = plan.analysis.stage_units
    if not units or (declared and len(units) != len(declared)):
        raise PluginError(
            f"splitting {plan.analysis.family!r} into pipeline units gave {len(units)} units for the "
            f"{len(declared)} stage_units it declares; its plugin must implement snnfw_split_stages"
        )
    split = decide_split(model, plan, hooks, example, pp * pipeline.virtual_stages, units, _in_place_peers(plan, mesh, hooks),
                         values)
    indices = spec.stage_indices(pp_rank, pp, pipeline.virtual_stages)
    precision = functools.partial(autocast, plan.config.train, plan.device_type)
    every = [Stage(*(units[u] for u in split.unit_range(index)), precision=precision) for index in range(len(split.layout))]
    hooks.transform_stages(model, list(zip(every, stage_inputs(every, example, hooks, values))), tuple(indices), plan)
    hooks.compile(model, plan)
    blocks = [submodule(model, name) for name in plan.analysis.blocks]
    stages = {index: (wrap or _same)(every[index], _stage_plan(plan, every[index], blocks)) for index in indices}
    local_units = {u for index in indices for u in split.unit_range(index)}
    for u, unit in enumerate(units):
        if u not in local_units and not is_fake(example):  # fake tensors (the dry run) hold no memory
            unit.to("meta")  # frees what other ranks hold
    for stage in stages.values():
        stage.register_forward_pre_hook(lambda module, args: hooks.reset_state(module))
    stopwatch = Stopwatch(torch.device(device), enabled=plan.config.log.phase_times)
    loss = ScoredLoss(training_loss(plan.config.train, hooks))
    torch_stages = [pipeline_stage(stages[i], i, split, device, group, stopwatch, split.sends_spikes(i, plan.config))
                    for i in indices]
    schedule = hooks.schedule(torch_stages, plan, loss)
    if schedule is None:
        raise PluginError(f"no plugin builds schedule {pipeline.schedule!r}; its plugin must implement snnfw_schedule")
    owner = {index: rank for rank in range(pp) for index in spec.stage_indices(rank, pp, pipeline.virtual_stages)}
    owners = tuple(owner[index] for index in range(len(split.layout)))
    pipeline = PipelineModel(stages, schedule, loss, split, owners, device, group, dp_group, stopwatch, torch_stages,
                             plan.config)
    pipeline.model_names = model_names(pipeline, names)
    pipeline.unsaved_names = model_names(pipeline, names, unsaved=True)
    if hooks.run is not None:  # for the run's step metrics and summary
        hooks.run.kept["pp"] = {"split": split, "step_times": pipeline.step_times}
    return pipeline


def _device_and_values(model: nn.Module, mesh, hooks) -> tuple[torch.device, UnitValues | None]:
    """The device the stages run on, and the initial values of a model built on the meta device (its ranks
    materialize only their stages after the split: ``Pipeline.reads_values``)."""
    parameter = next(model.parameters())
    if not parameter.is_meta:
        return parameter.device, None
    device = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device(mesh.device_type)
    return device, UnitValues(model, hooks.initial, device)


def _same(stage, plan):
    return stage


def _stage_plan(plan, stage: nn.Module, blocks: list[nn.Module]):
    """``plan`` as it applies to ``stage``: the model's blocks that lie in it, named within it (FSDP2's units)."""
    inside = {id(block) for block in blocks}
    names = tuple(name for name, module in stage.named_modules() if id(module) in inside)
    return attrs.evolve(plan, analysis=attrs.evolve(plan.analysis, blocks=names))


def _in_place_peers(plan, mesh, hooks) -> tuple[int, ...]:
    """The last rank's peers along the mesh dimensions applied in place (a composed mesh's tp and time), whose layers
    exchange with it."""
    dims = {name for (name, _), strategy in zip(plan.mesh, plan.strategies)
            if hooks.strategy(strategy).order == IN_PLACE}
    if not dims:
        return ()
    index = tuple(slice(None) if name in dims else -1 for name in mesh.mesh_dim_names)
    return tuple(mesh.mesh[index].flatten().tolist())
