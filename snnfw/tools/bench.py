"""``snnfw bench``: warm-up steps, timed steps, one JSON record appended per run.

Each record holds the resolved plan and config, versions and device, step
latency, global and per-device samples/s, peak memory per rank, the
plugins' per-step metrics averaged over the timed steps (TP communication,
phase times, ...) and their whole-run totals under ``run_totals`` (memopt
search and compile seconds, outside step time). A new record is
compared with the last one of the same configuration in the results file. A record also keeps the cost
model's prediction of its step (``predicted``: its uncorrected parts), which ``snnfw tune`` learns from.
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs

import snnfw
from snnfw.config import load_config
from snnfw.errors import UserError
from snnfw.plan import planfile
from snnfw.plan.prepare import prepare
from snnfw.plugin.manager import Plugins
from snnfw.run.session import CHECKPOINT_MS
from snnfw.rundir import METRICS, PLAN, SUMMARY, check_writable, write_text
from snnfw.tools.launch import launch

DEFAULT_RESULTS = Path("benchmark/results/bench.jsonl")
REGIMES = ("throughput", "latency", "memory")
_CORE_METRICS = {"step", "loss", "lr", "train_acc", "spike_rate", "step_ms", "samples_per_s", "peak_mem_mb", "peak_mem_mb_per_rank"}
_CORE_SUMMARY = {"steps", "final_loss", "resumed_from", "test_accuracy", "mean_step_ms", "wall_s", "plan", "config", "losses",
                 "spike_rates"}


def config_key(record: dict[str, Any]) -> str:
    """What makes two records comparable: model, data shape, strategy, mesh, batch, world and precision."""
    cfg, plan = record["config"], record["plan"]
    return json.dumps(
        [cfg["model"], cfg["data"]["batch_size"], plan["strategy"], plan["mesh"], plan["microbatches"], record["nproc"],
         cfg["parallel"], cfg.get("pipeline"), record.get("label"),
         cfg["train"].get("precision", "fp32"), cfg["train"].get("dtype", "float32")],
        sort_keys=True,
    )


def _last_matching(results: Path, key: str) -> dict[str, Any] | None:
    if not results.exists():
        return None
    last = None
    for line in results.read_text().splitlines():
        if line.strip() and config_key(json.loads(line)) == key:
            last = json.loads(line)
    return last


def make_record(config, plan, nproc: int, metrics: list[dict], summary: dict, warmup: int, regime: str, label) -> dict:
    timed = metrics[warmup:]
    step_ms = [r["step_ms"] for r in timed]
    peaks = [max(r["peak_mem_mb_per_rank"][i] for r in metrics) for i in range(nproc)]
    extra = {k: statistics.fmean(r[k] for r in timed) for k in timed[0] if k not in _CORE_METRICS and all(k in r for r in timed)}
    if any(CHECKPOINT_MS in r for r in timed):  # the time saves held training up, spread over every step
        extra[CHECKPOINT_MS] = statistics.fmean(r.get(CHECKPOINT_MS, 0.0) for r in timed)
    latency = statistics.median(step_ms)
    import torch

    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "label": label,
        "regime": regime,
        "nproc": nproc,
        "global_batch": plan.global_batch,
        "per_rank_batch": plan.replica_batch,
        "data_replicas": plan.dp_size,
        "warmup_steps": warmup,
        "timed_steps": len(timed),
        "step_ms": latency,
        "step_ms_mean": statistics.fmean(step_ms),
        "global_samples_per_s": plan.global_batch / latency * 1e3,
        "per_device_samples_per_s": plan.global_batch / latency * 1e3 / nproc,
        "peak_mem_mb_per_rank": peaks,
        "peak_mem_mb": max(peaks),
        "final_loss": summary["final_loss"],
        **extra,
        "run_totals": {k: v for k, v in summary.items() if k not in _CORE_SUMMARY},
        "torch": torch.__version__,
        "snnfw": snnfw.__version__,
        "device": plan.device_type if plan.device_type == "cpu" else torch.cuda.get_device_name(),
        "host": platform.node(),
        "plan": plan.to_dict(),
        "config": config.to_dict(),
    }


def _predicted(config_path, overrides: list[str], nproc: int, results: Path) -> dict | None:
    """The cost model's parts for this run, which ``snnfw tune`` learns from (None, said, where it cannot)."""
    from snnfw.tools.tune import predicted_parts

    try:
        return predicted_parts(config_path, overrides, nproc, results)
    except UserError as err:
        print(f"snnfw bench: no prediction in this record: {err}", file=sys.stderr)
        return None


def _change(new: float, old: float) -> str:
    return f"{(new - old) / old:+.1%}" if old else "n/a"


def bench(
    config_path, nproc: int, overrides: list[str], warmup: int, steps: int, results: Path, regime: str, label,
    baseline: bool = False,
) -> int:
    """Runs and records one benchmark; ``baseline`` times the plain PyTorch loop (snnfw.tools.baseline) instead."""
    if steps < 1 or warmup < 0:
        raise UserError(f"snnfw bench times --steps 1 or more after --warmup 0 or more steps; got --steps {steps} "
                        f"--warmup {warmup}")
    if regime not in REGIMES:
        raise UserError(f"unknown benchmark regime {regime!r}; regimes: {', '.join(REGIMES)}")
    check_writable(results, "--results")
    overrides = [*overrides, f"train.steps={warmup + steps}", f"train.log_every={warmup + steps}"]
    config = load_config(config_path, overrides)
    if "log.phase_times" not in config.explicit:  # a benchmark times the phases of a step unless told not to
        overrides.append("log.phase_times=true")
        config = load_config(config_path, overrides)
    if baseline:
        strategy = "baseline-ddp" if nproc > 1 else "baseline-plain"
        config = attrs.evolve(config, parallel=attrs.evolve(config.parallel, strategy="dp" if nproc > 1 else "none", mesh=None))
    plugins = Plugins()
    plan = prepare(config, nproc, plugins).plan
    if baseline:
        plan = attrs.evolve(plan, strategy=strategy)
    predicted = None if baseline else _predicted(config_path, overrides, nproc, results)
    with tempfile.TemporaryDirectory(prefix="snnfw-bench-") as tmp:
        module, plan_file = "snnfw.tools.baseline" if baseline else "snnfw.train", None
        if not baseline:
            plan_file = Path(tmp) / PLAN
            planfile.write(plan_file, plan, plugins, planfile.config_digest(config_path, overrides))
        status = launch(config_path, nproc, Path(tmp), overrides, config.parallel.timeout_s, module, plan=plan_file)
        if status:
            return status
        metrics = [json.loads(line) for line in (Path(tmp) / METRICS).read_text().splitlines()]
        summary = json.loads((Path(tmp) / SUMMARY).read_text())
    record = make_record(config, plan, nproc, metrics, summary, warmup, regime, label)
    if predicted:
        record["predicted"] = predicted
    previous = _last_matching(results, config_key(record))
    earlier = results.read_text() if results.exists() else ""
    write_text(results, earlier + json.dumps(record) + "\n")  # whole: the earlier records and this one
    line = (
        f"{config.model.family}/{config.model.flavor} {plan.name} x{nproc}: {record['step_ms']:.1f} ms/step, "
        f"{record['global_samples_per_s']:.1f} samples/s, peak {record['peak_mem_mb']:.0f} MB"
    )
    if previous:
        line += (
            f" (vs last: step {_change(record['step_ms'], previous['step_ms'])}, "
            f"peak {_change(record['peak_mem_mb'], previous['peak_mem_mb'])})"
        )
    print(line)
    print(f"appended to {results}", file=sys.stderr)
    return 0
