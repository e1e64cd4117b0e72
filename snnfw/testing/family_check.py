"""The plugin author's check of a model family: it trains under every strategy its analysis allows as ``none`` does.

The check is the float64 guarantee that snnfw's own families pass (:func:`snnfw.testing.guarantee.check_case`):
every step's loss and firing rate, the validation and the final model state within 1e-9 relative of ``none``'s
with as many microbatches, with every neuron layer of ``none``'s run firing. It trains the family's ``tiny``
flavor on the synthetic DVS set, one layout of the equivalence matrix (:data:`snnfw.testing.equivalence.CASES`) per
strategy.
"""

from __future__ import annotations

from typing import Iterable

import attrs

from snnfw.errors import PlanError
from snnfw.plan.prepare import prepare
from snnfw.plugin.manager import Plugins
from snnfw.testing import RankFailure
from snnfw.testing.equivalence import CASES, Case, case_config
from snnfw.testing.guarantee import check_case, checked_reference

STRATEGIES = tuple(dict.fromkeys(case.strategy for case in CASES))  # in the matrix's order: dp, zero, fsdp2, ...


@attrs.frozen
class FamilyReport:
    """What :func:`check_family` did: the layouts that trained as ``none`` does, and those it skipped, with why."""

    family: str
    checked: tuple[str, ...]
    skipped: dict[str, str]

    def __str__(self) -> str:
        lines = [f"model family {self.family!r}: trains as none does under {', '.join(self.checked) or 'nothing'}"]
        lines += [f"  skipped {name}: {reason}" for name, reason in self.skipped.items()]
        return "\n".join(lines)


def check_family(family: str, strategies: Iterable[str] | None = None, *, ranks: int = 2, steps: int = 3,
                 timeout_s: float = 300) -> FamilyReport:
    """Asserts that model family ``family`` (its ``tiny`` flavor) trains under each of ``strategies`` exactly as
    under ``none``, in float64, and returns a :class:`FamilyReport`.

    ``strategies``: strategy names (each runs its first layout of the matrix that fits in ``ranks`` processes) or
    layout names of the matrix (``"pp-zbv"``, ``"hsdp"``, ``"mesh-pp2-x-tp2"``); by default every strategy. A
    layout the planner refuses for this family (no ``tp_plan``: ``tp`` and ``fsdp2_tp``; no ``stage_units``:
    ``pp``; time steps that do not split: ``tsp``), or that needs more than ``ranks`` processes, is skipped and
    the report says why. ``steps``: optimizer steps of each run, with one validation after the last.

    Raises AssertionError naming the strategy and the step at the first difference from ``none``
    (``"strategy tp: rank 0 step 2 losses: differs from none by 3.1e-05 (scale 2.3)"``), or the rank's error
    when a rank fails, and with the report when every layout was skipped (nothing checked); ValueError for a name
    that is neither a strategy nor a layout.
    """
    cases, skipped = _layouts(strategies, ranks)
    checked = []
    plugins = Plugins()
    for case in cases:
        if reason := _refusal(family, case, steps, plugins):
            skipped[case.name] = reason
            continue
        try:
            checked_reference(family, case.reference_microbatches, steps, eval_every=steps)
        except AssertionError as err:
            raise AssertionError(f"model family {family!r} under none with {case.reference_microbatches} "
                                 f"microbatch(es): {err}") from err
        try:
            check_case(family, case, steps, eval_every=steps, timeout_s=timeout_s)
        except (AssertionError, RankFailure, TimeoutError) as err:
            raise AssertionError(f"strategy {case.name}: {err}") from err
        checked.append(case.name)
    report = FamilyReport(family, tuple(checked), skipped)
    if not checked:  # a check of nothing would pass whatever the family does
        raise AssertionError(f"{report}\nnothing was checked: name strategies the family's analysis allows, or pass "
                             "ranks= for layouts that need more")
    return report


def _layouts(names: Iterable[str] | None, ranks: int) -> tuple[list[Case], dict[str, str]]:
    """The layouts ``names`` ask for within ``ranks`` processes, and the names none of whose layouts fit, with why."""
    by_name = {case.name: case for case in CASES}
    chosen, skipped = [], {}
    for name in STRATEGIES if names is None else names:
        if name in by_name:
            candidates = [by_name[name]]
        elif name in STRATEGIES:
            candidates = [case for case in CASES if case.strategy == name]
        else:
            raise ValueError(f"no strategy or layout named {name!r}; strategies: {', '.join(STRATEGIES)}; "
                             f"layouts: {', '.join(by_name)}")
        fitting = [case for case in candidates if case.ranks <= ranks]
        if fitting:
            chosen.append(fitting[0])
        else:
            fewest = min(case.ranks for case in candidates)
            skipped[name] = f"its layouts need {fewest} ranks; pass ranks={fewest} to check it"
    return chosen, skipped


def _refusal(family: str, case: Case, steps: int, plugins: Plugins) -> str | None:
    """Why the planner refuses ``case`` for ``family``, or None when it plans it."""
    try:
        prepare(case_config(family, case, "float64", steps), case.ranks, plugins)
    except PlanError as err:
        return str(err)
    return None
