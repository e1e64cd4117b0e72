"""What a rank allocates before its first step: ``run_on_ranks(..., before=track_until_first_step, inspect=seen)``.

Each rank's CPU allocations are tracked by torch's MemTracker from before the model is built to the first
step, where the peak, the peak resident memory and the whole initial parameters are kept.
"""

from __future__ import annotations

import resource

import torch

from snnfw.run.trainer import Trainer
from snnfw.testing import full_parameters

_seen: dict = {}


def track_until_first_step(rank: int) -> None:
    """Tracks this process's CPU allocations until its trainer's first step."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.__enter__()
    step = Trainer.step

    def first_step(trainer, index):
        if not _seen:
            tracker.__exit__(None, None, None)
            _seen.update(peak=tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"],
                         rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                         initial=full_parameters(trainer))
        return step(trainer, index)

    Trainer.step = first_step


def track_whole_build(rank: int) -> None:
    """:func:`track_until_first_step` with every rank building the whole model, as before shards were built."""
    from snnfw.plan import prepare

    prepare.builds_shards = lambda *args: False
    track_until_first_step(rank)


def seen(trainer: Trainer) -> dict:
    """What :func:`track_until_first_step` kept: ``peak`` (bytes), ``rss_mb``, ``initial`` (parameters by name)."""
    return _seen
