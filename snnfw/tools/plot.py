"""``snnfw plot RUN_DIR ...``: one PNG of the runs' curves from their ``metrics.jsonl``, no server needed, and
where each rank's profiled time went (``log.profile``: compute, communication, idle)."""

from __future__ import annotations

from pathlib import Path

from snnfw.errors import ConfigError
from snnfw.rundir import METRICS, PROFILE, check_writable, read_metrics, written_whole

PANELS = (("loss", "training loss"), ("train_acc", "training accuracy"), ("eval_acc", "test accuracy"),
          ("lr", "learning rate"), ("spike_rate", "firing rate"), ("step_ms", "step time (ms)"))
FEW = 5  # validations up to this many are labelled with their values


def records(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / METRICS
    if not path.is_file():
        raise ConfigError(f"{run_dir} has no metrics.jsonl; name run directories that snnfw train wrote")
    return read_metrics(path)


def rank_shares(run_dir: Path) -> list[dict]:
    """The ``log.profile`` shares of each profiled rank, in rank order (none if the run was not profiled)."""
    import json

    files = [f for f in (Path(run_dir) / PROFILE).glob("rank*.json") if not f.name.endswith(".trace.json")]
    return sorted((json.loads(f.read_text()) for f in files), key=lambda shares: shares["rank"])


def plot(run_dirs: list[str | Path], out: str | Path) -> Path:
    """Draws each panel's metric over the steps, one line per run (``eval_acc`` at its validations)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    check_writable(out, "--out")
    runs = {str(run_dir): records(run_dir) for run_dir in run_dirs}
    profiled = {Path(name).name: shares for name in runs if (shares := rank_shares(Path(name)))}
    fig, axes = plt.subplots(3 if profiled else 2, 3, figsize=(13, 9.5 if profiled else 6.5))
    last_step = max((r["step"] for rows in runs.values() for r in rows), default=1)
    for ax, (key, title) in zip(axes.flat, PANELS):
        for name, rows in runs.items():
            points = [(r["step"], r[key]) for r in rows if key in r]
            if points:
                ax.plot(*zip(*points), marker="o" if key == "eval_acc" else None, markersize=3, label=Path(name).name)
            if key == "eval_acc" and 0 < len(points) <= FEW:  # a few validations: their values, on the run's steps
                for step, value in points:
                    ax.annotate(f"{value:.1%}", (step, value), textcoords="offset points", xytext=(0, 6), ha="center",
                                fontsize=8)
        if key == "eval_acc":
            ax.set_xlim(0, last_step * 1.05)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    if profiled:
        for ax in axes[2]:
            ax.remove()
        _time_per_rank(fig.add_subplot(3, 1, 3), profiled)
    fig.tight_layout()
    with written_whole(out) as temp:
        fig.savefig(temp, dpi=100, format=out.suffix.lstrip(".") or "png")
    plt.close(fig)
    return out


def _time_per_rank(ax, profiled: dict[str, list[dict]]) -> None:
    """One stacked bar per profiled rank: its shares of compute, communication and idle time."""
    labels = [f"{name} rank {shares['rank']}" for name, ranks in profiled.items() for shares in ranks]
    left = [0.0] * len(labels)
    for part in ("compute", "communication", "idle"):
        widths = [shares[part] for ranks in profiled.values() for shares in ranks]
        ax.barh(labels, widths, left=left, label=part)
        left = [a + b for a, b in zip(left, widths)]
    ax.set_title("time per rank in the profiled steps")
    ax.set_xlim(0, 1)
    ax.invert_yaxis()
    ax.legend(fontsize=8, loc="lower left", bbox_to_anchor=(1.0, 0.0))
