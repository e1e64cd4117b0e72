"""Checkpoint state of a pipeline rank, named by the model's own parameter and buffer names.

A pipeline rank holds some stages (``PipelineModel``), whose state keys
(``stages.0.1.conv.weight``) differ from the model's (``features.3.conv.weight``)
and collide between ranks. ``PipelineModel.model_names`` maps the first to the
second, found by tensor identity when the pipeline is built. Saving writes this
rank's tensors under the model's names, with the optimizer's param groups
gathered over the pp ranks so that they list every parameter; loading takes
this rank's entries of any checkpoint, whatever strategy wrote it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import _init_optim_state

from snnfw.api import merge_optimizer_states, state_name
from snnfw_plugins.strategies.pp_model import PipelineModel
from snnfw_plugins.strategies.tp_state import chunked, convert_sliced
from snnfw_plugins.strategies.tp_styles import SLICES


def tensor_names(model: torch.nn.Module) -> dict[tuple[int, str], str]:
    """(``id`` of the module holding it, its attribute) of every parameter and buffer of ``model`` -> its state-dict
    name: a wrapper may replace a tensor (FSDP2 shards it), never the module holding it."""
    return {(id(module), attribute): state_name(f"{prefix}.{attribute}" if prefix else attribute)
            for prefix, module in model.named_modules() for attribute in (*module._parameters, *module._buffers)}


def model_names(pipeline: torch.nn.Module, names: dict[tuple[int, str], str], unsaved: bool = False) -> dict[str, str]:
    """Each state-dict key of ``pipeline`` (with ``unsaved``, each buffer the state dict leaves out instead) -> the
    model's own name of that tensor (``names``: :func:`tensor_names`)."""
    saved = pipeline.state_dict(keep_vars=True)
    keys = [raw for raw, _ in pipeline.named_buffers() if raw not in saved] if unsaved else list(saved)
    out = {}
    for raw in keys:
        prefix, _, attribute = raw.rpartition(".")
        out[raw] = names[(id(pipeline.get_submodule(prefix)), attribute)]
    return out


def _parameter_names(pipeline: PipelineModel, optimizer) -> list[str]:
    """The model's name of every parameter the optimizer holds, in its state-dict index order."""
    names = {id(t): pipeline.model_names[raw] for raw, t in pipeline.state_dict(keep_vars=True).items()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def _slices(model: PipelineModel) -> dict:
    """The model's name of every tensor a tp style sliced (a composed mesh's tp applied before the split) -> its
    slice note."""
    return {model.model_names[f"{prefix}.{name}"]: piece for prefix, module in model.named_modules()
            for name, piece in getattr(module, SLICES, {}).items() if f"{prefix}.{name}" in model.model_names}


def named_state(model: PipelineModel, optimizer) -> dict:
    """This rank's stage state under the model's names, param groups listing every pp rank's parameters (without
    ``optimizer``, the model's tensors alone, non-persistent buffers included); tp's slices as pieces of the whole
    tensors (``tp_state``)."""
    state = _named_state(model, optimizer)
    slices = _slices(model)
    return convert_sliced(state, slices, chunked) if slices else state


def _named_state(model: PipelineModel, optimizer) -> dict:
    tensors = {model.model_names[raw]: tensor.detach() for raw, tensor in model.state_dict(keep_vars=True).items()}
    if optimizer is None:  # what a shard-only build materializes: the buffers the state dict leaves out too
        unsaved = dict(model.named_buffers())
        return {"model": {**tensors, **{name: unsaved[raw] for raw, name in model.unsaved_names.items()}}}
    _init_optim_state(optimizer)  # a fresh optimizer's state, for a checkpoint to load into
    own, params = optimizer.state_dict(), _parameter_names(model, optimizer)
    groups = [{**group, "params": [params[i] for i in group["params"]]} for group in own["param_groups"]]
    parts: list = [None] * dist.get_world_size(model.pp_group)
    dist.all_gather_object(parts, {"state": {}, "param_groups": groups}, group=model.pp_group)
    return {
        "model": tensors,
        "optimizer": {
            "state": {params[i]: values for i, values in own["state"].items()},
            "param_groups": merge_optimizer_states(parts)["param_groups"],
        },
    }


def load_named_state(model: PipelineModel, optimizer, state: dict) -> None:
    """Loads this rank's entries of a whole ``state`` (tp's slices read in place) into its stages and optimizer."""
    if slices := _slices(model):
        state = convert_sliced(state, slices, lambda pieces, piece: pieces.source)
    model.load_state_dict({raw: state["model"][name] for raw, name in model.model_names.items()})
    own = optimizer.state_dict()
    params = _parameter_names(model, optimizer)
    saved = state["optimizer"]["state"]
    optimizer.load_state_dict({
        "state": {i: saved[name] for i, name in enumerate(params) if name in saved},
        "param_groups": own["param_groups"],
    })
