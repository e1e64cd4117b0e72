"""Raw event recordings (:mod:`snnfw_plugins.datasets.event_formats` reads them) integrated into frames by tonic
and cached on disk.

Each recording becomes ``model.time_steps`` frames by ``tonic.transforms.ToFrame``, in bins of equal event
counts (``data.frames.by = "count"``: SpikingJelly's ``split_by="number"``, but for the last ``N % T`` events,
which SpikingJelly adds to its last frame and tonic leaves out) or of equal time (``"time"``),
after ``tonic.transforms.Denoise`` when ``data.frames.denoise_us`` is set. The frames of a split are written
once to ``data.cache`` (default ``data.root/.snnfw-frames``) under a key of those settings and of the raw files'
names, sizes and times; the first process to get there integrates them while the others wait on a file lock,
and later runs read the cache without opening a raw file. Frames are resized by area to the model's input.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import shutil
import sys
from pathlib import Path

import attrs
import numpy as np

from snnfw.api import TEMP_PREFIX, DataError
from snnfw_plugins.datasets.event_formats import SETS, URLS, BadRecording, holds_events, read

RAW_ONLY = ("frames", "cache", "bad_recordings")  # the [data] keys only raw recordings read
COUNTS = np.uint16  # per-pixel event counts of one frame, as cached


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
    skip = ["bad recordings skipped"] if config.bad_recordings == "skip" else []  # a run that refuses does not read a cache that skipped
    key = json.dumps([name, split, time_steps, attrs.asdict(config.frames), tonic.__version__,
                      SETS[name].fingerprint(root, split), *skip])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    base = Path(config.cache) if config.cache is not None else root / ".snnfw-frames"
    return base / f"{name}-{split}-T{time_steps}-{config.frames.by}-{digest}"


def cached_frames(config, name: str, split: str, time_steps: int) -> tuple[np.ndarray, np.ndarray]:
    """The split's frames ``[N, T, P, H, W]`` (memory-mapped) and labels, integrated once and cached."""
    if config.frames.denoise_us is not None and SETS[name].sensor[1] == 1:
        raise DataError(f"data.frames.denoise_us drops events without a neighbour in the pixel grid, and {name} "
                        "records channels, not pixels; remove it")
    folder = cache_folder(config, name, split, time_steps)
    lock_path = folder.parent / f".{folder.name}.lock"
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        lock = open(lock_path, "w")
    except OSError as err:
        raise DataError(f"cannot write the frames cache in {folder.parent} ({err.strerror}); set data.cache to a "
                        "folder you can write") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the first process integrates; the others wait, then read
        if not (folder / "labels.npy").exists():
            try:
                _integrate(config, name, split, time_steps, folder)
            except BaseException:  # refused or stopped: nothing half-made stays in the cache
                lock_path.unlink(missing_ok=True)
                with contextlib.suppress(OSError):
                    folder.parent.rmdir()  # only if it is empty
                raise
    if (skipped := folder / SKIPPED).exists():
        _say_skipped(name, split, skipped.read_text().splitlines())
    return np.load(folder / "frames.npy", mmap_mode="r"), np.load(folder / "labels.npy")


SKIPPED = "skipped.txt"  # in a cache made with data.bad_recordings = "skip": the recordings left out, one a line
KEPT = "kept.npy"  # and the listing's positions of those cached


def _say_skipped(name: str, split: str, skipped: list[str]) -> None:
    print(f"[snnfw] {name} {split}: {len(skipped)} recordings left out as not as their publisher ships them "
          f'(data.bad_recordings = "skip"; listed in the cache\'s {SKIPPED}), the first: {skipped[0]}',
          file=sys.stderr, flush=True)


def _integrate(config, name: str, split: str, time_steps: int, folder: Path) -> None:
    raw, root = SETS[name], Path(config.root)
    recordings = raw.recordings(root, split)
    if not recordings:
        raise DataError(f"{root} holds no {split} recordings of {name}; get them from {URLS[name]}")
    width, height, polarities = raw.sensor
    print(f"[snnfw] {name} {split}: integrating {len(recordings)} recordings into frames in {folder} (once)",
          file=sys.stderr, flush=True)
    temp = folder.with_name(f"{TEMP_PREFIX}{folder.name}")
    temp.mkdir(parents=True, exist_ok=True)
    try:
        labels, skipped = _write_frames(config, name, recordings, temp, (time_steps, polarities, height, width))
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    np.save(temp / "labels.npy", np.array(labels, dtype=np.int64))
    if skipped:
        (temp / SKIPPED).write_text("".join(f"{line}\n" for line in skipped))
    with contextlib.suppress(FileNotFoundError):
        for stale in folder.iterdir():
            stale.unlink()
        folder.rmdir()
    temp.rename(folder)


def _write_frames(config, name: str, recordings: list, temp: Path, shape: tuple) -> tuple[list[int], list[str]]:
    """Writes ``temp/frames.npy``; returns the labels of the recordings written, and what was wrong with those left
    out (with ``data.bad_recordings = "skip"``, whose positions in the listing go to ``temp/KEPT``; otherwise the
    first bad one is refused)."""
    root, labels, kept, skipped = Path(config.root), [], [], []
    frames = np.lib.format.open_memmap(temp / "frames.npy", mode="w+", dtype=COUNTS, shape=(len(recordings), *shape))
    for position, (recording, label) in enumerate(recordings):
        try:
            events = read(name, root, recording)
        except BadRecording as bad:
            if config.bad_recordings != "skip":
                raise DataError(f'{bad}; or set data.bad_recordings = "skip" to leave out such recordings') from None
            skipped.append(str(bad).partition("; get it again")[0])
            continue
        frames[len(labels)] = np.clip(to_frames(events, SETS[name].sensor, shape[0], config.frames), 0,
                                      np.iinfo(COUNTS).max)
        labels.append(label)
        kept.append(position)
    if not labels:
        raise DataError(f"none of the {len(recordings)} recordings of {name} in {root} is as its publisher ships it "
                        f"(the first: {skipped[0]}); get them again from {URLS[name]}")
    if skipped:  # the frames written, in a file of their own size
        written = np.lib.format.open_memmap(temp / "written.npy", mode="w+", dtype=COUNTS, shape=(len(labels), *shape))
        for index in range(len(labels)):
            written[index] = frames[index]
        written.flush()
        del written
        np.save(temp / KEPT, np.array(kept, dtype=np.int64))
    frames.flush()
    del frames
    if skipped:
        (temp / "written.npy").replace(temp / "frames.npy")
    return labels, skipped


def kept_positions(config, name: str, split: str, time_steps: int) -> np.ndarray | None:
    """Where in the split's listing each cached sample's recording is, when bad ones were left out (else None)."""
    kept = cache_folder(config, name, split, time_steps) / KEPT
    return np.load(kept) if kept.exists() else None


class CachedFrames:
    """``(frames [T, C, H, W] float, label)`` from a split's cached counts, resized to the model's input; with
    event augmentation, from the recording's events (:meth:`with_events`)."""

    def __init__(self, frames: np.ndarray, labels: np.ndarray, size: tuple[int, int], name: str, split: str, config,
                 kept: np.ndarray | None = None):
        self.frames, self.labels, self.size, self.name, self.split, self.config = frames, labels, size, name, split, config
        self.kept, self._recordings = kept, None  # kept: the listing's positions of the samples, when some were left out

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
        events = read(self.name, root, self._recordings[index if self.kept is None else int(self.kept[index])])
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
    return CachedFrames(frames, labels, tuple(spec.shape[1:]), name, split, config,
                        kept_positions(config, name, split, spec.time_steps))


def builder(name: str):
    """The DatasetSpec builder of a set read only as raw recordings."""

    def build(config, spec, split, seed):
        if config.root is None or not holds_events(name, Path(config.root)):
            raise DataError(f"data set {name} reads its raw recordings from data.root, and "
                            + ("it is not set" if config.root is None else f"{config.root} holds none")
                            + f"; get them from {URLS[name]}")
        return build_raw(name, config, spec, split)

    return build
