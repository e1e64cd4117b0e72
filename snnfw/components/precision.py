"""``train.precision``: bf16 or fp16 autocast of the forward pass, the same in every strategy.

Parameters, gradients and optimizer state stay in ``train.dtype`` (fp32);
only the forward pass of the model (each pipeline stage's, under ``pp``)
runs under ``torch.autocast``; losses upcast the logits to fp32 first, so
every strategy computes them alike. Evaluation runs under the same autocast.

fp16 adds a dynamic loss scale (:class:`LossScale`, the trainer's), one for the whole
model, with torch's GradScaler defaults (``train.loss_scale``, 65536, to
start): the loss's gradient is multiplied by the scale; a step whose gradient norm over the whole model (every data
replica, tensor-parallel shard and pipeline stage: the same value on every
rank) is not finite is skipped and halves the scale, and 2000 finite steps
in a row double it. torch's GradScaler checks only the gradients its own
rank holds, which under sharding and pipelines would let ranks disagree on
skipping a step.
"""

from __future__ import annotations

import contextlib
import functools

from snnfw.config import TrainConfig
from snnfw.errors import ConfigError


def check_precision(train: TrainConfig) -> None:
    """Refuses what the run cannot apply."""
    if train.loss_scale is not None and train.precision != "fp16":
        raise ConfigError(f"train.loss_scale is fp16's initial loss scale, and train.precision is {train.precision!r}; "
                          "remove train.loss_scale or set train.precision = \"fp16\"")
    if train.precision != "fp32" and train.dtype != "float32":
        raise ConfigError(
            f"train.precision = {train.precision!r} autocasts from float32 parameters, and train.dtype is {train.dtype!r}; "
            "remove one of them"
        )


def precision_notes(config, device_type: str) -> tuple[str, ...]:
    """A rationale line where bf16 or fp16 will be slow: a CPU without AVX-512 has no bf16 convolution kernels
    (for ``train.precision`` and ``parallel.mixed_precision`` alike), and fp16 pays only on GPUs."""
    precision, mixed = config.train.precision, config.parallel.mixed_precision
    if device_type != "cpu" or (precision == "fp32" and mixed == "none"):
        return ()
    if precision == "fp16":
        return ("train.precision fp16 on a CPU: torch runs it (with the loss scale, as on CUDA), but CPUs have no fast "
                "fp16 kernels; use it on GPUs, and bf16 or fp32 on CPUs",)
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    if "AVX512" in capability or "AMX" in capability:
        return ()
    keys = " and ".join(f"{key} bf16" for key, value in (("train.precision", precision),
                                                         ("parallel.mixed_precision", mixed)) if value == "bf16")
    return (f"{keys} on a {capability} CPU: torch has no bf16 convolution kernels for it, so bf16 "
            "convolutions run several times slower than fp32 here (measured 5.8x on the quickstart); bf16 pays on "
            "CPUs with AVX-512 BF16 or AMX, and on GPUs",)


def autocast(train: TrainConfig, device_type: str):
    """The autocast context of ``train.precision`` on ``device_type`` (a no-op in fp32)."""
    if train.precision == "fp32":
        return contextlib.nullcontext()
    import torch

    return torch.autocast(device_type=device_type, dtype=torch.bfloat16 if train.precision == "bf16" else torch.float16)


def full_precision(logits):
    """``logits`` as fp32 when autocast made them bf16 or fp16, for the loss."""
    import torch

    return logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits


class LossScale:
    """fp16's dynamic loss scale (torch.amp.GradScaler's defaults); 1 and inert unless enabled."""

    INIT, GROWTH, BACKOFF, INTERVAL = 2.0**16, 2.0, 0.5, 2000

    def __init__(self, enabled: bool = False, initial: float | None = None):
        self.enabled, self.scale, self.finite_steps = enabled, (initial or self.INIT) if enabled else 1.0, 0

    def update(self, finite: bool) -> None:
        """After a step: back off on a non-finite gradient, grow after ``INTERVAL`` finite ones."""
        if not finite:
            self.scale, self.finite_steps = self.scale * self.BACKOFF, 0
            return
        self.finite_steps += 1
        if self.finite_steps == self.INTERVAL:
            self.scale, self.finite_steps = self.scale * self.GROWTH, 0

    def state_dict(self) -> dict:
        return {"enabled": self.enabled, "scale": self.scale, "finite_steps": self.finite_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.finite_steps = float(state["scale"]), int(state["finite_steps"])

    def scaled(self, loss):
        """``loss`` whose gradient is multiplied by the scale (its value unchanged, for the metrics)."""
        return _scaled_gradient().apply(loss, self.scale) if self.enabled else loss


@functools.cache
def _scaled_gradient():
    import torch

    class ScaledGradient(torch.autograd.Function):
        @staticmethod
        def forward(ctx, loss, scale):
            ctx.scale = scale
            return loss.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad * ctx.scale, None

    return ScaledGradient
