"""analyze -> plan: the model, its analysis and the plan, decided before any process starts.

``snnfw plan`` stops here; every rank of a run repeats it (the same config and
seed give the same model and plan) and then applies and runs it
(:mod:`snnfw.runtime`).
"""

from __future__ import annotations

import attrs
import torch

from snnfw import data as datalib
from snnfw.analysis import Analysis, analyze
from snnfw.auto import measure, ranked_candidates
from snnfw.config import Config
from snnfw.optim import check_train
from snnfw.plan import AUTO, Plan, PlanRequest, Topology, make_plan
from snnfw.plugins import Plugins


def build_model(config: Config, plugins: Plugins):
    """Builds the configured flavor with the run's seed; returns (model, input spec)."""
    family = plugins.families.get(config.model.family)
    flavor = family.flavor(config.model.flavor)
    torch.manual_seed(config.train.seed)
    spec = datalib.InputSpec(config.model.time_steps, flavor.input_shape, flavor.num_classes)
    return flavor.build(), spec


@attrs.frozen
class Prepared:
    """The outcome of analyze -> plan: what every rank then applies and runs."""

    plan: Plan
    model: torch.nn.Module
    spec: datalib.InputSpec
    analysis: Analysis


def prepare(config: Config, world_size: int, plugins: Plugins, local_ranks: int | None = None) -> Prepared:
    """analyze -> plan for a world of ``world_size`` ranks, ``local_ranks`` on this node; starts no process."""
    plugins.datasets.entry(config.data.name)  # unknown names list the registered ones
    datalib.check_keys(config, plugins.datasets.get(config.data.name))
    check_train(config.train, plugins)
    topology = Topology.detect(world_size, config.parallel.device, local_ranks)
    model, spec = build_model(config, plugins)
    analysis = analyze(model, config.model.family, plugins)
    cost = measure(model, spec, plugins) if config.parallel.strategy == AUTO else None
    plan = make_plan(config, topology, analysis, plugins, model, cost)
    plan = attrs.evolve(plan, rationale=topology.rationale + plan.rationale)
    return Prepared(plan, model, spec, analysis)


def auto_candidates(config: Config, world_size: int, plugins: Plugins) -> list:
    """``auto``'s runnable candidates for ``config`` on ``world_size`` ranks, best first; starts no process."""
    plugins.datasets.entry(config.data.name)
    check_train(config.train, plugins)
    datalib.check_keys(config, plugins.datasets.get(config.data.name))
    model, spec = build_model(config, plugins)
    request = PlanRequest(
        config=config, topology=Topology.detect(world_size, config.parallel.device),
        analysis=analyze(model, config.model.family, plugins), model=model, plugins=plugins,
        cost=measure(model, spec, plugins),
    )
    return ranked_candidates(request, plugins)[0]


def build_datasets(config: Config, spec: datalib.InputSpec, plugins: Plugins) -> tuple:
    """The train and test splits of the configured data set."""
    dataset = plugins.datasets.get(config.data.name)
    return tuple(dataset.build(config.data, spec, split, config.train.seed) for split in ("train", "test"))
