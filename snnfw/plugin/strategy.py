"""What the core asks of a parallelism strategy besides its hooks: a strategy plugin registers one of these."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from snnfw.config import Config


class Strategy:
    """A strategy's answers to the core; the defaults fit a plain torch optimizer and a model that a dry run on a
    fake process group can step as it is. A plugin subclasses it where its strategy differs and registers an
    instance: ``register("mine", MyStrategy(), "what it does")``."""

    shards_parameters = False
    """True where every rank holds only its shard of the parameters (its state dict's pieces): ranks other than 0
    then build the model on the meta device and receive their pieces of rank 0's (:mod:`snnfw.distributed.materialize`)."""

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """The optimizer-state tensors this rank holds (the dry run counts them)."""
        return [value for state in optimizer.state.values() for value in state.values() if _is_tensor(value)]

    def for_fake_world(self, model: torch.nn.Module, config: Config) -> Config:
        """Readies the applied ``model`` for a dry-run step on a fake process group, which answers no collective;
        returns ``config`` with what this rank decided that the next rank must reuse (a fake group cannot
        broadcast it)."""
        return config


def _is_tensor(value) -> bool:
    import torch

    return isinstance(value, torch.Tensor)
