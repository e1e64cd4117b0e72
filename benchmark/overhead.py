"""snnfw's overhead over the plain PyTorch loop, paired in each process, so that the machine's drift cancels.

    torchrun --nproc_per_node=N benchmark/overhead.py [CONFIG] [--pairs 8] [--warmup 2] [--set KEY=VALUE ...]

Every rank holds two copies of the config's model: one trained by snnfw (the
Python API, under the config's strategy) and one by :class:`snnfw.tools.baseline.PlainLoop`
(in DDP on several ranks) or, under ``pp``, :class:`snnfw.tools.baseline.PlainPipeline`
(torch's schedule class on the stages snnfw's split chose), the same optimizer
and data on both. Their steps
alternate, the order flipped every pair (ABBA), each timed between barriers
(a distributed step takes its slowest rank's time). Rank 0 prints each
pair's ratio snnfw / plain, their median and range, and both losses, which
follow the same trajectory. One JSON line with all of it goes to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

import snnfw
from snnfw.config import load_config
from snnfw.tools.baseline import PlainLoop, PlainPipeline


def timed(step_fn, world: int) -> float:
    """Milliseconds of ``step_fn()`` from one barrier to the next."""
    if world > 1:
        dist.barrier()
    started = time.perf_counter()
    step_fn()
    if world > 1:
        dist.barrier()
    return (time.perf_counter() - started) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default="examples/quickstart.toml")
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2, help="untimed pairs first")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--out", default="benchmark/results/overhead.jsonl")
    args = parser.parse_args()
    steps = args.warmup + args.pairs
    config = load_config(args.config, [*args.overrides, f"train.steps={steps}"])
    with snnfw.start(config) as run:
        if run.plan.stage_dims:
            plain = PlainPipeline(run.config, run.plan, run.device, run.model.split)
        else:
            plain = PlainLoop(run.config, run.device, run.env.rank, run.env.world_size)
        world, ms = run.env.world_size, {"snnfw": [], "plain": []}
        losses = {"snnfw": [], "plain": []}
        for step in range(steps):
            order = ("snnfw", "plain") if step % 2 else ("plain", "snnfw")
            for side in order:
                if side == "snnfw":
                    elapsed = timed(lambda: losses["snnfw"].append(run.step(step)["loss"]), world)
                else:
                    elapsed = timed(lambda: losses["plain"].append(plain.step(step)), world)
                if step >= args.warmup:
                    ms[side].append(elapsed)
        plain_losses = torch.tensor(losses["plain"], dtype=torch.float64) * plain.loss_share  # to the global mean
        if world > 1:
            dist.all_reduce(plain_losses)
        losses["plain"] = plain_losses.tolist()
        if run.env.rank == 0:
            ratios = [s / p for s, p in zip(ms["snnfw"], ms["plain"])]
            result = {
                "strategy": run.plan.name, "ranks": world, "pairs": args.pairs, "overrides": args.overrides,
                "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
                "ratios": ratios, "snnfw_ms": ms["snnfw"], "plain_ms": ms["plain"],
                "snnfw_losses": losses["snnfw"], "plain_losses": losses["plain"], "torch": torch.__version__,
            }
            print(f"{run.plan.name} on {world} rank(s), {args.pairs} pairs: snnfw / plain median "
                  f"{result['ratio_median']:.3f} (range {result['ratio_min']:.3f} to {result['ratio_max']:.3f}); "
                  f"median step {statistics.median(ms['snnfw']):.0f} ms snnfw, {statistics.median(ms['plain']):.0f} ms "
                  f"plain; last losses {losses['snnfw'][-1]:.4f} snnfw, {losses['plain'][-1]:.4f} plain",
                  flush=True)
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)  # benchmark/results/ on a fresh checkout
            with open(args.out, "a") as f:
                f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
