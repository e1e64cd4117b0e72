"""The ATen ops and host synchronisations of one training step, snnfw's beside the plain loop's.

    python benchmark/launches.py CONFIG [--set KEY=VALUE ...] [--nproc N]

Small spiking networks on a GPU are bound by kernel launches and host work, so
each op a step dispatches and each time it waits for the device shows there;
on a CPU the same cost hides in the noise, and these counts are its measure.
An op is any op the dispatcher runs (ATen's, collectives), but for the
profiler's range markers. Both sides train the config's model on the same data in one process per rank:
snnfw under the config's strategy (the Python API), the plain loop
(:mod:`snnfw.tools.baseline`) in DDP on several ranks or, under ``pp``, torch's
pipeline schedule. After two untimed steps, a step that does not log and one
that logs (``train.log_every = 2``) are counted on each side, on rank 0; the
loading of batches, the host's work before they reach the device, is left
out on both.

A host synchronisation is what waits for a CUDA device: an op that reads a
tensor's value on the host (``aten._local_scalar_dense``, which ``.item()``,
``float()``, ``int()`` and ``bool()`` of a tensor reach), an op whose output
shape depends on values (``nonzero``, ``masked_select``, ``unique``, ...) or
that compares on the host (``equal``), and the calls that copy to the host
outside the dispatcher (``.tolist()``, ``.cpu()``, ``.numpy()``,
``torch.cuda.synchronize``). They are counted on any device, CPU tensors
included; a ``.to("cpu")`` of a device tensor is counted only where the run's
device is not the CPU (on the CPU it cannot be told from loading a batch).

Strategies of several ranks are launched on ``--nproc`` ranks (2 unless said)
through ``torch.distributed.run`` when the script is not started by it.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import subprocess
import sys
from typing import Callable, Iterator

import attrs
import torch
from torch.utils._python_dispatch import TorchDispatchMode

# ops that wait for the device to read a value or to learn an output's size
SYNCING_OPS = frozenset({
    "_local_scalar_dense", "equal", "nonzero", "nonzero_static", "masked_select", "unique", "_unique", "_unique2",
    "unique_consecutive", "unique_dim", "repeat_interleave", "argwhere",
})
HOST_COPIES = ("tolist", "cpu", "numpy")  # Tensor methods that copy to the host outside the dispatcher


@attrs.define
class Counts:
    """What a stretch of code dispatched: ops and host synchronisations, each by name."""

    ops: collections.Counter = attrs.field(factory=collections.Counter)
    syncs: collections.Counter = attrs.field(factory=collections.Counter)

    @property
    def total_ops(self) -> int:
        return sum(self.ops.values())

    @property
    def total_syncs(self) -> int:
        return sum(self.syncs.values())


class _Dispatched(TorchDispatchMode):
    def __init__(self, counts: Counts):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        space, name = func._schema.name.split("::")
        if space != "profiler":  # record_function's range markers (FSDP2 sets them) launch nothing
            self.counts.ops[name] += 1
        if name in SYNCING_OPS:
            self.counts.syncs[name] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counted(device: torch.device | None = None) -> Iterator[Counts]:
    """Counts the ops and host synchronisations of the code inside, on this thread (``device``: the run's)."""
    counts = Counts()
    originals = {name: getattr(torch.Tensor, name) for name in (*HOST_COPIES, "to")}
    synchronize = torch.cuda.synchronize

    def host_copy(name: str) -> Callable:
        def method(tensor, *args, **kwargs):
            if not _PAUSED[0]:
                counts.syncs[name] += 1
            return originals[name](tensor, *args, **kwargs)
        return method

    def to(tensor, *args, **kwargs):
        target = kwargs.get("device", args[0] if args else None)
        if not _PAUSED[0] and device is not None and device.type != "cpu" and tensor.device.type != "cpu" and _is_cpu(target):
            counts.syncs["to_cpu"] += 1
        return originals["to"](tensor, *args, **kwargs)

    def synchronized(*args, **kwargs):
        counts.syncs["cuda_synchronize"] += 1
        return synchronize(*args, **kwargs)

    for name in HOST_COPIES:
        setattr(torch.Tensor, name, host_copy(name))
    torch.Tensor.to, torch.cuda.synchronize = to, synchronized
    try:
        with _Dispatched(counts):
            yield counts
    finally:
        for name, method in originals.items():
            setattr(torch.Tensor, name, method)
        torch.cuda.synchronize = synchronize


@contextlib.contextmanager
def loading_left_out() -> Iterator[None]:
    """Leaves the loading of batches (the host's work before they reach the device) out of the counts of the code
    inside, snnfw's and the plain loop's alike."""
    from torch.utils._python_dispatch import _disable_current_modes

    from snnfw.data import batches as data

    step_batches = data.step_batches

    def batches(*args, **kwargs):
        loader = step_batches(*args, **kwargs)
        while True:
            _PAUSED[0] = True
            try:
                with _disable_current_modes():
                    batch = next(loader)
            except StopIteration:
                return
            finally:
                _PAUSED[0] = False
            yield batch

    data.step_batches = batches
    try:
        yield
    finally:
        data.step_batches = step_batches


_PAUSED = [False]


def _is_cpu(target) -> bool:
    return (isinstance(target, str) and target.startswith("cpu")) or (isinstance(target, torch.device) and target.type == "cpu")


WARMUP = 2  # untimed steps first: the first builds optimizer state and compiled code


def count_steps(config) -> dict:
    """This rank's counts of a step that does not log and one that logs, snnfw's and the plain loop's."""
    import snnfw
    from snnfw.tools.baseline import PlainLoop, PlainPipeline

    with loading_left_out(), snnfw.start(config) as run:
        if run.plan.stage_dims:
            plain = PlainPipeline(run.config, run.plan, run.device, run.model.split)
        else:
            plain = PlainLoop(run.config, run.device, run.env.rank, run.env.world_size)
        for step in range(WARMUP):
            run.step(step)
            plain.step(step)
        result = {"strategy": run.plan.name, "ranks": run.env.world_size,
                  "family": f"{config.model.family} {config.model.flavor}"}
        sides = {"snnfw": run.step, "plain": plain.step}
        for step, kind in ((WARMUP, "not_logging"), (WARMUP + 1, "logging")):
            for side, step_fn in sides.items():
                with counted(run.device) as counts:
                    step_fn(step)
                result.setdefault(f"{side}_ops", {})[kind] = counts.total_ops
                result.setdefault(f"{side}_syncs", {})[kind] = counts.total_syncs
                result.setdefault(f"{side}_sync_sources", {})[kind] = dict(counts.syncs)
                result.setdefault(f"{side}_by_op", {})[kind] = counts.ops
        result["ops_ratio"] = {kind: result["snnfw_ops"][kind] / max(result["plain_ops"][kind], 1)
                               for kind in result["plain_ops"]}
        result["extra_ops"] = {  # what snnfw dispatches beyond the plain loop, most first
            kind: dict((result["snnfw_by_op"][kind] - result["plain_by_op"][kind]).most_common(25))
            for kind in result["plain_ops"]}
        for side in sides:
            del result[f"{side}_by_op"]
        return result


def main(argv: list[str] | None = None) -> int:
    from snnfw.config import load_config

    parser = argparse.ArgumentParser(prog="benchmark/launches.py", description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default="examples/quickstart.toml")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--nproc", type=int, default=None, help="ranks (1 for strategy none, else 2)")
    args = parser.parse_args(argv)
    config = load_config(args.config, [*args.overrides, f"train.steps={WARMUP + 4}", "train.log_every=2"])
    nproc = args.nproc or (1 if config.parallel.strategy == "none" else 2)
    if nproc > 1 and "WORLD_SIZE" not in os.environ:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        forwarded = [args.config, *(arg for override in args.overrides for arg in ("--set", override))]  # not --nproc,
        # which torchrun's parser would take for an abbreviation of its own --nproc-per-node
        return subprocess.run([*launcher, "-m", "snnfw.tools.launches", *forwarded]).returncode
    result = count_steps(config)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({"overrides": args.overrides, **result}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
