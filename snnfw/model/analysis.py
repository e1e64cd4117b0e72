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
    own: bool = False  # a model of the user's own (model.builder or the Python API), described by [model] keys
    inferred: tuple[str, ...] = ()  # which of blocks, stage_units and tp_plan snnfw inferred for it

    def missing(self, key: str, example: str) -> str:
        """Says that the model lacks ``key`` (blocks, stage_units, tp_plan), and where to declare it."""
        if self.own:
            return f"model {self.family!r} has no {key} (none inferred); declare them as model.{key} = {example}"
        return f"model family {self.family!r} declares no {key}"


def analyze(model: nn.Module, family: str, plugins, own: tuple[AnalysisPart, tuple[str, ...]] | None = None) -> Analysis:
    """Finds stateful neurons and shardable layers, then merges the plugins' parts
    and, for a model of the user's own, ``own``: the config's part and what of it was inferred."""
    from torch import nn

    neurons, candidates = [], []
    for name, module in model.named_modules():
        if is_neuron(module):
            neurons.append(name)
        elif isinstance(module, (nn.Linear, nn.Conv2d)):
            candidates.append(name)
    blocks, units, tp_plan = [], [], []
    parts = plugins.analyze_parts(model, family) + ([own[0]] if own else [])
    for part in parts:
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
        own=own is not None,
        inferred=own[1] if own else (),
    )


GLUE = {"flatten": "torch.flatten(x, 2) before NAME ([T, N, C, H, W] -> [T, N, C*H*W]), as a forward does between "
                    "pooling and a Linear"}  # what a stage unit "GLUE:NAME" runs before NAME


def unit_glue(unit: str) -> tuple[str | None, str]:
    """A stage unit ``"flatten:fc"`` -> (``"flatten"``, ``"fc"``): the glue its input passes first (``GLUE``), and the
    module's name; ``"fc"`` -> (None, ``"fc"``)."""
    glue, sep, name = unit.rpartition(":")
    return (glue, name) if sep else (None, unit)


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
