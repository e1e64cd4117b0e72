"""analyze -> plan: the model, its analysis and the plan, decided before any process starts.

``snnfw plan`` stops here. ``snnfw train`` plans once and writes the plan file
(:mod:`snnfw.plan.planfile`), under which each rank only builds its model
(:func:`from_plan`); a rank started without one (plain torchrun, the Python
API) plans for itself, the same config and seed giving the same model and
plan. Each then applies and runs it (:mod:`snnfw.run.loop`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import attrs
import torch

from snnfw.components import extras
from snnfw.components.losses import check_loss
from snnfw.components.optim import check_train
from snnfw.components.precision import check_precision, precision_notes
from snnfw.config import Config, check_log_steps
from snnfw.data import batches as datalib
from snnfw.data.augment import check_augment
from snnfw.distributed import cpu_allocator
from snnfw.distributed.materialize import builds_shards
from snnfw.errors import ConfigError, users_code
from snnfw.model import recipe
from snnfw.model import source as models
from snnfw.model.analysis import Analysis, analyze
from snnfw.model.probe import check_model
from snnfw.plan import cost_model, presets
from snnfw.plan.auto import Decision, choose, measure, ranked_candidates
from snnfw.plan.estimate import ModelCost
from snnfw.plan.layout import AUTO, Plan, PlanRequest, Topology, make_plan
from snnfw.plugin.manager import Plugins


def build_model(config: Config, plugins: Plugins, given=None):
    """Builds the configured model (or ``given``) with the run's seed; returns (model, input spec)."""
    source = models.source(config, plugins, given)
    return _build(config, source)[1], source.spec


def model_alone(config: Config, plugins: Plugins) -> tuple[Config, torch.nn.Module, datalib.InputSpec]:
    """The configured model as one process outside a run builds it (``snnfw export --format nir``): the data set's
    classes followed, built with the run's seed; nothing planned, so whatever strategy the config names."""
    check_data(config, plugins, False)
    config = follow_data(config, plugins)[0]
    source = models.source(config, plugins)
    config, model, _ = _build(config, source)
    return config, model, source.spec


def _built(config: Config, source: models.Source) -> torch.nn.Module:
    """The model, built with the run's seed."""
    torch.manual_seed(config.train.seed)
    with users_code(f"building {source.name}"):
        model = source.build()
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"{source.name} returned {type(model).__name__}, not a torch.nn.Module; return the network")
    return model


def _build(config: Config, source: models.Source, built: torch.nn.Module | None = None,
           ) -> tuple[Config, torch.nn.Module, tuple[str, ...]]:
    """The config (with the input layout a model of the user's own takes), the model (``built`` if given), and the
    plan's lines on it."""
    model, notes = built if built is not None else _built(config, source), ()
    if source.own:
        explicit = "model.input_layout" in config.explicit
        layout, notes = check_model(model, source.name, source.spec, config.model.input_layout, explicit)
        config = attrs.evolve(config, model=attrs.evolve(config.model, input_layout=layout))
    if config.model.input_layout == "TN":
        models.time_major_input(model)
    return config, model, notes


def _analyze(model, config: Config, source, plugins: Plugins) -> Analysis:
    return analyze(model, source.name, plugins, models.own_part(model, config) if source.own else None)


def _built_and_analyzed(config: Config, source: models.Source, plugins: Plugins, built: torch.nn.Module | None = None):
    """:func:`_build` and the analysis."""
    config, model, notes = _build(config, source, built)
    return config, model, notes, _analyze(model, config, source, plugins)


def _recorded(config: Config, source: models.Source, rank: int, sendable: bool
              ) -> tuple[torch.nn.Module, recipe.Recipe | None]:
    """The model of a rank that materializes only its shard: built on the meta device and recorded, to be replayed
    one tensor at a time; where a replay could differ from the build (``recipe.record`` refuses it), built on the
    CPU by rank 0 and, if its values can be ``sendable`` (:func:`_shard_build`), on the meta device by the others,
    who are sent rank 0's values (no recipe)."""
    if (recorded := recipe.record(lambda: _built(config, source))) is not None:
        return recorded
    return _on_meta_or_real(sendable and rank != 0, lambda: _built(config, source)), None


def _recorded_and_analyzed(config: Config, source: models.Source, plugins: Plugins, rank: int, sendable: bool):
    """:func:`_built_and_analyzed` for a rank that materializes only its shard, and the recipe (:func:`_recorded`);
    a build the recording refuses is built once, as :func:`_recorded` builds it."""
    if (recorded := recipe.record(lambda: _built(config, source))) is not None:
        try:
            with torch.device("meta"):
                return *_built_and_analyzed(config, source, plugins, recorded[0]), recorded[1]
        except Exception:  # the analysis needs values: rank 0 builds the model for real below
            pass
    return *_on_meta_or_real(sendable and rank != 0, lambda: _built_and_analyzed(config, source, plugins)), None


def _shard_build(config: Config, plugins: Plugins, world_size: int, given: bool) -> tuple[bool, bool]:
    """(whether this run's ranks build only their shards, whether rank 0 may send a build the recording refuses):
    not where the strategy runs the model to apply it (:meth:`~snnfw.plugin.strategy.Strategy.reads_values`),
    whose ranks then all build it whole."""
    shards = builds_shards(config, plugins, world_size, given)
    return shards, shards and not plugins.strategy(config.parallel.strategy).reads_values(config, plugins)


def _on_meta_or_real(on_meta: bool, make: Callable):
    """``make()`` on the meta device with ``on_meta`` (a rank that receives its shard), else, or where making needs
    values (a meta tensor has none), for real."""
    if on_meta:
        try:
            with torch.device("meta"):
                return make()
        except Exception:  # made for real below, which raises the model's own errors as rank 0 does
            pass
    return make()


@attrs.frozen
class Prepared:
    """The outcome of analyze -> plan: what every rank then applies and runs."""

    plan: Plan
    model: torch.nn.Module
    spec: datalib.InputSpec
    analysis: Analysis
    given_instance: bool = False  # a module handed over whole: ranks take rank 0's initial state
    builds_shards: bool = False  # this run's ranks materialize only their shards (snnfw.distributed.materialize)
    recipe: recipe.Recipe | None = None  # the shard-building model's recorded build (None: rank 0's values are sent)
    datasets: tuple | None = None  # (train, test) as built for counting epochs, for the trainer to reuse


def check_data(config: Config, plugins: Plugins, own_data: bool) -> None:
    check_augment(config.data)
    if own_data or config.data.builder is not None:
        datalib.check_own_data(config, given=own_data)
    else:
        plugins.datasets.entry(config.data.name)  # unknown names list the registered ones
        datalib.check_keys(config, plugins.datasets.get(config.data.name))


def follow_family(config: Config, plugins: Plugins) -> tuple[Config, tuple[str, ...]]:
    """A family's flavor's own ``train.loss`` (a language model's ``next_token``) where the config names none, and
    what the plan says of it."""
    if config.model.builder is not None:
        return config, ()
    flavor = plugins.families.get(config.model.family).flavor(config.model.flavor)
    if flavor.loss is None or "train.loss" in config.explicit or flavor.loss == config.train.loss:
        return config, ()
    config = attrs.evolve(config, train=attrs.evolve(config.train, loss=flavor.loss))
    return config, (f"train.loss = {flavor.loss!r}: model family {config.model.family}'s (set train.loss to choose)",)


def follow_data(config: Config, plugins: Plugins) -> tuple[Config, tuple[str, ...]]:
    """A family's classes fitted to a registered data set that declares its own (unless model.num_classes is
    set), and what the plan says of it and of resized frames."""
    if config.data.builder is not None or config.model.builder is not None:
        return config, ()
    dataset = plugins.datasets.get(config.data.name)
    flavor = plugins.families.get(config.model.family).flavor(config.model.flavor)
    notes = []
    if dataset.tokens != (flavor.vocab is not None):
        model = f"model family {config.model.family!r} flavor {config.model.flavor!r}"
        raise ConfigError(f"data set {config.data.name!r} gives token sequences for a language model, and {model} takes "
                          "frames; choose model.family = \"spiking_lm\" or another data set" if dataset.tokens else
                          f"{model} reads token ids, and data set {config.data.name!r} gives frames; choose a text data "
                          "set such as data.name = \"python_bytes\"")
    if dataset.classes and "model.num_classes" not in config.explicit and flavor.with_classes is not None \
            and dataset.classes != flavor.num_classes:
        model = attrs.evolve(config.model, num_classes=dataset.classes)
        config = attrs.evolve(config, model=model)
        notes.append(f"model.num_classes = {dataset.classes}: data set {config.data.name}'s classes (flavor "
                     f"{config.model.flavor} has {flavor.num_classes}; set model.num_classes to choose)")
    if dataset.frame_shape and flavor.vocab is None and tuple(dataset.frame_shape[1:]) != tuple(flavor.input_shape[1:]):
        (height, width), (h, w) = dataset.frame_shape[1:], flavor.input_shape[1:]
        how = "images of data set {} resized (bicubic)" if dataset.images else "frames of data set {} resized by area"
        notes.append(f"{how.format(config.data.name)} from {height}x{width} to the model's {h}x{w}")
    return config, tuple(notes)


def with_epochs(config: Config, train_samples: int) -> Config:
    """``config`` with ``train.steps`` from ``train.epochs`` (that many passes of whole global batches),
    ``train.warmup_steps`` from ``train.warmup_epochs`` and ``eval.every`` from ``eval.every_epochs``."""
    epochs, batch = config.train.epochs, config.data.batch_size
    if epochs is None:
        for key, steps in (("eval.every_epochs", "eval.every"), ("train.warmup_epochs", "train.warmup_steps")):
            if _value(config, key):
                raise ConfigError(f"{key} counts epochs of train.epochs; set train.epochs, or use {steps} (steps)")
        return config
    if "train.steps" in config.explicit:
        raise ConfigError(f"train.steps ({config.train.steps}) and train.epochs ({epochs}) both say how long to train; remove one of them")
    check_one_batch(train_samples, batch)
    for key, steps, what in (("eval.every_epochs", "eval.every", "when to validate"),
                             ("train.warmup_epochs", "train.warmup_steps", "how long to warm up")):
        if _value(config, key) and steps in config.explicit:
            raise ConfigError(f"{steps} and {key} both say {what}; remove one of them")
    per_epoch = train_samples // batch
    train = attrs.evolve(config.train, steps=epochs * per_epoch,
                         warmup_steps=config.train.warmup_epochs * per_epoch or config.train.warmup_steps)
    evaluation = attrs.evolve(config.eval, every=config.eval.every_epochs * per_epoch) if config.eval.every_epochs else config.eval
    return attrs.evolve(config, train=train, eval=evaluation)


def _value(config: Config, key: str):
    section, name = key.split(".")
    return getattr(getattr(config, section), name)


def _counts_epochs(config: Config) -> bool:
    return config.train.epochs is not None or bool(config.eval.every_epochs) or bool(config.train.warmup_epochs)


def _resolved(config: Config, plugins: Plugins, source: models.Source, datasets: tuple | None) -> Config:
    """The config with what the model and data set decide (``train.steps`` from epochs), its [train] keys checked."""
    if _counts_epochs(config):
        train_set = datasets[0] if datasets else build_datasets(config, source.spec, plugins)[0]
        config = with_epochs(config, len(train_set))
        check_log_steps(config.log, config.train.steps)
    elif datasets:  # handed in through the Python API; those built by name are checked as they are built
        check_one_batch(len(datasets[0]), config.data.batch_size)
    check_train(config.train, plugins)
    check_loss(config.train, plugins)
    check_precision(config.train)
    for package, extra in (("tensorboard", "tensorboard"), ("wandb", "tensorboard,wandb")):  # optional extras
        if getattr(config.log, package):
            extras.require(package, f"log.{package}", extra)
    return config


def _here(decide: Callable[[], Decision], device_type: str) -> Decision:
    """``auto`` decided in this process: the launcher's and ``snnfw plan``'s way."""
    return decide()


def prepare(config: Config, world_size: int, plugins: Plugins, local_ranks: int | None = None,
            model=None, datasets: tuple | None = None, agree: Callable = _here, rank: int | None = None) -> Prepared:
    """analyze -> plan for a world of ``world_size`` ranks, ``local_ranks`` on this node; ``rank``: this process's
    rank in a run (None outside one: the launcher, ``snnfw plan``), which under a strategy that shards parameters
    builds the model on the meta device (:mod:`snnfw.distributed.materialize`).

    ``model`` (a module or builder) and ``datasets`` (train, test) are what the Python API was handed.
    ``auto``'s choice depends on a measurement, so it is made once: ``agree(decide, device_type)`` runs
    ``decide`` (the measurement and the choice) where it should and returns its :class:`Decision` (the ranks
    of a job that plan for themselves pass one that takes rank 0's).
    """
    check_data(config, plugins, datasets is not None)
    check_tune_results(config)
    if (profile := config.log.profile) and profile.ranks and profile.ranks[-1] >= world_size:
        raise ConfigError(f"log.profile.ranks names rank {profile.ranks[-1]}, and the run has ranks 0 to "
                          f"{world_size - 1}; name ranks of this run")
    config, data_notes = follow_data(config, plugins) if model is None and datasets is None else (config, ())
    config, family_notes = follow_family(config, plugins) if model is None else (config, ())
    data_notes = family_notes + data_notes
    source = models.source(config, plugins, model)
    built_data = None
    if datasets is None and _counts_epochs(config):
        datasets = built_data = build_datasets(config, source.spec, plugins)
    config = _resolved(config, plugins, source, datasets)
    presets.check_name(asked := config.parallel.strategy, plugins)
    config = presets.resolve(config, world_size)
    topology = Topology.detect(world_size, config.parallel.device, local_ranks, config.parallel.backend)
    shards, sendable = (_shard_build(config, plugins, world_size, isinstance(model, torch.nn.Module))
                        if rank is not None and config.parallel.strategy != AUTO else (False, False))
    if shards:
        config, built, model_notes, analysis, made = _recorded_and_analyzed(config, source, plugins, rank, sendable)
        shards = made is not None or sendable
    else:
        (config, built, model_notes, analysis), made = _built_and_analyzed(config, source, plugins), None
    decision = None
    if config.parallel.strategy == AUTO:
        def decide() -> Decision:
            transform = None if torch.distributed.is_initialized() else run_transforms(config, topology, analysis,
                                                                                          plugins)
            cost = measure(built, source.spec, plugins, config.train, cost_model.rank_threads(world_size), transform,
                           analysis.blocks)
            request = PlanRequest(config=config, topology=topology, analysis=analysis, model=built,
                                  plugins=plugins.context, cost=cost)
            return choose(request, plugins)

        decision = agree(decide, topology.device_type)
        config = decision.applied(config)
    plan = make_plan(config, topology, analysis, plugins, built, decision.rationale if decision else (), asked)
    if world_size > 1 and (why := plugins.strategy(plan.config.parallel.strategy).builds_whole(plan.config, plugins)):
        model_notes += (f"every rank builds the whole model before it takes its shard: {why}",)
    model_notes += _dropout_notes(built, plan)
    allocator = cpu_allocator.resolve(config.parallel.cpu_allocator, topology.device_type)
    notes = precision_notes(config, topology.device_type) + (
        ("cpu_allocator retain: each rank's malloc keeps freed blocks for the next step",) if allocator == "retain" else ())
    plan = attrs.evolve(plan, rationale=topology.rationale + plan.rationale + model_notes + data_notes + notes)
    return Prepared(plan, built, source.spec, analysis, given_instance=isinstance(model, torch.nn.Module),
                    builds_shards=shards, recipe=made, datasets=built_data)


DROPOUT_AS_ONE_PROCESS = {"tp"}  # dimensions whose ranks draw a dropout's masks as one process would (tp's peers share
# the batch and the random stream); the others draw their own samples', stages' or steps' masks from their own streams


def _dropout_notes(model: torch.nn.Module, plan: Plan) -> tuple[str, ...]:
    """The plan's word that dropout makes a run differ from ``none``'s step for step, where it does: a dropout
    layer with p > 0 under a dimension that does not draw its masks as one process would."""
    from spikingjelly.activation_based.layer import Dropout  # one mask for every time step of a sample

    kinds = (torch.nn.modules.dropout._DropoutNd, Dropout)
    dropouts = [name for name, m in model.named_modules() if isinstance(m, kinds) and m.p > 0]
    dims = sorted({name for name, size in plan.mesh if size > 1} - DROPOUT_AS_ONE_PROCESS)
    if not dropouts or not dims:
        return ()
    layers = f"{len(dropouts)} dropout layers ({', '.join(dropouts[:3])}{', ...' if len(dropouts) > 3 else ''})"
    return (f"dropout: {layers if len(dropouts) > 1 else 'dropout layer ' + dropouts[0]} draw their masks on each rank of "
            f"{' x '.join(dims)} from its own random stream, so the run is not none's step for step (equal in "
            "distribution); with their p at 0 it is (the float64 guarantee)",)


def run_transforms(config: Config, topology: Topology, analysis: Analysis, plugins: Plugins) -> Callable:
    """What a rank does to its model before it trains, for the profile to time the model as it runs: the
    plugins' transforms and compilation (memory optimisation, neuron backends, ``[compile]``), as on one rank of
    the device the profile runs on. Only where no process group is up: a transform may call collectives."""

    def transform(model: torch.nn.Module, example: torch.Tensor) -> None:
        plan = Plan(strategy="none", world_size=1, mesh=(("dp", 1),), dp_dims=(), stage_dims=(),
                    replicated_neuron_dims=(), microbatches=1, global_batch=config.data.batch_size,
                    device_type=example.device.type, backend=topology.backend, rationale=(), config=config,
                    analysis=analysis)
        plugins.transform_model(model, plan, example)
        plugins.compile(model, plan)

    return transform


def check_tune_results(config: Config) -> None:
    """Refuses ``parallel.tune_results`` where ``auto`` does not read it, or where it names no file."""
    results = config.parallel.tune_results
    if results is None:
        return
    if config.parallel.strategy != AUTO:
        raise ConfigError(f"parallel.tune_results is read by strategy auto only (its speed ranking), and the config "
                          f"names strategy {config.parallel.strategy!r}; remove it, or set parallel.strategy = \"auto\"")
    if not Path(results).is_file():
        raise ConfigError(f"parallel.tune_results names {results}, which is not a file; run snnfw tune CONFIG "
                          f"--world-size N --results {results} first, or remove the key")


def from_plan(plan: Plan, plugins: Plugins, rank: int) -> Prepared:
    """What rank ``rank`` applies and runs under a plan made before it started (:mod:`snnfw.plan.planfile`): the
    model built from the plan's resolved config as planning built it (on the meta device where the rank
    materializes only its shard); nothing is analysed, measured or proposed again."""
    config = plan.config
    source = models.source(config, plugins)
    shards, sendable = _shard_build(config, plugins, plan.world_size, given=False)
    model, made = _recorded(config, source, rank, sendable) if shards else (_built(config, source), None)
    shards = shards and (made is not None or sendable)
    if config.model.input_layout == "TN":
        models.time_major_input(model)
    return Prepared(plan, model, source.spec, plan.analysis, builds_shards=shards, recipe=made)


def auto_candidates(config: Config, world_size: int, plugins: Plugins, device_memory: float | None = None) -> list:
    """``auto``'s runnable candidates for ``config`` on ``world_size`` ranks, best first; starts no process.
    ``device_memory``: the bytes a rank may use (default: this machine's, shared by its ranks)."""
    return costed_candidates(config, world_size, plugins, device_memory)[0]


def costed_candidates(config: Config, world_size: int, plugins: Plugins, device_memory: float | None = None,
                      threads: int | None = None) -> tuple[list, list, ModelCost]:
    """(runnable candidates best first, refused ones, the model's profile at ``threads`` threads, default a rank's):
    every strategy's under ``auto``, the named strategy's own otherwise; starts no process."""
    check_data(config, plugins, own_data=False)
    check_tune_results(config)
    config, _ = follow_data(config, plugins)
    source = models.source(config, plugins)
    config = _resolved(config, plugins, source, None)
    presets.check_name(config.parallel.strategy, plugins)
    config = presets.resolve(config, world_size)
    config, model, _ = _build(config, source)
    topology = attrs.evolve(Topology.detect(world_size, config.parallel.device, backend=config.parallel.backend),
                            device_memory=device_memory)
    analysis = _analyze(model, config, source, plugins)
    cost = measure(model, source.spec, plugins, config.train, threads or cost_model.rank_threads(world_size),
                   run_transforms(config, topology, analysis, plugins), analysis.blocks)
    request = PlanRequest(config=config, topology=topology, analysis=analysis, model=model, plugins=plugins.context,
                          cost=cost)
    return (*ranked_candidates(request, plugins), cost)


def tune_settings(config: Config, world_size: int, plugins: Plugins) -> dict[str, tuple]:
    """The values of the keys the user did not set that the plugins offer ``snnfw tune`` to try for this model on
    ``world_size`` ranks' device (:func:`~snnfw.plugin.hookspecs.snnfw_tune_settings`), the config's own left out."""
    config, _ = follow_data(config, plugins)
    source = models.source(config, plugins)
    config, _, _, analysis = _built_and_analyzed(config, source, plugins)
    device_type = Topology.detect(world_size, config.parallel.device, backend=config.parallel.backend).device_type
    offered = plugins.tune_settings(config, analysis, device_type)
    kept = {key: tuple(v for v in values if v != _value(config, key)) for key, values in offered.items()
            if key not in config.explicit}
    return {key: values for key, values in kept.items() if values}


def build_datasets(config: Config, spec: datalib.InputSpec, plugins: Plugins) -> tuple:
    """The train and test splits of the configured data set (``data.builder``'s, or a registered one's)."""
    if config.data.builder is not None:
        splits = datalib.own_datasets(models.import_object(config.data.builder, "data.builder"), config.data.builder)
        for split, dataset in zip(("train", "test"), splits):
            datalib.check_samples(dataset, spec, split)
            datalib.check_labels(dataset, spec.num_classes, split)
    else:
        splits = _registered_splits(config.data, spec, config.train.seed, plugins)
    check_one_batch(len(splits[0]), config.data.batch_size)
    return splits


def registered_datasets(name: str, spec: datalib.InputSpec, seed: int = 0, plugins: Plugins | None = None,
                        **data) -> tuple:
    """The train and test splits of the data set registered as ``name``, as ``snnfw train`` builds them from
    ``[data] name = name`` with the other ``[data]`` keys ``data`` (``train_samples=1024``) and ``train.seed``
    ``seed``: data for a training loop of your own."""
    from snnfw.config import DataConfig

    return _registered_splits(DataConfig(name=name, **data), spec, seed, plugins or Plugins())


def _registered_splits(data, spec: datalib.InputSpec, seed: int, plugins: Plugins) -> tuple:
    """The train and test splits of the registered data set ``data.name`` under the ``[data]`` section ``data``."""
    dataset = plugins.datasets.get(data.name)
    return tuple(dataset.build(data, spec, split, seed) for split in ("train", "test"))


def check_one_batch(train_samples: int, batch: int) -> None:
    """Refuses a training set smaller than one global batch, whose steps would repeat samples."""
    if train_samples < batch:
        raise ConfigError(f"the training set has {train_samples} samples, fewer than one global batch ({batch}), so "
                          "each step would repeat samples; lower data.batch_size")
