"""Wall time of the named phases of a training step, for the metrics and the benchmark."""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from typing import Callable


def finish_queued_work(device) -> None:
    """Waits for the kernels queued on ``device`` (a CUDA call returns before they run), so that a host clock
    times them; nothing to wait for on a CPU."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


class PhaseTimes:
    """Milliseconds spent in named phases of a step (``data``, ``forward``, ``backward``, ...).

    Each trainer keeps one (``hooks.run.phases`` in a hook); strategies time
    their own phases with ``with hooks.run.phases("forward"):``. On CUDA
    ``synchronize`` (``torch.cuda.synchronize``) makes a phase end when its
    kernels do, not when they are launched. Phases nest: ``forward_backward``
    holds the others.
    """

    def __init__(self, synchronize: Callable[[], None] | None = None):
        self._ms: dict[str, float] = defaultdict(float)
        self.synchronize = synchronize

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.synchronize is not None:
                self.synchronize()
            self._ms[name] += (time.perf_counter() - start) * 1e3

    def take(self) -> dict[str, float]:
        """Returns ``{"<phase>_ms": ms}`` since the last call and clears it."""
        out = {f"{name}_ms": ms for name, ms in self._ms.items()}
        self._ms.clear()
        return out
