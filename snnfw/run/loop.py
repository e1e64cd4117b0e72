"""run: the training loop every rank executes, whatever the strategy, on the Python API (:mod:`snnfw.run.session`)."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable

from snnfw import rundir
from snnfw.components.memory import MemorySnapshot
from snnfw.components.metrics import MetricsLog
from snnfw.components.precision import precision_notes
from snnfw.components.profile import StepProfiler
from snnfw.components.weights import read_weights
from snnfw.config import Config, for_evaluation
from snnfw.distributed.collectives import all_reduce, barrier
from snnfw.errors import ConfigError, keys_phrase
from snnfw.plugin.manager import Plugins
from snnfw.run.session import start
from snnfw.run.trainer import Trainer
from snnfw.rundir import BEST_MODEL, EVAL, FINAL_MODEL, SUMMARY

CHECKPOINT_MS = "checkpoint_ms"  # a step's metric: the time its checkpoint save held training up
WRITES_INTO_RUN_DIR = ("tensorboard", "wandb", "profile", "memory_snapshot")  # [log] keys


def run_training(
    config: Config,
    run_dir: str | Path | None = None,
    plugins: Plugins | None = None,
    on_finish: Callable[[Trainer], Any] | None = None,
    resume: bool = False,
) -> dict[str, Any]:
    """Runs one rank of a training job described by ``config``; returns the summary.

    Rank 0 writes ``metrics.jsonl`` and ``summary.json`` into ``run_dir``.
    ``on_finish(trainer)``, if given, runs before the process group closes and
    its result is the summary's ``"inspect"`` entry (tests use it to look at
    parameters and neuron state). ``resume`` continues from the newest
    checkpoint in ``run_dir`` (from step 0 when there is none); checkpoints are
    written every ``checkpoint.every`` steps.
    """
    run_dir = Path(run_dir) if run_dir is not None else None
    if run_dir is None and (keys := [f"log.{key}" for key in WRITES_INTO_RUN_DIR if getattr(config.log, key)]):
        subject, pronoun = keys_phrase(keys)
        raise ConfigError(f"{subject} written into the run directory, and this run has none; pass a run directory, "
                          f"or remove {pronoun}")
    started = time.perf_counter()
    with start(config, run_dir=run_dir, resume=resume, plugins=plugins) as run:
        config, plan, is_main = run.config, run.plan, run.env.rank == 0
        wandb = (config.log.wandb, config.log.wandb_project, config.to_dict()) if config.log.wandb else None
        log = MetricsLog(run_dir, is_main, config.train.steps, run.start_step, config.log.tensorboard, wandb)
        cuda = plan.device_type == "cuda"
        profiler = StepProfiler(config.log.profile, run.env.rank, run_dir, cuda)
        memory = MemorySnapshot(config.log.memory_snapshot, run.env.rank, run_dir, cuda, run.trainer.model,
                                run.trainer.optimizer)
        for note in precision_notes(config, plan.device_type) if is_main else ():
            print(f"[snnfw] note: {note}", file=sys.stderr, flush=True)
        evaluations = earlier_evaluations(log.earlier)  # every validation with its step, a resumed run's included
        best = None  # (eval_acc, step) of the best validation
        for earlier in evaluations:
            if best is None or earlier["eval_acc"] > best[0]:
                best = (earlier["eval_acc"], earlier["step"])
        for step in range(run.start_step, config.train.steps):
            run.trainer.plugins.step_start(step + 1, run.env.rank)
            profiler.step_start(step + 1)
            with memory.around(step + 1):
                record = run.step(step)
            profiler.step_end(step + 1)
            if step + 1 == config.train.steps or (config.eval.every and (step + 1) % config.eval.every == 0):
                evaluated = run.evaluate()
                record.update(evaluated)
                evaluations.append({"step": step + 1, **evaluated})
                if best is None or evaluated["eval_acc"] > best[0]:
                    best = (evaluated["eval_acc"], step + 1)
                    if run_dir is not None:
                        run.export(run_dir / BEST_MODEL)
            if math.isfinite(record["loss"]) and run.checkpoints.due(step + 1):
                saving = time.perf_counter()
                run.save(step + 1, record["loss"])
                record[CHECKPOINT_MS] = (time.perf_counter() - saving) * 1e3  # how long the save held training up
            log.write(record, show=is_main and ((step + 1) % config.train.log_every == 0 or step + 1 == config.train.steps))
            if not math.isfinite(record["loss"]):
                log.close()
                run.close()
                raise run.checkpoints.diverged(step + 1, record["loss"])
        run.checkpoints.finish()  # an async save still being written
        log.close()
        last = evaluations[-1] if evaluations and evaluations[-1]["step"] == config.train.steps else None
        final = {k: v for k, v in last.items() if k != "step"} if last else run.evaluate()
        accuracy = final["eval_acc"]
        if run_dir is not None:
            run.export(run_dir / FINAL_MODEL)
        timed = log.records[1:] or log.records
        whole_run = log.earlier + log.records  # a resumed run's steps before the checkpoint, from its metrics.jsonl
        summary = {
            "steps": config.train.steps,
            "final_loss": log.records[-1]["loss"] if log.records else run.resumed_loss,
            "resumed_from": run.start_step,
            "test_accuracy": accuracy,
            "eval": final,
            "evaluations": evaluations,
            **({"best_eval_acc": best[0], "best_step": best[1]} if best else {}),
            "mean_step_ms": sum(r["step_ms"] for r in timed) / max(len(timed), 1),
            "wall_s": time.perf_counter() - started,
            "materialize_s": run.trainer.materialize_s,
            "plan": plan.to_dict(),
            "config": config.to_dict(),
            "losses": [r["loss"] for r in whole_run],
            "spike_rates": [r["spike_rate"] for r in whole_run],
            "grad_norms": [r["grad_norm"] for r in whole_run],
            **({"loss_scales": [r.get("loss_scale") for r in whole_run]} if config.train.precision == "fp16" else {}),
        }
        summary["layer_spike_rates"] = run.trainer.layer_spike_rates()
        extra = run.trainer.plugins.summary(plan)
        summary.update(zip(extra, all_reduce(list(extra.values()), op="max")))
        if on_finish is not None:
            summary["inspect"] = on_finish(run.trainer)
        run.trainer.plugins.results_due(run.env.rank)
        if is_main and run_dir is not None:
            public = {k: v for k, v in summary.items() if k != "inspect"}
            rundir.write_text(run_dir / SUMMARY, json.dumps(public, indent=2) + "\n")
        barrier()  # no rank leaves before rank 0 has written the run's results
    return summary


def earlier_evaluations(records: list[dict]) -> list[dict]:
    """The validations among a run's metrics records, each with its step."""
    return [{"step": r["step"], **{k: v for k, v in r.items() if k.startswith("eval_")}} for r in records if "eval_acc" in r]


def check_predictions_file(path: str | Path | None) -> None:
    """Refuses a predictions file that is not JSON lines, or that cannot be written."""
    if path is not None and not str(path).endswith(".jsonl"):
        from snnfw.errors import ConfigError

        raise ConfigError(f"predictions are written as JSON lines; name a .jsonl file, not {path}")
    if path is not None:
        rundir.check_writable(Path(path), "--out")


def run_evaluation(config: Config, weights: str | Path, run_dir: str | Path | None = None, predict: str | Path | None = None,
                   plugins: Plugins | None = None) -> dict[str, Any]:
    """Scores ``weights`` (a run directory, checkpoint or state-dict file) on the test split under
    ``config``'s strategy, on this rank; rank 0 writes ``eval.json`` into ``run_dir`` and, with
    ``predict``, one JSON line per test sample (index, label, predicted, logits) into that file."""
    check_predictions_file(predict)
    state = read_weights(weights)
    with start(for_evaluation(config), weights=state, plugins=plugins) as run:
        result = {"weights": str(weights), **run.evaluate(), "plan": run.plan.to_dict()}
        rows = run.predict() if predict is not None else None
        if run.env.rank == 0:
            if run_dir is not None:
                rundir.write_text(Path(run_dir) / EVAL, json.dumps(result, indent=2) + "\n")
            if rows is not None:
                rundir.write_text(Path(predict), "".join(json.dumps(row) + "\n" for row in rows))
        barrier()
    return result
