"""run: the training loop every rank executes, whatever the strategy, on the Python API (:mod:`snnfw.run.session`)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

from snnfw import rundir
from snnfw.components.memory import MemorySnapshot
from snnfw.components.ops import table as ops_table
from snnfw.components.precision import precision_notes
from snnfw.components.profile import StepProfiler
from snnfw.components.weights import read_weights
from snnfw.config import Config, for_evaluation
from snnfw.distributed.collectives import all_reduce, barrier
from snnfw.errors import ConfigError
from snnfw.plan.layout import Plan
from snnfw.plugin.manager import Plugins
from snnfw.run.preemption import Signals, StopAgreement
from snnfw.run.session import start
from snnfw.run.trainer import Trainer
from snnfw.rundir import BEST_MODEL, EVAL, FINAL_MODEL


def run_training(
    config: Config | None,
    run_dir: str | Path | None = None,
    plugins: Plugins | None = None,
    on_finish: Callable[[Trainer], Any] | None = None,
    resume: bool = False,
    plan: Plan | None = None,
    signals: Signals | None = None,
) -> dict[str, Any]:
    """Runs one rank of a training job described by ``config`` (None: ``plan``'s, a plan made before the ranks
    started, under which the rank plans nothing: :func:`snnfw.run.session.start`); returns the summary.

    Rank 0 writes ``metrics.jsonl`` and ``summary.json`` into ``run_dir``.
    ``on_finish(trainer)``, if given, runs before the process group closes and
    its result is the summary's ``"inspect"`` entry (tests use it to look at
    parameters and neuron state). ``resume`` continues from the newest
    checkpoint in ``run_dir`` (from step 0 when there is none); checkpoints are
    written every ``checkpoint.every`` steps. With ``signals`` (caught by the caller, :mod:`snnfw.run.preemption`)
    a signal among them stops every rank after the step they agree on, with a checkpoint of it: the run then ends
    with :class:`~snnfw.run.preemption.Preempted`.
    """
    run_dir = Path(run_dir) if run_dir is not None else None
    started = time.perf_counter()
    with start(config, run_dir=run_dir, resume=resume, plugins=plugins, plan=plan) as run:
        config, plan, is_main = run.config, run.plan, run.env.rank == 0
        cuda = plan.device_type == "cuda"
        profiler = StepProfiler(config.log.profile, run.env.rank, run_dir, cuda)
        memory = MemorySnapshot(config.log.memory_snapshot, run.env.rank, run_dir, cuda)
        for note in precision_notes(config, plan.device_type) if is_main else ():
            print(f"[snnfw] note: {note}", file=sys.stderr, flush=True)
        best = max((e["eval_acc"] for e in run.evaluations), default=None)
        agreement = StopAgreement(signals, config.parallel.timeout_s) if signals is not None else None
        step = run.start_step
        while step < config.train.steps:
            profiler.step_start(step + 1)
            with memory.around(step + 1, run.trainer.model, run.trainer.optimizer):
                record = run.step(step)
            step = record["step"] - 1  # under parallel.fault_tolerance, a rejoining group goes on at its peers' step
            profiler.step_end(step + 1)
            if step + 1 == config.train.steps or (config.eval.every and (step + 1) % config.eval.every == 0):
                evaluated = run.evaluate()
                if best is None or evaluated["eval_acc"] > best:
                    best = evaluated["eval_acc"]
                    if run_dir is not None:
                        run.export(run_dir / BEST_MODEL)
            due = run.checkpoints.due(step + 1)
            stop = agreement.after_step() if agreement is not None and step + 1 < config.train.steps else None
            if due or stop:
                run.figures.read()  # the steps since the last that logged: a checkpoint keeps only finite ones
            if (bad := run.diverged()) is None and (due or stop):
                run.save(step + 1, record["loss"])
            if bad is not None:  # found where the figures are read: a step that logs or a checkpoint
                run.write_record()
                run.close()
                raise run.checkpoints.diverged(bad["step"], bad["loss"])
            if stop:
                run.checkpoints.finish()
                raise agreement.stopped(step + 1, run.checkpoints.complete()[-1], stop)
            step += 1
        if agreement is not None:
            agreement.finish()
        run.checkpoints.finish()  # an async save still being written
        summary = run.summary()
        if "test_accuracy" not in summary or summary["evaluations"][-1]["step"] != config.train.steps:
            summary["eval"] = run.evaluate()  # a run resumed after its last step
            summary["test_accuracy"] = summary["eval"]["eval_acc"]
        if run_dir is not None:
            run.export(run_dir / FINAL_MODEL)
        summary.update(steps=config.train.steps, wall_s=time.perf_counter() - started)  # set-up included
        extra = run.trainer.plugins.summary(plan)
        summary.update(zip(extra, all_reduce(list(extra.values()), op="max")))
        if on_finish is not None:
            summary["inspect"] = on_finish(run.trainer)
        run.trainer.plugins.results_due(run.env.rank)
        run.write_summary({k: v for k, v in summary.items() if k != "inspect"})
        barrier()  # no rank leaves before rank 0 has written the run's results
    return summary


def check_predictions_file(path: str | Path | None) -> None:
    """Refuses a predictions file that is not JSON lines, or that cannot be written."""
    if path is not None and not str(path).endswith(".jsonl"):
        raise ConfigError(f"predictions are written as JSON lines; name a .jsonl file, not {path}")
    if path is not None:
        rundir.check_writable(Path(path), "--out")


def run_evaluation(config: Config | None, weights: str | Path, run_dir: str | Path | None = None,
                   predict: str | Path | None = None, plugins: Plugins | None = None, plan: Plan | None = None) -> dict[str, Any]:
    """Scores ``weights`` (a run directory, checkpoint or state-dict file) on the test split under
    ``config``'s strategy (None: ``plan``'s, made for the config as :func:`for_evaluation` reads it), on this rank;
    rank 0 writes ``eval.json`` into ``run_dir`` and, with ``predict``, one JSON line per test sample (index, label,
    predicted, logits) into that file."""
    check_predictions_file(predict)
    state = read_weights(weights)
    with start(for_evaluation(config) if plan is None else None, weights=state, plugins=plugins, plan=plan) as run:
        if predict is not None and run.trainer.positions:
            raise ConfigError("predictions list each sample's positions whole, and this mesh splits the sequence "
                              "across ranks (cp); predict under a mesh without cp")
        result = {"weights": str(weights), **run.evaluate(ops=predict is None), "plan": run.plan.to_dict()}
        rows = run.predict() if predict is not None else None
        if run.env.rank == 0:
            if "layer_ops" in result:
                print(ops_table(result), flush=True)
            if run_dir is not None:
                rundir.write_text(Path(run_dir) / EVAL, json.dumps(result, indent=2) + "\n")
            if rows is not None:
                rundir.write_text(Path(predict), "".join(json.dumps(row) + "\n" for row in rows))
        barrier()
    return result
