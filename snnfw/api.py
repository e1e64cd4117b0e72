"""snnfw's public API: every name a plugin, a user's model file, a user's own training loop or a plugin's tests may
use. Everything else in snnfw (and all of ``snnfw_plugins``) is internal and may change in any release.

Import from here (``from snnfw.api import Strategy, hookimpl``); a name is imported from its module when first
used, so importing this module costs no torch import. The names, their signatures and the hook specifications'
arguments are recorded in ``tests/unit/api_snapshot.json``: a change to them is a new version of snnfw, with an
entry in ``CHANGELOG.md``; a name is removed only after a release that deprecates it.
"""

from __future__ import annotations

import importlib
from typing import Any

from snnfw import __version__, hookimpl

_WHERE = {  # name: the module that defines it
    # the parallelism a strategy plugin registers (snnfw_register_strategies), and how its mesh dimension composes
    "Strategy": "snnfw.plugin.strategy",
    "REPLICATED": "snnfw.plugin.strategy", "SHARDED": "snnfw.plugin.strategy", "SPLIT": "snnfw.plugin.strategy",
    "IN_PLACE": "snnfw.plugin.strategy", "STAGES": "snnfw.plugin.strategy", "DATA": "snnfw.plugin.strategy",
    # model families and what a model declares
    "ModelFamily": "snnfw.model.families", "Flavor": "snnfw.model.families",
    "AnalysisPart": "snnfw.model.analysis", "Analysis": "snnfw.model.analysis",
    "TimeMajor": "snnfw.model.modules",
    # data sets, schedules, optimizers, learning-rate schedules and losses: what the registration hooks register
    "InputSpec": "snnfw.data.batches", "DatasetSpec": "snnfw.data.batches",
    "ScheduleSpec": "snnfw.distributed.pipeline",
    "OptimizerSpec": "snnfw.components.optim", "LrScheduleSpec": "snnfw.components.optim",
    "LossSpec": "snnfw.components.losses",
    # planning: what snnfw_plan receives and answers, and the plan every later hook receives
    "Topology": "snnfw.plan.layout", "PlanRequest": "snnfw.plan.layout", "Proposal": "snnfw.plan.layout",
    "refuse_others": "snnfw.plan.layout", "Plan": "snnfw.plan.layout", "estimate": "snnfw.plan.estimate",
    # running: a strategy's optimizer, the mark of a sharded neuron, a step's result, the state checkpoints hold
    "parameter_groups": "snnfw.components.optim", "optimizer_options": "snnfw.components.optim",
    "NEURON_SHARD": "snnfw.components.metrics", "StepOutput": "snnfw.components.step",
    "state_name": "snnfw.distributed.state", "held_state": "snnfw.distributed.state",
    "load_held_state": "snnfw.distributed.state", "merge_optimizer_states": "snnfw.distributed.state",
    # the config
    "Config": "snnfw.config", "build_config": "snnfw.config", "load_config": "snnfw.config",
    # a training loop of the user's own
    "start": "snnfw.run.session", "Session": "snnfw.run.session",
    # the errors to raise for what a user can fix (each is one line saying what is wrong and how to fix it)
    "UserError": "snnfw.errors", "ConfigError": "snnfw.errors", "UnknownNameError": "snnfw.errors",
    "PlanError": "snnfw.errors", "PluginError": "snnfw.errors", "DataError": "snnfw.errors",
    "CheckpointError": "snnfw.errors", "DivergedError": "snnfw.errors",
    # a plugin's tests
    "tiny_config": "snnfw.testing", "run_on_ranks": "snnfw.testing", "RankFailure": "snnfw.testing",
    "full_parameters": "snnfw.testing", "run_training": "snnfw.run.loop",
    "check_family": "snnfw.testing.family_check", "FamilyReport": "snnfw.testing.family_check",
}

__all__ = sorted(["__version__", "hookimpl", *_WHERE])


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'snnfw.api' has no attribute {name!r}; its names are snnfw.api.__all__")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
