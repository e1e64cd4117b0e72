"""``1f1b``: after a warm-up, one forward and one backward alternate.

One stage per rank; the bubble of GPipe with at most P microbatches in flight.
"""

from torch.distributed.pipelining import Schedule1F1B

from snnfw import hookimpl
from snnfw.pipeline import ScheduleSpec

NAME = "1f1b"


@hookimpl
def snnfw_register_schedules(register):
    register(NAME, ScheduleSpec("single"), "1F1B: one forward, one backward in the steady state; one stage per rank")


@hookimpl
def snnfw_schedule(stages, plan, loss_fn):
    if plan.config.pipeline.schedule != NAME:
        return None
    return Schedule1F1B(stages[0], plan.microbatches, loss_fn=loss_fn)
