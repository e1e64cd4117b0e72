"""Nothing lost, nothing half-written: the run directory's lock, files written whole, a cut metrics line on resume,
and the launcher's refusals and timeouts, each in one line."""

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from snnfw import rundir
from snnfw.cli import main
from snnfw.errors import CheckpointError
from snnfw.run.loop import run_training
from snnfw.testing import TINY, tiny_config

ROOT = Path(__file__).resolve().parents[2]


def tiny_toml(folder: Path) -> Path:
    """The tiny VGG config as a TOML file, for the command line."""
    lines = []
    for section, table in {**TINY, "parallel": {"strategy": "dp", "device": "cpu"}}.items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in table.items()]
    path = folder / "tiny.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def snnfw(*args, timeout=300):
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "snnfw", *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                            timeout=timeout)
    return result, time.monotonic() - started


def in_process(capsys, *args):
    """The CLI in this process, for commands that start no ranks and refusals made before any start (a process of its
    own would spend seconds importing torch); the result has the exit status and standard error a subprocess's has."""
    status = main([str(a) for a in args])
    return SimpleNamespace(returncode=status, stderr=capsys.readouterr().err)


def one_error_line(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("snnfw: error: "), result.stderr
    return lines[0]


def test_a_run_directory_in_use_is_refused_naming_its_owner(tmp_path):
    run = tmp_path / "run"
    with rundir.locked(run):
        result, _ = snnfw("train", tiny_toml(tmp_path), "--nproc", 2, "--run-dir", run)
    assert result.returncode == 2
    line = one_error_line(result)
    assert f"pid {os.getpid()} on {socket.gethostname()}" in line and "choose another --run-dir" in line
    assert not (run / rundir.METRICS).exists()


def test_one_process_cannot_hold_the_lock_twice_and_lets_go_of_it(tmp_path):
    with rundir.locked(tmp_path):
        with pytest.raises(CheckpointError, match="belongs to a run in progress"):
            with rundir.locked(tmp_path):
                pass
    with rundir.locked(tmp_path):  # released at the end of the first
        pass
    assert (tmp_path / rundir.LOCK).read_text() == ""


def test_the_lock_of_an_owner_that_died_is_taken_over_with_a_note(tmp_path, capsys):
    (tmp_path / rundir.LOCK).write_text("pid 4194304 on a-node-that-crashed\n")  # written, never unlocked
    with rundir.locked(tmp_path):
        assert (tmp_path / rundir.LOCK).read_text().startswith(f"pid {os.getpid()} ")
    assert "locked by pid 4194304 on a-node-that-crashed, which is no longer running" in capsys.readouterr().err


def test_negative_max_restarts_is_refused_before_launch(tmp_path, capsys):
    result = in_process(capsys, "train", tiny_toml(tmp_path), "--nproc", 2, "--run-dir", tmp_path / "run",
                        "--max-restarts", -1)
    assert result.returncode == 2
    assert "--max-restarts counts restarts" in one_error_line(result)


@pytest.mark.parametrize("node, said", [(0, "did not all reach the rendezvous"),
                                        (1, "node 1 could not reach the rendezvous that node 0 hosts")])
def test_the_rendezvous_ends_within_the_timeout_when_a_node_is_missing(tmp_path, node, said):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result, took = snnfw("train", tiny_toml(tmp_path), "--nproc", 1, "--nnodes", 2, "--node-rank", node,
                         "--rdzv-endpoint", f"127.0.0.1:{port}", "--run-dir", tmp_path / "run",
                         "--set", "parallel.timeout_s=5", timeout=240)
    assert result.returncode == 2, result.stderr
    assert said in one_error_line(result) and "within 5 s (parallel.timeout_s)" in result.stderr
    assert took < 5 + 60, f"ended after {took:.0f} s"  # the timeout, and the config's checks before launch


def test_a_result_file_is_whole_or_absent(tmp_path, monkeypatch):
    """A run killed while it writes its best model leaves no file at all, not a cut one that eval would pick."""

    def killed_while_writing(obj, path, *args, **kwargs):
        Path(path).write_bytes(b"PK\x03\x04 the first bytes of a zip")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", killed_while_writing)
    with pytest.raises(KeyboardInterrupt):
        run_training(tiny_config("none", eval={"every": 1}), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [rundir.METRICS]


def test_resume_drops_a_cut_last_line_of_the_metrics(tmp_path, capsys):
    config = tiny_config("none", checkpoint={"every": 2})
    whole = run_training(config, tmp_path)
    metrics = tmp_path / rundir.METRICS
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join(lines[:2]) + "\n" + lines[2][: len(lines[2]) // 2])  # cut while writing step 3
    resumed = run_training(config, tmp_path, resume=True)
    assert "the last line of" in capsys.readouterr().err
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert resumed["losses"] == whole["losses"]


@pytest.mark.parametrize("sig, every, said", [
    (signal.SIGTERM, 1, "; continue from the newest checkpoint ({run}/checkpoints/step-"),
    (signal.SIGINT, 0, " before any checkpoint was written (checkpoint.every sets how often one is); start again with "
                       "the same command and --overwrite"),
], ids=["SIGTERM", "Ctrl-C"])
def test_a_signal_ends_in_one_line_that_says_how_to_go_on(tmp_path, sig, every, said):
    """SIGTERM to the launcher of a run that does not save on it (checkpoint.save_on_signals = []; test_preemption.py
    has those that do) after a checkpoint: resume from it. Ctrl-C (SIGINT to the terminal's process group, which the
    launcher forwards to its ranks) before any: start again (--resume would be refused)."""
    run = tmp_path / "run"
    args = ["train", tiny_toml(tmp_path), "--nproc", 2, "--run-dir", run, "--set", "train.steps=400",
            "--set", f"checkpoint.every={every}", "--set", "checkpoint.save_on_signals=[]"]
    launcher = subprocess.Popen([sys.executable, "-m", "snnfw", *map(str, args)], cwd=ROOT, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)  # its own process group, as a terminal's job
    deadline = time.monotonic() + 180

    def started() -> bool:  # a whole checkpoint (its temporary folder is not one yet), or a first step
        if every:
            return bool(rundir.complete_checkpoints(run / rundir.CHECKPOINTS))
        return (run / rundir.METRICS).exists() and bool((run / rundir.METRICS).read_text())

    while not started():
        assert launcher.poll() is None and time.monotonic() < deadline, "the run did not start its steps"
        time.sleep(0.5)
    if sig == signal.SIGINT:
        os.killpg(launcher.pid, sig)
    else:
        launcher.send_signal(sig)
    _, stderr = launcher.communicate(timeout=120)
    assert launcher.returncode == 128 + sig
    assert "Traceback" not in stderr, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(f"snnfw: error: stopped by {sig.name}{said.format(run=run)}"), last


def test_a_run_directory_that_is_a_file_is_refused_before_launch(tmp_path, capsys):
    (tmp_path / "taken").write_text("not a folder")
    result = in_process(capsys, "train", tiny_toml(tmp_path), "--nproc", 2, "--run-dir", tmp_path / "taken")
    assert result.returncode == 2
    assert "is a file, not a folder" in one_error_line(result)


def test_a_checkpoints_folder_that_cannot_be_written_is_refused_before_launch(tmp_path, capsys):
    """/sys refuses a new folder to root as to anyone: a read-only checkpoints folder."""
    run = tmp_path / "run"
    run.mkdir()
    (run / rundir.CHECKPOINTS).symlink_to("/sys")
    result = in_process(capsys, "train", tiny_toml(tmp_path), "--nproc", 2, "--run-dir", run, "--set",
                        "checkpoint.every=1", "--set", "checkpoint.async_save=true")
    assert result.returncode == 2
    assert one_error_line(result) == (
        f"snnfw: error: checkpoint.every = 1 writes checkpoints into {run / rundir.CHECKPOINTS}, which cannot be "
        "written (Operation not permitted); make it a folder you can write, or choose another --run-dir")
    assert not (run / rundir.PLAN).exists()  # refused before any rank started


def test_bench_refuses_zero_timed_steps(tmp_path, capsys):
    result = in_process(capsys, "bench", tiny_toml(tmp_path), "--nproc", 2, "--steps", 0,
                        "--results", tmp_path / "b.jsonl")
    assert result.returncode == 2
    assert "--steps 1 or more" in one_error_line(result)


def test_plot_leaves_out_a_cut_last_line(tmp_path, capsys):
    (tmp_path / rundir.METRICS).write_text('{"step": 1, "loss": 2.3, "lr": 0.01}\n{"step": 2, "lo')
    result = in_process(capsys, "plot", tmp_path, "--out", tmp_path / "run.png")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "run.png").stat().st_size > 0 and "cut off" in result.stderr


def test_a_training_config_scores_weights_under_another_strategy(tmp_path):
    """eval takes what it needs of a training config: its checkpoints and training microbatches do not apply."""
    from snnfw.plan.prepare import build_model
    from snnfw.plugin.manager import Plugins

    model, _ = build_model(tiny_config(), Plugins())
    torch.save(model.state_dict(), tmp_path / "net.pt")
    training = ["--set", "train.microbatches=8", "--set", "checkpoint.every=2"]  # 8 samples in 8 microbatches
    result, _ = snnfw("eval", tiny_toml(tmp_path), "--weights", tmp_path / "net.pt", "--nproc", 2, *training,
                      "--run-dir", tmp_path / "scored")
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "scored" / rundir.EVAL).read_text())["plan"]["preset"] == "dp"


def test_export_refuses_a_folder_as_its_output(tmp_path, capsys):
    run_training(tiny_config("none", checkpoint={"every": 3}), tmp_path / "run")
    capsys.readouterr()
    result = in_process(capsys, "export", tmp_path / "run", "--out", tmp_path)
    assert result.returncode == 2
    assert "is a folder; name the file to write" in one_error_line(result)
    result = in_process(capsys, "export", tmp_path / "run", "--out", tmp_path / "net.pt")
    assert result.returncode == 0 and torch.load(tmp_path / "net.pt", weights_only=True)


def test_measure_refuses_zero_candidates(tmp_path, capsys):
    result = in_process(capsys, "plan", tiny_toml(tmp_path), "--world-size", 2, "--set", "parallel.strategy='auto'",
                        "--measure", 0)
    assert result.returncode == 2
    assert "--measure K" in one_error_line(result)


def test_predictions_of_a_float64_model_keep_float64_logits(tmp_path):
    """Logits are written as the model computed them: equal to the module's own float64 forward, and after float64
    training most of them are not float32 numbers."""
    from spikingjelly.activation_based import functional

    from snnfw.plan.prepare import build_datasets, build_model
    from snnfw.plugin.manager import Plugins
    from snnfw.run.loop import run_evaluation

    exact = tiny_config("none", train={"dtype": "float64", "steps": 2})
    run_training(exact, tmp_path / "run")
    run_evaluation(exact, tmp_path / "run" / rundir.FINAL_MODEL, predict=tmp_path / "rows.jsonl")
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    model, spec = build_model(exact, Plugins())
    model = model.double().eval()
    model.load_state_dict(torch.load(tmp_path / "run" / rundir.FINAL_MODEL, weights_only=True))
    test_set = build_datasets(exact, spec, Plugins())[1]
    frames = torch.stack([test_set[row["index"]][0] for row in rows]).double()
    with torch.no_grad():
        functional.reset_net(model)
        own = model(frames).mean(0)  # [N, T, ...] in, [T, N, classes] out
    written = torch.tensor([row["logits"] for row in rows], dtype=torch.float64)
    assert torch.allclose(written, own, rtol=1e-12, atol=0)
    logits = written.flatten().tolist()
    rounded = written.float().double().flatten().tolist()
    assert sum(value != single for value, single in zip(logits, rounded)) > len(logits) / 2


@pytest.mark.parametrize("body, refused", [
    ("def build(:\n", r"model.builder: .*net.py, line 1: .*; correct the file"),
    ("raise RuntimeError('no GPU here')\n", r"importing .*net.py raised RuntimeError: no GPU here; correct the module"),
    ("import not_installed_anywhere\n", r"imports 'not_installed_anywhere', which is not installed"),
    ("def build():\n    raise ValueError('bad width')\n", r"building .*net.py:build raised ValueError: bad width"),
])
def test_a_builder_that_fails_is_refused_in_one_line(tmp_path, body, refused):
    from snnfw.config import build_config
    from snnfw.errors import ConfigError
    from snnfw.plan.prepare import build_model
    from snnfw.plugin.manager import Plugins

    (tmp_path / "net.py").write_text(body)
    document = {section: dict(table) for section, table in TINY.items()}
    document["model"] = {"builder": f"{tmp_path / 'net.py'}:build", "input_shape": [2, 32, 32], "num_classes": 10,
                         "time_steps": TINY["model"]["time_steps"]}
    with pytest.raises(ConfigError, match=refused):
        build_model(build_config(document), Plugins())


def assert_whole_or_absent(run: Path) -> None:
    """Every file a run writes parses whole; only files with the temporary prefix may be cut, and the last line of
    the metrics (which resume drops)."""
    from torch.distributed.checkpoint import FileSystemReader

    for path in sorted(run.rglob("*")):
        if rundir.TEMP_PREFIX in str(path.relative_to(run)) or path.is_dir() or rundir.RANKS in path.parts:
            continue
        if path.name == rundir.METRICS:
            lines = path.read_text().splitlines()
            [json.loads(line) for line in lines[:-1]]
        elif path.suffix == ".json":
            json.loads(path.read_text())
        elif path.suffix == ".pt":
            torch.load(path, weights_only=True)
    for step in rundir_checkpoints(run):
        FileSystemReader(step).read_metadata()


def running(pid: int) -> bool:
    with contextlib.suppress(FileNotFoundError):
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()  # a zombie has ended
    return False


def test_the_ranks_of_a_killed_launcher_end_with_it(tmp_path):
    """torch's launcher starts each rank in a session of its own; a rank whose launcher is gone ends instead of
    training on as an orphan that writes into the run directory."""
    run = tmp_path / "run"
    args = ["train", tiny_toml(tmp_path), "--nproc", 2, "--run-dir", run, "--set", "train.steps=400"]
    launcher = subprocess.Popen([sys.executable, "-m", "snnfw", *map(str, args)], cwd=ROOT, stderr=subprocess.DEVNULL,
                                start_new_session=True)
    deadline = time.monotonic() + 180
    while not ((run / rundir.METRICS).exists() and (run / rundir.METRICS).read_text()):
        assert launcher.poll() is None and time.monotonic() < deadline, "the run did not start its steps"
        time.sleep(0.2)
    ranks = rundir.local_rank_pids(run)
    os.killpg(launcher.pid, signal.SIGKILL)
    launcher.wait(timeout=60)
    killed = time.monotonic()
    while any(map(running, ranks.values())) and time.monotonic() < killed + 30:
        time.sleep(0.1)
    assert sorted(ranks) == [0, 1] and not any(map(running, ranks.values())), "orphaned ranks train on"
    written = (run / rundir.METRICS).read_text()
    time.sleep(2)
    assert (run / rundir.METRICS).read_text() == written


def rundir_checkpoints(run: Path) -> list[Path]:
    folder = run / rundir.CHECKPOINTS
    return [p for p in folder.iterdir() if not p.name.startswith(rundir.TEMP_PREFIX)] if folder.is_dir() else []


def test_a_run_killed_at_random_moments_resumes_to_the_uninterrupted_final_model(tmp_path):
    """The launcher and its ranks killed at once (SIGKILL, as a lost machine) at moments drawn over the steps,
    checkpoints, validations, exports and the summary: after each kill every file is whole or absent, and the run
    resumed each time ends with the uninterrupted run's final model, bit for bit in float64."""
    settings = ["train.steps=12", 'train.dtype="float64"', "checkpoint.every=2", "eval.every=3"]
    config = tiny_toml(tmp_path)

    def start(run: Path, *flags):
        args = ["train", config, "--nproc", 2, "--run-dir", run, *flags, *[a for s in settings for a in ("--set", s)]]
        return subprocess.Popen([sys.executable, "-m", "snnfw", *map(str, args)], cwd=ROOT, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)

    def steps_began(run: Path, since: float) -> bool:
        metrics = run / rundir.METRICS
        return metrics.exists() and metrics.stat().st_mtime > since

    whole = start(tmp_path / "whole")
    began = time.time()
    while not steps_began(tmp_path / "whole", began) and whole.poll() is None:
        time.sleep(0.05)
    first_step = time.monotonic()
    while not (tmp_path / "whole" / rundir.SUMMARY).exists() and whole.poll() is None:
        time.sleep(0.02)
    span = time.monotonic() - first_step  # from the first metrics line to the summary, the last file written
    assert whole.wait(timeout=300) == 0, whole.stderr.read()

    cut, draws, kills = tmp_path / "cut", random.Random(37), 0
    while True:
        saved = [int(p.name.split("-")[1]) for p in rundir_checkpoints(cut)]
        flags = ["--resume"] if saved else ["--overwrite"]
        launcher, launched = start(cut, *flags), time.time()
        if kills == 4:
            assert launcher.wait(timeout=300) == 0, launcher.stderr.read()
            break
        while not steps_began(cut, launched) and launcher.poll() is None:
            time.sleep(0.02)
        time.sleep(draws.uniform(0, span) * (1 - max(saved, default=0) / 12))  # a moment of the steps left
        for pid in [launcher.pid, *rundir.local_rank_pids(cut).values()]:  # each rank runs in a session of its own
            with contextlib.suppress(ProcessLookupError):  # the run may have ended by then
                os.killpg(pid, signal.SIGKILL)
        launcher.wait(timeout=60)
        kills += 1
        assert_whole_or_absent(cut)
    for name in (rundir.FINAL_MODEL, rundir.BEST_MODEL):
        expected, resumed = (torch.load(run / name, weights_only=True) for run in (tmp_path / "whole", cut))
        assert expected.keys() == resumed.keys() and all(torch.equal(expected[k], resumed[k]) for k in expected), name
    assert json.loads((cut / rundir.SUMMARY).read_text())["losses"] == json.loads(
        (tmp_path / "whole" / rundir.SUMMARY).read_text())["losses"]


UNWRITABLE = Path("/proc/snnfw-cannot-write-here")  # refused to root as to anyone


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A run directory with a checkpoint and metrics, and the weights of its model."""
    folder = tmp_path_factory.mktemp("finished")
    run_training(tiny_config("none", checkpoint={"every": 3}), folder / "run")
    return folder / "run"


@pytest.mark.parametrize("command, said", [
    (lambda run, toml, out: ["export", run, "--out", out / "net.pt"], "--out {out}/net.pt cannot be written"),
    (lambda run, toml, out: ["export", run, "--out", out.parent], "--out {parent} is a folder"),
    (lambda run, toml, out: ["plot", run, "--out", out / "run.png"], "--out {out}/run.png cannot be written"),
    (lambda run, toml, out: ["bench", toml, "--results", out / "bench.jsonl"],
     "--results {out}/bench.jsonl cannot be written"),
    (lambda run, toml, out: ["predict", toml, "--nproc", 2, "--weights", run / rundir.FINAL_MODEL,
                             "--out", out / "rows.jsonl"],
     "--out {out}/rows.jsonl cannot be written"),
    (lambda run, toml, out: ["eval", toml, "--nproc", 2, "--weights", run / rundir.FINAL_MODEL,
                             "--run-dir", out / "scored"],
     "--run-dir {out}/scored cannot be written"),
    (lambda run, toml, out: ["eval", toml, "--nproc", 2, "--weights", run / rundir.FINAL_MODEL, "--run-dir", toml],
     "--run-dir {toml} is a file, not a folder"),
], ids=["export", "export-folder", "plot", "bench", "predict", "eval", "eval-file"])
def test_an_output_that_cannot_be_written_is_refused_before_any_work(finished_run, tmp_path, command, said, capsys):
    toml = tiny_toml(tmp_path)
    result = in_process(capsys, *command(finished_run, toml, UNWRITABLE))
    assert result.returncode == 2
    assert said.format(out=UNWRITABLE, parent=UNWRITABLE.parent, toml=toml) in one_error_line(result)


def test_scoring_into_the_run_directory_of_a_run_in_progress_is_refused(finished_run, tmp_path, capsys):
    """eval clears the launch markers of its run directory, so it must not share one with a training that runs."""
    with rundir.locked(tmp_path / "training"):
        result = in_process(capsys, "eval", tiny_toml(tmp_path), "--nproc", 2, "--weights",
                            finished_run / rundir.FINAL_MODEL, "--run-dir", tmp_path / "training")
    assert result.returncode == 2
    assert f"{tmp_path / 'training'} belongs to a run in progress (pid {os.getpid()}" in one_error_line(result)
