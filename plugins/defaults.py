"""Fallbacks every run needs: the plain optimizer, SpikingJelly's state reset, and
the microbatch loop of every strategy that does not bring its own (pipelines do)."""

import contextlib

import torch

from snnfw import hookimpl
from snnfw.step import StepOutput, classification_loss, count_correct


def optimizer_spec(train):
    """The optimizer class and its arguments for ``train.optimizer`` and ``train.lr``."""
    if train.optimizer == "sgd":
        return torch.optim.SGD, {"lr": train.lr, "momentum": 0.9}
    return torch.optim.Adam, {"lr": train.lr}


@hookimpl(trylast=True)
def snnfw_build_optimizer(model, plan, mesh):
    optimizer_class, kwargs = optimizer_spec(plan.config.train)
    return optimizer_class([p for p in model.parameters() if p.requires_grad], **kwargs)


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
            hooks.reset_state(model)
            logits = model(frames)
            loss = classification_loss(logits, labels)
            (loss / len(batches)).backward()
        loss_sum += float(loss.detach())
        correct += count_correct(logits.detach(), labels)
        samples += len(labels)
    return StepOutput(loss=loss_sum / len(batches), correct=correct, samples=samples)


@hookimpl(trylast=True)
def snnfw_evaluate(model, frames, labels, plan, hooks):
    hooks.reset_state(model)
    return StepOutput(loss=0.0, correct=count_correct(model(frames), labels), samples=len(labels))
