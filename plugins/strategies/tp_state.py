"""Checkpoint state of models sharded by the tp styles (``tp``, ``fsdp2_tp``).

The styles note every sliced tensor (``tp_styles.SLICES``): which entries of
one dimension of the whole it holds, possibly several blocks (the q, k and v
rows of some heads). Saving writes each rank's slices as :class:`Chunked`
pieces of the whole tensor (and the optimizer state shaped like its
parameter), nothing gathered; loading reads this rank's pieces of any
checkpoint in place. The rest, FSDP2 over dp included, goes through the
defaults, so a checkpoint moves between tensor parallel and any other strategy.
"""

import torch
import torch.distributed as dist

from snnfw.api import Chunked, held_state, load_held_state, pieces, state_name
from snnfw_plugins.strategies.tp_styles import SLICES


def _slices(model) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):  # its names have no "module." (torch's state dict API's)
        model = model.module
    return {
        state_name(f"{prefix}.{name}"): piece
        for prefix, module in model.named_modules()
        for name, piece in getattr(module, SLICES, {}).items()
    }


def _runs(index: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(local start, whole start, length)`` of each run of consecutive entries of ``index``."""
    runs, values = [], index.tolist()
    for local, value in enumerate(values):
        if runs and value == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([local, value, 1])
    return [tuple(run) for run in runs]


def chunked(value, piece) -> Chunked:
    """``value`` (a tensor, or FSDP2's DTensor of one) as pieces of the whole tensor it slices."""
    dim, runs = piece.dim, _runs(piece.index)
    shape = list(value.shape)
    shape[dim] = len(piece.index) * dist.get_world_size(piece.group)
    out = []
    for at, local in pieces(value):
        held = range(at[dim], at[dim] + local.shape[dim])
        for start, whole_start, length in runs:
            low, high = max(held.start, start), min(held.stop, start + length)
            if low < high:
                offsets = list(at)
                offsets[dim] = whole_start + low - start
                out.append((tuple(offsets), local.narrow(dim, low - held.start, high - low)))
    return Chunked(shape, out, source=value)


def convert_sliced(state: dict, slices: dict, convert) -> dict:
    """``state`` with every sliced tensor, and its parameter's optimizer state, passed through ``convert``."""
    model = state["model"]

    def optimizer_entry(name, values):
        if name not in slices:
            return values
        shape = model[name].shape
        return {key: convert(v, slices[name]) if isinstance(v, (torch.Tensor, Chunked)) and v.shape == shape else v
                for key, v in values.items()}

    optimizer = state["optimizer"]
    return {
        **state,
        "model": {name: convert(t, slices[name]) if name in slices else t for name, t in model.items()},
        "optimizer": {**optimizer, "state": {n: optimizer_entry(n, v) for n, v in optimizer["state"].items()}},
    }


def sliced_state(model, optimizer) -> dict | None:
    """This rank's training state, its slices as pieces of the whole tensors; None when ``model`` holds none."""
    slices = _slices(model)
    return convert_sliced(held_state(model, optimizer), slices, chunked) if slices else None


def load_sliced_state(model, optimizer, state) -> bool:
    """Loads ``state`` as :func:`sliced_state` shapes it (its pieces read in place); False when ``model`` holds
    no slices."""
    slices = _slices(model)
    if not slices:
        return False
    load_held_state(model, optimizer, convert_sliced(state, slices, lambda pieces, piece: pieces.source))
    return True
