"""analyze: what in a model carries state and what can be sharded."""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    from torch import nn


def is_neuron(module: nn.Module) -> bool:
    from spikingjelly.activation_based.neuron import BaseNode

    return isinstance(module, BaseNode)


@attrs.frozen
class AnalysisPart:
    """A plugin's contribution to the analysis of a model.

    ``blocks``: modules that FSDP2 shards as units. ``stage_units``: modules,
    in forward order, that may start a pipeline stage. ``tp_plan``: pairs of
    (module name, tensor-parallel style name) that the ``tp`` strategy applies.
    """

    blocks: tuple[str, ...] = ()
    stage_units: tuple[str, ...] = ()
    tp_plan: tuple[tuple[str, str], ...] = ()


@attrs.frozen
class Analysis:
    family: str
    parameters: int
    neurons: tuple[str, ...]
    tp_candidates: tuple[str, ...]
    blocks: tuple[str, ...] = ()
    stage_units: tuple[str, ...] = ()
    tp_plan: tuple[tuple[str, str], ...] = ()


def analyze(model: nn.Module, family: str, plugins) -> Analysis:
    """Finds stateful neurons and shardable layers, then merges the plugins' parts."""
    from torch import nn

    neurons, candidates = [], []
    for name, module in model.named_modules():
        if is_neuron(module):
            neurons.append(name)
        elif isinstance(module, (nn.Linear, nn.Conv2d)):
            candidates.append(name)
    blocks, units, tp_plan = [], [], []
    for part in plugins.analyze_parts(model, family):
        blocks.extend(part.blocks)
        units.extend(part.stage_units)
        tp_plan.extend(part.tp_plan)
    return Analysis(
        family=family,
        parameters=sum(p.numel() for p in model.parameters()),
        neurons=tuple(neurons),
        tp_candidates=tuple(candidates),
        blocks=tuple(blocks),
        stage_units=tuple(units),
        tp_plan=tuple(tp_plan),
    )


WRAPPED = "_checkpoint_wrapped_module"  # where torch's checkpoint wrapper keeps the module it wraps


def submodule(model: nn.Module, name: str) -> nn.Module:
    """The module the analysis named ``name``, found through checkpoint wrappers on the way.

    A wrapper put around a named module is returned in its place, so hooks
    and sharding applied to it act on every call.
    """
    module = model
    for part in name.split(".") if name else ():
        while part not in module._modules and WRAPPED in module._modules:
            module = module._modules[WRAPPED]
        if part not in module._modules:
            raise AttributeError(f"{type(model).__name__} has no submodule {name!r} (missing {part!r})")
        module = module._modules[part]
    return module
