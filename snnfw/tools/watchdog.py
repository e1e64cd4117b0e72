"""The launcher's watch over its ranks, and its account of which rank ended a failed run.

Once a rank has failed, torch's elastic agent sends the others SIGTERM and waits 30 s before it kills them; a
frozen rank (stopped, or stuck outside Python) would hold the run that long after ``parallel.timeout_s``. The
watchdog gives the ranks :data:`GRACE_S` to end instead, then kills those still running, and remembers them as
the ranks that stopped answering.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

from snnfw import rundir

GRACE_S = 5.0  # how long the ranks get to end after one failed, before the watchdog kills them


class Watchdog:
    """Runs beside the elastic agent while ``with`` holds it; ``unanswering`` lists the ranks it killed."""

    def __init__(self, run_dir: Path, poll_s: float = 0.2):
        self.run_dir, self.poll_s = Path(run_dir), poll_s
        self.unanswering: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="snnfw-watchdog", daemon=True)

    def __enter__(self) -> Watchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        seen: set[tuple[Path, int]] = set()  # failure markers already handled: a restarted group writes new ones
        while not self._stop.wait(self.poll_s):
            found = (self.run_dir / rundir.RANKS).glob("rank*.failed")
            markers = {(marker, mtime) for marker in found if (mtime := _mtime(marker)) is not None}
            if not markers - seen:
                continue
            seen |= markers
            running = {rank: pid for rank, pid in rundir.local_rank_pids(self.run_dir).items() if _running_child(pid)}
            if self._stop.wait(GRACE_S):
                return
            failed = rundir.rank_failures(self.run_dir)
            for rank, pid in running.items():
                if _running_child(pid):
                    os.kill(pid, signal.SIGKILL)
                    if rank not in failed:
                        self.unanswering.append(rank)


def _mtime(path: Path) -> int | None:
    """``path``'s modification time, or None if it is gone (a restarted rank removes its earlier marker)."""
    try:
        return path.stat().st_mtime_ns
    except FileNotFoundError:
        return None


def _running_child(pid: int) -> bool:
    """Whether ``pid`` is a process this launcher started that has not ended (Linux's /proc; elsewhere, False)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return False
    return fields[0] != "Z" and int(fields[1]) == os.getpid()


def blame(failed: dict, run_dir: Path, unanswering: list[int], timeout_s: float) -> str:
    """One line on what ended a failed run: ``failed`` maps ranks to torch's ``ProcessFailure``."""
    raised = rundir.rank_failures(run_dir)
    signalled = sorted(r for r, f in failed.items() if f.exitcode < 0 and r not in raised and r not in unanswering)
    killed = [r for r in signalled if failed[r].signal_name() != "SIGTERM"]  # SIGTERM: the agent stopping the rest
    if unanswering:
        cause = (f"{_ranks(unanswering)} stopped answering (frozen, or stuck outside Python): the others waited "
                 f"parallel.timeout_s = {timeout_s:g} s for {_them(unanswering)}, then {_them(unanswering)} "
                 f"{'was' if len(unanswering) == 1 else 'were'} killed")
    elif killed:
        signals = sorted({failed[r].signal_name() for r in killed})
        cause = (f"{_ranks(killed)} {'was' if len(killed) == 1 else 'were'} killed by {', '.join(signals)}"
                 + (" (the kernel's out-of-memory killer sends SIGKILL)" if "SIGKILL" in signals else "")
                 + "; the other ranks stopped with " + _them(killed))
    elif raised:
        first = min(raised, key=lambda r: rundir.failure_marker(run_dir, r).stat().st_mtime_ns)
        cause = f"{_ranks([first])} failed first, with {raised[first]}"
    else:
        return f"training failed on ranks {sorted(failed)}; see the messages above"
    checkpoints = run_dir / rundir.CHECKPOINTS
    after = ("continue from its newest checkpoint with the same command and --resume"
             if checkpoints.is_dir() and any(checkpoints.iterdir()) else "see the messages above")
    return f"{cause}; {after}"


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def _them(ranks: list[int]) -> str:
    return "it" if len(ranks) == 1 else "them"
