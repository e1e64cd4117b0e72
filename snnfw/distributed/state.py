"""A rank's training state as it holds it (FSDP2's shards as DTensors), by the model's own parameter names: what a
strategy saves into a checkpoint and loads back (the defaults' ``snnfw_state_dict``; ``zero``, ``tp`` and ``pp``
build theirs from it)."""

from __future__ import annotations

WRAPPER_NAMES = ("_checkpoint_wrapped_module", "_orig_mod")  # activation checkpointing (memopt), torch.compile


def state_name(name: str) -> str:
    """A parameter or buffer name as torch's state_dict API writes it: wrapper modules left out."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_NAMES)


def held_state(model, optimizer) -> dict:
    """Model and optimizer state by parameter name as this rank holds it: FSDP2's shards stay DTensors. Without an
    optimizer (None) the optimizer's part is empty."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    optimizer_state = get_optimizer_state_dict(model, optimizer) if optimizer is not None else {"state": {}, "param_groups": []}
    return {"model": get_model_state_dict(model), "optimizer": optimizer_state}


def load_held_state(model, optimizer, state) -> None:
    """Loads ``state`` as :func:`held_state` shapes it (a checkpoint is read into that shape, resharded)."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


def merge_optimizer_states(parts: list[dict]) -> dict:
    """One optimizer state from every rank's part: the union of states, each group's parameter names joined."""
    groups = [
        dict(group, params=[name for part in parts for name in part["param_groups"][i]["params"]])
        for i, group in enumerate(parts[0]["param_groups"])
    ]
    return {"state": {name: value for part in parts for name, value in part["state"].items()}, "param_groups": groups}
