"""``model.memory_format``: the layout of the activations around a model's 2-D convolutions.

``contiguous`` (the default) keeps torch's layout. ``channels_last`` makes
every ``nn.Conv2d`` (SpikingJelly's multi-step ``layer.Conv2d`` included)
take its input channels-last (NHWC; a multi-step ``[T, N, C, H, W]`` input
as ``T x N`` such images): the convolution's output, and the BatchNorm,
neurons and pooling that follow, then stay channels-last through forward and
backward. Parameters keep their layout (FSDP2 shards only contiguous ones;
the kernels lay out a convolution's weight as they need). Where a device's
convolution kernels prefer channels-last (cuDNN's tensor cores in bf16 and
fp16) it is faster; values equal contiguous's up to the kernels' order of
summation. ``auto`` decides by measurement before training: it
times forward and backward of the run's first microbatch in both layouts
(:data:`TRIALS` alternating trials each after a warm-up, in the run's
precision), sums each layout's median over ranks so that every rank picks
the same, and keeps the faster. Rank 0 prints the choice and both times; the
summary holds them (``memory_format_channels_last`` 1 or 0,
``memory_format_contiguous_ms``, ``memory_format_channels_last_ms``).
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import TYPE_CHECKING

import attrs

from snnfw import hookimpl
from snnfw.api import Proposal

if TYPE_CHECKING:
    import torch
    from torch import nn

TRIALS = 3
LAYOUTS = ("contiguous", "channels_last")


@attrs.frozen
class LayoutKeys:
    """``model.memory_format`` (entry point ``snnfw.config``: ``model.memory_format``)."""

    memory_format: str = attrs.field(default="contiguous", validator=attrs.validators.in_((*LAYOUTS, "auto")))
NAME = "memory_format"  # what it keeps for a run: hooks.run.kept[NAME], the figures of its choice


def _convolutions(model: nn.Module) -> list[nn.Module]:
    from torch import nn

    return [m for m in model.modules() if isinstance(m, nn.Conv2d)]


@hookimpl
def snnfw_plan(request):
    layout = request.config.model.memory_format
    if layout != "contiguous" and request.model is not None and not _convolutions(request.model):
        return Proposal.refuse(
            request.strategy,
            f"model.memory_format = {layout!r} lays out the inputs of 2-D convolutions, and the model has none; "
            "remove model.memory_format",
        )
    return None


def is_channels_last(x: torch.Tensor) -> bool:
    """Whether ``x`` is channels-last images (not merely contiguous either way); a multi-step
    ``[T, N, C, H, W]`` sequence as ``T x N`` of them."""
    import torch

    images = x.flatten(0, 1) if x.dim() == 5 else x
    return images.dim() == 4 and images.is_contiguous(memory_format=torch.channels_last) and not images.is_contiguous()


def to_channels_last(x: torch.Tensor) -> torch.Tensor:
    """``x`` as channels-last images; a multi-step ``[T, N, C, H, W]`` sequence as ``T x N`` of them."""
    import torch

    if x.dim() == 5:
        return x.flatten(0, 1).contiguous(memory_format=torch.channels_last).unflatten(0, x.shape[:2])
    return x.contiguous(memory_format=torch.channels_last) if x.dim() == 4 else x


def _channels_last_input(module, args):
    x, *rest = args
    return (to_channels_last(x), *rest)


def channels_last(model: nn.Module) -> list:
    """Makes ``model``'s 2-D convolutions take channels-last inputs; returns the hooks' handles."""
    return [conv.register_forward_pre_hook(_channels_last_input) for conv in _convolutions(model)]


def measure(model: nn.Module, example: torch.Tensor, plan, hooks) -> dict[str, float]:
    """Milliseconds of a forward and backward of ``example`` in each layout: the median of
    :data:`TRIALS` alternating trials, summed over ranks. Leaves the model as it found it."""
    import torch

    from snnfw.api import all_reduce, autocast, finish_queued_work

    device = example.device
    times: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for trial in range(TRIALS + 1):  # trial 0 warms each layout up
            for layout in LAYOUTS if trial % 2 else LAYOUTS[::-1]:
                handles = channels_last(model) if layout == "channels_last" else []
                hooks.reset_state(model)
                finish_queued_work(device)
                started = time.perf_counter()
                with autocast(plan.config.train, device.type):
                    out = model(example)
                out.float().sum().backward()
                finish_queued_work(device)
                if trial:
                    times[layout].append((time.perf_counter() - started) * 1e3)
                for handle in handles:
                    handle.remove()
    model.zero_grad(set_to_none=True)
    hooks.reset_state(model)
    summed = all_reduce([statistics.median(times[layout]) for layout in LAYOUTS])
    return dict(zip(LAYOUTS, summed))


@hookimpl
def snnfw_transform_runs_model(config):
    """``auto`` times a forward and backward in each layout."""
    return config.model.memory_format == "auto" or None


@hookimpl
def snnfw_transform_model(model, plan, example, hooks):
    from torch._subclasses.fake_tensor import is_fake

    from snnfw.api import is_main

    layout = plan.config.model.memory_format
    if layout == "auto":
        if is_fake(example):  # a dry run: layouts hold the same bytes
            return
        times = measure(model, example, plan, hooks)
        layout = "channels_last" if times["channels_last"] < times["contiguous"] else "contiguous"
        figures = hooks.run.kept.setdefault(NAME, {}) if hooks.run is not None else {}
        figures.update(memory_format_channels_last=float(layout == "channels_last"),
                       **{f"memory_format_{name}_ms": ms for name, ms in times.items()})
        if is_main():
            print(f"[snnfw] note: model.memory_format auto chose {layout}: forward and backward of a microbatch "
                  f"took {times['contiguous']:.1f} ms contiguous, {times['channels_last']:.1f} ms channels-last "
                  f"(medians of {TRIALS} trials, summed over ranks)", file=sys.stderr, flush=True)
    if layout == "channels_last":
        channels_last(model)


@hookimpl
def snnfw_summary(plan, hooks):
    figures = hooks.kept(NAME)
    return dict(figures) if figures else None
