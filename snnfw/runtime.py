"""apply -> run: the training loop every rank executes, whatever the strategy."""

from __future__ import annotations

import gc
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Callable

import torch

from snnfw import data as datalib
from snnfw import faults
from snnfw.checkpoint import Checkpoints
from snnfw.config import Config
from snnfw.distributed import RankEnv, all_reduce, device_for, dp_coordinate, dp_group, process_group
from snnfw.metrics import MetricsLog, SpikeCounter, peak_memory_mb
from snnfw.optim import build_scheduler
from snnfw.phases import PHASES
from snnfw.plugins import Plugins, check_same_plugins_on_all_ranks
from snnfw.prepare import Prepared, build_datasets, prepare
from snnfw.running_stats import RunningStats


def _set_cpu_threads(env: RankEnv) -> None:
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // env.local_world_size))


class Trainer:
    """Trains a parallelized model with microbatches, neuron resets and per-step metrics."""

    def __init__(self, config: Config, prepared: Prepared, plugins: Plugins, mesh, device):
        started = time.perf_counter()
        self.config, self.plan, self.plugins, self.device = config, prepared.plan, plugins, device
        PHASES.synchronize = torch.cuda.synchronize if device.type == "cuda" else None
        self.counter = SpikeCounter(prepared.model, prepared.analysis.neurons)
        self.state_names = frozenset(prepared.model.state_dict())
        self.train_set, self.test_set = build_datasets(config, prepared.spec, plugins)
        self.dtype = config.train.torch_dtype
        model = prepared.model.to(device, self.dtype)
        self.replica = dp_coordinate(self.plan, mesh)
        self.running_stats = RunningStats(model)  # from here on, only training steps update BatchNorm statistics
        plugins.transform_model(model, self.plan, self.example())
        self.model = plugins.parallelize(model, self.plan, mesh)
        self.running_stats.bind(self.model, self.replica, self.plan.dp_size, dp_group(self.plan, mesh))
        self.counter.clear()  # spikes of the transforms' and strategies' own forward passes
        self.optimizer = plugins.build_optimizer(self.model, self.plan, mesh)
        self.scheduler = build_scheduler(self.optimizer, config.train, plugins)
        self._batches, self._next_step = None, None
        self.materialize_s = time.perf_counter() - started

    def example(self) -> torch.Tensor:
        """The frames of step 0's first microbatch of replica 0: the same on every rank."""
        first = datalib.microbatch_indices(0, self.plan, len(self.train_set), self.config.train.seed, replica=0)[0]
        return datalib.load(self.train_set, first, self.device, self.dtype)[0]

    def batches(self, step: int) -> list:
        """This replica's microbatches of ``step``, from a loader that runs ahead while steps follow on."""
        if step != self._next_step:
            cfg = self.config
            sampler = datalib.StepSampler(self.plan, len(self.train_set), cfg.train.seed, self.replica, step, cfg.train.steps)
            self._batches = datalib.step_batches(self.train_set, sampler, cfg.data.workers, self.device, self.dtype)
        self._next_step = step + 1
        return next(self._batches)

    def step(self, step: int) -> dict[str, float]:
        plan = self.plan
        self.model.train()
        with PHASES("data"):
            batches = self.batches(step)
        with PHASES("forward_backward"):
            self.running_stats.start()
            out = self.plugins.forward_backward(self.model, batches, plan)
        with PHASES("running_stats"):
            self.running_stats.apply()
        lr = self.optimizer.param_groups[0]["lr"]
        with PHASES("optimizer"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
        spikes, elements = self.counter.take()
        extra = {**PHASES.take(), **self.plugins.step_metrics(plan)}
        loss, correct, samples, spikes, elements, *extra_totals = all_reduce(
            [out.loss * out.samples, out.correct, out.samples, spikes, float(elements), *extra.values()]
        )
        return {
            "loss": loss / samples,
            "lr": lr,
            "train_acc": correct / samples,
            "spike_rate": spikes / max(elements, 1.0),
            **{key: total / plan.world_size for key, total in zip(extra, extra_totals)},
        }

    def layer_spike_rates(self) -> dict[str, float]:
        """Each neuron module's firing rate over the training steps so far, over all ranks (a collective)."""
        counts = self.counter.by_layer()
        totals = all_reduce([float(x) for pair in counts.values() for x in pair])
        return {name: totals[2 * i] / max(totals[2 * i + 1], 1.0) for i, name in enumerate(counts)}

    @torch.no_grad()
    def evaluate(self) -> float:
        """Accuracy on the held-out split; each replica scores an equal contiguous share."""
        self.model.eval()
        share = len(self.test_set) // self.plan.dp_size
        mine = torch.arange(self.replica * share, (self.replica + 1) * share)
        correct = samples = 0
        for chunk in mine.split(self.plan.replica_batch) if len(mine) else ():
            out = self.plugins.evaluate(self.model, *datalib.load(self.test_set, chunk, self.device, self.dtype), self.plan)
            correct, samples = correct + out.correct, samples + out.samples
        correct, samples = all_reduce([float(correct), float(samples)])
        return correct / max(samples, 1.0)


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
    env = RankEnv.from_environ()
    plugins = plugins or Plugins()
    prepared = prepare(config, env.world_size, plugins)
    plan = prepared.plan
    config = plan.config  # as resolved: auto's choice, the preference's defaults
    run_dir = Path(run_dir) if run_dir is not None else None
    is_main = env.rank == 0
    started = time.perf_counter()
    with process_group(plan, env, config.parallel.timeout_s) as mesh:
        if mesh is not None:
            check_same_plugins_on_all_ranks(plugins)
        device = device_for(plan, env)
        if device.type == "cpu":
            _set_cpu_threads(env)
        trainer = Trainer(config, prepared, plugins, mesh, device)
        checkpoints = Checkpoints(run_dir, config, env.rank)
        resumed = checkpoints.begin(trainer, resume)
        log = MetricsLog(run_dir, is_main, config.train.steps, resumed["step"])
        for step in range(resumed["step"], config.train.steps):
            faults.inject(step + 1, env.rank)
            t0 = time.perf_counter()
            record = {"step": step + 1, **trainer.step(step)}
            elapsed = time.perf_counter() - t0
            peaks = [0.0] * env.world_size
            peaks[env.rank] = peak_memory_mb(device)
            peaks = all_reduce(peaks)
            record.update(
                step_ms=elapsed * 1e3,
                samples_per_s=plan.global_batch / elapsed,
                peak_mem_mb=max(peaks),
                peak_mem_mb_per_rank=peaks,
            )
            log.write(record, show=is_main and ((step + 1) % config.train.log_every == 0 or step + 1 == config.train.steps))
            if not math.isfinite(record["loss"]):
                log.close()
                del trainer
                gc.collect()
                raise checkpoints.diverged(step + 1, record["loss"])
            if checkpoints.due(step + 1):
                checkpoints.save(trainer, step + 1, record["loss"])
        log.close()
        accuracy = trainer.evaluate()
        timed = log.records[1:] or log.records
        summary = {
            "steps": config.train.steps,
            "final_loss": log.records[-1]["loss"] if log.records else resumed["loss"],
            "resumed_from": resumed["step"],
            "test_accuracy": accuracy,
            "mean_step_ms": sum(r["step_ms"] for r in timed) / max(len(timed), 1),
            "wall_s": time.perf_counter() - started,
            "materialize_s": trainer.materialize_s,
            "plan": plan.to_dict(),
            "config": config.to_dict(),
            "losses": [r["loss"] for r in log.records],
            "spike_rates": [r["spike_rate"] for r in log.records],
        }
        summary["layer_spike_rates"] = trainer.layer_spike_rates()
        extra = plugins.summary(plan)
        summary.update(zip(extra, all_reduce(list(extra.values()), op="max")))
        if on_finish is not None:
            summary["inspect"] = on_finish(trainer)
        if is_main and run_dir is not None:
            public = {k: v for k, v in summary.items() if k != "inspect"}
            (run_dir / "summary.json").write_text(json.dumps(public, indent=2) + "\n")
        del trainer  # wrappers such as DDP must go before their process group does, or exit can hang
        gc.collect()
    return summary
