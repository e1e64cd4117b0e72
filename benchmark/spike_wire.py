"""Spikes sent as bits against unpacked: bytes sent a step and step time under ``pp`` and ``tp`` on 2 CPU ranks.

``python benchmark/spike_wire.py [--rounds 3]``: the VGG ``full`` (T = 4, 8 samples a step; ``pp`` with 4
microbatches) trained by ``snnfw bench`` with ``parallel.pack_spikes`` true and false, the two runs of each
strategy alternating, ``--rounds`` times. Prints one JSON line per strategy: the median step ms and the bytes
sent a step per rank (``pp_sent_mb``: activations forward and gradients back; ``tp_comm_mb``: the channel
all-gathers and the all-reduces) of each setting, and their ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

CONFIG = "examples/quickstart.toml"
SHAPE = ["model.flavor=full", "model.time_steps=4", "data.batch_size=8", "data.train_samples=64",
         "data.test_samples=4", "parallel.device=cpu"]
STRATEGIES = {"pp": (["parallel.strategy=pp", "pipeline.schedule=1f1b", "train.microbatches=4"], "pp_sent_mb"),
              "tp": (["parallel.strategy=tp"], "tp_comm_mb")}


def bench(sets: list[str], label: str, results: Path, warmup: int, steps: int) -> dict:
    command = [sys.executable, "-m", "snnfw", "bench", CONFIG, "--nproc", "2", "--warmup", str(warmup), "--steps",
               str(steps), "--results", str(results), "--label", label, *[a for s in sets for a in ("--set", s)]]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return json.loads(results.read_text().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--results", type=Path, default=Path("benchmark/results/spike_wire.jsonl"))
    args = parser.parse_args(argv)
    args.results.parent.mkdir(parents=True, exist_ok=True)
    for strategy, (sets, sent) in STRATEGIES.items():
        runs = {True: [], False: []}
        for round_ in range(args.rounds):
            for pack in ((True, False) if round_ % 2 else (False, True)):
                label = f"{strategy} pack_spikes={str(pack).lower()}"
                runs[pack].append(bench([*SHAPE, *sets, f"parallel.pack_spikes={str(pack).lower()}"], label,
                                        args.results, args.warmup, args.steps))
        row = {"strategy": strategy, "rounds": args.rounds}
        for pack, name in ((False, "unpacked"), (True, "bits")):
            row[f"{name}_step_ms"] = statistics.median(r["step_ms"] for r in runs[pack])
            row[f"{name}_{sent}"] = statistics.median(r[sent] for r in runs[pack])
        row["step_ratio"] = row["bits_step_ms"] / row["unpacked_step_ms"]
        row["sent_ratio"] = row[f"bits_{sent}"] / row[f"unpacked_{sent}"]
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
