"""``parallel.fault_tolerance``: each replica group of ``dp_replicate`` a torchft replica (docs/fault_tolerance.md).

A replica group is one process, started on its own (``python -m snnfw.train`` or a torchrun of one rank) beside a
torchft lighthouse. Its gradients are averaged with the other groups' through torchft's manager; a group that dies
drops out of the quorum while the others go on, and a group that starts late or again takes a live peer's state
(model, optimizer, schedule and step) at its first quorum.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlsplit

import torch

from snnfw.errors import CollectiveError, ConfigError

INSTALL = "pip install 'snnfw[ft]' (torchft 0.2.0, with --no-deps beside an installed torch)"
LIGHTHOUSE_ENV, GROUP_ENV = "TORCHFT_LIGHTHOUSE", "REPLICA_GROUP_ID"


def groups(config) -> int:
    """How many replica groups ``config`` asks for (its ``parallel.mesh``'s ranks), after refusing in one line, before
    any process group, what fault tolerance cannot run with."""
    key = "parallel.fault_tolerance"
    if importlib.util.find_spec("torchft") is None:
        raise ConfigError(f"{key} needs the torchft package, which is not installed; run {INSTALL}, or remove {key}")
    mesh = dict(config.parallel.mesh or ())
    if not mesh.get("dp_replicate", 0) >= 2:
        raise ConfigError(f"{key} makes each index of the dp_replicate dimension a replica group, and parallel.mesh "
                          f"has {'no dp_replicate' if 'dp_replicate' not in mesh else 'one'}; set parallel.mesh = "
                          "{dp_replicate = R} with R >= 2 replica groups")
    if others := [name for name in mesh if name != "dp_replicate"]:
        lost = "their peers cannot be lost" if {"tp", "pp", "time"} & set(others) else "one rank a group is supported"
        raise ConfigError(f"{key} runs replica groups of one rank over dp_replicate, and parallel.mesh also has "
                          f"{', '.join(others)} ({lost}); set parallel.mesh = {{dp_replicate = R}}")
    if int(os.environ.get("WORLD_SIZE", "1")) != 1:
        raise ConfigError(f"{key}: a replica group is one process, and this job has WORLD_SIZE = "
                          f"{os.environ['WORLD_SIZE']}; launch each group alone (torchrun --nproc_per_node=1 or "
                          "python -m snnfw.train)")
    if getattr(config.parallel, "zero", False):
        raise ConfigError(f"{key} keeps the whole optimizer state in every group, to heal a group from it; "
                          "remove parallel.zero")
    if config.checkpoint.every:
        raise ConfigError(f"{key} heals a group from a live peer, and checkpoints under it are not supported yet; "
                          "set checkpoint.every = 0")
    if "checkpoint.save_on_signals" in config.explicit and config.checkpoint.save_on_signals:
        raise ConfigError(f"{key} keeps no checkpoints, so a signal cannot save one (a group that stops rejoins from "
                          "a live peer); remove checkpoint.save_on_signals")
    if config.train.precision == "fp16":
        raise ConfigError(f"{key} does not carry fp16's loss scale between groups; use train.precision = \"bf16\"")
    replicas = mesh["dp_replicate"]
    group = replica_group(config.parallel.fault_tolerance)
    if group >= replicas:
        raise ConfigError(f"{key}: replica group {group} is not one of the mesh's {replicas} (0 to {replicas - 1})")
    address = lighthouse(config.parallel.fault_tolerance)
    if config.parallel.fault_tolerance.start_lighthouse:
        local_port(address)
    return replicas


def replica_group(ft) -> int:
    if ft.replica_group is not None:
        return ft.replica_group
    value = os.environ.get(GROUP_ENV, "")
    if not value.isdigit():
        raise ConfigError(f"parallel.fault_tolerance needs this process's replica group: set its replica_group, or "
                          f"{GROUP_ENV} to 0, 1, ... (got {value!r})")
    return int(value)


def lighthouse(ft) -> str:
    address = ft.lighthouse or os.environ.get(LIGHTHOUSE_ENV, "")
    if not address:
        raise ConfigError(f"parallel.fault_tolerance needs the lighthouse's address: set its lighthouse, or "
                          f"{LIGHTHOUSE_ENV}, to the address torchft_lighthouse prints (http://host:port)")
    return address


def _answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def local_port(address: str) -> tuple[str, int]:
    """The host and port of ``address`` where ``start_lighthouse`` may start a lighthouse: a port of this host."""
    parts = urlsplit(address)
    host, port = parts.hostname or "", parts.port
    if port is None or host not in {"localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn()}:
        raise ConfigError(f"parallel.fault_tolerance.start_lighthouse starts the lighthouse on this host, at the port "
                          f"its address names, and {address!r} is not such an address; give http://"
                          f"{socket.gethostname()}:PORT, or start torchft_lighthouse on its host yourself")
    return host, port


def start_lighthouse(address: str, min_replicas: int, timeout_s: float) -> None:
    """Starts torchft's lighthouse at ``address`` (a port of this host) where none answers there, as a process of its
    own that outlives the groups, and waits until it answers. Of the groups of one host that start it together, the
    first to take a file lock starts it; the others find it answering."""
    host, port = local_port(address)
    with open(Path(tempfile.gettempdir()) / f"snnfw-lighthouse-{port}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one group of this host starts it, the others find it answering
        if not _answers(host, port):
            _spawn_lighthouse(address, host, port, min_replicas, timeout_s)


def _spawn_lighthouse(address: str, host: str, port: int, min_replicas: int, timeout_s: float) -> None:
    binary = Path(sys.executable).parent / "torchft_lighthouse"
    binary = str(binary) if binary.exists() else shutil.which("torchft_lighthouse")
    if binary is None:
        raise ConfigError(f"parallel.fault_tolerance.start_lighthouse needs torchft's torchft_lighthouse command, which "
                          f"is not beside {sys.executable} nor on PATH; run {INSTALL}")
    process = subprocess.Popen([binary, "--min_replicas", str(min_replicas), "--bind", f"[::]:{port}"],
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)  # not ended by a signal to this group's process group
    deadline = time.monotonic() + timeout_s
    while not _answers(host, port):
        if time.monotonic() > deadline:
            ended = ", which ended" if process.poll() is not None else ""
            raise CollectiveError(f"no lighthouse answers at {address} within {timeout_s:g} s (parallel.fault_tolerance"
                                  f".timeout_s), though torchft_lighthouse was started there (pid {process.pid}{ended})")
        time.sleep(0.1)
    print(f"[snnfw] started torchft's lighthouse at {address} (pid {process.pid}); it outlives the replica groups: "
          f"stop it with kill {process.pid} once they are done", file=sys.stderr, flush=True)


def check_model(model: torch.nn.Module) -> None:
    """Refuses a model whose BatchNorm running statistics the groups would have to merge (snnfw merges them over a
    process group; torchft gives none)."""
    norms = [name for name, m in model.named_modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if norms:
        raise ConfigError(f"parallel.fault_tolerance cannot merge BatchNorm running statistics across replica groups, "
                          f"and the model has {len(norms)} BatchNorm layers ({norms[0]}, ...); use a model without "
                          "BatchNorm, or train without fault tolerance")


MAX_RETRIES = 10  # a step trained again this many times without committing ends the group (never a loop forever)


class ReplicaGroup:
    """This process's torchft replica: the manager, the model wrapped in torchft's DistributedDataParallel, and the
    state a rejoining group takes from a live peer."""

    def __init__(self, config):
        ft = config.parallel.fault_tolerance
        self.index = replica_group(ft)
        self.address, self.timeout = lighthouse(ft), timedelta(seconds=ft.timeout_s)
        self.min_replicas, self.starts_lighthouse = ft.min_replicas, ft.start_lighthouse
        self.manager, self.committed = None, True

    def wrap(self, model: torch.nn.Module, state, load) -> torch.nn.Module:
        """``model`` with its gradients averaged over the groups present; ``state()`` and ``load(state)`` give and
        take what a rejoining group needs."""
        from torch.distributed import TCPStore
        from torch.nn.parallel import DistributedDataParallel
        from torchft import Manager, ProcessGroupGloo
        from torchft.process_group import ProcessGroupDummy

        if self.starts_lighthouse:
            start_lighthouse(self.address, self.min_replicas, self.timeout.total_seconds())
        self.store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the group's own; kept alive
        try:
            self.manager = Manager(
                pg=ProcessGroupGloo(timeout=self.timeout), load_state_dict=load, state_dict=state,
                min_replica_size=self.min_replicas, use_async_quorum=False, init_sync=False, timeout=self.timeout,
                quorum_timeout=self.timeout, connect_timeout=self.timeout, rank=0, world_size=1, max_retries=MAX_RETRIES,
                store_addr="127.0.0.1", store_port=self.store.port, lighthouse_addr=self.address,
                replica_id=f"snnfw_{self.index}", hostname=socket.gethostname())
        except RuntimeError as err:
            if "failed to connect" not in str(err):
                raise
            raise CollectiveError(f"replica group {self.index} reached no lighthouse at {self.address} within "
                                  f"{self.timeout.total_seconds():g} s (parallel.fault_tolerance.timeout_s); start "
                                  "torchft_lighthouse there, or give parallel.fault_tolerance.lighthouse its address") from None
        # torchft's DistributedDataParallel with a hook that survives a peer lost in the all-reduce, where torchft
        # 0.2.0's fails an assertion or waits forever
        replicated = DistributedDataParallel(model, process_group=ProcessGroupDummy(0, 1), find_unused_parameters=True)
        replicated.register_comm_hook(self.manager, _averaged_over_groups)
        return replicated

    def begin(self, step: int) -> int:
        """Joins the step's quorum (a group behind its peers loads a live peer's state here); returns the step the
        groups train, the peers' where this group was behind."""
        try:
            self.manager.start_quorum()
        except TimeoutError:
            fix = ("start the other groups, or lower min_replicas (and the lighthouse's --min_replicas)"
                   if self.min_replicas > 1 else "check that the lighthouse still runs there, and that this group's "
                   "process was not stopped (its standard error must be read: a full pipe stops it)")
            raise CollectiveError(f"replica group {self.index} found no quorum of parallel.fault_tolerance.min_replicas = "
                                  f"{self.min_replicas} groups at {self.address} within "
                                  f"{self.timeout.total_seconds():g} s (its timeout_s); {fix}") from None
        return self.manager.current_step() if self.manager.current_step() > step else step

    def commit(self) -> bool:
        """Whether the groups of the quorum all finished the step (else it is trained again, at most
        :data:`MAX_RETRIES` times in a row)."""
        try:
            self.committed = self.manager.should_commit()
        except RuntimeError as err:
            if "exceeding max_retries" not in str(err):
                raise
            raise CollectiveError(f"replica group {self.index} trained a step {MAX_RETRIES + 1} times in a row and no "
                                  "quorum committed it (a group was lost or failed each time); see the groups' logs, "
                                  "and start this group again to rejoin from a live peer") from None
        return self.committed

    def participants(self) -> int:
        return self.manager.num_participants()

    def close(self) -> None:
        if self.manager is not None:
            self.manager.shutdown(wait=False)


def _averaged_over_groups(manager, bucket):
    """A gradient bucket averaged over the groups of the step's quorum. Where a peer was lost in the all-reduce, the
    manager has recorded the error (the step will not commit) and the bucket is handed back as it is: the future of
    a failed all-reduce never completes, and DistributedDataParallel would wait on it."""
    work = manager.allreduce(bucket.buffer())
    work.wait()
    if manager.errored() is not None:
        handed_back = torch.futures.Future()
        handed_back.set_result(bucket.buffer())
        return handed_back
    return work.get_future()._fut  # the average's own future, inside the manager's wrapper
