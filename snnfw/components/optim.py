"""Optimizers and learning-rate schedules by name: their specs, parameter groups, checks and the scheduler.

Plugins register an :class:`OptimizerSpec` under ``snnfw_register_optimizers``
and an :class:`LrScheduleSpec` under ``snnfw_register_lr_schedules``. Each
spec lists the ``[train]`` keys it takes; a key set for an optimizer or
schedule that does not take it is refused, naming it. Every schedule starts
with ``train.warmup_steps`` steps of linear warm-up and is stepped once per
optimizer step (``torch.optim.lr_scheduler.LambdaLR``, so the learning rate is
``train.lr`` times a function of the step alone).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import attrs

from snnfw.config import TrainConfig
from snnfw.errors import ConfigError

OPTIMIZER_KEYS = ("weight_decay", "betas", "momentum", "nesterov")
SCHEDULE_KEYS = ("min_lr", "step_size", "milestones", "gamma")


@attrs.frozen
class OptimizerSpec:
    """An optimizer: ``torch_class()`` returns its class, which takes each of ``options`` as the keyword
    argument of that name; ``defaults`` are snnfw's values where they differ from the class's own,
    and ``state_tensors`` the tensors it keeps per parameter (for memory estimates)."""

    torch_class: Callable[[], type]
    options: tuple[str, ...]
    defaults: dict[str, Any] = attrs.field(factory=dict)
    state_tensors: int = 0


@attrs.frozen
class LrScheduleSpec:
    """A learning-rate schedule after warm-up: ``factor(options, train)`` returns ``f(step)``, the
    multiple of ``train.lr`` at each 0-based optimizer step from ``train.warmup_steps`` to
    ``train.steps``. ``options`` are the ``train`` keys it takes, resolved from the config or from
    ``defaults`` (a key in neither is required); ``check(options, train)`` refuses values it cannot
    use with a ConfigError."""

    factor: Callable[[dict[str, Any], TrainConfig], Callable[[int], float]]
    options: tuple[str, ...] = ()
    defaults: dict[str, Any] = attrs.field(factory=dict)
    check: Callable[[dict[str, Any], TrainConfig], None] | None = None


def _set(train: TrainConfig, keys: tuple[str, ...]) -> dict[str, Any]:
    return {key: getattr(train, key) for key in keys if getattr(train, key) is not None}


def _refuse_foreign(train: TrainConfig, keys, options, what: str, name: str) -> None:
    for key in keys:
        if getattr(train, key) is not None and key not in options:
            takes = ", ".join(f"train.{k}" for k in options) or "none of them"
            raise ConfigError(f"train.{key} does not apply to {what} = {name!r}, which takes {takes}; remove train.{key}")


def _meshes(parameters) -> set:
    """The device meshes of the parameters, None standing for plain tensors."""
    return {getattr(p, "device_mesh", None) for p in parameters}


def _fused_on_dtensors(optimizer_class: type) -> bool:
    """Whether DTensor runs the class's fused kernel: it shards torch's Adam and AdamW kernels alone."""
    import torch

    return issubclass(optimizer_class, (torch.optim.Adam, torch.optim.AdamW))


def _implementation(train: TrainConfig, optimizer_class: type, parameters) -> dict[str, bool]:
    """The keyword arguments that pick ``train.optimizer_impl`` for ``parameters`` (None: not built yet).

    fused and foreach kernels take one list of parameters of one kind: all
    plain tensors, or all DTensors of one mesh (every built-in strategy's
    ranks hold one kind; a strategy of one's own, such as torch's tensor
    parallelism of some layers, may mix them). ``auto`` is the fused kernel (one pass over each
    parameter for all of its arithmetic) where the class has one that runs on
    these parameters, the loop over parameters where they are of mixed kinds,
    else the class's own choice.
    """
    takes = inspect.signature(optimizer_class).parameters
    meshes = _meshes(parameters) if parameters is not None else {None}
    fusable = "fused" in takes and (meshes == {None} or (len(meshes) == 1 and _fused_on_dtensors(optimizer_class)))
    impl = train.optimizer_impl
    if impl == "auto":
        return {"foreach": False} if len(meshes) > 1 else {"fused": True} if fusable else {}
    flag = "fused" if impl == "fused" else "foreach"
    if flag not in takes:
        raise ConfigError(
            f"train.optimizer_impl = {impl!r} needs an optimizer that takes {flag!r}, and {train.optimizer} "
            f"({optimizer_class.__name__}) does not; set train.optimizer_impl = \"auto\""
        )
    if impl == "for_loop":
        return {"foreach": False}
    if len(meshes) > 1 or (impl == "fused" and not fusable):
        raise ConfigError(
            f"train.optimizer_impl = {impl!r} cannot run over this strategy's parameters: "
            + ("plain tensors beside DTensors, or DTensors of two meshes" if len(meshes) > 1
               else f"DTensors, and DTensor has no fused {optimizer_class.__name__} kernel")
            + "; set train.optimizer_impl = \"auto\" or \"for_loop\""
        )
    return {flag: True}


def optimizer_options(train: TrainConfig, plugins, parameters=None) -> tuple[type, dict[str, Any]]:
    """The class of ``train.optimizer`` and its keyword arguments: ``lr``, the keys it takes, and the
    implementation for ``parameters`` (None: checked before they exist)."""
    spec = plugins.optimizers.get(train.optimizer)
    optimizer_class = spec.torch_class()
    options = {"lr": train.lr, **spec.defaults, **_set(train, spec.options)}
    return optimizer_class, {**options, **_implementation(train, optimizer_class, parameters)}


def _default_weight_decay(optimizer_class: type) -> float:
    """The class's own default of ``weight_decay`` (AdamW's 0.01), 0 where it has none."""
    parameter = inspect.signature(optimizer_class).parameters.get("weight_decay")
    return 0.0 if parameter is None or parameter.default is inspect.Parameter.empty else float(parameter.default)


def schedule_options(train: TrainConfig, plugins) -> dict[str, Any]:
    """The options of ``train.lr_schedule``, from the config or the schedule's defaults."""
    spec = plugins.lr_schedules.get(train.lr_schedule)
    return {**spec.defaults, **_set(train, spec.options)}


def check_train(train: TrainConfig, plugins) -> None:
    """Refuses an unknown optimizer or schedule, a key that does not apply to it, and values it cannot use."""
    spec = plugins.optimizers.get(train.optimizer)
    _refuse_foreign(train, OPTIMIZER_KEYS, spec.options, "train.optimizer", train.optimizer)
    optimizer_class, kwargs = optimizer_options(train, plugins)
    if kwargs.get("nesterov") and not kwargs.get("momentum"):
        raise ConfigError("train.nesterov needs momentum; set train.momentum above 0 or remove train.nesterov")
    decay = kwargs.get("weight_decay", _default_weight_decay(optimizer_class))
    if train.no_decay and not decay:
        raise ConfigError(
            f"train.no_decay exempts parameters from weight decay, but {train.optimizer} decays none "
            "(train.weight_decay is 0); set train.weight_decay or remove train.no_decay"
        )
    schedule = plugins.lr_schedules.get(train.lr_schedule)
    _refuse_foreign(train, SCHEDULE_KEYS, schedule.options, "train.lr_schedule", train.lr_schedule)
    if train.warmup_steps >= train.steps:
        raise ConfigError(
            f"train.warmup_steps ({train.warmup_steps}) must be less than train.steps ({train.steps}); lower it"
        )
    options = schedule_options(train, plugins)
    for key in schedule.options:
        if key not in options:
            raise ConfigError(f"train.lr_schedule = {train.lr_schedule!r} needs train.{key}; set it")
    if schedule.check is not None:
        schedule.check(options, train)


def _groups(model, kinds: tuple[str, ...]) -> tuple[list, list]:
    """The trainable parameters ``model`` holds, split into decayed ones and those of an exempt kind."""
    from torch import nn

    from snnfw.model.analysis import is_neuron

    norms = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)
    decayed, exempt, seen = [], [], set()
    for module in model.modules():
        module_kinds = {"norm"} if isinstance(module, norms) else {"neuron"} if is_neuron(module) else set()
        for name, parameter in module.named_parameters(recurse=False):
            if not parameter.requires_grad or id(parameter) in seen:
                continue
            seen.add(id(parameter))
            own = module_kinds | ({"bias"} if name == "bias" else set())
            (exempt if own & set(kinds) else decayed).append(parameter)
    return decayed, exempt


def trainable(model) -> list:
    """The parameters of ``model`` that require grad."""
    return [p for p in model.parameters() if p.requires_grad]


def parameter_groups(model, train: TrainConfig) -> list:
    """The parameters to optimise: all of them, or with ``train.no_decay`` a decayed group and an exempt one.

    Groups are formed from the parameters this rank holds (a pipeline stage, a
    tensor-parallel or FSDP2 shard), by module kind and parameter name, so every
    rank has the same groups, in the same order, whatever it holds of each.
    """
    decayed, exempt = _groups(model, train.no_decay)
    if not train.no_decay:
        return decayed or [{"params": []}]  # a group, though empty: a pipeline stage of neurons alone holds none
    return [{"params": decayed}, {"params": exempt, "weight_decay": 0.0}]


def build_optimizer(model, train: TrainConfig, plugins):
    """``train.optimizer`` over ``parameter_groups(model, train)``."""
    groups = parameter_groups(model, train)
    optimizer_class, kwargs = optimizer_options(train, plugins, trainable(model))
    return optimizer_class(groups, **kwargs)


def lr_factor(train: TrainConfig, plugins) -> Callable[[int], float]:
    """The multiple of ``train.lr`` at each 0-based optimizer step: a linear warm-up of ``W`` steps
    (``(step + 1) / (W + 1)``, so no step trains at 0), then the schedule, from ``train.lr`` at step ``W``."""
    spec = plugins.lr_schedules.get(train.lr_schedule)
    warmup = train.warmup_steps
    after = spec.factor(schedule_options(train, plugins), train)
    return lambda step: (step + 1) / (warmup + 1) if step < warmup else after(step)


def build_scheduler(optimizer, train: TrainConfig, plugins):
    """A ``LambdaLR`` over ``optimizer`` that follows ``lr_factor``; step it once per optimizer step."""
    from torch.optim.lr_scheduler import LambdaLR

    return LambdaLR(optimizer, lr_factor(train, plugins))


def resume_scheduler(scheduler, state: dict, lr: float) -> None:
    """Continues ``scheduler`` at its checkpointed step, on the curve of ``lr`` (the config's ``train.lr``)."""
    scheduler.load_state_dict(state)
    scheduler.base_lrs = [lr] * len(scheduler.base_lrs)
    for group, factor in zip(scheduler.optimizer.param_groups, scheduler.lr_lambdas):
        group["initial_lr"] = lr
        group["lr"] = lr * factor(scheduler.last_epoch)

