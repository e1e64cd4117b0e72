"""Every GPU setting snnfw offers, one change at a time, on the GPUs this host has.

``bash benchmark/gpu.sh`` on a CUDA host: for each family, the plain PyTorch
loop and ``none`` on one GPU, then each setting changed alone from ``none``:
the neuron backends (torch, cuda, triton, inductor), ``compile.enable``,
bf16 and fp16 (whose neurons SpikingJelly runs on its Torch reference: its
kernels take only a float32 voltage), channels-last convolutions (fp32 and
bf16), memopt levels 1 to 4; then every strategy the GPU count fits
(dp, zero, fsdp2, tp and the pipelines from 2 GPUs, fsdp2_tp and HSDP from
4). Peaks are the CUDA allocator's. A setting the plan refuses here (a
backend that is not installed, ...) is recorded as skipped with the plan's
reason. The run ends within ``--budget-s``: a case runs for what is left of
it (at most ``--case-timeout-s``) and is then stopped with its ranks, and
cases that would start with less than ``MIN_CASE_S`` left are skipped as
such. Prints the table and leaves the JSONL.

``--dry`` (or a host without CUDA) runs the same case list on the CPU with
tiny shapes and one timed step, as if the host had ``--gpus`` GPUs, so the
script is known to work before a GPU is at hand; its times say nothing about
GPUs, and the CUDA-only backends show up as skipped with the reason.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIG = "examples/quickstart.toml"
MIN_CASE_S = 30.0  # a case needs at least this long: CUDA context, model, warm-up
STOP_GRACE_S = 30.0  # after SIGTERM, before SIGKILL
GPU_LOADERS = 4  # data.workers per rank on a GPU, for snnfw and the plain loop alike: in-step loading starves a GPU
FAMILIES = {  # family: the --set list of its shape on a GPU, and in the dry mode
    "cifar10dvs_vgg": (["model.flavor=full", "model.time_steps=8", "data.batch_size=32"],
                       ["model.flavor=tiny", "model.time_steps=2", "data.batch_size=8"]),
    "spikformer": (["model.flavor=tiny", "model.time_steps=4", "data.batch_size=64"],
                   ["model.flavor=tiny", "model.time_steps=2", "data.batch_size=8"]),
}
SETTINGS = [  # (label, --set list) changed alone from `none` on one GPU
    *[(f"neuron {b}", [f"model.neuron_backend={b}"]) for b in ("torch", "cuda", "triton", "inductor")],
    ("compile", ["compile.enable=true"]),
    ("bf16", ["train.precision=bf16"]),
    ("fp16", ["train.precision=fp16"]),
    ("channels_last", ["model.memory_format=channels_last"]),
    ("bf16 channels_last", ["train.precision=bf16", "model.memory_format=channels_last"]),
    *[(f"memopt {level}", [f"memopt.level={level}"]) for level in (1, 2, 3, 4)],
]
STRATEGIES = [  # (label, GPUs it needs, --set list)
    ("dp", 2, ["parallel.strategy=dp"]),
    ("zero", 2, ["parallel.strategy=zero"]),
    ("fsdp2", 2, ["parallel.strategy=fsdp2"]),
    ("tp", 2, ["parallel.strategy=tp"]),
    ("pp 1f1b", 2, ["parallel.strategy=pp", "pipeline.schedule=1f1b", "train.microbatches=4"]),
    ("pp interleaved v2", 2, ["parallel.strategy=pp", "pipeline.schedule=interleaved", "pipeline.virtual_stages=2",
                              "train.microbatches=4"]),
    ("fsdp2_tp", 4, ["parallel.strategy=fsdp2_tp"]),
    ("hsdp", 4, ["parallel.strategy=fsdp2", "parallel.mesh={dp_replicate=2,dp_shard=2}"]),
]


ANCHOR_SHAPE = ["model.flavor=full", "model.time_steps=10"]  # SpikingJelly 2.0's distributed trainer's table
ANCHORS = [  # (label, ranks, --set list, its published ms a step on an RTX 4090: CIFAR10-DVS VGG, 16 a rank, T = 10)
    ("plain pytorch", 1, ["parallel.strategy=none"], None),
    ("none", 1, ["parallel.strategy=none"], 38.3),
    ("neuron inductor", 1, ["parallel.strategy=none", "model.neuron_backend=inductor"], None),
    ("dp", 2, ["parallel.strategy=dp"], 39.3),
    ("fsdp2", 2, ["parallel.strategy=fsdp2"], 47.9),
    ("tp", 2, ["parallel.strategy=tp"], 85.7),
]


def anchors(gpus: int, dry: bool):
    """SpikingJelly's published cases on its shapes (tiny ones in the dry mode), with its figure to compare."""
    for label, ranks, sets, published in ANCHORS:
        if ranks <= gpus:
            shape = [] if dry else [*ANCHOR_SHAPE, f"data.batch_size={16 * ranks}"]
            yield "cifar10dvs_vgg", label, ranks, [*shape, *sets], label == "plain pytorch", published


def cases(gpus: int):
    """(family, label, ranks, --set list, baseline) of every case on ``gpus`` GPUs, in run order."""
    for family in FAMILIES:
        yield family, "plain pytorch", 1, ["parallel.strategy=none"], True
        yield family, "none", 1, ["parallel.strategy=none"], False
        for label, sets in SETTINGS[1:]:  # "neuron torch" is `none` itself
            yield family, label, 1, ["parallel.strategy=none", *sets], False
        replicas = 2 * (gpus // 2)  # dp and its DDP baseline on the same even count
        if replicas:
            yield family, "plain pytorch ddp", replicas, [], True
        for label, need, sets in STRATEGIES:
            if gpus >= need:
                yield family, label, replicas if label == "dp" else need, sets, False


def run_within(command: list[str], timeout_s: float) -> tuple[int | None, str]:
    """Runs ``command``: its exit status (None past ``timeout_s``) and stderr.

    Past the timeout it gets SIGTERM, on which torch's elastic launcher stops the
    ranks it started (each in a session of its own, so out of reach of a kill of
    the launcher), and SIGKILL ``STOP_GRACE_S`` later; no rank outlives its case
    to hold GPU memory in the next one. Stderr goes to a file, not a pipe that a
    surviving rank could hold open."""
    with tempfile.TemporaryFile("w+") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, text=True)
        try:
            status = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.terminate()
            try:
                process.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            return None, ""
        stderr.seek(0)
        return status, stderr.read()


def plan_refusal(sets: list[str], ranks: int, timeout_s: float) -> str | None:
    """The plan's reason when it refuses the case here, else None; TimeoutError past ``timeout_s``."""
    status, stderr = run_within([sys.executable, "-m", "snnfw", "plan", CONFIG, "--world-size", str(ranks),
                                 *[a for s in sets for a in ("--set", s)]], timeout_s)
    if status == 0:
        return None
    if status is None:
        raise TimeoutError(f"planning did not finish within {timeout_s:.0f} s")
    return (stderr.strip().splitlines() or ["plan failed"])[-1].removeprefix("snnfw: error: ")


def case_overrides(family: str, sets: list[str], dry: bool) -> list[str]:
    """The --set list of a case: the family's shape (tiny in the dry mode) and device, then the case's own."""
    shape = FAMILIES[family][1 if dry else 0]
    device = ["parallel.device=cpu"] if dry else ["parallel.device=cuda", f"data.workers={GPU_LOADERS}"]
    return [f"model.family={family}", *shape, *device, "data.train_samples=512", "data.test_samples=8", *sets]


def run_case(family, label, ranks, sets, baseline, args, deadline: float) -> dict:
    """Plans and runs one case, stopped at ``deadline`` (``time.monotonic()``) at the latest."""
    sets = case_overrides(family, sets, args.dry)
    row = {"family": family, "case": label, "ranks": ranks, "dry": args.dry}
    try:
        if not baseline and (reason := plan_refusal(sets, ranks, deadline - time.monotonic())):
            return {**row, "skipped": reason}
    except TimeoutError as error:
        return {**row, "failed": str(error)}
    warmup, steps = (1, 1) if args.dry else (2, 5)
    command = [sys.executable, "-m", "snnfw", "bench", CONFIG, "--nproc", str(ranks), "--warmup", str(warmup),
               "--steps", str(steps), "--results", str(args.records), "--label", label,
               *[a for s in sets for a in ("--set", s)], *(["--baseline"] if baseline else [])]
    before = args.records.read_text().count("\n") if args.records.exists() else 0
    timeout_s = min(args.case_timeout_s, deadline - time.monotonic())
    status, stderr = run_within(command, timeout_s)
    if status is None:
        return {**row, "failed": f"stopped after {timeout_s:.0f} s (--case-timeout-s, or the end of --budget-s)"}
    lines = args.records.read_text().splitlines() if args.records.exists() else []
    if status or len(lines) <= before:
        return {**row, "failed": (stderr.strip().splitlines() or ["no output"])[-1]}
    record = json.loads(lines[-1])
    return {**row, "step_ms": record["step_ms"], "samples_per_s": record["global_samples_per_s"],
            "peak_mb_per_rank": record["peak_mem_mb_per_rank"], "final_loss": record["final_loss"]}


def print_table(rows: list[dict]) -> None:
    print("| family | case | ranks | step ms | samples/s | peak MB per rank | final loss | SpikingJelly ms (RTX 4090) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if "step_ms" in r:
            peaks = " / ".join(f"{p:.0f}" for p in r["peak_mb_per_rank"])
            cells = [f"{r['step_ms']:.1f}", f"{r['samples_per_s']:.1f}", peaks, f"{r['final_loss']:.4f}"]
        else:
            cells = ["skipped" if "skipped" in r else "FAILED", r.get("skipped") or r.get("failed"), "", ""]
        published = r.get("spikingjelly_rtx4090_ms")
        cells.append(f"{published}" if published is not None else "")
        print(f"| {r['family']} | {r['case']} | {r['ranks']} | " + " | ".join(cells) + " |")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--guarantee" in argv:  # every strategy on CUDA against none in float64: benchmark/gpu_guarantee.py
        sys.path.insert(0, str(Path(__file__).parent))
        from gpu_guarantee import main as guarantee

        return guarantee([a for a in argv if a != "--guarantee"])
    parser = argparse.ArgumentParser(prog="benchmark/gpu.sh", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry", action="store_true", help="run the case list on the CPU with tiny shapes")
    parser.add_argument("--gpus", type=int, help="GPUs to plan for (default: all this host has; 1 in the dry mode)")
    parser.add_argument("--budget-s", type=float, default=570.0,
                        help="seconds for the whole run: a running case is stopped at its end, and no case starts "
                             f"with less than {MIN_CASE_S:.0f} s of it left")
    parser.add_argument("--case-timeout-s", type=float, default=300.0)
    parser.add_argument("--only", help="comma-separated cases to run (e.g. \"none,bf16\"); default: all")
    parser.add_argument("--anchors", action="store_true",
                        help="SpikingJelly 2.0's published cases instead (CIFAR10-DVS VGG, 16 a rank, T = 10), its "
                        "RTX 4090 step times beside")
    parser.add_argument("--family", action="append", choices=sorted(FAMILIES), help="default: both")
    parser.add_argument("--out", type=Path, default=Path(f"benchmark/results/gpu-{time.strftime('%Y%m%d-%H%M%S')}"))
    args = parser.parse_args(argv)
    import torch

    if not args.dry and not torch.cuda.is_available():
        print("no CUDA device here: running the dry mode on the CPU", file=sys.stderr)
        args.dry = True
    gpus = args.gpus or (1 if args.dry else torch.cuda.device_count())
    args.records = args.out.with_suffix(".records.jsonl")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    started, rows = time.monotonic(), []
    deadline = started + args.budget_s
    with args.out.with_suffix(".jsonl").open("a") as out:
        listed = anchors(gpus, args.dry) if args.anchors else ((*case, None) for case in cases(gpus))
        for family, label, ranks, sets, baseline, published in listed:
            if (args.only and label not in args.only.split(",")) or (args.family and family not in args.family):
                continue
            if deadline - time.monotonic() < MIN_CASE_S:
                row = {"family": family, "case": label, "ranks": ranks, "dry": args.dry,
                       "skipped": f"less than {MIN_CASE_S:.0f} s of the {args.budget_s:.0f} s budget left"}
            else:
                row = run_case(family, label, ranks, sets, baseline, args, deadline)
            if published is not None:
                row["spikingjelly_rtx4090_ms"] = published
            rows.append(row)
            out.write(json.dumps(row) + "\n")
            out.flush()
            print(json.dumps(row), file=sys.stderr, flush=True)
    where = "the CPU (dry mode: times say nothing about GPUs)" if args.dry else torch.cuda.get_device_name()
    print(f"\n{gpus} GPU(s) planned, on {where}, {time.monotonic() - started:.0f} s; "
          f"rows in {args.out.with_suffix('.jsonl')}, bench records in {args.records}\n")
    print_table(rows)
    return 1 if any("failed" in r for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
