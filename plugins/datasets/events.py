"""Raw event recordings in the layout their publishers ship, integrated into frames by tonic and cached on disk.

==============  ==================================================  =============================================
``data.name``   ``data.root`` holds                                 fetched by hand from
==============  ==================================================  =============================================
``n_mnist``     ``Train/<digit>/*.bin`` and ``Test/<digit>/*.bin``  :data:`URLS` (``train.zip``, ``test.zip``)
``cifar10_dvs`` ``<class>/*.aedat`` (the ten class zips, unpacked)  :data:`URLS`; split as TEBN splits it
``dvs128_gesture`` ``DvsGesture/`` (``DvsGesture.tar.gz`` unpacked):   :data:`URLS`; one sample per labelled
                ``user*.aedat``, ``*_labels.csv``, ``trials_to_*.txt``  gesture, split by the trials files
``shd``         ``shd_train.h5`` and ``shd_test.h5`` (gunzipped)    :data:`URLS`
==============  ==================================================  =============================================

Each recording becomes ``model.time_steps`` frames by ``tonic.transforms.ToFrame``, in bins of equal event
counts (``data.frames.by = "count"``, SpikingJelly's ``split_by="number"``) or of equal time (``"time"``),
after ``tonic.transforms.Denoise`` when ``data.frames.denoise_us`` is set. The frames of a split are written
once to ``data.cache`` (default ``data.root/.snnfw-frames``) under a key of those settings and of the raw files'
names, sizes and times; the first process to get there integrates them while the others wait on a file lock,
and later runs read the cache without opening a raw file. Frames are resized by area to the model's input.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import re
import struct
import sys
from pathlib import Path
from typing import Callable

import attrs
import numpy as np

from snnfw import rundir
from snnfw.errors import DataError

URLS = {
    "n_mnist": "https://www.garrickorchard.com/datasets/n-mnist (train.zip and test.zip, unzipped into data.root)",
    "cifar10_dvs": "https://figshare.com/articles/dataset/CIFAR10-DVS_New/4724671 (the ten class zips, unzipped "
                   "into data.root)",
    "dvs128_gesture": "https://research.ibm.com/interactive/dvsgesture/ (DvsGesture.tar.gz, unpacked into "
                      "data.root)",
    "shd": "https://zenkelab.org/datasets/ (shd_train.h5.gz and shd_test.h5.gz, gunzipped into data.root)",
}
RAW_ONLY = ("frames", "cache")  # the [data] keys only raw recordings read
COUNTS = np.uint16  # per-pixel event counts of one frame, as cached


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
    return _xytp((address >> 17) & 0x7FFF, (address >> 2) & 0x7FFF, t, (address >> 1) & 1)


def _gesture_read(root: Path, key: tuple[Path, int, int]) -> np.ndarray:
    path, start, end = key
    events = _aedat3_polarity_events(path)
    return events[(events["t"] >= start) & (events["t"] < end)]


def _gesture_files(root: Path, split: str) -> list[Path]:
    folder = root / "DvsGesture"
    trials = sorted({key[0] for key, _ in _gesture_recordings(root, split)})
    files = [folder / f"trials_to_{split}.txt", *trials, *(t.with_name(t.stem + "_labels.csv") for t in trials)]
    return [f for f in files if f.exists()]


def _xytp(x, y, t, p) -> np.ndarray:
    events = np.zeros(len(t), dtype=np.dtype([("x", int), ("y", int), ("t", int), ("p", int)]))
    events["x"], events["y"], events["t"], events["p"] = x, y, t, p
    return events


# SHD: one HDF5 file per split, spike times in seconds and channel numbers per sample.
def _shd_file(root: Path, split: str) -> Path:
    return root / f"shd_{split}.h5"


def _shd_recordings(root: Path, split: str) -> list[tuple[tuple[str, int], int]]:
    import h5py

    path = _shd_file(root, split)
    if not path.is_file():
        return []
    with h5py.File(path, "r") as file:
        return [((split, index), int(label)) for index, label in enumerate(file["labels"][()])]


def _shd_read(root: Path, key: tuple[str, int]) -> np.ndarray:
    """As tonic's SHD reads a sample: times in microseconds, the channel as x, polarity 1."""
    import h5py
    from tonic.io import make_structured_array

    split, index = key
    with h5py.File(_shd_file(root, split), "r") as file:
        times, units = file["spikes/times"][index], file["spikes/units"][index]
    return make_structured_array(times.astype(np.float64) * 1e6, units, 1,
                                 dtype=np.dtype([("t", int), ("x", int), ("p", int)]))


SETS = {
    "n_mnist": RawSet(_nmnist_files, _nmnist_read, (34, 34, 2),
                      lambda root, split: _file_stats([f for f, _ in _nmnist_files(root, split)], root)),
    "cifar10_dvs": RawSet(_cifar10_dvs_files, _cifar10_dvs_read, (128, 128, 2),
                          lambda root, split: _file_stats([f for f, _ in _cifar10_dvs_files(root, split)], root)),
    "dvs128_gesture": RawSet(_gesture_recordings, _gesture_read, (128, 128, 2),
                             lambda root, split: _file_stats(_gesture_files(root, split), root)),
    "shd": RawSet(_shd_recordings, _shd_read, (700, 1, 1),
                  lambda root, split: _file_stats([_shd_file(root, split)], root)),
}


def holds_events(name: str, root: Path) -> bool:
    """Whether ``root`` holds data set ``name``'s raw recordings (of either split)."""
    return name in SETS and any(SETS[name].recordings(root, split) for split in ("train", "test"))


def to_frames(events: np.ndarray, sensor: tuple[int, int, int], time_steps: int, frames) -> np.ndarray:
    """One recording's ``[T, P, H, W]`` event counts: tonic's Denoise (when set), then tonic's ToFrame."""
    from tonic.transforms import Denoise, ToFrame

    if frames.denoise_us is not None:
        events = Denoise(filter_time=frames.denoise_us)(events)
    bins = {"n_time_bins": time_steps} if frames.by == "time" else {"n_event_bins": time_steps}
    counts = ToFrame(sensor_size=sensor, **bins)(events)
    width, height, polarities = sensor
    return counts.reshape(time_steps, polarities, height, width)


def cache_folder(config, name: str, split: str, time_steps: int) -> Path:
    """The cache of a split's frames: its folder is named by the settings and the raw files it was made from."""
    import tonic

    root = Path(config.root)
    key = json.dumps([name, split, time_steps, attrs.asdict(config.frames), tonic.__version__,
                      SETS[name].fingerprint(root, split)])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    base = Path(config.cache) if config.cache is not None else root / ".snnfw-frames"
    return base / f"{name}-{split}-T{time_steps}-{config.frames.by}-{digest}"


def cached_frames(config, name: str, split: str, time_steps: int) -> tuple[np.ndarray, np.ndarray]:
    """The split's frames ``[N, T, P, H, W]`` (memory-mapped) and labels, integrated once and cached."""
    if config.frames.denoise_us is not None and SETS[name].sensor[1] == 1:
        raise DataError(f"data.frames.denoise_us drops events without a neighbour in the pixel grid, and {name} "
                        "records channels, not pixels; remove it")
    folder = cache_folder(config, name, split, time_steps)
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        lock = open(folder.parent / f".{folder.name}.lock", "w")
    except OSError as err:
        raise DataError(f"cannot write the frames cache in {folder.parent} ({err.strerror}); set data.cache to a "
                        "folder you can write") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the first process integrates; the others wait, then read
        if not (folder / "labels.npy").exists():
            _integrate(config, name, split, time_steps, folder)
    return np.load(folder / "frames.npy", mmap_mode="r"), np.load(folder / "labels.npy")


def _integrate(config, name: str, split: str, time_steps: int, folder: Path) -> None:
    raw, root = SETS[name], Path(config.root)
    recordings = raw.recordings(root, split)
    if not recordings:
        raise DataError(f"{root} holds no {split} recordings of {name}; get them from {URLS[name]}")
    width, height, polarities = raw.sensor
    print(f"[snnfw] {name} {split}: integrating {len(recordings)} recordings into frames in {folder} (once)",
          file=sys.stderr, flush=True)
    temp = folder.with_name(f"{rundir.TEMP}{folder.name}")
    temp.mkdir(parents=True, exist_ok=True)
    frames = np.lib.format.open_memmap(temp / "frames.npy", mode="w+", dtype=COUNTS,
                                       shape=(len(recordings), time_steps, polarities, height, width))
    for index, (recording, _) in enumerate(recordings):
        try:
            events = raw.read(root, recording)
        except (OSError, ValueError, KeyError, AssertionError, NotImplementedError) as err:
            raise DataError(f"{recording} is not a {name} recording as its publisher ships it ({err}); get it "
                            f"again from {URLS[name]}") from None
        counts = to_frames(events, raw.sensor, time_steps, config.frames)
        frames[index] = np.clip(counts, 0, np.iinfo(COUNTS).max)
    frames.flush()
    del frames
    np.save(temp / "labels.npy", np.array([label for _, label in recordings], dtype=np.int64))
    with contextlib.suppress(FileNotFoundError):
        for stale in folder.iterdir():
            stale.unlink()
        folder.rmdir()
    temp.rename(folder)


class CachedFrames:
    """``(frames [T, C, H, W] float, label)`` from a split's cached counts, resized to the model's input; with
    event augmentation, from the recording's events (:meth:`with_events`)."""

    def __init__(self, frames: np.ndarray, labels: np.ndarray, size: tuple[int, int], name: str, split: str, config):
        self.frames, self.labels, self.size, self.name, self.split, self.config = frames, labels, size, name, split, config
        self._recordings = None

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        import torch

        frames = torch.from_numpy(np.asarray(self.frames[index], dtype=np.float32))
        return resize(frames, self.size), int(self.labels[index])

    def time_slice(self, index: int, start: int, stop: int):
        """Time steps ``start`` to ``stop`` of sample ``index``, read alone from the cache."""
        import torch

        frames = torch.from_numpy(np.asarray(self.frames[index, start:stop], dtype=np.float32))
        return resize(frames, self.size), int(self.labels[index])

    def with_events(self, index: int, names: tuple[str, ...], options: dict, seed: int):
        """Sample ``index`` integrated again from its recording's events after tonic's transforms ``names``,
        their random draws seeded by ``seed``."""
        import torch

        raw, root = SETS[self.name], Path(self.config.root)
        if self._recordings is None:
            self._recordings = [recording for recording, _ in raw.recordings(root, self.split)]
        events = raw.read(root, self._recordings[index])
        with _numpy_seeded(seed):
            for name in names:
                events = _event_transform(name, raw.sensor, options)(events)
        counts = to_frames(events, raw.sensor, self.frames.shape[1], self.config.frames)
        return resize(torch.from_numpy(counts.astype(np.float32)), self.size), int(self.labels[index])


def _event_transform(name: str, sensor: tuple[int, int, int], options: dict):
    from tonic.transforms import DropEvent, SpatialJitter, TimeJitter

    if name == "drop_event":
        return DropEvent(p=options["drop_event_p"])
    if name == "time_jitter":
        return TimeJitter(std=options["time_jitter_us"], clip_negative=True, sort_timestamps=True)
    return SpatialJitter(sensor_size=sensor, var_x=options["spatial_jitter_px"], var_y=options["spatial_jitter_px"],
                         clip_outliers=True)


@contextlib.contextmanager
def _numpy_seeded(seed: int):
    """tonic's transforms draw from numpy's global generator: seeded here, and restored after."""
    state = np.random.get_state()
    np.random.seed(seed % 2**32)
    try:
        yield
    finally:
        np.random.set_state(state)


def resize(frames, size: tuple[int, int]):
    """``[T, C, H, W]`` resized by area to ``size`` (unchanged if it already has it)."""
    import torch.nn.functional as F

    return frames if tuple(frames.shape[-2:]) == size else F.interpolate(frames, size=size, mode="area")


def build_raw(name: str, config, spec, split: str) -> CachedFrames:
    """Data set ``name``'s ``split`` from the raw recordings in ``data.root``."""
    frames, labels = cached_frames(config, name, split, spec.time_steps)
    channels = frames.shape[2]
    if channels != spec.shape[0]:
        raise DataError(f"{name} frames have {channels} channels (its sensor's polarities) and the model takes "
                        f"{spec.shape[0]}; choose a model that takes {channels} (a model of your own: "
                        f"model.input_shape = [{channels}, H, W])")
    if (classes := int(labels.max()) + 1) > spec.num_classes:
        raise DataError(f"{name} has {classes} classes, but the model has {spec.num_classes} outputs; set "
                        f"model.num_classes = {classes}")
    if "spatial_jitter" in config.augment and SETS[name].sensor[1] == 1:
        raise DataError(f"data.augment's 'spatial_jitter' moves events in the pixel grid, and {name} records "
                        "channels, not pixels; remove it")
    return CachedFrames(frames, labels, tuple(spec.shape[1:]), name, split, config)


def builder(name: str):
    """The DatasetSpec builder of a set read only as raw recordings."""

    def build(config, spec, split, seed):
        if config.root is None or not holds_events(name, Path(config.root)):
            raise DataError(f"data set {name} reads its raw recordings from data.root, and "
                            + ("it is not set" if config.root is None else f"{config.root} holds none")
                            + f"; get them from {URLS[name]}")
        return build_raw(name, config, spec, split)

    return build
