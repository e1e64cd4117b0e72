"""``log.memory_snapshot = N``: what each rank's memory held in step N.

On a GPU, torch's CUDA memory history of the step, ``RUN_DIR/memory/rankR.pickle`` (drag it into
https://pytorch.org/memory_viz). On a CPU, torch's MemTracker counts the step's tensors by kind (parameters,
buffers, gradients, activations, temporaries, optimizer state) and by module, ``RUN_DIR/memory/rankR.json``.
Either way the rank prints its peak in one line.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

from snnfw import rundir

MB = 2**20


def step_tracker():
    """torch's MemTracker, made to forget a module's stats when a new forward calls it again (microbatches and
    time steps repeat calls, which the tracker refuses by default)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class StepTracker(MemTracker):
        def _pre_fw_hook(self, module, inputs):
            if not self._mod_tracker.is_bw:
                self.memory_tracking.pop(module, None)
            super()._pre_fw_hook(module, inputs)

    return StepTracker()


class MemorySnapshot:
    """Records step ``step`` (counted from 1; 0: none) on this rank."""

    def __init__(self, step: int, rank: int, run_dir: Path | None, cuda: bool):
        self.step, self.rank, self.cuda = step, rank, cuda
        self.folder = Path(run_dir) / rundir.MEMORY if step else None

    @contextlib.contextmanager
    def around(self, step: int, model, optimizer):
        """Wraps the run's step ``step`` of ``model`` and ``optimizer``: records it if it is the chosen one."""
        if step != self.step:
            yield
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        if self.cuda:
            with self._cuda_history():
                yield
        else:
            with self._tensors(model, optimizer):
                yield

    @contextlib.contextmanager
    def _cuda_history(self):
        import torch

        torch.cuda.memory._record_memory_history(max_entries=1_000_000)
        try:
            yield
        finally:
            path = self.folder / f"rank{self.rank}.pickle"
            with rundir.written_whole(path) as temp:
                torch.cuda.memory._dump_snapshot(str(temp))
            torch.cuda.memory._record_memory_history(enabled=None)
            peak = torch.cuda.max_memory_allocated() / MB
            self._say(f"peak {peak:.1f} MB allocated (since the run began); {path}")

    @contextlib.contextmanager
    def _tensors(self, model, optimizer):
        tracker = step_tracker()
        tracker.track_external(model, optimizer)
        with tracker:
            yield
        peaks = next(iter(tracker.get_tracker_snapshot("peak").values()), {})
        by_kind = {getattr(kind, "value", kind).lower(): value for kind, value in peaks.items()}
        path = self.folder / f"rank{self.rank}.json"
        record = {"rank": self.rank, "step": self.step, "peak_bytes": by_kind, "module_peak_bytes": _module_peaks(tracker)}
        rundir.write_text(path, json.dumps(record, indent=2) + "\n")
        kinds = ", ".join(f"{kind} {value / MB:.1f}" for kind, value in by_kind.items() if kind != "total" and value)
        self._say(f"peak {by_kind.get('total', 0) / MB:.1f} MB of tensors = {kinds} (MB); {path}")

    def _say(self, what: str) -> None:
        print(f"[snnfw] memory rank {self.rank}, step {self.step}: {what}", file=sys.stderr, flush=True)


def _module_peaks(tracker) -> dict[str, int]:
    """Each tracked module's largest total over its forward and backward snapshots."""
    return {stats.mod_fqn: max((device.get("Total", 0) for snapshots in stats.snapshots.values()
                                for snapshot in snapshots for device in snapshot.values()), default=0)
            for stats in tracker.memory_tracking.values()}
