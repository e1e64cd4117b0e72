"""``log.profile``: torch.profiler traces of chosen steps, one per rank, and where each rank's time went.

A chosen rank records steps ``first`` to ``last`` and writes ``RUN_DIR/profile/rankR.pt.trace.json`` (Chrome's
trace format, which TensorBoard's profiler plugin also reads from that folder) and ``rankR.json``: the share of
the profiled wall time spent in communication (collectives and point-to-point: c10d, gloo, NCCL), in compute
(every other recorded operator, or kernel on a GPU) and idle (neither). It prints the shares in one line.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

from snnfw import rundir
from snnfw.config import Profile

COMMUNICATION = re.compile(r"c10d|gloo|nccl|all_?reduce|all_?gather|reduce_?scatter|broadcast|all_to_all|"
                           r"\bsend\b|\brecv\b|barrier|wait_tensor|record_param_comms", re.IGNORECASE)
STEP_MARKER = re.compile(r"^ProfilerStep#")


class StepProfiler:
    """Starts torch's profiler before step ``first`` and stops it after step ``last`` on the chosen ranks."""

    def __init__(self, setting: Profile | None, rank: int, run_dir: Path | None, cuda: bool):
        self.setting, self.rank, self.cuda = setting, rank, cuda
        self._profiler, self._started = None, 0.0
        if setting is None:
            self.active = False
            return
        self.active = setting.ranks is None or rank in setting.ranks
        self.folder = Path(run_dir) / rundir.PROFILE

    def step_start(self, step: int) -> None:
        """Before step ``step`` (counted from 1)."""
        if self.active and step == self.setting.steps[0]:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            self._profiler = profile(activities=activities)
            self._profiler.__enter__()
            self._started = time.perf_counter()

    def step_end(self, step: int) -> None:
        """After step ``step``: at the last profiled one, writes the trace and the shares."""
        if self._profiler is None or step < self.setting.steps[1]:
            return
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        wall_us = (time.perf_counter() - self._started) * 1e6
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(None, None, None)
        shares = time_shares(profiler.events(), wall_us, self.cuda)
        self.folder.mkdir(parents=True, exist_ok=True)
        trace = self.folder / f"rank{self.rank}.pt.trace.json"
        with rundir.written_whole(trace) as temp:
            profiler.export_chrome_trace(str(temp))
        first, last = self.setting.steps
        summary = {"rank": self.rank, "steps": [first, last], "wall_ms": wall_us / 1e3, **shares}
        rundir.write_text(self.folder / f"rank{self.rank}.json", json.dumps(summary, indent=2) + "\n")
        print(f"[snnfw] profile rank {self.rank}, steps {first}-{last}: compute {shares['compute']:.0%}, "
              f"communication {shares['communication']:.0%}, idle {shares['idle']:.0%}; {trace}",
              file=sys.stderr, flush=True)


def time_shares(events, wall_us: float, cuda: bool) -> dict[str, float]:
    """The shares of ``wall_us`` that the profiler's events spent communicating, computing and neither: unions of
    their intervals, so nested and overlapping operators count once (kernels on a GPU, operators on a CPU)."""
    from torch.autograd import DeviceType

    kind = DeviceType.CUDA if cuda else DeviceType.CPU
    spans = [(e.name, e.time_range.start, e.time_range.end) for e in events
             if e.device_type == kind and not STEP_MARKER.match(e.name)]
    busy = _union([(start, end) for _, start, end in spans])
    communication = _union([(start, end) for name, start, end in spans if COMMUNICATION.search(name)])
    wall = max(wall_us, busy, 1e-9)
    return {"communication": communication / wall, "compute": (busy - communication) / wall,
            "idle": (wall - busy) / wall}


def _union(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``intervals``."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total
