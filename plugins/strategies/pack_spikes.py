"""``parallel.pack_spikes``: whether a neuron's output crosses ranks as bits (``spike_bits``), planned here
without importing torch."""

from __future__ import annotations

import attrs

from snnfw import hookimpl
from snnfw.api import refuse_others

SENDS_ACTIVATIONS = ("tp", "pp")  # the strategies of the mesh dimensions that send spikes between ranks


@attrs.frozen
class PackSpikesKeys:
    """``parallel.pack_spikes`` (entry point ``snnfw.config``: ``parallel.pack_spikes``)."""

    pack_spikes: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))


@hookimpl
def snnfw_plan(request):
    if "parallel.pack_spikes" in request.config.explicit:
        return refuse_others(request, SENDS_ACTIVATIONS, "parallel.pack_spikes applies to the mesh dimensions that send "
                                                         "spikes between ranks (tp, pp); remove it")
    return None
