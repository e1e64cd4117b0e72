"""``snnfw plot RUN_DIR ...``: one PNG of the runs' curves from their ``metrics.jsonl``, no server needed."""

from __future__ import annotations

from pathlib import Path

from snnfw.errors import ConfigError
from snnfw.rundir import METRICS, read_metrics

PANELS = (("loss", "training loss"), ("train_acc", "training accuracy"), ("eval_acc", "test accuracy"),
          ("lr", "learning rate"), ("spike_rate", "firing rate"), ("step_ms", "step time (ms)"))


def records(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / METRICS
    if not path.is_file():
        raise ConfigError(f"{run_dir} has no metrics.jsonl; name run directories that snnfw train wrote")
    return read_metrics(path)


def plot(run_dirs: list[str | Path], out: str | Path) -> Path:
    """Draws each panel's metric over the steps, one line per run (``eval_acc`` at its validations)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {str(run_dir): records(run_dir) for run_dir in run_dirs}
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5))
    for ax, (key, title) in zip(axes.flat, PANELS):
        for name, rows in runs.items():
            points = [(r["step"], r[key]) for r in rows if key in r]
            if points:
                ax.plot(*zip(*points), marker="o" if key == "eval_acc" else None, markersize=3, label=Path(name).name)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
