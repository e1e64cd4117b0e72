"""``log.profile``: a trace per chosen rank, and each rank's compute, communication and idle shares from it."""

import json

import pytest
import torch

from snnfw import rundir
from snnfw.errors import ConfigError
from snnfw.run.loop import run_training
from snnfw.testing import run_on_ranks, tiny_config
from snnfw.tools.plot import plot, rank_shares


def profiled(strategy, ranks="all"):
    return tiny_config(strategy, train={"steps": 4}, log={"profile": {"steps": "2-3", "ranks": ranks}})


def test_communication_shows_under_tp_and_not_under_none(tmp_path, capfd):
    run_training(profiled("none"), tmp_path / "none")
    said = [line for line in capfd.readouterr().err.splitlines() if line.startswith("[snnfw] profile")]
    run_on_ranks(profiled("tp"), 2, tmp_path / "tp", timeout_s=180)
    (alone,), tp = rank_shares(tmp_path / "none"), rank_shares(tmp_path / "tp")
    assert [shares["rank"] for shares in tp] == [0, 1]
    assert alone["communication"] == 0 and all(shares["communication"] > 0.05 for shares in tp)
    assert said == [f"[snnfw] profile rank 0, steps 2-3: compute {alone['compute']:.0%}, communication 0%, idle "
                    f"{alone['idle']:.0%}; {tmp_path / 'none' / rundir.PROFILE / 'rank0.pt.trace.json'}"]
    for shares in (alone, *tp):
        assert shares["steps"] == [2, 3] and shares["compute"] > 0
        assert shares["compute"] + shares["communication"] + shares["idle"] == pytest.approx(1)
        trace = tmp_path / ("none" if shares is alone else "tp") / rundir.PROFILE / f"rank{shares['rank']}.pt.trace.json"
        assert json.loads(trace.read_text())["traceEvents"]
    assert plot([tmp_path / "none", tmp_path / "tp"], tmp_path / "plot.png").stat().st_size > 0


def test_only_the_chosen_ranks_profile(tmp_path):
    run_on_ranks(profiled("dp", ranks=[1]), 2, tmp_path, timeout_s=180)
    assert sorted(p.name for p in (tmp_path / rundir.PROFILE).iterdir()) == ["rank1.json", "rank1.pt.trace.json"]


def test_a_profile_needs_a_run_directory_and_ranks_of_the_run(tmp_path):
    with pytest.raises(ConfigError, match="log.profile is written into the run directory, and this run has none"):
        run_training(profiled("none"))
    with pytest.raises(ConfigError, match="log.profile.ranks names rank 2, and the run has ranks 0 to 0"):
        run_training(profiled("none", ranks=[0, 2]), tmp_path)


def test_a_memory_snapshot_counts_the_steps_tensors_by_kind_on_every_rank(tmp_path):
    """On a CPU, torch's MemTracker: the parameters are the model's, and tsp at P = 2 holds about half of none's
    activations."""

    def snapshot(strategy, ranks, run):
        config = tiny_config(strategy, train={"steps": 3}, log={"memory_snapshot": 2})
        summaries = run_training(config, run) if ranks == 1 else run_on_ranks(config, ranks, run, timeout_s=180)
        return [json.loads((run / rundir.MEMORY / f"rank{r}.json").read_text()) for r in range(ranks)], summaries

    (alone,), _ = snapshot("none", 1, tmp_path / "none")
    split, _ = snapshot("tsp", 2, tmp_path / "tsp")
    model = torch.load(tmp_path / "none" / rundir.FINAL_MODEL, weights_only=True)
    parameters = sum(v.numel() * v.element_size() for k, v in model.items() if "running" not in k and "num_batches" not in k)
    assert alone["step"] == 2 and alone["peak_bytes"]["parameter"] == parameters
    assert alone["module_peak_bytes"] and max(alone["module_peak_bytes"].values()) <= alone["peak_bytes"]["total"]
    for rank in split:
        assert 0.4 < rank["peak_bytes"]["activation"] / alone["peak_bytes"]["activation"] < 0.6


def test_a_memory_snapshot_needs_a_run_directory_and_a_step_of_the_run():
    with pytest.raises(ConfigError, match="log.memory_snapshot is written into the run directory"):
        run_training(tiny_config("none", log={"memory_snapshot": 1}))
    with pytest.raises(ConfigError, match="log.memory_snapshot = 9 is after the run's last step, step 3"):
        tiny_config("none", log={"memory_snapshot": 9})


def test_every_metrics_record_reaches_an_offline_weights_and_biases_run(tmp_path):
    pytest.importorskip("wandb", reason="log.wandb is an optional extra (SNNFW_EXTRAS=tensorboard,wandb)")
    from snnfw.testing.wandb_records import offline_history

    summary = run_training(tiny_config("none", log={"wandb": "offline"}, eval={"every": 2}), tmp_path)
    rows = offline_history(tmp_path)
    assert [row["_step"] for row in rows] == [1, 2, 3]
    assert [row["train/loss"] for row in rows] == summary["losses"]
    assert [row.get("eval/acc") for row in rows] == [None, *(e["eval_acc"] for e in summary["evaluations"])]


def test_wandb_is_refused_in_one_line_where_it_is_not_installed(monkeypatch):
    import importlib.util

    from snnfw.plan.prepare import prepare
    from snnfw.plugin.manager import Plugins

    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else found(name, *a))
    with pytest.raises(ConfigError, match=r"log.wandb needs the wandb package, which is not installed; run "
                                          r"`SNNFW_EXTRAS=tensorboard,wandb bash scripts/install.sh`"):
        prepare(tiny_config("none", log={"wandb": "offline"}), 1, Plugins())
    with pytest.raises(ConfigError, match="log.wandb_project names the Weights & Biases project of log.wandb, which is off"):
        tiny_config("none", log={"wandb_project": "mine"})


def test_log_steps_are_checked_against_the_steps_that_epochs_give(tmp_path):
    from snnfw.config import build_config
    from snnfw.plan.prepare import prepare
    from snnfw.plugin.manager import Plugins
    from snnfw.testing import TINY

    settings = {**TINY, "train": {"epochs": 1}, "parallel": {"device": "cpu"}}  # 64 samples in batches of 8: 8 steps
    for log, refusal in (({"profile": {"steps": "8-9"}}, "log.profile.steps ends at step 9, after the run's last, step 8"),
                         ({"memory_snapshot": 9}, "log.memory_snapshot = 9 is after the run's last step, step 8")):
        with pytest.raises(ConfigError, match=refusal):
            prepare(build_config({**settings, "log": log}), 1, Plugins())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run by hand on an H200)")
def test_a_memory_snapshot_on_a_gpu_is_cudas_memory_history_of_the_step(tmp_path):
    import pickle

    run_training(tiny_config("none", train={"steps": 3}, parallel={"device": "cuda"}, log={"memory_snapshot": 2}),
                 tmp_path)
    snapshot = pickle.loads((tmp_path / rundir.MEMORY / "rank0.pickle").read_bytes())
    assert snapshot["segments"] and any(trace for trace in snapshot["device_traces"])
