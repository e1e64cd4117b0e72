"""On-disk data sets: tiny files in each set's layout, read as frames of model.time_steps; clear errors."""

from pathlib import Path

import pytest
import torch

from snnfw.cli import main
from snnfw.config import DataConfig
from snnfw.data.batches import InputSpec
from snnfw.errors import DataError
from snnfw.plugin.manager import Plugins
from snnfw.run.loop import run_training
from snnfw.testing import tiny_config
from snnfw.testing.layouts import cifar10_dvs_layout, split_layout, write_cifar10

SPEC = InputSpec(4, (2, 32, 32), 10)
QUICKSTART = "examples/quickstart.toml"


@pytest.fixture(scope="module")
def plugins():
    return Plugins()


@pytest.mark.parametrize("name", ["dvs128_gesture", "n_mnist"])
def test_split_sets_number_classes_as_sorted_folders_and_resize(tmp_path, plugins, name):
    root = split_layout(tmp_path)
    dataset = plugins.datasets.get(name)
    train = dataset.build(DataConfig(name=name, root=str(root)), SPEC, "train", 0)
    test = dataset.build(DataConfig(name=name, root=str(root)), SPEC, "test", 0)
    assert len(train) == len(test) == 6
    frames, label = train[4]
    assert frames.shape == (4, 2, 32, 32) and frames.dtype == torch.float32
    assert label == 2 and train.samples[4][0].parent.name == "10"  # folders sorted as strings: 0, 1, 10


def test_cifar10_dvs_splits_each_class_as_tebn(tmp_path, plugins):
    root = cifar10_dvs_layout(tmp_path / "data")
    data = DataConfig(name="cifar10_dvs", root=str(root))
    test = plugins.datasets.get("cifar10_dvs").build(data, SPEC, "test", 0)
    assert sorted(p.stem for p, _ in test.samples) == [f"cifar10_{c}_{i}" for c in ("airplane", "automobile") for i in range(3)]


def test_cifar10_images_are_rate_coded_deterministically(tmp_path, plugins):
    root = write_cifar10(tmp_path)
    spec = InputSpec(8, (3, 16, 16), 10)
    build = plugins.datasets.get("cifar10").build
    train = build(DataConfig(name="cifar10", root=str(root)), spec, "train", 5)
    assert len(train) == 20 and len(build(DataConfig(name="cifar10", root=str(root)), spec, "test", 5)) == 4
    black, white = train[0][0], train[4][0]
    assert black.shape == (8, 3, 16, 16) and black.sum() == 0 and white.min() == 1
    spikes, label = train[5]
    assert set(spikes.unique().tolist()) <= {0.0, 1.0} and 0 <= label < 10
    assert torch.equal(spikes, train[5][0])
    assert 0.3 < spikes.mean() < 0.7  # uniform random pixels spike half of the time


def on_disk_quickstart(tmp_path) -> str:
    """The quickstart without its sample counts, which on-disk data sets do not read."""
    lines = Path(QUICKSTART).read_text().splitlines()
    path = tmp_path / "on_disk.toml"
    path.write_text("\n".join(line for line in lines if not line.startswith(("train_samples", "test_samples"))))
    return str(path)


def train_error(capsys, config, *settings):
    args = ["train", config, "--nproc", "2"] + [arg for item in settings for arg in ("--set", item)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    return err


def test_missing_or_malformed_data_fails_before_launch_saying_what_was_expected(tmp_path, capsys):
    config = on_disk_quickstart(tmp_path)
    err = train_error(capsys, config, "data.name=\"dvs128_gesture\"")
    assert "reads SpikingJelly's frames from data.root" in err
    err = train_error(capsys, config, "data.name=\"n_mnist\"", f"data.root=\"{tmp_path}\"")
    assert f"{tmp_path}/frames_number_4_split_by_number does not exist" in err and "NMNIST(root" in err
    split_layout(tmp_path / "t8", time_steps=8)
    err = train_error(capsys, config, "data.name=\"n_mnist\"", f"data.root=\"{tmp_path / 't8'}\"")
    assert "frames of model.time_steps = 4" in err
    root = split_layout(tmp_path / "bad")
    (root / "frames_number_4_split_by_number" / "train" / "0" / "user0.npz").write_text("not an archive")
    err = train_error(capsys, config, "data.name=\"dvs128_gesture\"", f"data.root=\"{root}\"")
    assert "user0.npz is not a frames file" in err
    err = train_error(capsys, config, "data.name=\"cifar10\"", f"data.root=\"{tmp_path}\"",
                      "model.family=\"spikformer\"", "model.flavor=\"cifar10\"")
    assert "data_batch_1.bin does not exist" in err
    (write_cifar10(tmp_path / "c") / "test_batch.bin").write_bytes(b"\0" * 100)
    err = train_error(capsys, config, "data.name=\"cifar10\"", f"data.root=\"{tmp_path / 'c'}\"",
                      "model.family=\"spikformer\"", "model.flavor=\"cifar10\"")
    assert "test_batch.bin is not a CIFAR-10 binary batch" in err
    err = train_error(capsys, config, "data.name=\"cifar10\"", f"data.root=\"{tmp_path / 'c'}\"")
    assert "the model takes 2 channels" in err


def test_data_keys_a_data_set_does_not_read_are_refused_before_launch(tmp_path, capsys):
    err = train_error(capsys, QUICKSTART, "data.name=\"n_mnist\"", f"data.root=\"{split_layout(tmp_path)}\"")
    assert "data.train_samples, data.test_samples are not read by data set 'n_mnist'" in err and "remove them" in err
    err = train_error(capsys, QUICKSTART, f"data.root=\"{tmp_path}\"")
    assert "data.root is not read by data set 'synthetic_dvs' (moving blobs of DVS events" in err
    err = train_error(capsys, QUICKSTART, 'data.frames={by="time"}')
    assert "data.frames is not read by data set 'synthetic_dvs'" in err


def test_loader_workers_feed_the_same_microbatches_and_resume_mid_run(tmp_path):
    """Two worker processes load ahead; the steps see the batches that loading in the step gives."""
    plain = run_training(tiny_config("none", 2, train={"steps": 4}))
    ahead = run_training(tiny_config("none", 2, train={"steps": 2}, data={"workers": 2}, checkpoint={"every": 2}), tmp_path)
    resumed = run_training(tiny_config("none", 2, train={"steps": 4}, data={"workers": 2}, checkpoint={"every": 2}),
                           tmp_path, resume=True)
    assert ahead["losses"] == plain["losses"][:2] and resumed["losses"] == plain["losses"]  # the whole run's


def test_a_family_takes_the_class_count_of_dvs128_gesture(tmp_path, plugins):
    classes = tuple(str(c) for c in range(11))
    root = split_layout(tmp_path / "gesture", classes=classes, per_class=1)
    data = {"name": "dvs128_gesture", "root": str(root), "batch_size": 4}
    with pytest.raises(DataError, match="11 classes, but the model has 10 outputs"):  # set by the user: kept
        run_training(tiny_config(data=data, model={"num_classes": 10}, train={"steps": 1}))
    summary = run_training(tiny_config(data=data, train={"steps": 2}), tmp_path / "run")  # the plan follows the data
    model = torch.load(tmp_path / "run" / "final_model.pt", weights_only=True)
    assert model["classifier.0.weight"].shape[0] == 11 and len(summary["losses"]) == 2
