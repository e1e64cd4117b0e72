"""Only the shard is built: under a strategy that shards parameters, a rank materializes only what it holds.

Every rank builds the model on the meta device, which holds no memory, and records the build
(:mod:`snnfw.model.recipe`; :func:`builds_shards`, asked in ``prepare``). In the trainer every rank then:

1. sets its model aside (:func:`set_aside`): the module's tensors by name, the module itself on the meta device,
   so that the transforms and the strategy apply to a model without storage;
2. parallelizes it (FSDP2's ``fully_shard`` and the tp styles take meta modules);
3. materializes it (:func:`materialize`): empty storage on its device for what it holds (``to_empty``), then one
   tensor at a time the whole tensor's initial value and a copy of this rank's pieces of it, those the
   strategy's state dict names (the pieces its checkpoints write). A value comes from the recorded build,
   replayed by each rank alone (:class:`Replayed`: the initial weights of strategy ``none``, bit for bit, and the
   random state the CPU build leaves), or from weights every rank was given.

A strategy that runs the model to apply it (a pipeline's split: ``Strategy.reads_values``) is given the meta
model and reads each tensor's initial value through ``hooks.initial`` (:meth:`Replayed.initial`) for as long as
it runs a part of it.

A rank thus holds its shard plus one whole tensor before the first step. Where a replay could differ from the
build (an initialiser that samples from its own generator, or a build that reads values: ``record`` refuses
it), rank 0 builds the model on the CPU and broadcasts each tensor in turn (:class:`FromRank0`); rank 0 then
holds the whole model until it is sent. Where the strategy reads values, every rank builds the whole model instead.

Every rank builds the whole model, as before, where this does not apply: layouts that keep whole models
(``none``, ``dp``, ``zero``, ``tsp``; :meth:`Composed.builds_shards` says which),
``auto`` (chosen only after the model is built), a module instance handed to the Python API (ranks take
rank 0's state by broadcast), and a transform that runs the model before it is parallelized
(``snnfw_transform_runs_model``: memopt, a timed memory format).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from snnfw.distributed.chunks import is_held_tensor, pieces, value_dtype, whole_shape
from snnfw.model.recipe import Recipe


def builds_shards(config, plugins, world_size: int, given_instance: bool) -> bool:
    """Whether the ranks of this run build only their shards: the same answer on every rank (``config`` names a
    registered strategy, not ``auto``)."""
    return (world_size > 1 and not given_instance and plugins.strategy(config.parallel.strategy).builds_shards(config, plugins)
            and not plugins.transform_runs_model(config))


def set_aside(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model`` by name: whole on rank 0 where it built the model on the CPU to send
    it (:class:`FromRank0`), meta tensors otherwise; ``model`` itself moved to the meta device in place, to be
    parallelized without storage."""
    named = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}
    whole = {name: tensor.detach() for name, tensor in named.items()}
    model.to_empty(device="meta")
    return whole if dist.get_rank() == 0 else {name: tensor.to("meta") for name, tensor in whole.items()}


class Replayed:
    """Each tensor's initial value computed by this rank alone: ``weights`` where given (every rank holds them),
    else the recorded build's replay (in the dtype it was built in: the pieces' copies cast it)."""

    def __init__(self, recipe: Recipe, weights: dict[str, torch.Tensor] | None):
        self.recipe, self.weights = recipe, weights

    def start(self, sizes: dict, device: torch.device) -> None:
        pass  # the recording left the generator where the CPU build leaves it

    def initial(self, name: str) -> torch.Tensor | None:
        """The initial value of the model's tensor ``name`` (``hooks.initial``), a tensor of its own; None once
        :meth:`release` d."""
        if self.recipe is None:
            return None
        given = self._given(name)
        return given.clone() if given is not None else self.recipe.value(name)

    def release(self) -> None:
        """Lets go of the recipe and the given weights (the run keeps ``initial``): the model is materialized."""
        self.recipe = self.weights = None

    def value(self, name: str, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        given = self._given(name)
        return (given if given is not None else self.recipe.value(name)).reshape(shape)

    def _given(self, name: str) -> torch.Tensor | None:
        """``name``'s weight given to the run (None for a buffer the state dict leaves out)."""
        return self.weights.get(name) if self.weights is not None else None


class FromRank0:
    """Each tensor's initial value as rank 0 built it (a collective): ``whole`` is what :func:`set_aside` returned
    (meta tensors on other ranks), emptied as its tensors are sent. Every tensor crosses in one buffer the size
    of the largest, so no whole tensor outlives its turn (a backend's worker thread may keep a reference to a
    sent tensor a while after the collective ends)."""

    def __init__(self, whole: dict[str, torch.Tensor]):
        self.whole = whole

    def start(self, sizes: dict, device: torch.device) -> None:
        rng = torch.get_rng_state()  # rank 0's, which its build advanced: every rank's stream as if it had built too
        dist.broadcast(rng, src=0)
        torch.set_rng_state(rng)
        self.buffer = torch.empty(max((_nbytes(*size) for size in sizes.values()), default=0), dtype=torch.uint8,
                                  device=device)

    def value(self, name: str, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        tensor = self.buffer[:_nbytes(shape, dtype)].view(dtype).view(shape)
        source = self.whole.pop(name)
        if dist.get_rank() == 0:
            tensor.copy_(source.reshape(shape))  # a 0-dim parameter FSDP2 made a vector
        del source
        dist.broadcast(tensor, src=0)
        return tensor


@torch.no_grad()
def materialize(model: torch.nn.Module, device: torch.device, names: dict[str, torch.Tensor],
                held_state: Callable[[], dict], values: Replayed | FromRank0) -> None:
    """Gives the parallelized meta ``model`` storage on ``device`` and its initial ``values`` (rank 0's: a
    collective).

    ``names`` is what :func:`set_aside` returned; ``held_state()`` maps the model's own names to what this rank
    holds of each tensor (whole tensors, DTensors, :class:`~snnfw.distributed.chunks.Chunked` pieces): the
    strategy's state dict, whose pieces are views of the model's storage (its names may differ from the model's:
    a pipeline's stages). Buffers whose storage it leaves out (non-persistent ones) are held whole.
    """
    model.to_empty(device=device)
    held = {name: value for name, value in held_state().items() if is_held_tensor(value)}
    addresses = {piece.data_ptr() for value in held.values() for _, piece in pieces(value)}
    held.update({name: buffer for name, buffer in model.named_buffers()
                 if buffer.numel() and buffer.data_ptr() not in addresses})
    _check_names(held, names)
    sizes = {name: (whole_shape(value), value_dtype(value)) for name, value in held.items()}
    values.start(sizes, device)
    for name in sorted(held):
        tensor = values.value(name, *sizes[name])
        for at, piece in pieces(held[name]):
            piece.copy_(tensor[tuple(slice(start, start + length) for start, length in zip(at, piece.shape))])
        del tensor


def _nbytes(shape: torch.Size, dtype: torch.dtype) -> int:
    return shape.numel() * dtype.itemsize


def _check_names(held: dict, whole: dict[str, torch.Tensor]) -> None:
    """Refuses (alike on every rank: every rank knows each tensor's shape) a parallelized model whose tensors are
    not those of the model set aside."""
    unknown = sorted(held.keys() - whole.keys())
    resized = sorted(name for name in held.keys() & whole.keys() if whole_shape(held[name]).numel() != whole[name].numel())
    if unknown or resized:
        raise RuntimeError(
            f"the parallelized model holds tensors the built model does not: unknown {unknown[:3]}, resized "
            f"{resized[:3]}; a strategy with shards_parameters must keep the model's own names and sizes in its state dict"
        )
