"""``gpipe``: every microbatch's forward, then every backward (fill and drain).

One stage per rank; the bubble is (P - 1) / (M + P - 1) of the step.
"""

from snnfw import hookimpl
from snnfw.api import ScheduleSpec

NAME = "gpipe"


@hookimpl
def snnfw_register_schedules(register):
    register(NAME, ScheduleSpec("single", "ScheduleGPipe", holds_all_microbatches=True), "GPipe: all forwards, then all backwards; one stage per rank")
