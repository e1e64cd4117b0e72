"""Checkpoints: the whole training state every ``checkpoint.every`` steps, and resuming from the newest.

``RUN_DIR/checkpoints/step-N`` is a torch.distributed.checkpoint (DCP) folder
with the unsharded model (BatchNorm buffers included) and optimizer state keyed
by the model's parameter and buffer names (``snnfw_state_dict``), the
learning-rate scheduler's state, every rank's RNG state, and ``meta.json``
(step, loss, and the ``FIXED`` settings). The step is the data position, since
the data order is a function of step, seed, global batch and the data set
(name, folder, size, time steps); on resuming, the optimizer's hyperparameters
are the config's, and the learning rate is the config's schedule at the
checkpoint's step. Every rank writes into ``.tmp-step-N``; after a
barrier rank 0 renames it, so a checkpoint is whole or absent. Unsharded, it resumes under any strategy and world size, each strategy
taking its part (``snnfw_load_state_dict``). Loading runs no code from the
files: DCP's metadata is unpickled through an allowlist and its other values
through ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import contextlib
import json
import pickle
import shutil
import sys
import warnings
from pathlib import Path
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import StorageMeta, TensorStorageMetadata

from snnfw.components.optim import resume_scheduler
from snnfw.distributed.collectives import barrier
from snnfw.errors import CheckpointError, DivergedError
from snnfw.rundir import CHECKPOINTS, METRICS, RUN_FILES, TEMP

FIXED = (  # what a resumed run must share: the model, the optimizer and what fixes the data order
    "model.family", "model.flavor", "model.time_steps", "data.name", "data.root", "data.train_samples", "data.batch_size",
    "train.seed", "train.optimizer", "train.no_decay", "train.dtype",
)
PREFIX = "step-"
META = "meta.json"


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only DCP's metadata classes, torch sizes, dtypes and layouts, and paths."""

    MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
    NAMES = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")}

    def find_class(self, module, name):
        if module in self.MODULES or module == "torch" or (module, name) in self.NAMES:
            found = super().find_class(module, name)
            if (module, name) in self.NAMES or isinstance(found, torch.dtype) or (
                module in self.MODULES and isinstance(found, type) and found.__module__ == module
            ):
                return found
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is not allowed")


class _SafeReader(FileSystemReader):
    def read_metadata(self, *args, **kwargs):
        with open(Path(self.path) / ".metadata", "rb") as stream:
            metadata = _MetadataUnpickler(stream).load()
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafePlanner(DefaultLoadPlanner):
    """Loads a flat state dict, reading non-tensor values with ``weights_only=True``."""

    def __init__(self):
        super().__init__(flatten_state_dict=False)

    def load_bytes(self, read_item, value):
        self.original_state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)


def _nest(flat: dict, paths: dict) -> dict:
    """Rebuilds the nested state from DCP's flat keys and their saved paths."""
    root: dict = {}
    for key, value in flat.items():
        *parents, last = paths.get(key, (key,))
        node = root
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return _lists(root)


def _lists(node):
    if not isinstance(node, dict):
        return node
    items = {key: _lists(value) for key, value in node.items()}
    if items and all(isinstance(key, int) for key in items):
        return [items[i] for i in sorted(items)]
    return items


@contextlib.contextmanager
def _quiet():
    """DCP warns when it runs in a single process, which is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _fixed(config) -> dict:
    """The settings a resumed run must share: the model, the optimizer, and what orders the data (as JSON has them)."""
    return json.loads(json.dumps({key: getattr(getattr(config, key.split(".")[0]), key.split(".")[1]) for key in FIXED}))


def _step(path: Path) -> int:
    return int(path.name[len(PREFIX):])


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def complete(root: Path) -> list[Path]:
    """The renamed (so whole) checkpoints ``step-N`` in ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit()]
    return sorted((p for p in found if (p / META).is_file()), key=_step)


def read(path: Path, wanted: Callable[[tuple], bool] | None = None) -> dict:
    """The nested state saved in the checkpoint folder ``path``, in one process (no process group needed).

    ``wanted(keys)`` picks entries by their saved path, such as ``("model", "fc.weight")``;
    only those are read. Runs no code from the files (see the module's docstring).
    """
    reader = _SafeReader(path)
    try:
        metadata = reader.read_metadata()
        paths = metadata.planner_data or {}
        flat = {
            key: torch.empty(md.size, dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata) else None
            for key, md in metadata.state_dict_metadata.items() if wanted is None or wanted(paths.get(key, (key,)))
        }
        with _quiet():
            dcp.load(flat, storage_reader=reader, planner=_SafePlanner())
    except (OSError, pickle.UnpicklingError, dcp.CheckpointException) as err:
        raise CheckpointError(f"checkpoint {path} cannot be read: {err}") from None
    return _nest(flat, paths)




def _earlier_checkpoints(root: Path, newest: Path) -> CheckpointError:
    return CheckpointError(
        f"{root} holds checkpoints up to step {_step(newest)} of an earlier run; "
        "pass --resume to continue it, --overwrite to replace it, or choose another --run-dir"
    )


def check_run_dir(run_dir: Path, resume: bool, overwrite: bool) -> None:
    """Refuses to resume where there is no checkpoint, and to start over an earlier run unless ``overwrite``."""
    done = complete(run_dir / CHECKPOINTS)
    if resume:
        if not done:
            raise CheckpointError(f"--resume continues from a checkpoint, and {run_dir / CHECKPOINTS} holds none; "
                                  "start without --resume (or with --overwrite over an earlier run)")
        return
    if overwrite:
        return
    if done:
        raise _earlier_checkpoints(run_dir / CHECKPOINTS, done[-1])
    if (run_dir / METRICS).exists():
        raise CheckpointError(f"{run_dir} holds an earlier run (metrics.jsonl); pass --overwrite to replace it, "
                              "or choose another --run-dir")


def clear_run_dir(run_dir: Path) -> None:
    """Removes an earlier run's files (``--overwrite``); other files stay."""
    for name in RUN_FILES:
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


class Checkpoints:
    """The checkpoints of one run directory; ``save`` and ``load`` are collectives."""

    def __init__(self, run_dir: Path | None, config, rank: int):
        self.root = Path(run_dir) / CHECKPOINTS if run_dir is not None else None
        self.config, self.rank = config, rank
        if config.checkpoint.every and self.root is None:
            raise CheckpointError("checkpoint.every needs a run directory to write into; pass --run-dir")

    def complete(self) -> list[Path]:
        """The renamed (so whole) checkpoints, oldest first."""
        return complete(self.root) if self.root is not None else []

    def due(self, step: int) -> bool:
        every = self.config.checkpoint.every
        return every > 0 and step % every == 0

    def diverged(self, step: int, loss: float) -> DivergedError:
        """The error for a non-finite loss at ``step`` (a collective).

        The checkpoint of the step before holds the parameters that gave that
        loss, so it is removed; older ones are kept.
        """
        if self.root is not None and self.rank == 0:
            shutil.rmtree(self.root / f"{PREFIX}{step - 1}", ignore_errors=True)
        barrier()
        done = self.complete()
        if done:
            kept = f"the last good checkpoint, {done[-1]}, is kept; continue from it with --resume and a lower train.lr"
        elif self.config.checkpoint.every:
            kept = "no good checkpoint is left"
        else:
            kept = "no checkpoints are written (checkpoint.every = 0)"
        return DivergedError(f"step {step}: the loss is {loss}; training stopped, {kept}")

    def begin(self, trainer, resume: bool) -> dict:
        """Loads the newest checkpoint when resuming; returns its meta (step 0 when starting afresh)."""
        done = self.complete()
        if done and not resume:
            raise _earlier_checkpoints(self.root, done[-1])
        if not done:
            return {"step": 0, "loss": None}
        meta = self.load(trainer, done[-1])
        if self.rank == 0:
            print(f"[snnfw] resuming after step {meta['step']} from {done[-1]}", file=sys.stderr, flush=True)
        return meta

    def save(self, trainer, step: int, loss: float) -> None:
        """Writes ``step-N`` (all ranks into a temporary folder, then rank 0 renames it) and prunes old ones."""
        final, temp = self.root / f"{PREFIX}{step}", self.root / f"{TEMP}{PREFIX}{step}"
        if self.rank == 0:
            for stale in self.root.glob(f"{TEMP}*"):
                shutil.rmtree(stale)
            temp.mkdir(parents=True)
        barrier()
        state = trainer.plugins.state_dict(trainer.model, trainer.optimizer, trainer.plan)
        foreign = sorted(set(state["model"]) - trainer.state_names)
        if foreign:
            raise CheckpointError(
                f"strategy {trainer.plan.strategy!r} names model state the model does not have ({', '.join(foreign[:3])}, ...); "
                "its plugin must implement snnfw_state_dict to name the state by the model's own parameter names"
            )
        with _quiet():
            dcp.save(
                {**state, "scheduler": trainer.scheduler.state_dict(), "rng": {f"rank{self.rank}": _rng_state()}},
                storage_writer=FileSystemWriter(temp),
            )
        barrier()
        if self.rank == 0:
            meta = {"step": step, "loss": loss, "fixed": _fixed(self.config),
                    "strategy": trainer.plan.strategy, "world_size": trainer.plan.world_size,
                    "loss_scale": trainer.run.loss_scale.state_dict()}
            (temp / META).write_text(json.dumps(meta) + "\n")
            if final.exists():
                shutil.rmtree(final)
            temp.rename(final)
            for old in self.complete()[: -self.config.checkpoint.keep]:
                shutil.rmtree(old)
        barrier()

    def load(self, trainer, path: Path) -> dict:
        """Restores model, optimizer (with the config's hyperparameters), the learning-rate scheduler at its step
        (on the curve of the config's ``train.lr``) and this rank's RNG from ``path``; returns its meta."""
        meta = json.loads((path / META).read_text())
        mine = _fixed(self.config)
        changed = [
            f"{key} is {value!r} in the checkpoint and {mine[key]!r} in the config"
            for key, value in meta["fixed"].items() if mine.get(key) != value
        ]
        if changed:
            raise CheckpointError(
                f"{path} cannot be resumed: {'; '.join(changed)}; resuming needs the same model, optimizer, dtype and "
                "data order, so set them as the checkpoint has them or choose another --run-dir"
            )
        state = read(path)
        missing = sorted(trainer.state_names - set(state.get("model", {})))
        if missing:
            raise CheckpointError(f"checkpoint {path} lacks model state {', '.join(missing[:3])}: it is of another model")
        configured = [{k: v for k, v in group.items() if k != "params"} for group in trainer.optimizer.param_groups]
        trainer.plugins.load_state_dict(trainer.model, trainer.optimizer, trainer.plan, state)
        for group, settings in zip(trainer.optimizer.param_groups, configured):
            group.update(settings)  # the config's hyperparameters, not the checkpoint's
        resume_scheduler(trainer.scheduler, state["scheduler"], self.config.train.lr)
        loss_scale = trainer.run.loss_scale
        if loss_scale.enabled and meta.get("loss_scale", {}).get("enabled"):  # else fp16 starts its scale afresh
            loss_scale.load_state_dict(meta["loss_scale"])
        rng = state.get("rng", {}).get(f"rank{self.rank}", {})
        if "cpu" in rng:
            torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
        return meta
