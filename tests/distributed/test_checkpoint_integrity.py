"""A damaged checkpoint is never read as good: each way one can be broken is refused in one line naming the file and
the step, and where the newest was asked for, the newest whole one is used instead, saying so."""

import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from snnfw import rundir
from snnfw.cli import main
from snnfw.components import integrity
from snnfw.components.dcp_reader import metadata_of
from snnfw.components.weights import read_weights
from snnfw.errors import CheckpointError
from snnfw.run.loop import run_training
from snnfw.testing import TINY, tiny_config

ROOT = Path(__file__).resolve().parents[2]
PARAMETER = "features.1.proj_bn.1.weight"  # a BatchNorm weight, as in the report of bytes flipped that exported as good


def config(steps=2):
    return tiny_config("none", train={"steps": steps}, checkpoint={"every": 1})


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    """A run directory with the checkpoints of steps 1 and 2."""
    run_dir = tmp_path_factory.mktemp("two-steps")
    run_training(config(), run_dir)
    return run_dir


@pytest.fixture
def run_dir(two_steps, tmp_path):
    shutil.copytree(two_steps, tmp_path / "run")
    return tmp_path / "run"


def flip_parameter(folder: Path, name: str = PARAMETER) -> None:
    """Flips a byte in the middle of the parameter ``name``'s own values inside its ``.distcp`` file."""
    metadata = metadata_of(folder)
    (info,) = [s for i, s in metadata.storage_data.items() if metadata.planner_data[i.fqn] == ("model", name)]
    path = folder / info.relative_path
    data = bytearray(path.read_bytes())
    piece = bytes(data[info.offset: info.offset + info.length])
    values = torch.load(io.BytesIO(piece), weights_only=True).numpy().tobytes()
    assert piece.count(values) == 1
    at = info.offset + piece.find(values) + len(values) // 2
    data[at] ^= 0x40  # an exponent bit of a float32
    path.write_bytes(bytes(data))


def other_files(folder: Path) -> None:
    """Gives step 2 a sealed meta.json of its step that records step 1's files."""
    meta = json.loads((folder.parent / "step-1" / "meta.json").read_text())
    del meta[integrity.SEALED]
    meta["step"] = 2
    (folder / "meta.json").write_text(json.dumps({**meta, integrity.SEALED: integrity.seal_of(meta)}))


def cut(path: Path, keep: float = 0.5) -> None:
    path.write_bytes(path.read_bytes()[: int(path.stat().st_size * keep)])


BREAKS = {  # how step 2 is broken, and the file its refusal names
    "flipped parameter": (lambda f: flip_parameter(f), "__0_0.distcp"),
    "corrupt meta.json": (lambda f: (f / "meta.json").write_text('{"step": 2, "loss": '), "meta.json"),
    "missing meta.json": (lambda f: (f / "meta.json").unlink(), "meta.json"),
    "foreign meta.json": (lambda f: shutil.copy(f.parent / "step-1" / "meta.json", f / "meta.json"), "meta.json"),
    "meta.json of other files": (lambda f: other_files(f), "meta.json"),
    "cut .distcp": (lambda f: cut(f / "__0_0.distcp"), "__0_0.distcp"),
    "missing .distcp": (lambda f: (f / "__0_0.distcp").unlink(), "__0_0.distcp"),
    "extra .distcp": (lambda f: shutil.copy(f / "__0_0.distcp", f / "__1_0.distcp"), "__1_0.distcp"),
    "cut .metadata": (lambda f: cut(f / ".metadata"), ".metadata"),
}


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    return lines[0]


@pytest.mark.parametrize("broken", BREAKS)
def test_a_broken_checkpoint_is_refused_by_name_and_the_newest_whole_one_used_instead(run_dir, tmp_path, capsys,
                                                                                        broken):
    """Exporting or evaluating the broken step is refused in one line naming its file; exporting (a run that stopped
    before its final model) or resuming the run directory (the newest checkpoint) uses step 1, saying in one line why;
    with no whole one left, resuming is refused."""
    damage, file = BREAKS[broken]
    folder = run_dir / "checkpoints" / "step-2"
    damage(folder)
    out = tmp_path / "x.pt"
    assert main(["export", str(folder), "--out", str(out)]) == 2
    stdout, stderr = capsys.readouterr()
    assert stdout == "" and not out.exists()
    assert one_line(stderr).startswith(f"snnfw: error: checkpoint step 2 is damaged: {folder / file} ")
    assert f"remove {folder} to use an earlier checkpoint" in stderr
    with pytest.raises(CheckpointError, match=rf"^checkpoint step 2 is damaged: {folder / file} "):
        read_weights(folder)  # what snnfw eval and predict read, before launch and on every rank

    (run_dir / "final_model.pt").unlink()  # a run stopped after step 2's save: its newest weights are checkpoints
    assert main(["export", str(run_dir), "--out", str(out)]) == 0
    stdout, stderr = capsys.readouterr()
    assert stdout.startswith(f"exported step 1 of {run_dir / 'checkpoints' / 'step-1'} ")
    note = one_line(stderr)
    assert note.startswith(f"[snnfw] note: checkpoint step 2 is damaged: {folder / file} ")
    assert note.endswith("using step 1, the newest whole checkpoint")

    resumed = run_training(config(), run_dir, resume=True)
    assert resumed["resumed_from"] == 1
    assert note in capsys.readouterr().err.splitlines()

    damage(folder)  # the resumed run wrote step 2 anew
    shutil.rmtree(run_dir / "checkpoints" / "step-1")
    refusal = rf"^checkpoint step 2 is damaged: {folder / file} .* no checkpoint before it is whole; restore it"
    with pytest.raises(CheckpointError, match=refusal):
        run_training(config(), run_dir, resume=True)


def test_a_flipped_parameter_is_refused_on_export_and_on_resume_through_the_command_line(run_dir, tmp_path):
    """A byte of a parameter's own values flipped in the only checkpoint: ``snnfw export`` and ``snnfw train --resume``
    on 2 ranks each end in one line naming the file and the step, exit status 2, no rank's traceback, and no advice
    to resume; the parameter as read without the digest differs (it would be exported as good)."""
    shutil.rmtree(run_dir / "checkpoints" / "step-1")
    folder = run_dir / "checkpoints" / "step-2"
    whole = read_weights(folder)[PARAMETER]
    flip_parameter(folder)
    meta = json.loads((folder / "meta.json").read_text())
    unsealed = {key: value for key, value in meta.items() if key not in (integrity.DIGESTS, integrity.SEALED)}
    (folder / "meta.json").write_text(json.dumps(unsealed))
    assert not torch.equal(read_weights(folder)[PARAMETER], whole)
    (folder / "meta.json").write_text(json.dumps(meta))
    config_file = tmp_path / "tiny.toml"
    tables = {**TINY, "parallel": {"strategy": "dp", "device": "cpu"}, "checkpoint": {"every": 1}}
    config_file.write_text("".join(f"[{section}]\n" + "".join(f"{key} = {json.dumps(value)}\n" for key, value in
                                                              table.items()) for section, table in tables.items()))
    said = f"snnfw: error: checkpoint step 2 is damaged: {folder / '__0_0.distcp'} does not match the digest"
    for command in (["export", run_dir, "--out", tmp_path / "x.pt"],
                    ["train", config_file, "--nproc", 2, "--run-dir", run_dir, "--resume"]):
        done = subprocess.run([sys.executable, "-m", "snnfw", *map(str, command)], cwd=ROOT, capture_output=True,
                              text=True, timeout=240)
        assert done.returncode == 2, done.stderr
        assert one_line(done.stderr).startswith(said), done.stderr
        assert "--resume" not in done.stderr and "Traceback" not in done.stderr


def test_a_checkpoint_written_before_digests_loads_with_one_note(run_dir, tmp_path, capsys):
    for folder in (run_dir / "checkpoints").iterdir():
        meta = json.loads((folder / "meta.json").read_text())
        (folder / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k not in ("digests", "sealed")}))
    assert main(["export", str(run_dir), "--out", str(tmp_path / "x.pt")]) == 0
    assert one_line(capsys.readouterr().err) == (
        "[snnfw] note: checkpoint step 2 was written without digests (by an earlier snnfw), so its files are checked "
        "for presence and length only")
    assert run_training(config(3), run_dir, resume=True)["resumed_from"] == 2
    assert "checkpoint step 2 was written without digests" in capsys.readouterr().err


def test_an_export_that_passes_over_an_incomplete_step_says_so(run_dir, tmp_path, capsys):
    (run_dir / "checkpoints" / "step-2").rename(run_dir / "checkpoints" / ".tmp-step-2")
    (run_dir / "final_model.pt").unlink()  # a run stopped while saving step 2: its newest weights are checkpoints
    assert main(["export", str(run_dir), "--out", str(tmp_path / "x.pt")]) == 0
    assert one_line(capsys.readouterr().err) == (
        f"[snnfw] note: step 2 was not completed ({run_dir / 'checkpoints' / '.tmp-step-2'} was being written when its "
        "run stopped); using step 1, the newest whole checkpoint")


def test_an_export_carries_its_digest_which_eval_checks(run_dir, tmp_path):
    out = tmp_path / "x.pt"
    assert main(["export", str(run_dir), "--out", str(out)]) == 0
    sha256 = integrity.file_digest(out, "sha256").removeprefix("sha256:")
    assert (tmp_path / "x.pt.sha256").read_text() == f"{sha256}  x.pt\n"  # as sha256sum -c reads it
    data = bytearray(out.read_bytes())
    data[len(data) // 2] ^= 1
    out.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"^{out} does not match the SHA-256 in {out}.sha256 \(corrupt or cut\)"):
        read_weights(out)


def test_resuming_a_run_whose_only_checkpoint_lacks_its_meta_json_names_it(run_dir):
    shutil.rmtree(run_dir / "checkpoints" / "step-1")
    (run_dir / "checkpoints" / "step-2" / "meta.json").unlink()
    with pytest.raises(CheckpointError, match=rf"^{run_dir / 'checkpoints' / 'step-2' / 'meta.json'} is missing, so .* "
                                              "restore it from a copy, or start over with --overwrite"):
        rundir.check_run_dir(run_dir, resume=True, overwrite=False)


def test_a_runs_weights_files_carry_digests_which_their_readers_check(run_dir, tmp_path, capsys):
    """final_model.pt and best_model.pt have their SHA-256 beside them, as sha256sum -c reads it; export, eval and
    predict refuse a file that no longer matches it in one line, and read one of an earlier snnfw (no digest)."""
    final, best = run_dir / rundir.FINAL_MODEL, run_dir / rundir.BEST_MODEL
    whole = best.read_bytes()
    for path in (final, best):
        sha256 = integrity.file_digest(path, "sha256").removeprefix("sha256:")
        assert path.with_name(f"{path.name}.sha256").read_text() == f"{sha256}  {path.name}\n"
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 1
        path.write_bytes(bytes(data))
    assert main(["export", str(final), "--out", str(tmp_path / "x.pt")]) == 2
    assert one_line(capsys.readouterr().err) == (
        f"snnfw: error: {final} does not match the SHA-256 in {final}.sha256 (corrupt or cut); restore it from a copy, "
        "or write it again")
    assert main(["eval", str(ROOT / "examples" / "quickstart.toml"), "--weights", str(best), "--nproc", "1",
                 "--set", "parallel.strategy=none"]) == 2
    assert one_line(capsys.readouterr().err).startswith(f"snnfw: error: {best} does not match the SHA-256 in ")
    best.write_bytes(whole)
    (run_dir / f"{rundir.BEST_MODEL}.sha256").unlink()  # as an earlier snnfw wrote it: read without a check
    assert PARAMETER in read_weights(best)
