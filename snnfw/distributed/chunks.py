"""The pieces of a tensor that a rank holds: what its checkpoint writes, and how an export gathers the whole.

A value of a training state is a whole tensor, a DTensor (FSDP2's shards),
or a :class:`Chunked`: pieces of one tensor at given offsets, for shardings a
DTensor cannot express (tensor-parallel slices that take several blocks of a
dimension, such as the q, k and v rows of some heads). A checkpoint writes
each rank's pieces through torch.distributed.checkpoint, which reads
:class:`Chunked` through its ``__create_write_items__`` and
``__create_chunk_list__``; :func:`gather_whole` streams the whole tensors to
one rank, one tensor at a time.
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist


class Chunked:
    """Pieces ``(offsets, tensor)`` of a tensor of ``shape`` held by this rank, each a view of ``source``."""

    def __init__(self, shape, pieces: list[tuple[tuple[int, ...], torch.Tensor]], source=None):
        self.shape = torch.Size(shape)
        self.pieces = pieces
        self.source = source

    def size(self) -> torch.Size:
        return self.shape

    def piece_at(self, offsets) -> torch.Tensor:
        for at, tensor in self.pieces:
            if tuple(at) == tuple(offsets):
                return tensor
        raise KeyError(f"no piece at {tuple(offsets)}")

    def staged(self) -> Chunked:
        """A copy on the CPU, for a save that writes while the live tensors change."""
        return Chunked(self.shape, [(at, tensor.detach().to("cpu", copy=True)) for at, tensor in self.pieces])

    def __create_write_items__(self, fqn: str, obj) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(at)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(at), sizes=tensor.size()),
                    properties=TensorProperties.create_from_tensor(tensor),
                    size=self.shape,
                ),
            )
            for at, tensor in self.pieces
        ]

    def __create_chunk_list__(self) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=torch.Size(at), sizes=tensor.size()) for at, tensor in self.pieces]


def is_held_tensor(value) -> bool:
    return isinstance(value, (torch.Tensor, Chunked))


def pieces(value) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """``(offsets, tensor)`` of every piece of ``value`` on this rank (none for a DTensor off its mesh)."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, Chunked):
        return list(value.pieces)
    if isinstance(value, DTensor):
        if value.device_mesh.get_coordinate() is None:
            return []
        (chunk,) = value.__create_chunk_list__()
        return [(tuple(chunk.offsets), value.to_local())]
    return [((0,) * value.dim(), value)]


def whole_shape(value) -> torch.Size:
    return value.size()


def nbytes(value) -> int:
    """Bytes of the pieces this rank holds of ``value``."""
    return sum(tensor.numel() * tensor.element_size() for _, tensor in pieces(value))


def _place(whole: torch.Tensor, at: tuple[int, ...], tensor: torch.Tensor) -> None:
    whole[tuple(slice(start, start + length) for start, length in zip(at, tensor.shape))] = tensor


def gather_whole(state: dict, dst: int | None = 0) -> dict:
    """The whole tensors of ``state`` (name -> tensor, DTensor or :class:`Chunked`) on CPU, on rank ``dst``
    only (every rank with None); other ranks get ``{}``. A collective of every rank.

    One tensor at a time: a rank other than ``dst`` holds at most its own pieces and a CPU copy of one, and
    each piece is sent by the lowest rank holding it (replicas send nothing).
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return {name: _whole_here(value) for name, value in sorted(state.items())}
    rank, world = dist.get_rank(), dist.get_world_size()
    held = {name: ([at for at, t in pieces(v)], tuple(whole_shape(v)), value_dtype(v)) if is_held_tensor(v) else None
            for name, v in state.items()}
    every: list = [None] * world
    dist.all_gather_object(every, held)
    sender, kinds = {}, {}
    for source in reversed(range(world)):
        for name, entry in every[source].items():
            kinds[name] = entry[1:] if entry is not None else None  # (shape, dtype), or None for a non-tensor
            for at in entry[0] if entry is not None else [()]:
                sender[name, tuple(at)] = source
    out = {}
    for name in sorted(kinds):
        mine = _pieces_to_send(state.get(name), name, sender, rank)
        if dst is None:
            parts: list | None = [None] * world
            dist.all_gather_object(parts, mine)
        else:
            parts = [None] * world if rank == dst else None
            dist.gather_object(mine, parts, dst=dst)
        if parts is not None:
            received = [piece for part in parts for piece in part]
            if kinds[name] is None:
                out[name] = received[0][1]
                continue
            out[name] = torch.empty(kinds[name][0], dtype=kinds[name][1])
            for at, tensor in received:
                _place(out[name], at, tensor)
    return out


def value_dtype(value) -> torch.dtype:
    return value.dtype if isinstance(value, torch.Tensor) else value.pieces[0][1].dtype


def _whole_here(value):
    if not is_held_tensor(value):
        return value
    whole = torch.empty(whole_shape(value), dtype=value_dtype(value))
    for at, tensor in pieces(value):
        _place(whole, at, tensor.detach().cpu())
    return whole


def _pieces_to_send(value, name: str, sender: dict, rank: int) -> list:
    if value is None:
        return []
    if not is_held_tensor(value):
        return [((), value)] if sender[name, ()] == rank else []
    return [(tuple(at), tensor.detach().cpu()) for at, tensor in pieces(value) if sender[name, tuple(at)] == rank]


def leaves(node, keys: tuple = ()) -> Iterator[tuple[tuple, object]]:
    """``(path, value)`` of every leaf of nested dicts, as DCP's flattening names them."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from leaves(value, (*keys, key))
    else:
        yield keys, node
