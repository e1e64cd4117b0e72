"""A loop of the user's own on the Python API: a record's figures read on one rank only, at a step that does not log,
give metrics.jsonl's value without a hang; a collective that times out ends each rank in one line. Under torchrun and
on spawned ranks alike."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

import snnfw.testing
from snnfw.config import build_config
from snnfw.testing import RankFailure, run_on_ranks, tiny_config

HERE = Path(__file__).resolve().parent
TIMEOUT_S = 240  # a run of a few tiny steps takes 20 s on 2 cores
SHORT = 8  # parallel.timeout_s: a read that waited for a collective the other rank never joins fails in seconds

TORCHRUN = """
import json, sys
sys.path.insert(0, {here!r})
from test_own_loop import {loop}

print(json.dumps({loop}(json.loads(sys.argv[1]), sys.argv[2])), flush=True)
"""


def rank_0_reads_between_logs(config: dict, run_dir: str | None) -> dict:
    """Trains ``config`` in a loop whose rank 0 alone reads each step's loss, at once, where the step does not log."""
    import snnfw

    read = {}
    with snnfw.start(build_config(config), run_dir=run_dir) as run:
        for step in range(run.start_step, run.config.train.steps):
            record = run.step(step)
            if run.rank == 0 and not run.logs(step + 1):
                read[step + 1] = record["loss"]
    return {"rank": run.rank, "read": read}


def rank_1_sleeps_past_the_timeout(config: dict, run_dir: str | None) -> dict:
    """Rank 1 stops answering for three timeouts before step 2; rank 0 waits for it in that step's collectives."""
    import snnfw

    with snnfw.start(build_config(config), run_dir=run_dir) as run:
        for step in range(run.start_step, run.config.train.steps):
            if run.rank == 1 and step == 1:
                time.sleep(3 * SHORT)
            run.step(step)
    return {"rank": run.rank}


def _as_the_loop(loop):
    def before(rank):
        snnfw.testing.run_training = lambda config, run_dir, **_: loop(config.to_dict(), run_dir and str(run_dir))
    return before


def _reading_loop(rank):
    _as_the_loop(rank_0_reads_between_logs)(rank)


def _sleeping_loop(rank):
    _as_the_loop(rank_1_sleeps_past_the_timeout)(rank)


def torchrun(loop: str, config: dict, run_dir: Path) -> subprocess.CompletedProcess:
    script = run_dir.parent / f"{loop}.py"
    script.write_text(TORCHRUN.format(here=str(HERE), loop=loop))
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
                           json.dumps(config), str(run_dir)], capture_output=True, text=True, timeout=TIMEOUT_S)


def config_of(strategy: str) -> dict:
    return tiny_config(strategy, train={"steps": 4, "log_every": 2}, parallel={"timeout_s": SHORT}).to_dict()


@pytest.mark.parametrize("launch", ["torchrun", "spawned"])
@pytest.mark.parametrize("strategy", ["dp", "fsdp2"])
def test_rank_0_alone_reads_the_loss_between_steps_that_log(tmp_path, strategy, launch):
    run_dir = tmp_path / "run"
    if launch == "torchrun":
        done = torchrun("rank_0_reads_between_logs", config_of(strategy), run_dir)
        assert done.returncode == 0, done.stderr[-3000:]
        results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    else:
        results = run_on_ranks(build_config(config_of(strategy)), 2, run_dir, timeout_s=TIMEOUT_S, before=_reading_loop)
    read = next(r["read"] for r in results if r["rank"] == 0)
    written = {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    assert sorted(written) == [1, 2, 3, 4] and {int(step) for step in read} == {1, 3}
    assert all(loss == written[int(step)] for step, loss in read.items()), (read, written)


@pytest.mark.parametrize("launch", ["torchrun", "spawned"])
def test_a_collective_that_times_out_ends_the_rank_in_one_line(tmp_path, launch):
    said = f"snnfw: error: rank 0 waited {SHORT} s (parallel.timeout_s) in a collective that"
    started = time.monotonic()
    if launch == "torchrun":
        done = torchrun("rank_1_sleeps_past_the_timeout", config_of("dp"), tmp_path / "run")
        ranks = [line for line in done.stderr.splitlines() if line.startswith(("[rank", "snnfw:"))]  # the rest: torchrun's
        assert done.returncode != 0 and len(ranks) == 1 and ranks[0].startswith(said), done.stderr[-3000:]
        assert "gloo" not in done.stderr, done.stderr[-3000:]
    else:
        with pytest.raises(RankFailure) as failure:
            run_on_ranks(build_config(config_of("dp")), 2, timeout_s=TIMEOUT_S, before=_sleeping_loop)
        assert failure.value.errors[0].startswith(f"CollectiveError: {said[len('snnfw: error: '):]}")
    assert time.monotonic() - started < TIMEOUT_S / 2


def test_the_step_timeout_bounds_the_collectives_of_an_own_loop_from_its_second_step(tmp_path):
    """parallel.step_timeout_s applies in a loop of the user's own as in snnfw's: rank 0 fails after it, though
    parallel.timeout_s would wait longer than rank 1 sleeps."""
    config = tiny_config("dp", train={"steps": 4, "log_every": 2},
                         parallel={"timeout_s": 10 * SHORT, "step_timeout_s": SHORT}).to_dict()
    with pytest.raises(RankFailure) as failure:
        run_on_ranks(build_config(config), 2, timeout_s=TIMEOUT_S, before=_sleeping_loop)
    said = f"CollectiveError: rank 0 waited {SHORT} s (parallel.step_timeout_s) in a collective that"
    assert failure.value.errors[0].startswith(said), failure.value.errors[0][:500]
