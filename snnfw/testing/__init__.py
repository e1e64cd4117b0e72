"""Helpers for testing snnfw and its plugins: run a config on N local ranks (CPU ones unless it asks for CUDA).

Every helper that starts ranks has a timeout, so a hang fails the test instead
of stalling it.
"""

from __future__ import annotations

import contextlib
import faulthandler
import io
import multiprocessing.connection
import os
import queue
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import attrs
import torch
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from snnfw.config import Config, build_config
from snnfw.data import batches as datalib
from snnfw.run.loop import Trainer, run_training

TINY = {
    "model": {"family": "cifar10dvs_vgg", "flavor": "tiny", "time_steps": 4},
    "data": {"name": "synthetic_dvs", "batch_size": 8, "train_samples": 64, "test_samples": 16},
    "train": {"steps": 3, "lr": 0.01, "seed": 3},
}


def tiny_config(strategy="none", microbatches=1, **sections) -> Config:
    """The tiny VGG on a few synthetic DVS samples under ``strategy``, on the CPU; ``sections`` update the config's
    tables (``train={"steps": 5}``)."""
    data = {k: dict(v) for k, v in TINY.items()}
    data["parallel"] = {"strategy": strategy, "device": "cpu"}  # unless a test asks for CUDA
    data["train"]["microbatches"] = microbatches
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    if data["data"]["name"] != "synthetic_dvs":  # an on-disk set has the samples its files hold
        del data["data"]["train_samples"], data["data"]["test_samples"]
    return build_config(data)


def _named_parameters(trainer: Trainer):
    return getattr(trainer.model, "module", trainer.model).named_parameters()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this rank holds: a DTensor's local shard, else the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole of ``tensor``: a DTensor gathered from its ranks, else the tensor itself."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def local_parameters(trainer: Trainer) -> dict[str, Any]:
    """This rank's parameter tensors by name (wrapper prefixes removed; local shards of DTensors)."""
    return {name: _local(p.detach()).cpu().clone() for name, p in _named_parameters(trainer)}


def full_parameters(trainer: Trainer) -> dict[str, Any]:
    """Whole parameter tensors by name, DTensors gathered; a collective, so call it on every rank."""
    return {name: _full(p.detach()).cpu().clone() for name, p in _named_parameters(trainer)}


def state_bytes(trainer: Trainer) -> dict[str, int]:
    """Bytes of parameters and of optimizer state this rank holds, summed from local tensor sizes.

    Deterministic, unlike resident memory. The optimizer state is read from a
    wrapped local optimizer (ZeroRedundancyOptimizer's ``optim``) when there is one.
    """
    optimizer = getattr(trainer.optimizer, "optim", trainer.optimizer)

    def nbytes(tensor):
        local = _local(tensor)
        return local.numel() * local.element_size()

    return {
        "parameters": sum(nbytes(p) for p in trainer.model.parameters()),
        "optimizer": sum(nbytes(v) for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)),
    }


def tracked_peak_bytes(trainer: Trainer) -> int:
    """Peak bytes on this rank's device during the forward and backward passes of one training step.

    Counted by torch's MemTracker (parameters, gradients, optimizer state and
    activations), so deterministic, unlike resident memory. The step is
    :func:`replay_first_step`.
    """
    from snnfw.components.memory import step_tracker

    tracker = step_tracker()
    tracker.track_external(trainer.model, trainer.optimizer)
    replay_first_step(trainer, tracker)
    return tracker.get_tracker_snapshot("peak")[trainer.device]["Total"]


def replay_first_step(trainer: Trainer, context: contextlib.AbstractContextManager | None = None) -> None:
    """One more forward and backward of step 0's microbatches on this rank's replica, inside ``context`` when
    given (a tracker, a dispatch mode); its gradients are dropped and the optimizer does not step."""
    plan = trainer.plan
    chunks = datalib.microbatch_indices(0, plan, len(trainer.train_set), trainer.config.train.seed, trainer.replica)
    batches = [datalib.load(trainer.train_set, chunk, trainer.device, trainer.dtype) for chunk in chunks]
    with context or contextlib.nullcontext():
        trainer.plugins.forward_backward(trainer.model, batches, plan)
    trainer.optimizer.zero_grad(set_to_none=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Ranks fork from a server that has imported torch, snnfw, its plugins and SpikingJelly once (a
# spawned rank spends seconds importing them). A forked rank takes the caller's environment, sys.path and
# thread count from its arguments, since the server's are those of when it started; the same
# thread count keeps a rank's float reductions in the order of the caller's own runs.
PRELOAD = ["snnfw.testing.preloaded", "spikingjelly.activation_based.neuron", "spikingjelly.activation_based.layer"]


def _context():
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _worker(rank, world, port, config_dict, run_dir, env, inspect, resume, before, results, caller, stacks):
    stacks_file = open(Path(stacks) / f"rank{rank}.txt", "w")  # noqa: SIM115 (open while the rank lives)
    faulthandler.register(signal.SIGUSR1, file=stacks_file, all_threads=True)
    os.environ.clear()
    os.environ.update(caller["environ"])
    sys.path[:] = caller["path"]
    torch.set_num_threads(caller["threads"])
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS=str(caller["threads"]),
    )
    os.environ.update(env.get(rank, {}))
    try:
        if before is not None:
            before(rank)
        summary = run_training(build_config(config_dict), run_dir, on_finish=inspect, resume=resume)
        buffer = io.BytesIO()
        torch.save(summary, buffer)  # by value: shared-memory tensors would die with this process
        results.put((rank, "ok", buffer.getvalue()))
    except BaseException as err:  # reported to the parent, which raises it
        results.put((rank, "error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))


def _died(procs, reported) -> dict[int, str]:
    """The ranks whose process ended with a failure status and has not reported, with that status."""
    return {
        r: f"process died with exit code {p.exitcode} before reporting a result"
        for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in reported
    }


def _stacks_of_the_stuck(procs, stacks: Path) -> str:
    """Where each rank still running stands: every thread's Python stack, written by the rank on SIGUSR1."""
    stuck = [(r, p) for r, p in enumerate(procs) if p.is_alive()]
    started = [(r, p) for r, p in stuck if (stacks / f"rank{r}.txt").exists()]  # else SIGUSR1 would end it
    for _, p in started:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signal.SIGUSR1)
    time.sleep(1.0)

    def where(rank: int) -> str:
        try:
            return (stacks / f"rank{rank}.txt").read_text() or "(no stack written)\n"
        except OSError:
            return "(not started: it never reached the training code)\n"

    return "".join(f"\n--- rank {r}, still running ---\n{where(r)}" for r, _ in stuck)


class RankFailure(RuntimeError):
    """One or more ranks raised; the message holds each rank's error."""

    def __init__(self, errors: dict[int, str]):
        self.errors = errors
        super().__init__("\n".join(f"rank {r}: {e}" for r, e in sorted(errors.items())))


def run_on_ranks(
    config: Config,
    nproc: int,
    run_dir: str | Path | None = None,
    *,
    timeout_s: float = 180,
    env: dict[int, dict[str, str]] | None = None,
    inspect: Callable[[Trainer], Any] | None = None,
    resume: bool = False,
    before: Callable[[int], Any] | None = None,
) -> list[dict[str, Any]]:
    """Trains ``config`` on ``nproc`` spawned ranks; returns each rank's summary in rank order.

    The ranks run on the CPU unless the config asks for CUDA (``parallel.device = "cuda"``).

    ``env`` adds environment variables per rank; ``inspect(trainer)`` runs on
    every rank at the end and its result lands in ``summary["inspect"]``;
    ``resume`` continues from the newest checkpoint in ``run_dir``; ``before(rank)`` runs first in every rank
    (a test's way to change what one rank sees, such as a measurement).
    Raises :class:`RankFailure` if any rank raised or died (at once, not when the
    others time out), TimeoutError past ``timeout_s`` with the Python stacks of the ranks still running.
    """
    if config.parallel.device == "auto":
        config = attrs.evolve(config, parallel=attrs.evolve(config.parallel, device="cpu"))
    ctx = _context()
    results = ctx.Queue()
    caller = {"environ": dict(os.environ), "path": list(sys.path), "threads": torch.get_num_threads()}
    stacks = Path(tempfile.mkdtemp(prefix="snnfw-ranks-"))
    args = (nproc, _free_port(), config.to_dict(), run_dir, env or {}, inspect, resume, before, results, caller,
            str(stacks))
    procs = [ctx.Process(target=_worker, args=(rank, *args), daemon=True) for rank in range(nproc)]
    for p in procs:
        p.start()
    summaries, errors, suspects, stuck = {}, {}, {}, False
    try:
        deadline = time.monotonic() + timeout_s
        while len(summaries) + len(errors) < nproc:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                stuck = True
                raise TimeoutError(f"ranks did not finish within {timeout_s} s; finished: {sorted(summaries)}"
                                   f"{_stacks_of_the_stuck(procs, stacks)}")
            try:
                rank, status, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                # dead at two empty polls a second apart: what a rank sent before dying has arrived by then
                dead = _died(procs, summaries)
                errors.update({r: dead[r] for r in dead.keys() & suspects.keys()})
                suspects = dead
            else:
                if status == "ok":
                    summaries[rank] = torch.load(io.BytesIO(payload), weights_only=False)
                else:
                    errors[rank] = payload
            if errors:  # one rank's error is often the others' reaction to a rank that died: name that one too
                running = [p.sentinel for p in procs if p.exitcode is None]
                if running:
                    multiprocessing.connection.wait(running, timeout=1.0)
                errors = {**_died(procs, summaries), **errors}
                break
    finally:
        for p in procs:
            p.join(timeout=0 if errors or stuck else 30)
            if p.is_alive():
                p.kill()
        shutil.rmtree(stacks, ignore_errors=True)
    if errors:
        raise RankFailure(errors)
    return [summaries[r] for r in range(nproc)]
