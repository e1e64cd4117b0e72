"""``dualpipev``: DeepSeek's DualPipe folded into a V.

pp rank r holds stages r and 2P - 1 - r (pipeline.virtual_stages = 2); forward
and backward of different microbatches are overlapped.
"""

from torch.distributed.pipelining import ScheduleDualPipeV

from snnfw import hookimpl
from snnfw.pipeline import ScheduleSpec

NAME = "dualpipev"


@hookimpl
def snnfw_register_schedules(register):
    register(NAME, ScheduleSpec("v"), "DualPipeV: DeepSeek's DualPipe folded into a V of two stages per rank")


@hookimpl
def snnfw_schedule(stages, plan, loss_fn):
    if plan.config.pipeline.schedule != NAME:
        return None
    return ScheduleDualPipeV(stages, plan.microbatches, loss_fn=loss_fn)
