"""The README's dry-run table: Spikformer-ti (224 px, T = 8, AdamW, fp32) at cluster sizes, each case timed.

    python benchmark/dry_runs.py [--only fsdp2] [--memory 80GB]
    python benchmark/dry_runs.py --time   # T = 16, one sample: none beside tsp, tp and fsdp2 at 2, 4 and 8 ranks

Each case dry-runs ranks 0 and N-1 (``snnfw plan --dry-run``) with one sample per data replica (the pipeline:
4 microbatches of 1 per replica) and prints one markdown row per case: rank 0's bytes (the last stage's after a
semicolon under pp), the largest microbatch that fits ``--memory``, and the seconds the dry run took here.
"""

from __future__ import annotations

import argparse
import time

from snnfw.config import build_config
from snnfw.plugin.manager import Plugins
from snnfw.tools.dry_run import dry_run, largest_microbatch, parse_bytes, size_text

CASES = [  # (strategy, world size, mesh, pipeline settings)
    ("none", 1, None, None),
    *(("dp", n, None, None) for n in (8, 64, 512)),
    *(("zero", n, None, None) for n in (8, 64, 512)),
    *(("fsdp2", n, None, None) for n in (8, 64, 512, 1024)),
    ("tp", 8, {"tp": 8}, None),
    ("fsdp2_tp", 64, {"dp": 8, "tp": 8}, None),
    ("fsdp2_tp", 512, {"dp": 64, "tp": 8}, None),
    *(("pp", n, {"dp": n // 4, "pp": 4}, {"schedule": "1f1b"}) for n in (8, 64)),
]
TIME_CASES = [  # --time: one sample at T = 16 (fsdp2: one per rank), split in time, in channels, or not at all
    ("none", 1, None, None),
    *(("tsp", n, {"time": n}, None) for n in (2, 4, 8)),
    *(("tp", n, {"tp": n}, None) for n in (2, 4, 8)),
    *(("fsdp2", n, None, None) for n in (2, 4, 8)),
]


def config(strategy: str, world: int, mesh: dict | None, pipeline: dict | None, time_steps: int = 8):
    mesh_sizes = mesh or {}
    replicas = world // mesh_sizes.get("tp", 1) // mesh_sizes.get("pp", 1) // mesh_sizes.get("time", 1)
    batch = 4 if strategy == "none" and time_steps == 8 else replicas * (4 if pipeline else 1)
    return build_config({
        "model": {"family": "spikformer", "flavor": "ti", "time_steps": time_steps},
        "data": {"name": "synthetic_dvs", "batch_size": batch, "train_samples": batch},
        "train": {"steps": 1, "optimizer": "adamw", **({"microbatches": 4} if pipeline else {})},
        "parallel": {"strategy": strategy, "device": "cpu", **({"mesh": mesh} if mesh else {})},
        **({"pipeline": pipeline} if pipeline else {}),
    })


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="run the cases of this strategy only")
    parser.add_argument("--memory", default="80GB", help="device memory for the largest microbatch (80GB)")
    parser.add_argument("--time", action="store_true", help="the time-split cases: T = 16, one sample")
    args = parser.parse_args()
    memory = parse_bytes(args.memory)
    print("| strategy | ranks (mesh) | parameters | gradients | optimizer | neurons | saved for backward | total "
          f"| collectives per step | largest microbatch in {args.memory} | dry run (s) |")
    print("| --- " * 11 + "|")
    for strategy, world, mesh, pipeline in TIME_CASES if args.time else CASES:
        if args.only and strategy != args.only:
            continue
        started = time.perf_counter()
        plan, footprints = dry_run(config(strategy, world, mesh, pipeline, 16 if args.time else 8), world, Plugins())
        seconds = time.perf_counter() - started
        shown = footprints if pipeline else footprints[:1]
        cells = [
            "; ".join(size_text(getattr(f, key)) for _, f in shown)
            for key in ("parameters", "gradients", "optimizer", "neurons", "activations", "total", "communication")
        ]
        largest = "; ".join(str(largest_microbatch(f, plan.microbatch_size, memory)) for _, f in shown)
        where = " x ".join(f"{d}={n}" for d, n in plan.mesh)
        print(f"| {strategy} | {world} ({where}) | " + " | ".join(cells) + f" | {largest} | {seconds:.0f} |", flush=True)


if __name__ == "__main__":
    main()
