"""``snnfw export``: a plain state dict (the model's own names -> whole tensors) from a checkpoint.

A checkpoint already holds the model whole, by the model's parameter and
buffer names, whatever the strategy and world size that wrote it (tensor
parallel slices and FSDP2 shards gathered, pipeline stages by model names).
Export reads only those entries (and the optimizer's parameter names, to count
parameters), in one process without a process group, through the checkpoint's
safe loading, once every file of the checkpoint is checked against its
digest, and writes them with ``torch.save`` (or as safetensors), with their
SHA-256 beside them (``OUT.sha256``, as ``sha256sum`` writes it), which
``snnfw eval`` and ``predict`` check.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import torch

from snnfw.components import checkpoint as ckpt
from snnfw.components import integrity
from snnfw.errors import CheckpointError
from snnfw.rundir import (BEST_MODEL, CHECKPOINTS, FINAL_MODEL, STEP, STEP_META, TEMP_PREFIX, check_writable, write_text,
                          written_whole)

SAFETENSORS = ".safetensors"
DIGEST = ".sha256"  # beside an export: its SHA-256 and name, as sha256sum writes them


@attrs.frozen
class Exported:
    """What :func:`export` wrote."""

    checkpoint: Path
    out: Path
    step: int
    meta: dict
    tensors: int
    values: int
    parameters: int | None  # elements of the optimizer's parameters; None when the checkpoint does not name them

    def line(self) -> str:
        origin = ""
        if "strategy" in self.meta:
            origin = f" ({self.meta['strategy']} on {self.meta['world_size']} rank(s))"
        count = f"{self.parameters:,} parameters" if self.parameters is not None else f"{self.values:,} values"
        if self.parameters is not None and self.values != self.parameters:
            count += f" and {self.values - self.parameters:,} buffer values"
        return f"exported step {self.step} of {self.checkpoint}{origin}: {self.tensors} tensors, {count} -> {self.out}"


def find(source: str | Path) -> tuple[Path, dict]:
    """The checkpoint folder ``source`` names and its ``meta.json``, checked whole: ``source`` itself, or the newest
    whole one of a run directory (newer ones damaged or not completed passed over with a note)."""
    source = Path(source)
    if not source.exists():
        raise CheckpointError(f"{source} does not exist; name a run directory or one of its checkpoints/step-K folders")
    if source.name.startswith(TEMP_PREFIX):
        raise CheckpointError(f"{source} is not a complete checkpoint (it has no {STEP_META}); export a complete one")
    if source.name.startswith(STEP) or any((source / name).exists() for name in (STEP_META, ".metadata")):
        found = source, integrity.verify(source)
    else:
        root = source if source.name == CHECKPOINTS else source / CHECKPOINTS
        found = integrity.newest_whole(root, integrity.note)
        if found is None:
            plain = [name for name in (FINAL_MODEL, BEST_MODEL) if (source / name).is_file()]
            raise CheckpointError(
                f"{source} holds no complete checkpoint: looked for {root}/{STEP}K folders with {STEP_META} "
                "(written with checkpoint.every = N and --run-dir)"
                + (f"; its {' and '.join(plain)} are plain state dicts already, to load as they are" if plain else "")
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
    """Writes the model state of checkpoint or run directory ``source`` to ``out``; loadable with
    ``module.load_state_dict(torch.load(out, weights_only=True))``."""
    (path, meta), out = find(source), Path(out)
    check_writable(out, "--out")
    write = _writer(out)
    state, names = model_state(path)
    try:
        with written_whole(out) as temp:
            write(state, temp)
            digest = integrity.file_digest(temp, "sha256").partition(":")[2]
        write_text(digest_of(out), f"{digest}  {out.name}\n")
    except OSError as err:  # a full disk, a quota: what check_writable's probe cannot see
        raise CheckpointError(f"--out {out} could not be written ({err.strerror}); free space, or name another "
                              "place") from None
    tensors = [value for value in state.values() if torch.is_tensor(value)]
    parameters = sum(state[name].numel() for name in names if name in state) if names is not None else None
    return Exported(path, out, meta["step"], meta, len(tensors), sum(t.numel() for t in tensors), parameters)


def digest_of(path: Path) -> Path:
    """Where the SHA-256 of the export ``path`` is written."""
    return path.with_name(path.name + DIGEST)


def check_digest(path: Path) -> None:
    """Refuses the file ``path`` when a digest written beside it (by ``snnfw export``) does not match it."""
    recorded = digest_of(path)
    if not recorded.is_file():
        return
    expected = recorded.read_text(errors="replace").split()[:1]
    if expected != [integrity.file_digest(path, "sha256").partition(":")[2]]:
        raise CheckpointError(f"{path} does not match the SHA-256 in {recorded} (corrupt or cut); export it again, or "
                              "restore it from a copy")
