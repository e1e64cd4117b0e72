"""A step's record whose device figures are read later, together with every other step's not read yet.

A step's loss, hits, spikes and gradient norm are computed on the device;
reading them waits for the device (a host synchronisation), and adding them
over the ranks is a collective. :class:`StepFigures` starts each step's
reduction over the ranks at the end of the step, without waiting for it
(every rank starts the same one, in step order), and waits for it only when
a figure is read: at a step that logs, a checkpoint, the end of the run, or
when one is asked for first, on any rank alone. The figures of all the steps
not read yet are then read in one transfer.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs
import torch
import torch.distributed as dist


@attrs.frozen
class StepResult:
    """A training step as one rank ends it: the record's ``values`` known on the host, its figures as one float64
    ``row`` on the device and ``host`` numbers, both added over the ranks, and ``finish``, which makes the record's
    remaining values (named in ``coming``) of their totals (row's, then host's)."""

    values: dict[str, Any]
    row: torch.Tensor
    host: list[float]
    finish: Callable[[list[float]], dict[str, Any]]
    coming: tuple[str, ...]

    def read(self) -> dict[str, Any]:
        """The whole record of a step of one process, whose figures need no reduction (a host synchronisation)."""
        return {**self.values, **self.finish(self.row.tolist() + self.host)}


class Record(dict):
    """One step's record, a dict of numbers.

    The figures computed on the device (``loss``, ``train_acc``, ...) join it
    when :class:`StepFigures` reads them: at a step that logs
    (``train.log_every``), a checkpoint, the end of the run, or when one of
    them is asked for first. Asking waits for this rank's device and for the
    step's reduction over the ranks, which every rank started at the end of
    the step: any rank may ask alone, at any step.
    """

    def __init__(self, values: dict[str, Any], coming: tuple[str, ...] = ()):
        """``values`` known now; ``coming``: the keys :meth:`StepFigures.add` will fill."""
        super().__init__(values)
        self._figures: StepFigures | None = None
        self._coming = frozenset(coming)
        self.settled = not coming  # read where every rank reads (StepFigures.read), not by one rank asking

    @property
    def complete(self) -> bool:
        """Whether every figure is in place (asking for one then waits for nothing)."""
        return self._figures is None

    def read(self) -> Record:
        """Puts every figure in place (this rank alone: no collective); returns the record."""
        if self._figures is not None:
            self._figures.fill()
        return self

    def _filled(self, values: dict[str, Any]) -> None:
        self.update(values)
        self._figures = None

    def __missing__(self, key: str):
        if key not in self._coming or self.complete:
            raise KeyError(key)
        return self.read()[key]

    def __contains__(self, key) -> bool:
        return dict.__contains__(self, key) or (not self.complete and key in self._coming)

    def get(self, key: str, default=None):
        return self[key] if key in self else default

    def keys(self):
        return dict.keys(self.read())

    def values(self):
        return dict.values(self.read())

    def items(self):
        return dict.items(self.read())

    def __iter__(self):
        return dict.__iter__(self.read())

    def __len__(self) -> int:
        return dict.__len__(self.read())

    def __eq__(self, other) -> bool:
        return dict.__eq__(self.read(), other)

    __hash__ = None

    def __repr__(self) -> str:
        return dict.__repr__(self.read())

    def copy(self) -> dict[str, Any]:
        return dict(self.read().items())


@attrs.frozen
class _Pending:
    """A step's figures on their way: ``values`` on the device and ``host`` numbers (over several ranks, the host
    numbers join the device row in ``values``, the reduction's tensor, whose ``work`` is then running) and what makes
    the record's values of them."""

    record: Record
    values: torch.Tensor
    host: list[float]
    work: Any
    finish: Callable[[list[float]], dict]


class StepFigures:
    """The device figures of the steps not read yet, one float64 row per step, with each step's host numbers
    (added over the ranks alike) and what makes its record's values of the totals."""

    def __init__(self):
        self._pending: list[_Pending] = []
        self._unsettled: list[Record] = []

    def add(self, record: Record, row: torch.Tensor, host: list[float], finish: Callable[[list[float]], dict]) -> None:
        """Holds ``row`` (float64, on the device) and ``host`` for ``record``, and starts adding them over the ranks
        (a collective every rank starts with its step, waiting for nothing): ``finish`` makes the record's values of
        their totals (row's then host's)."""
        values, work = row, None
        if dist.is_initialized():
            numbers = torch.tensor(host, dtype=torch.float64).to(row.device, non_blocking=True)  # waits for no kernel
            values, host = torch.cat([row, numbers]), []
            work = dist.all_reduce(values, async_op=True)
        record._figures = self
        self._pending.append(_Pending(record, values, host, work, finish))
        self._unsettled.append(record)

    def fill(self) -> None:
        """Fills the records of every step not read yet, once their reductions are done (one host transfer; on this
        rank alone)."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        for step in pending:
            if step.work is not None:
                step.work.wait()
        totals = torch.cat([step.values for step in pending]).tolist()
        start = 0
        for step in pending:
            end = start + step.values.numel()
            step.record._filled(step.finish(totals[start:end] + step.host))
            start = end

    def read(self) -> None:
        """Fills every record not read yet (:meth:`fill`) where every rank reads them alike (a step that logs, a
        checkpoint, the end of the run), and marks them :attr:`Record.settled`."""
        self.fill()
        for record in self._unsettled:
            record.settled = True
        self._unsettled = []
