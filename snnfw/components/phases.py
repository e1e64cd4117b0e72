"""Time of the named phases of a training step (``log.phase_times``), for the metrics and the benchmark."""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict


def finish_queued_work(device) -> None:
    """Waits for the kernels queued on ``device`` (a CUDA call returns before they run), so that a host clock
    times them; nothing to wait for on a CPU."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


class PhaseTimes:
    """Milliseconds spent in named phases of a step (``data``, ``forward``, ``backward``, ...), when ``enabled``.

    Each trainer keeps one (``hooks.run.phases`` in a hook); strategies time
    their own phases with ``with hooks.run.phases("forward"):``. Off (the
    default of ``snnfw train``; ``snnfw bench`` turns it on), a phase costs
    nothing. On a GPU a phase is timed by CUDA events, read once per step in
    :meth:`take`, so timing never makes the host wait for the GPU inside a
    step; on a CPU by the host clock. Phases nest: ``forward_backward`` holds
    the others.
    """

    def __init__(self, enabled: bool = True, cuda: bool = False):
        self.enabled, self.cuda = enabled, cuda
        self._ms: dict[str, float] = defaultdict(float)
        self._events: list = []  # (name, start, end) CUDA events not yet read

    @contextlib.contextmanager
    def __call__(self, name: str):
        if not self.enabled:
            yield
        elif self.cuda:
            import torch

            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self._events.append((name, start, end))
        else:
            started = time.perf_counter()
            try:
                yield
            finally:
                self._ms[name] += (time.perf_counter() - started) * 1e3

    def take(self) -> dict[str, float]:
        """Returns ``{"<phase>_ms": ms}`` since the last call and clears it (on a GPU, waits for the phases' end)."""
        for name, start, end in self._events:
            end.synchronize()
            self._ms[name] += start.elapsed_time(end)
        out = {f"{name}_ms": ms for name, ms in self._ms.items()}
        self._ms.clear()
        self._events.clear()
        return out
