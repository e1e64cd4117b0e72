"""snnfw train plans once: the launcher parses the config, builds, analyses and plans (auto's measurement included),
and writes plan.json; each rank reads it, builds its model and data sets once, and plans nothing again. A rank
refuses, in one line, a plan file changed since, made for a config changed since, or made under other plugins."""

import json
import os
import subprocess
import sys
from collections import Counter

import pytest

from snnfw import train

NETS = '''
import os
from pathlib import Path

import torch
from spikingjelly.activation_based import functional, layer, neuron
from torch import nn


def count(what):
    with open(Path(__file__).with_name("counts.txt"), "a") as counts:
        counts.write(f"{what} {os.getpid()}\\n")


def mlp():
    count("model")
    net = nn.Sequential(layer.Flatten(), layer.Linear(128, 16), neuron.LIFNode(), layer.Linear(16, 10), neuron.LIFNode())
    functional.set_step_mode(net, "m")
    return net


class Frames(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, index):
        return (torch.rand(4, 2, 8, 8, generator=torch.Generator().manual_seed(index)) < 0.2).float(), index % 10


def data():
    count("data")
    return Frames(), Frames()
'''
COUNTING = '''
from nets import count

from snnfw import hookimpl


@hookimpl
def snnfw_analyze(model, family):
    count("analyze")


@hookimpl
def snnfw_plan(request):
    count("plan")
'''
SITE = '''
import tomllib

_loads = tomllib.loads


def loads(text, **options):
    if "plan-once" in text:
        from nets import count

        count("config")
    return _loads(text, **options)


tomllib.loads = loads
'''
CONFIG = """# plan-once
[model]
builder = "nets.py:mlp"
input_shape = [2, 8, 8]
num_classes = 10
time_steps = 4
[data]
builder = "nets.py:data"
batch_size = 8
[parallel]
strategy = "auto"
[train]
epochs = 1
"""


def test_the_launcher_plans_once_and_each_rank_builds_its_model_once(tmp_path, monkeypatch, capsys):
    for name, text in (("nets.py", NETS), ("counting.py", COUNTING), ("sitecustomize.py", SITE), ("own.toml", CONFIG)):
        (tmp_path / name).write_text(text)
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
           "SNNFW_PLUGINS": "counting"}
    launcher = subprocess.Popen([sys.executable, "-m", "snnfw", "train", "own.toml", "--nproc", "2", "--run-dir",
                                 str(run_dir)], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    try:
        _, stderr = launcher.communicate(timeout=240)
    finally:
        launcher.kill()  # past the timeout; its ranks end with it
    assert launcher.returncode == 0, stderr[-3000:]
    counts = Counter(tuple(line.split()) for line in (tmp_path / "counts.txt").read_text().splitlines())
    ranks = {pid for _, pid in counts} - {str(launcher.pid)}
    assert len(ranks) == 2, counts
    mine = {what: n for (what, pid), n in counts.items() if pid == str(launcher.pid)}
    assert mine.pop("plan") >= 1 and mine == {"config": 1, "model": 1, "data": 1, "analyze": 1}, counts
    for rank in ranks:  # no config parsed, no analysis, no proposal (nor auto's measurement): the model and data once
        assert {what: n for (what, pid), n in counts.items() if pid == rank} == {"model": 1, "data": 1}, counts
    summary = json.loads((run_dir / "summary.json").read_text())
    plan = json.loads((run_dir / "plan.json").read_text())["plan"]
    assert summary["plan"]["strategy"] == plan["strategy"] and summary["config"] == plan["config"]
    assert summary["config"]["model"]["input_layout"] == "TN" and summary["steps"] == 2  # inferred and counted once

    def refusal() -> str:
        assert train.main(["own.toml", "--run-dir", str(run_dir), "--plan", str(run_dir / "plan.json")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("snnfw: error: "), err
        return err.removeprefix("snnfw: error: ").strip()

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SNNFW_PLUGINS", raising=False)
    assert refusal().startswith(f"plugin 'counting' was loaded when snnfw train planned the run ({run_dir / 'plan.json'}) "
                                "and is not on this rank")
    monkeypatch.setenv("SNNFW_PLUGINS", "counting")
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "own.toml").write_text(CONFIG.replace("batch_size = 8", "batch_size = 4"))
    assert refusal().startswith("the config changed after snnfw train planned this run")
    (tmp_path / "own.toml").write_text(CONFIG)
    document = json.loads((run_dir / "plan.json").read_text())
    document["plan"]["config"]["train"]["lr"] *= 10
    (run_dir / "plan.json").write_text(json.dumps(document))
    assert refusal() == (f"{run_dir / 'plan.json'} was changed after snnfw train wrote it; start the run with snnfw train "
                         "again, which plans it anew")
    for module in ("counting", "nets"):  # imported here from this test's folder
        sys.modules.pop(module, None)


SCRIPT = '''
import snnfw

with snnfw.start("own.toml") as run:
    for step in range(run.start_step, run.config.train.steps):
        run.step(step)
'''


@pytest.mark.parametrize("command", [["-m", "snnfw.train", "own.toml"], ["own_loop.py"]], ids=["snnfw.train", "start"])
def test_under_plain_torchrun_rank_0_plans_once_and_the_other_rank_only_builds(tmp_path, command):
    """No launcher plans for them: rank 0 parses, builds, analyses and plans (auto's measurement included) and hands
    the plan on; rank 1 parses its config (checked against rank 0's) and builds its model and data sets once."""
    for name, text in (("nets.py", NETS), ("counting.py", COUNTING), ("sitecustomize.py", SITE), ("own.toml", CONFIG),
                       ("own_loop.py", SCRIPT)):
        (tmp_path / name).write_text(text)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
           "SNNFW_PLUGINS": "counting"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", *command], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    counts = Counter(tuple(line.split()) for line in (tmp_path / "counts.txt").read_text().splitlines())
    by_rank = {}
    for (what, pid), n in counts.items():
        by_rank.setdefault(pid, {})[what] = n
    planners = [pid for pid, seen in by_rank.items() if "plan" in seen]
    assert len(by_rank) == 2 and len(planners) == 1, counts
    planner = by_rank.pop(planners[0])
    assert planner.pop("plan") >= 1 and planner == {"config": 1, "model": 1, "data": 1, "analyze": 1}, counts
    assert list(by_rank.values()) == [{"config": 1, "model": 1, "data": 1}], counts


SLOW_PLAN = '''
import time

from snnfw import hookimpl


@hookimpl
def snnfw_plan(request):
    time.sleep(12)  # rank 0 plans for longer than parallel.timeout_s
'''


def test_the_other_ranks_wait_for_rank_0_s_plan_longer_than_the_collectives_timeout(tmp_path):
    """parallel.timeout_s = 5 bounds the run's collectives, not the wait for rank 0 to plan (auto measures a
    model for tens of seconds): ranks planned for 12 s train to the end."""
    for name, text in (("nets.py", NETS), ("slow.py", SLOW_PLAN), ("own.toml", CONFIG.replace(
            'strategy = "auto"', 'strategy = "dp"\ntimeout_s = 5'))):
        (tmp_path / name).write_text(text)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
           "SNNFW_PLUGINS": "slow"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "snnfw.train",
                           "own.toml"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
