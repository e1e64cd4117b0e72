"""``zbv``: zero bubble in a V.

pp rank r holds stages r and 2P - 1 - r (pipeline.virtual_stages = 2); the
backward is split into input and weight gradients.
"""

from torch.distributed.pipelining import ScheduleZBVZeroBubble

from snnfw import hookimpl
from snnfw.pipeline import ScheduleSpec

NAME = "zbv"


@hookimpl
def snnfw_register_schedules(register):
    register(NAME, ScheduleSpec("v"), "zero bubble V: two stages per rank in a V, input and weight gradients split")


@hookimpl
def snnfw_schedule(stages, plan, loss_fn):
    if plan.config.pipeline.schedule != NAME:
        return None
    return ScheduleZBVZeroBubble(stages, plan.microbatches, loss_fn=loss_fn)
