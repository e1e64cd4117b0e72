"""A fuzz of checkpoints: a real checkpoint's files bit-flipped, cut, emptied, removed, grown or joined by another are
either read exactly as written or refused with a user error (one line at the command line), never another exception,
a hang or a value read wrong; checked in this process with the code that resume and export read through."""

import json
import random
import signal
from pathlib import Path

import pytest
import torch

from snnfw.components import checkpoint, integrity
from snnfw.errors import CheckpointError
from snnfw.run.loop import run_training
from snnfw.testing import tiny_config
from snnfw.testing.checks import user_outcome

TRIES = 400
UNSEALED_TRIES = 100  # of a checkpoint written before digests, whose files are checked for presence and length


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """The checkpoint of one step of the tiny VGG, its files' bytes, and all it holds as read."""
    run_dir = tmp_path_factory.mktemp("fuzz")
    run_training(tiny_config("none", train={"steps": 1}, checkpoint={"every": 1}), run_dir)
    folder = run_dir / "checkpoints" / "step-1"
    return folder, {p.name: p.read_bytes() for p in folder.iterdir()}, checkpoint.read(folder)


def _mutate(folder: Path, files: dict[str, bytes], rng: random.Random) -> str:
    name = rng.choice(sorted(files))
    data, path = bytearray(files[name]), folder / name
    kind = rng.choice(["flip", "flip", "flip", "cut", "empty", "remove", "grow", "extra"])
    if kind == "flip":
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif kind == "cut":
        data = data[: rng.randrange(len(data))]
    elif kind == "empty":
        data = bytearray()
    elif kind == "grow":
        data += rng.randbytes(rng.randint(1, 64))
    elif kind == "extra":
        path, data = folder / rng.choice(["__1_0.distcp", "__0_1.distcp", "notes.txt"]), bytearray(files[name])
    if kind == "remove":
        path.unlink()
    else:
        path.write_bytes(bytes(data))
    return f"{kind} {path.name}"


def _same(read, expected) -> bool:
    if isinstance(expected, dict):
        return isinstance(read, dict) and read.keys() == expected.keys() and all(_same(read[k], expected[k])
                                                                                  for k in expected)
    if isinstance(expected, list):
        return isinstance(read, list) and len(read) == len(expected) and all(map(_same, read, expected))
    if torch.is_tensor(expected):
        return torch.is_tensor(read) and read.dtype == expected.dtype and torch.equal(read, expected)
    return type(read) is type(expected) and read == expected


class Hung(Exception):
    pass


def _hang(signum, frame):
    raise Hung


def _fuzz(folder: Path, files: dict[str, bytes], expected: dict, tries: int, seed: int, kinds=None) -> dict:
    """Mutates the checkpoint ``tries`` times, restoring it after each; returns the outcomes' counts."""
    rng, outcomes = random.Random(seed), {"done": 0, "refused": 0}
    previous = signal.signal(signal.SIGALRM, _hang)
    try:
        for _ in range(tries):
            what = _mutate(folder, files, rng) if kinds is None else kinds(folder, files, rng)

            def read():
                try:
                    integrity.verify(folder)
                except CheckpointError as err:  # one line, naming the file
                    assert "\n" not in str(err) and str(folder) in str(err), f"{what}: {err}"
                    raise
                assert _same(checkpoint.read(folder), expected), f"{what}: read as good, with other values"

            signal.alarm(10)  # a hang fails the try
            outcomes[user_outcome(read, what)] += 1
            signal.alarm(0)
            for path in folder.iterdir():
                if path.name not in files:
                    path.unlink()
            for name, data in files.items():
                (folder / name).write_bytes(data)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    return outcomes


def test_mutated_checkpoints_are_read_exactly_or_refused_with_a_user_error(written):
    folder, files, expected = written
    outcomes = _fuzz(folder, files, expected, TRIES, seed=0)
    print(f"checkpoint fuzz: {TRIES} mutated checkpoints, {outcomes}")
    assert outcomes["refused"] > 0.9 * TRIES


def test_cut_checkpoints_written_before_digests_are_read_exactly_or_refused(written):
    """Without digests a flipped value cannot be told; a cut, emptied or removed file, or one more, is refused."""
    folder, files, expected = written
    meta = json.loads(files["meta.json"])
    old = {**files, "meta.json": json.dumps({k: v for k, v in meta.items() if k not in ("digests", "sealed")}).encode()}
    for name, data in old.items():
        (folder / name).write_bytes(data)

    def structural(folder, files, rng):
        while (what := _mutate(folder, files, rng)).startswith("flip"):
            (folder / what.split()[1]).write_bytes(files[what.split()[1]])
        return what

    try:
        outcomes = _fuzz(folder, old, expected, UNSEALED_TRIES, seed=1, kinds=structural)
    finally:
        for name, data in files.items():
            (folder / name).write_bytes(data)
    print(f"checkpoint fuzz without digests: {UNSEALED_TRIES} cut or grown checkpoints, {outcomes}")
    assert outcomes["refused"] > 0.6 * UNSEALED_TRIES  # a grown file or another file beside them reads exactly


def test_a_sealed_record_of_no_files_is_refused(tmp_path, written):
    """meta.json sealed anew over an empty list of digests, alone in its folder: nothing would be checked, and it is
    refused rather than passed."""
    folder = tmp_path / "step-1"
    folder.mkdir()
    meta = json.loads(written[1]["meta.json"])
    body = {key: value for key, value in meta.items() if key != integrity.SEALED} | {integrity.DIGESTS: {}}
    (folder / "meta.json").write_text(json.dumps({**body, integrity.SEALED: integrity.seal_of(body)}))
    with pytest.raises(CheckpointError, match="records no digest of .metadata"):
        integrity.verify(folder)
