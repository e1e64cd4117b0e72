"""``cp``: context parallelism, the sequence of every sample split across ranks, exactly (the mesh dimension named as
torchtitan names it).

The P ranks of a ``cp`` dimension see the same samples and rank k runs positions k S/P to (k+1) S/P - 1 of each
(``cp_ops``): its tokens, and its next tokens as the loss's targets. Causal attention all-gathers each layer's keys
and values over the group; neurons keep their state per position, so they need nothing. Its ranks hold the same
parameters and each rank's loss is the mean over its positions, so the core's gradient average over the dimension
(with the data replicas') is the whole sequence's gradient, as for ``time``.
"""

import math

from snnfw import hookimpl
from snnfw.api import Proposal, Strategy

NAME = "cp"
SEQUENCE_PARTS = ("keys_values", "first_position")  # what cp_ops changes: attention's k and v, the embedded positions


def sequence_length(config, families) -> int | None:
    """The sequence length S of ``config``'s language model, or None for a model that takes frames."""
    if config.model.family is None:
        return None
    flavor = families.get(config.model.family).flavor(config.model.flavor)
    return None if flavor.vocab is None else flavor.shape_for(config.model.sequence_length)[0]


def sequence_split_refusal(request, size: int) -> str | None:
    """Why the sequence of ``request``'s model cannot be split ``size`` ways, or None."""
    config = request.config
    length = sequence_length(config, request.plugins.families)
    if length is None:
        what = f"model family {config.model.family!r}" if config.model.family else "a model of your own"
        return (f"cp splits a language model's sequence, and {what} takes frames, not token ids; use tp, time or a "
                "data dimension")
    if length % size:
        return (f"the sequence of {length} tokens does not split into {size} equal slices; use a cp size that divides "
                f"it, or set model.sequence_length to a multiple of {size}")
    if config.memopt.level:
        return ("memopt recomputes forward passes in backward, where cp's key/value all-gathers are not verified to run "
                "in step; set memopt.level = 0")
    if config.compile.enable:
        return ("cp's collectives run inside autograd functions that torch.compile is not verified on; set "
                "compile.enable = false")
    if request.model is not None and not all(any(hasattr(m, part) for m in request.model.modules())
                                             for part in SEQUENCE_PARTS):
        return (f"model family {config.model.family!r} lacks an attention's keys_values or an embedding's "
                "first_position, which cp splits the sequence by; cp applies to the spiking_lm family")
    return None


def key_value_bytes(request, layout) -> float:
    """Bytes a rank receives from its cp peers in a step: each attention layer's (of its pipeline stage's share of
    the layers) all-gather of the whole sequence's keys and values (its time steps' and tp heads' share) and their
    gradients' reduce-scatter, (P - 1) / P of it each (the MoE means, a few numbers a step and expert, left out)."""
    import torch

    sizes, config = dict(layout.mesh), request.config
    size = sizes[NAME]
    layers = [m for m in request.model.modules() if hasattr(m, "keys_values")] if request.model is not None else []
    channels = sum(m.k.out_features for m in layers)  # k's; v's as many
    element = torch.empty((), dtype=config.train.torch_dtype).element_size()
    samples = config.data.batch_size / layout.replicas
    steps = config.model.time_steps / sizes.get("time", 1)
    stages = math.prod(sizes[name] for name in layout.stage_dims)
    length = sequence_length(config, request.plugins.families)
    whole = 2 * channels / sizes.get("tp", 1) / stages * steps * samples * length
    return 2 * (size - 1) / size * whole * element


class SequenceSplit(Strategy):
    """The ``cp`` dimension: its ranks hold the same parameters, each rank's loss the mean over its positions, so
    the core's average over it is the whole sequence's."""

    dimension = NAME

    def propose_dimension(self, request, layout):
        size = dict(layout.mesh)[NAME]
        if reason := sequence_split_refusal(request, size):
            return Proposal.refuse(NAME, reason)
        length = sequence_length(request.config, request.plugins.families)
        attentions = sum(hasattr(m, "keys_values") for m in request.model.modules()) if request.model is not None else 0
        exchanged = key_value_bytes(request, layout)
        return Proposal(NAME, rationale=(f"cp = {size}: each sample's {length} positions split ({length // size} per "
                                         f"rank), keys and values all-gathered in each of {attentions} causal "
                                         f"attentions: each rank receives {exchanged / 2**20:.1f} MiB a step",),
                        added_comm_bytes=exchanged, added_calls=2 * attentions)

    def apply_dimension(self, model, plan, mesh, hooks, wrap=None):
        from snnfw.api import rows_group
        from snnfw_plugins.strategies.cp_ops import SequenceGroup, split_sequence

        sequence = SequenceGroup(rows_group(mesh, (NAME,)), timed=plan.config.log.phase_times)
        if hooks.run is not None:
            hooks.run.kept[NAME] = sequence.counter
        split_sequence(model, sequence, sequence_length(plan.config, hooks.families))
        return model


@hookimpl
def snnfw_register_strategies(register):
    register(NAME, SequenceSplit(), "the cp dimension: each sample's sequence split across its ranks")


@hookimpl
def snnfw_sequence_view(plan, mesh, hooks):
    """On a ``cp`` mesh dimension of P ranks, coordinate k reads positions k S/P to (k+1) S/P only."""
    if mesh is None or NAME not in dict(plan.mesh):
        return None
    from snnfw_plugins.strategies.cp_ops import sequence_slice

    part = sequence_slice(sequence_length(plan.config, hooks.families), mesh.get_local_rank(NAME), dict(plan.mesh)[NAME])
    return part.start, part.stop


@hookimpl
def snnfw_step_metrics(plan, hooks):
    """``cp_comm_mb``: the megabytes this rank received from its cp peers in the step; with log.phase_times,
    ``cp_exchange_ms``: the time it spent in those collectives."""
    counter = hooks.kept(NAME)
    if NAME not in dict(plan.mesh) or counter is None:
        return None
    return counter.take()
