"""Spikes on the wire as bits: a 0/1 tensor sent 8 values to a byte between ranks (``tp``'s gathers, ``pp``'s
stage boundaries), 32x fewer bytes than float32.

A tensor is packed only where the sender knows it holds spikes: it is the output of a neuron module (identity
with what the neuron returned, not a guess from its values). That it really is 0/1 is checked on the device by
``torch._assert_async``, with no host synchronisation: a neuron whose output is not binary (graded spikes)
stops the run with the reason (on a GPU, as a device-side assert at the step's next host read). Gradients, which
are not binary, cross ranks in their own dtype. ``parallel.pack_spikes = false`` sends activations unpacked.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

NOT_BINARY = ("{where}: a neuron's output sent as bits is not 0/1 (a neuron with graded spikes?); set "
              "parallel.pack_spikes = false to send activations in their dtype")


def _shifts(device: torch.device) -> torch.Tensor:
    return torch.arange(8, dtype=torch.uint8, device=device)


def packed_numel(numel: int) -> int:
    return -(-numel // 8)


def pack(x: torch.Tensor) -> torch.Tensor:
    """``x``'s values as bits, 8 to a ``uint8`` in ``x``'s flattened order (non-zero reads 1)."""
    bits = x.reshape(-1).ne(0).to(torch.uint8)
    if pad := -bits.numel() % 8:
        bits = F.pad(bits, (0, pad))
    return (bits.view(-1, 8) << _shifts(x.device)).sum(1, dtype=torch.uint8)


def unpack(packed: torch.Tensor, shape, dtype: torch.dtype) -> torch.Tensor:
    """The 0/1 tensor of ``shape`` and ``dtype`` that :func:`pack` packed into ``packed``."""
    bits = (packed.unsqueeze(1) >> _shifts(packed.device)) & 1
    return bits.reshape(-1)[: torch.Size(shape).numel()].to(dtype).view(shape)


def check_binary(x: torch.Tensor, where: str) -> None:
    """Asserts on the device, without waiting for it, that ``x`` holds only 0 and 1."""
    torch._assert_async(torch.logical_or(x == 0, x == 1).all(), NOT_BINARY.format(where=where))


class NeuronOutputs:
    """Remembers the last output of ``neurons`` (by a weak reference: a recomputing backward's output is not kept
    alive), so a hook after them can tell whether a tensor is one: spikes."""

    def __init__(self, neurons: list[nn.Module]):
        self.last = None
        for neuron in neurons:
            neuron.register_forward_hook(self._keep)

    def _keep(self, module, args, out) -> None:
        self.last = weakref.ref(out)

    def produced(self, tensor: torch.Tensor) -> bool:
        """True when ``tensor`` is what a neuron returned last; forgets that output."""
        last, self.last = self.last, None
        return last is not None and tensor is last()
