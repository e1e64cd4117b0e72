"""snnfw eval and predict: weights trained under one strategy, scored under another, each sample once."""

import json
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from snnfw.cli import main
from snnfw.testing import run_on_ranks
from snnfw.testing.equivalence import CASES, case_config

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 240


def write_toml(path: Path, config) -> Path:
    """``config`` as a TOML file of the keys the CLI needs (the own model's, float64, 50 test samples)."""
    model = config.model
    path.write_text(
        f'[model]\nbuilder = "{model.builder}"\ninput_shape = [2, 16, 16]\nnum_classes = 10\ninput_layout = "TN"\n'
        '[data]\nbatch_size = 32\ntrain_samples = 256\ntest_samples = 50\n[train]\ndtype = "float64"\nseed = 3\n'
    )
    return path


def snnfw(*args):
    return subprocess.run([sys.executable, "-m", "snnfw", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A float64 run of the own model under fsdp2 on 2 ranks, its parameters sharded in its checkpoint:
    its run directory and final validation."""
    run_dir = tmp_path_factory.mktemp("trained")
    fsdp2 = next(case for case in CASES if case.name == "fsdp2")
    config = case_config("own_sew", fsdp2, "float64", 8, data={"test_samples": 50})
    config = attrs.evolve(config, checkpoint=attrs.evolve(config.checkpoint, every=8))
    summary = run_on_ranks(config, fsdp2.ranks, run_dir, timeout_s=TIMEOUT_S)[0]
    return run_dir, summary["eval"], write_toml(run_dir / "own.toml", config)


@pytest.mark.parametrize("strategy, nproc, sets", [
    ("tp", 2, ("parallel.strategy=tp",)),
    ("none", 1, ("parallel.strategy=none",)),
    ("mesh", 4, ("parallel.mesh={pp = 2, tp = 2}", "train.microbatches=2")),  # a composed mesh: stages, each sliced
])
def test_eval_of_an_fsdp2_checkpoint_scores_as_the_training_run_did(trained, tmp_path, strategy, nproc, sets):
    run_dir, want, toml = trained
    checkpoint = run_dir / "checkpoints" / "step-8"
    done = snnfw("eval", str(toml), "--weights", str(checkpoint), "--nproc", str(nproc),
                 *(arg for value in sets for arg in ("--set", value)), "--run-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads((tmp_path / "eval.json").read_text())
    assert got["eval_acc"] == want["eval_acc"] and got["eval_acc5"] == want["eval_acc5"]
    assert got["eval_loss"] == pytest.approx(want["eval_loss"], rel=1e-9)
    assert strategy in (got["plan"]["strategy"], got["plan"].get("preset"))
    layers = got["layer_ops"]  # synaptic operations over the split, a sample's in eval_sops, and the printed table
    assert got["eval_sops"] == pytest.approx(sum(layer["sops"] for layer in layers.values()) / 50) and got["eval_sops"] > 0
    assert "synaptic operations a sample (of 50)" in done.stdout and all(name in done.stdout for name in layers)


def test_predict_under_pp_writes_every_sample_once_in_order(trained, tmp_path):
    run_dir, want, toml = trained
    out = tmp_path / "predictions.jsonl"
    done = snnfw("predict", str(toml), "--weights", str(run_dir / "final_model.pt"), "--nproc", "2",
                 "--set", "parallel.strategy=pp", "--set", "train.microbatches=2", "--out", str(out), "--run-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["index"] for row in rows] == list(range(50))
    assert all(row["predicted"] == max(range(10), key=row["logits"].__getitem__) for row in rows)
    assert sum(row["predicted"] == row["label"] for row in rows) / 50 == want["eval_acc"]


def test_weights_of_another_model_are_refused_in_one_line(trained, capsys):
    """Refused before any rank starts, so in this process."""
    run_dir, _, _ = trained
    status = main(["eval", str(ROOT / "examples" / "quickstart.toml"), "--weights", str(run_dir / "final_model.pt"),
                   "--set", "parallel.strategy=none"])
    stderr = capsys.readouterr().err
    assert status == 2 and stderr.strip().count("\n") == 0
    assert "the weights do not fit the model" in stderr
