"""``snnfw submit``: a SLURM batch script for a config, written into the run directory and submitted with sbatch.

One task per node runs torchrun, whose c10d rendezvous is hosted on the job's first node. SLURM sends SIGUSR1
``checkpoint.grace_s`` + :data:`SIGNAL_MARGIN_S` before the time limit (``--signal``); torchrun forwards it (and
SIGTERM, at preemption) to the ranks, which save a checkpoint and requeue the job (:mod:`snnfw.run.preemption`);
the requeued job runs the same script, which then passes ``--resume``.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from snnfw.errors import ConfigError, UserError

SCRIPT = "submit.sbatch"  # in the run directory
RDZV_PORT = 29400  # torchrun's c10d rendezvous, on the first node
SIGNAL_MARGIN_S = 30  # beyond checkpoint.grace_s: the requeue, and the ranks' exit, before the time limit
TIME = re.compile(r"^\d+:[0-5]\d:[0-5]\d$")


def script(config: Path, run_dir: Path, overrides: list[str], nodes: int, gpus_per_node: int, time_limit: str,
           partition: str | None, save_on_signals: tuple[str, ...], grace_s: float) -> str:
    """The batch script; paths are made absolute, since SLURM runs it from its own copy."""
    run_dir, config = run_dir.resolve(), config.resolve()
    lead = int(grace_s) + SIGNAL_MARGIN_S
    signals = ",".join(dict.fromkeys(["SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", *save_on_signals]))
    torchrun = [
        "torchrun", f"--nnodes={nodes}", f"--nproc-per-node={gpus_per_node}", "--rdzv-backend=c10d",
        f'--rdzv-endpoint="$HEAD:{RDZV_PORT}"', '--rdzv-id="$SLURM_JOB_ID"', f"--signals-to-handle={signals}",
        f"--shutdown-timeout={int(grace_s) + 5}", "-m", "snnfw.train", shlex.quote(str(config)),
        "--run-dir", shlex.quote(str(run_dir)), *(f"--set {shlex.quote(item)}" for item in overrides), "$CONTINUE",
    ]
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name=snnfw-{config.stem}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={gpus_per_node}",
        f"#SBATCH --time={time_limit}",
        *([f"#SBATCH --partition={partition}"] if partition else []),
        f"#SBATCH --signal=USR1@{lead}",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        f"#SBATCH --output={run_dir}/slurm-%j.out",
        "set -euo pipefail",
        f"cd {shlex.quote(str(Path.cwd()))}",
        'HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "# a requeued job continues from the newest whole checkpoint; without one, it starts over",
        'CONTINUE=""',
        f"if ls {shlex.quote(str(run_dir))}/checkpoints/step-*/meta.json >/dev/null 2>&1; then CONTINUE=--resume",
        'elif [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then CONTINUE=--overwrite; fi',
        "srun --kill-on-bad-exit=1 " + " ".join(torchrun),
    ]
    return "\n".join(lines) + "\n"


def submit(config: str, run_dir: Path, overrides: list[str], nodes: int, gpus_per_node: int, time_limit: str,
           partition: str | None, dry: bool) -> int:
    """Writes the script into ``run_dir`` and submits it (with ``dry``, prints it instead); returns the exit status."""
    from snnfw.config import load_config
    from snnfw.rundir import check_writable, write_text

    if nodes < 1 or gpus_per_node < 1:
        raise ConfigError(f"--nodes and --gpus-per-node count nodes and GPUs, 1 or more; got {nodes} and {gpus_per_node}")
    if not TIME.match(time_limit):
        raise ConfigError(f"--time is the job's time limit as HH:MM:SS, like 04:00:00; got {time_limit!r}")
    settings = load_config(config, overrides).checkpoint  # a bad config refused before anything is written
    if "SIGUSR1" not in settings.save_on_signals:
        raise ConfigError("snnfw submit has SLURM send SIGUSR1 before the time limit, and checkpoint.save_on_signals "
                          f"= {list(settings.save_on_signals)} does not save on it; add \"SIGUSR1\" to it")
    if not dry and shutil.which("sbatch") is None:
        raise ConfigError("sbatch is not on PATH: run snnfw submit on a SLURM login node, or pass --dry to write and "
                          "print the script")
    text = script(Path(config), run_dir, overrides, nodes, gpus_per_node, time_limit, partition,
                  settings.save_on_signals, settings.grace_s)
    path = run_dir / SCRIPT
    check_writable(path, "--run-dir")
    write_text(path, text)
    if dry:
        print(text, end="")
        print(f"# written to {path}; submit it with: sbatch {path}", file=sys.stderr)
        return 0
    done = subprocess.run(["sbatch", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        said = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise UserError(f"sbatch refused {path}: {said}")
    print(f"{done.stdout.strip()}; script {path}, output in {run_dir.resolve()}/slurm-<job id>.out")
    return 0
