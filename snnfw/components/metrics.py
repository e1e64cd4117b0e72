"""Per-step metrics: spike counting, peak memory, the JSONL log and rank 0's progress line."""

from __future__ import annotations

import json
import math
import resource
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from snnfw import rundir

NEURON_SHARD = "snnfw_shard"  # set by tensor-parallel strategies on a neuron module whose state they shard

class SpikeCounter:
    """Counts the spikes and output elements of every neuron module through forward hooks.

    Counts add up as tensors per neuron module, read once per ``take()``: no
    host sync per neuron, and neither graph breaks nor recompiles where a
    neuron runs inside a compiled block. ``by_layer()`` gives the counts of
    every ``take()`` so far per neuron module, for per-layer firing rates.
    """

    def __init__(self, model: nn.Module, neuron_names: tuple[str, ...]):
        self._modules = dict(model.named_modules())
        self.names = neuron_names
        self.clear()
        self._run = {name: [0.0, 0] for name in neuron_names}
        self._weights = dict.fromkeys(neuron_names, 1.0)
        self._handles = [self._modules[name].register_forward_hook(partial(self._count, name)) for name in neuron_names]

    def weigh_replicated(self, copies: int) -> None:
        """Counts a neuron module that ``copies`` ranks run whole (not sharded by the strategy, which marks sharded
        ones with ``snnfw_shard``; tensor parallelism's row blocks) ``1 / copies`` in the totals, so the firing
        rate over all modules weighs each as ``none`` does."""
        for name in self.names:
            self._weights[name] = 1.0 if hasattr(self._modules[name], NEURON_SHARD) else 1.0 / copies

    def _count(self, name: str, module, inputs, output) -> None:
        spikes, elements = self._counts[name]
        self._counts[name] = (spikes + output.detach().sum(), elements + output.numel())

    def take(self, record: bool = True) -> tuple[float, float]:
        """Returns and clears the counts since the last call (all neuron modules together),
        adding them to :meth:`by_layer` when ``record`` (training steps, not evaluation).

        One host transfer per step (per device and dtype, one in a run): the counts
        of the neuron modules that ran are stacked where they are and read with one
        ``tolist()``; those that did not run still hold ``clear()``'s CPU zeros,
        read as 0 without touching a tensor, so no per-module cross-device op.
        """
        ran = [name for name, counts in self._counts.items() if counts is not self._cleared[name]]
        spikes = dict(zip(ran, _read([self._counts[name][0] for name in ran])))
        elements = dict(zip(ran, _read([self._counts[name][1] for name in ran])))
        total_spikes, total_elements = 0.0, 0
        for name in self._counts:
            layer_spikes, layer_elements = float(spikes.get(name, 0.0)), int(elements.get(name, 0))
            if record:
                self._run[name][0] += layer_spikes
                self._run[name][1] += layer_elements
            weight = self._weights[name]
            total_spikes, total_elements = total_spikes + weight * layer_spikes, total_elements + weight * layer_elements
        self.clear()
        return total_spikes, total_elements

    def clear(self) -> None:
        """Forgets the counts since the last ``take()`` (forward passes that were not training steps)."""
        self._counts = {name: (torch.zeros(()), torch.zeros((), dtype=torch.int64)) for name in self.names}
        self._cleared = dict(self._counts)  # a module's entry is replaced when its hook runs

    def by_layer(self) -> dict[str, tuple[float, int]]:
        """``{neuron module: (spikes, output elements)}`` over every ``take()`` so far, on this rank."""
        return {name: (spikes, elements) for name, (spikes, elements) in self._run.items()}


def _read(values: list[torch.Tensor]) -> list:
    """The Python numbers of 0-dim tensors, in order: one stack and one ``tolist()`` per device and dtype."""
    groups: dict[tuple, list[int]] = {}
    for i, value in enumerate(values):
        groups.setdefault((value.device, value.dtype), []).append(i)
    out: list = [None] * len(values)
    for indices in groups.values():
        for i, number in zip(indices, torch.stack([values[i] for i in indices]).tolist()):
            out[i] = number
    return out


def peak_memory_mb(device: torch.device) -> float:
    """The CUDA allocator's peak on GPU since the trainer was set up; on CPU the process's peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024




def progress_line(record: dict[str, Any], total_steps: int) -> str:
    """Rank 0's line for a step, short enough for a terminal; ``metrics.jsonl`` holds every figure."""
    line = (f"[snnfw] step {record['step']}/{total_steps} epoch {record['epoch']:.2f} loss {record['loss']:.4f} "
            f"acc {record['train_acc']:.1%} spikes {record['spike_rate']:.1%} {record['step_ms']:.0f} ms")
    return line + (f" | eval {record['eval_acc']:.1%}" if "eval_acc" in record else "")


def board_tag(key: str) -> str:
    """The TensorBoard tag of a metrics key: ``eval_acc`` -> ``eval/acc``, ``loss`` -> ``train/loss``."""
    return f"eval/{key[5:]}" if key.startswith("eval_") else f"train/{key}"


class MetricsLog:
    """Appends one JSON object per step to ``run_dir/metrics.jsonl`` (rank 0 only).

    A run resumed after step ``start`` keeps the file's records up to that step; every rank reads them
    (``earlier``), for the summary of the whole run.
    """

    def __init__(self, run_dir: Path | None, enabled: bool, total_steps: int, start: int = 0, tensorboard: bool = False,
                 wandb: tuple[str, str, dict] | None = None):
        """``wandb``: (mode, project, the run's config) to log every record to Weights & Biases as well."""
        self.enabled = enabled and run_dir is not None
        self.total_steps = total_steps
        self.records: list[dict[str, Any]] = []
        path = run_dir / rundir.METRICS if run_dir is not None else None
        earlier = rundir.read_metrics(path, note=self.enabled) if start and path is not None and path.exists() else []
        self.earlier = [record for record in earlier if record["step"] <= start]
        self._file = self._board = self._wandb = None
        if self.enabled and wandb:
            self._wandb = open_wandb(run_dir, *wandb)
        if self.enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._board = SummaryWriter(str(run_dir / rundir.TENSORBOARD), purge_step=start + 1 if start else None)
        if self.enabled:
            run_dir.mkdir(parents=True, exist_ok=True)
            rundir.write_text(path, "".join(json.dumps(record) + "\n" for record in self.earlier))
            self._file = open(path, "a")

    def write(self, record: dict[str, Any], show: bool) -> None:
        self.records.append(record)
        if self._file:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        scalars = {board_tag(k): v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
        if self._board:
            for tag, value in scalars.items():
                self._board.add_scalar(tag, value, record["step"])
        if self._wandb:
            self._wandb.log(scalars, step=record["step"])
        if show:
            print(progress_line(record, self.total_steps) + self._eta(record["step"]), flush=True)

    def _eta(self, step: int) -> str:
        """`` | eta 1m05s`` from the median of this run's recent step times; empty on the last step."""
        left = self.total_steps - step
        if left <= 0:
            return ""
        recent = sorted(r["step_ms"] for r in self.records[-20:])
        seconds = math.ceil(left * recent[len(recent) // 2] / 1e3)
        return f" | eta {seconds // 60}m{seconds % 60:02d}s"

    def close(self) -> None:
        """Closes the file and loggers (again: nothing)."""
        if self._file:
            self._file.close()
        if self._board:
            self._board.close()
        if self._wandb:
            self._wandb.finish()
        self._file = self._board = self._wandb = None


def open_wandb(run_dir: Path, mode: str, project: str, config: dict):
    """A Weights & Biases run in ``run_dir/wandb``, one per run directory, so that a resumed run continues it."""
    import hashlib

    import wandb

    run_id = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]
    return wandb.init(project=project, dir=str(run_dir), name=Path(run_dir).name, id=run_id, resume="allow",
                      mode=mode, config=config)
