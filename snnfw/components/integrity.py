"""What makes a checkpoint whole, checked before it is read.

When a checkpoint is written, every rank records the CRC-32 of each file it
wrote, read back once written (in the background with ``checkpoint.async_save``;
from the page cache, 28 ms for the 112 MB of the full VGG's state where SHA-256
took 66 ms); rank 0 adds ``.metadata``'s and writes them into ``meta.json``
(``digests``), which is sealed by the SHA-256 of its own content (``sealed``).
Before a checkpoint is read, :func:`verify` checks ``meta.json``, that the
folder holds the files it lists and no other ``.distcp`` file, and each file's
digest. A checkpoint written without digests is checked as far as DCP's own
``.metadata`` allows (every file it names there, long enough, and no other
``.distcp`` file) and read with a note.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import sys
import zlib
from pathlib import Path

from torch.distributed.checkpoint import FileSystemWriter

from snnfw.errors import CheckpointError
from snnfw.components.dcp_reader import metadata_of
from snnfw.rundir import LAUNCHED, STEP_META, TEMP_PREFIX, checkpoint_step, is_checkpoint_name

DIGESTS = "digests"  # in meta.json: {file name: "crc32:HEX"}
ALGORITHMS = ("crc32", "sha256")
SEALED = "sealed"  # in meta.json: the SHA-256 of the rest of it, as canonical JSON
RECORD = "digests.json"  # a rank's digests, beside its files until rank 0 writes meta.json
UNSEALED_KEYS = {"step", "loss", "fixed", "strategy", "world_size", "loss_scale"}  # meta.json without digests


def file_digest(path: Path, algorithm: str = "crc32") -> str:
    """``ALGORITHM:HEX``, the digest of the file's bytes: zlib's ``crc32`` or ``sha256``."""
    with open(path, "rb") as stream:
        size = os.fstat(stream.fileno()).st_size
        with mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_READ) if size else contextlib.nullcontext(b"") as data:
            value = f"{zlib.crc32(data):08x}" if algorithm == "crc32" else hashlib.new(algorithm, data).hexdigest()
    return f"{algorithm}:{value}"


def seal_of(meta: dict) -> str:
    """The seal of ``meta.json``'s content ``meta`` (without the seal itself)."""
    return hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()


class DigestingWriter(FileSystemWriter):
    """DCP's file writer, which also records the digest of each file this rank wrote in ``.__R_digests.json``."""

    def write_data(self, plan, planner):
        written = super().write_data(plan, planner)
        names = sorted({result.storage_data.relative_path for result in written.wait()})
        digests = {name: file_digest(Path(self.path) / name) for name in names}
        (Path(self.path) / f".{plan.storage_data.prefix}{RECORD}").write_text(json.dumps(digests))
        return written


def seal(folder: Path, meta: dict) -> dict:
    """``meta`` with the digests of every file in ``folder`` (the ranks' records, which it removes, and
    ``.metadata``) and its seal: what rank 0 writes as ``meta.json`` once every rank has written."""
    digests = {}
    for record in sorted(folder.glob(f".__*_{RECORD}")):
        digests.update(json.loads(record.read_text()))
        record.unlink()
    digests[".metadata"] = file_digest(folder / ".metadata")
    body = {**meta, DIGESTS: dict(sorted(digests.items()))}
    return {**body, SEALED: seal_of(body)}


class Damaged(CheckpointError):
    """A checkpoint that is not what was written; ``reason`` names the file and what is wrong with it."""

    def __init__(self, folder: Path, reason: str):
        self.folder, self.reason = folder, reason
        super().__init__(f"{_step(folder)} is damaged: {reason}; restore it from a copy, or remove {folder} to use "
                         "an earlier checkpoint")


def _numbered(folder: Path) -> bool:
    return is_checkpoint_name(folder.name)


def _step(folder: Path) -> str:
    return f"checkpoint step {checkpoint_step(folder)}" if _numbered(folder) else f"checkpoint {folder}"


def verify(folder: Path) -> dict:
    """The ``meta.json`` of checkpoint ``folder`` once the folder is checked whole; refuses it naming the file."""
    folder = Path(folder)
    where = folder / STEP_META
    try:
        meta = json.loads(where.read_bytes())
    except FileNotFoundError:
        raise Damaged(folder, f"{where} is missing") from None
    except (OSError, ValueError, RecursionError) as err:
        raise Damaged(folder, f"{where} cannot be read ({type(err).__name__}: cut or corrupt)") from None
    if not isinstance(meta, dict):
        raise Damaged(folder, f"{where} is not a snnfw checkpoint's record")
    if DIGESTS in meta or SEALED in meta:
        _check_sealed(folder, meta)
    else:
        _check_unsealed(folder, meta)
    return meta


def _check_sealed(folder: Path, meta: dict) -> None:
    where, body = folder / STEP_META, {k: v for k, v in meta.items() if k != SEALED}
    if meta.get(SEALED) != seal_of(body) or not isinstance(meta.get(DIGESTS), dict):
        raise Damaged(folder, f"{where} does not match its seal (corrupt)")
    if _numbered(folder) and meta.get("step") != checkpoint_step(folder):
        raise Damaged(folder, f"{where} is step {meta.get('step')}'s, not this folder's (moved from another "
                              "checkpoint)")
    listed = meta[DIGESTS]
    if ".metadata" not in listed:  # every checkpoint has its index: a record of none would check nothing
        raise Damaged(folder, f"{where} records no digest of .metadata, the checkpoint's index, so it checks nothing")
    present = {p.name for p in folder.glob("*.distcp")} | ({".metadata"} & {p.name for p in folder.iterdir()})
    missing, extra = sorted(listed.keys() - present), sorted(present - listed.keys())
    if missing:
        raise Damaged(folder, f"{folder / missing[0]} is missing")
    if extra:
        raise Damaged(folder, f"{folder / extra[0]} is not one of the files it was written with")
    algorithms = {name: str(digest).partition(":")[0] for name, digest in listed.items()}
    unknown = sorted(set(algorithms.values()) - set(ALGORITHMS))
    if unknown:
        raise Damaged(folder, f"{where} records digests by {unknown[0]!r}, which this snnfw does not know")
    differ = [name for name in sorted(listed) if file_digest(folder / name, algorithms[name]) != listed[name]]
    if len(listed) > 1 and len(differ) == len(listed):
        raise Damaged(folder, f"{where} records the digests of other files than these (it is another checkpoint's)")
    if differ:
        raise Damaged(folder, f"{folder / differ[0]} does not match the digest recorded when it was written (corrupt "
                              "or cut)")


def _check_unsealed(folder: Path, meta: dict) -> None:
    """A checkpoint written before digests: its record's keys, and the files DCP's ``.metadata`` names."""
    where = folder / STEP_META
    if not (meta.keys() <= UNSEALED_KEYS and isinstance(meta.get("step"), int) and isinstance(meta.get("fixed"), dict)):
        raise Damaged(folder, f"{where} is not a snnfw checkpoint's record (foreign or corrupt)")
    if _numbered(folder) and meta["step"] != checkpoint_step(folder):
        raise Damaged(folder, f"{where} is step {meta['step']}'s, not this folder's (moved from another checkpoint)")
    try:
        metadata = metadata_of(folder)
        extents = {}
        for info in metadata.storage_data.values():
            extents[info.relative_path] = max(extents.get(info.relative_path, 0), info.offset + info.length)
    except FileNotFoundError:
        raise Damaged(folder, f"{folder / '.metadata'} is missing") from None
    except Exception as err:  # noqa: BLE001: whatever a cut or corrupt pickle raises
        why = (str(err).strip().splitlines() or ["cut or corrupt"])[0][:200]
        raise Damaged(folder, f"{folder / '.metadata'} cannot be read ({type(err).__name__}: {why})") from None
    for name, end in sorted(extents.items()):
        size = (folder / name).stat().st_size if (folder / name).is_file() else None
        if size is None:
            raise Damaged(folder, f"{folder / name} is missing")
        if size < end:
            raise Damaged(folder, f"{folder / name} is cut ({size:,} of at least {end:,} bytes)")
    for path in sorted(folder.glob("*.distcp")):
        if path.name not in extents:
            raise Damaged(folder, f"{path} is not one of the files it was written with")


def unsealed_note(folder: Path) -> str:
    return (f"{_step(folder)} was written without digests (by an earlier snnfw), so its files are checked for presence "
            "and length only")


def newest_whole(root: Path, say=None) -> tuple[Path, dict] | None:
    """The newest whole checkpoint in ``root`` and its ``meta.json`` (None when there is none); newer ones that are
    damaged or were not completed are passed over, saying so in one line through ``say``. Refuses when every
    checkpoint is damaged, naming the newest's fault."""
    root, found = Path(root), []
    for path in root.iterdir() if root.is_dir() else ():
        name = path.name.removeprefix(TEMP_PREFIX)
        if is_checkpoint_name(name):
            found.append((checkpoint_step(Path(name)), path.name == name, path))
    passed, damaged = [], None
    for step, named, folder in sorted(found, key=lambda item: item[:2], reverse=True):
        if not named:
            passed.append(f"step {step} was not completed ({folder} was being written when its run stopped)")
            continue
        try:
            meta = verify(folder)
        except Damaged as err:
            passed.append(f"{_step(folder)} is damaged: {err.reason}")
            damaged = damaged or err
            continue
        if passed and say is not None:
            say(f"{'; '.join(passed)}; using step {step}, the newest whole checkpoint")
        return folder, meta
    if damaged is not None:
        raise CheckpointError(f"{_step(damaged.folder)} is damaged: {damaged.reason}, and no checkpoint before it is "
                              "whole; restore it from a copy, or start over")
    return None


def note(text: str) -> None:
    """A note on stderr from the process the user started: not again from the ranks that ``snnfw`` launched."""
    if not os.environ.get(LAUNCHED) and os.environ.get("RANK", "0") == "0":
        print(f"[snnfw] note: {text}", file=sys.stderr, flush=True)
