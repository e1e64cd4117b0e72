"""``gpipe``: every microbatch's forward, then every backward (fill and drain).

One stage per rank; the bubble is (P - 1) / (M + P - 1) of the step.
"""

from torch.distributed.pipelining import ScheduleGPipe

from snnfw import hookimpl
from snnfw.pipeline import ScheduleSpec

NAME = "gpipe"


@hookimpl
def snnfw_register_schedules(register):
    register(NAME, ScheduleSpec("single"), "GPipe: all forwards, then all backwards; one stage per rank")


@hookimpl
def snnfw_schedule(stages, plan, loss_fn):
    if plan.config.pipeline.schedule != NAME:
        return None
    return ScheduleGPipe(stages[0], plan.microbatches, loss_fn=loss_fn)
