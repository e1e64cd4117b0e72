"""Process group, device mesh and small collectives, each with a timeout."""

from __future__ import annotations

import contextlib
import datetime
import os
import re
from typing import Any, Callable, Iterator

import attrs
import torch
import torch.distributed as dist

from snnfw.distributed.layout import Layout
from snnfw.errors import CollectiveError, UserError


@attrs.frozen
class RankEnv:
    """This process's place in the job, as torchrun's environment variables give it."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    @classmethod
    def from_environ(cls) -> "RankEnv":
        env = os.environ
        world = int(env.get("WORLD_SIZE", "1"))
        return cls(
            rank=int(env.get("RANK", "0")),
            world_size=world,
            local_rank=int(env.get("LOCAL_RANK", "0")),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", str(world))),
        )


def set_cpu_threads(env: RankEnv) -> None:
    """Shares this node's cores out among its ranks, unless ``OMP_NUM_THREADS`` says how many to use."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // env.local_world_size))


def collective_backend(device_type: str, backend: str = "auto") -> str:
    """``parallel.backend`` resolved: NCCL on CUDA and gloo on the CPU unless gloo is asked for on CUDA, where
    ranks may then outnumber GPUs and share them (NCCL refuses two ranks on one GPU)."""
    return "nccl" if device_type == "cuda" and backend != "gloo" else "gloo"


def device_for(layout: Layout, env: RankEnv) -> torch.device:
    """The local rank's GPU (ranks beyond the GPU count share them in turn, under gloo), or the CPU."""
    if layout.device_type == "cuda":
        device = torch.device("cuda", env.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def init_world(backend: str, env: RankEnv, timeout_s: float) -> None:
    """Starts the default process group from torchrun's environment, once, on ``backend``
    (:func:`collective_backend`). NCCL tears the process down on a collective's error or timeout
    (``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``, as torchrun sets it) unless the environment says otherwise."""
    if dist.is_initialized():
        return
    nccl = backend == "nccl"
    if nccl:
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    dist.init_process_group(
        backend=backend,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=torch.device("cuda", env.local_rank) if nccl else None,
    )


def decided_once(decide: Callable[[], Any], device_type: str, env: RankEnv, timeout_s: float, backend: str = "auto") -> Any:
    """``decide()`` run on rank 0 only and its result (or the user error it raised) handed to every rank.

    Starts the default process group for it (``backend``: ``parallel.backend``), which :func:`process_group` then keeps.
    """
    init_world(collective_backend(device_type, backend), env, timeout_s)
    outcome, failure = [None], None
    if env.rank == 0:
        try:
            outcome[0] = ("ok", decide())
        except UserError as err:
            outcome[0] = ("error", err)
        except Exception as err:  # a bug's traceback stays rank 0's; the others are told, not left waiting
            outcome[0], failure = ("error", UserError(f"rank 0 failed while deciding for every rank ({type(err).__name__}: "
                                                      f"{err}); its traceback is rank 0's")), err
    gpu = torch.device("cuda", env.local_rank % torch.cuda.device_count()) if device_type == "cuda" else None
    dist.broadcast_object_list(outcome, src=0, device=gpu)
    if failure is not None:
        raise failure
    status, value = outcome[0]
    if status == "error":
        raise value
    return value


@contextlib.contextmanager
def process_group(layout: Layout, env: RankEnv, timeout_s: float) -> Iterator[object | None]:
    """Initialises the process group (unless started already) and the layout's device mesh; yields the mesh
    (None on one rank)."""
    if layout.world_size == 1:
        yield None
        return
    from torch.distributed.device_mesh import init_device_mesh

    init_world(layout.backend, env, timeout_s)
    try:
        names, sizes = zip(*layout.mesh)
        mesh = init_device_mesh(layout.device_type, tuple(sizes), mesh_dim_names=tuple(names))
        set_timeouts(timeout_s)  # the mesh's groups start with torch's default timeout, not the world's
        yield mesh
    finally:
        dist.destroy_process_group()


TIMED_OUT = re.compile(r"timed out waiting (\d+) ?ms|collective operation timeout", re.IGNORECASE)  # gloo's, NCCL's
LOST_A_RANK = re.compile(r"connection (closed|reset) by peer|broken pipe", re.IGNORECASE)


@contextlib.contextmanager
def collective_errors_in_one_line(rank: int, parallel) -> Iterator[None]:
    """Turns a collective that timed out or lost a rank, raised inside, into a :class:`CollectiveError` of one line
    naming the timeout and how to avoid it (the backend's own error is a page of C++ and Python frames)."""
    try:
        yield
    except RuntimeError as err:
        timed_out, lost = TIMED_OUT.search(str(err)), LOST_A_RANK.search(str(err))
        if not (timed_out or lost):
            raise
        if lost:
            raise CollectiveError(f"rank {rank} lost a rank it was in a collective with: that rank ended (its own "
                                  "message says why) or its connection broke") from err
        waited = int(timed_out.group(1)) / 1e3 if timed_out.group(1) else None
        key = next((name for name in ("step_timeout_s", "timeout_s") if getattr(parallel, name, None) == waited),
                   "timeout_s")
        raise CollectiveError(
            f"rank {rank} waited {f'{waited:g} s' if waited else 'its timeout'} (parallel.{key}) in a collective that "
            "another rank did not join: a rank stopped answering or is busy elsewhere, or the ranks did not make the "
            "same collectives in the same order (Session.step, evaluate, save, export and state_dict are collectives: "
            f"call them on every rank alike); raise parallel.{key} for ranks that are only slow") from err


def set_timeouts(timeout_s: float) -> None:
    """Gives every process group of this rank ``timeout_s`` for its collectives from now on (those of a backend that
    takes a timeout: gloo's and NCCL's; the dry run's fake process group has none)."""
    from torch.distributed.distributed_c10d import _rank_not_in_group, _set_pg_timeout, _world, get_backend

    for group in list(_world.pg_map):
        if not _rank_not_in_group(group) and get_backend(group) in ("gloo", "nccl", "cpu:gloo,cuda:nccl"):
            _set_pg_timeout(datetime.timedelta(seconds=timeout_s), group)


def dp_coordinate(layout: Layout, mesh) -> int:
    """This rank's data-parallel replica index, flattened over the layout's dp dimensions."""
    if mesh is None:
        return 0
    index = 0
    for name in layout.dp_dims:
        index = index * mesh.size(mesh.mesh_dim_names.index(name)) + mesh.get_local_rank(name)
    return index


def dp_group(layout: Layout, mesh):
    """The process group of this rank's data-parallel replicas (None with one replica)."""
    if mesh is None or layout.dp_size == 1:
        return None
    dims = tuple(layout.dp_dims)
    return mesh.get_group(dims[0]) if len(dims) == 1 else mesh[dims]._flatten().get_group()


def is_main() -> bool:
    """True on rank 0, and in a process without a process group: where a run prints and writes once."""
    return not dist.is_initialized() or dist.get_rank() == 0


def barrier() -> None:
    """Waits until every rank gets here (the process group's timeout applies); nothing on one process."""
    if dist.is_initialized():
        dist.barrier()


def all_reduce(values: list[float], op: str = "sum") -> list[float]:
    """Reduces a few floats over the world (identity on one rank)."""
    if not dist.is_initialized():
        return values
    tensor = torch.tensor(values, dtype=torch.float64)
    if dist.get_backend() == "nccl":
        tensor = tensor.cuda()
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return tensor.tolist()


@torch.no_grad()
def broadcast_state(module: torch.nn.Module) -> None:
    """Gives every rank rank 0's parameters and buffers (in place; no-op on one rank)."""
    if dist.is_initialized():
        for tensor in module.state_dict().values():
            dist.broadcast(tensor, src=0)
