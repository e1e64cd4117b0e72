"""``looped_bfs``: breadth first over looped stages.

All microbatches pass one local stage before the next; pipeline.virtual_stages
>= 2 stages per rank (r, r + P, ...).
"""

from snnfw import hookimpl
from snnfw.api import ScheduleSpec

NAME = "looped_bfs"


@hookimpl
def snnfw_register_schedules(register):
    register(NAME, ScheduleSpec("looped", "ScheduleLoopedBFS", min_virtual=2, holds_all_microbatches=True), "looped BFS: all microbatches through a stage before the next")
