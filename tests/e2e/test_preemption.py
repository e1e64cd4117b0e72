"""Saved on the cluster's signal: SIGTERM or SIGUSR1 to a 2-rank snnfw train (its whole process group, as SLURM sends
it) leaves a checkpoint within the grace period, requeues the SLURM job, ends with the preempted status, and --resume
trains to the end with every loss of an uninterrupted run; a second signal during the save leaves the checkpoint
before it."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from snnfw import rundir
from snnfw.components import integrity
from snnfw.run.preemption import PREEMPTED_EXIT
from snnfw.tools.submit import script

from test_nothing_lost import ROOT, tiny_toml

STEPS = 40
GRACE_S = 30.0  # checkpoint.grace_s's default


def train(config: Path, run: Path, *args, env=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "snnfw", "train", config, "--nproc", "2", "--run-dir", run, "--set",
                           f"train.steps={STEPS}", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=env)


def losses(run: Path) -> list[float]:
    return [record["loss"] for record in rundir.read_metrics(run / rundir.METRICS)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[float]:
    folder = tmp_path_factory.mktemp("uninterrupted")
    done = train(tiny_toml(folder), folder / "run")
    assert done.returncode == 0, done.stderr
    return losses(folder / "run")


def fake_scontrol(folder: Path) -> tuple[dict, Path]:
    """An environment with SLURM_JOB_ID set and an ``scontrol`` on PATH that records its arguments."""
    bin_dir, said = folder / "bin", folder / "scontrol.log"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {said}\n')
    (bin_dir / "scontrol").chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "4242"}, said


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_a_signal_saves_requeues_and_resume_continues_exactly(tmp_path, uninterrupted, sig):
    run, config = tmp_path / "run", tiny_toml(tmp_path)
    env, said = fake_scontrol(tmp_path)
    launcher = subprocess.Popen([sys.executable, "-m", "snnfw", "train", config, "--nproc", "2", "--run-dir", run,
                                 "--set", f"train.steps={STEPS}"], cwd=ROOT, stderr=subprocess.PIPE, text=True,
                                env=env, start_new_session=True)  # its own process group, as SLURM's job step
    metrics, deadline = run / rundir.METRICS, time.monotonic() + 180
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 25):
        assert launcher.poll() is None and time.monotonic() < deadline, "the run did not reach step 25"
        time.sleep(0.05)
    os.killpg(launcher.pid, sig)
    signalled = time.monotonic()
    if sig == signal.SIGUSR1:  # SLURM's --signal may reach every process of the job step: with the launcher's, once
        for pid in rundir.local_rank_pids(run).values():
            os.kill(pid, sig)
    _, stderr = launcher.communicate(timeout=120)
    took = time.monotonic() - signalled
    assert launcher.returncode == PREEMPTED_EXIT, stderr
    assert took < GRACE_S, f"ended {took:.1f} s after the signal"
    saved = rundir.complete_checkpoints(run / rundir.CHECKPOINTS)
    assert len(saved) == 1 and 25 <= rundir.checkpoint_step(saved[0]) < STEPS  # with checkpoint.every = 0
    step = rundir.checkpoint_step(saved[0])
    assert json.loads((saved[0] / rundir.STEP_META).read_text())["step"] == step
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(f"snnfw: preempted at step {step} by {sig.name}, ") and last.endswith(
        f" s after the signal: checkpoint {saved[0]}; continue with the same command and --resume"), last
    assert said.read_text() == "requeue 4242\n"
    assert "requeued SLURM job 4242" in stderr
    resumed = train(config, run, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming after step {step} from {saved[0]}" in resumed.stderr
    assert losses(run) == uninterrupted


SAVE_INTERRUPTED = """
import os, signal, sys, time
from snnfw.components import checkpoint
from snnfw.config import build_config
from snnfw.run.loop import run_training
from snnfw.run.preemption import Signals
from snnfw.run.trainer import Trainer
from snnfw.testing import TINY

when = sys.argv[2]  # "again": a second signal during the save; "late": the grace period runs out during it
stepped, saved = Trainer.step, checkpoint.dcp.save

def step(self, number):
    if number == 2:  # the first signal, in step 3, after the checkpoint of step 2: the run stops after step 3
        os.kill(os.getpid(), signal.SIGTERM)
    return stepped(self, number)

def save(state, storage_writer, **kwargs):
    if storage_writer.path.name != ".tmp-step-2":  # the save the signal asked for
        (storage_writer.path / "half-written").write_text("")
        time.sleep(1.2)  # a repeat within preemption.REPEAT_S counts once
        if when == "again":
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    return saved(state, storage_writer=storage_writer, **kwargs)

Trainer.step, checkpoint.dcp.save = step, save
config = build_config({**TINY, "train": {**TINY["train"], "steps": 8}, "checkpoint": {"every": 2, "grace_s": 2}})
with Signals(("SIGTERM",), 2.0) as signals:
    run_training(config, sys.argv[1], signals=signals)
"""


@pytest.mark.parametrize("when", ["again", "late"], ids=["second-signal", "grace-ran-out"])
def test_a_save_cut_by_a_second_signal_or_the_grace_period_leaves_the_checkpoint_before(tmp_path, when):
    script = tmp_path / "run.py"
    script.write_text(SAVE_INTERRUPTED)
    started = time.monotonic()
    done = subprocess.run([sys.executable, script, tmp_path, when], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    why = "SIGTERM came again" if when == "again" else "checkpoint.grace_s = 2 s ran out"
    assert f"[snnfw] {why} " in done.stderr and "ended at once without the checkpoint being written" in done.stderr
    assert time.monotonic() - started < 60
    root = tmp_path / rundir.CHECKPOINTS
    assert [p.name for p in rundir.numbered_checkpoints(root)] == ["step-2"]
    assert [p.name for p in root.iterdir() if p.name.startswith(rundir.TEMP_PREFIX)]  # the cut one, under its temporary name
    newest, meta = integrity.newest_whole(root, print)
    assert newest == root / "step-2" and meta["step"] == 2
    rundir.check_run_dir(tmp_path, resume=True, overwrite=False)


def test_the_torchrun_line_of_snnfw_submit_saves_on_sigusr1(tmp_path):
    """SLURM's SIGUSR1 to the process group of torchrun, run with the signal options of snnfw submit's script:
    torchrun forwards it, rank 0 says where the run stopped, and the checkpoint is there."""
    run, config = tmp_path / "run", tiny_toml(tmp_path)
    line = script(config, run, [], 1, 2, "01:00:00", None, ("SIGTERM", "SIGUSR1"), GRACE_S).splitlines()[-1]
    options = [word for word in line.split() if word.startswith(("--signals-to-handle=", "--shutdown-timeout="))]
    assert len(options) == 2, line
    torchrun = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                                 *options, "-m", "snnfw.train", config, "--run-dir", run, "--set", f"train.steps={STEPS}"],
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    metrics, deadline = run / rundir.METRICS, time.monotonic() + 180
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 5):
        assert torchrun.poll() is None and time.monotonic() < deadline, "the run did not reach step 5"
        time.sleep(0.05)
    os.killpg(torchrun.pid, signal.SIGUSR1)
    _, stderr = torchrun.communicate(timeout=120)
    saved = rundir.complete_checkpoints(run / rundir.CHECKPOINTS)
    assert len(saved) == 1, stderr
    assert f"snnfw: preempted at step {rundir.checkpoint_step(saved[0])} by SIGUSR1, " in stderr
