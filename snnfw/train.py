"""Worker entry point: ``torchrun --nproc_per_node=N -m snnfw.train CONFIG [--run-dir DIR] [--set k=v ...] [--resume]``.

``snnfw train`` launches this module on every rank with the plan it made
(``--plan RUN_DIR/plan.json``), which each rank checks and runs without
planning again; under a plain torchrun each rank plans for itself. Rank 0
prints progress and writes the run directory. A
restarted attempt (``TORCHELASTIC_RESTART_COUNT`` > 0) resumes from the newest
checkpoint, unless an earlier attempt stopped on a user error, which a
restart would only repeat. An error raised in the user's own code (a model
or data set of theirs) ends a rank as a user error does, naming their file
and line (or a third-party plugin's hook, naming the plugin and the hook),
with the traceback in the run directory's ``error.log``. A rank
ends when its launcher is gone.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

from snnfw import fast_exit, rundir
from snnfw.config import load_config
from snnfw.errors import CollectiveError, UserError, WorkerError, explain, said, user_line
from snnfw.plan import planfile
from snnfw.plugin.manager import Plugins, plugin_hook


def _end_with_the_launcher() -> None:
    """Kills this rank once the launcher that started it is gone: torch's launcher starts each rank in a session of
    its own, which a kill of the launcher does not reach, and an orphan would go on writing into the run directory
    (beside the run that resumes it)."""
    launcher = os.getppid()

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="snnfw-launcher-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m snnfw.train", description=__doc__)
    parser.add_argument("config")
    parser.add_argument("--run-dir", default="runs/latest")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in the run directory")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier run's files in the run directory")
    parser.add_argument("--evaluate", metavar="WEIGHTS", help="score these weights on the test split instead of training")
    parser.add_argument("--predict", metavar="FILE", help="with --evaluate: write per-sample predictions (.jsonl)")
    parser.add_argument("--plan", metavar="FILE", help="the plan file snnfw train made for this config, run instead of planning")
    args = parser.parse_args(argv)
    from snnfw.run.loop import run_evaluation, run_training  # here: fast_exit.run must come before torch's import

    if "TORCHELASTIC_RUN_ID" in os.environ:  # started by snnfw train's or torchrun's launcher
        _end_with_the_launcher()
    started = time.time()
    run_dir = Path(args.run_dir)
    rank = int(os.environ.get("RANK", "0"))
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if restarted and rundir.stopped_marker(run_dir).exists():
        return 2
    for earlier in rundir.done_marker(run_dir, rank), rundir.failure_marker(run_dir, rank):  # an earlier attempt's
        earlier.unlink(missing_ok=True)
    rundir.mark_started(run_dir, rank)
    try:
        plugins = Plugins()
        if args.plan:
            config, plan = None, planfile.read(Path(args.plan), plugins, planfile.config_digest(args.config, args.overrides))
        else:
            config, plan = load_config(args.config, args.overrides), None
        if args.evaluate:
            result = run_evaluation(config, args.evaluate, run_dir, args.predict, plugins, plan)
            if rank == 0:
                print(f"[snnfw] {args.evaluate}: test accuracy {result['eval_acc']:.1%}, loss {result['eval_loss']:.4f}"
                      f"; {run_dir / rundir.EVAL}" + (f", predictions in {args.predict}" if args.predict else ""))
            rundir.mark_done(run_dir, rank)
            return 0
        if not restarted:  # a restarted attempt resumes from what its predecessor wrote, or starts afresh
            rundir.check_run_dir(run_dir, args.resume, args.overwrite)
            if args.overwrite and rank == 0:
                rundir.clear_run_dir(run_dir)
        owner = rundir.locked(run_dir) if rank == 0 and not os.environ.get(rundir.LAUNCHED) else contextlib.nullcontext()
        with owner:  # under plain torchrun rank 0 holds the run directory; under snnfw train its launcher does
            summary = run_training(config, run_dir, plugins, resume=args.resume or restarted, plan=plan)
    except UserError as err:
        if not os.environ.get(rundir.LAUNCHED) and rundir.first_to_say(run_dir, started, explain(err)):
            print(f"snnfw: error: {explain(err)}", file=sys.stderr)
        rundir.mark_stopped(run_dir, explain(err))
        return 2
    except CollectiveError as err:  # one line, which the launcher shows as the run's cause if it came first
        if rundir.stopped_since(run_dir, started):  # a peer stopped on a user error, and this rank lost it
            return 2
        if not os.environ.get(rundir.LAUNCHED):
            print(err.code, file=sys.stderr)
        rundir.mark_failed(run_dir, rank, str(err))
        return 1
    except Exception as err:  # reported by the launcher beside the ranks that ended with it
        if where := user_line(err) or plugin_hook(err):
            return _stopped_in_user_code(err, where, run_dir, rank)
        if rundir.stopped_since(run_dir, started):  # a peer stopped on a user error, and this rank lost it
            return 2
        rundir.mark_failed(run_dir, rank, f"{type(err).__name__}: {explain(err)}"[:400])
        raise
    if rank == 0:
        print(f"[snnfw] done: {summary['steps']} steps, final loss {summary['final_loss']:.4f}, {_scored(summary)}, "
              f"{summary['wall_s']:.1f} s; results in {run_dir}")
    rundir.mark_done(run_dir, rank)
    sys.stdout.flush()
    sys.stderr.flush()
    plugins.rank_done(rank)
    return 0


def _scored(summary: dict) -> str:
    """The last validation as the final line says it: a language model's bits per byte (else perplexity), or the
    test accuracy."""
    last = summary.get("eval", {})
    if "eval_bpb" in last:
        return f"validation {last['eval_bpb']:.3f} bits per byte"
    if "eval_ppl" in last:
        return f"validation perplexity {last['eval_ppl']:.2f}"
    return f"test accuracy {summary['test_accuracy']:.1%}"


def _stopped_in_user_code(err: Exception, where: str, run_dir: Path, rank: int) -> int:
    """Ends this rank on an error raised in the user's own code (their model, their data set) as on a user error:
    one line naming it, the traceback in the run directory's error log (and on screen with ``snnfw --debug``); of one
    raised in a data loader worker, the worker's."""
    worker = isinstance(err, WorkerError)
    text = err.traceback if worker else "".join(traceback.format_exception(err))
    log = run_dir / rundir.ERROR_LOG
    rundir.write_text(log, f"rank {rank}:\n{text}")
    if os.environ.get(rundir.DEBUG):
        print(text, file=sys.stderr, end="")
    message = f"{where}: {err.kind if worker else type(err).__name__}: {said(err)}; the traceback is in {log}"
    if not os.environ.get(rundir.LAUNCHED):
        print(f"snnfw: error: {message}", file=sys.stderr)
    rundir.mark_stopped(run_dir, message)
    return 2


def _interruptible() -> int:
    try:
        return main()
    except KeyboardInterrupt:  # the launcher forwards Ctrl-C to its ranks, and says how the run ended
        return 130


if __name__ == "__main__":
    fast_exit.run(_interruptible)
