"""Model weights outside checkpoints: read from any run directory, checkpoint or state-dict file, and loaded."""

from __future__ import annotations

from pathlib import Path

import torch

from snnfw.errors import CheckpointError


def read_weights(source: str | Path) -> dict[str, torch.Tensor]:
    """A state dict by the model's own names from ``source``: a ``.pt`` or ``.safetensors`` file, a run directory
    (its newest weights: :func:`snnfw.components.export.weights_of`) or a checkpoint folder."""
    from snnfw.components import export

    source, checkpoint = export.weights_of(source)
    if checkpoint is not None:
        return export.model_state(source)[0]
    return export.read_file(source)


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
