"""A model and data of the user's own, checked before launch: every mistake is one line, exit status 2, and no rank
starts (the run directory stays empty); a layout left at its default is inferred."""

import subprocess
import sys
from pathlib import Path

import pytest

from snnfw.config import build_config
from snnfw.errors import ConfigError
from snnfw.plan.prepare import build_datasets, prepare
from snnfw.plugin.manager import Plugins
from snnfw.run.loop import run_training

NETS = '''
import torch
from spikingjelly.activation_based import functional, layer, neuron
from torch import nn


def mlp(inputs=128):
    """SpikingJelly's multi-step layout: [T, N, C, H, W] in, [T, N, classes] out."""
    net = nn.Sequential(layer.Flatten(), layer.Linear(inputs, 10), neuron.LIFNode())
    functional.set_step_mode(net, "m")
    return net


class Averaged(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = mlp()

    def forward(self, x):
        return self.net(x).mean(0)


def too_narrow():
    return mlp(100)


class Frames(torch.utils.data.Dataset):
    def __init__(self, label):
        self.label = label

    def __len__(self):
        return 16

    def __getitem__(self, index):
        return (torch.rand(4, 2, 8, 8) < 0.2).float(), self.label(index)


def data():
    return Frames(lambda i: i % 10), Frames(lambda i: i % 10)


def float_labels():
    return Frames(lambda i: float(i % 10)), Frames(lambda i: float(i % 10))


def single_step():
    return nn.Sequential(layer.Conv2d(2, 4, 3, padding=1), neuron.LIFNode(), layer.Flatten(), layer.Linear(256, 10))


class Pair(Averaged):
    def forward(self, x):
        return self.net(x), x


class Valued(Averaged):
    def forward(self, x):
        return x if x.sum().item() > 1e9 else self.net(x)  # a value, which a meta tensor has not


def broken():
    return Frames(lambda i: [][i]), Frames(lambda i: [][i])


def eleven():
    return Frames(lambda i: 11), Frames(lambda i: 11)


def corrupt_label(index):
    if index == 1:  # an item the check's sample of labels leaves out
        raise ValueError(f"sample {index} is corrupt")
    return index % 10


def corrupt():
    return Frames(corrupt_label), Frames(corrupt_label)


def refused_label(index):
    if index == 1:
        from snnfw.errors import DataError

        raise DataError(f"sample {index} has no events; remove it from the data set")
    return index % 10


def refusing():
    return Frames(refused_label), Frames(refused_label)


class Strict(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = mlp()

    def forward(self, x):
        if self.training:  # the probe runs in eval mode
            raise RuntimeError("training needs a mask")
        return self.net(x)
'''
CONFIG = """
[model]
builder = "nets.py:mlp"
input_shape = [2, 8, 8]
num_classes = 10
time_steps = 4
[data]
builder = "nets.py:data"
batch_size = 8
[parallel]
strategy = "dp"
[train]
steps = 2
"""


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("own")
    (folder / "nets.py").write_text(NETS)
    (folder / "own.toml").write_text(CONFIG)
    return folder


@pytest.mark.parametrize("overrides, needle", [
    # 2 ranks of 4 samples and T = 4: on main this trained without an error, on the wrong axis
    (["model.input_layout=NT"], 'set model.input_layout = "TN"'),
    (["model.builder=nets.py:Averaged"], "must return logits [T, N, classes] = [4, 2, 10]"),
    (["model.builder=nets.py:too_narrow"], "mat1 and mat2 shapes cannot be multiplied (8x128 and 100x10); make model.input_shape"),
    (["data.builder=nets.py:float_labels"], "has label 0.0 (float); labels are integer class indices: return int(label)"),
    (["data.builder=nets.py:broken"], "item 0 of the train data set raised IndexError: list index out of range (nets.py, "
                                      f"line {next(n for n, text in enumerate(NETS.splitlines(), 1) if '[][i]' in text)}, "
                                      "in <lambda>)"),
], ids=["layout", "averaged-output", "input-shape", "float-labels", "broken-data"])
def test_a_mistake_in_the_own_model_or_data_is_one_line_before_any_rank_starts(folder, overrides, needle):
    run_dir = folder / f"run-{overrides[0]}"
    sets = [arg for item in overrides for arg in ("--set", item)]
    done = subprocess.run([sys.executable, "-m", "snnfw", "train", "own.toml", "--nproc", "2", "--run-dir", str(run_dir),
                           *sets], cwd=folder, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.count("\n") == 1 and needle in done.stderr, done.stderr
    assert not run_dir.exists(), "a rank started"


def config_in(folder: Path, **model):
    return build_config({"model": {"builder": f"{folder / 'nets.py'}:mlp", "input_shape": [2, 8, 8], "num_classes": 10,
                                   "time_steps": 4, **model},
                         "data": {"builder": f"{folder / 'nets.py'}:data", "batch_size": 8}, "train": {"steps": 2}})


def test_a_layout_left_at_its_default_is_inferred_and_trains_as_the_right_one_declared(folder):
    inferred = prepare(config_in(folder), 1, Plugins())
    assert inferred.plan.config.model.input_layout == "TN"
    assert any(line.startswith('model.input_layout = "TN" (inferred') for line in inferred.plan.rationale)
    declared = run_training(config_in(folder, input_layout="TN"))
    assert run_training(config_in(folder))["losses"] == declared["losses"]


@pytest.mark.parametrize("model, data, needle", [
    ({"num_classes": 7}, None, "returns 10 classes a time step, and model.num_classes = 7; set model.num_classes = 10"),
    ({}, "eleven", "has label 11, outside the model's classes 0 to 9; set model.num_classes = 12"),
])
def test_classes_the_model_or_the_labels_do_not_have_are_refused(folder, model, data, needle):
    config = config_in(folder, **model)
    if data:
        config = build_config({**config.to_dict(), "data": {"builder": f"{folder / 'nets.py'}:{data}", "batch_size": 8}})
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        prepared = prepare(config, 1, Plugins())  # what snnfw train checks before it starts the ranks
        build_datasets(config, prepared.spec, Plugins())


@pytest.mark.parametrize("flags, overrides, raised", [
    ([], ["data.builder=nets.py:corrupt"], "ValueError: sample 1 is corrupt"),
    (["--debug"], ["model.builder=nets.py:Strict"], "RuntimeError: training needs a mask"),
], ids=["data", "model-debug"])
def test_an_error_in_the_users_code_inside_the_ranks_is_one_line_naming_it(folder, flags, overrides, raised):
    """Printed once, not once a rank; the traceback in the run directory's error.log, and with --debug on screen."""
    line = next(n for n, text in enumerate(NETS.splitlines(), 1) if f"raise {raised.partition(':')[0]}" in text)
    run_dir = folder / f"ranks-{overrides[0]}"
    sets = [arg for item in [*overrides, "model.input_layout=TN"] for arg in ("--set", item)]
    done = subprocess.run([sys.executable, "-m", "snnfw", *flags, "train", "own.toml", "--nproc", "2", "--run-dir",
                           str(run_dir), *sets], cwd=folder, capture_output=True, text=True, timeout=180)
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [text for text in done.stderr.splitlines() if text.startswith("snnfw: error:")]
    assert errors == [f"snnfw: error: nets.py, line {line}, in {'corrupt_label' if 'data' in overrides[0] else 'forward'}: "
                      f"{raised}; the traceback is in {run_dir / 'error.log'}"], done.stderr[-3000:]
    assert "Traceback" in (run_dir / "error.log").read_text()
    assert ("Traceback" in done.stderr) == bool(flags), done.stderr[-3000:]


@pytest.mark.parametrize("data", ["corrupt", "refusing"])
def test_an_error_in_the_users_data_set_in_a_loader_worker_is_the_same_one_line(folder, data):
    """torch re-raises a worker's exception as another, its message the worker's traceback: the line is the one
    without workers, and error.log holds the worker's traceback."""
    run_dir = folder / f"workers-{data}"
    sets = [arg for item in [f"data.builder=nets.py:{data}", "data.workers=1", "parallel.strategy=none",
                             "model.input_layout=TN"] for arg in ("--set", item)]
    done = subprocess.run([sys.executable, "-m", "snnfw", "train", "own.toml", "--nproc", "1", "--run-dir", str(run_dir),
                           *sets], cwd=folder, capture_output=True, text=True, timeout=180)
    assert done.returncode == 2, done.stderr[-3000:]
    if data == "corrupt":
        line = next(n for n, text in enumerate(NETS.splitlines(), 1) if "raise ValueError" in text)
        said = (f"nets.py, line {line}, in corrupt_label: ValueError: sample 1 is corrupt; the traceback is in "
                f"{run_dir / 'error.log'}")
        assert "in corrupt_label" in (run_dir / "error.log").read_text()
    else:
        said = "sample 1 has no events; remove it from the data set"
    assert [text for text in done.stderr.splitlines() if text.startswith("snnfw: error:")] == [f"snnfw: error: {said}"]
    assert "Traceback" not in done.stderr and "DataLoader worker" not in done.stderr, done.stderr[-3000:]


def test_a_network_left_in_single_step_mode_is_told_to_switch(folder):
    with pytest.raises(ConfigError, match=r"4 of its SpikingJelly modules are in single-step mode: call "
                                          r"functional.set_step_mode\(net, \"m\"\) on the network$"):
        prepare(config_in(folder, builder=f"{folder / 'nets.py'}:single_step"), 1, Plugins())


def test_a_model_that_returns_no_tensor_is_told_what_it_returned(folder):
    with pytest.raises(ConfigError, match=r"in either layout it returned a tuple; return them from its forward$"):
        prepare(config_in(folder, builder=f"{folder / 'nets.py'}:Pair"), 1, Plugins())


def test_data_sets_handed_to_the_api_have_their_labels_checked(folder):
    import snnfw
    from snnfw.model.source import import_object

    nets = str(folder / "nets.py")
    train, test = import_object(f"{nets}:float_labels", "data.builder")()
    config = {"model": {"input_shape": [2, 8, 8], "num_classes": 10, "time_steps": 4}, "data": {"batch_size": 8}}
    with pytest.raises(ConfigError, match=r"item 0 of the train data set has label 0\.0 \(float\)"):
        with snnfw.start(config, model=import_object(f"{nets}:mlp", "model.builder"), train_set=train, test_set=test):
            pass


def test_the_dry_run_probes_a_model_that_needs_values_for_real(folder):
    from snnfw.tools.dry_run import dry_run

    plan, footprints = dry_run(config_in(folder, builder=f"{folder / 'nets.py'}:Valued"), 1, Plugins())
    assert plan.config.model.input_layout == "TN" and footprints[0][1].total > 0
