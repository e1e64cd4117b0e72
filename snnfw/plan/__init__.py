"""plan: validate the config, build and analyse the model, and choose the parallel layout, before any process group exists."""

from snnfw.deprecation import moved_names

# 0.1.0's snnfw.plan module, now snnfw.plan.layout: its public names, deprecated
__getattr__ = moved_names(__name__, "snnfw.plan.layout", ("Topology", "PlanRequest", "Proposal", "refuse_others", "Plan"))
