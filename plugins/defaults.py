"""Fallbacks every run needs: the optimizers and learning-rate schedules by name, the plain optimizer,
SpikingJelly's state reset, checkpoint state as each rank holds it, and the microbatch loop of every strategy
that does not bring its own (pipelines do)."""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING

from snnfw import hookimpl
from snnfw.api import (ConfigError, LossSpec, LrScheduleSpec, OptimizerSpec, StepOutput, autocast, build_optimizer,
                       cross_entropy, held_state, hits, load_held_state, mse_rate, next_token, scored, tet,
                       training_loss)

if TYPE_CHECKING:
    import torch


def _torch_optimizer(name: str):
    def torch_class():
        import torch

        return getattr(torch.optim, name)

    return torch_class


@hookimpl
def snnfw_register_losses(register):
    register("cross_entropy", LossSpec(cross_entropy, ("label_smoothing",), {"label_smoothing": 0.0}),
             "cross entropy of the time-averaged logits, train.label_smoothing (0)")
    register("next_token", LossSpec(next_token), "a language model's cross entropy of the time-averaged logits against "
             "the next tokens, with the model's auxiliary loss where it carries one (mixture of experts)")
    register("mse_rate", LossSpec(mse_rate), "mean squared error of the time-averaged output against one-hot targets")
    register("tet", LossSpec(tet, ("tet_lambda",), {"tet_lambda": 1e-3}),
             "TET: cross entropy at every time step, train.tet_lambda (0.001) of distance of the logits from 1")


@hookimpl
def snnfw_register_optimizers(register):
    register("adamw", OptimizerSpec(_torch_optimizer("AdamW"), ("weight_decay", "betas"), state_tensors=2),
             "torch.optim.AdamW: decoupled weight decay (0.01 unless train.weight_decay), train.betas")
    register("adam", OptimizerSpec(_torch_optimizer("Adam"), ("weight_decay", "betas"), state_tensors=2),
             "torch.optim.Adam: L2 penalty train.weight_decay (0), train.betas")
    register("sgd", OptimizerSpec(_torch_optimizer("SGD"), ("weight_decay", "momentum", "nesterov"), {"momentum": 0.9}, 1),
             "torch.optim.SGD: train.momentum (0.9), train.nesterov, train.weight_decay (0)")


def _constant(options, train):
    return lambda step: 1.0


def _cosine(options, train):
    floor, start, length = options["min_lr"] / train.lr, train.warmup_steps, train.steps - train.warmup_steps
    return lambda step: floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * (step - start) / length))


def _check_cosine(options, train):
    if options["min_lr"] >= train.lr:
        raise ConfigError(f"train.min_lr ({options['min_lr']}) must be below train.lr ({train.lr}); lower it")


def _step(options, train):
    start, size, gamma = train.warmup_steps, options["step_size"], options["gamma"]
    return lambda step: gamma ** ((step - start) // size)


def _check_decay(options, name: str) -> None:
    if options["gamma"] > 1:
        raise ConfigError(f"train.gamma = {options['gamma']} would raise the learning rate at each decay of "
                          f"lr_schedule \"{name}\", which multiplies it by gamma to lower it; set train.gamma below 1")


def _check_step(options, train):
    _check_decay(options, "step")
    if options["step_size"] >= train.steps - train.warmup_steps:
        raise ConfigError(
            f"train.step_size ({options['step_size']}) never decays within the {train.steps - train.warmup_steps} "
            "steps after warm-up; lower it or use lr_schedule = \"constant\""
        )


def _multistep(options, train):
    milestones, gamma = options["milestones"], options["gamma"]
    return lambda step: gamma ** sum(step >= m for m in milestones)


def _check_multistep(options, train):
    _check_decay(options, "multistep")
    milestones = list(options["milestones"])
    if not milestones or milestones != sorted(set(milestones)) or not train.warmup_steps < milestones[0] <= milestones[-1] < train.steps:
        raise ConfigError(
            f"train.milestones must be increasing steps after warm-up and before the last step "
            f"({train.warmup_steps} < m < {train.steps}), got {milestones}"
        )


@hookimpl
def snnfw_register_lr_schedules(register):
    register("constant", LrScheduleSpec(_constant), "train.lr throughout (after warm-up)")
    register("cosine", LrScheduleSpec(_cosine, ("min_lr",), {"min_lr": 0.0}, _check_cosine),
             "half a cosine from train.lr after warm-up to train.min_lr (0) after the last step")
    register("step", LrScheduleSpec(_step, ("step_size", "gamma"), {"gamma": 0.1}, _check_step),
             "train.lr times train.gamma (0.1) every train.step_size steps after warm-up")
    register("multistep", LrScheduleSpec(_multistep, ("milestones", "gamma"), {"gamma": 0.1}, _check_multistep),
             "train.lr times train.gamma (0.1) after each of train.milestones")


@hookimpl
def snnfw_tune_settings(config, analysis, device_type):
    """``train.precision``: every autocast a float32 run may take here (fp16 pays on GPUs only)."""
    if config.train.dtype != "float32":
        return None
    return {"train.precision": ("fp32", "bf16", "fp16") if device_type == "cuda" else ("fp32", "bf16")}


@hookimpl(trylast=True)
def snnfw_build_optimizer(model, plan, mesh, hooks):
    return build_optimizer(model, plan.config.train, hooks)


@hookimpl(trylast=True)
def snnfw_state_dict(model, optimizer, plan):
    return held_state(model, optimizer)


@hookimpl(trylast=True)
def snnfw_load_state_dict(model, optimizer, plan, state):
    load_held_state(model, optimizer, state)
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
    """Every microbatch forward and backward; their loss and hits add up on the device, where they stay (the step's
    figures are read when it logs)."""
    import torch

    loss_sum = correct = None
    samples = 0
    loss_of = training_loss(plan.config.train, hooks)
    precision = autocast(plan.config.train, plan.device_type)
    phases = hooks.run.phases
    for m, (frames, labels) in enumerate(batches):
        with gradient_sync(model, enabled=m == len(batches) - 1):
            with phases("reset"):
                hooks.reset_state(model)
            with phases("forward"):
                with precision:
                    logits = model(frames)
                loss = loss_of(logits, labels)
            with phases("backward"):
                (loss / len(batches)).backward()
        with torch.no_grad():
            loss = loss.double()  # summed in float64, as Python floats would be
            loss_sum = loss if loss_sum is None else loss_sum + loss
            hit = hits(logits, labels)
            correct = hit if correct is None else correct + hit
        samples += len(labels)
    return StepOutput(loss=loss_sum / len(batches), correct=correct, samples=samples)


@hookimpl(trylast=True)
def snnfw_evaluate(model, frames, labels, plan, hooks):
    hooks.reset_state(model)
    with autocast(plan.config.train, plan.device_type):
        logits = model(frames)
    return scored(logits, labels, training_loss(plan.config.train, hooks))
