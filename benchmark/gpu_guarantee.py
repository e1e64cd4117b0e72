"""``bash benchmark/gpu.sh --guarantee``: every strategy trained on CUDA, each equal to ``none`` on the same GPU.

The float64 guarantee (``snnfw.testing.guarantee``: every step's loss and firing rate, the validations and the
final model state within 1e-9 relative of ``none``'s with as many microbatches, every neuron layer firing) on
the VGG ``tiny``, case by case in ``ORDER`` (the most valuable first; ``cuda-graphs``: ``none`` compiled with
``compile.mode = "reduce-overhead"``, ``cudnn-benchmark``: with cuDNN's autotuner, each against eager
``none``), each result appended to the JSONL as it ends, so a GPU taken back mid-run still leaves the results so far. Ranks get a GPU each and NCCL where the
host has enough GPUs; else they share them over gloo (``parallel.backend = "gloo"``), under which the plan
refuses the strategies that send CUDA tensors point to point (pp, tsp, fsdp2_tsp): such a case is recorded
as skipped with the plan's reason. The run stops starting cases when less than ``MIN_CASE_S`` of
``--budget-s`` is left.

``--dry`` (automatic without CUDA) runs the same cases on CPU ranks with gloo.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

FAMILY = "cifar10dvs_vgg"
ORDER = ("tp", "fsdp2", "cuda-graphs", "dp", "pp-1f1b", "pp-interleaved", "fsdp2_tp", "tsp", "hsdp", "zero",
         "fsdp2-x-tsp", "cudnn-benchmark")
MIN_CASE_S = 45.0  # CUDA contexts on every rank, the model, 2 x steps in float64


def cases(only: str | None = None):
    """The equivalence cases of the GPU run, in ``ORDER`` (``only``: a comma-separated subset)."""
    from snnfw.testing.equivalence import CASES, Case

    by_name = {case.name: case for case in CASES} | {  # one rank, against none eager and untuned
        "cuda-graphs": Case("cuda-graphs", "none", 1, 1, 1, {"compile": {"enable": True, "mode": "reduce-overhead"}}),
        "cudnn-benchmark": Case("cudnn-benchmark", "none", 1, 1, 1, {"cuda": {"cudnn_benchmark": True}}),
    }
    wanted = only.split(",") if only else ORDER
    return [by_name[name] for name in ORDER if name in wanted]


def parallel_keys(ranks: int, gpus: int, dry: bool) -> tuple[tuple[str, str], ...]:
    """Each rank a GPU of its own and NCCL where there are enough, else gloo over shared GPUs; gloo on CPU dry."""
    if dry:
        return (("device", "cpu"), ("backend", "auto"))
    return (("device", "cuda"), ("backend", "auto" if gpus >= ranks else "gloo"))


def plan_refusal(case, parallel, steps: int) -> str | None:
    from snnfw.errors import UserError
    from snnfw.plan.prepare import prepare
    from snnfw.plugin.manager import Plugins
    from snnfw.testing.equivalence import case_config
    from snnfw.testing.guarantee import on

    try:
        prepare(on(case_config(FAMILY, case, "float64", steps), steps, parallel), case.ranks, Plugins())
    except UserError as err:
        return str(err)
    return None


def run_case(case, parallel, steps: int, timeout_s: float) -> dict:
    """One case's outcome: ``matched``, or ``skipped``/``differs``/``failed`` with the reason's line."""
    from snnfw.testing.guarantee import check_case

    if reason := plan_refusal(case, parallel, steps):
        return {"skipped": reason}
    try:
        check_case(FAMILY, case, steps, steps, parallel, timeout_s=timeout_s)
    except AssertionError as err:
        return {"differs": (str(err).splitlines() or ["assertion failed"])[0]}
    except Exception as err:  # a rank's error (a collective gloo lacks on CUDA, ...) or a timeout
        lines = [line for line in str(err).splitlines() if line.strip()] or traceback.format_exc().splitlines()
        return {"failed": f"{type(err).__name__}: {lines[-1].strip()}"}
    return {"matched": True}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="benchmark/gpu.sh --guarantee", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry", action="store_true", help="the same cases on CPU ranks with gloo")
    parser.add_argument("--only", help="comma-separated case names (default: all, in order)")
    parser.add_argument("--steps", type=int, default=10, help="training steps a case (validated at the last)")
    parser.add_argument("--budget-s", type=float, default=450.0)
    parser.add_argument("--out", type=Path, default=Path(f"benchmark/results/gpu-guarantee-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"))
    args = parser.parse_args(argv)
    import torch

    if not args.dry and not torch.cuda.is_available():
        print("no CUDA device here: running the dry mode on the CPU", file=sys.stderr)
        args.dry = True
    gpus = 0 if args.dry else torch.cuda.device_count()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget_s
    outcomes = []
    with args.out.open("a") as out:
        for case in cases(args.only):
            parallel = parallel_keys(case.ranks, gpus, args.dry)
            row = {"case": case.name, "strategy": case.strategy, "ranks": case.ranks, **dict(parallel), "gpus": gpus,
                   "steps": args.steps}
            left, started = deadline - time.monotonic(), time.monotonic()
            if left < MIN_CASE_S:
                row["skipped"] = f"less than {MIN_CASE_S:.0f} s of the {args.budget_s:.0f} s budget left"
            else:
                row.update(run_case(case, parallel, args.steps, left))
            row["seconds"] = round(time.monotonic() - started, 1)
            outcomes.append(row)
            out.write(json.dumps(row) + "\n")
            out.flush()
            print(json.dumps(row), flush=True)
    return 1 if any("differs" in r or "failed" in r for r in outcomes) else 0


if __name__ == "__main__":
    raise SystemExit(main())
