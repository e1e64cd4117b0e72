"""``tp``: the tensor-parallel mesh dimension (strategies ``tp`` and ``fsdp2_tp``), neuron state sharded with its
activations.

The model's ``tp_plan`` names a style (see ``tp_styles``) per module or run of
layers; every rank of the group sees the same batch. Every sharded neuron,
whatever its ``snnfw_shard_neuron`` rule, checks that it receives its local
channels, so a shard that went wrong fails by name instead of silently
re-creating full-size state.
"""

import difflib

from snnfw import hookimpl
from snnfw.api import SPLIT, Proposal, Strategy

NAME = "tp"


def check_tp_plan(request, size: int) -> str | None:
    """Why the model's tp_plan cannot run with ``size`` shards, or None."""
    from snnfw.api import state_name
    from snnfw_plugins.strategies.tp_styles import STYLES, Indivisible, unit

    plan, analysis = request.analysis.tp_plan, request.analysis
    where = "model.tp_plan" if analysis.own else "the family's snnfw_analyze"
    if not plan:
        if not analysis.own:
            return f"{analysis.missing('tp_plan', '')}; use strategy dp or fsdp2"
        if "tp_plan" in analysis.inferred:
            return (f"model {analysis.family!r} has nothing tp can shard: no container, nor run of an nn.Sequential's "
                    "layers, is Conv, BatchNorm, neuron (conv_bn_neuron) or Linear, neuron, optional dropout, "
                    "Linear (linear_mlp), nor a zoo ResNet's residual block (residual_conv_pair); use strategy dp or "
                    "fsdp2, or declare model.tp_plan")
        found = _inferred_inside(request.model, "") if request.model is not None else ""
        return "model.tp_plan is empty; " + (f"name units in it ({found}), or use strategy dp or fsdp2" if found else
                                             "use strategy dp or fsdp2")
    for name, style in plan:
        if style not in STYLES:
            return f"{name} names the unknown tp style {style!r}; styles: {', '.join(sorted(STYLES))}"
        if request.model is None:
            continue
        try:
            module = unit(request.model, name)
        except AttributeError:
            names = [state_name(n) for n, _ in request.model.named_modules() if n]
            nearest = ", ".join(difflib.get_close_matches(name, names, n=3, cutoff=0))
            return (
                f"the tp_plan of {analysis.family!r} names module {name!r}, which the model "
                f"does not have (nearest: {nearest}); correct the name in {where}"
            )
        if reason := STYLES[style].check(module, size):
            if isinstance(reason, Indivisible):
                return f"{name} ({style}): {reason}; choose a tp size that divides it"
            inside = _inferred_inside(module, name) if analysis.own else ""
            return f"{name} ({style}): {reason}; " + (f"name the units inside it in {where}: {inside}" if inside else
                                                      f"name a unit that fits the style in {where}")
    return None


def _inferred_inside(module, name: str) -> str:
    """The units snnfw infers inside ``module`` (named ``name``), as model.tp_plan entries; "" for none."""
    from torch import nn

    from snnfw.api import infer_tp_plan

    found = infer_tp_plan(module) if isinstance(module, nn.Module) else ()
    return ", ".join(f'"{name}{"." if name else ""}{inner}" = "{style}"' for inner, style in found)


def apply_tensor_parallel(model, plan, tp_mesh, hooks) -> None:
    """Shards every module of the family's tp_plan over ``tp_mesh`` (1-D), in place."""
    from snnfw_plugins.strategies.tp_comm import COUNTER
    from snnfw_plugins.strategies.tp_styles import STYLES, Shard, unit

    COUNTER.take()  # the process's counter (the autograd functions know only their group): from this run's start
    names = {id(m): name for name, m in model.named_modules()}
    shard = Shard(tp_mesh, tp_mesh.get_group(), tp_mesh.get_local_rank(), tp_mesh.size(), hooks, names,
                  plan.config.parallel.pack_spikes)
    for name, style in plan.analysis.tp_plan:
        STYLES[style].apply(unit(model, name), shard)


class TensorParallel(Strategy):
    """The family's tp_plan applied over the ``tp`` mesh; every rank sees the whole batch."""

    dimension, parameters, neurons_alike, shards_parameters = "tp", SPLIT, True, True

    def propose_dimension(self, request, layout):
        size = dict(layout.mesh)[self.dimension]
        if reason := check_tp_plan(request, size):
            return Proposal.refuse(NAME, reason)
        return Proposal(NAME, rationale=(f"tp = {size}: the tp_plan's layers and their neurons' state sharded, tp peers "
                                         "share a batch",))

    def apply_dimension(self, model, plan, mesh, hooks, wrap=None):
        apply_tensor_parallel(model, plan, mesh["tp"], hooks)
        return model


@hookimpl
def snnfw_register_strategies(register):
    register(NAME, TensorParallel(), "the tp dimension: channels, heads and neuron state sharded over its ranks")


@hookimpl(trylast=True)
def snnfw_shard_neuron(module, placement, mesh):
    """SpikingJelly's multi-step neurons keep state shaped like their input, so a shard needs no rule of its own."""
    return module


@hookimpl
def snnfw_state_dict(model, optimizer, plan):
    """The slices of a ``tp`` dimension as pieces of the whole tensors (``tp_state``)."""
    if NAME not in dict(plan.mesh):
        return None
    from snnfw_plugins.strategies.tp_state import sliced_state

    return sliced_state(model, optimizer)


@hookimpl
def snnfw_load_state_dict(model, optimizer, plan, state):
    if NAME not in dict(plan.mesh):
        return None
    from snnfw_plugins.strategies.tp_state import load_sliced_state

    return load_sliced_state(model, optimizer, state) or None


@hookimpl
def snnfw_step_metrics(plan):
    if NAME not in dict(plan.mesh):
        return None
    from snnfw_plugins.strategies.tp_comm import COUNTER

    return COUNTER.take()
