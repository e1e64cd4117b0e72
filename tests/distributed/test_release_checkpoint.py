"""What the last release wrote still trains on: a checkpoint snnfw 0.2.0 wrote under fsdp2_tp (its mesh spelled
{dp = 2, tp = 2}) resumes under the preset and under its mesh in today's names, and each continues with the losses
0.2.0's uninterrupted run had, as does today's run from the start (tests/fixtures/snnfw-0.2.0-fsdp2_tp/make.py)."""

import json
import shutil
from pathlib import Path

import pytest

from snnfw.testing import run_on_ranks, tiny_config
from snnfw.testing.checks import assert_close

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "snnfw-0.2.0-fsdp2_tp"
RELEASED_LOSSES = json.loads((FIXTURE / "losses.json").read_text())  # 0.2.0's four steps, uninterrupted
SPELLINGS = {
    "preset, 0.2.0's mesh": ("fsdp2_tp", {"dp": 2, "tp": 2}),
    "mesh": ("mesh", {"dp_shard": 2, "tp": 2}),
}


def config(strategy: str, mesh: dict):
    return tiny_config(strategy, model={"family": "sequence_mlp", "flavor": "tiny", "time_steps": 4},
                       train={"steps": 4, "dtype": "float64"}, data={"test_samples": 8},
                       parallel={"mesh": mesh}, checkpoint={"every": 2})


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_a_checkpoint_of_the_last_release_resumes_to_its_losses(spelling, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(FIXTURE / "run", run_dir)
    run_on_ranks(config(*SPELLINGS[spelling]), 4, run_dir, resume=True, timeout_s=300)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert lines[:2] == (FIXTURE / "run" / "metrics.jsonl").read_text().splitlines()  # resumed: 0.2.0's steps kept
    got = [json.loads(line)["loss"] for line in lines]
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4]
    for step, (mine, released) in enumerate(zip(got, RELEASED_LOSSES), 1):
        assert_close(f"step {step} loss", mine, released)


def test_the_preset_trains_to_the_last_releases_losses(tmp_path):
    summary = run_on_ranks(config("fsdp2_tp", {"dp_shard": 2, "tp": 2}), 4, tmp_path, timeout_s=300)[0]
    for step, (mine, released) in enumerate(zip(summary["losses"], RELEASED_LOSSES), 1):
        assert_close(f"step {step} loss", mine, released)
    assert len(summary["losses"]) == 4
