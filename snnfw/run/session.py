"""The Python API: train under any strategy from your own script and loop (``snnfw train`` runs on it too).

Launch the script with ``torchrun --nproc_per_node=N script.py`` (or run it
as one process), then::

    import snnfw

    config = {"parallel": {"strategy": "fsdp2"}, "data": {"batch_size": 32}, "train": {"steps": 100, "lr": 3e-3},
              "model": {"input_shape": [2, 32, 32], "num_classes": 10, "input_layout": "TN"}}
    with snnfw.start(config, model=MyNet, train_set=train, test_set=test) as run:
        for step in range(run.start_step, run.config.train.steps):
            record = run.step(step)          # loss, lr, train_acc, spike_rate, step_ms, ... (Session.step)
        print(run.evaluate()["eval_acc"])
        run.export("my_net.pt")              # a plain state dict by MyNet's own names

``model`` is a module class or builder (called on every rank after seeding
with ``train.seed``) or a module (every rank then takes rank 0's initial
state). Data sets are map-style ``Dataset``s of ``(frames [T, C, H, W],
label)``; each step trains on the same samples in the same microbatches as
``snnfw train`` would, so the equivalence guarantee holds in your loop too.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from snnfw.components.checkpoint import Checkpoints
from snnfw.components.export import write_weights
from snnfw.components.flops import device_peak_tflops
from snnfw.components.metrics import MetricsLog, peak_memory_mb
from snnfw.components.records import Record, StepFigures
from snnfw.config import Config, build_config, load_config
from snnfw.distributed import cpu_allocator
from snnfw.distributed.chunks import gather_whole
from snnfw.distributed.collectives import (RankEnv, collective_errors_in_one_line, decided_once, device_for,
                                           process_group, set_cpu_threads)
from snnfw.errors import ConfigError, PlanError, keys_phrase
from snnfw.plan.auto import Decision
from snnfw.plan.layout import Plan
from snnfw.plan.prepare import from_plan, prepare
from snnfw.plugin.manager import Plugins, check_same_plugins_on_all_ranks
from snnfw.run.trainer import Trainer
from snnfw.rundir import SUMMARY, write_text

CHECKPOINT_MS = "checkpoint_ms"  # a step's metric: the time its checkpoint save held training up
WRITES_INTO_RUN_DIR = ("tensorboard", "wandb", "profile", "memory_snapshot")  # [log] keys


def as_config(config: Config | dict | str | Path | None) -> Config:
    """A :class:`Config` from itself, a dict of ``[section]`` tables, or a TOML file path (None: defaults)."""
    if isinstance(config, Config):
        return config
    if isinstance(config, dict):
        return build_config(config)
    return load_config(config)


class Session:
    """One rank's part of a training job: the parallelized model, its optimizer, and a step under the strategy."""

    # A first step that leaves more objects than this alive (compiled code: its kernels and the compiler's modules,
    # 330,000 objects for the tiny VGG against 51,000 eager) takes them out of the collector's scans.
    FREEZE_ABOVE = 100_000

    def __init__(self, trainer: Trainer, env: RankEnv, mesh, checkpoints: Checkpoints, start_step: int,
                 resumed_loss: float, log: MetricsLog, run_dir: Path | None):
        self.trainer, self.env, self.mesh, self.checkpoints, self.log = trainer, env, mesh, checkpoints, log
        self.run_dir = run_dir
        self.start_step, self.resumed_loss = start_step, resumed_loss
        self.config, self.plan, self.device = trainer.config, trainer.plan, trainer.device
        self.first_step_done = self.heap_frozen = self.summary_written = False
        per_sample = trainer.flops_per_sample
        self.flops_per_step = None if per_sample is None else per_sample * self.plan.global_batch  # the whole job's
        self.peak_tflops = device_peak_tflops(self.config, self.device)  # a device's; None: unknown (a CPU), no MFU
        self.figures = StepFigures()  # the device figures of the steps not read yet
        self.unwritten: list[Record] = []  # records not in the metrics yet, the last step's last
        self.evaluations = [  # every validation with its step, a resumed run's included
            {"step": r["step"], **{k: v for k, v in r.items() if k.startswith("eval_")}}
            for r in log.earlier if "eval_acc" in r
        ]
        self.started = time.perf_counter()

    @property
    def rank(self) -> int:
        """This process's rank in the job (0 without torchrun); kept after the session closes."""
        return self.env.rank

    @property
    def world_size(self) -> int:
        """How many ranks train together (1 without torchrun)."""
        return self.env.world_size

    @property
    def model(self) -> torch.nn.Module:
        """The model as the strategy runs it (DDP, FSDP2, tensor-parallel modules, or this rank's pipeline stages)."""
        return self.trainer.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.trainer.optimizer

    @property
    def scheduler(self):
        return self.trainer.scheduler

    def reset(self) -> None:
        """Resets every neuron's state, as before an independent microbatch."""
        self.trainer.plugins.reset_state(self.trainer.model)

    def step(self, step: int) -> Record:
        """Trains optimizer step ``step`` (from 0) on its global batch; returns its record, the same on every rank.

        The figures computed on the device (loss, accuracy, spike rate, gradient norm, peak memory) start their
        reduction over the ranks at the end of the step, waiting for nothing, and join the record on a step that logs
        (every ``train.log_every`` steps and the last): they are read in one host synchronisation then, with those of
        the steps before that did not log, so that those steps wait for nothing. Asking a record for one earlier
        reads them at once, on any rank alone (:class:`~snnfw.components.records.Record`).
        ``step_ms`` is the host's time in the step: on a GPU, where kernels run after the host has queued them, a
        step that logs also waits for the ones before.

        With a run directory the records are written to ``metrics.jsonl`` (and rank 0 prints a progress line for a
        step that logs) once their figures are read and the step's validation and checkpoint, if any, have added to
        it: when the next step starts, a checkpoint is saved, or the session ends.

        The plugins hear the step start first (``snnfw_step_start``: ``parallel.step_timeout_s`` takes over from the
        second step on). A collective: every rank calls it with the same ``step``. What was alive before the session is out of the
        garbage collector's scans (:func:`start`). After the first step, garbage is collected, and when compiled code
        is in place (more than ``FREEZE_ABOVE`` objects) the objects then alive leave the scans too (``gc.freeze``):
        a full collection over them paused a rank for a quarter of a second with inductor neuron kernels, and every
        rank with it at the next collective. :meth:`close` gives them back.
        """
        self.trainer.plugins.step_start(step + 1, self.env.rank)
        self.write_record(read=False)
        started = time.perf_counter()
        result = self.trainer.step(step)
        elapsed = time.perf_counter() - started
        if not self.first_step_done:
            gc.collect()
            if len(gc.get_objects()) > self.FREEZE_ABOVE:
                gc.freeze()
                self.heap_frozen = True
            self.first_step_done = True
        peaks = [0.0] * self.env.world_size
        peaks[self.env.rank] = peak_memory_mb(self.device)
        record = Record({"step": step + 1, **result.values, "step_ms": elapsed * 1e3,
                         "samples_per_s": self.plan.global_batch / elapsed, **self._tokens(elapsed),
                         **self._utilisation(elapsed * 1e3)},
                        coming=(*result.coming, "peak_mem_mb", "peak_mem_mb_per_rank"))

        def finish(totals: list[float]) -> dict[str, Any]:
            peaks = totals[len(totals) - self.env.world_size:]
            return {**result.finish(totals[:len(totals) - len(peaks)]), "peak_mem_mb": max(peaks),
                    "peak_mem_mb_per_rank": peaks}

        self.figures.add(record, result.row, [*result.host, *peaks], finish)
        self.unwritten.append(record)
        if self.logs(step + 1):
            self.figures.read()
        return record

    def _tokens(self, elapsed: float) -> dict[str, float]:
        """A language model's ``tokens_per_s``: the global batch's positions a second."""
        spec = self.trainer.spec
        return {"tokens_per_s": self.plan.global_batch * spec.shape[0] / elapsed} if spec.vocab is not None else {}

    def _utilisation(self, step_ms: float) -> dict[str, float]:
        """``flops`` (a step's model FLOPs, :mod:`snnfw.components.flops`) and ``mfu``, the share of the ranks' peak
        FLOP/s that a step of ``step_ms`` achieves; each left out where it is unknown."""
        if self.flops_per_step is None:
            return {}
        if self.peak_tflops is None or step_ms <= 0:
            return {"flops": self.flops_per_step}
        peak = self.peak_tflops * 1e12 * self.env.world_size
        return {"flops": self.flops_per_step, "mfu": self.flops_per_step / (step_ms / 1e3) / peak}

    def logs(self, step: int) -> bool:
        """Whether step ``step`` (from 1) logs: every ``train.log_every`` steps, and the last."""
        return step % self.config.train.log_every == 0 or step == self.config.train.steps

    def diverged(self) -> Record | None:
        """The first record whose loss is not finite among those not yet written whose figures every rank has read
        (reads nothing; the same on every rank, whatever one rank asked its records for)."""
        return next((r for r in self.unwritten if r.settled and not math.isfinite(r["loss"])), None)

    def evaluate(self, ops: bool | None = None) -> dict:
        """``eval_loss``, ``eval_acc`` (``eval_acc5`` with more than 5 classes) and ``eval_spike_rate``
        on the test split, every sample scored once over the replicas (a collective); with ``ops`` (default
        ``eval.ops``) the synaptic operations and energy too (:meth:`Trainer.evaluate`). Right after a step the
        ``eval_*`` figures join that step's record and :attr:`evaluations`; the figures of the steps before are read
        first."""
        self.figures.read()
        result = self.trainer.evaluate(self.config.eval.ops if ops is None else ops)
        scores = {key: value for key, value in result.items() if key.startswith("eval_")}
        last = self.unwritten[-1] if self.unwritten else None
        if last is not None and "eval_acc" not in last:
            last.update(scores)
            self.evaluations.append({"step": last["step"], **scores})
        return result

    def predict(self) -> list[dict]:
        """Every test sample's ``index``, ``label``, ``predicted`` class and time-averaged ``logits``, in data
        order, on every rank (a collective)."""
        return self.trainer.predict()

    def save(self, step: int, loss: float = float("nan")) -> None:
        """Writes a checkpoint of the training state after ``step`` steps into the run directory (a collective)."""
        if self.checkpoints.root is None:
            from snnfw.errors import CheckpointError

            raise CheckpointError("Session.save writes into the run directory; pass run_dir to snnfw.start")
        started = time.perf_counter()

        def record_the_step() -> None:  # before the checkpoint is renamed into place, so a resume finds its record
            if self.unwritten and self.unwritten[-1]["step"] == step:
                self.unwritten[-1][CHECKPOINT_MS] = (time.perf_counter() - started) * 1e3  # how long the save held training up
            self.write_record()

        self.figures.read()
        self.checkpoints.save(self.trainer, step, loss, before_rename=record_the_step)

    def write_record(self, read: bool = True) -> None:
        """Writes the records not written yet to the metrics (with a run directory, a progress line on rank 0 for a
        step that logs), reading their figures first; with ``read`` False only those that every rank has read (at a
        step that logs, a checkpoint or a validation), so that each rank writes the same records at the same step."""
        if read:
            self.figures.read()
        while self.unwritten and self.unwritten[0].settled:
            record = self.unwritten.pop(0)
            show = self.env.rank == 0 and self.run_dir is not None and self.logs(record["step"])
            self.log.write(dict(record.items()), show=show)

    def summary(self) -> dict[str, Any]:
        """The run so far, as ``summary.json`` holds it: final loss, every validation and the best, mean step time,
        a step's model FLOPs and the MFU of the mean step (None where unknown), the plan and config, and the losses,
        spike rates and gradient norms of every step (a collective)."""
        self.write_record()
        whole_run = self.log.earlier + self.log.records  # a resumed run's steps before the checkpoint included
        timed = self.log.records[1:] or self.log.records
        mean_step_ms = sum(r["step_ms"] for r in timed) / max(len(timed), 1)
        best = max(self.evaluations, key=lambda e: e["eval_acc"], default=None)  # the first of equals
        last = self.evaluations[-1] if self.evaluations else None
        return {
            "steps": whole_run[-1]["step"] if whole_run else self.start_step,
            "final_loss": self.log.records[-1]["loss"] if self.log.records else self.resumed_loss,
            "resumed_from": self.start_step,
            **({"test_accuracy": last["eval_acc"], "eval": {k: v for k, v in last.items() if k != "step"}} if last else {}),
            "evaluations": self.evaluations,
            **({"best_eval_acc": best["eval_acc"], "best_step": best["step"]} if best else {}),
            "mean_step_ms": mean_step_ms,
            "flops_per_step": self.flops_per_step,
            "peak_tflops": self.peak_tflops,
            "mfu": self._utilisation(mean_step_ms).get("mfu") if timed else None,
            "wall_s": time.perf_counter() - self.started,
            "materialize_s": self.trainer.materialize_s,
            "plan": self.plan.to_dict(),
            "config": self.config.to_dict(),
            "losses": [r["loss"] for r in whole_run],
            "spike_rates": [r["spike_rate"] for r in whole_run],
            "grad_norms": [r["grad_norm"] for r in whole_run],
            **({"loss_scales": [r.get("loss_scale") for r in whole_run]} if self.config.train.precision == "fp16" else {}),
            "layer_spike_rates": self.trainer.layer_spike_rates(),
        }

    def write_summary(self, summary: dict[str, Any]) -> None:
        """Rank 0 writes ``summary`` as the run directory's ``summary.json``."""
        if self.env.rank == 0 and self.run_dir is not None:
            write_text(self.run_dir / SUMMARY, json.dumps(summary, indent=2) + "\n")
        self.summary_written = True

    def finish(self) -> None:
        """Writes what the run directory still lacks: the last record, and ``summary.json`` unless the loop wrote
        its own (a collective, at the end of ``with snnfw.start(...)``)."""
        self.checkpoints.finish()  # an async save still being written
        self.write_record()
        if self.run_dir is not None and not self.summary_written:
            self.write_summary(self.summary())
        self.log.close()

    def state_dict(self, everywhere: bool = False) -> dict[str, torch.Tensor]:
        """The whole model's parameters and buffers by the model's own names, on CPU, on rank 0 (every rank with
        ``everywhere``; the others get ``{}``). A collective.

        Shards are gathered one tensor at a time, so no rank but the receiver holds more than its part and one
        tensor; pipeline stages are merged across ranks.
        """
        trainer = self.trainer
        state = trainer.plugins.state_dict(trainer.model, trainer.optimizer, trainer.plan)["model"]
        return gather_whole(state, dst=None if everywhere else 0)

    def export(self, path: str | Path) -> Path:
        """Saves :meth:`state_dict` with ``torch.save`` (rank 0 writes it whole or not at all, and its SHA-256 beside
        it, ``PATH.sha256``; a collective); returns the path.

        The family's or your own module loads it with ``load_state_dict(torch.load(path, weights_only=True))``.
        """
        state, path = self.state_dict(), Path(path)
        if self.env.rank == 0:
            write_weights(path, lambda temp: torch.save(state, temp))
        return path

    def close(self) -> None:
        """Lets go of the model and optimizer, which must go before their process group does."""
        self.log.close()
        self.trainer = None
        if self.heap_frozen:  # the model among the objects the first step froze: a full collection
            gc.unfreeze()
        gc.collect()  # else over what the session made alone


PLANNING_TIMEOUT_S = 600.0


def _planned_once(config: Config, plugins: Plugins, env: RankEnv):
    """The job's plan made once: rank 0 plans (``auto``'s measurement and choice included) and keeps the model and
    data sets it built; every other rank receives the plan, checks that it was given rank 0's config, and builds
    only its model (:func:`from_plan`). Starts the default process group for it, as ``auto``'s agreement does."""
    from snnfw.plan.layout import Topology

    device_type = Topology.detect(env.world_size, config.parallel.device, backend=config.parallel.backend).device_type
    kept = {}

    def plan_here() -> Plan:
        kept["prepared"] = prepare(config, env.world_size, plugins, rank=0)
        return kept["prepared"].plan

    plan = decided_once(plan_here, device_type, env, _planning_timeout(config), config.parallel.backend)
    digests = [None] * env.world_size
    dist.all_gather_object(digests, _digest(config))
    if differing := [rank for rank, digest in enumerate(digests) if digest != digests[0]]:
        raise PlanError(f"rank(s) {', '.join(map(str, differing))} were given another config than rank 0, which planned "
                        "the run; give every rank the same config file and --set overrides")
    return kept["prepared"] if env.rank == 0 else from_plan(plan, plugins, env.rank)


def _planning_timeout(config: Config) -> float:
    """How long the other ranks wait for rank 0 to plan (auto measures the model): parallel.timeout_s, and at least
    PLANNING_TIMEOUT_S; the process groups wait parallel.timeout_s once the mesh is up."""
    return max(config.parallel.timeout_s, PLANNING_TIMEOUT_S)


def _digest(config: Config) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(config.to_dict(), sort_keys=True, default=str).encode()).hexdigest()


def _agreement(env: RankEnv, config: Config):
    """How ranks that plan for themselves agree on ``auto``'s choice: rank 0's, broadcast (each rank measuring for
    itself could choose another layout and hang or train wrong)."""

    def agree(decide, device_type: str) -> Decision:
        if env.world_size == 1:
            return decide()
        return decided_once(decide, device_type, env, _planning_timeout(config), config.parallel.backend)

    return agree


@contextlib.contextmanager
def start(
    config: Config | dict | str | Path | None = None,
    *,
    model=None,
    train_set=None,
    test_set=None,
    run_dir: str | Path | None = None,
    resume: bool = False,
    weights: dict | None = None,
    plugins: Plugins | None = None,
    plan: Plan | None = None,
) -> Iterator[Session]:
    """Plans, starts the process group (from torchrun's environment) and applies the strategy; yields the :class:`Session`.

    ``model`` (a module, or a callable building one) and ``train_set`` with
    ``test_set`` replace the config's model and data set. ``run_dir`` is where
    the run is written as ``snnfw train`` writes it: ``metrics.jsonl`` (a
    progress line on rank 0 every ``train.log_every`` steps), ``summary.json``
    at the end of the ``with`` block, and checkpoints (``checkpoint.every``
    and :meth:`Session.save`); with
    ``resume`` the session starts from its newest checkpoint
    (``Session.start_step``). ``weights`` (a state dict by the model's own
    names, :func:`snnfw.components.weights.read_weights`) replace the initial ones. Errors in the config are raised before any
    process group work. A collective that times out or loses a rank in the ``with`` block ends it with a
    :class:`~snnfw.errors.CollectiveError`: a ``SystemExit`` whose one line says what happened and what to do.

    Rank 0 plans (builds and analyses the model, asks the strategies, ``auto``'s measurement and choice) and hands
    the plan to the others, which check that they were given its config and only build their model; where the
    model or data sets are handed over here, each rank plans for itself, with ``auto``'s choice rank 0's. A ``plan``
    made before the ranks started (``snnfw train``'s plan file, :mod:`snnfw.plan.planfile`) replaces the config and
    that planning: the rank then only builds the model.
    """
    if plan is not None and (config is not None or model is not None or train_set is not None):
        raise TypeError("a plan holds its config and is made for the config's model and data set; pass the plan alone")
    config = plan.config if plan is not None else as_config(config)
    if run_dir is None and (keys := [f"log.{key}" for key in WRITES_INTO_RUN_DIR if getattr(config.log, key)]):
        subject, pronoun = keys_phrase(keys)
        raise ConfigError(f"{subject} written into the run directory, and this run has none; pass a run directory, "
                          f"or remove {pronoun}")
    if (train_set is None) != (test_set is None):
        raise ConfigError("snnfw.start takes train_set and test_set together; pass both, or neither for the config's data set")
    with _scans_only_the_session():
        yield from _started(config, model, train_set, test_set, run_dir, resume, weights, plugins, plan)


@contextlib.contextmanager
def _scans_only_the_session() -> Iterator[None]:
    """What was alive before the session (modules, the caller's objects) stays out of the garbage collector's scans
    while it runs, so that its collections (after the first step, at the end) look only at what the session built:
    for the tiny VGG 23 ms instead of 130 ms in a bare process (470 ms in the test suite's), most of it torch's
    modules. Everything is scanned again afterwards."""
    gc.collect(1)  # young garbage is not kept
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _started(config: Config, model, train_set, test_set, run_dir, resume, weights, plugins, plan) -> Iterator[Session]:
    env = RankEnv.from_environ()
    plugins = plugins or Plugins()
    datasets = (train_set, test_set) if train_set is not None else None
    started = dist.is_initialized()
    if plan is not None and plan.world_size != env.world_size:
        raise PlanError(f"the plan is made for {plan.world_size} rank(s) and this job has {env.world_size}; launch "
                        f"{plan.world_size} rank(s), or plan again for {env.world_size}")
    try:
        if plan is not None:
            prepared = from_plan(plan, plugins, env.rank)
        elif env.world_size > 1 and model is None and datasets is None:
            prepared = _planned_once(config, plugins, env)
        else:
            prepared = prepare(config, env.world_size, plugins, model=model, datasets=datasets,
                               agree=_agreement(env, config), rank=env.rank)
    except PlanError as err:
        if "WORLD_SIZE" in os.environ or config.parallel.strategy == "none":
            raise
        script = Path(sys.argv[0]).name or "script.py"
        raise PlanError(f"{err}; this process was not started by torchrun, so it is one rank: launch it with "
                        f"`torchrun --nproc_per_node=2 {script}`") from None
    except BaseException:
        if dist.is_initialized() and not started:  # auto's agreement started it; nothing else will end it
            dist.destroy_process_group()
        raise
    config = prepared.plan.config  # as resolved: auto's choice, the preference's defaults
    device = device_for(prepared.plan.layout, env)  # a GPU rank's device is set before its process group starts
    with process_group(prepared.plan.layout, env, config.parallel.timeout_s) as mesh, \
            collective_errors_in_one_line(env.rank, config.parallel):
        if mesh is not None:
            check_same_plugins_on_all_ranks(plugins)
        if device.type == "cpu":
            set_cpu_threads(env)
        cpu_allocator.apply(config.parallel.cpu_allocator, device.type)
        trainer = Trainer(config, prepared, plugins, mesh, device, datasets, weights)
        del prepared  # the session holds the model alone, so that close lets go of it
        run_dir = Path(run_dir) if run_dir is not None else None
        checkpoints = Checkpoints(run_dir, config, env.rank)
        resumed = checkpoints.begin(trainer, resume)
        wandb = (config.log.wandb, config.log.wandb_project, config.to_dict()) if config.log.wandb else None
        log = MetricsLog(run_dir, env.rank == 0, config.train.steps, resumed["step"], config.log.tensorboard, wandb)
        session = Session(trainer, env, mesh, checkpoints, resumed["step"], resumed["loss"], log, run_dir)
        del trainer
        try:
            yield session
            session.finish()
        finally:
            session.close()
