"""What a rank allocates before its first step: ``run_on_ranks(..., before=track_until_first_step, inspect=seen)``.

Each rank's CPU allocations are tracked by torch's MemTracker from before the model is built to the first
step, where the peak, the peak resident memory and the whole initial parameters are kept.
"""

from __future__ import annotations

import resource

import torch

from snnfw.distributed.chunks import gather_whole
from snnfw.run.trainer import Trainer
from snnfw.testing import full_parameters, state_bytes

_seen: dict = {}


def track_until_first_step(rank: int) -> None:
    """Tracks this process's CPU allocations until its trainer's first step."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker._mod_tracker = _NoModules()  # its statistics per module refuse a module run twice outside another
    tracker.__enter__()
    step = Trainer.step

    def first_step(trainer, index):
        if not _seen:
            tracker.__exit__(None, None, None)
            _seen.update(peak=tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"],
                         rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                         held=state_bytes(trainer)["parameters"],
                         initial=_initial(trainer))
        return step(trainer, index)

    Trainer.step = first_step


class _NoModules:
    """What MemTracker asks of its module tracker, tracking no module: the peak of all allocations is kept, without
    the statistics per module, which refuse a module run twice outside another (a pipeline's split runs the model,
    then its units) and hook into autograd."""

    is_bw, parents = False, frozenset({"Global"})

    def register_user_hooks(self, *hooks) -> None:
        pass

    def clear_user_hooks(self) -> None:
        pass

    def get_known_fqn(self, module) -> None:
        return None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


def track_whole_build(rank: int) -> None:
    """:func:`track_until_first_step` with every rank building the whole model, as before shards were built."""
    from snnfw.plan import prepare

    prepare.builds_shards = lambda *args: False
    track_until_first_step(rank)


def seen(trainer: Trainer) -> dict:
    """What :func:`track_until_first_step` kept: ``peak`` (bytes), ``rss_mb``, ``held`` (bytes of the parameter
    pieces this rank holds), ``initial`` (those parameters, whole, by the model's names)."""
    return _seen


def _initial(trainer: Trainer) -> dict:
    """The parameters, whole (DTensors and tp's sliced tensors gathered), by the model's names."""
    whole = gather_whole(trainer.plugins.state_dict(trainer.model, None, trainer.plan)["model"], dst=None)
    return {name: whole.get(name, tensor) for name, tensor in _by_model_names(trainer, full_parameters(trainer)).items()}


def _by_model_names(trainer: Trainer, parameters: dict) -> dict:
    """``parameters`` under the model's own names (a pipeline's stages name them by stage)."""
    names = getattr(trainer.model, "model_names", None)
    return {names[name]: tensor for name, tensor in parameters.items()} if names else parameters
