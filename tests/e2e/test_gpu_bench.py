"""benchmark/gpu.sh: the case list fits the GPU count, and its dry mode runs end to end on the CPU."""

import json
import os
import runpy
import signal
import subprocess
import sys
from pathlib import Path

GPU = runpy.run_path(str(Path(__file__).parents[2] / "benchmark" / "gpu.py"), run_name="gpu")


def test_cases_fit_the_gpu_count():
    one = list(GPU["cases"](1))
    assert {ranks for _, _, ranks, _, _ in one} == {1}
    assert {label for _, label, *_ in one} >= {"plain pytorch", "none", "neuron cuda", "neuron triton", "neuron inductor",
                                                 "compile", "bf16", "fp16", "channels_last", "bf16 channels_last",
                                                 "memopt 1", "memopt 4"}
    four = {(family, label): ranks for family, label, ranks, _, _ in GPU["cases"](4)}
    assert four["spikformer", "fsdp2_tp"] == 4 and four["spikformer", "dp"] == 4 and four["spikformer", "tp"] == 2
    assert four["cifar10dvs_vgg", "plain pytorch ddp"] == 4
    assert ("spikformer", "fsdp2_tp") not in {(f, label) for f, label, *_ in GPU["cases"](3)}


def test_every_strategy_case_of_four_gpus_plans_in_the_dry_mode():
    from snnfw.config import load_config
    from snnfw.plan.prepare import prepare
    from snnfw.plugin.manager import Plugins

    strategies = {label for label, _, _ in GPU["STRATEGIES"]}
    planned = set()
    for family, label, ranks, sets, baseline in GPU["cases"](4):
        if label in strategies:
            config = load_config(GPU["CONFIG"], GPU["case_overrides"](family, sets, True))
            planned.add((label, prepare(config, ranks, Plugins()).plan.world_size == ranks))
    assert planned == {(label, True) for label in strategies}


def test_dry_mode_runs_a_case_and_skips_what_needs_cuda(tmp_path):
    out = tmp_path / "gpu"
    done = subprocess.run(
        ["bash", "benchmark/gpu.sh", "--dry", "--family", "spikformer", "--only", "none,neuron cuda", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    rows = {r["case"]: r for r in map(json.loads, out.with_suffix(".jsonl").read_text().splitlines())}
    assert rows["none"]["dry"] and rows["none"]["step_ms"] > 0 and len(rows["none"]["peak_mb_per_rank"]) == 1
    assert "need CUDA" in rows["neuron cuda"]["skipped"]
    assert "| spikformer | none | 1 |" in done.stdout and "| spikformer | neuron cuda | 1 | skipped |" in done.stdout


def _processes_with(marker: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker in (entry / "cmdline").read_bytes().decode(errors="ignore"):
                pids.append(int(entry.name))
        except OSError:  # gone meanwhile
            pass
    return pids


def test_a_case_stopped_at_its_timeout_leaves_no_rank_running(tmp_path):
    """The elastic launcher starts each rank in a session of its own: a case stopped at its timeout must stop them
    too, or they hold their GPU's memory through the next cases."""
    import threading

    marker = f"train.seed={os.getpid()}7"  # in every rank's command line
    command = [sys.executable, "-m", "snnfw", "bench", GPU["CONFIG"], "--nproc", "2", "--steps", "100000",
               "--results", str(tmp_path / "records.jsonl"), "--set", marker]
    seen, stop = set(), threading.Event()

    def watch():
        while not stop.wait(0.5):
            seen.update(_processes_with(marker))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        status, _ = GPU["run_within"](command, timeout_s=15)
    finally:
        stop.set()
        watcher.join()
        left = _processes_with(marker)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    assert status is None
    assert len(seen) >= 3, "the launcher and its 2 ranks should have started before the timeout"
    assert not left


GUARANTEE = runpy.run_path(str(Path(__file__).parents[2] / "benchmark" / "gpu_guarantee.py"), run_name="gpu_guarantee")


def test_the_gpu_guarantee_covers_every_strategy_and_shares_one_gpu_over_gloo():
    cases = GUARANTEE["cases"]()
    assert [case.name for case in cases] == list(GUARANTEE["ORDER"])
    assert {case.strategy for case in cases} == {"none", "dp", "zero", "fsdp2", "tp", "fsdp2_tp", "pp", "tsp", "fsdp2_tsp"}
    assert {case.sections["pipeline"]["schedule"] for case in cases if case.strategy == "pp"} == {"1f1b", "interleaved"}
    assert any(case.sections.get("parallel", {}).get("mesh") == {"dp_replicate": 2, "dp_shard": 2} for case in cases)  # HSDP
    keys = GUARANTEE["parallel_keys"]
    assert keys(4, 1, False) == (("device", "cuda"), ("backend", "gloo")) and keys(2, 2, False)[1] == ("backend", "auto")


def test_the_gpu_guarantee_dry_mode_matches_none_and_records_what_cannot_run_here(tmp_path):
    """dp (the guarantee's default run leaves it to the full matrix) against none in float64 on CPU ranks, and
    the CUDA-only cases refused by the plan, each a JSONL row."""
    out = tmp_path / "guarantee.jsonl"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}  # gpu.sh runs `python`: this one
    done = subprocess.run(["bash", "benchmark/gpu.sh", "--guarantee", "--dry", "--only", "dp,cuda-graphs,cudnn-benchmark",
                           "--steps", "2", "--out", str(out)], capture_output=True, text=True, timeout=400, env=env)
    assert done.returncode == 0, done.stderr
    rows = {r["case"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert rows["dp"]["matched"] and rows["dp"]["device"] == "cpu"
    assert "CUDA graphs, which need CUDA" in rows["cuda-graphs"]["skipped"]
    assert "cuda.cudnn_benchmark is for CUDA runs" in rows["cudnn-benchmark"]["skipped"]
