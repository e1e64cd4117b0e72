"""The collective probe: each collective kind timed at two sizes on this host's ranks, as ``latency + bytes /
bandwidth`` (:class:`snnfw.plan.cost_model.Link`).

Bytes are counted as the dry run counts them: an all-reduce's, broadcast's, send's tensor, an all-gather's whole
output, a reduce-scatter's and all-to-all's whole input. The probe runs on the whole world of local ranks; a mesh
dimension of fewer ranks on the same host is priced with it.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import tempfile
import time
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from snnfw.errors import UserError
from snnfw.plan.cost_model import KINDS, Cluster, Figure, Link

SIZES = (4 * 2**10, 4 * 2**20)  # bytes: one where latency dominates, one where bandwidth does
REPEATS = 5


def probe(world: int, device_type: str, timeout_s: float = 120.0) -> Cluster:
    """Times every collective kind on ``world`` local ranks (gloo on CPU, NCCL on GPUs)."""
    if world < 2:
        raise UserError("the collective probe needs 2 ranks or more; tune for --world-size 2 or more")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="snnfw-probe-") as tmp:
        out = Path(tmp) / "times.json"
        context = mp.start_processes(_rank, args=(world, port, device_type, str(out)), nprocs=world, join=False,
                                     start_method="spawn")
        deadline = time.monotonic() + timeout_s
        while not context.join(timeout=max(deadline - time.monotonic(), 0.1)):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                raise UserError(f"the collective probe did not finish within {timeout_s:.0f} s on {world} ranks; "
                                f"check that {world} processes can start here, or tune with fewer ranks")
        times = json.loads(out.read_text())
    device = torch.cuda.get_device_name() if device_type == "cuda" else "cpu"
    source = f"probe on {world} ranks of {platform.node()}, {time.strftime('%Y-%m-%d %H:%M')}"
    links = {kind: _link(times[kind], source) for kind in KINDS}
    return Cluster(device, device_type, os.cpu_count() or 1, world if device_type == "cpu" else 1, links)


def _link(seconds: list[float], source: str) -> Link:
    """The line through the two sizes' times."""
    (small, large), (t_small, t_large) = SIZES, seconds
    bandwidth = (large - small) / max(t_large - t_small, 1e-9)
    latency = max(t_small - small / bandwidth, 0.0)
    return Link(Figure(bandwidth, source), Figure(latency, source))


def _rank(rank: int, world: int, port: int, device_type: str, out: str) -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch renames the tensor collectives it times
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    try:
        times = {kind: [_time(kind, nbytes, world, rank, device) for nbytes in SIZES] for kind in KINDS}
        if rank == 0:
            Path(out).write_text(json.dumps(times))
    finally:
        dist.destroy_process_group()


def _time(kind: str, nbytes: int, world: int, rank: int, device: torch.device) -> float:
    """The median seconds of one ``kind`` of ``nbytes`` (as the dry run counts them)."""
    n = max(nbytes // 4 // world * world, world)
    whole = torch.ones(n, device=device)
    part = torch.ones(n // world, device=device)
    peer = rank ^ 1

    def once():
        if kind == "all_reduce":
            dist.all_reduce(whole)
        elif kind == "all_gather":
            dist.all_gather_single(whole, part)
        elif kind == "reduce_scatter":
            dist.reduce_scatter_single(part, whole)
        elif kind == "broadcast":
            dist.broadcast(whole, src=0)
        elif kind == "all_to_all":
            dist.all_to_all_single(torch.empty_like(whole), whole)
        elif peer < world:  # send_recv: pairs of ranks swap a tensor
            if rank % 2 == 0:
                dist.send(whole, peer)
                dist.recv(whole, peer)
            else:
                dist.recv(whole, peer)
                dist.send(whole, peer)

    once()
    times = []
    for _ in range(REPEATS):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        once()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    seconds = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return seconds.item() / (2 if kind == "send_recv" else 1)  # a swap is two transfers one after the other
