"""parallel.fault_tolerance: replica groups of dp_replicate as torchft replicas, beside a lighthouse on loopback."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from snnfw.config import load_config
from snnfw.testing import run_on_ranks

pytest.importorskip("torchft", reason="torchft is not installed (pip install 'snnfw[ft]')")

NET = '''
import os

from torch import nn
from spikingjelly.activation_based import layer, neuron


class DieAt(nn.Module):
    """Ends the process inside a step, at its DIE_AT_FORWARD-th forward pass (never without it)."""
    calls = 0

    def forward(self, x):
        DieAt.calls += 1
        if str(DieAt.calls) == os.environ.get("DIE_AT_FORWARD"):
            os._exit(1)
        return x


def build():
    return nn.Sequential(layer.Flatten(step_mode="m"), layer.Linear(2 * 8 * 8, 16, step_mode="m"),
                         neuron.LIFNode(step_mode="m"), DieAt(), layer.Linear(16, 4, step_mode="m"))
'''
CONFIG = '''
[model]
builder = "net.py:build"
input_shape = [2, 8, 8]
num_classes = 4
input_layout = "TN"
time_steps = 2

[data]
name = "synthetic_dvs"
batch_size = 8
train_samples = 64
test_samples = 16

[parallel]
mesh = {{dp_replicate = 2}}
device = "cpu"
{fault_tolerance}

[train]
steps = {steps}
microbatches = 2
clip_grad_norm = 0.3
lr = 0.01
seed = 3
log_every = 1
dtype = "float64"
'''
TIMEOUT_S = 240  # each process; the runs take seconds


def write_config(folder: Path, steps: int, fault_tolerance: str) -> Path:
    (folder / "net.py").write_text(NET)
    path = folder / ("ft.toml" if fault_tolerance else "dp.toml")
    path.write_text(CONFIG.format(steps=steps, fault_tolerance=fault_tolerance))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def lighthouse(request):
    """A torchft lighthouse on loopback for ``min_replicas`` groups; its address."""
    min_replicas = request.param
    port = free_port()
    binary = Path(sys.executable).parent / "torchft_lighthouse"
    process = subprocess.Popen([str(binary), "--min_replicas", str(min_replicas), "--bind", f"[::]:{port}",
                                "--join_timeout_ms", "1000", "--heartbeat_timeout_ms", "1000"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    yield f"http://127.0.0.1:{port}"
    process.kill()
    process.wait(timeout=30)


def group(config: Path, index: int, run_dir: Path, lighthouse: str, **env) -> subprocess.Popen:
    """One replica group: a process of its own, as a torchrun of one rank would start it. Its standard error goes to
    a file (:func:`ended` reads it), never to a pipe: torchft logs about a kilobyte a step there, and a group whose
    pipe is not read while it trains (these tests wait for one group at a time) stops in a write once the pipe holds
    64 KiB, its heartbeats to the lighthouse with it."""
    cmd = [sys.executable, "-m", "snnfw.train", str(config), "--run-dir", str(run_dir), "--overwrite"]
    env = {**os.environ, "TORCHFT_LIGHTHOUSE": lighthouse, "REPLICA_GROUP_ID": str(index), **env}
    log = run_dir.with_name(f"{run_dir.name}.stderr")
    with open(log, "w") as err:
        process = subprocess.Popen(cmd, env=env, cwd=config.parent, stdout=subprocess.DEVNULL, stderr=err)
    process.log = log
    return process


def ended(process: subprocess.Popen) -> str:
    """Waits for a group to end; its standard error."""
    process.wait(timeout=TIMEOUT_S)
    return process.log.read_text()


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def final_state(run_dir: Path) -> dict:
    return torch.load(run_dir / "final_model.pt")


def finish(process: subprocess.Popen) -> str:
    """Waits for a group that must end well; its standard error."""
    err = ended(process)
    assert process.returncode == 0, err[-3000:]
    return err


@pytest.mark.parametrize("lighthouse", [2], indirect=True)
def test_with_every_group_present_the_float64_losses_and_weights_equal_plain_dp_replicate(tmp_path, lighthouse):
    steps = 6
    groups = [group(write_config(tmp_path, steps, 'fault_tolerance = {min_replicas = 2}'), i, tmp_path / f"g{i}",
                    lighthouse) for i in range(2)]
    for process in groups:
        finish(process)
    plain = load_config(write_config(tmp_path, steps, ""))
    run_on_ranks(plain, 2, tmp_path / "dp", timeout_s=TIMEOUT_S)
    expected = [r["loss"] for r in records(tmp_path / "dp")]
    first, second = ([r["loss"] for r in records(tmp_path / f"g{i}")] for i in range(2))
    assert len(expected) == len(first) == len(second) == steps
    for a, b, want in zip(first, second, expected):  # each group logs its own samples: dp's loss is their mean
        assert abs((a + b) / 2 - want) <= 1e-12 * abs(want), (first, second, expected)
    norms = [r["grad_norm"] for r in records(tmp_path / "dp")]
    assert sum(norm > 0.3 for norm in norms) >= 2  # clipped steps among them
    for name in ("g0", "g1"):  # the averaged gradient's norm, the same in every group
        assert [r["grad_norm"] for r in records(tmp_path / name)] == pytest.approx(norms, rel=1e-12)
    assert all(r["ft_groups"] == 2 for r in records(tmp_path / "g0"))
    states = [final_state(tmp_path / name) for name in ("g0", "g1", "dp")]
    for name, value in states[2].items():
        assert torch.equal(states[0][name], value) and torch.equal(states[1][name], value), name


@pytest.mark.parametrize("lighthouse", [1], indirect=True)
def test_a_killed_group_drops_out_the_other_goes_on_and_the_relaunched_group_rejoins_from_it(tmp_path, lighthouse):
    """Group 1 dies before step 10; group 0 trains on alone without a restart; group 1 started again takes group
    0's state at its first quorum, goes on at group 0's step and ends with group 0's weights."""
    steps, config = 70, write_config(tmp_path, 70, "fault_tolerance = {min_replicas = 1, timeout_s = 10}")
    # both groups in the first quorum: with min_replicas = 1 the lighthouse waits for no group it has not heard of, and
    # group 1 (not slowed) would train its 9 steps alone, and die, before group 0 came on a loaded machine
    faults = {"SNNFW_PLUGINS": "snnfw.testing.faults", "SNNFW_TEST_START_TOGETHER": f"{tmp_path / 'started'}:2"}
    # group 0 alone takes 30 s for the steps after the kill, time for the relaunch on a loaded machine (4 to 20 s here)
    healthy = group(config, 0, tmp_path / "g0", lighthouse, **faults, SNNFW_TEST_SLOW_STEPS="0.5")
    doomed = group(config, 1, tmp_path / "g1", lighthouse, **faults, SNNFW_TEST_CRASH_AT_STEP="10",
                   SNNFW_TEST_FAULT_RANK="0")
    err = ended(doomed)
    killed = time.monotonic()
    assert doomed.returncode == 1 and "test fault: rank 0 exits before step 10" in err, err[-3000:]
    assert healthy.poll() is None, "group 0 ended with group 1"
    rejoined = group(config, 1, tmp_path / "g1-again", lighthouse)
    deadline = killed + TIMEOUT_S
    while not records(tmp_path / "g1-again") and time.monotonic() < deadline and rejoined.poll() is None:
        time.sleep(0.05)
    recovery_s = time.monotonic() - killed
    assert healthy.poll() is None, f"group 0 finished before group 1 rejoined ({recovery_s:.1f} s after the kill)"
    finish(healthy)
    finish(rejoined)
    print(f"recovery: {recovery_s:.1f} s from group 1's death to its first step after the relaunch")
    alone, before, again = (records(tmp_path / name) for name in ("g0", "g1", "g1-again"))
    # group 1's steps with group 0 (step 9's record is written as step 10 begins, which it did not)
    assert [(r["step"], r["ft_groups"]) for r in before] == [(step, 2) for step in range(1, 9)]
    assert [r["step"] for r in alone] == list(range(1, steps + 1))  # no step lost, none repeated, no restart
    assert again[0]["step"] > 10 and again[-1]["step"] == steps  # the peers' step, not step 1
    back = again[0]["step"]  # group 0 trained alone from group 1's death until its return
    assert [r["ft_groups"] for r in alone] == [1 if 10 <= step < back else 2 for step in range(1, steps + 1)]
    assert all(r["ft_groups"] == 2 for r in again)  # healed before its first step's forward, it trains that step
    theirs, mine = final_state(tmp_path / "g0"), final_state(tmp_path / "g1-again")
    assert all(torch.equal(theirs[name], mine[name]) for name in theirs)


@pytest.mark.parametrize("lighthouse", [1], indirect=True)
def test_a_group_that_dies_inside_a_step_fails_that_step_which_the_other_trains_again_alone(tmp_path, lighthouse):
    """Group 1 ends in a forward pass while group 0 waits for it in the gradients' all-reduce: group 0's step does
    not commit, and it trains that step again alone, then every step after, each step once."""
    steps, config = 24, write_config(tmp_path, 24, "fault_tolerance = {min_replicas = 1, timeout_s = 10}")
    faults = {"SNNFW_PLUGINS": "snnfw.testing.faults", "SNNFW_TEST_SLOW_STEPS": "0.25",
              "SNNFW_TEST_START_TOGETHER": f"{tmp_path / 'started'}:2"}  # both in the first quorum, as above
    healthy = group(config, 0, tmp_path / "g0", lighthouse, **faults)
    doomed = group(config, 1, tmp_path / "g1", lighthouse, **faults, DIE_AT_FORWARD="20")
    ended(doomed)
    err = finish(healthy)
    assert doomed.returncode == 1
    assert err.count("should_commit completed should_commit=false") == 1  # the step group 1 left, not committed
    died_after = records(tmp_path / "g1")[-1]["step"]  # its last step whole; it died in the next
    alone = records(tmp_path / "g0")
    assert [r["step"] for r in alone] == list(range(1, steps + 1))
    assert [r["ft_groups"] for r in alone] == [2] * died_after + [1] * (steps - died_after)


@pytest.mark.parametrize("lighthouse", [2], indirect=True)
@pytest.mark.parametrize("missing", ["lighthouse", "quorum"])
def test_a_group_without_its_lighthouse_or_its_quorum_ends_in_one_line(tmp_path, lighthouse, missing):
    config = write_config(tmp_path, 4, "fault_tolerance = {min_replicas = 2, timeout_s = 3}")
    address = f"http://127.0.0.1:{free_port()}" if missing == "lighthouse" else lighthouse  # min_replicas = 2, one group
    process = group(config, 0, tmp_path / "g0", address)
    err = ended(process)
    last = err.strip().splitlines()[-1]
    assert process.returncode == 1 and "Traceback" not in err, err[-3000:]
    if missing == "lighthouse":
        assert last == (f"snnfw: error: replica group 0 reached no lighthouse at {address} within 3 s (parallel."
                        "fault_tolerance.timeout_s); start torchft_lighthouse there, or give parallel.fault_tolerance."
                        "lighthouse its address")
    else:
        assert last.startswith(f"snnfw: error: replica group 0 found no quorum of parallel.fault_tolerance.min_replicas "
                               f"= 2 groups at {address} within 3 s"), last


def test_groups_that_start_the_lighthouse_start_one_that_outlives_them(tmp_path):
    address = f"http://127.0.0.1:{free_port()}"
    config = write_config(tmp_path, 4, 'fault_tolerance = {min_replicas = 2, start_lighthouse = true}')
    groups = [group(config, i, tmp_path / f"g{i}", address) for i in range(2)]
    errs = [ended(process) for process in groups]
    assert [process.returncode for process in groups] == [0, 0], errs
    started = [line for err in errs for line in err.splitlines() if "started torchft's lighthouse" in line]
    assert len(started) == 1, errs  # the other group joined it
    pid = int(started[0].split("(pid ")[1].split(")")[0])
    try:
        os.kill(pid, 0)  # alive after both groups ended
    finally:
        os.kill(pid, 9)
    assert [r["ft_groups"] for r in records(tmp_path / "g1")] == [2] * 4
