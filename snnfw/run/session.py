"""The Python API: train under any strategy from your own script and loop (``snnfw train`` runs on it too).

Launch the script with ``torchrun --nproc_per_node=N script.py`` (or run it
as one process), then::

    import snnfw

    config = {"parallel": {"strategy": "fsdp2"}, "data": {"batch_size": 32}, "train": {"steps": 100, "lr": 3e-3},
              "model": {"input_shape": [2, 32, 32], "num_classes": 10, "input_layout": "TN"}}
    with snnfw.start(config, model=MyNet, train_set=train, test_set=test) as run:
        for step in range(run.start_step, run.config.train.steps):
            record = run.step(step)          # loss, lr, train_acc, spike_rate, step_ms, ...
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
import os
import time
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from snnfw.components.checkpoint import Checkpoints
from snnfw.components.metrics import peak_memory_mb
from snnfw.config import Config, build_config, load_config
from snnfw.distributed import cpu_allocator
from snnfw.distributed.chunks import gather_whole
from snnfw.distributed.collectives import RankEnv, all_reduce, decided_once, device_for, process_group, set_cpu_threads
from snnfw.plan.auto import Decision
from snnfw.plan.prepare import prepare
from snnfw.plugin.manager import Plugins, check_same_plugins_on_all_ranks
from snnfw.run.trainer import Trainer
from snnfw.rundir import AUTO_DECISION, written_whole


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

    def __init__(self, trainer: Trainer, env: RankEnv, mesh, checkpoints: Checkpoints, start_step: int, resumed_loss: float):
        self.trainer, self.env, self.mesh, self.checkpoints = trainer, env, mesh, checkpoints
        self.start_step, self.resumed_loss = start_step, resumed_loss
        self.config, self.plan, self.device = trainer.config, trainer.plan, trainer.device
        self.first_step_done = self.heap_frozen = False

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

    def step(self, step: int) -> dict[str, Any]:
        """Trains optimizer step ``step`` (from 0) on its global batch; returns its record, the same on every rank.

        A collective: every rank calls it with the same ``step``. What was alive before the session is out of the
        garbage collector's scans (:func:`start`). After the first step, garbage is collected, and when compiled code
        is in place (more than ``FREEZE_ABOVE`` objects) the objects then alive leave the scans too (``gc.freeze``):
        a full collection over them paused a rank for a quarter of a second with inductor neuron kernels, and every
        rank with it at the next collective. :meth:`close` gives them back.
        """
        started = time.perf_counter()
        record = {"step": step + 1, **self.trainer.step(step)}
        elapsed = time.perf_counter() - started
        if not self.first_step_done:
            gc.collect()
            if len(gc.get_objects()) > self.FREEZE_ABOVE:
                gc.freeze()
                self.heap_frozen = True
            self.first_step_done = True
        peaks = [0.0] * self.env.world_size
        peaks[self.env.rank] = peak_memory_mb(self.device)
        peaks = all_reduce(peaks)
        record.update(
            step_ms=elapsed * 1e3,
            samples_per_s=self.plan.global_batch / elapsed,
            peak_mem_mb=max(peaks),
            peak_mem_mb_per_rank=peaks,
        )
        return record

    def evaluate(self) -> dict[str, float]:
        """``eval_loss``, ``eval_acc`` (``eval_acc5`` with more than 5 classes) and ``eval_spike_rate``
        on the test split, every sample scored once over the replicas (a collective)."""
        return self.trainer.evaluate()

    def predict(self) -> list[dict]:
        """Every test sample's ``index``, ``label``, ``predicted`` class and time-averaged ``logits``, in data
        order, on every rank (a collective)."""
        return self.trainer.predict()

    def save(self, step: int, loss: float = float("nan")) -> None:
        """Writes a checkpoint of the training state after ``step`` steps into the run directory (a collective)."""
        if self.checkpoints.root is None:
            from snnfw.errors import CheckpointError

            raise CheckpointError("Session.save writes into the run directory; pass run_dir to snnfw.start")
        self.checkpoints.save(self.trainer, step, loss)

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
        """Saves :meth:`state_dict` with ``torch.save`` (rank 0 writes it whole or not at all; a collective); returns
        the path.

        The family's or your own module loads it with ``load_state_dict(torch.load(path, weights_only=True))``.
        """
        state, path = self.state_dict(), Path(path)
        if self.env.rank == 0:
            with written_whole(path) as temp:
                torch.save(state, temp)
        return path

    def close(self) -> None:
        """Lets go of the model and optimizer, which must go before their process group does."""
        self.trainer = None
        if self.heap_frozen:  # the model among the objects the first step froze: a full collection
            gc.unfreeze()
        gc.collect()  # else over what the session made alone


def _agreement(env: RankEnv, config: Config):
    """How the ranks agree on ``auto``'s choice: the launcher's, carried in the environment; else rank 0's, broadcast
    (each rank measuring for itself could choose another layout and hang or train wrong)."""

    def agree(decide, device_type: str) -> Decision:
        if carried := os.environ.get(AUTO_DECISION):
            return Decision.from_json(carried)
        if env.world_size == 1:
            return decide()
        return decided_once(decide, device_type, env, config.parallel.timeout_s)

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
) -> Iterator[Session]:
    """Plans, starts the process group (from torchrun's environment) and applies the strategy; yields the :class:`Session`.

    ``model`` (a module, or a callable building one) and ``train_set`` with
    ``test_set`` replace the config's model and data set. ``run_dir`` is where
    checkpoints go (``checkpoint.every`` and :meth:`Session.save`); with
    ``resume`` the session starts from its newest checkpoint
    (``Session.start_step``). ``weights`` (a state dict by the model's own
    names, :func:`snnfw.components.weights.read_weights`) replace the initial ones. Errors in the config are raised before any
    process group work.
    """
    config = as_config(config)
    if (train_set is None) != (test_set is None):
        from snnfw.errors import ConfigError

        raise ConfigError("snnfw.start takes train_set and test_set together; pass both, or neither for the config's data set")
    with _scans_only_the_session():
        yield from _started(config, model, train_set, test_set, run_dir, resume, weights, plugins)


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


def _started(config: Config, model, train_set, test_set, run_dir, resume, weights, plugins) -> Iterator[Session]:
    env = RankEnv.from_environ()
    plugins = plugins or Plugins()
    datasets = (train_set, test_set) if train_set is not None else None
    started = dist.is_initialized()
    try:
        prepared = prepare(config, env.world_size, plugins, model=model, datasets=datasets, agree=_agreement(env, config))
    except BaseException:
        if dist.is_initialized() and not started:  # auto's agreement started it; nothing else will end it
            dist.destroy_process_group()
        raise
    config = prepared.plan.config  # as resolved: auto's choice, the preference's defaults
    device = device_for(prepared.plan, env)  # a GPU rank's device is set before its process group starts
    with process_group(prepared.plan, env, config.parallel.timeout_s) as mesh:
        if mesh is not None:
            check_same_plugins_on_all_ranks(plugins)
        if device.type == "cpu":
            set_cpu_threads(env)
        cpu_allocator.apply(config.parallel.cpu_allocator, device.type)
        trainer = Trainer(config, prepared, plugins, mesh, device, datasets, weights)
        del prepared  # the session holds the model alone, so that close lets go of it
        checkpoints = Checkpoints(Path(run_dir) if run_dir is not None else None, config, env.rank)
        resumed = checkpoints.begin(trainer, resume)
        session = Session(trainer, env, mesh, checkpoints, resumed["step"], resumed["loss"])
        del trainer
        try:
            yield session
            session.checkpoints.finish()  # an async save still being written
        finally:
            session.close()
