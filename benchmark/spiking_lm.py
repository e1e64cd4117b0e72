"""Tokens a second of the spiking language model: snnfw beside a plain PyTorch loop on this CPU, and the layouts of
SpikingJelly's published 1.41B SpikeLM table on GPUs.

    python benchmark/spiking_lm.py [--steps 3] [--warmup 1] [--results benchmark/results/spiking_lm.jsonl]
    python benchmark/spiking_lm.py --gpu [--steps 5] [--warmup 2]

CPU (the default): ``examples/recipes/spiking_lm.toml`` (``small``, T = 4, S = 64, a global batch of 32) timed by
``snnfw bench`` under ``none`` on one rank and ``dp`` on two, and the plain loop of the same model and data
(:mod:`snnfw.tools.baseline`: one process, DDP on two), validation off. Each run appends a ``snnfw bench`` record
(median step of the timed steps) to ``--results``, with ``tokens_per_s``: the global batch's positions a second.

``--gpu``: the ``1.4b`` flavor (S = 128, T = 4, bf16) in the layouts of the published table (4 RTX 4090s:
pp 4 at global batches 8 and 16, dp 2, cp 4) and the one snnfw adds there (time x pp), each on as many GPUs as its
layout takes; it runs only where CUDA is, and otherwise prints what it would run and exits 0. A layout whose mesh
dimension this snnfw does not know (``cp`` before it lands) or that needs more GPUs than there are is skipped with
its reason.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

RECIPE = "examples/recipes/spiking_lm.toml"
RESULTS = Path("benchmark/results/spiking_lm.jsonl")
NO_VALIDATION = ["eval.every=0", "log.phase_times=false", "train.warmup_steps=0"]  # the recipe's 20 exceed a few steps

# (label, ranks, overrides, plain loop): the CPU runs at the recipe's small shape
CPU_RUNS = [
    ("snnfw none", 1, ['parallel.strategy="none"'], False),
    ("plain loop", 1, ['parallel.strategy="none"'], True),
    ("snnfw dp", 2, ['parallel.strategy="dp"'], False),
    ("plain DDP", 2, ['parallel.strategy="dp"'], True),
]

# SpikingJelly's published table: 1.41B SpikeLM, S = 128, T = 4, bf16, 4 RTX 4090s (tokens/s)
PUBLISHED = {"pp 4, global batch 8": 1379.9, "pp 4, global batch 16": 2997.0, "dp 2": 746.3, "cp 4": 289.5}
GPU_SHAPE = ['model.flavor="1.4b"', "model.sequence_length=128", "model.time_steps=4", 'train.precision="bf16"',
             'parallel.strategy="mesh"']
# (label, mesh, global batch, microbatches)
GPU_RUNS = [
    ("pp 4, global batch 8", "{pp = 4}", 8, 4),
    ("pp 4, global batch 16", "{pp = 4}", 16, 4),
    ("dp 2", "{dp_replicate = 2}", 8, 1),
    ("cp 4", "{cp = 4}", 8, 1),
    ("time 2 x pp 2", "{time = 2, pp = 2}", 16, 4),
]


def tokens_per_s(record: dict) -> float:
    """The global batch's positions a second of a bench record's median step."""
    return record["global_batch"] * record["config"]["model"]["sequence_length"] / record["step_ms"] * 1e3


def run_cpu(args) -> int:
    from snnfw.tools.bench import bench

    rows = []
    for label, ranks, overrides, plain in CPU_RUNS:
        status = bench(RECIPE, ranks, [*NO_VALIDATION, *overrides, *args.overrides], args.warmup, args.steps,
                       args.results, "throughput", f"spiking_lm {label}", baseline=plain)
        if status:
            return status
        rows.append((label, ranks, _last_record(args.results)))
    print(f"\nspiking_lm small (T = 4, S = 64, global batch 32), {args.steps} timed step(s) after {args.warmup}:")
    for label, ranks, record in rows:
        print(f"  {label:<11} x{ranks}: {record['step_ms']:8.1f} ms/step {record['tokens_per_s']:8.0f} tokens/s "
              f"loss {record['final_loss']:.4f}")
    return 0


def _last_record(results: Path) -> dict:
    """The record just appended to ``results``, its ``tokens_per_s`` added (written back)."""
    lines = results.read_text().splitlines()
    record = json.loads(lines[-1])
    record["tokens_per_s"] = tokens_per_s(record)
    results.write_text("\n".join([*lines[:-1], json.dumps(record)]) + "\n")
    return record


def gpu_overrides(mesh: str, batch: int, microbatches: int) -> list[str]:
    return [*GPU_SHAPE, f"parallel.mesh={mesh}", f"data.batch_size={batch}", f"train.microbatches={microbatches}"]


def run_gpu(args) -> int:
    import torch

    if not torch.cuda.is_available():
        print("--gpu: no CUDA device here; on a machine with 4 GPUs it would run (python -m snnfw bench, then the "
              "tokens a second and peak GiB a GPU of each):")
        for label, mesh, batch, microbatches in GPU_RUNS:
            ranks = _ranks(mesh)
            overrides = [*NO_VALIDATION, *gpu_overrides(mesh, batch, microbatches)]
            sets = " ".join(f"--set {shlex.quote(override)}" for override in overrides)
            published = f" (published: {PUBLISHED[label]} tokens/s)" if label in PUBLISHED else ""
            print(f"  {label}{published}:\n    python -m snnfw bench {RECIPE} --nproc {ranks} --warmup {args.warmup} "
                  f"--steps {args.steps} --label 'spiking_lm 1.4b {label}' {sets}")
        print("note: nothing was run; rerun with --gpu where torch.cuda.is_available()")
        return 0
    from snnfw.errors import UserError
    from snnfw.tools.bench import bench

    gpus = torch.cuda.device_count()
    for label, mesh, batch, microbatches in GPU_RUNS:
        ranks = _ranks(mesh)
        if ranks > gpus:
            print(f"{label}: skipped, its mesh {mesh} takes {ranks} GPUs and this machine has {gpus}")
            continue
        try:
            status = bench(RECIPE, ranks, [*NO_VALIDATION, *gpu_overrides(mesh, batch, microbatches), *args.overrides],
                           args.warmup, args.steps, args.results, "throughput", f"spiking_lm 1.4b {label}")
        except UserError as err:  # a dimension this snnfw does not know yet, a layout the model cannot take
            print(f"{label}: skipped: {err}")
            continue
        if status:
            print(f"{label}: failed with status {status}")
            continue
        record = _last_record(args.results)
        published = f", published {PUBLISHED[label]}" if label in PUBLISHED else ""
        print(f"{label}: {record['tokens_per_s']:.1f} tokens/s{published}; peak "
              f"{record['peak_mem_mb'] / 1024:.2f} GiB a GPU")
    return 0


def _ranks(mesh: str) -> int:
    ranks = 1
    for part in mesh.strip("{}").split(","):
        ranks *= int(part.split("=")[1])
    return ranks


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmark/spiking_lm.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", action="store_true", help="the 1.4b layouts of the published table (CUDA only)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps a run (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="steps before the timed ones (default 1)")
    parser.add_argument("--results", type=Path, default=RESULTS, help=f"where the records go (default {RESULTS})")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    from snnfw.errors import UserError, explain

    try:
        return run_gpu(args) if args.gpu else run_cpu(args)
    except UserError as err:
        print(f"spiking_lm benchmark: error: {explain(err)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
