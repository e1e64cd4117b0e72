"""Hook specifications: the contract between the snnfw core and its plugins.

Hooks are called with keyword arguments only. A ``firstresult`` hook stops at
the first implementation that returns something other than None, so a plugin
declines by returning None. Built-in plugins load first and third-party ones
after them; pluggy calls the last registered first, so an installed package
overrides a built-in by answering the same hook.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import pluggy

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from snnfw.components.step import StepOutput
    from snnfw.config import Config
    from snnfw.model.analysis import Analysis, AnalysisPart
    from snnfw.plan.layout import Plan, PlanRequest, Proposal
    from snnfw.plugin.context import HookContext

hookspec = pluggy.HookspecMarker("snnfw")
hookimpl = pluggy.HookimplMarker("snnfw")  # what plugins mark their implementations with: snnfw.hookimpl


# Registration: each hook receives ``register(name, value, description="", overrides=False)``;
# ``overrides=True`` replaces the entry another plugin registered under that name.


@hookspec
def snnfw_register_strategies(register: Callable[..., None]) -> None:
    """Register parallelism strategies by name with their :class:`snnfw.plugin.strategy.Strategy` object
    (``register("dp", Strategy(), "DDP ...")``; None stands for the defaults).

    The object proposes how to run a request that names the strategy (or ``auto``:
    :meth:`~snnfw.plugin.strategy.Strategy.propose`), may own a dimension of a
    composed mesh, and implements the hooks that apply and run it
    (:func:`snnfw_parallelize` at least), called only for its plans.
    """


@hookspec
def snnfw_register_model_families(register: Callable[..., None]) -> None:
    """Register model families: ``register(name, snnfw.model.families.ModelFamily(...))``."""


@hookspec
def snnfw_register_datasets(register: Callable[..., None]) -> None:
    """Register data sets: ``register(name, snnfw.data.batches.DatasetSpec(...))``."""


@hookspec
def snnfw_register_schedules(register: Callable[..., None]) -> None:
    """Register pipeline schedules: ``register(name, snnfw.distributed.pipeline.ScheduleSpec(...))``.

    A spec that names a ``torch_schedule`` class is built by the ``pp``
    plugin; otherwise :func:`snnfw_schedule` answers for the name.
    """


@hookspec
def snnfw_register_optimizers(register: Callable[..., None]) -> None:
    """Register optimizers for ``train.optimizer``: ``register(name, snnfw.components.optim.OptimizerSpec(...))``."""


@hookspec
def snnfw_register_lr_schedules(register: Callable[..., None]) -> None:
    """Register learning-rate schedules for ``train.lr_schedule``: ``register(name, snnfw.components.optim.LrScheduleSpec(...))``.

    Every schedule follows ``train.warmup_steps`` of linear warm-up and is
    stepped once per optimizer step.
    """


@hookspec
def snnfw_register_losses(register: Callable[..., None]) -> None:
    """Register training losses for ``train.loss``: ``register(name, snnfw.components.losses.LossSpec(...))``."""


# The flow: analyze -> plan -> apply (parallelize, optimizer) -> run.


@hookspec
def snnfw_analyze(model: torch.nn.Module, family: str) -> AnalysisPart | None:
    """Contribute to the analysis of ``model``, built by the family named ``family``.

    Return an :class:`snnfw.model.analysis.AnalysisPart` (the blocks to shard, the
    units that may start a pipeline stage) or None. Parts of all plugins are
    merged; the core itself finds the neurons and tensor-parallel candidates.
    """


@hookspec
def snnfw_preference_defaults(config: Config) -> dict[str, Any] | None:
    """Settings that ``config.parallel.prefer`` implies for the chosen strategy.

    Return a dict like ``{"parallel.zero": True}`` or None. Called once the
    strategy is known (explicit, or chosen by ``auto``); a setting applies only
    where the config still holds that key's default.
    """


@hookspec
def snnfw_plan(request: PlanRequest) -> Proposal | list[Proposal] | None:
    """Propose how to run ``request`` (:class:`snnfw.plan.layout.PlanRequest`), beside what each asked strategy's
    object proposes itself (:meth:`snnfw.plugin.strategy.Strategy.propose`): refusals of other strategies that
    would ignore a key only this plugin's apply, or a strategy's proposal made by hook.

    Return an :class:`snnfw.plan.layout.Proposal` for each strategy this plugin owns
    (a refusal with its reason if it cannot run), or None. The core picks the
    proposal of ``request.strategy`` and validates it against the world. Under
    ``auto`` a list of proposals, each with its ``settings``, lets ``auto``
    choose among variants of one strategy.
    """


@hookspec
def snnfw_transform_model(model: torch.nn.Module, plan: Plan, example: torch.Tensor, hooks: HookContext) -> None:
    """Change the unparallelized ``model`` in place before :func:`snnfw_parallelize`.

    ``example`` is one training microbatch of frames, the same on every rank.
    Called on every rank, inside the process group, by every implementation
    in turn; the return value is ignored. A transform may put wrappers around
    modules (memory optimisation's checkpoint wrappers): strategies find the
    analysis's names through them with :func:`snnfw.model.analysis.submodule`.
    """


@hookspec
def snnfw_transform_runs_model(config: Config) -> bool | None:
    """Return True where this plugin's :func:`snnfw_transform_model` will run the model under ``config`` (a forward
    pass, a timing), which needs its values; None otherwise.

    Asked before the model is built: under a strategy that shards parameters, ranks other than 0 build it on the
    meta device (:mod:`snnfw.distributed.materialize`) unless a transform says it runs it.
    """


@hookspec
def snnfw_tune_settings(config: Config, analysis: Analysis, device_type: str) -> dict[str, tuple] | None:
    """Values of this plugin's config keys for ``snnfw tune`` to try beside ``config``'s own on ``device_type``:
    ``{"model.neuron_backend": ("inductor",)}``, or None. Offer values that change how a rank computes its step
    (``analysis``: the model's :class:`snnfw.model.analysis.Analysis`), and only those that can run here.

    ``tune`` profiles the model under each combination with the keys the user did not set, and takes each
    candidate's collectives from its dry run under the config as given: a setting that changes what crosses
    ranks is a strategy's setting, proposed under ``auto`` instead. (Added in 0.2.0.)
    """


@hookspec(firstresult=True)
def snnfw_parallelize(
    model: torch.nn.Module, plan: Plan, mesh: DeviceMesh | None, hooks: HookContext,
) -> torch.nn.Module | None:
    """Apply ``plan`` to ``model`` on ``mesh`` (a DeviceMesh, or None on one rank).

    ``hooks`` is the run's :class:`snnfw.plugin.context.HookContext`, for calling other
    hooks (``hooks.shard_neuron(...)``). Return the model to train (wrapped or
    changed in place), or None to decline a plan whose strategy is not this
    plugin's. Stops at the first non-None result.

    A strategy calls ``hooks.compile(model, plan)`` once its model is ready
    for compilation: after tensor parallel, before FSDP2, DDP or pipeline
    stage wrappers.
    """


@hookspec
def snnfw_compile(model: torch.nn.Module, plan: Plan, hooks: HookContext) -> None:
    """Apply ``torch.compile`` where ``plan`` asks for it, in place; the return value is ignored.

    Called by strategy plugins from :func:`snnfw_parallelize` (after tensor
    parallel, before FSDP2 or DDP), by every implementation in turn. (0.2.0 added ``hooks``.)
    """


@hookspec(firstresult=True)
def snnfw_build_optimizer(
    model: torch.nn.Module, plan: Plan, mesh: DeviceMesh | None, hooks: HookContext,
) -> torch.optim.Optimizer | None:
    """Return the optimizer for the parallelized ``model`` on ``mesh``, or None to decline.

    Stops at the first non-None result; the fallback is ``train.optimizer``
    over :func:`snnfw.components.optim.parameter_groups` of the parameters this rank holds
    (``hooks.optimizers`` is the registry of optimizer specs).
    """


@hookspec(firstresult=True)
def snnfw_forward_backward(
    model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], plan: Plan, hooks: HookContext,
) -> StepOutput | None:
    """Run forward and backward over this rank's microbatches of one optimizer step.

    ``batches`` is a list of ``(frames, labels)`` microbatches. Accumulate
    gradients as the mean over them (the optimizer step follows) and return a
    :class:`snnfw.components.step.StepOutput`, or None to decline. Stops at the first
    non-None result; the default runs them one after another with a neuron
    reset before each, synchronising gradients on the last.
    """


@hookspec(firstresult=True)
def snnfw_evaluate(
    model: torch.nn.Module, frames: torch.Tensor, labels: torch.Tensor, plan: Plan, hooks: HookContext,
) -> StepOutput | None:
    """Score one evaluation batch without gradients; return a :class:`snnfw.components.step.StepOutput`.

    Stops at the first non-None result; return None to decline.
    """


@hookspec(firstresult=True)
def snnfw_time_view(plan: Plan, mesh: DeviceMesh | None) -> tuple[int, int] | None:
    """Return ``(start, stop)``: the time steps of each sample that this rank's applied model reads, or None
    for all of them.

    The data loader then hands the rank only those frames: a data set with ``time_slice(index, start, stop)``
    reads only them (snnfw's raw event sets do), any other is sliced after loading. The model is given
    ``[N, stop - start, ...]`` frames.
    """


@hookspec(firstresult=True)
def snnfw_sequence_view(plan: Plan, mesh: DeviceMesh | None, hooks: HookContext) -> tuple[int, int] | None:
    """Return ``(start, stop)``: the positions of each sample's sequence (a language model's tokens) that this
    rank's applied model reads and scores, or None for all of them.

    The data loader then hands the rank those positions of every sample's token ids ``[T, S]`` and of its next
    tokens ``[S]``: the model is given ``[N, T, stop - start]`` ids, the loss ``[N, stop - start]`` labels.
    """


@hookspec
def snnfw_step_metrics(plan: Plan, hooks: HookContext) -> dict[str, float] | None:
    """Return a dict of extra per-step metrics (numbers) since the last call, or None.

    Called on every rank after each optimizer step; the values are summed
    over ranks, divided by the world size, and added to ``metrics.jsonl``. Counters a plugin keeps for the run
    live in ``hooks.run.kept`` (0.2.0 added ``hooks``).
    """


@hookspec
def snnfw_step_start(step: int, rank: int, hooks: HookContext) -> None:
    """Called on every rank before training step ``step`` (counted from 1); ``rank`` is this rank's number.
    What a plugin keeps from step to step lives in ``hooks.run.kept`` (0.2.0 added ``hooks``)."""


@hookspec
def snnfw_results_due(rank: int) -> None:
    """Called on every rank after training and its last evaluation, before rank 0 writes the run's results."""


@hookspec
def snnfw_rank_done(rank: int) -> None:
    """Called in each rank of ``python -m snnfw.train`` once its work is complete and marked done, as it exits."""


@hookspec
def snnfw_summary(plan: Plan, hooks: HookContext) -> dict[str, float] | None:
    """Return a dict of extra numbers for ``summary.json`` (seconds spent optimising, ...) or None.

    Called on every rank after training, which must return the same keys on
    every rank; the summary holds each value's maximum over ranks. (0.2.0 added ``hooks``.)
    """


@hookspec(firstresult=True)
def snnfw_state_dict(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, plan: Plan,
) -> dict[str, Any] | None:
    """Return the training state ``{"model": ..., "optimizer": ...}`` as this rank holds it, for a checkpoint.

    ``"model"`` maps the unparallelized model's parameter and buffer names to
    what this rank holds of them: whole tensors (replicated or owned), DTensors
    (FSDP2's shards), or :class:`snnfw.distributed.chunks.Chunked` pieces of a
    whole tensor at their offsets; ``"optimizer"`` is keyed by parameter names
    as ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``
    returns it. Nothing is gathered: each rank writes its part, and on resuming
    the same structure is what a checkpoint of any strategy is read into. A
    collective: every rank calls it. Return None to decline; stops at the first
    non-None result, the default taking the state dict API's sharded state. ``optimizer`` None asks for the
    model's part alone (``"optimizer"`` then holds no state): a model is materialized that way before its
    optimizer exists (:mod:`snnfw.distributed.materialize`).
    """


@hookspec(firstresult=True)
def snnfw_load_state_dict(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, plan: Plan, state: dict[str, Any],
) -> bool | None:
    """Load ``state`` (what :func:`snnfw_state_dict` returned, read from a checkpoint that another strategy or
    world size may have written) into ``model`` and ``optimizer``.

    Return True when done, or None to decline. Stops at the first non-None result.
    """


@hookspec(firstresult=True)
def snnfw_reset_state(model: torch.nn.Module) -> bool | None:
    """Reset all neuron state of ``model`` before an independent microbatch.

    Return True when done, or None to decline. Stops at the first non-None result.
    """


@hookspec(firstresult=True)
def snnfw_shard_neuron(module: torch.nn.Module, placement: Any, mesh: DeviceMesh | None) -> torch.nn.Module | None:
    """Make neuron ``module`` keep only the shard of its state that ``placement`` gives.

    Return the module to use, or None to decline (for a neuron type the plugin
    does not know). Stops at the first non-None result.
    """


@hookspec(firstresult=True)
def snnfw_split_stages(model: torch.nn.Module, plan: Plan, example: torch.Tensor) -> list[torch.nn.Module] | None:
    """Split ``model`` into its pipeline units; ``example`` is one microbatch of input.

    Return the modules, in forward order, whose composition computes
    ``model(example)``: one per ``stage_units`` entry of the analysis, with the
    family's glue (layout changes, flatten, pooling) inside them, made of the
    model's own submodules. A pipeline stage runs a consecutive range of them.
    Return None to decline. Stops at the first non-None result; family
    plugins answer before the generic splitter of ``nn.Sequential`` models.
    """


@hookspec
def snnfw_transform_stages(
    model: torch.nn.Module, stages: list, local: tuple[int, ...], plan: Plan, hooks: HookContext,
) -> None:
    """Change this rank's pipeline stages in place once the split is decided, before they run.

    ``stages`` lists every stage of the pipeline in order as ``(module, example)``:
    its consecutive units (submodules of ``model``) and one microbatch of its
    input, so that every rank can rank all stages alike; ``local`` holds the
    indices of the stages this rank runs, the only ones to change. Called by
    pipeline strategies on every rank, after :func:`snnfw_transform_model`
    has seen the whole model; transforms that choose by stage act here. The
    return value is ignored.
    """


@hookspec(firstresult=True)
def snnfw_schedule(
    stages: list, plan: Plan, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], hooks: HookContext,
) -> Any:
    """Build the pipeline schedule named by ``plan.config.pipeline.schedule``.

    ``stages`` are this rank's ``torch.distributed.pipelining.PipelineStage``
    objects in forward order, placed as the schedule's registered
    :class:`snnfw.distributed.pipeline.ScheduleSpec` says; ``loss_fn(output, target)`` is
    the loss of one microbatch. Return a schedule object with ``step(*args,
    target=..., losses=...)`` for ``plan.microbatches`` microbatches, or None
    when the schedule is not this plugin's. The ``pp`` plugin builds those
    whose spec names a ``torch_schedule`` class. Stops at the first non-None
    result.
    """
