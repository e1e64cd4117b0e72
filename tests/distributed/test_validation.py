"""Validation: every test sample scored once under any strategy, periodic records, the best and final model."""

import json

import pytest
import torch

from snnfw.config import build_config
from snnfw.errors import ConfigError
from snnfw.plan.prepare import build_model, prepare
from snnfw.plugin.manager import Plugins
from snnfw.run.loop import run_training
from snnfw.testing import run_on_ranks
from snnfw.testing.equivalence import CASES, case_config, reference_config

FAMILY, STEPS = "own_sew", 4


def with_data(config, **data):
    return build_config({**config.to_dict(), "data": {**config.to_dict()["data"], **data},
                         "explicit": sorted(config.explicit | {f"data.{k}" for k in data})})


@pytest.mark.parametrize("name, test_samples", [
    ("fsdp2", 33),
    pytest.param("pp-1f1b", 33, marks=pytest.mark.full_matrix),  # within the suite's time budget
    pytest.param("hsdp", 10, marks=pytest.mark.full_matrix),
])
def test_an_uneven_test_split_is_scored_once_as_none_scores_it(name, test_samples):
    """33 samples: 17 and 16 for 2 replicas in batches of 16, replica 1's second forward pass scoring nothing;
    10 samples on 4 replicas (HSDP): 3, 3, 2 and 2."""
    case = next(c for c in CASES if c.name == name)
    data = {"test_samples": test_samples}
    want = run_training(with_data(reference_config(FAMILY, case.reference_microbatches, "float64", STEPS), **data))["eval"]
    got = run_on_ranks(with_data(case_config(FAMILY, case, "float64", STEPS), **data), case.ranks, timeout_s=240)
    for summary in got:
        assert summary["eval"]["eval_acc"] == want["eval_acc"] and summary["eval"]["eval_acc5"] == want["eval_acc5"]
        assert summary["eval"]["eval_loss"] == pytest.approx(want["eval_loss"], rel=1e-9)
        assert summary["eval"]["eval_spike_rate"] == pytest.approx(want["eval_spike_rate"], rel=1e-9)  # no padding pass
    assert 0 < want["eval_spike_rate"] < 0.7 and want["eval_acc"] <= want["eval_acc5"] <= 1


def test_periodic_validation_records_and_keeps_the_best_model(tmp_path):
    config = build_config({**reference_config(FAMILY, 1, "float32", 6).to_dict(), "eval": {"every": 2}})
    summary = run_training(config, tmp_path)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evaluated = {r["step"]: r["eval_acc"] for r in records if "eval_acc" in r}
    assert sorted(evaluated) == [2, 4, 6]
    best_step = max(evaluated, key=lambda step: (evaluated[step], -step))  # the first of equal accuracies
    assert summary["best_step"] == best_step and summary["best_eval_acc"] == evaluated[best_step]
    assert summary["test_accuracy"] == evaluated[6]
    model, _ = build_model(config, Plugins())
    for name in ("best_model.pt", "final_model.pt"):
        model.load_state_dict(torch.load(tmp_path / name, weights_only=True), strict=True)


def test_without_periodic_validation_the_last_step_record_holds_the_validation(tmp_path):
    """eval.every = 0 validates once, at the end: in the last step's metrics.jsonl record, which is the best model."""
    summary = run_training(reference_config(FAMILY, 1, "float32", 3), tmp_path)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "eval_acc" in r] == [3]
    assert records[-1]["eval_acc"] == summary["test_accuracy"] == summary["best_eval_acc"]
    assert (tmp_path / "best_model.pt").exists()


def test_epoch_counts_are_resolved_to_steps_and_need_epochs():
    data = {"model": {"builder": reference_config(FAMILY, 1, "float32").model.builder, "input_shape": [2, 16, 16],
                      "num_classes": 10, "input_layout": "TN"},
            "data": {"batch_size": 16, "train_samples": 64}}
    plan = prepare(build_config({**data, "train": {"epochs": 3, "warmup_epochs": 1}, "eval": {"every_epochs": 1}}), 1,
                   Plugins()).plan
    assert (plan.config.train.steps, plan.config.eval.every, plan.config.train.warmup_steps) == (12, 4, 4)
    with pytest.raises(ConfigError, match="set train.epochs"):
        prepare(build_config({**data, "eval": {"every_epochs": 1}}), 1, Plugins())
    with pytest.raises(ConfigError, match=r"train.warmup_epochs counts epochs of train.epochs; set train.epochs"):
        prepare(build_config({**data, "train": {"warmup_epochs": 1}}), 1, Plugins())
    with pytest.raises(ConfigError, match="train.warmup_steps and train.warmup_epochs both say how long to warm up"):
        prepare(build_config({**data, "train": {"epochs": 3, "warmup_epochs": 1, "warmup_steps": 2}}), 1, Plugins())
