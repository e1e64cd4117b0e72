"""Checkpoints: the whole training state every ``checkpoint.every`` steps, and resuming from the newest.

``RUN_DIR/checkpoints/step-N`` is a torch.distributed.checkpoint (DCP) folder.
Every rank writes the state it holds (``snnfw_state_dict``): FSDP2's shards,
tensor-parallel slices, its pipeline stages, its ZeRO partition of the
optimizer, replicated tensors once; nothing is gathered whole. Entries are
keyed by the model's own parameter and buffer names, so a checkpoint resumes
under any strategy and world size: each rank reads what it holds there and
DCP reshards. Beside them: the learning-rate scheduler's state, every rank's
RNG state, and ``meta.json`` (step, loss, and the ``FIXED`` settings). The
step is the data position, since the data order is a function of step, seed,
global batch and the data set (name, folder, size, time steps); on resuming,
the optimizer's hyperparameters are the config's, and the learning rate is
the config's schedule at the checkpoint's step.

Every rank writes into ``.tmp-step-N``; after a barrier rank 0 renames it, so
a checkpoint is whole or absent. With ``checkpoint.async_save`` the state is
staged to CPU and written in the background while training goes on; it is
renamed when the next save begins or the run ends, and a run that dies before
leaves the previous checkpoint. ``meta.json`` records each file's digest
(:mod:`snnfw.components.integrity`), checked before a checkpoint is read;
resuming passes over a damaged newest checkpoint, with a note. Loading runs no
code from the files: DCP's metadata is unpickled through an allowlist and its
other values through ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import contextlib
import copy
import json
import pickle
import shutil
import sys
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Callable

import attrs
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.staging import AsyncStager

from snnfw.components import integrity
from snnfw.components.dcp_reader import SafeReader
from snnfw.components.optim import resume_scheduler
from snnfw.distributed.chunks import Chunked, leaves, whole_shape
from snnfw.distributed.collectives import barrier
from snnfw.errors import CheckpointError, DivergedError
from snnfw.rundir import (
    CHECKPOINTS,
    STEP,
    STEP_META,
    TEMP_PREFIX,
    complete_checkpoints,
    earlier_checkpoints,
    remove_whole,
    write_text,
)

FIXED = (  # what a resumed run must share: the model, the optimizer and what fixes the data order
    "model.family", "model.flavor", "model.time_steps", "data.name", "data.root", "data.train_samples", "data.batch_size",
    "train.seed", "train.optimizer", "train.no_decay", "train.dtype",
)


def _failed(err: dcp.CheckpointException) -> str:
    """What DCP's exception says of each rank that failed, one line each (its traceback's last)."""
    return "; ".join(f"rank {rank}: {(str(trace).strip().splitlines() or ['failed'])[-1]}"
                     for rank, trace in sorted(err.failures.items()))


def _unreadable(path: Path, err: Exception) -> CheckpointError:
    """The refusal of checkpoint ``path``, which the allowlist or DCP could not read."""
    why = _failed(err) if isinstance(err, dcp.CheckpointException) else str(err)
    return CheckpointError(f"checkpoint {path} cannot be read ({why}); restore it from a copy")


class _SafePlanner(DefaultLoadPlanner):
    """Loads a flat state dict, reading non-tensor values with ``weights_only=True``."""

    def __init__(self):
        super().__init__(flatten_state_dict=False)

    def load_bytes(self, read_item, value):
        self.original_state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)


class _HeldSavePlanner(DefaultSavePlanner):
    """DCP's save planner, which also writes the pieces of :class:`Chunked` values."""

    def lookup_object(self, index):
        value = self.state_dict[index.fqn]
        if isinstance(value, Chunked):
            return value.piece_at(index.offset).contiguous()
        return super().lookup_object(index)


class _HeldLoadPlanner(DefaultLoadPlanner):
    """Reads a checkpoint into the state a rank holds (:class:`Chunked` pieces in place), non-tensor values with
    ``weights_only=True``."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
        """As DefaultLoadPlanner's, without its making of meta tensors (there are none), which drops Chunked."""
        self.original_state_dict = state_dict
        self.state_dict, self.mappings = flatten_state_dict(state_dict)
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index):
        value = self.state_dict[index.fqn]
        if isinstance(value, Chunked):
            return value.piece_at(index.offset)
        return super().lookup_tensor(index)

    def load_bytes(self, read_item, value):
        set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], torch.load(value, weights_only=True))


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


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def read(path: Path, wanted: Callable[[tuple], bool] | None = None) -> dict:
    """The nested state saved in the checkpoint folder ``path``, in one process (no process group needed).

    ``wanted(keys)`` picks entries by their saved path, such as ``("model", "fc.weight")``;
    only those are read. Runs no code from the files (see the module's docstring).
    """
    reader = SafeReader(path)
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
        raise _unreadable(path, err) from None
    return _nest(flat, paths)


def _staged(state):
    """A copy of ``state`` on the CPU that training cannot change: DTensors stay DTensors, :class:`Chunked`
    stays :class:`Chunked`."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, dict):
        return {key: _staged(value) for key, value in state.items()}
    if isinstance(state, Chunked):
        return state.staged()
    if isinstance(state, DTensor):
        local = state.to_local().detach().to("cpu", copy=True)
        return DTensor.from_local(local, state.device_mesh, state.placements, run_check=False, shape=state.shape,
                                  stride=state.stride())
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    return copy.deepcopy(state)


class _CpuStager(AsyncStager):
    """Stages the state for a background write with :func:`_staged`, before ``async_save`` returns."""

    _synchronize_after_execute = False

    def stage(self, state_dict):
        return _staged(state_dict)


@attrs.frozen
class _Pending:
    """A save whose files are still being written: renamed into place by :meth:`Checkpoints.finish`."""

    written: Future | None
    temp: Path
    final: Path
    meta: dict


class Checkpoints:
    """The checkpoints of one run directory; ``save``, ``finish`` and ``load`` are collectives."""

    def __init__(self, run_dir: Path | None, config, rank: int):
        self.root = Path(run_dir) / CHECKPOINTS if run_dir is not None else None
        self.config, self.rank = config, rank
        self.pending: _Pending | None = None
        self._writers = None  # the process group of background writes, apart from the training's collectives
        if config.checkpoint.every and self.root is None:
            raise CheckpointError("checkpoint.every needs a run directory to write into; pass --run-dir")

    def complete(self) -> list[Path]:
        """The renamed (so whole) checkpoints, oldest first."""
        return complete_checkpoints(self.root) if self.root is not None else []

    def due(self, step: int) -> bool:
        every = self.config.checkpoint.every
        return every > 0 and step % every == 0

    def diverged(self, step: int, loss: float) -> DivergedError:
        """The error for a non-finite loss at ``step`` (a collective).

        The checkpoint of the step before holds the parameters that gave that
        loss, so it is removed; older ones are kept.
        """
        self.finish()
        if self.root is not None and self.rank == 0:
            remove_whole(self.root / f"{STEP}{step - 1}")
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
        """Loads the newest whole checkpoint when resuming (newer damaged ones passed over with a note); returns its
        meta (step 0 when starting afresh)."""
        done = self.complete()
        if done and not resume:
            raise earlier_checkpoints(self.root, done[-1])
        found = integrity.newest_whole(self.root, self._note) if resume and self.root is not None else None
        if found is None:
            return {"step": 0, "loss": None}
        path, meta = found
        if integrity.DIGESTS not in meta:
            self._note(integrity.unsealed_note(path))
        self.load(trainer, path, meta)
        if self.rank == 0:
            print(f"[snnfw] resuming after step {meta['step']} from {path}", file=sys.stderr, flush=True)
        return meta

    def _note(self, text: str) -> None:
        if self.rank == 0:
            print(f"[snnfw] note: {text}", file=sys.stderr, flush=True)

    def save(self, trainer, step: int, loss: float, before_rename: Callable[[], None] = lambda: None) -> None:
        """Writes ``step-N``: every rank its part into a temporary folder, renamed by rank 0 when all are written
        (at once, or with ``checkpoint.async_save`` at the next save or :meth:`finish`); prunes old ones.

        ``before_rename`` runs once the files are written (or handed to the background writer), before the
        checkpoint can be found: what must be on disk before a resume can start from it (the step's metrics)."""
        self.finish()
        final, temp = self.root / f"{STEP}{step}", self.root / f"{TEMP_PREFIX}{STEP}{step}"
        if self.rank == 0:
            for stale in self.root.glob(f"{TEMP_PREFIX}*"):
                shutil.rmtree(stale)
            temp.mkdir(parents=True)
        barrier()
        state = trainer.plugins.state_dict(trainer.model, trainer.optimizer, trainer.plan)
        foreign = sorted(set(state["model"]) - trainer.state_names)
        if foreign:
            raise CheckpointError(
                f"strategy {trainer.plan.name!r} names model state the model does not have ({', '.join(foreign[:3])}, ...); "
                "its plugin must implement snnfw_state_dict to name the state by the model's own parameter names"
            )
        state = {**state, "scheduler": trainer.scheduler.state_dict(), "rng": {f"rank{self.rank}": _rng_state()}}
        meta = {"step": step, "loss": loss, "fixed": _fixed(self.config), "strategy": trainer.plan.name,
                "world_size": trainer.plan.world_size, "loss_scale": trainer.run.loss_scale.state_dict()}
        writer, planner = integrity.DigestingWriter(temp), _HeldSavePlanner()
        if self.config.checkpoint.async_save:
            with _quiet():
                written = dcp.async_save(state, storage_writer=writer, planner=planner, async_stager=_CpuStager(),
                                         process_group=self._background_group())
            self.pending = _Pending(written, temp, final, meta)
            before_rename()
            return
        with _quiet():
            dcp.save(state, storage_writer=writer, planner=planner)
        self.pending = _Pending(None, temp, final, meta)
        before_rename()
        self.finish()

    def _background_group(self):
        if self._writers is None and torch.distributed.is_initialized():
            self._writers = torch.distributed.new_group(backend="gloo")
        return self._writers

    def finish(self) -> None:
        """Waits for the save in progress, if any, and renames it into place (a collective)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        if pending.written is not None:
            try:
                pending.written.result()
            except dcp.CheckpointException as err:
                raise CheckpointError(
                    f"the background write of {pending.final} failed ({_failed(err)}); the checkpoints before it are "
                    "kept, and --resume continues from the newest"
                ) from None
        barrier()
        if self.rank == 0:
            write_text(pending.temp / STEP_META, json.dumps(integrity.seal(pending.temp, pending.meta)) + "\n")
            remove_whole(pending.final)
            pending.temp.rename(pending.final)
            for old in self.complete()[: -self.config.checkpoint.keep]:
                remove_whole(old)
        barrier()

    def load(self, trainer, path: Path, meta: dict) -> None:
        """Restores model, optimizer (with the config's hyperparameters), the learning-rate scheduler at its step
        (on the curve of the config's ``train.lr``) and this rank's RNG from checkpoint ``path`` (checked whole,
        with ``meta`` its ``meta.json``).

        Each rank reads only what it holds under its strategy (``snnfw_state_dict`` gives the shapes)."""
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
        held = trainer.plugins.state_dict(trainer.model, trainer.optimizer, trainer.plan)
        wanted = {"model": held["model"], "optimizer": {"state": held["optimizer"]["state"]}}
        reader = SafeReader(path)
        try:
            _check_fits(path, reader.read_metadata(), wanted)
            with _quiet():
                dcp.load(wanted, storage_reader=reader, planner=_HeldLoadPlanner())
        except (OSError, pickle.UnpicklingError, dcp.CheckpointException) as err:
            raise _unreadable(path, err) from None
        configured = [{k: v for k, v in group.items() if k != "params"} for group in trainer.optimizer.param_groups]
        trainer.plugins.load_state_dict(trainer.model, trainer.optimizer, trainer.plan, held)
        for group, settings in zip(trainer.optimizer.param_groups, configured):
            group.update(settings)  # the config's hyperparameters, not the checkpoint's
        small = read(path, lambda keys: keys[0] == "scheduler" or keys[:2] == ("rng", f"rank{self.rank}"))
        resume_scheduler(trainer.scheduler, small["scheduler"], self.config.train.lr)
        loss_scale = trainer.run.loss_scale
        if loss_scale.enabled and meta.get("loss_scale", {}).get("enabled"):  # else fp16 starts its scale afresh
            loss_scale.load_state_dict(meta["loss_scale"])
        rng = small.get("rng", {}).get(f"rank{self.rank}", {})
        if "cpu" in rng:
            torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])


def _check_fits(path: Path, metadata, wanted: dict) -> None:
    """Refuses, in one line, a checkpoint that lacks what this rank holds or holds it in another shape."""
    saved = {tuple(keys): metadata.state_dict_metadata[key] for key, keys in (metadata.planner_data or {}).items()}
    missing, reshaped = [], []
    for keys, value in leaves(wanted):
        found = saved.get(keys)
        if found is None:
            missing.append(keys)
        elif isinstance(found, TensorStorageMetadata) and tuple(found.size) != tuple(whole_shape(value)):
            reshaped.append(f"{keys[1]} is {list(found.size)} there and {list(whole_shape(value))} here")
    if reshaped:
        raise CheckpointError(
            f"checkpoint {path} holds another model: {'; '.join(reshaped[:2])}; resume with the model settings "
            "(model.*) it was written with, or choose another --run-dir"
        )
    names = sorted({keys[1] if keys[0] == "model" else keys[2] for keys in missing})
    if any(keys[0] == "model" for keys in missing):
        raise CheckpointError(f"checkpoint {path} lacks model state {', '.join(names[:3])}: it is of another model")
    if missing:
        raise CheckpointError(
            f"checkpoint {path} lacks optimizer state of {', '.join(names[:3])}; resume with the train.* settings "
            "it was written with, or choose another --run-dir"
        )
