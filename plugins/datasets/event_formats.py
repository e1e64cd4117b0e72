"""The raw event recordings of each data set, in the layout its publisher ships, read into tonic's events.

- ``n_mnist``: ``Train/<digit>/*.bin`` and ``Test/<digit>/*.bin`` (``train.zip`` and ``test.zip`` unpacked), read
  with tonic's reader.
- ``cifar10_dvs``: ``<class>/*.aedat`` (the ten class zips unpacked), AEDAT 2.0 decoded as SpikingJelly decodes
  it; the first tenth of each class by sample number tests (TEBN's split).
- ``dvs128_gesture``: ``DvsGesture/`` (``DvsGesture.tar.gz`` unpacked): AEDAT 3.1 trials, one sample per gesture
  span of their ``*_labels.csv``, split by ``trials_to_train.txt`` and ``trials_to_test.txt``.
- ``shd``: ``shd_train.h5`` and ``shd_test.h5`` (gunzipped), read as tonic's SHD reads them; ``ssc``:
  ``ssc_train.h5`` and ``ssc_test.h5`` alike (SSC's validation file is not read).

:data:`URLS` says where each is fetched from; nothing is downloaded.
"""

from __future__ import annotations

import functools
import re
import struct
from pathlib import Path
from typing import Callable

import attrs
import numpy as np

URLS = {
    "n_mnist": "https://www.garrickorchard.com/datasets/n-mnist (train.zip and test.zip, unzipped into data.root)",
    "cifar10_dvs": "https://figshare.com/articles/dataset/CIFAR10-DVS_New/4724671 (the ten class zips, unzipped "
                   "into data.root)",
    "dvs128_gesture": "https://research.ibm.com/interactive/dvsgesture/ (DvsGesture.tar.gz, unpacked into "
                      "data.root)",
    "shd": "https://zenkelab.org/datasets/ (shd_train.h5.gz and shd_test.h5.gz, gunzipped into data.root)",
    "ssc": "https://zenkelab.org/datasets/ (ssc_train.h5.gz and ssc_test.h5.gz, gunzipped into data.root)",
}


@attrs.frozen
class RawSet:
    """One publisher's layout: the recordings of a split, how to read one, and the sensor's (W, H, P)."""

    recordings: Callable[[Path, str], list[tuple[object, int]]]  # (root, split) -> [(recording, label)]
    read: Callable[[Path, object], np.ndarray]  # (root, recording) -> tonic's structured events
    sensor: tuple[int, int, int]
    fingerprint: Callable[[Path, str], list]  # (root, split) -> what the cache key covers of the raw files


def _file_stats(files: list[Path], root: Path) -> list:
    return [(str(f.relative_to(root)), f.stat().st_size, f.stat().st_mtime_ns) for f in files]


# N-MNIST: one .bin per sample in a folder named by its digit.
_NMNIST = {"train": "Train", "test": "Test"}


def _nmnist_files(root: Path, split: str) -> list[tuple[Path, int]]:
    folder = root / _NMNIST[split]
    digits = sorted(p for p in folder.iterdir() if p.is_dir() and p.name.isdigit()) if folder.is_dir() else []
    return [(f, int(d.name)) for d in digits for f in sorted(d.glob("*.bin"))]


def _nmnist_read(root: Path, path: Path) -> np.ndarray:
    from tonic.io import read_mnist_file

    return read_mnist_file(str(path), dtype=np.dtype([("x", int), ("y", int), ("t", int), ("p", int)]))


# CIFAR10-DVS: one AEDAT 2.0 file per sample in a folder named by its class; the first tenth of each class by
# sample number tests (TEBN's split, as the frames reader splits SpikingJelly's folders).
def tebn_split(classes: list[list[Path]], split: str) -> list[tuple[Path, int]]:
    """``(file, label)`` of ``split`` from each class's files: the first tenth by sample number tests."""
    samples = []
    for label, files in enumerate(classes):
        files = sorted(files, key=_number)
        cut = len(files) // 10
        samples += [(f, label) for f in (files[:cut] if split == "test" else files[cut:])]
    return samples


def _number(path: Path) -> tuple[int, str]:
    match = re.search(r"(\d+)$", path.stem)
    return (int(match.group(1)) if match else -1, path.name)


def _cifar10_dvs_files(root: Path, split: str) -> list[tuple[Path, int]]:
    classes = sorted(p for p in root.iterdir() if p.is_dir() and any(p.glob("*.aedat"))) if root.is_dir() else []
    return tebn_split([sorted(c.glob("*.aedat")) for c in classes], split)


def _cifar10_dvs_read(root: Path, path: Path) -> np.ndarray:
    """Decoded as SpikingJelly's CIFAR10DVS decodes the publisher's files (x and y mirrored, polarity flipped)."""
    from tonic.io import get_aer_events_from_file, make_structured_array, read_aedat_header_from_file

    version, start, _ = read_aedat_header_from_file(str(path))
    if (path.stat().st_size - start) % 8:
        raise ValueError("its events are cut: AEDAT 2.0 events are 8 bytes each")
    raw = get_aer_events_from_file(str(path), version, start)
    address, t = raw["address"].astype(np.int64), raw["timeStamp"].astype(np.int64)
    x, y, p = (address & 0xFE) >> 1, (address & 0x7F00) >> 8, address & 1
    return make_structured_array(127 - y, 127 - x, t, 1 - p)


# DVS128 Gesture: one AEDAT 3.1 file per trial (a user under a lighting), its gestures' classes and time spans in
# a CSV beside it; trials_to_train.txt and trials_to_test.txt list the trials of each split.
def _gesture_recordings(root: Path, split: str) -> list[tuple[tuple[Path, int, int], int]]:
    folder = root / "DvsGesture"
    listed = folder / f"trials_to_{split}.txt"
    if not listed.is_file():
        return []
    recordings = []
    for trial in listed.read_text().split():
        spans = np.loadtxt(folder / trial.replace(".aedat", "_labels.csv"), dtype=np.int64, delimiter=",",
                           skiprows=1, ndmin=2)
        recordings += [((folder / trial, start, end), int(label) - 1) for label, start, end in spans]
    return recordings


@functools.lru_cache(maxsize=2)  # a trial's gestures are read one after another
def _aedat3_polarity_events(path: Path) -> np.ndarray:
    """The polarity events (type 1) of an AEDAT 3.1 file, decoded as SpikingJelly's ``load_aedat_v3`` does."""
    from tonic.io import make_structured_array

    data = path.read_bytes()
    start = data.index(b"#!END-HEADER\r\n") + len(b"#!END-HEADER\r\n")
    packets, offset = [], start
    while offset < len(data):
        (kind,), (size,) = struct.unpack_from("<H", data, offset), struct.unpack_from("<I", data, offset + 4)
        overflow, capacity = struct.unpack_from("<II", data, offset + 12)
        body = offset + 28
        if body + capacity * size > len(data):
            raise ValueError("its last event packet is cut")
        if kind == 1:
            words = np.frombuffer(data, "<u4", capacity * size // 4, body).reshape(capacity, size // 4)
            packets.append((words[:, 0].astype(np.int64), words[:, 1].astype(np.int64) | int(overflow) << 31))
        offset = body + capacity * size
    address = np.concatenate([a for a, _ in packets]) if packets else np.zeros(0, np.int64)
    t = np.concatenate([t for _, t in packets]) if packets else np.zeros(0, np.int64)
    return make_structured_array((address >> 17) & 0x7FFF, (address >> 2) & 0x7FFF, t, (address >> 1) & 1)


def _gesture_read(root: Path, key: tuple[Path, int, int]) -> np.ndarray:
    path, start, end = key
    events = _aedat3_polarity_events(path)
    return events[(events["t"] >= start) & (events["t"] < end)]


def _gesture_files(root: Path, split: str) -> list[Path]:
    folder = root / "DvsGesture"
    trials = sorted({key[0] for key, _ in _gesture_recordings(root, split)})
    files = [folder / f"trials_to_{split}.txt", *trials, *(t.with_name(t.stem + "_labels.csv") for t in trials)]
    return [f for f in files if f.exists()]


# SHD and SSC: one HDF5 file per split, spike times in seconds and channel numbers per sample.
def _heidelberg(prefix: str) -> RawSet:
    def file(root: Path, split: str) -> Path:
        return root / f"{prefix}_{split}.h5"

    def recordings(root: Path, split: str) -> list[tuple[tuple[str, int], int]]:
        import h5py

        if not file(root, split).is_file():
            return []
        with h5py.File(file(root, split), "r") as opened:
            return [((split, index), int(label)) for index, label in enumerate(opened["labels"][()])]

    def read(root: Path, key: tuple[str, int]) -> np.ndarray:
        """As tonic's SHD reads a sample: times in microseconds, the channel as x, polarity 1."""
        import h5py
        from tonic.io import make_structured_array

        split, index = key
        with h5py.File(file(root, split), "r") as opened:
            times, units = opened["spikes/times"][index], opened["spikes/units"][index]
        return make_structured_array(times.astype(np.float64) * 1e6, units, 1,
                                     dtype=np.dtype([("t", int), ("x", int), ("p", int)]))

    return RawSet(recordings, read, (700, 1, 1), lambda root, split: _file_stats([file(root, split)], root))


SETS = {
    "n_mnist": RawSet(_nmnist_files, _nmnist_read, (34, 34, 2),
                      lambda root, split: _file_stats([f for f, _ in _nmnist_files(root, split)], root)),
    "cifar10_dvs": RawSet(_cifar10_dvs_files, _cifar10_dvs_read, (128, 128, 2),
                          lambda root, split: _file_stats([f for f, _ in _cifar10_dvs_files(root, split)], root)),
    "dvs128_gesture": RawSet(_gesture_recordings, _gesture_read, (128, 128, 2),
                             lambda root, split: _file_stats(_gesture_files(root, split), root)),
    "shd": _heidelberg("shd"),
    "ssc": _heidelberg("ssc"),
}


def holds_events(name: str, root: Path) -> bool:
    """Whether ``root`` holds data set ``name``'s raw recordings (of either split)."""
    return name in SETS and any(SETS[name].recordings(root, split) for split in ("train", "test"))
