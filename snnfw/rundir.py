"""Everything a run directory holds, by name: what the worker, the launcher and the tools agree on.

A run directory holds the results of one run (the files below) and the
``.ranks`` folder of markers through which the ranks tell the launcher how
they ended.
"""

from __future__ import annotations

from pathlib import Path

METRICS = "metrics.jsonl"  # one JSON object per optimizer step
SUMMARY = "summary.json"  # the run's outcome, written by rank 0 at the end
EVAL = "eval.json"  # the score of ``snnfw eval``
FINAL_MODEL = "final_model.pt"  # the trained model, whole
BEST_MODEL = "best_model.pt"  # the same, at the validation with the highest eval_acc
TENSORBOARD = "tensorboard"  # the folder of TensorBoard event files (``log.tensorboard``)
CHECKPOINTS = "checkpoints"  # the folder of ``step-N`` checkpoints
RUN_FILES = (METRICS, SUMMARY, FINAL_MODEL, BEST_MODEL, TENSORBOARD, CHECKPOINTS)  # what a training run writes

RANKS = ".ranks"  # the ranks' markers for the launcher
STOPPED = "stopped"  # in RANKS: the user error that stopped a rank, one line
LAUNCHED = "SNNFW_LAUNCHED"  # environment: set by ``snnfw train``, which reports a rank's user error itself, once
AUTO_DECISION = "SNNFW_AUTO_DECISION"  # environment: the launcher's ``auto`` choice (JSON), which every rank applies


def done_marker(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / RANKS / f"rank{rank}.done"


def mark_done(run_dir: Path, rank: int) -> None:
    """Records that this rank passed the run's last barrier (every rank's work is complete), so an abort at exit
    is told apart."""
    (Path(run_dir) / RANKS).mkdir(parents=True, exist_ok=True)
    done_marker(run_dir, rank).touch()


def any_done(run_dir: Path) -> bool:
    return any((Path(run_dir) / RANKS).glob("rank*.done"))


def mark_stopped(run_dir: Path, rank: int, message: str) -> None:
    """Records the user error that stopped this rank; written whole (a rename), since every rank may write it."""
    (Path(run_dir) / RANKS).mkdir(parents=True, exist_ok=True)
    part = Path(run_dir) / RANKS / f"{STOPPED}.rank{rank}"
    part.write_text(f"{message}\n")
    part.replace(stopped_marker(run_dir))


def stopped_marker(run_dir: Path) -> Path:
    return Path(run_dir) / RANKS / STOPPED


def clear_markers(run_dir: Path) -> None:
    """Removes an earlier launch's markers."""
    folder = Path(run_dir) / RANKS
    if folder.exists():
        for marker in folder.iterdir():
            marker.unlink()
