"""What a run leaves besides metrics.jsonl: TensorBoard scalars and a picture of the run."""

import importlib.util
import json

import pytest

import snnfw.components.extras
import snnfw.plan.prepare
from snnfw.config import build_config
from snnfw.errors import ConfigError
from snnfw.plugin.manager import Plugins
from snnfw.run.loop import run_training
from snnfw.testing.equivalence import reference_config


def own_run(tmp_path, **sections):
    base = reference_config("own_sew", 1, "float32", 4).to_dict()
    return build_config({**base, **sections, "explicit": base["explicit"] + [f"{s}.{k}" for s, t in sections.items() for k in t]})


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None,
                    reason="tensorboard is not installed (SNNFW_EXTRAS=tensorboard bash scripts/install.sh adds it)")
def test_tensorboard_holds_the_metrics_of_every_step(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_training(own_run(tmp_path, log={"tensorboard": True}, eval={"every": 2}), tmp_path)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    board = EventAccumulator(str(tmp_path / "tensorboard"))
    board.Reload()
    assert {"train/loss", "train/lr", "train/grad_norm", "train/spike_rate", "train/step_ms", "eval/acc"} <= set(board.Tags()["scalars"])
    assert [(e.step, e.value) for e in board.Scalars("train/loss")] == [(r["step"], pytest.approx(r["loss"])) for r in records]
    assert [e.step for e in board.Scalars("eval/acc")] == [2, 4]


def test_phase_times_are_recorded_only_when_asked(tmp_path):
    """Timing phases waits for a GPU, so ``snnfw train`` leaves it off unless log.phase_times is set."""
    phases = {"data_ms", "forward_backward_ms", "reset_ms", "forward_ms", "backward_ms", "grad_norm_ms", "optimizer_ms"}
    plain = run_training(own_run(tmp_path), tmp_path / "plain")
    timed = run_training(own_run(tmp_path, log={"phase_times": True}), tmp_path / "timed")
    assert plain["losses"] == timed["losses"]
    records = [json.loads(line) for line in (tmp_path / "timed" / "metrics.jsonl").read_text().splitlines()]
    assert all(phases <= record.keys() and all(record[key] > 0 for key in phases) for record in records)
    assert not any(phases & json.loads(line).keys() for line in (tmp_path / "plain" / "metrics.jsonl").read_text().splitlines())


def test_tensorboard_without_the_package_is_refused_naming_the_install(monkeypatch):
    find = importlib.util.find_spec
    monkeypatch.setattr(snnfw.components.extras.importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else find(name, *a))
    with pytest.raises(ConfigError, match="SNNFW_EXTRAS=tensorboard bash scripts/install.sh"):
        snnfw.plan.prepare.prepare(build_config({"log": {"tensorboard": True}}), 1, Plugins())


def test_plot_draws_several_runs_into_one_png(tmp_path):
    from snnfw.cli import main

    for name, lr in (("a", 3e-3), ("b", 1e-3)):
        run_training(own_run(tmp_path, eval={"every": 2}, train={**reference_config("own_sew", 1, "float32", 4).to_dict()["train"], "lr": lr}),
                     tmp_path / name)
    assert main(["plot", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "runs.png")]) == 0
    assert (tmp_path / "runs.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["plot", str(tmp_path)]) == 2  # no metrics.jsonl there: one line, status 2


def files_of(folder):
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_run_directories_are_not_overwritten_by_surprise_and_a_resumed_run_says_from_where(tmp_path, capfd):
    from snnfw.cli import main

    config = tmp_path / "own.toml"
    own = reference_config("own_sew", 1, "float32", 2).model
    config.write_text(f'[model]\nbuilder = "{own.builder}"\ninput_shape = [2, 16, 16]\nnum_classes = 10\ninput_layout = "TN"\n'
                      '[data]\nbatch_size = 8\ntrain_samples = 16\ntest_samples = 8\n[train]\nsteps = 2\n')
    run = tmp_path / "run"
    assert main(["train", str(config), "--run-dir", str(run)]) == 0
    before = files_of(run)
    capfd.readouterr()
    for args, message in (
        ([], "holds an earlier run (metrics.jsonl); pass --overwrite"),
        (["--resume"], "--resume continues from a checkpoint"),
    ):
        assert main(["train", str(config), "--run-dir", str(run), *args]) == 2
        err = capfd.readouterr().err
        assert message in err and err.count("\n") == 1
        assert files_of(run) == before
    every = ["--set", "checkpoint.every=2"]
    assert main(["train", str(config), "--run-dir", str(run), "--overwrite", "--set", "train.lr=0.01", *every]) == 0
    assert json.loads((run / "summary.json").read_text())["config"]["train"]["lr"] == 0.01
    capfd.readouterr()
    assert main(["train", str(config), "--run-dir", str(run), "--resume", "--set", "train.steps=3", *every]) == 0
    first = next(line for line in capfd.readouterr().err.splitlines() if line.startswith("[snnfw]"))
    assert first == f"[snnfw] resuming after step 2 from {run / 'checkpoints' / 'step-2'}"


def test_a_plot_of_one_validation_labels_it_on_the_runs_steps(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from snnfw.tools.plot import plot

    rows = [{"step": s, "loss": 1.0 / s, "train_acc": 0.5, "lr": 1e-3, "spike_rate": 0.1, "step_ms": 5.0} for s in range(1, 41)]
    rows[-1].update(eval_acc=0.625, eval_loss=1.0)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    drawn = []
    monkeypatch.setattr(plt, "close", drawn.append)
    plot([tmp_path / "run"], tmp_path / "run.png")
    panel = drawn[0].axes[2]  # test accuracy
    assert panel.get_title() == "test accuracy" and panel.get_xlim()[1] >= 40 and panel.get_xlim()[0] <= 1
    assert [text.get_text() for text in panel.texts] == ["62.5%"]
