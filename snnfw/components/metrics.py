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
from snnfw.plugin.context import ShardedNeuron

NEURON_SHARD = "snnfw_shard"  # set by tensor-parallel strategies on a neuron module whose state they shard

class SpikeCounter:
    """Counts the spikes and output elements of every neuron module through forward hooks.

    A module's spikes add up on its device (one sum per forward, no host
    sync), and neither graph breaks nor recompiles where a neuron runs inside
    a compiled block; output elements are counted on the host. ``take()``
    gives a step's total as one device tensor; ``by_layer()`` the counts of
    every step so far per neuron module, for per-layer firing rates.
    """

    def __init__(self, model: nn.Module, neuron_names: tuple[str, ...]):
        self._modules = dict(model.named_modules())
        self.names = neuron_names
        self.clear()
        self._run_spikes: dict[tuple[str, ...], torch.Tensor] = {}  # the modules that ran -> their spikes so far
        self._run_elements = dict.fromkeys(neuron_names, 0)
        self._weights = dict.fromkeys(neuron_names, 1.0)
        self._handles = [self._modules[name].register_forward_hook(partial(self._count, name)) for name in neuron_names]

    def weigh_replicated(self, copies: int) -> None:
        """Counts a neuron module that ``copies`` ranks run whole (not sharded by the strategy, which marks sharded
        ones with ``snnfw_shard``; tensor parallelism's row blocks) ``1 / copies`` in the totals, so the firing
        rate over all modules weighs each as ``none`` does."""
        for name in self.names:
            self._weights[name] = 1.0 if isinstance(self._modules[name], ShardedNeuron) else 1.0 / copies

    def _count(self, name: str, module, inputs, output) -> None:
        with torch.no_grad():
            spikes = output.sum(dtype=torch.float32 if output.dtype in (torch.float16, torch.bfloat16) else None)
        counted = self._spikes.get(name)
        self._spikes[name] = spikes if counted is None else counted + spikes
        self._elements[name] += output.numel()

    def take(self, record: bool = True) -> tuple[torch.Tensor | float, float]:
        """Returns and clears the spikes (a float64 tensor on the device, 0.0 if no neuron ran) and output elements
        since the last call, all neuron modules together, adding them to :meth:`by_layer` when ``record``
        (training steps, not evaluation). Reads nothing from the device."""
        ran = tuple(self._spikes)
        spikes, total = (torch.stack([self._spikes[name] for name in ran]) if ran else None), 0.0
        if spikes is not None:
            weights = [self._weights[name] for name in ran]
            total = (spikes.sum(dtype=torch.float64) if all(w == 1.0 for w in weights)
                     else spikes.double() @ torch.tensor(weights, dtype=torch.float64, device=spikes.device))
        elements = sum(self._weights[name] * self._elements[name] for name in self.names)
        if record and spikes is not None:
            so_far = self._run_spikes.get(ran)
            self._run_spikes[ran] = spikes if so_far is None else so_far + spikes
            for name in self.names:
                self._run_elements[name] += self._elements[name]
        self.clear()
        return total, elements

    def clear(self) -> None:
        """Forgets the counts since the last ``take()`` (forward passes that were not training steps)."""
        self._spikes: dict[str, torch.Tensor] = {}
        self._elements = dict.fromkeys(self.names, 0)

    def by_layer(self) -> dict[str, tuple[float, int]]:
        """``{neuron module: (spikes, output elements)}`` over every ``take()`` so far, on this rank (one read)."""
        spikes = dict.fromkeys(self.names, 0.0)
        for ran, counts in self._run_spikes.items():
            for name, count in zip(ran, counts.tolist()):
                spikes[name] += count
        return {name: (spikes[name], self._run_elements[name]) for name in self.names}


def peak_memory_mb(device: torch.device) -> float:
    """The CUDA allocator's peak on GPU since the trainer was set up; on CPU the process's peak resident set size.

    On Linux the peak of the process's own memory (``VmHWM``): ``ru_maxrss`` starts at the peak of the process
    that started it (the launcher's, with ``snnfw bench``'s cost-model profile in it)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        _, found, rest = Path("/proc/self/status").read_text().partition("VmHWM:")
    except OSError:
        found = ""
    return int(rest.split()[0]) / 1024 if found else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB




def progress_line(record: dict[str, Any], total_steps: int, samples_per_s: float) -> str:
    """Rank 0's line for a step, short enough for a terminal, with the throughput ``samples_per_s``;
    ``metrics.jsonl`` holds every figure. A language model's (``tokens_per_s`` recorded) shows tokens a second,
    and its validation's loss, perplexity and bits per byte instead of accuracy."""
    line = (f"[snnfw] step {record['step']}/{total_steps} epoch {record['epoch']:.2f} loss {record['loss']:.4f} "
            f"acc {record['train_acc']:.1%} spikes {record['spike_rate']:.1%} {record['step_ms']:.0f} ms ")
    if "tokens_per_s" in record:
        line += f"{samples_per_s * record['tokens_per_s'] / record['samples_per_s']:.0f} tokens/s"
    else:
        line += f"{samples_per_s:.0f} samples/s"
    if "eval_ppl" in record:
        bpb = f" bpb {record['eval_bpb']:.3f}" if "eval_bpb" in record else ""
        return line + f" | eval loss {record['eval_loss']:.4f} ppl {record['eval_ppl']:.2f}{bpb}"
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
        self._shown = 0  # the records before the last progress line's
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
            print(progress_line(record, self.total_steps, self._samples_per_s()) + self._eta(record["step"]), flush=True)
            self._shown = len(self.records)

    def _samples_per_s(self) -> float:
        """The samples a second of the steps since the last progress line: on a GPU a step's own time is the host's,
        and the step that logs also waits for the kernels the ones before queued."""
        since = self.records[self._shown:]
        seconds = sum(r["step_ms"] for r in since) / 1e3
        return sum(r["samples_per_s"] * r["step_ms"] / 1e3 for r in since) / seconds if seconds > 0 else 0.0

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
