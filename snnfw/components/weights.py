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
    if source.is_file():
        if source.name.endswith(export.SAFETENSORS):
            from safetensors.torch import load_file

            return load_file(source)
        return torch.load(source, weights_only=True, map_location="cpu")
    return export.model_state(export.find(source))[0]


def load_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Loads ``weights`` into the unparallelized ``model`` (cast to its dtype); every name must match."""
    own = model.state_dict()
    missing, unknown = sorted(own.keys() - weights.keys()), sorted(weights.keys() - own.keys())
    if missing or unknown:
        raise CheckpointError(
            f"the weights do not fit the model: missing {', '.join(missing[:3]) or 'none'}, unknown "
            f"{', '.join(unknown[:3]) or 'none'}; give the weights of this model (model.family, flavor or builder)"
        )
    model.load_state_dict({name: weights[name].to(own[name].dtype) for name in own})
