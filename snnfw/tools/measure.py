"""``snnfw plan --measure K``: a few real steps of auto's top candidates, timed on local ranks."""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

from snnfw.plan.auto import Candidate
from snnfw.rundir import METRICS
from snnfw.tools.launch import launch


def measure_top(config_path, overrides: list[str], world: int, ranked: list[Candidate], steps: int = 4) -> list[tuple[Candidate, float]]:
    """Runs a few real steps of each candidate on ``world`` local ranks; (candidate, median step ms), fastest first."""
    timed = []
    for candidate in ranked:
        extra = [*overrides, *candidate.overrides(), f"train.steps={steps}", f"train.log_every={steps}",
                 f"data.test_samples={world}"]
        with tempfile.TemporaryDirectory(prefix="snnfw-measure-") as tmp:
            if launch(config_path, world, Path(tmp), extra, 300.0):
                continue
            lines = (Path(tmp) / METRICS).read_text().splitlines()
        timed.append((candidate, statistics.median(json.loads(line)["step_ms"] for line in lines[1:])))
    return sorted(timed, key=lambda item: item[1])
