"""Everything a run directory holds, by name: what the worker, the launcher and the tools agree on.

A run directory holds the results of one run (the files below), the
``.ranks`` folder of markers through which the ranks tell the launcher how
they ended, and the lock of the run that owns it. Every file is written whole
or not at all (:func:`written_whole`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path
from typing import Iterator

from snnfw.errors import CheckpointError, ConfigError

METRICS = "metrics.jsonl"  # one JSON object per optimizer step
SUMMARY = "summary.json"  # the run's outcome, written by rank 0 at the end
EVAL = "eval.json"  # the score of ``snnfw eval``
FINAL_MODEL = "final_model.pt"  # the trained model, whole
BEST_MODEL = "best_model.pt"  # the same, at the validation with the highest eval_acc
DIGEST = ".sha256"  # beside a weights file: its SHA-256 and name, as sha256sum writes them (``final_model.pt.sha256``)
TENSORBOARD = "tensorboard"  # the folder of TensorBoard event files (``log.tensorboard``)
CHECKPOINTS = "checkpoints"  # the folder of ``step-N`` checkpoints
STEP = "step-"  # in CHECKPOINTS: the folder ``step-N`` holds the checkpoint after step N
STEP_META = "meta.json"  # in a checkpoint: its step, loss and settings, written last (a checkpoint without it is cut)
PROFILE = "profile"  # the folder of ``log.profile``'s traces and shares, per rank
MEMORY = "memory"  # the folder of ``log.memory_snapshot``'s records, per rank
PLAN = "plan.json"  # the plan ``snnfw train`` made, which its ranks run (written at each launch, not a result)
EVAL_PLAN = "eval_plan.json"  # the same of ``snnfw eval`` and ``snnfw predict``
RUN_FILES = (METRICS, SUMMARY, FINAL_MODEL, FINAL_MODEL + DIGEST, BEST_MODEL, BEST_MODEL + DIGEST, TENSORBOARD,
             CHECKPOINTS, PROFILE, MEMORY)  # a run's files

ERROR_LOG = "error.log"  # the traceback of an error in the user's own code that ended a rank
RANKS = ".ranks"  # the ranks' markers for the launcher
STOPPED = "stopped"  # in RANKS: the user error that stopped a rank, one line
PREEMPTED = "preempted"  # in RANKS: where a signal of checkpoint.save_on_signals stopped the run (JSON)
LAUNCHED = "SNNFW_LAUNCHED"  # environment: set by ``snnfw train``, which reports a rank's user error itself, once
DEBUG = "SNNFW_DEBUG"  # environment: set by ``snnfw --debug train``: ranks show tracebacks on screen too


def checkpoint_step(path: Path) -> int:
    """N, of the checkpoint folder ``step-N``."""
    return int(Path(path).name[len(STEP):])


def is_checkpoint_name(name: str) -> bool:
    """Whether ``name`` is a checkpoint folder's, ``step-N``."""
    return name.startswith(STEP) and name[len(STEP):].isdigit()


def numbered_checkpoints(root: Path) -> list[Path]:
    """Every ``step-N`` in ``root``, with its ``meta.json`` or not, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if is_checkpoint_name(p.name)), key=checkpoint_step)


def complete_checkpoints(root: Path) -> list[Path]:
    """The renamed (so whole) checkpoints ``step-N`` in ``root``, oldest first."""
    return [p for p in numbered_checkpoints(root) if (p / STEP_META).is_file()]


def earlier_checkpoints(root: Path, newest: Path) -> CheckpointError:
    """The refusal to start afresh over the checkpoints of an earlier run, the newest being ``newest``."""
    return CheckpointError(
        f"{root} holds checkpoints up to step {checkpoint_step(newest)} of an earlier run; "
        "pass --resume to continue it, --overwrite to replace it, or choose another --run-dir"
    )


def check_run_dir(run_dir: Path, resume: bool, overwrite: bool) -> None:
    """Refuses to resume where there is no checkpoint, and to start over an earlier run unless ``overwrite``."""
    done = complete_checkpoints(run_dir / CHECKPOINTS)
    if resume:
        steps = numbered_checkpoints(run_dir / CHECKPOINTS)
        if not done and steps:
            raise CheckpointError(f"{steps[-1] / STEP_META} is missing, so {steps[-1]} is not a whole checkpoint, and "
                                  f"{run_dir / CHECKPOINTS} holds no other; restore it from a copy, or start over "
                                  "with --overwrite")
        if not done:
            raise CheckpointError(f"--resume continues from a checkpoint, and {run_dir / CHECKPOINTS} holds none; "
                                  "start without --resume (or with --overwrite over an earlier run)")
        return
    if overwrite:
        return
    if done:
        raise earlier_checkpoints(run_dir / CHECKPOINTS, done[-1])
    if (run_dir / METRICS).exists():
        raise CheckpointError(f"{run_dir} holds an earlier run (metrics.jsonl); pass --overwrite to replace it, "
                              "or choose another --run-dir")


def check_checkpoints_writable(run_dir: Path, every: int) -> None:
    """Refuses, in one line, a checkpoints folder that checkpoints (one ``every`` steps) could not be written into;
    makes it where it is not there yet."""
    folder = run_dir / CHECKPOINTS
    try:
        folder.mkdir(parents=True, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=folder))
    except OSError as err:
        why = "is a file, not a folder" if folder.is_file() else f"cannot be written ({err.strerror or err})"
        raise CheckpointError(f"checkpoint.every = {every} writes checkpoints into {folder}, which {why}; make it a "
                              "folder you can write, or choose another --run-dir") from None


def clear_run_dir(run_dir: Path) -> None:
    """Removes an earlier run's files (``--overwrite``); other files stay."""
    for name in RUN_FILES:
        remove_whole(run_dir / name)


def read_metrics(path: Path, note: bool = True) -> list[dict]:
    """The records of a ``metrics.jsonl``; a last line cut off when its run stopped is dropped (with a note unless
    ``note`` is false), any other line that is not a JSON record refused."""
    lines = [line for line in Path(path).read_text(errors="replace").splitlines() if line.strip()]
    records = []
    for number, line in enumerate(lines, start=1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines):
                if note:
                        print(f"[snnfw] note: the last line of {path} was cut off when its run stopped; it is left out",
                          file=sys.stderr, flush=True)
                break
            raise CheckpointError(f"{path} line {number} is not a JSON record; restore the file, or start the run "
                                  "over with --overwrite") from None
    return records


def done_marker(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / RANKS / f"rank{rank}.done"


def mark_done(run_dir: Path, rank: int) -> None:
    """Records that this rank passed the run's last barrier (every rank's work is complete), so an abort at exit
    is told apart."""
    (Path(run_dir) / RANKS).mkdir(parents=True, exist_ok=True)
    done_marker(run_dir, rank).touch()


def any_done(run_dir: Path) -> bool:
    return any((Path(run_dir) / RANKS).glob("rank*.done"))


def mark_stopped(run_dir: Path, message: str) -> None:
    """Records the user error that stopped this rank; written whole, since every rank may write it."""
    write_text(stopped_marker(run_dir), f"{message}\n")


def first_to_say(run_dir: Path, since: float, line: str) -> bool:
    """Whether this rank is the first since ``since`` (a ``time.time()``) to stop on the user error ``line``: the
    ranks of a plain torchrun that stop on the same error print it once (an error of one rank alone is still
    printed by that rank). Ranks on hosts that do not share the run directory each count as first."""
    said = Path(run_dir) / RANKS / f"said-{hashlib.sha1(line.encode()).hexdigest()[:16]}"
    said.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(said, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        if said.stat().st_mtime >= since:
            return False
        said.touch()  # an earlier run's
        return True
    except OSError:  # a run directory this rank cannot write: say it
        return True


def stopped_marker(run_dir: Path) -> Path:
    return Path(run_dir) / RANKS / STOPPED


def stopped_since(run_dir: Path, since: float) -> bool:
    """Whether a rank stopped on a user error after ``since`` (a ``time.time()``)."""
    try:
        return stopped_marker(run_dir).stat().st_mtime >= since
    except FileNotFoundError:
        return False


def preempted_marker(run_dir: Path) -> Path:
    return Path(run_dir) / RANKS / PREEMPTED


def mark_preempted(run_dir: Path, step: int, checkpoint: Path, signal_name: str, signalled_at: float) -> None:
    """Records that a signal stopped the run after ``step`` with ``checkpoint`` written (``signalled_at``: the
    signal's ``time.time()``), for the launcher's last line."""
    write_text(preempted_marker(run_dir), json.dumps({"step": step, "checkpoint": str(checkpoint), "signal": signal_name,
                                                      "signalled_at": signalled_at}) + "\n")


def preempted(run_dir: Path) -> dict | None:
    """What :func:`mark_preempted` recorded, None if the run was not preempted."""
    try:
        return json.loads(preempted_marker(run_dir).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def mark_started(run_dir: Path, rank: int) -> None:
    """Records this rank's process (host and pid), so its launcher can stop it if it stops answering."""
    write_text(Path(run_dir) / RANKS / f"rank{rank}.pid", f"{socket.gethostname()} {os.getpid()}\n")


def local_rank_pids(run_dir: Path) -> dict[int, int]:
    """The started ranks' processes on this host: {rank: pid}."""
    pids = {}
    for marker in (Path(run_dir) / RANKS).glob("rank*.pid"):
        with contextlib.suppress(OSError, ValueError):
            host, pid = marker.read_text().split()
            if host == socket.gethostname():
                pids[int(marker.name[4:-4])] = int(pid)
    return pids


def failure_marker(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / RANKS / f"rank{rank}.failed"


def mark_failed(run_dir: Path, rank: int, message: str) -> None:
    """Records the error that ended this rank, one line, for the launcher's report."""
    write_text(failure_marker(run_dir, rank), " ".join(message.split()) + "\n")


def rank_failures(run_dir: Path) -> dict[int, str]:
    """The errors that ended ranks: {rank: one line} (a marker that a restarted rank removes meanwhile is left out)."""
    failures = {}
    for marker in sorted((Path(run_dir) / RANKS).glob("rank*.failed")):
        with contextlib.suppress(FileNotFoundError):
            failures[int(marker.name[4:-7])] = marker.read_text().strip()
    return failures


def clear_markers(run_dir: Path) -> None:
    """Removes an earlier launch's markers and error log."""
    (Path(run_dir) / ERROR_LOG).unlink(missing_ok=True)
    folder = Path(run_dir) / RANKS
    if folder.exists():
        for marker in folder.iterdir():
            marker.unlink()


# One rule for every file a run writes: a temporary name in the same folder (readers skip names that start with
# TEMP_PREFIX), flushed to disk, then renamed over the final name, so a file is whole or absent, never cut.
TEMP_PREFIX = ".tmp-"
LOCK = ".lock"  # held by the run that owns the directory: the launcher of node 0, or rank 0 under plain torchrun


@contextlib.contextmanager
def written_whole(path: Path) -> Iterator[Path]:
    """A temporary path beside ``path`` to write to; once the block ends, it is synced and renamed to ``path``
    (on an exception, removed)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f"{TEMP_PREFIX}{path.name}.{os.getpid()}")
    try:
        yield temp
        with open(temp, "rb+") as written:
            os.fsync(written.fileno())
        os.replace(temp, path)
        with contextlib.suppress(OSError):  # the rename itself, where the file system syncs folders at all
            folder = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(folder)
            finally:
                os.close(folder)
    finally:
        temp.unlink(missing_ok=True)


def check_writable(path: Path, flag: str) -> None:
    """Refuses ``path`` (given as ``flag``) as a file to write before any work is done: a folder, a place under a
    file, or a folder that cannot be written."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{flag} {path} is a folder; name the file to write in it")
    probe = path.with_name(f"{TEMP_PREFIX}probe-{path.name}.{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        probe.touch()
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"{flag} {path} cannot be written ({err.strerror}); name a file in a folder you can "
                          "write") from None


def remove_whole(path: Path) -> None:
    """Removes the folder or file ``path`` so that it is whole or absent: renamed to a temporary name first (an
    atomic step that readers then skip), then deleted; a kill during the deletion leaves only temporary files."""
    path = Path(path)
    if not path.exists():
        return
    doomed = path.with_name(f"{TEMP_PREFIX}removed-{path.name}.{os.getpid()}")
    os.replace(path, doomed)
    if doomed.is_dir():
        shutil.rmtree(doomed)
    else:
        doomed.unlink()


def write_text(path: Path, text: str) -> None:
    """Writes ``text`` to ``path`` whole (:func:`written_whole`)."""
    with written_whole(path) as temp:
        temp.write_text(text)


@contextlib.contextmanager
def locked(run_dir: Path) -> Iterator[None]:
    """Holds the run directory's advisory lock while the block runs.

    A second run into the same directory is refused in one line naming the owner; the lock of an owner that died
    (the kernel lets go of a dead process's lock) is taken over with a note.
    """
    run_dir = Path(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        what = "is a file, not a folder" if run_dir.is_file() else f"cannot be written ({err.strerror})"
        raise CheckpointError(f"--run-dir {run_dir} {what}; choose a folder you can write") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = os.pread(fd, 256, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise CheckpointError(
            f"{run_dir} belongs to a run in progress ({owner}); wait for it to end, or choose another --run-dir"
        ) from None
    if stale := os.pread(fd, 256, 0).decode(errors="replace").strip():
        print(f"[snnfw] note: {run_dir} was locked by {stale}, which is no longer running; this run takes it over",
              file=sys.stderr, flush=True)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    try:
        yield
    finally:
        os.ftruncate(fd, 0)
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
