"""A step's record whose device figures are read later, together with every other step's not read yet.

A step's loss, hits, spikes and gradient norm are computed on the device;
reading them waits for the device (a host synchronisation), and adding them
over the ranks is a collective. :class:`StepFigures` holds each step's
figures as one device tensor until a step that logs, a checkpoint or the end
of the run, then reduces the figures of all those steps over the ranks in one
collective and reads them in one transfer.
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
    them is asked for first. Asking before then reduces them over the ranks: a
    collective, so every rank asks (on a step that logs, they are in place).
    """

    def __init__(self, values: dict[str, Any], coming: tuple[str, ...] = ()):
        """``values`` known now; ``coming``: the keys :meth:`StepFigures.add` will fill."""
        super().__init__(values)
        self._figures: StepFigures | None = None
        self._coming = frozenset(coming)

    @property
    def complete(self) -> bool:
        """Whether every figure is in place (asking for one then waits for nothing)."""
        return self._figures is None

    def read(self) -> Record:
        """Puts every figure in place (a collective unless :attr:`complete`); returns the record."""
        if self._figures is not None:
            self._figures.read()
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


class StepFigures:
    """The device figures of the steps not read yet, one float64 row per step, with each step's host numbers
    (added over the ranks alike) and what makes its record's values of the totals."""

    def __init__(self):
        self._unread: list[tuple[Record, torch.Tensor, list[float], Callable[[list[float]], dict]]] = []

    def add(self, record: Record, row: torch.Tensor, host: list[float], finish: Callable[[list[float]], dict]) -> None:
        """Holds ``row`` (float64, on the device) and ``host`` for ``record``: ``finish`` makes the record's values
        of their totals over the ranks (row's then host's)."""
        record._figures = self
        self._unread.append((record, row, host, finish))

    def read(self) -> None:
        """Adds the unread figures over the ranks (one collective) and fills their records (one host transfer)."""
        unread, self._unread = self._unread, []
        if not unread:
            return
        rows = torch.stack([row for _, row, _, _ in unread])
        if dist.is_initialized():
            host = torch.tensor([h for _, _, numbers, _ in unread for h in numbers], dtype=torch.float64)
            flat = torch.cat([rows.reshape(-1), host.to(rows.device)])
            dist.all_reduce(flat)
            totals = flat.tolist()
            width, offset = rows.shape[1], rows.numel()
            row_values = [totals[i * width:(i + 1) * width] for i in range(len(unread))]
            host_values = []
            for _, _, numbers, _ in unread:
                host_values.append(totals[offset:offset + len(numbers)])
                offset += len(numbers)
        else:
            row_values, host_values = rows.tolist(), [numbers for _, _, numbers, _ in unread]
        for (record, _, _, finish), device_totals, host_totals in zip(unread, row_values, host_values):
            record._filled(finish(device_totals + host_totals))
