"""Settings of the training loop around the model: cuDNN's autotuner (``cuda.cudnn_benchmark``) and the
collectives' timeout once the first step is done (``parallel.step_timeout_s``).

``parallel.timeout_s`` covers start-up: the rendezvous, the process groups, the first step (the slowest: memory
allocation, cuDNN's autotuning, compiling). From step 2 on every process group of the run takes
``parallel.step_timeout_s`` (torch's ``_set_pg_timeout``), so that a rank that hangs mid-run stops the job in
seconds rather than minutes; it must cover a rank's longest wait, checkpoint saves and evaluations included.
"""

from __future__ import annotations

import attrs

from snnfw import hookimpl
from snnfw.api import MAX_TIMEOUT_S, Proposal, keys_phrase

NAME = "loop_settings"  # what it keeps for a run: hooks.run.kept[NAME]


@attrs.frozen
class CudaConfig:
    """The ``[cuda]`` section (entry point ``snnfw.config``: ``cuda``)."""

    cudnn_benchmark: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))


@attrs.frozen
class StepTimeoutKeys:
    """``parallel.step_timeout_s`` (entry point ``snnfw.config``: ``parallel.step_timeout_s``); None: ``timeout_s``."""

    step_timeout_s: float | None = attrs.field(
        default=None, converter=attrs.converters.optional(float),
        validator=attrs.validators.optional([attrs.validators.gt(0), attrs.validators.le(MAX_TIMEOUT_S)]))


@hookimpl
def snnfw_plan(request):
    config, refusals = request.config, []
    cuda_keys = sorted(key for key in config.explicit if key.startswith("cuda."))
    if cuda_keys and request.topology.device_type != "cuda":
        subject, pronoun = keys_phrase(cuda_keys)
        refusals.append(f"{subject} for CUDA runs and this run is on the CPU; remove {pronoun}, or set "
                        "parallel.device = \"cuda\"")
    if "parallel.step_timeout_s" in config.explicit and request.topology.world_size < 2:
        refusals.append("parallel.step_timeout_s times collectives, which a run of one rank has none of; remove it")
    return [Proposal.refuse(request.strategy, reason) for reason in refusals]


@hookimpl
def snnfw_transform_model(model, plan, example, hooks):
    parallel = plan.config.parallel
    if plan.device_type == "cuda":
        import torch

        torch.backends.cudnn.benchmark = plan.config.cuda.cudnn_benchmark
    if plan.world_size > 1 and hooks.run is not None:
        hooks.run.kept[NAME] = {"timeout_after_first_step": parallel.step_timeout_s or parallel.timeout_s, "started": 0}


@hookimpl
def snnfw_step_start(step, rank, hooks):
    kept = hooks.kept(NAME)
    if kept is None:
        return
    kept["started"] += 1
    if kept["started"] == 2:
        from snnfw.api import set_timeouts

        set_timeouts(kept["timeout_after_first_step"])
