"""The benchmark harness: one record per run, compared with the last; the plain PyTorch baseline; the report."""

import json
import subprocess
import sys

import pytest

from snnfw.cli import main
from snnfw.testing import TINY

SMALL = ["--set", "data.test_samples=16", "--set", "data.batch_size=8", "--warmup", "1", "--steps", "2"]


def bench(results, *extra):
    cmd = [sys.executable, "-m", "snnfw", "bench", "examples/quickstart.toml", "--nproc", "1",
           "--results", str(results), "--set", "parallel.strategy=none", *SMALL, *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180)


def test_bench_records_compares_and_reports(tmp_path, capsys):
    results = tmp_path / "results.jsonl"
    first, second, base = bench(results), bench(results), bench(results, "--baseline")
    for done in (first, second, base):
        assert done.returncode == 0, done.stderr
    assert "vs last: step" in second.stdout and "vs last" not in first.stdout
    records = [json.loads(line) for line in results.read_text().splitlines()]
    assert [r["plan"]["strategy"] for r in records] == ["none", "none", "baseline-plain"]
    for key in ("regime", "global_batch", "per_rank_batch", "data_replicas", "step_ms", "global_samples_per_s",
                "per_device_samples_per_s", "peak_mem_mb_per_rank", "torch", "snnfw", "device", "plan", "config"):
        assert key in records[0], key
    assert records[0]["timed_steps"] == 2 and records[0]["global_batch"] == 8
    phases = {key: records[0][f"{key}_ms"] for key in ("data", "reset", "forward", "backward", "optimizer")}
    assert all(ms > 0 for ms in phases.values()), phases
    assert sum(phases.values()) <= records[0]["step_ms_mean"] * 1.05, (phases, records[0]["step_ms_mean"])
    assert records[0]["run_totals"]["materialize_s"] > 0
    chart = tmp_path / "chart.png"
    capsys.readouterr()
    assert main(["bench", "--report", "--results", str(results), "--chart", str(chart)]) == 0  # starts no ranks
    row = next(line for line in capsys.readouterr().out.splitlines() if "| none |" in line)
    ratio = float(row.rstrip(" |").rsplit("|", 1)[1])
    assert ratio > 0
    assert chart.stat().st_size > 1000


def test_records_of_another_precision_are_another_row_and_not_compared():
    from snnfw.tools.bench import config_key
    from snnfw.tools.report import grouped, table

    def record(precision, step_ms):
        config = {"model": {"family": "cifar10dvs_vgg", "flavor": "tiny", "time_steps": 4}, "data": {"batch_size": 8},
                  "parallel": {}, "train": {"precision": precision, "dtype": "float32"}}
        return {"config": config, "plan": {"strategy": "none", "mesh": [["dp", 1]], "microbatches": 1}, "nproc": 1,
                "global_batch": 8, "step_ms": step_ms, "peak_mem_mb_per_rank": [100.0]}

    fp32, bf16 = record("fp32", 200.0), record("bf16", 100.0)
    assert config_key(fp32) != config_key(bf16)
    rows = [line for line in table(grouped([fp32, bf16, record("fp32", 210.0)], config_key)).splitlines() if "| none |" in line]
    assert len(rows) == 2 and "| fp32 | none | 1 | 8 | 2 | 205.0 |" in rows[1] and "| bf16 | none | 1 | 8 | 1 | 100.0 |" in rows[0]


def test_overhead_pairs_each_run_with_the_nearest_baseline_run():
    from snnfw.tools.report import overhead

    baseline = [(0, 100.0), (2, 200.0), (4, 100.0)]  # the machine slowed down during the middle pair
    runs = [(1, 104.0), (3, 210.0), (5, 106.0)]
    assert overhead(runs, baseline) == 1.05  # the ratio of medians, 106 / 100, would blame the drift on snnfw


def test_the_baseline_trains_the_configs_dtype_optimizer_and_microbatches_as_none_does(tmp_path):
    """A plain loop on the config's device, in float64, with SGD (momentum as snnfw builds it) and 2 microbatches,
    its batches loaded ahead by 2 data.workers: the same losses as none loading in the step."""
    from snnfw.config import build_config
    from snnfw.run.loop import run_training

    document = {k: dict(v) for k, v in TINY.items()}
    document["train"].update(optimizer="sgd", dtype="float64", microbatches=2)
    reference = run_training(build_config(document))["losses"]
    document["data"]["workers"] = 2
    path = tmp_path / "config.toml"
    path.write_text("".join(f"[{section}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in table.items())
                            for section, table in document.items()))
    done = subprocess.run([sys.executable, "-m", "snnfw.tools.baseline", str(path), "--run-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == len(reference) == 3
    for step, (want, got) in enumerate(zip(reference, losses), start=1):
        assert abs(want - got) < 1e-9, f"step {step}: baseline loss {got}, none {want}"


def test_report_writes_its_table_between_the_markers_only(tmp_path):
    from snnfw.errors import UserError
    from snnfw.tools.report import MARKERS, write_into

    readme = tmp_path / "README.md"
    readme.write_text(f"# title\nbefore\n{MARKERS[0]}\nold table\n{MARKERS[1]}\nafter\n")
    write_into(readme, "| new | table |")
    assert readme.read_text() == f"# title\nbefore\n{MARKERS[0]}\n| new | table |\n{MARKERS[1]}\nafter\n"
    readme.write_text("no markers\n")
    with pytest.raises(UserError, match="bench-table"):
        write_into(readme, "| new |")
    assert readme.read_text() == "no markers\n"


@pytest.mark.parametrize("strategy, sets", [("dp", []), ("pp", ["pipeline.schedule=gpipe", "train.microbatches=4"])])
def test_paired_overhead_alternates_snnfw_and_the_plain_loop_on_the_same_losses(tmp_path, strategy, sets):
    """Under pp the plain side is torch's schedule class on the stages of snnfw's split."""
    out = tmp_path / "overhead.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "benchmark/overhead.py", "--pairs", "2",
           "--warmup", "1", "--out", str(out), "--set", f"parallel.strategy={strategy}", "--set", "data.batch_size=8",
           "--set", "data.test_samples=8", *(arg for s in sets for arg in ("--set", s))]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    (result,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert (result["strategy"], result["ranks"], len(result["ratios"])) == (strategy, 2, 2)
    assert all(ms > 0 for ms in result["snnfw_ms"] + result["plain_ms"])
    assert result["ratio_min"] <= result["ratio_median"] <= result["ratio_max"]
    for mine, plain in zip(result["snnfw_losses"], result["plain_losses"], strict=True):
        assert abs(mine - plain) <= 1e-5 * abs(plain)  # the same model, data and optimizer: the same training


@pytest.mark.parametrize("name, precision", [("best_cpu", "bf16"), ("best_cpu_avx2", "fp32")])
def test_the_best_settings_configs_plan_as_they_say(name, precision):
    """The configs the side-by-side run takes as QUICK (on the tiny model here), with a strategy it sets."""
    from pathlib import Path

    from snnfw.config import load_config
    from snnfw.plan.prepare import prepare
    from snnfw.plugin.manager import Plugins

    path = Path(__file__).resolve().parents[2] / "benchmark" / f"{name}.toml"
    config = load_config(path, ["parallel.strategy=dp", "model.flavor=tiny", "data.batch_size=8"])
    plan = prepare(config, 2, Plugins()).plan
    assert (plan.preset, plan.config.train.precision) == ("dp", precision)
    assert (plan.config.model.neuron_backend, plan.config.model.memory_format) == ("inductor", "auto")


def test_the_recorded_peak_is_the_ranks_own_not_the_profiles(tmp_path, monkeypatch):
    """The cost model's profile runs in the bench's own process before the ranks start: however much it held, a
    rank's recorded peak is its own, the one snnfw train of the same run records."""
    import snnfw.tools.bench as bench_tool

    planted_mb = 1024
    profile = bench_tool._predicted

    def profile_holding_much(*args):
        held = bytearray(b"\x01") * (planted_mb * 2**20)  # written: resident while the profile runs
        try:
            return profile(*args)
        finally:
            del held

    sets = ["data.test_samples=16", "data.batch_size=8", "parallel.strategy=none"]
    run_dir = tmp_path / "run"
    trained = main(["train", "examples/quickstart.toml", "--nproc", "1", "--run-dir", str(run_dir),
                    *(arg for s in [*sets, "train.steps=2", "train.log_every=2", "log.phase_times=true"]
                      for arg in ("--set", s))])
    assert trained == 0
    train_peak = max(json.loads(line)["peak_mem_mb"] for line in (run_dir / "metrics.jsonl").read_text().splitlines())
    monkeypatch.setattr(bench_tool, "_predicted", profile_holding_much)
    results = tmp_path / "results.jsonl"
    assert bench_tool.bench("examples/quickstart.toml", 1, sets, 1, 1, results, "throughput", None) == 0
    (record,) = [json.loads(line) for line in results.read_text().splitlines()]
    assert record["peak_mem_mb"] < planted_mb, record["peak_mem_mb_per_rank"]
    assert abs(record["peak_mem_mb"] - train_peak) <= 0.1 * train_peak, (record["peak_mem_mb"], train_peak)
