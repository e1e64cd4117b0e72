"""One data semantics for every strategy, so strategies compare step by step.

Step ``s`` trains on the ``s``-th contiguous run of ``batch_size`` samples of a
seeded per-epoch permutation. Data-parallel replica ``r`` takes the ``r``-th
contiguous chunk of that global batch, and its microbatches are contiguous
chunks of the replica's chunk. ``none`` with ``D x M`` microbatches therefore
computes on exactly the chunks that ``D`` replicas with ``M`` each compute on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import attrs

from snnfw.config import DataConfig

if TYPE_CHECKING:
    import torch
    from torch.utils.data import Dataset


@attrs.frozen
class InputSpec:
    """What the model expects: frames ``[T, C, H, W]`` per sample and a class count."""

    time_steps: int
    shape: tuple[int, int, int]
    num_classes: int


@attrs.frozen
class DatasetSpec:
    """A data-set plugin's builder: ``build(config, spec, split, seed) -> Dataset``.

    Items are ``(frames [T, C, H, W] float, label int)``; ``split`` is "train" or "test".
    """

    build: Callable[[DataConfig, InputSpec, str, int], Dataset]
    description: str = ""


def global_batch_indices(step: int, batch_size: int, length: int, seed: int) -> torch.Tensor:
    """Dataset indices of the global batch of ``step`` (reshuffled every epoch)."""
    import torch

    positions = torch.arange(step * batch_size, (step + 1) * batch_size)
    epochs = positions // length
    out = torch.empty_like(positions)
    for epoch in epochs.unique().tolist():
        perm = torch.randperm(length, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        mask = epochs == epoch
        out[mask] = perm[positions[mask] % length]
    return out


def replica_chunk(indices: torch.Tensor, replica: int, replicas: int) -> torch.Tensor:
    return indices.chunk(replicas)[replica]


def load(dataset: Dataset, indices: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    from torch.utils.data import default_collate

    frames, labels = default_collate([dataset[i] for i in indices.tolist()])
    return frames.to(device, non_blocking=True), labels.to(device, non_blocking=True)
