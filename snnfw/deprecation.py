"""The import paths 0.3.0 removed (0.1.0's, deprecated through 0.2): a plugin that still imports one is told what to
import instead when it fails to load."""

from __future__ import annotations

REMOVED_IN = "0.3.0"
MOVED = {  # 0.1.0's module: where its public names are now (import them from snnfw.api)
    "snnfw.analysis": "snnfw.model.analysis", "snnfw.families": "snnfw.model.families",
    "snnfw.modules": "snnfw.model.modules", "snnfw.estimate": "snnfw.plan.estimate",
    "snnfw.optim": "snnfw.components.optim", "snnfw.losses": "snnfw.components.losses",
    "snnfw.metrics": "snnfw.components.metrics", "snnfw.step": "snnfw.components.step",
    "snnfw.pipeline": "snnfw.distributed.pipeline", "snnfw.runtime": "snnfw.run.loop",
}
MOVED_NAMES = {  # 0.1.0's names of a module that became a package
    "snnfw.plan": ("Topology", "PlanRequest", "Proposal", "refuse_others", "Plan"),
    "snnfw.data": ("InputSpec", "DatasetSpec"),
}


def removed_import(err: BaseException) -> str | None:
    """What to import instead, where ``err`` is the failed import of a path 0.3.0 removed; else None."""
    name = getattr(err, "name", None)
    if isinstance(err, ModuleNotFoundError) and name in MOVED:
        return f"{name} was removed in snnfw {REMOVED_IN}: import its public names from snnfw.api"
    if isinstance(err, ImportError) and name in MOVED_NAMES and \
            any(f"'{moved}'" in str(err) for moved in MOVED_NAMES[name]):
        return f"{name}'s names of 0.1.0 were removed in snnfw {REMOVED_IN}: import them from snnfw.api"
    return None
