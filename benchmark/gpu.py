"""Every GPU setting snnfw offers, one change at a time, on the GPUs this host has.

``bash benchmark/gpu.sh`` on a CUDA host: for each family, the plain PyTorch
loop and ``none`` on one GPU, then each setting changed alone from ``none``:
the neuron backends (torch, cuda, triton, inductor), ``compile.enable``,
bf16 and fp16, channels-last convolutions (fp32 and bf16), memopt levels 1
to 4; then every strategy the GPU count fits
(dp, zero, fsdp2, tp and the pipelines from 2 GPUs, fsdp2_tp and HSDP from
4). Peaks are the CUDA allocator's. A setting the plan refuses here (a
backend that is not installed, ...) is recorded as skipped with the plan's
reason; cases that would start after ``--budget-s`` are skipped as such.
Prints the table and leaves the JSONL.

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
import time
from pathlib import Path

CONFIG = "examples/quickstart.toml"
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


def plan_refusal(sets: list[str], ranks: int) -> str | None:
    """The plan's reason when it refuses the case here, else None."""
    done = subprocess.run([sys.executable, "-m", "snnfw", "plan", CONFIG, "--world-size", str(ranks),
                           *[a for s in sets for a in ("--set", s)]], capture_output=True, text=True)
    if done.returncode == 0:
        return None
    return (done.stderr.strip().splitlines() or ["plan failed"])[-1].removeprefix("snnfw: error: ")


def case_overrides(family: str, sets: list[str], dry: bool) -> list[str]:
    """The --set list of a case: the family's shape (tiny in the dry mode) and device, then the case's own."""
    shape = FAMILIES[family][1 if dry else 0]
    return [f"model.family={family}", *shape, f"parallel.device={'cpu' if dry else 'cuda'}", "data.train_samples=512",
            "data.test_samples=8", *sets]


def run_case(family, label, ranks, sets, baseline, args) -> dict:
    sets = case_overrides(family, sets, args.dry)
    row = {"family": family, "case": label, "ranks": ranks, "dry": args.dry}
    if not baseline and (reason := plan_refusal(sets, ranks)):
        return {**row, "skipped": reason}
    warmup, steps = (1, 1) if args.dry else (2, 5)
    command = [sys.executable, "-m", "snnfw", "bench", CONFIG, "--nproc", str(ranks), "--warmup", str(warmup),
               "--steps", str(steps), "--results", str(args.records), "--label", label,
               *[a for s in sets for a in ("--set", s)], *(["--baseline"] if baseline else [])]
    before = args.records.read_text().count("\n") if args.records.exists() else 0
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.case_timeout_s)
    except subprocess.TimeoutExpired:
        return {**row, "failed": f"did not finish within --case-timeout-s {args.case_timeout_s:.0f}"}
    lines = args.records.read_text().splitlines() if args.records.exists() else []
    if done.returncode or len(lines) <= before:
        return {**row, "failed": (done.stderr.strip().splitlines() or ["no output"])[-1]}
    record = json.loads(lines[-1])
    return {**row, "step_ms": record["step_ms"], "samples_per_s": record["global_samples_per_s"],
            "peak_mb_per_rank": record["peak_mem_mb_per_rank"], "final_loss": record["final_loss"]}


def print_table(rows: list[dict]) -> None:
    print("| family | case | ranks | step ms | samples/s | peak MB per rank | final loss |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if "step_ms" in r:
            peaks = " / ".join(f"{p:.0f}" for p in r["peak_mb_per_rank"])
            cells = [f"{r['step_ms']:.1f}", f"{r['samples_per_s']:.1f}", peaks, f"{r['final_loss']:.4f}"]
        else:
            cells = ["skipped" if "skipped" in r else "FAILED", r.get("skipped") or r.get("failed"), "", ""]
        print(f"| {r['family']} | {r['case']} | {r['ranks']} | " + " | ".join(cells) + " |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="benchmark/gpu.sh", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry", action="store_true", help="run the case list on the CPU with tiny shapes")
    parser.add_argument("--gpus", type=int, help="GPUs to plan for (default: all this host has; 1 in the dry mode)")
    parser.add_argument("--budget-s", type=float, default=540.0, help="start no case after this many seconds")
    parser.add_argument("--case-timeout-s", type=float, default=300.0)
    parser.add_argument("--only", help="comma-separated cases to run (e.g. \"none,bf16\"); default: all")
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
    with args.out.with_suffix(".jsonl").open("a") as out:
        for family, label, ranks, sets, baseline in cases(gpus):
            if (args.only and label not in args.only.split(",")) or (args.family and family not in args.family):
                continue
            if time.monotonic() - started > args.budget_s:
                row = {"family": family, "case": label, "ranks": ranks, "dry": args.dry,
                       "skipped": f"past the {args.budget_s:.0f} s budget"}
            else:
                row = run_case(family, label, ranks, sets, baseline, args)
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
