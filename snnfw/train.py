"""Worker entry point: ``torchrun --nproc_per_node=N -m snnfw.train CONFIG [--run-dir DIR] [--set k=v ...] [--resume]``.

``snnfw train`` launches this module on every rank; it also runs under a
plain torchrun. Rank 0 prints progress and writes the run directory. A
restarted attempt (``TORCHELASTIC_RESTART_COUNT`` > 0) resumes from the newest
checkpoint, unless an earlier attempt stopped on a user error, which a
restart would only repeat.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from snnfw import faults
from snnfw.checkpoint import check_run_dir, clear_run_dir
from snnfw.config import load_config
from snnfw.errors import UserError, explain
from snnfw.runtime import run_evaluation, run_training

DONE_DIR = ".ranks"
STOPPED = "stopped"
LAUNCHED = "SNNFW_LAUNCHED"  # set by snnfw train, which reports a rank's user error itself, once


def mark_done(run_dir: Path, rank: int) -> None:
    """Records that this rank passed the run's last barrier (every rank's work is complete), so an abort at exit
    is told apart."""
    (run_dir / DONE_DIR).mkdir(parents=True, exist_ok=True)
    (run_dir / DONE_DIR / f"rank{rank}.done").touch()


def mark_stopped(run_dir: Path, rank: int, message: str) -> None:
    """Records the user error that stopped this rank; written whole (a rename), since every rank may write it."""
    (run_dir / DONE_DIR).mkdir(parents=True, exist_ok=True)
    part = run_dir / DONE_DIR / f"{STOPPED}.rank{rank}"
    part.write_text(f"{message}\n")
    part.replace(run_dir / DONE_DIR / STOPPED)


def main(argv: list[str] | None = None) -> int:
    import os

    parser = argparse.ArgumentParser(prog="python -m snnfw.train", description=__doc__)
    parser.add_argument("config")
    parser.add_argument("--run-dir", default="runs/latest")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in the run directory")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier run's files in the run directory")
    parser.add_argument("--evaluate", metavar="WEIGHTS", help="score these weights on the test split instead of training")
    parser.add_argument("--predict", metavar="FILE", help="with --evaluate: write per-sample predictions (.jsonl)")
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir)
    rank = int(os.environ.get("RANK", "0"))
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if restarted and (run_dir / DONE_DIR / STOPPED).exists():
        return 2
    (run_dir / DONE_DIR / f"rank{rank}.done").unlink(missing_ok=True)  # an earlier attempt's
    try:
        config = load_config(args.config, args.overrides)
        if args.evaluate:
            result = run_evaluation(config, args.evaluate, run_dir, args.predict)
            if rank == 0:
                print(f"[snnfw] {args.evaluate}: test accuracy {result['eval_acc']:.1%}, loss {result['eval_loss']:.4f}"
                      f"; {run_dir / 'eval.json'}" + (f", predictions in {args.predict}" if args.predict else ""),
                      file=sys.stderr)
            mark_done(run_dir, rank)
            return 0
        if not restarted:  # a restarted attempt resumes from what its predecessor wrote, or starts afresh
            check_run_dir(run_dir, args.resume, args.overwrite)
            if args.overwrite and rank == 0:
                clear_run_dir(run_dir)
        summary = run_training(config, run_dir, resume=args.resume or restarted)
    except UserError as err:
        if not os.environ.get(LAUNCHED):
            print(f"snnfw: error: {explain(err)}", file=sys.stderr)
        mark_stopped(run_dir, rank, explain(err))
        return 2
    if rank == 0:
        print(
            f"[snnfw] done: {summary['steps']} steps, final loss {summary['final_loss']:.4f}, "
            f"test accuracy {summary['test_accuracy']:.1%}, {summary['wall_s']:.1f} s; results in {run_dir}",
            file=sys.stderr,
        )
    mark_done(run_dir, rank)
    sys.stdout.flush()
    sys.stderr.flush()
    faults.inject_at_end(rank)
    return 0


if __name__ == "__main__":
    sys.exit(main())
