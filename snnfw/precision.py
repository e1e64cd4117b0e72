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


def precision_notes(config, device_type: str) -> tuple[str, ...]:
    """A rationale line where bf16 will be slow: a CPU without AVX-512 has no bf16 convolution kernels."""
    if config.train.precision != "bf16" or device_type != "cpu":
        return ()
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    if "AVX512" in capability or "AMX" in capability:
        return ()
    return (f"train.precision bf16 on a {capability} CPU: torch has no bf16 convolution kernels for it, so bf16 "
            "convolutions run several times slower than fp32 here (measured 5.8x on the quickstart); bf16 pays on "
            "CPUs with AVX-512 BF16 or AMX, and on GPUs",)


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
