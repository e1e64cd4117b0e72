"""``zbv``: zero bubble in a V.

pp rank r holds stages r and 2P - 1 - r (pipeline.virtual_stages = 2); the
backward is split into input and weight gradients.
"""

from snnfw import hookimpl
from snnfw.api import ScheduleSpec

NAME = "zbv"


@hookimpl
def snnfw_register_schedules(register):
    spec = ScheduleSpec("v", "ScheduleZBVZeroBubble", bubble_scale=1 / 3)
    register(NAME, spec, "zero bubble V: two stages per rank in a V, input and weight gradients split")
