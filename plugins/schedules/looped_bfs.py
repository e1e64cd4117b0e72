"""``looped_bfs``: breadth first over looped stages.

All microbatches pass one local stage before the next; pipeline.virtual_stages
>= 2 stages per rank (r, r + P, ...).
"""

from torch.distributed.pipelining import ScheduleLoopedBFS

from snnfw import hookimpl
from snnfw.pipeline import ScheduleSpec

NAME = "looped_bfs"


@hookimpl
def snnfw_register_schedules(register):
    register(NAME, ScheduleSpec("looped", min_virtual=2), "looped BFS: all microbatches through a stage before the next")


@hookimpl
def snnfw_schedule(stages, plan, loss_fn):
    if plan.config.pipeline.schedule != NAME:
        return None
    return ScheduleLoopedBFS(stages, plan.microbatches, loss_fn=loss_fn)
