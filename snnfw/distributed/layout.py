"""Layout: what the distributed primitives need of a plan, the ranks' mesh and the roles of its dimensions."""

from __future__ import annotations

import math

import attrs


@attrs.frozen
class Layout:
    """The ranks as a mesh of named dimensions, and what each kind of dimension does.

    ``dp_dims`` split the batch into replicas; ``stage_dims`` split the model
    into stages (a rank holds only its stages' parameters); over
    ``replicated_neuron_dims`` a neuron the strategy does not shard runs alike.
    ``backend`` is the collectives' (gloo or NCCL) on ``device_type``.
    """

    mesh: tuple[tuple[str, int], ...]
    dp_dims: tuple[str, ...] = ()
    stage_dims: tuple[str, ...] = ()
    replicated_neuron_dims: tuple[str, ...] = ()
    device_type: str = "cpu"
    backend: str = "gloo"

    def size(self, dims: tuple[str, ...]) -> int:
        """How many ranks the mesh dimensions ``dims`` span together."""
        sizes = dict(self.mesh)
        return math.prod(sizes[d] for d in dims)

    @property
    def world_size(self) -> int:
        return math.prod(n for _, n in self.mesh)

    @property
    def dp_size(self) -> int:
        return self.size(self.dp_dims)
