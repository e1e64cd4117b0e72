"""Fallbacks every run needs: the plain optimizer and SpikingJelly's state reset."""

import torch

from snnfw import hookimpl


@hookimpl(trylast=True)
def snnfw_build_optimizer(model, plan, mesh):
    train = plan.config.train
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer_class, kwargs = optimizer_spec(train)
    return optimizer_class(params, **kwargs)


def optimizer_spec(train):
    """The optimizer class and its arguments for ``train.optimizer`` and ``train.lr``."""
    if train.optimizer == "sgd":
        return torch.optim.SGD, {"lr": train.lr, "momentum": 0.9}
    return torch.optim.Adam, {"lr": train.lr}


@hookimpl(trylast=True)
def snnfw_reset_state(model):
    from spikingjelly.activation_based import functional

    functional.reset_net(model)
    return True
