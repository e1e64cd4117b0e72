"""``zero_bubble``: interleaved zero bubble (ZB1P) over looped stages.

The backward is split into input and weight gradients; the weight part fills
the bubble. Any pipeline.virtual_stages (r, r + P, ...).
"""

from snnfw import hookimpl
from snnfw.api import ScheduleSpec
from snnfw_plugins.schedules import rounds_refusal

NAME = "zero_bubble"


@hookimpl
def snnfw_register_schedules(register):
    spec = ScheduleSpec("looped", "ScheduleInterleavedZeroBubble", check_microbatches=rounds_refusal, bubble_scale=1 / 3)
    register(NAME, spec, "interleaved zero bubble (ZB1P): weight gradients fill the bubble; looped stages")
