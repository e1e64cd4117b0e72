"""The launcher's account of a failed run: the rank that failed first is named, not every rank that ended."""

import os
import time

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from snnfw import rundir
from snnfw.tools.watchdog import blame


def failure(rank, exitcode):
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file="")


def test_the_rank_that_raised_first_is_blamed_with_its_error(tmp_path):
    rundir.mark_failed(tmp_path, 1, "ValueError: a bad\nbatch")
    later = time.time() + 5
    rundir.mark_failed(tmp_path, 0, "RuntimeError: Connection closed by peer")
    os.utime(rundir.failure_marker(tmp_path, 0), (later, later))
    failed = {0: failure(0, 1), 1: failure(1, 1)}
    assert blame(failed, tmp_path, [], 10) == "rank 1 failed first, with ValueError: a bad batch; see the messages above"
    (tmp_path / rundir.CHECKPOINTS / "step-2").mkdir(parents=True)
    assert blame(failed, tmp_path, [], 10).endswith("; continue from its newest checkpoint with the same command and "
                                                    "--resume")


def test_ranks_the_agent_stopped_with_sigterm_are_not_blamed(tmp_path):
    failed = {0: failure(0, -15), 1: failure(1, -11), 2: failure(2, -9)}
    assert blame(failed, tmp_path, [], 10) == ("ranks [1, 2] were killed by SIGKILL, SIGSEGV (the kernel's "
                                               "out-of-memory killer sends SIGKILL); the other ranks stopped with them;"
                                               " see the messages above")


def test_without_a_cause_every_failed_rank_is_named(tmp_path):
    assert blame({3: failure(3, 1)}, tmp_path, [], 10) == "training failed on ranks [3]; see the messages above"


def test_a_removal_killed_midway_leaves_no_half_checkpoint(tmp_path, monkeypatch):
    """A checkpoint being pruned is renamed away before its files go: a kill during the deletion (here an error
    raised by the first file's removal) leaves only a temporary name, never a ``step-N`` without its metadata."""
    import shutil

    for step in (2, 4):
        folder = tmp_path / f"{rundir.STEP}{step}"
        folder.mkdir()
        (folder / "__0_0.distcp").write_bytes(b"x")
        (folder / rundir.STEP_META).write_text("{}")

    def killed(path, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        rundir.remove_whole(tmp_path / f"{rundir.STEP}2")
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(rundir.TEMP_PREFIX)] == [f"{rundir.STEP}4"]
    assert rundir.complete_checkpoints(tmp_path) == [tmp_path / f"{rundir.STEP}4"]
