"""Hook specifications: the contract between the snnfw core and its plugins.

Hooks are called with keyword arguments only. A ``firstresult`` hook stops at
the first implementation that returns something other than None, so a plugin
declines by returning None. Built-in plugins load first and third-party ones
after them; pluggy calls the last registered first, so an installed package
overrides a built-in by answering the same hook.
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("snnfw")


# Registration: each hook receives ``register(name, value, description="")``.


@hookspec
def snnfw_register_strategies(register):
    """Register parallelism strategies by name (``register("dp", None, "DDP ...")``).

    The behaviour of a strategy lives in the plugin's :func:`snnfw_plan` and
    :func:`snnfw_parallelize` implementations, which answer for its name.
    """


@hookspec
def snnfw_register_model_families(register):
    """Register model families: ``register(name, snnfw.families.ModelFamily(...))``."""


@hookspec
def snnfw_register_datasets(register):
    """Register data sets: ``register(name, snnfw.data.DatasetSpec(...))``."""


@hookspec
def snnfw_register_schedules(register):
    """Register pipeline schedules by name; the behaviour lives in :func:`snnfw_schedule`."""


# The flow: analyze -> plan -> apply (parallelize, optimizer) -> run.


@hookspec
def snnfw_analyze(model, family):
    """Contribute to the analysis of ``model``, built by the family named ``family``.

    Return an :class:`snnfw.analysis.AnalysisPart` (the blocks to shard, the
    units that may start a pipeline stage) or None. Parts of all plugins are
    merged; the core itself finds the neurons and tensor-parallel candidates.
    """


@hookspec
def snnfw_plan(request):
    """Propose how to run ``request`` (:class:`snnfw.plan.PlanRequest`).

    Return an :class:`snnfw.plan.Proposal` for each strategy this plugin owns
    (a refusal with its reason if it cannot run), or None. The core picks the
    proposal of ``request.strategy`` and validates it against the world.
    """


@hookspec(firstresult=True)
def snnfw_parallelize(model, plan, mesh, hooks):
    """Apply ``plan`` to ``model`` on ``mesh`` (a DeviceMesh, or None on one rank).

    ``hooks`` is the :class:`snnfw.plugins.Plugins` facade, for calling other
    hooks (``hooks.shard_neuron(...)``). Return the model to train (wrapped or
    changed in place), or None to decline a plan whose strategy is not this
    plugin's. Stops at the first non-None result.
    """


@hookspec(firstresult=True)
def snnfw_build_optimizer(model, plan, mesh):
    """Return the optimizer for the parallelized ``model`` on ``mesh``, or None to decline.

    Stops at the first non-None result; a plain optimizer is the fallback.
    """


@hookspec(firstresult=True)
def snnfw_forward_backward(model, batches, plan, hooks):
    """Run forward and backward over this rank's microbatches of one optimizer step.

    ``batches`` is a list of ``(frames, labels)`` microbatches. Accumulate
    gradients as the mean over them (the optimizer step follows) and return a
    :class:`snnfw.step.StepOutput`, or None to decline. Stops at the first
    non-None result; the default runs them one after another with a neuron
    reset before each, synchronising gradients on the last.
    """


@hookspec(firstresult=True)
def snnfw_evaluate(model, frames, labels, plan, hooks):
    """Score one evaluation batch without gradients; return a :class:`snnfw.step.StepOutput`.

    Stops at the first non-None result; return None to decline.
    """


@hookspec
def snnfw_step_metrics(plan):
    """Return a dict of extra per-step metrics (numbers) since the last call, or None.

    Called on every rank after each optimizer step; the values are summed
    over ranks, divided by the world size, and added to ``metrics.jsonl``.
    """


@hookspec(firstresult=True)
def snnfw_reset_state(model):
    """Reset all neuron state of ``model`` before an independent microbatch.

    Return True when done, or None to decline. Stops at the first non-None result.
    """


@hookspec(firstresult=True)
def snnfw_shard_neuron(module, placement, mesh):
    """Make neuron ``module`` keep only the shard of its state that ``placement`` gives.

    Return the module to use, or None to decline (for a neuron type the plugin
    does not know). Stops at the first non-None result.
    """


@hookspec(firstresult=True)
def snnfw_split_stages(model, plan, example):
    """Split ``model`` into pipeline stages for ``plan``; ``example`` is one microbatch.

    Return the list of stage modules in order, or None to decline. Stops at
    the first non-None result; family plugins answer before the generic splitter.
    """


@hookspec(firstresult=True)
def snnfw_schedule(stages, plan, loss_fn):
    """Build the pipeline schedule named by ``plan`` for this rank's ``stages``.

    Return a schedule object with ``step(*args, target=..., losses=...)``, or
    None when the schedule is not this plugin's. Stops at the first non-None result.
    """
