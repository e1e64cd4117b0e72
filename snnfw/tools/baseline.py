"""A plain PyTorch training loop for the benchmark: what snnfw's overhead is measured against.

``python -m snnfw.tools.baseline CONFIG --run-dir DIR``, alone or under torchrun:
one process runs a hand-written loop, several wrap the model in DDP. It uses
only the family's model builder and the data set; no snnfw runtime, hooks or
metrics machinery. It trains what the config asks of ``none`` or ``dp``: on
the device snnfw's plan takes for ``parallel.device`` (CUDA with NCCL, or the
CPU with gloo), in ``train.dtype`` and ``train.precision`` (autocast; fp16
with torch's GradScaler), with ``train.optimizer`` and
``train.lr_schedule`` as snnfw builds them, gradients clipped at
``train.clip_grad_norm``, and ``train.microbatches`` per
replica (neurons reset before each, gradients accumulated as the mean,
synchronised after the last), its batches loaded ahead by ``data.workers`` processes as snnfw loads them; the loss
is the time-averaged cross entropy (a language model's against the next tokens, as ``next_token``). It writes
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

import attrs
import torch
import torch.distributed as dist
import torch.nn.functional as F

from snnfw.components.losses import next_token
from snnfw.components.precision import full_precision


@attrs.frozen
class _Split:
    """How a plain loop splits a step's global batch: over ``dp_size`` replicas, each into ``microbatches``."""

    global_batch: int
    dp_size: int
    microbatches: int


class _PlainBatches:
    """This rank's microbatches of each step, loaded as snnfw loads them: ``data.workers`` processes ahead of the
    step (0: in the step). Steps are asked for in order, from the first one asked."""

    def __init__(self, dataset, config, split: _Split, replica: int, device: torch.device):
        self.dataset, self.config, self.split, self.replica, self.device = dataset, config, split, replica, device
        self.batches, self.next_step = None, None

    def __call__(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        from snnfw.data import batches as datalib

        if self.batches is None:
            config = self.config
            sampler = datalib.StepSampler(self.split, len(self.dataset), config.train.seed, self.replica, step,
                                          config.train.steps)
            self.batches = datalib.step_batches(self.dataset, sampler, config.data.workers, self.device,
                                                config.train.torch_dtype)
            self.next_step = step
        if step != self.next_step:
            raise ValueError(f"the plain loop loads steps in order: step {self.next_step} is next, not {step}")
        self.next_step += 1
        return next(self.batches)


def time_averaged_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(full_precision(logits).mean(0), labels)


class PlainLoop:
    """The hand-written loop on this rank: the config's model (in DDP on several ranks), optimizer and steps.

    Several ranks need the default process group started first.
    """

    def __init__(self, config, device: torch.device, rank: int = 0, world: int = 1):
        from snnfw.components.optim import build_optimizer, build_scheduler
        from snnfw.plan.prepare import build_model
        from snnfw.plugin.manager import Plugins

        plugins = Plugins()
        self.config, self.device, self.rank, self.world = config, device, rank, world
        model, spec = build_model(config, plugins)
        self.model = model.to(device, config.train.torch_dtype)
        self.loss = next_token({}) if spec.vocab is not None else time_averaged_cross_entropy
        self.dataset = plugins.datasets.get(config.data.name).build(config.data, spec, "train", config.train.seed)
        if world > 1:
            device_ids = [device.index] if device.type == "cuda" else None
            self.model = torch.nn.parallel.DistributedDataParallel(self.model, device_ids=device_ids)
        self.optimizer = build_optimizer(self.model, config.train, plugins)
        self.scheduler = build_scheduler(self.optimizer, config.train, plugins)
        self.scaler = torch.amp.GradScaler(device.type, enabled=config.train.precision == "fp16")
        self.loss_share = 1.0 / world  # each rank's mean loss counts alike in the global mean
        self.batches = _PlainBatches(self.dataset, config, _Split(config.data.batch_size, world,
                                                                  config.train.microbatches or 1), rank, device)

    def step(self, step: int) -> float:
        """Trains step ``step``; returns this rank's mean microbatch loss."""
        from spikingjelly.activation_based import functional

        from snnfw.components.precision import autocast

        config, model = self.config, self.model
        microbatches = config.train.microbatches or 1
        loss_sum = 0.0
        for m, (frames, labels) in enumerate(self.batches(step)):
            last = m == microbatches - 1
            with model.no_sync() if self.world > 1 and not last else contextlib.nullcontext():
                functional.reset_net(model)
                with autocast(config.train, self.device.type):
                    logits = model(frames)
                loss = self.loss(logits, labels)
                self.scaler.scale(loss / microbatches).backward()
            loss_sum += loss.item()
        if config.train.clip_grad_norm is not None:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.train.clip_grad_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return loss_sum / microbatches


class PlainPipeline:
    """The hand-written pipeline on this pp rank: the model's units cut as ``split`` cuts them (the split
    snnfw's pipeline chose, ``run.model.split``), its stages in torch.distributed.pipelining's schedule
    class, and the optimizer over them.

    Stages reset the neurons before every microbatch; the loss is the time-averaged cross entropy. Every
    rank of the default process group is one pp rank (no data parallel); it must be started first.
    """

    def __init__(self, config, plan, device: torch.device, split):
        from spikingjelly.activation_based import functional
        from torch.distributed import pipelining

        from snnfw.components.optim import build_optimizer, build_scheduler
        from snnfw.components.precision import full_precision
        from snnfw.data import batches as datalib
        from snnfw.plan.prepare import build_model
        from snnfw.plugin.manager import Plugins

        plugins = Plugins()
        spec = plugins.schedules.get(config.pipeline.schedule)
        if spec.torch_schedule is None:
            raise ValueError(f"schedule {config.pipeline.schedule!r} has no torch.distributed.pipelining class to compare with")
        if plan.dp_size > 1:
            raise ValueError("the plain pipeline runs one pipeline over all ranks; set parallel.mesh = {pp = N}")
        if config.train.precision != "fp32" or config.train.loss != "cross_entropy":
            raise ValueError("the plain pipeline trains in fp32 with cross entropy; set train.precision and train.loss so")
        self.config, self.device = config, device
        model, input_spec = build_model(config, plugins)
        model = model.to(device, config.train.torch_dtype)
        self.dataset = plugins.datasets.get(config.data.name).build(config.data, input_spec, "train", config.train.seed)
        example = datalib.load(self.dataset, torch.arange(plan.microbatch_size), device, config.train.torch_dtype)[0]
        units = plugins.split_stages(model, plan, example)
        indices = spec.stage_indices(dist.get_rank(), dist.get_world_size(), config.pipeline.virtual_stages)
        modules = [torch.nn.Sequential(*(units[u] for u in split.unit_range(s))) for s in indices]
        for module in modules:
            module.register_forward_pre_hook(lambda module, args: functional.reset_net(module))
        stages = [pipelining.PipelineStage(module, s, len(split.layout), device) for module, s in zip(modules, indices)]
        self.holds_last = len(split.layout) - 1 in indices
        self.stages = torch.nn.ModuleList(modules)
        schedule = getattr(pipelining, spec.torch_schedule)
        self.schedule = schedule(stages[0] if spec.placement == "single" else stages, plan.microbatches,
                                 loss_fn=lambda logits, labels: F.cross_entropy(full_precision(logits).mean(0), labels))
        self.optimizer = build_optimizer(self.stages, config.train, plugins)
        self.scheduler = build_scheduler(self.optimizer, config.train, plugins)
        self.loss_share = 1.0  # the loss is on the last stage's rank alone
        self.batches = _PlainBatches(self.dataset, config, _Split(config.data.batch_size, 1, 1), 0, device)

    def step(self, step: int) -> float:
        """Trains step ``step``; returns the mean microbatch loss on the last stage's rank, 0 elsewhere."""
        [(frames, labels)] = self.batches(step)
        losses: list[torch.Tensor] = []
        self.schedule.step(frames, target=labels, losses=losses)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return float(torch.stack(losses).detach().mean()) if self.holds_last else 0.0


def main(argv=None) -> int:
    from snnfw.components.metrics import peak_memory_mb
    from snnfw.config import load_config
    from snnfw.distributed.collectives import RankEnv, set_cpu_threads
    from snnfw.plan.layout import Topology
    from snnfw.rundir import METRICS, SUMMARY, mark_done

    parser = argparse.ArgumentParser(prog="python -m snnfw.tools.baseline")
    parser.add_argument("config")
    parser.add_argument("--run-dir", default="runs/baseline")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args(argv)
    config = load_config(args.config, args.overrides)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    topology = Topology.detect(world, config.parallel.device, backend=config.parallel.backend)
    if topology.device_type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
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
        totals[world] = loss * loop.loss_share
        if world > 1:
            dist.all_reduce(totals)
        records.append({"step": step + 1, "loss": totals[world].item(), "step_ms": elapsed * 1e3,
                        "peak_mem_mb_per_rank": totals[:world].tolist()})
    if rank == 0:
        (run_dir / METRICS).write_text("".join(json.dumps(r) + "\n" for r in records))
        (run_dir / SUMMARY).write_text(json.dumps({"final_loss": records[-1]["loss"]}) + "\n")
    del loop
    if world > 1:
        dist.barrier()  # no rank marks itself done before rank 0 has written the results
        dist.destroy_process_group()
    mark_done(run_dir, rank)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
