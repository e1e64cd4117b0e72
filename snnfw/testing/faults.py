"""Faults on purpose, for testing restarts and timeouts: a plugin that a test loads with
``SNNFW_PLUGINS=snnfw.testing.faults``, and environment variables that say which fault.

- ``SNNFW_TEST_CRASH_AT_STEP=k``: before step k, rank ``SNNFW_TEST_FAULT_RANK``
  (default 1) exits with status 1, on the launcher's first attempt only
  (``TORCHELASTIC_RESTART_COUNT`` unset or 0).
- ``SNNFW_TEST_START_TOGETHER=DIR:N``: before its first step, every rank waits (``TOGETHER_TIMEOUT_S`` at most)
  until N processes given the same DIR have reached theirs: replica groups under ``parallel.fault_tolerance``, whose
  processes start in their own time, then all take part in the first quorum.
- ``SNNFW_TEST_HANG_AT_STEP=k``: before step k, that rank stops answering.
- ``SNNFW_TEST_RAISE_AT_STEP=k``: before step k, that rank raises RuntimeError from its hook.
- ``SNNFW_TEST_EXIT_AT_END=N``: after marking itself done, that rank exits
  with status N, or aborts (SIGABRT) with ``abort``; first attempt only.
- ``SNNFW_TEST_SLOW_STEPS=s``: every rank waits s seconds before each step, so that a run lasts while a test
  acts on it.
- ``SNNFW_TEST_SLOW_RESULTS=s``: rank 0 waits s seconds before writing the
  run's results, so the other ranks finish first.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from snnfw import hookimpl

TOGETHER_TIMEOUT_S = 240
_started = False  # this process has begun a step


def _first_attempt() -> bool:
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


def _start_together(value: str) -> None:
    folder, count = value.rsplit(":", 1)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / str(os.getpid())).touch()
    deadline = time.monotonic() + TOGETHER_TIMEOUT_S
    while len(list(folder.iterdir())) < int(count):
        if time.monotonic() > deadline:
            raise RuntimeError(f"test fault: {count} processes did not all reach their first step within "
                               f"{TOGETHER_TIMEOUT_S} s ({folder})")
        time.sleep(0.05)


@hookimpl
def snnfw_step_start(step: int, rank: int) -> None:
    global _started
    env = os.environ
    if not _started and "SNNFW_TEST_START_TOGETHER" in env:
        _start_together(env["SNNFW_TEST_START_TOGETHER"])
    _started = True
    if "SNNFW_TEST_SLOW_STEPS" in env:
        time.sleep(float(env["SNNFW_TEST_SLOW_STEPS"]))
    if rank != int(env.get("SNNFW_TEST_FAULT_RANK", "1")):
        return
    if env.get("SNNFW_TEST_CRASH_AT_STEP") == str(step) and _first_attempt():
        print(f"[snnfw] test fault: rank {rank} exits before step {step}", file=sys.stderr, flush=True)
        os._exit(1)
    if env.get("SNNFW_TEST_RAISE_AT_STEP") == str(step):
        raise RuntimeError(f"test fault: rank {rank} raises before step {step}")
    if env.get("SNNFW_TEST_HANG_AT_STEP") == str(step):
        print(f"[snnfw] test fault: rank {rank} stops answering before step {step}", file=sys.stderr, flush=True)
        time.sleep(3600)


@hookimpl
def snnfw_rank_done(rank: int) -> None:
    how = os.environ.get("SNNFW_TEST_EXIT_AT_END")
    if how is None or rank != int(os.environ.get("SNNFW_TEST_FAULT_RANK", "1")) or not _first_attempt():
        return
    if how == "abort":
        print(f"[snnfw] test fault: rank {rank} aborts after its work", file=sys.stderr, flush=True)
        os.abort()
    print(f"[snnfw] test fault: rank {rank} exits with status {how} after its work", file=sys.stderr, flush=True)
    os._exit(int(how))


@hookimpl
def snnfw_results_due(rank: int) -> None:
    if rank == 0 and "SNNFW_TEST_SLOW_RESULTS" in os.environ:
        time.sleep(float(os.environ["SNNFW_TEST_SLOW_RESULTS"]))
