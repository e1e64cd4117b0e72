"""Faults: a rank that dies, a loss that diverges, a rank that stops answering, and two launchers as two nodes."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from snnfw import rundir, train
from snnfw.config import load_config
from snnfw.run.loop import run_training
from snnfw.testing import RankFailure, run_on_ranks, tiny_config
from snnfw.tools.watchdog import GRACE_S

TINY = ["data.batch_size=8", "data.train_samples=64", "data.test_samples=16", "train.lr=0.01", "train.seed=3",
        "train.log_every=1", 'parallel.device="cpu"']
QUICKSTART = "examples/quickstart.toml"


pytestmark = pytest.mark.usefixtures("faults")


def overrides(*extra):
    return [arg for item in (*TINY, *extra) for arg in ("--set", item)]


def reference_losses(steps, microbatches):
    """What data parallel over ``microbatches`` replicas computes, from one process."""
    config = load_config(QUICKSTART, [*TINY, f"train.steps={steps}", "parallel.strategy=none", f"train.microbatches={microbatches}"])
    return run_training(config)["losses"]


def logged_losses(run_dir):
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def snnfw_train(*args, env=None):
    cmd = [sys.executable, "-m", "snnfw", "train", QUICKSTART, *args]
    return subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stderr=subprocess.PIPE, text=True)


def test_a_killed_rank_restarts_the_group_from_the_last_checkpoint(tmp_path):
    """Killed before step 5 and restarted from step 4, the run logs the uninterrupted run's losses bit for bit."""
    settings = ("train.steps=6", "checkpoint.every=2")
    run_on_ranks(load_config(QUICKSTART, [*TINY, *settings]), 2, tmp_path / "whole", timeout_s=240)  # uninterrupted
    run = snnfw_train("--nproc", "2", "--max-restarts", "1", "--run-dir", str(tmp_path / "killed"),
                      *overrides(*settings),
                      env={"SNNFW_TEST_CRASH_AT_STEP": "5"})
    _, err = run.communicate(timeout=240)
    assert run.returncode == 0, err
    assert "test fault: rank 1 exits before step 5" in err
    expected, got = logged_losses(tmp_path / "whole"), logged_losses(tmp_path / "killed")
    assert len(got) == 6 and got == expected, (expected, got)
    summaries = [json.loads((tmp_path / name / "summary.json").read_text()) for name in ("whole", "killed")]
    assert summaries[1]["resumed_from"] == 4
    assert summaries[1]["test_accuracy"] == summaries[0]["test_accuracy"]


def test_a_non_finite_loss_stops_with_the_step_and_keeps_the_last_good_checkpoint(tmp_path, capsys):
    sgd = overrides("checkpoint.every=1", "checkpoint.keep=3", "parallel.strategy=none", "train.optimizer=\"sgd\"")
    args = [QUICKSTART, "--run-dir", str(tmp_path), *sgd]
    assert train.main([*args, "--set", "train.steps=2"]) == 0
    assert train.main([*args, "--set", "train.steps=4", "--set", "train.lr=1e38", "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"snnfw: error: step 4: the loss is nan; training stopped, the last good checkpoint, {tmp_path}/checkpoints/step-2, is kept" in err
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-1", "step-2"]
    assert train.main([*args, "--set", "train.steps=4", "--set", "train.optimizer=\"adam\"", "--resume"]) == 2
    assert "train.optimizer is 'sgd' in the checkpoint and 'adam' in the config; resuming needs the same model" in capsys.readouterr().err
    assert train.main([*args, "--set", "train.steps=4", "--resume"]) == 0
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4] and all(r["loss"] < 10 for r in records)


def test_a_non_finite_loss_between_steps_that_log_is_named_by_its_own_step(tmp_path, capsys):
    sgd = overrides("parallel.strategy=none", "train.optimizer=\"sgd\"", "train.lr=1e38", "train.steps=4",
                    "train.log_every=4")
    assert train.main([QUICKSTART, "--run-dir", str(tmp_path), *sgd]) == 2
    assert "snnfw: error: step 2: the loss is nan; training stopped" in capsys.readouterr().err
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4] and records[0]["loss"] < 10


def test_a_user_error_in_the_ranks_exits_2_with_one_line(tmp_path):
    args = [QUICKSTART, "--run-dir", str(tmp_path), *overrides("train.steps=2", "checkpoint.every=1")]
    assert train.main([*args, "--set", "parallel.strategy=none"]) == 0
    launch = [sys.executable, "-m", "snnfw", "train", *args, "--nproc", "2"]

    def refused(*extra):
        done = subprocess.run([*launch, *extra], capture_output=True, text=True, timeout=180)
        assert "Traceback" not in done.stderr and "torch/distributed/elastic" not in done.stderr, done.stderr
        return done.returncode, [line for line in done.stderr.splitlines() if line.startswith("snnfw:")]

    assert refused() == (2, [
        f"snnfw: error: {tmp_path}/checkpoints holds checkpoints up to step 2 of an earlier run; "
        "pass --resume to continue it, --overwrite to replace it, or choose another --run-dir"])
    assert refused("--resume", "--set", "data.batch_size=16") == (2, [
        f"snnfw: error: {tmp_path}/checkpoints/step-2 cannot be resumed: data.batch_size is 8 in the checkpoint "
        "and 16 in the config; resuming needs the same model, optimizer, dtype and data order, so set them as the "
        "checkpoint has them or choose another --run-dir"])


def test_a_rank_that_stops_answering_fails_the_others_within_the_timeout():
    config = tiny_config("dp", parallel={"timeout_s": 5})
    started = time.monotonic()
    with pytest.raises(RankFailure) as failure:
        run_on_ranks(config, 2, timeout_s=150, env={1: {"SNNFW_TEST_HANG_AT_STEP": "2"}})
    assert 0 in failure.value.errors and "timed out" in failure.value.errors[0].lower()
    assert time.monotonic() - started < 120


@pytest.mark.parametrize("how, status, messages", [
    ("1", 1, ["snnfw: error: training failed on ranks [1]; see the messages above"]),
    ("abort", 0, ["rank 1: SIGABRT", "after finishing all work (an abort at process exit"]),  # rank 0 may get SIGTERM
])
def test_a_rank_that_exits_with_a_status_after_its_work_fails_the_run(tmp_path, how, status, messages):
    """Rank 0 writes its results last (slowed on purpose): the others wait for it, so the results are whole."""
    run = snnfw_train("--nproc", "2", "--run-dir", str(tmp_path), *overrides("train.steps=1"),
                      env={"SNNFW_TEST_EXIT_AT_END": how, "SNNFW_TEST_SLOW_RESULTS": "2"})
    _, err = run.communicate(timeout=180)
    assert run.returncode == status and all(message in err for message in messages), err
    assert (tmp_path / ".ranks" / "rank1.done").exists() and (tmp_path / "summary.json").exists()


@pytest.mark.parametrize("sig, blamed", [
    (signal.SIGSTOP, "snnfw: error: rank 1 stopped answering (frozen, or stuck outside Python): the others waited "
                     "parallel.timeout_s = 5 s for it, then it was killed; see the messages above"),
    (signal.SIGKILL, "snnfw: error: rank 1 was killed by SIGKILL (the kernel's out-of-memory killer sends SIGKILL); "
                     "the other ranks stopped with it; see the messages above"),
], ids=["frozen", "killed"])
def test_a_stopped_or_killed_rank_is_blamed_alone_and_ends_the_run_within_the_timeout(tmp_path, sig, blamed):
    run = snnfw_train("--nproc", "2", "--run-dir", str(tmp_path), *overrides("train.steps=2000", "parallel.timeout_s=5"))
    metrics = tmp_path / rundir.METRICS
    while not metrics.exists() or len(metrics.read_text().splitlines()) < 2:
        assert run.poll() is None, run.stderr.read()
        time.sleep(0.1)
    started = time.monotonic()
    os.kill(rundir.local_rank_pids(tmp_path)[1], sig)
    _, err = run.communicate(timeout=180)
    assert run.returncode == 1 and err.strip().splitlines()[-1] == blamed, err
    assert time.monotonic() - started < 5 + GRACE_S + 15  # torch's agent alone waits 30 s more for a frozen rank


def test_a_done_marker_of_an_earlier_attempt_is_removed_when_a_rank_starts(tmp_path):
    rundir.mark_done(tmp_path, 0)
    assert train.main([QUICKSTART, "--run-dir", str(tmp_path), "--set", "train.steps=0"]) == 2
    assert not (tmp_path / ".ranks" / "rank0.done").exists()


@pytest.mark.parametrize("rank0", [{}, {"SNNFW_TEST_FAULT_RANK": "0", "SNNFW_TEST_HANG_AT_STEP": "2"}],
                         ids=["others-fail-too", "others-hang"])
def test_a_rank_that_dies_fails_run_on_ranks_at_once(rank0):
    started = time.monotonic()
    with pytest.raises(RankFailure) as failure:
        run_on_ranks(tiny_config("dp"), 2, timeout_s=120, env={0: rank0, 1: {"SNNFW_TEST_CRASH_AT_STEP": "2"}})
    assert failure.value.errors[1] == "process died with exit code 1 before reporting a result"
    assert time.monotonic() - started < 60


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_launchers_make_one_job_through_the_c10d_rendezvous(tmp_path):
    endpoint = f"127.0.0.1:{_free_port()}"
    nodes = [
        snnfw_train("--nproc", "2", "--nnodes", "2", "--node-rank", str(rank), "--rdzv-endpoint", endpoint,
                    "--run-dir", str(tmp_path), *overrides("train.steps=3"))
        for rank in (0, 1)
    ]
    errors = [node.communicate(timeout=240)[1] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], errors
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["plan"]["world_size"] == 4
    expected, got = reference_losses(3, 4), logged_losses(tmp_path)
    assert all(abs(a - b) <= 1e-5 for a, b in zip(expected, got)) and len(got) == 3, (expected, got)
