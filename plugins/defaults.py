"""Fallbacks every run needs: the plain optimizer and SpikingJelly's state reset."""

import torch

from snnfw import hookimpl


@hookimpl(trylast=True)
def snnfw_build_optimizer(model, plan):
    params = [p for p in model.parameters() if p.requires_grad]
    if plan.optimizer == "sgd":
        return torch.optim.SGD(params, lr=plan.lr, momentum=0.9)
    return torch.optim.Adam(params, lr=plan.lr)


@hookimpl(trylast=True)
def snnfw_reset_state(model):
    from spikingjelly.activation_based import functional

    functional.reset_net(model)
    return True
