"""Checkpoint state of models sharded by the tp styles (``tp``, ``fsdp2_tp``).

The styles note every sliced tensor (``tp_styles.SLICES``). Saving all-gathers
the slices over their tp group into whole tensors (parameters, BatchNorm
statistics, and the optimizer state shaped like its parameter); loading keeps
this rank's entries. The rest, FSDP2 over dp included, goes through the
defaults, so a checkpoint moves between tensor parallel and any other strategy.
"""

import torch
import torch.distributed as dist

from snnfw_plugins.defaults import full_state, load_full_state, state_name
from snnfw_plugins.strategies.tp_styles import SLICES


def _slices(model) -> dict:
    return {
        state_name(f"{prefix}.{name}"): piece
        for prefix, module in model.named_modules()
        for name, piece in getattr(module, SLICES, {}).items()
    }


def _gather(local: torch.Tensor, piece) -> torch.Tensor:
    size = dist.get_world_size(piece.group)
    index = piece.index.to(local.device)
    parts, indices = [torch.empty_like(local) for _ in range(size)], [torch.empty_like(index) for _ in range(size)]
    dist.all_gather(parts, local.contiguous(), group=piece.group)
    dist.all_gather(indices, index, group=piece.group)
    shape = list(local.shape)
    shape[piece.dim] *= size
    return local.new_empty(shape).index_copy_(piece.dim, torch.cat(indices), torch.cat(parts, piece.dim))


def _select(whole: torch.Tensor, piece) -> torch.Tensor:
    return whole.index_select(piece.dim, piece.index.to(whole.device))


def _convert(state: dict, slices: dict, convert) -> dict:
    """``state`` with every sliced tensor, and its parameter's optimizer state, passed through ``convert``."""
    model = state["model"]

    def optimizer_entry(name, values):
        if name not in slices:
            return values
        shape = model[name].shape
        return {key: convert(v, slices[name]) if torch.is_tensor(v) and v.shape == shape else v for key, v in values.items()}

    optimizer = state["optimizer"]
    return {
        **state,
        "model": {name: convert(t, slices[name]) if name in slices else t for name, t in model.items()},
        "optimizer": {**optimizer, "state": {n: optimizer_entry(n, v) for n, v in optimizer["state"].items()}},
    }


def gathered_state(model, optimizer) -> dict | None:
    """The whole training state, slices gathered; None when ``model`` holds no slices."""
    slices = _slices(model)
    return _convert(full_state(model, optimizer), slices, _gather) if slices else None


def load_sliced_state(model, optimizer, state) -> bool:
    """Loads this rank's slices of the whole ``state``; False when ``model`` holds no slices."""
    slices = _slices(model)
    if not slices:
        return False
    load_full_state(model, optimizer, _convert(state, slices, _select))
    return True
