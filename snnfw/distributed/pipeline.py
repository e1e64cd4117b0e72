"""Pipeline parallelism's shared parts: schedule specs, stage placement, layouts, glue.

A model family splits its model into pipeline units (``snnfw_split_stages``)
whose composition is the model's forward; a stage runs a consecutive range of
units. A schedule plugin registers a :class:`ScheduleSpec` under its name:
one that names a ``torch.distributed.pipelining`` class is built by the
``pp`` plugin; another is built by its own ``snnfw_schedule``.
"""

from __future__ import annotations

from typing import Callable, Sequence

import attrs
from attrs import validators as v

PLACEMENTS = ("single", "looped", "v")


@attrs.frozen
class ScheduleSpec:
    """Where a schedule puts its stages and what it needs, checked before any process starts.

    ``placement``: ``single`` (pp rank r holds stage r), ``looped`` (r, r + P,
    r + 2P, ...; at least ``min_virtual`` stages per rank) or ``v`` (r and
    2P - 1 - r). ``torch_schedule`` names the ``torch.distributed.pipelining``
    class that runs it, or is None when the plugin's ``snnfw_schedule`` builds
    it. ``check_microbatches(microbatches, pp)`` says why a count cannot run,
    or returns None. For ``auto``'s estimates: ``bubble_scale`` is the share of
    the fill-and-drain bubble the schedule leaves idle (1 for GPipe and 1F1B,
    less where weight gradients fill it), and ``holds_all_microbatches`` is
    True when every microbatch's activations are alive at once (breadth first).
    """

    placement: str = attrs.field(validator=v.in_(PLACEMENTS))
    torch_schedule: str | None = None
    min_virtual: int = 1
    check_microbatches: Callable[[int, int], str | None] | None = None
    bubble_scale: float = 1.0
    holds_all_microbatches: bool = False

    def bubble(self, pp: int, virtual: int, microbatches: int) -> float:
        """The idle share of a step: (P - 1) / (V M + P - 1), scaled by ``bubble_scale``."""
        return self.bubble_scale * (pp - 1) / (virtual * microbatches + pp - 1)

    def microbatches_in_flight(self, pp: int, microbatches: int) -> int:
        """How many microbatches' activations a stage holds at its peak."""
        return microbatches if self.holds_all_microbatches else min(microbatches, pp)

    def virtual_refusal(self, name: str, virtual: int) -> str | None:
        """Why schedule ``name`` cannot run ``virtual`` stages per rank, or None."""
        if self.placement == "single" and virtual != 1:
            return f"schedule {name} runs one stage per rank; set pipeline.virtual_stages = 1 or choose a looped schedule"
        if self.placement == "v" and virtual != 2:
            return f"schedule {name} runs two stages per rank in a V; set pipeline.virtual_stages = 2, not {virtual}"
        if virtual < self.min_virtual:
            return (
                f"schedule {name} runs {self.min_virtual} or more stages per rank; "
                f"set pipeline.virtual_stages = {self.min_virtual}, not {virtual}"
            )
        return None

    def stage_indices(self, pp_rank: int, pp: int, virtual: int) -> tuple[int, ...]:
        """The global indices of the stages pp rank ``pp_rank`` holds, in forward order."""
        if self.placement == "v":
            return (pp_rank, 2 * pp - 1 - pp_rank)
        return tuple(pp_rank + k * pp for k in range(virtual))


def parse_layout(text: str) -> tuple[int, ...]:
    """``"1|2|2|1"`` -> ``(1, 2, 2, 1)``: units per stage."""
    return tuple(int(part) for part in text.split("|"))


def balanced_layout(costs: Sequence[float], stages: int) -> tuple[int, ...]:
    """Units per stage for consecutive, non-empty stages that minimise the costliest stage.

    Ties go to the layout whose later stages are lighter (the last stage also
    computes the loss).
    """
    n = len(costs)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot split {n} units into {stages} non-empty stages")
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for i in range(s, n + 1):
            for j in range(s - 1, i):
                slowest = max(best[s - 1][j], prefix[i] - prefix[j])
                if slowest <= best[s][i]:
                    best[s][i], cut[s][i] = slowest, j
    counts, end = [], n
    for s in range(stages, 0, -1):
        counts.append(end - cut[s][end])
        end = cut[s][end]
    return tuple(reversed(counts))

