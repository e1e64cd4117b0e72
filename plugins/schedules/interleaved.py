"""``interleaved``: 1F1B over looped stages, depth first.

pipeline.virtual_stages = V >= 2 stages per rank (r, r + P, ...); the bubble
shrinks about V times.
"""

from snnfw import hookimpl
from snnfw.api import ScheduleSpec
from snnfw_plugins.schedules import rounds_refusal

NAME = "interleaved"


@hookimpl
def snnfw_register_schedules(register):
    spec = ScheduleSpec("looped", "ScheduleInterleaved1F1B", min_virtual=2, check_microbatches=rounds_refusal)
    register(NAME, spec, "interleaved 1F1B: depth first over 2 or more looped stages per rank")
