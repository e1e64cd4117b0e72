"""``snnfw export``: a plain state dict (the model's own names -> whole tensors) from a run's weights.

The weights a source names (:func:`weights_of`, which ``snnfw export`` in either format, ``eval`` and
``predict`` share): a file (``final_model.pt``, ``best_model.pt``, an earlier export), a checkpoint folder,
or a run directory's newest, its newest whole checkpoint unless its ``final_model.pt`` is newer (the run
ended after its last checkpoint, or wrote none). A checkpoint already holds the model whole, by the model's parameter and
buffer names, whatever the strategy and world size that wrote it (tensor parallel slices and FSDP2 shards
gathered, pipeline stages by model names). Export reads only those entries (and the optimizer's parameter
names, to count parameters), in one process without a process group, through the checkpoint's safe loading,
once every file of the checkpoint is checked against its digest, and writes them with ``torch.save`` (or as
safetensors), with their SHA-256 beside them (``OUT.sha256``, as ``sha256sum`` writes it), which ``snnfw
eval`` and ``predict`` check. :func:`run_config` reads the config a run recorded, which builds the network
for ``--format nir``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import attrs
import torch

from snnfw.components import checkpoint as ckpt
from snnfw.components import integrity
from snnfw.config import Config, build_config
from snnfw.errors import CheckpointError, ConfigError
from snnfw.rundir import (BEST_MODEL, CHECKPOINTS, DIGEST, FINAL_MODEL, PLAN, STEP, STEP_META, SUMMARY, TEMP_PREFIX,
                          check_writable, checkpoint_step, complete_checkpoints, remove_whole, write_text, written_whole)

SAFETENSORS = ".safetensors"


@attrs.frozen
class Exported:
    """What :func:`export` wrote."""

    source: Path  # the checkpoint folder or weights file read
    out: Path
    step: int | None  # None for a weights file of no run
    meta: dict
    tensors: int
    values: int
    parameters: int | None  # elements of the optimizer's parameters; None when the source does not name them

    def line(self) -> str:
        origin = ""
        if "strategy" in self.meta:
            origin = f" ({self.meta['strategy']} on {self.meta['world_size']} rank(s))"
        count = f"{self.parameters:,} parameters" if self.parameters is not None else f"{self.values:,} values"
        if self.parameters is not None and self.values != self.parameters:
            count += f" and {self.values - self.parameters:,} buffer values"
        what = f"step {self.step} of {self.source}" if self.step is not None else str(self.source)
        return f"exported {what}{origin}: {self.tensors} tensors, {count} -> {self.out}"


def _is_checkpoint(folder: Path) -> bool:
    return folder.name.startswith(STEP) or any((folder / name).exists() for name in (STEP_META, ".metadata"))


def weights_of(source: str | Path) -> tuple[Path, dict | None]:
    """The weights ``source`` names, and for a checkpoint its ``meta.json`` once checked whole (:func:`find`): a
    file or a checkpoint folder itself; of a run directory its newest, its newest whole checkpoint (whose files are
    checked against their digests) unless its ``final_model.pt`` is newer (the run ended after its last checkpoint,
    or wrote none). Refuses a source that holds neither, naming what was looked for."""
    source = Path(source)
    if source.is_file():
        return source, None
    newest, ended = complete_checkpoints(source / CHECKPOINTS), _summary(source).get("steps")  # final_model.pt's step
    if (source / FINAL_MODEL).is_file() and (not newest or isinstance(ended, int) and ended > checkpoint_step(newest[-1])):
        return source / FINAL_MODEL, None
    return find(source)


def _summary(run_dir: Path) -> dict:
    """The run's ``summary.json`` ({} when it has none, or one that cannot be read)."""
    try:
        summary = json.loads((run_dir / SUMMARY).read_text())
    except (OSError, ValueError):
        return {}
    return summary if isinstance(summary, dict) else {}


def run_of(source: str | Path) -> Path:
    """The run directory that holds ``source``: a run directory itself, a checkpoint's run, a weights file's folder."""
    source = Path(source)
    if source.is_file():
        return source.parent
    if _is_checkpoint(source):
        return source.parent.parent if source.parent.name == CHECKPOINTS else source.parent
    return source.parent if source.name == CHECKPOINTS else source


def run_config(source: str | Path, overrides: list[str] = ()) -> Config:
    """The config the run holding ``source`` recorded (its ``summary.json``, else the ``plan.json`` that snnfw
    train wrote), with ``overrides`` (``--set``) applied."""
    run = run_of(source)
    recorded = _summary(run).get("config")
    if recorded is None:
        try:
            recorded = json.loads((run / PLAN).read_text())["plan"]["config"]
        except (OSError, ValueError, KeyError, TypeError):
            raise ConfigError(f"{run} holds neither {SUMMARY} nor {PLAN}, which record the config of the run that "
                              "wrote the weights; pass its config with --config CONFIG") from None
    return build_config(recorded, list(overrides))


def find(source: str | Path) -> tuple[Path, dict]:
    """The checkpoint folder ``source`` names and its ``meta.json``, checked whole: ``source`` itself, or the newest
    whole one of a run directory (newer ones damaged or not completed passed over with a note)."""
    source = Path(source)
    if not source.exists():
        raise CheckpointError(f"{source} does not exist; name a run directory, one of its checkpoints/step-K folders "
                              "or a weights file")
    if source.name.startswith(TEMP_PREFIX):
        raise CheckpointError(f"{source} is not a complete checkpoint (it has no {STEP_META}); export a complete one")
    if _is_checkpoint(source):
        found = source, integrity.verify(source)
    else:
        root = source if source.name == CHECKPOINTS else source / CHECKPOINTS
        found = integrity.newest_whole(root, integrity.note)
        if found is None:
            best = source / BEST_MODEL
            raise CheckpointError(
                f"{source} holds no {FINAL_MODEL} (written when a run ends) and no complete checkpoint: looked for "
                f"{root}/{STEP}K folders with {STEP_META} (written with checkpoint.every = N and --run-dir)"
                + (f"; name {best}, the best validation's weights, to export them" if best.is_file() else "")
            )
    if integrity.DIGESTS not in found[1]:
        integrity.note(integrity.unsealed_note(found[0]))
    return found


def model_state(path: Path) -> tuple[dict, list[str] | None]:
    """The model's state saved in checkpoint ``path`` (sorted by name) and the optimizer's parameter names."""
    state = ckpt.read(path, lambda keys: keys[0] == "model" or (keys[0] == "optimizer" and keys[-1] == "params"))
    model = state.get("model")
    if not model:
        raise CheckpointError(f"checkpoint {path} holds no model state")
    groups = state.get("optimizer", {}).get("param_groups", [])
    names = [name for group in groups for name in group.get("params", [])]
    named = bool(names) and all(isinstance(name, str) for name in names)
    return {name: model[name] for name in sorted(model)}, (names if named else None)


def _writer(out: Path):
    """How ``out`` is written, by its suffix; refuses ``.safetensors`` without the safetensors package."""
    if not out.name.endswith(SAFETENSORS):
        return torch.save
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise CheckpointError(
            f"{out} asks for the safetensors format, but the safetensors package is not importable; "
            "pip install safetensors, or name a .pt file"
        ) from None

    def write(state: dict, path: Path) -> None:
        other = sorted(name for name, value in state.items() if not torch.is_tensor(value))
        if other:
            raise CheckpointError(f"safetensors holds only tensors, and the model state {', '.join(other[:3])} is not one; "
                                  "name a .pt file")
        save_file({name: value.contiguous() for name, value in state.items()}, str(path))

    return write


def export(source: str | Path, out: str | Path) -> Exported:
    """Writes the model state of the weights ``source`` names (:func:`weights_of`) to ``out``; loadable with
    ``module.load_state_dict(torch.load(out, weights_only=True))``."""
    (path, meta), out = weights_of(source), Path(out)
    check_writable(out, "--out")
    write = _writer(out)
    if meta is None:
        state, names, (step, meta) = read_file(path), None, _origin(path)
    else:
        step, (state, names) = meta["step"], model_state(path)
    try:
        write_weights(out, lambda temp: write(state, temp))
    except OSError as err:  # a full disk, a quota: what check_writable's probe cannot see
        raise CheckpointError(f"--out {out} could not be written ({err.strerror}); free space, or name another "
                              "place") from None
    tensors = [value for value in state.values() if torch.is_tensor(value)]
    parameters = sum(state[name].numel() for name in names if name in state) if names is not None else None
    return Exported(path, out, step, meta, len(tensors), sum(t.numel() for t in tensors), parameters)


def _origin(weights: Path) -> tuple[int | None, dict]:
    """The step and the strategy and world size of a run's ``final_model.pt``, by its summary; (None, {}) for another
    file."""
    plan = _summary(weights.parent).get("plan") if weights.name == FINAL_MODEL else None
    if not isinstance(plan, dict) or "strategy" not in plan:
        return None, {}
    return _summary(weights.parent).get("steps"), {"strategy": plan.get("preset") or plan["strategy"],
                                                   "world_size": plan["world_size"]}


def read_file(source: Path) -> dict[str, torch.Tensor]:
    """The state dict in the ``.pt`` or ``.safetensors`` file ``source``, checked against a digest beside it; read
    without running code from it (``weights_only``)."""
    check_digest(source)
    try:
        if source.name.endswith(SAFETENSORS):
            from safetensors.torch import load_file

            weights = load_file(source)
        else:
            weights = torch.load(source, weights_only=True, map_location="cpu")
    except Exception as err:  # truncated, empty, not a torch file, or holding what weights_only refuses
        raise CheckpointError(f"{source} cannot be read as a state dict ({_unreadable(err)}); give a file that "
                              "torch.save or snnfw export wrote, a run directory or a checkpoint") from None
    if not isinstance(weights, dict) or not all(isinstance(k, str) and isinstance(t, torch.Tensor) for k, t in weights.items()):
        raise CheckpointError(f"{source} holds {type(weights).__name__}, not a state dict of parameter names to tensors; "
                              "give what model.state_dict() or snnfw export wrote")
    return weights


def _unreadable(err: Exception) -> str:
    """Why torch.load refused a file, without torch's advice to load it unsafely (``weights_only=False``)."""
    text = str(err)
    found = [line.strip() for line in text.splitlines() if "Unsupported global: GLOBAL " in line]
    if found:
        return f"it holds {found[0].split('GLOBAL ')[-1].split()[0]}, not only tensors, and snnfw does not unpickle code"
    first = "" if "Weights only load failed" in text or not text.strip() else text.strip().splitlines()[0][:200]
    return f"not a torch file, or cut short: {type(err).__name__}" + (f" {first}" if first else "")


def digest_of(path: Path) -> Path:
    """Where the SHA-256 of the weights file ``path`` is written."""
    return path.with_name(path.name + DIGEST)


def write_weights(path: Path, write: Callable[[Path], None]) -> None:
    """Writes the weights file ``path`` whole with ``write(temporary path)``, then its SHA-256 beside it
    (:func:`digest_of`); the digest of the file it replaces goes first, so none is left beside a file it does not
    describe (a file whose writing was cut short has none, and is read unchecked)."""
    remove_whole(digest_of(path))
    with written_whole(path) as temp:
        write(temp)
        digest = integrity.file_digest(temp, "sha256").partition(":")[2]
    write_text(digest_of(path), f"{digest}  {path.name}\n")


def check_digest(path: Path) -> None:
    """Refuses the file ``path`` when the digest written beside it (by ``snnfw export``, or the run that wrote
    ``final_model.pt`` and ``best_model.pt``) does not match it; a file without one (an earlier snnfw's) passes."""
    recorded = digest_of(path)
    if not recorded.is_file():
        return
    expected = recorded.read_text(errors="replace").split()[:1]
    if expected != [integrity.file_digest(path, "sha256").partition(":")[2]]:
        raise CheckpointError(f"{path} does not match the SHA-256 in {recorded} (corrupt or cut); restore it from a copy, "
                              "or write it again")
