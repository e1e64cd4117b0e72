"""Model weights outside checkpoints: read from any run directory, checkpoint or state-dict file, and loaded."""

from __future__ import annotations

from pathlib import Path

import torch

from snnfw.errors import CheckpointError
from snnfw.rundir import FINAL_MODEL


def read_weights(source: str | Path) -> dict[str, torch.Tensor]:
    """A state dict by the model's own names from ``source``: a ``.pt`` or ``.safetensors`` file,
    a run directory (its ``final_model.pt``, else its newest checkpoint) or a checkpoint folder."""
    from snnfw.components import export

    source = Path(source)
    if source.is_dir() and (source / FINAL_MODEL).is_file():
        source = source / FINAL_MODEL
    if not source.is_file():
        return export.model_state(export.find(source)[0])[0]
    export.check_digest(source)
    try:
        if source.name.endswith(export.SAFETENSORS):
            from safetensors.torch import load_file

            weights = load_file(source)
        else:
            weights = torch.load(source, weights_only=True, map_location="cpu")
    except Exception as err:  # truncated, empty, not a torch file, or holding what weights_only refuses
        raise CheckpointError(f"{source} cannot be read as a state dict ({_unreadable(err)}); give a file that "
                              "torch.save or snnfw export wrote, a run directory or a checkpoint") from None
    if not isinstance(weights, dict) or not all(isinstance(k, str) and isinstance(t, torch.Tensor) for k, t in weights.items()):
        raise CheckpointError(f"{source} holds {type(weights).__name__}, not a state dict of parameter names to tensors; "
                              "give what model.state_dict() or snnfw export wrote")
    return weights


def _unreadable(err: Exception) -> str:
    """Why torch.load refused a file, without torch's advice to load it unsafely (``weights_only=False``)."""
    text = str(err)
    found = [line.strip() for line in text.splitlines() if "Unsupported global: GLOBAL " in line]
    if found:
        return f"it holds {found[0].split('GLOBAL ')[-1].split()[0]}, not only tensors, and snnfw does not unpickle code"
    first = "" if "Weights only load failed" in text or not text.strip() else text.strip().splitlines()[0][:200]
    return f"not a torch file, or cut short: {type(err).__name__}" + (f" {first}" if first else "")


def load_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Loads ``weights`` into the unparallelized ``model`` (cast to its dtype); every name must match. A model on the
    meta device (a rank that materializes only its shard, :mod:`snnfw.distributed.materialize`) holds no values:
    the weights are only checked."""
    own = model.state_dict()
    missing, unknown = sorted(own.keys() - weights.keys()), sorted(weights.keys() - own.keys())
    if missing or unknown:
        raise CheckpointError(
            f"the weights do not fit the model: missing {', '.join(missing[:3]) or 'none'}, unknown "
            f"{', '.join(unknown[:3]) or 'none'}; give the weights of this model (model.family, flavor or builder)"
        )
    for name, tensor in own.items():
        if weights[name].shape != tensor.shape:
            raise CheckpointError(
                f"the weights do not fit the model: {name} is {tuple(weights[name].shape)} in the weights and "
                f"{tuple(tensor.shape)} in the model; give the weights of this model (model.family, flavor, "
                "num_classes or builder)"
            )
        if weights[name].is_floating_point() and not torch.isfinite(weights[name]).all():
            raise CheckpointError(f"the weights hold NaN or infinite values in {name}; give weights of a run that "
                                  "did not diverge")
    if not any(tensor.is_meta for tensor in own.values()):
        model.load_state_dict({name: weights[name].to(own[name].dtype) for name in own})
