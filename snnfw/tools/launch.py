"""``snnfw train``: launch N local ranks through torch's elastic launcher.

The same as ``torchrun --nproc_per_node=N -m snnfw.train CONFIG ...``, plus
one honest distinction: a rank that aborts at process exit after every rank
finished its work (seen with gloo on CPU) is reported as such, not as a failed
run.
With ``nnodes`` > 1 the launchers of all nodes meet through the c10d
rendezvous at ``rdzv_endpoint``, hosted by node rank 0. With ``max_restarts``
the group restarts when a rank dies, and restarted ranks resume from the
newest checkpoint; the workers then keep their own store
(``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``), since with the agent's shared store
a restarted group can read its predecessor's addresses (pytorch/pytorch#135712).
A user error in the ranks, or an error raised in the user's own code (their
model, their data set), is reported like one found before launch: one line,
exit status 2, without the elastic agent's log of the failed workers.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import sys
import time
import uuid
from pathlib import Path

from snnfw import rundir
from snnfw.rundir import DEBUG, LAUNCHED
from snnfw.run.preemption import PREEMPTED_EXIT, Preempted
from snnfw.tools.watchdog import Watchdog, blame

ELASTIC_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")  # those torch's elastic agent forwards by default
SHUTDOWN_MARGIN_S = 5.0  # beyond checkpoint.grace_s, before the agent kills ranks that did not end


class _QuietOnceStopped(logging.Filter):
    """Drops the elastic agent's records once a rank has stopped on a user error, which the launcher reports."""

    def __init__(self, marker: Path):
        super().__init__()
        self.marker = marker

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.marker.exists()


def _elastic_loggers() -> list[logging.Logger]:
    prefixes = ("torch.distributed.elastic", "torch.distributed.launcher")
    loggers = logging.Logger.manager.loggerDict.items()
    return [logger for name, logger in loggers if name.startswith(prefixes) and isinstance(logger, logging.Logger)]


def launch(
    config_path: str, nproc: int, run_dir: Path, overrides: list[str], timeout_s: float, module: str = "snnfw.train",
    *, nnodes: int = 1, node_rank: int = 0, rdzv_endpoint: str | None = None, max_restarts: int = 0, resume: bool = False,
    extra: list[str] = (), plan: Path | None = None, debug: bool = False, save_on_signals: tuple[str, ...] = (),
    grace_s: float = 30.0,
) -> int:
    """Runs ``module`` (the worker entry) on every rank and returns the exit status for the CLI.

    ``plan``: the plan file the launcher wrote (:mod:`snnfw.plan.planfile`), which every rank then runs instead of
    planning. ``debug``: the ranks show the tracebacks of errors in the user's code on screen too.
    ``save_on_signals`` (``checkpoint.save_on_signals``): signals the launcher forwards to its ranks, which save on
    them, given ``grace_s`` (and :data:`SHUTDOWN_MARGIN_S`) before the elastic agent kills them;
    a preempted run ends with :data:`~snnfw.run.preemption.PREEMPTED_EXIT`.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousTimeoutError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if rdzv_endpoint and node_rank != 0 and not _reachable(rdzv_endpoint, timeout_s):
        print(f"snnfw: error: {_unreachable(node_rank, rdzv_endpoint, timeout_s)}", file=sys.stderr)
        return 2
    rundir.clear_markers(run_dir)
    if max_restarts:
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    config = LaunchConfig(
        min_nodes=nnodes,
        max_nodes=nnodes,
        nproc_per_node=nproc,
        run_id="snnfw" if rdzv_endpoint else f"snnfw-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=rdzv_endpoint or "localhost:0",
        rdzv_configs={"is_host": node_rank == 0, "join_timeout": math.ceil(timeout_s), "read_timeout": math.ceil(timeout_s)}
        if rdzv_endpoint else {},
        rdzv_timeout=int(timeout_s),
        max_restarts=max_restarts,
        monitor_interval=0.1,
        signals_to_handle=",".join(dict.fromkeys([*ELASTIC_SIGNALS, *save_on_signals])),
        shutdown_timeout=math.ceil(grace_s + SHUTDOWN_MARGIN_S) if save_on_signals else None,
    )
    args = ["-u", "-m", module, config_path, "--run-dir", str(run_dir)] + (["--resume"] if resume else []) + list(extra)
    args += ["--plan", str(plan)] if plan is not None else []
    for item in overrides:
        args += ["--set", item]
    stopped = rundir.stopped_marker(run_dir)
    quiet, loggers = _QuietOnceStopped(stopped), _elastic_loggers()
    for logger in loggers:
        logger.addFilter(quiet)
    try:
        with _environment({LAUNCHED: "1", DEBUG: "1" if debug else None}), Watchdog(run_dir) as watchdog:
            elastic_launch(config, entrypoint=sys.executable)(*args)
    except SignalException as err:
        if said := _preempted(run_dir):
            print(said, file=sys.stderr)
            return PREEMPTED_EXIT
        if save_on_signals and rundir.any_done(run_dir):  # the signal came after the ranks' last agreement
            print(f"snnfw: note: {err.sigval.name} came as the run ended; it completed, and its results in {run_dir} "
                  "are whole", file=sys.stderr)
            return 0
        print(f"snnfw: error: {_stopped(err.sigval.name, run_dir, module == 'snnfw.train' and '--evaluate' not in extra)}",
              file=sys.stderr)
        return 128 + err.sigval
    except RendezvousTimeoutError:
        print(f"snnfw: error: the {nnodes} nodes did not all reach the rendezvous at {rdzv_endpoint} within "
              f"{timeout_s:g} s (parallel.timeout_s); start snnfw train on every node with the same --rdzv-endpoint "
              "and --nnodes", file=sys.stderr)
        return 2
    except RendezvousConnectionError:
        if node_rank == 0:
            print(f"snnfw: error: node 0 could not host the rendezvous at {rdzv_endpoint}, or lost it; give "
                  "--rdzv-endpoint this node's own address and a free port", file=sys.stderr)
        else:
            print(f"snnfw: error: {_unreachable(node_rank, rdzv_endpoint, timeout_s)}", file=sys.stderr)
        return 2
    except ChildFailedError as err:
        if said := _preempted(run_dir):  # the ranks alone had the signal
            print(said, file=sys.stderr)
            return PREEMPTED_EXIT
        if stopped.exists():
            print(f"snnfw: error: {stopped.read_text().strip()}", file=sys.stderr)
            return 2
        failed = err.failures
        if all(f.exitcode == 2 for f in failed.values()):
            return 2
        # A rank marks itself done after the run's last barrier, so one marker says every rank's work is complete:
        # then a signal (the abort at exit, or the agent's SIGTERM to the others) is harmless; an exit status is not.
        finished = rundir.any_done(run_dir)
        broken = sorted(r for r in failed if failed[r].exitcode > 0 or not finished)
        if broken:
            print(f"snnfw: error: {blame({r: failed[r] for r in broken}, run_dir, watchdog.unanswering, timeout_s)}", file=sys.stderr)
            return 1
        codes = ", ".join(f"rank {r}: {failed[r].signal_name()}" for r in sorted(failed))
        print(
            f"snnfw: note: {codes} after finishing all work (an abort at process exit, known with gloo "
            f"on CPU); training completed and its results in {run_dir} are whole",
            file=sys.stderr,
        )
        return 0
    finally:
        for logger in loggers:
            logger.removeFilter(quiet)
    return 0


def check_wandb_login(config) -> None:
    """Refuses, before any rank starts, Weights & Biases online without a login (its API key in ``WANDB_API_KEY``
    or the netrc file; no network is asked). The plan has refused a ``[log]`` setting whose package is missing."""
    import netrc

    from snnfw.errors import ConfigError

    if config.log.wandb == "online" and not os.environ.get("WANDB_API_KEY"):
        host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1].split("/")[0].split(":")[0]
        path = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
        try:
            login = netrc.netrc(path).authenticators(host) if path.is_file() else None
        except (netrc.NetrcParseError, OSError):
            login = None
        if not login or not login[2]:
            raise ConfigError(f'log.wandb = "online" logs to Weights & Biases, and no login was found (WANDB_API_KEY, '
                              f'or {host} in {path}); run wandb login, or set log.wandb = "offline"')


def _reachable(endpoint: str, timeout_s: float) -> bool:
    """Whether node 0's rendezvous at ``endpoint`` accepts a connection within ``timeout_s``.

    Asked before the elastic agent, whose store client tries a missing host twice for the whole timeout each,
    with a pause between, and logs a C++ stack at each try (14 s and 40 lines for a timeout of 5 s)."""
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    address = parse_rendezvous_endpoint(endpoint, default_port=29400)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection(address, timeout=max(0.1, deadline - time.monotonic())):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)


def _unreachable(node_rank: int, endpoint: str, timeout_s: float) -> str:
    return (f"node {node_rank} could not reach the rendezvous that node 0 hosts at {endpoint} within {timeout_s:g} s "
            "(parallel.timeout_s), or lost it; start snnfw train on node 0 with --rdzv-endpoint on its own address, "
            "and check that this node reaches it")


def _preempted(run_dir: Path) -> str | None:
    """The run's last line where a signal of ``checkpoint.save_on_signals`` stopped it with a checkpoint."""
    if (marked := rundir.preempted(run_dir)) is None:
        return None
    stopped = Preempted(marked["step"], Path(marked["checkpoint"]), marked["signal"], marked["signalled_at"])
    return f"snnfw: {stopped.line()}"


def _stopped(signal_name: str, run_dir: Path, training: bool) -> str:
    """What a signal ended, and for a training how to go on: from its newest checkpoint, or afresh without one."""
    if not training:
        return f"stopped by {signal_name}"
    if written := rundir.complete_checkpoints(run_dir / rundir.CHECKPOINTS):
        return (f"stopped by {signal_name}; continue from the newest checkpoint ({written[-1]}) with the same command "
                "and --resume")
    return (f"stopped by {signal_name} before any checkpoint was written (checkpoint.every sets how often one is); "
            "start again with the same command and --overwrite")


@contextlib.contextmanager
def _environment(values: dict[str, str | None]):
    """Sets the environment variables whose value is not None for the ranks, and restores them after."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update({name: value for name, value in values.items() if value is not None})
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
