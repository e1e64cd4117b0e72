"""A plain PyTorch training loop for the benchmark: what snnfw's overhead is measured against.

``python -m snnfw.baseline CONFIG --run-dir DIR``, alone or under torchrun:
one process runs a hand-written loop, several wrap the model in DDP. It uses
only the family's model builder and the data set; no snnfw runtime, hooks or
metrics machinery. It trains what the config asks of ``none`` or ``dp``: on
the device snnfw's plan takes for ``parallel.device`` (CUDA with NCCL, or the
CPU with gloo), in ``train.dtype`` and ``train.precision`` (autocast; fp16
with torch's GradScaler), with ``train.optimizer`` and
``train.lr_schedule`` as snnfw builds them, and ``train.microbatches`` per
replica (neurons reset before each, gradients accumulated as the mean,
synchronised after the last). It writes
``metrics.jsonl`` (step, loss over the global batch, step_ms,
peak_mem_mb_per_rank) and ``summary.json`` like a snnfw run, so ``snnfw
bench --baseline`` can compare them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F


class PlainLoop:
    """The hand-written loop on this rank: the config's model (in DDP on several ranks), optimizer and steps.

    Several ranks need the default process group started first.
    """

    def __init__(self, config, device: torch.device, rank: int = 0, world: int = 1):
        from snnfw.optim import build_optimizer, build_scheduler
        from snnfw.plugins import Plugins
        from snnfw.prepare import build_model

        plugins = Plugins()
        self.config, self.device, self.rank, self.world = config, device, rank, world
        model, spec = build_model(config, plugins)
        self.model = model.to(device, config.train.torch_dtype)
        self.dataset = plugins.datasets.get(config.data.name).build(config.data, spec, "train", config.train.seed)
        if world > 1:
            device_ids = [device.index] if device.type == "cuda" else None
            self.model = torch.nn.parallel.DistributedDataParallel(self.model, device_ids=device_ids)
        self.optimizer = build_optimizer(self.model, config.train, plugins)
        self.scheduler = build_scheduler(self.optimizer, config.train, plugins)
        self.scaler = torch.amp.GradScaler(device.type, enabled=config.train.precision == "fp16")

    def step(self, step: int) -> float:
        """Trains step ``step``; returns this rank's mean microbatch loss."""
        from spikingjelly.activation_based import functional

        from snnfw import data as datalib
        from snnfw.precision import autocast, full_precision

        config, model = self.config, self.model
        microbatches = config.train.microbatches or 1
        indices = datalib.global_batch_indices(step, config.data.batch_size, len(self.dataset), config.train.seed)
        loss_sum = 0.0
        for m, chunk in enumerate(indices.chunk(self.world)[self.rank].chunk(microbatches)):
            frames, labels = datalib.load(self.dataset, chunk, self.device, config.train.torch_dtype)
            last = m == microbatches - 1
            with model.no_sync() if self.world > 1 and not last else contextlib.nullcontext():
                functional.reset_net(model)
                with autocast(config.train, self.device.type):
                    logits = model(frames)
                loss = F.cross_entropy(full_precision(logits).mean(0), labels)
                self.scaler.scale(loss / microbatches).backward()
            loss_sum += loss.item()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return loss_sum / microbatches


def main(argv=None) -> int:
    from snnfw.config import load_config
    from snnfw.distributed import RankEnv, set_cpu_threads
    from snnfw.metrics import peak_memory_mb
    from snnfw.plan import Topology
    from snnfw.train import mark_done

    parser = argparse.ArgumentParser(prog="python -m snnfw.baseline")
    parser.add_argument("config")
    parser.add_argument("--run-dir", default="runs/baseline")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args(argv)
    config = load_config(args.config, args.overrides)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    topology = Topology.detect(world, config.parallel.device)
    if topology.device_type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        set_cpu_threads(RankEnv.from_environ())
    if world > 1:
        dist.init_process_group(topology.backend)
    loop = PlainLoop(config, device, rank, world)
    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    records = []
    for step in range(config.train.steps):
        started = time.perf_counter()
        loss = loop.step(step)
        elapsed = time.perf_counter() - started
        totals = torch.zeros(world + 1, dtype=torch.float64, device=device)  # each rank's peak, then the mean loss
        totals[rank] = peak_memory_mb(device)
        totals[world] = loss / world
        if world > 1:
            dist.all_reduce(totals)
        records.append({"step": step + 1, "loss": totals[world].item(), "step_ms": elapsed * 1e3,
                        "peak_mem_mb_per_rank": totals[:world].tolist()})
    if rank == 0:
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        (run_dir / "summary.json").write_text(json.dumps({"final_loss": records[-1]["loss"]}) + "\n")
    del loop
    if world > 1:
        dist.barrier()  # no rank marks itself done before rank 0 has written the results
        dist.destroy_process_group()
    mark_done(run_dir, rank)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
