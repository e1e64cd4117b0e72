"""snnfw's public API: every name a plugin, a user's model file, a user's own training loop or a plugin's tests may
use. Everything else in snnfw (and all of ``snnfw_plugins``) is internal and may change in any release.

Import from here (``from snnfw.api import Strategy, hookimpl``); a name is imported from its module when first
used, so importing this module costs no torch import. The names, their signatures and the hook specifications'
arguments are recorded in ``tests/unit/api_snapshot.json``: a change to them is a new version of snnfw, with an
entry in ``CHANGELOG.md``; a name is removed only after a release that deprecates it: a deprecated name
(:data:`DEPRECATED`) still works, outside ``__all__``, and warns on each use what replaces it and the release that
removes it (:data:`REMOVED_IN`).
"""

from __future__ import annotations

import importlib
import warnings
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
    "TokenMeta": "snnfw.data.text", "ByteTokenizer": "snnfw.data.text",
    "registered_datasets": "snnfw.plan.prepare",
    "ScheduleSpec": "snnfw.distributed.pipeline",
    "OptimizerSpec": "snnfw.components.optim", "LrScheduleSpec": "snnfw.components.optim",
    "LossSpec": "snnfw.components.losses",
    # planning: what snnfw_plan receives and answers, and the plan every later hook receives
    "Topology": "snnfw.plan.layout", "PlanRequest": "snnfw.plan.layout", "Proposal": "snnfw.plan.layout",
    "refuse_others": "snnfw.plan.compose", "refuse_meshes": "snnfw.plan.compose", "Plan": "snnfw.plan.layout", "estimate": "snnfw.plan.estimate",
    # running: a strategy's optimizer, the mark of a sharded neuron, a step's result, the state checkpoints hold
    "parameter_groups": "snnfw.components.optim", "optimizer_options": "snnfw.components.optim",
    "NEURON_SHARD": "snnfw.components.metrics", "StepOutput": "snnfw.components.step",
    # what a hook receives as ``hooks``, and the protocols of what a plugin marks on a module or offers on a data set
    "HookContext": "snnfw.plugin.context", "ShardedNeuron": "snnfw.plugin.context",
    "SlicedParameters": "snnfw.plugin.context", "TimeSliced": "snnfw.plugin.context",
    "EventAugmented": "snnfw.plugin.context", "RunState": "snnfw.components.step",
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
    # a strategy's toolkit (what snnfw's own strategies use): composing its mesh dimension with the others
    "COMPOSED": "snnfw.plan.layout", "GLOO_CUDA_POINT_TO_POINT": "snnfw.plan.layout",
    "ROOT_HOOKS": "snnfw.plugin.strategy", "hook_root": "snnfw.plugin.strategy",
    # ... its cost terms
    "ring_bytes": "snnfw.plan.estimate", "ddp_buckets": "snnfw.plan.estimate",
    # ... its collectives and process groups (each with the run's timeout)
    "all_reduce": "snnfw.distributed.collectives", "is_main": "snnfw.distributed.collectives",
    "set_timeouts": "snnfw.distributed.collectives", "MAX_TIMEOUT_S": "snnfw.config",
    "replicate": "snnfw.distributed.groups", "rows_group": "snnfw.distributed.groups",
    "Chunked": "snnfw.distributed.chunks", "pieces": "snnfw.distributed.chunks",
    # ... its pipeline stages
    "balanced_layout": "snnfw.distributed.pipeline", "parse_layout": "snnfw.distributed.pipeline",
    # ... its step: precision, the loss and accuracy of a step's logits, waiting for the device's queued work
    "autocast": "snnfw.components.precision", "scored": "snnfw.components.step", "hits": "snnfw.components.step",
    "finish_queued_work": "snnfw.components.phases", "build_optimizer": "snnfw.components.optim",
    "trainable": "snnfw.components.optim",
    # ... and what it reads of the model
    "is_neuron": "snnfw.model.analysis", "submodule": "snnfw.model.analysis", "infer_tp_plan": "snnfw.model.source",
    # the built-in losses (a loss plugin may wrap them), frames of a data set, and a data set's encoding
    "training_loss": "snnfw.components.losses", "cross_entropy": "snnfw.components.losses",
    "mse_rate": "snnfw.components.losses", "tet": "snnfw.components.losses", "next_token": "snnfw.components.losses",
    "Frames": "snnfw.config", "DirectEncoded": "snnfw.data.images",
    # writing files whole (a reader skips names starting with TEMP_PREFIX) and one-line error messages
    "TEMP_PREFIX": "snnfw.rundir", "keys_phrase": "snnfw.errors", "said": "snnfw.errors",
}

REMOVED_IN = "0.4.0"  # the release that removes the DEPRECATED names
DEPRECATED = {  # name: (the module that defines it, what to use instead); each use warns (a DeprecationWarning)
    # the composition's internals, published by 0.2.0: the core now composes the mesh (strategy mesh) itself and
    # hands each dimension what it needs (Strategy.propose_dimension, Strategy.apply_dimension)
    "propose_mesh": ("snnfw.plan.compose", "the core proposes a composed mesh (strategy mesh); a dimension answers "
                                           "Strategy.propose_dimension"),
    "apply_mesh": ("snnfw.plan.compose", "the core applies a composed mesh (strategy mesh); a dimension answers "
                                         "Strategy.apply_dimension"),
    "candidate_meshes": ("snnfw.plan.compose", "strategy auto weighs the candidate meshes (strategy mesh proposes them)"),
    "owners": ("snnfw.plan.compose", "each registered strategy's Strategy.dimension (hooks.strategies, hooks.strategy)"),
    "replicas": ("snnfw.plan.compose", "Proposal.replicas"),
    "fsdp_mesh": ("snnfw.plan.compose", "the mesh argument of a SHARDED dimension's Strategy.apply_dimension"),
    "stage_averaged_dims": ("snnfw.plan.compose", "the group argument of a STAGES dimension's Strategy.apply_dimension"),
}

__all__ = sorted(["__version__", "hookimpl", *_WHERE])


def __getattr__(name: str) -> Any:
    if name in DEPRECATED:  # not kept in the module's globals, so that every use warns
        module, instead = DEPRECATED[name]
        warnings.warn(f"snnfw.api.{name} is deprecated and removed in snnfw {REMOVED_IN}; use {instead}",
                      DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(module), name)
    if name not in _WHERE:
        raise AttributeError(f"module 'snnfw.api' has no attribute {name!r}; its names are snnfw.api.__all__")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
