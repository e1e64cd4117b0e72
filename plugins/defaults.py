"""Fallbacks every run needs: the plain optimizer, SpikingJelly's state reset, whole-tensor
checkpoint state, and the microbatch loop of every strategy that does not bring its own (pipelines do)."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from snnfw import hookimpl
from snnfw.errors import CheckpointError
from snnfw.phases import PHASES
from snnfw.step import StepOutput, classification_loss, count_correct

if TYPE_CHECKING:
    import torch


def optimizer_spec(train):
    """The optimizer class and its arguments for ``train.optimizer`` and ``train.lr``."""
    import torch

    if train.optimizer == "sgd":
        return torch.optim.SGD, {"lr": train.lr, "momentum": 0.9}
    return torch.optim.Adam, {"lr": train.lr}


@hookimpl(trylast=True)
def snnfw_build_optimizer(model, plan, mesh):
    optimizer_class, kwargs = optimizer_spec(plan.config.train)
    return optimizer_class([p for p in model.parameters() if p.requires_grad], **kwargs)


WRAPPER_NAMES = ("_checkpoint_wrapped_module", "_orig_mod")  # activation checkpointing (memopt), torch.compile


def state_name(name: str) -> str:
    """A parameter or buffer name as torch's state_dict API writes it: wrapper modules left out."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_NAMES)


def full_state(model, optimizer) -> dict:
    """Model and optimizer state as whole tensors by parameter name, DTensors gathered (a collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True)
    return {
        "model": get_model_state_dict(model, options=options),
        "optimizer": get_optimizer_state_dict(model, optimizer, options=options),
    }


def load_full_state(model, optimizer, state) -> None:
    """Loads whole tensors by name; a model holding part of the whole takes the names it has."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    own = get_model_state_dict(model)
    missing = [name for name in own if name not in state["model"]]
    if missing:
        raise CheckpointError(
            f"the checkpoint has no model state named {', '.join(missing[:3])}; a strategy that renames the "
            "model's state must implement snnfw_load_state_dict"
        )
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, {name: state["model"][name] for name in own}, options=options)
    set_optimizer_state_dict(model, optimizer, state["optimizer"], options=options)


def merge_optimizer_states(parts: list[dict]) -> dict:
    """One optimizer state from every rank's part: the union of states, each group's parameter names joined."""
    groups = [
        dict(group, params=[name for part in parts for name in part["param_groups"][i]["params"]])
        for i, group in enumerate(parts[0]["param_groups"])
    ]
    return {"state": {name: value for part in parts for name, value in part["state"].items()}, "param_groups": groups}


@hookimpl(trylast=True)
def snnfw_state_dict(model, optimizer, plan):
    return full_state(model, optimizer)


@hookimpl(trylast=True)
def snnfw_load_state_dict(model, optimizer, plan, state):
    load_full_state(model, optimizer, state)
    return True


@hookimpl(trylast=True)
def snnfw_reset_state(model):
    from spikingjelly.activation_based import functional

    functional.reset_net(model)
    return True


@contextlib.contextmanager
def gradient_sync(model: torch.nn.Module, enabled: bool):
    """Lets backward passes inside synchronise gradients across replicas only if ``enabled``.

    Skipping uses DDP's ``no_sync()`` or FSDP2's ``set_requires_gradient_sync``;
    a model with neither is left alone.
    """
    no_sync = getattr(model, "no_sync", None)
    set_sync = getattr(model, "set_requires_gradient_sync", None)
    if enabled or (no_sync is None and set_sync is None):
        yield
    elif no_sync is not None:
        with no_sync():
            yield
    else:
        set_sync(False)
        try:
            yield
        finally:
            set_sync(True)


@hookimpl(trylast=True)
def snnfw_forward_backward(model, batches, plan, hooks):
    loss_sum, correct, samples = 0.0, 0, 0
    for m, (frames, labels) in enumerate(batches):
        with gradient_sync(model, enabled=m == len(batches) - 1):
            with PHASES("reset"):
                hooks.reset_state(model)
            with PHASES("forward"):
                logits = model(frames)
                loss = classification_loss(logits, labels)
            with PHASES("backward"):
                (loss / len(batches)).backward()
        loss_sum += float(loss.detach())
        correct += count_correct(logits.detach(), labels)
        samples += len(labels)
    return StepOutput(loss=loss_sum / len(batches), correct=correct, samples=samples)


@hookimpl(trylast=True)
def snnfw_evaluate(model, frames, labels, plan, hooks):
    hooks.reset_state(model)
    return StepOutput(loss=0.0, correct=count_correct(model(frames), labels), samples=len(labels))
