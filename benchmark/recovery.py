"""Recovery time after a process dies: parallel.fault_tolerance (torchft) beside snnfw's elastic restart.

    python benchmark/recovery.py [--repeats 2]

Both train a tiny float64 model (0.25 s a step, SNNFW_TEST_SLOW_STEPS) as 2 replicas of one CPU rank each, and
the second replica's process exits before step 10:

- torchft: the lighthouse, two groups that take their first step together; the dead group is started again at once. Recovery: from its death to the
  first record of the relaunched group (its metrics.jsonl), which joined at its peer's step.
- elastic: snnfw train --nproc 2 --max-restarts 1 with checkpoint.every = 5. Recovery: from the fault's message to
  rank 0's progress line of step 6, the first step after the resume from step 5 (steps 6 to 9 are trained again).
"""

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

NET = '''from torch import nn
from spikingjelly.activation_based import layer, neuron


def build():
    return nn.Sequential(layer.Flatten(step_mode="m"), layer.Linear(2 * 8 * 8, 16, step_mode="m"),
                         neuron.LIFNode(step_mode="m"), layer.Linear(16, 4, step_mode="m"))
'''
CONFIG = '''[model]
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
mesh = {dp_replicate = 2}
device = "cpu"
[train]
steps = 80
lr = 0.01
seed = 3
log_every = 1
dtype = "float64"
'''
SLOW = {"SNNFW_PLUGINS": "snnfw.testing.faults", "SNNFW_TEST_SLOW_STEPS": "0.25", "OMP_NUM_THREADS": "1"}
CRASH = {"SNNFW_TEST_CRASH_AT_STEP": "10"}


def torchft_recovery(folder: Path) -> float:
    for name in ("g0", "g1", "g1-again", "together"):  # a record left by an earlier repeat would end the wait at once
        shutil.rmtree(folder / name, ignore_errors=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    lighthouse = subprocess.Popen([str(Path(sys.executable).parent / "torchft_lighthouse"), "--min_replicas", "1",
                                   "--bind", f"[::]:{port}", "--join_timeout_ms", "1000", "--heartbeat_timeout_ms", "1000"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env = {**os.environ, **SLOW, "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}"}

    def group(index: int, run_dir: str, **extra) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "snnfw.train", "ft.toml", "--run-dir", run_dir, "--overwrite"],
                                cwd=folder, env={**env, "REPLICA_GROUP_ID": str(index), **extra},
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        together = {"SNNFW_TEST_START_TOGETHER": f"{folder / 'together'}:2"}  # else one may train alone, and end
        healthy, doomed = group(0, "g0", **together), group(1, "g1", **CRASH, **together, SNNFW_TEST_FAULT_RANK="0")
        doomed.wait()
        died = time.monotonic()
        again = group(1, "g1-again")
        metrics = folder / "g1-again" / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text()):
            time.sleep(0.02)
        recovered = time.monotonic() - died
        healthy.wait()
        again.wait()
        alone = [r["step"] for r in map(json.loads, (folder / "g0" / "metrics.jsonl").read_text().splitlines())
                 if r["ft_groups"] == 1]
        print(f"torchft: {recovered:.1f} s; the healthy group trained steps {alone[0]}-{alone[-1]} alone", flush=True)
        return recovered
    finally:
        lighthouse.kill()


def elastic_recovery(folder: Path) -> float:
    cmd = [sys.executable, "-m", "snnfw", "train", "dp.toml", "--nproc", "2", "--max-restarts", "1", "--run-dir",
           "elastic", "--overwrite", "--set", "checkpoint.every=5"]
    run = subprocess.Popen(cmd, cwd=folder, env={**os.environ, **SLOW, **CRASH}, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    times = {}

    def watch_errors() -> None:
        for line in run.stderr:
            if "test fault" in line:
                times["died"] = time.monotonic()

    threading.Thread(target=watch_errors, daemon=True).start()
    for line in run.stdout:
        if "died" in times and "back" not in times and line.startswith("[snnfw] step 6/"):
            times["back"] = time.monotonic()
    run.wait()
    recovered = times["back"] - times["died"]
    print(f"elastic restart: {recovered:.1f} s, then steps 6-9 trained again", flush=True)
    return recovered


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="snnfw-recovery-"))
    try:
        (folder / "net.py").write_text(NET)
        (folder / "dp.toml").write_text(CONFIG)
        (folder / "ft.toml").write_text(CONFIG.replace('device = "cpu"\n', 'device = "cpu"\nfault_tolerance = {}\n'))
        for _ in range(args.repeats):
            torchft_recovery(folder)
            elastic_recovery(folder)
    finally:
        shutil.rmtree(folder)


if __name__ == "__main__":
    main()
