"""``cifar10_dvs``, ``dvs128_gesture``, ``n_mnist``, ``shd``, ``ssc``: event frames in SpikingJelly's on-disk layout, or the
raw recordings as their publishers ship them (integrated by tonic: :mod:`snnfw_plugins.datasets.events`);
``n_caltech101``, ``asl_dvs``, ``dvs_lip``: their publishers' raw recordings only.

``data.root`` is the ``root`` given to SpikingJelly's class (``CIFAR10DVS``,
``DVS128Gesture``, ``NMNIST`` in ``spikingjelly.datasets``), which, built with
``data_type="frame", frames_number=T, split_by="number"`` (or ``"time"``),
integrates the events into ``root/frames_number_T_split_by_number/``:
``train/<class>/*.npz`` and ``test/<class>/*.npz``, each holding ``frames``
``[T, 2, H, W]`` of event counts. CIFAR10-DVS has no official split: its
``<class>/*.npz`` are split as TEBN does (the first tenth of each class by
sample number for testing), unless ``train``/``test`` folders exist. This
plugin reads that layout with numpy, since SpikingJelly's classes need
torchvision: T is ``model.time_steps``, classes are numbered in sorted folder
order as torchvision's DatasetFolder numbers them, and frames are resized by
area to the model's input size.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np

from snnfw import hookimpl
from snnfw.api import DataError, DatasetSpec, Frames
from snnfw_plugins.datasets import events
from snnfw_plugins.datasets.event_formats import URLS, holds_events, tebn_split
from snnfw_plugins.datasets.events import resize

EXTENSIONS = (".npz", ".npy")
ON_DISK_UNREAD = ("train_samples", "test_samples")  # an on-disk set has the samples its files hold
SETS = {  # SpikingJelly's class, description, classes, one time step's (C, H, W)
    "cifar10_dvs": ("CIFAR10DVS", "CIFAR10-DVS, 10 classes of 128x128 event frames", 10, (2, 128, 128)),
    "dvs128_gesture": ("DVS128Gesture", "DVS128 Gesture, 11 classes of 128x128 event frames", 11, (2, 128, 128)),
    "n_mnist": ("NMNIST", "N-MNIST, 10 classes of 34x34 event frames", 10, (2, 34, 34)),
}


RAW_ONLY_SETS = (  # read from their publishers' files only: name, description, classes, one time step's (C, H, W)
    ("n_caltech101", "N-Caltech101, 101 classes of 180x240 event frames", 101, (2, 180, 240)),
    ("asl_dvs", "ASL-DVS, 24 letters of 180x240 event frames", 24, (2, 180, 240)),
    ("dvs_lip", "DVS-Lip, 100 words of 128x128 event frames", 100, (2, 128, 128)),
)


def load_frames(path: Path) -> np.ndarray:
    """The frames array of one sample file, without unpickling anything."""
    if path.suffix == ".npy":
        return np.load(path)
    with np.load(path) as archive:
        return archive["frames"]


class FrameFolder:
    """``(frames [T, C, H, W] float, label)`` from one file per sample."""

    def __init__(self, samples: list[tuple[Path, int]], size: tuple[int, int]):
        self.samples, self.size = samples, size

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        import torch

        path, label = self.samples[index]
        frames = torch.from_numpy(load_frames(path).astype(np.float32))
        return resize(frames, self.size), label


def _classes(folder: Path) -> list[Path]:
    return sorted((p for p in folder.iterdir() if p.is_dir()), key=lambda p: p.name)


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.suffix in EXTENSIONS)


def _samples(frames_root: Path, split: str) -> tuple[Path, list[tuple[Path, int]]]:
    """The folder read and its (file, label) pairs: a ``split`` folder, or TEBN's split of class folders."""
    if (frames_root / split).is_dir():
        folder = frames_root / split
        return folder, [(f, label) for label, c in enumerate(_classes(folder)) for f in _files(c)]
    return frames_root, tebn_split([_files(c) for c in _classes(frames_root)], split)


def _check_first(path: Path, spec) -> None:
    try:
        shape = load_frames(path).shape
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as err:
        raise DataError(f"{path} is not a frames file (.npz with an array 'frames', or .npy): {err}") from None
    expected = (spec.time_steps, spec.shape[0])
    if len(shape) != 4 or shape[:2] != expected:
        raise DataError(
            f"{path} holds frames of shape {tuple(shape)}; expected [T={expected[0]}, C={expected[1]}, H, W] "
            "(T is model.time_steps, C the model's input channels)"
        )


def builder(name: str):
    """The DatasetSpec builder of data set ``name`` (one of ``SETS``)."""
    class_name = SETS[name][0]

    def build(config, spec, split, seed):
        made_by = f"spikingjelly.datasets.{class_name}(root, data_type='frame', frames_number={spec.time_steps}, split_by='number')"
        raw = f"the raw recordings from {URLS[name]}" if name in URLS else ""
        if config.root is None:
            raise DataError(f"data set {name} reads SpikingJelly's frames from data.root; set it to the root given to "
                            f"{made_by}"
                            + (f", or to a folder of {raw}" if raw else ""))
        root = Path(config.root)
        if holds_events(name, root):
            return events.build_raw(name, config, spec, split)
        candidates = [root / f"frames_number_{spec.time_steps}_split_by_{by}" for by in ("number", "time")]
        frames_root = next((p for p in candidates if p.is_dir()), None)
        if frames_root is None:
            raise DataError(
                f"{candidates[0]} does not exist: data set {name} expects the frames of model.time_steps = "
                f"{spec.time_steps} that {made_by} writes, as <split>/<class>/*.npz" + (f"; or {raw}" if raw else "")
            )
        if config.frames != Frames() or config.cache is not None or config.bad_recordings != "refuse":
            raise DataError(f"data.frames, data.cache and data.bad_recordings apply to raw recordings, and {root} "
                            "holds SpikingJelly's frames, integrated already; remove them")
        folder, samples = _samples(frames_root, split)
        if not samples:
            raise DataError(f"{folder} holds no {split} samples: expected {split}/<class>/*.npz frame files")
        classes = max(label for _, label in samples) + 1
        if classes > spec.num_classes:
            raise DataError(f"{folder} has {classes} classes, but the model has {spec.num_classes} outputs; set "
                            f"model.num_classes = {classes}")
        _check_first(samples[0][0], spec)
        return FrameFolder(samples, tuple(spec.shape[1:]))

    return build


@hookimpl
def snnfw_register_datasets(register):
    for name, (_, description, classes, shape) in SETS.items():
        register(name, DatasetSpec(builder(name), description, ON_DISK_UNREAD, classes, shape),
                 "SpikingJelly's frames or the raw recordings in data.root")
    register("shd", DatasetSpec(events.builder("shd"), "Spiking Heidelberg Digits, 20 classes of 700-channel spike "
                                "trains", ON_DISK_UNREAD, 20, (1, 1, 700)), "the raw recordings in data.root")
    register("ssc", DatasetSpec(events.builder("ssc"), "Spiking Speech Commands, 35 classes of 700-channel spike "
                                "trains", ON_DISK_UNREAD, 35, (1, 1, 700)), "the raw recordings in data.root")
    for name, description, classes, shape in RAW_ONLY_SETS:
        register(name, DatasetSpec(events.builder(name), description, ON_DISK_UNREAD, classes, shape),
                 "the raw recordings in data.root")
