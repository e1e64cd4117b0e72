"""The on-disk cache of memopt's choices: which modules it wrapped, and how, per model and input."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn


def cache_dir() -> Path:
    """``$SNNFW_CACHE_DIR/memopt``, by default ``~/.cache/snnfw/memopt``."""
    return Path(os.environ.get("SNNFW_CACHE_DIR", Path.home() / ".cache" / "snnfw")) / "memopt"


def cache_key(model: nn.Module, example: torch.Tensor, memopt, blocks: list[str]) -> str:
    """The name of the cache entry for ``blocks`` of ``model`` given ``example`` and the ``[memopt]`` options."""
    from importlib.metadata import version

    import torch

    text = json.dumps([
        repr(model), list(example.shape), str(example.dtype), example.device.type, memopt.level, memopt.budget,
        memopt.compress, list(blocks), torch.__version__, version("spikingjelly"),
    ])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def wrappers(model: nn.Module) -> list[dict]:
    """The checkpoint wrappers in ``model``, outermost first, with their options."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    out = []
    for path, module in model.named_modules():
        if isinstance(module, CheckpointWrapper):
            options = module.checkpoint_fn.keywords
            compressor = options["compressor"]
            out.append({
                "path": path,
                "compressor": type(compressor).__name__ if compressor is not None else None,
                "chunks": options["chunks"],
                "chunked_args": list(options["chunked_args"]),
                "time_dim": options["time_dim"],
            })
    return out


def reapply(model: nn.Module, chosen: list[dict]) -> None:
    """Wraps the modules a search chose, as it wrapped them."""
    from spikingjelly.activation_based import memopt

    for entry in chosen:
        module = model.get_submodule(entry["path"])
        compressor = getattr(memopt, entry["compressor"])() if entry["compressor"] else None
        wrapped = memopt.checkpoint_module(
            module, compressor=compressor, chunks=entry["chunks"],
            chunked_args=tuple(entry["chunked_args"]), time_dim=entry["time_dim"],
        )
        model.set_submodule(entry["path"], wrapped)


def load(path: Path) -> list[dict] | None:
    """The wrappers a cache entry holds, or None."""
    try:
        return json.loads(path.read_text())["wrappers"]
    except (OSError, ValueError, KeyError):
        return None


def save(path: Path, chosen: list[dict]) -> None:
    """Writes a cache entry whole (through a temporary file), so readers never see a partial one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps({"wrappers": chosen}, indent=1) + "\n")
    os.replace(partial, path)
