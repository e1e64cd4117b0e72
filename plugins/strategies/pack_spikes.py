"""``parallel.pack_spikes``: whether a neuron's output crosses ranks as bits (``spike_bits``), planned here
without importing torch."""

from __future__ import annotations

import attrs

from snnfw import hookimpl
from snnfw.api import Proposal

SENDS_ACTIVATIONS = ("tp", "fsdp2_tp", "pp", "auto")


@attrs.frozen
class PackSpikesKeys:
    """``parallel.pack_spikes`` (entry point ``snnfw.config``: ``parallel.pack_spikes``)."""

    pack_spikes: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))


@hookimpl
def snnfw_plan(request):
    if "parallel.pack_spikes" in request.config.explicit and request.strategy not in SENDS_ACTIVATIONS:
        reason = (f"parallel.pack_spikes applies to the strategies that send activations between ranks "
                  f"({', '.join(SENDS_ACTIVATIONS[:-1])}); remove it")
        return Proposal.refuse(request.strategy, reason)
    return None
