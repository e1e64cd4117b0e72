"""What each rank holds before its first step: the model built only as its shard, against whole.

``python benchmark/shard_build.py [--flavor full] [--nproc 4] [--strategy fsdp2 | --mesh tp=2,time=2]``: the VGG
(T = 2, one sample a rank, one step, fp32) under ``fsdp2`` (or ``pp``, a mesh, ...) on CPU ranks, each rank's CPU allocations tracked by torch's MemTracker from
before the model is built to its first step, twice: as snnfw builds it (every rank on the meta device,
replaying its own tensors) and with every rank building the whole model (as before).
Prints one JSON line per setting: each rank's tracked peak as a ratio of the model's bytes, the bytes it
holds once built (its shard) as a ratio of the model's, its peak resident memory (MB, the process's whole
footprint: torch's libraries included), and whether the initial parameters of the two settings are the same.
"""

from __future__ import annotations

import argparse
import json

import torch

from snnfw.config import build_config
from snnfw.plan.prepare import build_model
from snnfw.plugin.manager import Plugins
from snnfw.testing import run_on_ranks
from snnfw.testing.build_memory import seen, track_until_first_step, track_whole_build


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="full")
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--strategy", default="fsdp2")
    parser.add_argument("--mesh", help="a composed mesh instead of --strategy, as dim=size,...: tp=2,time=2")
    args = parser.parse_args(argv)
    mesh = {name: int(size) for name, size in (part.split("=") for part in args.mesh.split(","))} if args.mesh else None
    strategy = "mesh" if mesh else args.strategy
    config = build_config({
        "model": {"family": "cifar10dvs_vgg", "flavor": args.flavor, "time_steps": 2},
        "data": {"name": "synthetic_dvs", "batch_size": args.nproc, "train_samples": args.nproc, "test_samples": args.nproc},
        "train": {"steps": 1},
        "parallel": {"strategy": strategy, "device": "cpu", **({"mesh": mesh} if mesh else {})},
    })
    model, _ = build_model(config, Plugins())
    tensors = list(model.state_dict().values())
    whole = sum(t.numel() * t.element_size() for t in tensors)
    largest = max(t.numel() * t.element_size() for t in tensors)
    print(json.dumps({"flavor": args.flavor, "ranks": args.nproc, "model_mb": round(whole / 2**20, 2),
                      "largest_tensor_ratio": round(largest / whole, 4)}))
    initial = {}
    for label, before in (("whole on every rank", track_whole_build), ("shard only", track_until_first_step)):
        ranks = [summary["inspect"] for summary in run_on_ranks(config, args.nproc, before=before, timeout_s=600,
                                                                    inspect=seen)]
        initial[label] = {name: tensor for r in ranks for name, tensor in r["initial"].items()}
        print(json.dumps({"build": label, "strategy": args.mesh or args.strategy,
                          "peak_over_model": [round(r["peak"] / whole, 3) for r in ranks],
                          "held_over_model": [round(r["held"] / whole, 3) for r in ranks],
                          "peak_rss_mb": [round(r["rss_mb"]) for r in ranks]}))
    first, second = initial.values()
    print(json.dumps({"same_initial_parameters": first.keys() == second.keys()
                      and all(torch.equal(first[n], second[n]) for n in first)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
