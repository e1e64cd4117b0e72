"""Saving on the cluster's signal: a preempted job writes a checkpoint within its grace period and says so.

SLURM sends SIGTERM at preemption (and the signal ``--signal`` names before the time limit); Kubernetes sends
SIGTERM before it kills a pod. Each signal in ``checkpoint.save_on_signals`` asks the run to stop: every rank
finishes its step, the ranks agree on the step to stop after (:class:`StopAgreement`), write the usual sharded
checkpoint (data position and run state, as ``--resume`` needs) and end with :data:`PREEMPTED_EXIT`; where SLURM
runs the job, rank 0 requeues it (``scontrol requeue``). A second signal, or ``checkpoint.grace_s`` running out,
ends the rank at once: a checkpoint is renamed into place only once whole, so the previous one stays the newest.
"""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

PREEMPTED_EXIT = 75  # sysexits' EX_TEMPFAIL: stopped and saved, to be continued with --resume
# SLURM signals every process of the job and the launcher forwards the signal too: a repeat this soon is the same one
REPEAT_S = 1.0


class Preempted(Exception):
    """Raised out of the training loop once the checkpoint of ``step`` is written, on every rank."""

    def __init__(self, step: int, checkpoint: Path, signal_name: str, signalled_at: float):
        super().__init__(f"preempted at step {step} by {signal_name}: checkpoint {checkpoint}")
        self.step, self.checkpoint, self.signal_name, self.signalled_at = step, checkpoint, signal_name, signalled_at

    def line(self) -> str:
        """The run's last line: where it stopped, how long after the signal, and how to go on."""
        return (f"preempted at step {self.step} by {self.signal_name}, {time.time() - self.signalled_at:.1f} s after "
                f"the signal: checkpoint {self.checkpoint}; continue with the same command and --resume")


class Signals:
    """The signals of ``checkpoint.save_on_signals``, caught on this rank while ``with`` holds it.

    The first asks the run to stop (:attr:`received`); a second, at least :data:`REPEAT_S` later, or ``grace_s``
    after the first, ends the process at once with status 128 + the signal's number.
    """

    def __init__(self, names: tuple[str, ...], grace_s: float, rank: int = 0):
        self.numbers = [signal.Signals[name] for name in names]
        self.grace_s, self.rank = grace_s, rank
        self.received: signal.Signals | None = None
        self.received_at = 0.0  # time.time() of the first signal
        self._first = 0.0  # its time.monotonic()
        self._before: dict = {}

    def __enter__(self) -> Signals:
        self._before = {number: signal.signal(number, self._caught) for number in self.numbers}
        return self

    def __exit__(self, *exc) -> None:
        for number, handler in self._before.items():
            signal.signal(number, handler)

    def _caught(self, number: int, frame) -> None:
        if self.received is None:
            self.received, self.received_at, self._first = signal.Signals(number), time.time(), time.monotonic()
            ran_out = f"checkpoint.grace_s = {self.grace_s:g} s ran out"
            timer = threading.Timer(self.grace_s, self._end, (number, ran_out))
            timer.daemon = True
            timer.start()
        elif time.monotonic() - self._first >= REPEAT_S:
            self._end(number, f"{signal.Signals(number).name} came again")

    def _end(self, number: int, why: str) -> None:
        """Ends this rank at once; a checkpoint it was writing stays under its temporary name, which no reader takes."""
        if self.rank == 0:
            print(f"[snnfw] {why} {time.monotonic() - self._first:.1f} s after {self.received.name}: ended at once "
                  "without the checkpoint being written; the newest whole checkpoint, if any, is kept",
                  file=sys.stderr, flush=True)
        os._exit(128 + number)


class StopAgreement:
    """Whether every rank stops after this step: the signal each rank received (its number, 0 for none) is reduced
    (max) over the ranks after each step on a gloo group of its own, and read after the next step, by then long
    arrived, so that no step waits for it; every rank reads the same round after the same step, so all stop after
    the same step, one or two steps after the signal."""

    def __init__(self, signals: Signals, timeout_s: float):
        self.signals, self.timeout_s = signals, timeout_s
        self._group = None
        self._round = None  # the reduction in flight: (its tensor, its work)

    def after_step(self) -> signal.Signals | None:
        """Called by every rank after each step: the signal to stop on now, None to go on (a collective)."""
        import torch
        import torch.distributed as dist

        mine = int(self.signals.received or 0)
        if not dist.is_initialized():
            return self.signals.received
        agreed = 0
        if self._round is not None:
            flag, work = self._round
            work.wait()
            agreed = int(flag.item())
        if agreed:
            self._round = None
            return signal.Signals(agreed)
        if self._group is None:
            self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.timeout_s))
        flag = torch.tensor([mine], dtype=torch.int32)
        self._round = flag, dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        return None

    def stopped(self, step: int, checkpoint: Path, agreed: signal.Signals) -> Preempted:
        """What ends the run once the checkpoint of ``step`` is written: a signal this rank may not have had itself."""
        received = self.signals.received
        return Preempted(step, checkpoint, agreed.name, self.signals.received_at if received else time.time())

    def finish(self) -> None:
        """Waits for the round in flight, before the process group goes."""
        if self._round is not None:
            self._round[1].wait()
            self._round = None


def requeue() -> str | None:
    """Requeues the SLURM job this process runs in (``scontrol requeue $SLURM_JOB_ID``, as Lightning does); returns
    a line saying what happened, None outside SLURM."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return None
    try:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=10)
    except FileNotFoundError:
        return f"note: SLURM_JOB_ID is {job} and scontrol is not on PATH, so the job was not requeued; submit it again"
    except subprocess.TimeoutExpired:
        return f"note: scontrol requeue {job} did not answer within 10 s; the job may not be requeued"
    if done.returncode != 0:
        said = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return f"note: scontrol requeue {job} failed ({said}); submit the job again"
    return f"requeued SLURM job {job}"
