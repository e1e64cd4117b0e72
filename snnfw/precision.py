"""``train.precision``: bf16 autocast of the forward pass, the same in every strategy.

Parameters, gradients and optimizer state stay in ``train.dtype`` (fp32);
only the forward pass of the model (each pipeline stage's, under ``pp``)
runs under ``torch.autocast``; losses upcast the logits to fp32 first, so
every strategy computes them alike. Evaluation runs under the same autocast.
"""

from __future__ import annotations

import contextlib

from snnfw.config import TrainConfig
from snnfw.errors import ConfigError


def check_precision(train: TrainConfig) -> None:
    """Refuses what the run cannot apply."""
    if train.precision == "fp16":
        raise ConfigError(
            "train.precision = \"fp16\" needs a gradient scaler in every strategy, which snnfw does not have yet; "
            "use \"bf16\" (no scaler needed, on CPU and CUDA)"
        )
    if train.precision == "bf16" and train.dtype != "float32":
        raise ConfigError(
            f"train.precision = \"bf16\" autocasts from float32 parameters, and train.dtype is {train.dtype!r}; "
            "remove one of them"
        )


def autocast(train: TrainConfig, device_type: str):
    """The autocast context of ``train.precision`` on ``device_type`` (a no-op in fp32)."""
    if train.precision == "fp32":
        return contextlib.nullcontext()
    import torch

    return torch.autocast(device_type=device_type, dtype=torch.bfloat16)


def full_precision(logits):
    """``logits`` as fp32 when autocast made them bf16 or fp16, for the loss."""
    import torch

    return logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits
