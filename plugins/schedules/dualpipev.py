"""``dualpipev``: DeepSeek's DualPipe folded into a V.

pp rank r holds stages r and 2P - 1 - r (pipeline.virtual_stages = 2); forward
and backward of different microbatches are overlapped.
"""

from snnfw import hookimpl
from snnfw.api import ScheduleSpec

NAME = "dualpipev"


@hookimpl
def snnfw_register_schedules(register):
    spec = ScheduleSpec("v", "ScheduleDualPipeV", bubble_scale=1 / 2)
    register(NAME, spec, "DualPipeV: DeepSeek's DualPipe folded into a V of two stages per rank")
