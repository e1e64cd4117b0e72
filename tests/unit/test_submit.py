"""snnfw submit: the SLURM batch script it writes (nodes, tasks, the signal before the time limit, requeue, the
torchrun line, --resume once requeued), and its submission through sbatch."""

import os
import shlex
import subprocess
from pathlib import Path

import pytest

from snnfw.cli import main

CONFIG = Path(__file__).resolve().parents[2] / "examples" / "quickstart.toml"


def fake(folder: Path, name: str, body: str) -> Path:
    """An executable ``name`` in ``folder`` that logs its arguments to ``folder/name.log`` and runs ``body``."""
    folder.mkdir(exist_ok=True)
    path = folder / name
    path.write_text(f'#!/bin/sh\necho "$@" >> {folder / name}.log\n{body}\n')
    path.chmod(0o755)
    return path


def sbatch_options(text: str) -> dict[str, str]:
    options = {}
    for line in text.splitlines():
        if line.startswith("#SBATCH --"):
            key, _, value = line[len("#SBATCH --"):].partition("=")
            options[key] = value
    return options


def launched(text: str) -> list[str]:
    """The words of the script's srun line."""
    (line,) = [line for line in text.splitlines() if line.startswith("srun ")]
    return shlex.split(line)


def test_dry_writes_the_script_for_the_job_and_prints_it(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["submit", str(CONFIG), "--nodes", "2", "--gpus-per-node", "4", "--time", "04:00:00", "--partition",
                 "gpu", "--run-dir", str(run), "--set", "checkpoint.grace_s=45", "--set", "train.steps=7", "--dry"]) == 0
    text = (run / "submit.sbatch").read_text()
    assert capsys.readouterr().out == text
    options = sbatch_options(text)
    assert options["nodes"] == "2" and options["ntasks-per-node"] == "1" and options["gpus-per-node"] == "4"
    assert options["time"] == "04:00:00" and options["partition"] == "gpu"
    assert options["signal"] == "USR1@75"  # the grace period and a margin before the time limit
    assert "requeue" in options
    words = launched(text)
    torchrun = words.index("torchrun")
    flags = dict(word.split("=", 1) for word in words[torchrun + 1:] if word.startswith("--") and "=" in word)
    assert flags["--nnodes"] == "2" and flags["--nproc-per-node"] == "4" and flags["--rdzv-backend"] == "c10d"
    assert flags["--rdzv-endpoint"] == "$HEAD:29400" and flags["--rdzv-id"] == "$SLURM_JOB_ID"
    assert {"SIGTERM", "SIGUSR1"} <= set(flags["--signals-to-handle"].split(","))
    assert int(flags["--shutdown-timeout"]) > 45
    module = words.index("-m")
    assert words[module:] == ["-m", "snnfw.train", str(CONFIG), "--run-dir", str(run.resolve()), "--set",
                              "checkpoint.grace_s=45", "--set", "train.steps=7", "$CONTINUE"]


def test_the_script_resumes_once_requeued(tmp_path, capsys):
    """Run by bash with srun and scontrol faked: torchrun's line, with --resume once a whole checkpoint is there."""
    run, bin_dir = tmp_path / "run", tmp_path / "bin"
    main(["submit", str(CONFIG), "--nodes", "2", "--gpus-per-node", "1", "--time", "0:10:00", "--run-dir", str(run),
          "--dry"])
    fake(bin_dir, "srun", "")
    fake(bin_dir, "scontrol", "echo node-a")
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "7",
           "SLURM_JOB_NODELIST": "node-[a-b]"}
    subprocess.run(["bash", run / "submit.sbatch"], env=env, check=True, timeout=60)
    (run / "checkpoints" / "step-5").mkdir(parents=True)
    (run / "checkpoints" / "step-5" / "meta.json").write_text("{}")
    subprocess.run(["bash", run / "submit.sbatch"], env={**env, "SLURM_RESTART_COUNT": "1"}, check=True, timeout=60)
    first, requeued = (bin_dir / "srun.log").read_text().splitlines()
    assert "--rdzv-endpoint=node-a:29400" in first and "--rdzv-id=7" in first
    assert first.endswith(f"--run-dir {run.resolve()}") and requeued.endswith(f"--run-dir {run.resolve()} --resume")


def test_the_script_is_submitted_with_sbatch(tmp_path, capsys, monkeypatch):
    bin_dir, run = tmp_path / "bin", tmp_path / "run"
    fake(bin_dir, "sbatch", "echo Submitted batch job 77")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    assert main(["submit", str(CONFIG), "--nodes", "1", "--gpus-per-node", "8", "--time", "12:00:00",
                 "--run-dir", str(run)]) == 0
    assert (bin_dir / "sbatch.log").read_text() == f"{run / 'submit.sbatch'}\n"
    assert capsys.readouterr().out.startswith("Submitted batch job 77; script ")


@pytest.mark.parametrize("args, said", [
    ([], "sbatch is not on PATH: run snnfw submit on a SLURM login node, or pass --dry"),
    (["--time", "90"], "--time is the job's time limit as HH:MM:SS, like 04:00:00; got '90'"),
    (["--set", "checkpoint.save_on_signals=[\"SIGTERM\"]"], "does not save on it; add \"SIGUSR1\" to it"),
])
def test_what_cannot_be_submitted_is_refused_in_one_line(tmp_path, capsys, monkeypatch, args, said):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch
    status = main(["submit", str(CONFIG), "--nodes", "1", "--gpus-per-node", "1", "--time", "01:00:00",
                   "--run-dir", str(tmp_path / "run"), *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and said in err[0], err
