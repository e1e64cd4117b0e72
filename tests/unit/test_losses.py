"""Losses by name and epochs: the configured loss is what step 1 trains on; epochs give whole passes of batches."""

import json

import pytest
import torch
import torch.nn.functional as F

from snnfw.config import build_config
from snnfw.data import batches as datalib
from snnfw.errors import ConfigError, UnknownNameError
from snnfw.plan.prepare import build_datasets, build_model, prepare
from snnfw.plugin.manager import Plugins
from snnfw.run.loop import run_training
from snnfw.testing.equivalence import OWN_MODELS


def own(train: dict, data: dict | None = None):
    return build_config({
        "model": OWN_MODELS["own_sew"],
        "data": {"batch_size": 16, "train_samples": 64, "test_samples": 16, **(data or {})},
        "train": {"steps": 1, "seed": 5, "dtype": "float64", **train},
    })


def first_step_loss_by_hand(config, loss):
    """The loss of step 0's global batch on the freshly built model, computed with torch alone."""
    plugins = Plugins()
    model, spec = build_model(config, plugins)
    model = model.double()
    train_set, _ = build_datasets(config, spec, plugins)
    indices = datalib.global_batch_indices(0, config.data.batch_size, len(train_set), config.train.seed)
    frames, labels = datalib.load(train_set, indices, torch.device("cpu"), torch.float64)
    return loss(model(frames), labels).item()


def tet_by_hand(logits, labels, weight=0.2):
    """SpikingJelly's TETLoss: the mean over time steps of each step's cross entropy, and the MSE from 1."""
    per_step = sum(F.cross_entropy(step, labels) for step in logits) / len(logits)
    return (1 - weight) * per_step + weight * F.mse_loss(logits, torch.ones_like(logits))


@pytest.mark.parametrize(
    "train, by_hand",
    [
        ({"label_smoothing": 0.2}, lambda out, labels: F.cross_entropy(out.mean(0), labels, label_smoothing=0.2)),
        ({"loss": "mse_rate"}, lambda out, labels: F.mse_loss(out.mean(0), F.one_hot(labels, 10).double())),
        ({"loss": "tet", "tet_lambda": 0.2}, tet_by_hand),
    ],
    ids=["label_smoothing", "mse_rate", "tet"],
)
def test_the_first_step_trains_on_the_configured_loss(train, by_hand):
    config = own(train)
    got = run_training(config)["losses"][0]
    assert got == pytest.approx(first_step_loss_by_hand(config, by_hand), rel=1e-12)
    plain = run_training(own({}))["losses"][0]
    assert abs(got - plain) > 1e-3, "the loss key changed nothing"


def test_loss_keys_are_checked():
    with pytest.raises(ConfigError, match=r"train\.label_smoothing does not apply to train\.loss = 'mse_rate'"):
        prepare(own({"loss": "mse_rate", "label_smoothing": 0.1}), 1, Plugins())
    with pytest.raises(ConfigError, match=r"train\.tet_lambda does not apply to train\.loss = 'cross_entropy'"):
        prepare(own({"tet_lambda": 0.1}), 1, Plugins())
    with pytest.raises(UnknownNameError, match="registered loss names: cross_entropy, mse_rate, next_token, tet"):
        prepare(own({"loss": "focal"}), 1, Plugins())


def test_epochs_are_whole_passes_of_global_batches():
    config = build_config({"model": OWN_MODELS["own_sew"], "data": {"batch_size": 16, "train_samples": 70},
                           "train": {"epochs": 3}})
    plan = prepare(config, 1, Plugins()).plan
    assert plan.config.train.steps == 3 * (70 // 16)
    with pytest.raises(ConfigError, match=r"train\.steps \(5\) and train\.epochs \(3\)"):
        prepare(build_config({"train": {"epochs": 3, "steps": 5}}), 1, Plugins())
    with pytest.raises(ConfigError, match="fewer than one global batch"):
        prepare(build_config({"data": {"train_samples": 8, "batch_size": 16}, "train": {"epochs": 1}}), 1, Plugins())


def test_the_record_counts_epochs_and_the_data_sets_are_built_once(tmp_path, monkeypatch):
    import snnfw.plan.prepare
    import snnfw.run.trainer

    built = []

    def counted(*args):
        built.append(args)
        return build_datasets(*args)

    for module in (snnfw.plan.prepare, snnfw.run.trainer):
        monkeypatch.setattr(module, "build_datasets", counted)
    config = build_config({"model": OWN_MODELS["own_sew"], "data": {"batch_size": 16, "train_samples": 32, "test_samples": 16},
                           "train": {"epochs": 2}})
    summary = run_training(config, tmp_path)
    assert len(built) == 1, "counting the epochs and training built the data sets twice"
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == 4 and [r["epoch"] for r in records] == [0.5, 1.0, 1.5, 2.0]
