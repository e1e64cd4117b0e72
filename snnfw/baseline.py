"""A plain PyTorch training loop for the benchmark: what snnfw's overhead is measured against.

``python -m snnfw.baseline CONFIG --run-dir DIR``, alone or under torchrun:
one process runs a hand-written loop, several wrap the model in DDP. It uses
only the family's model builder and the data set; no snnfw runtime, hooks or
metrics machinery. It writes ``metrics.jsonl`` (step, loss, step_ms,
peak_mem_mb_per_rank) and ``summary.json`` like a snnfw run, so ``snnfw
bench --baseline`` can compare them.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F


def main(argv=None) -> int:
    from spikingjelly.activation_based import functional

    from snnfw import data as datalib
    from snnfw.config import load_config
    from snnfw.metrics import peak_memory_mb
    from snnfw.plugins import Plugins
    from snnfw.prepare import build_model
    from snnfw.train import mark_done

    parser = argparse.ArgumentParser(prog="python -m snnfw.baseline")
    parser.add_argument("config")
    parser.add_argument("--run-dir", default="runs/baseline")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args(argv)
    config = load_config(args.config, args.overrides)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    plugins = Plugins()
    model, spec = build_model(config, plugins)
    dataset = plugins.datasets.get(config.data.name).build(config.data, spec, "train", config.train.seed)
    if world > 1:
        dist.init_process_group("gloo")
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.train.lr)
    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    records = []
    for step in range(config.train.steps):
        started = time.perf_counter()
        indices = datalib.global_batch_indices(step, config.data.batch_size, len(dataset), config.train.seed)
        frames, labels = datalib.load(dataset, indices.chunk(world)[rank], torch.device("cpu"))
        functional.reset_net(model)
        loss = F.cross_entropy(model(frames).mean(0), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - started
        peaks = torch.zeros(world, dtype=torch.float64)
        peaks[rank] = peak_memory_mb(torch.device("cpu"))
        if world > 1:
            dist.all_reduce(peaks)
        records.append({"step": step + 1, "loss": loss.item(), "step_ms": elapsed * 1e3,
                        "peak_mem_mb_per_rank": peaks.tolist()})
    if rank == 0:
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        (run_dir / "summary.json").write_text(json.dumps({"final_loss": records[-1]["loss"]}) + "\n")
    del model, optimizer
    if world > 1:
        dist.destroy_process_group()
    mark_done(run_dir, rank)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
