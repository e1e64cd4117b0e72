"""A model too large to measure on this host, measured through copies of it with one and two of its repeated blocks.

``auto`` times one training step of the model (:func:`snnfw.plan.estimate.measure_cost`), which needs about four
copies of its parameters in host memory. A model of a run of identical blocks (a transformer's layers: the
analysis's ``blocks`` named ``prefix.0`` ... ``prefix.N-1``) is measured instead on two proxies that keep the rest
of the model and 1 and 2 of those blocks. What a block adds is their difference: saved-for-backward and neuron
state bytes, and the training FLOPs a sample (counted, so exact), extrapolate to N blocks linearly; the step's time
scales with the FLOPs from the two-block proxy's, the optimizer's with the parameters.
"""

from __future__ import annotations

import copy
import re
from typing import Callable

import attrs
import torch

from snnfw.components.flops import training_flops_per_sample
from snnfw.plan.estimate import ModelCost


@attrs.frozen
class BlockRun:
    """``count`` identical blocks, the children of the container at ``container`` (``layers``)."""

    container: str
    count: int

    def describe(self) -> str:
        return f"1 and 2 of its {self.count} blocks {self.container}.*"


def repeated_blocks(model: torch.nn.Module, blocks: tuple[str, ...]) -> BlockRun | None:
    """The longest run of ``blocks`` that are all the children of one ``nn.ModuleList`` or ``nn.Sequential``, of one
    class and equal parameter shapes; None where there is none of at least 3."""
    runs: dict[str, list[int]] = {}
    for name in blocks:
        if match := re.fullmatch(r"(.+)\.(\d+)", name):
            runs.setdefault(match[1], []).append(int(match[2]))
    best = None
    for container, indices in runs.items():
        parent = model.get_submodule(container)
        if not isinstance(parent, (torch.nn.ModuleList, torch.nn.Sequential)) or indices != list(range(len(parent))):
            continue
        shapes = {(type(child), tuple(p.shape for p in child.parameters())) for child in parent}
        if len(parent) >= 3 and len(shapes) == 1 and (best is None or len(parent) > best.count):
            best = BlockRun(container, len(parent))
    return best


def proxy(model: torch.nn.Module, run: BlockRun, keep: int) -> torch.nn.Module:
    """A copy of ``model`` with only the first ``keep`` blocks of ``run`` (the others are never copied)."""
    owner_name, _, attribute = run.container.rpartition(".")
    owner = model.get_submodule(owner_name)
    container = getattr(owner, attribute)
    kept = list(container)[:keep]
    setattr(owner, attribute, torch.nn.ModuleList(kept) if isinstance(container, torch.nn.ModuleList)
            else torch.nn.Sequential(*kept))
    try:
        return copy.deepcopy(model)
    finally:
        setattr(owner, attribute, container)


def extrapolated(model: torch.nn.Module, run: BlockRun, measure: Callable[[torch.nn.Module], ModelCost],
                 time_steps: int, frame: tuple[int, ...], reset) -> ModelCost:
    """``model``'s cost from ``measure`` of its one- and two-block proxies."""
    proxies = [proxy(model, run, keep) for keep in (1, 2)]
    one, two = (measure(p) for p in proxies)
    flops_one, flops_two = (training_flops_per_sample(p, time_steps, frame, reset) for p in proxies)
    blocks_after_one = run.count - 1

    def linear(field: str) -> float:
        first, second = getattr(one, field), getattr(two, field)
        return first + blocks_after_one * max(second - first, 0.0)

    flops = flops_one + blocks_after_one * (flops_two - flops_one) if flops_one and flops_two else None
    scale = flops / flops_two if flops else run.count / 2  # the step's time grows with the FLOPs a sample
    parameters = sum(p.numel() for p in model.parameters())
    return attrs.evolve(two, parameters=parameters, activation_bytes=linear("activation_bytes"),
                        neuron_state_bytes=linear("neuron_state_bytes"), step_ms=two.step_ms * scale,
                        fixed_ms=max(linear("fixed_ms"), two.fixed_ms),
                        optimizer_ms=two.optimizer_ms * parameters / max(two.parameters, 1))
