"""``1f1b``: after a warm-up, one forward and one backward alternate.

One stage per rank; the bubble of GPipe with at most P microbatches in flight.
"""

from snnfw import hookimpl
from snnfw.api import ScheduleSpec

NAME = "1f1b"


@hookimpl
def snnfw_register_schedules(register):
    register(NAME, ScheduleSpec("single", "Schedule1F1B"), "1F1B: one forward, one backward in the steady state; one stage per rank")
