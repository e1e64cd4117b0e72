"""``cifar10_dvs``, ``dvs128_gesture``, ``n_mnist``: event frames in SpikingJelly's on-disk layout.

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

import re
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from snnfw import hookimpl
from snnfw.data.batches import DatasetSpec
from snnfw.errors import DataError

if TYPE_CHECKING:
    import torch

EXTENSIONS = (".npz", ".npy")
ON_DISK_UNREAD = ("train_samples", "test_samples")  # an on-disk set has the samples its files hold
SETS = {
    "cifar10_dvs": ("CIFAR10DVS", "CIFAR10-DVS, 10 classes of 128x128 event frames"),
    "dvs128_gesture": ("DVS128Gesture", "DVS128 Gesture, 11 classes of 128x128 event frames"),
    "n_mnist": ("NMNIST", "N-MNIST, 10 classes of 34x34 event frames"),
}


def load_frames(path: Path) -> np.ndarray:
    """The frames array of one sample file, without unpickling anything."""
    if path.suffix == ".npy":
        return np.load(path)
    with np.load(path) as archive:
        return archive["frames"]


def resize(frames: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """``[T, C, H, W]`` resized by area to ``size`` (unchanged if it already has it)."""
    import torch.nn.functional as F

    return frames if tuple(frames.shape[-2:]) == size else F.interpolate(frames, size=size, mode="area")


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


def _number(path: Path) -> tuple[int, str]:
    match = re.search(r"(\d+)$", path.stem)
    return (int(match.group(1)) if match else -1, path.name)


def _samples(frames_root: Path, split: str) -> tuple[Path, list[tuple[Path, int]]]:
    """The folder read and its (file, label) pairs: a ``split`` folder, or TEBN's split of class folders."""
    if (frames_root / split).is_dir():
        folder = frames_root / split
        return folder, [(f, label) for label, c in enumerate(_classes(folder)) for f in _files(c)]
    samples = []
    for label, class_dir in enumerate(_classes(frames_root)):
        files = sorted(_files(class_dir), key=_number)
        cut = len(files) // 10
        samples += [(f, label) for f in (files[:cut] if split == "test" else files[cut:])]
    return frames_root, samples


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
        if config.root is None:
            raise DataError(f"data set {name} reads SpikingJelly's frames from data.root; set it to the root given to {made_by}")
        root = Path(config.root)
        candidates = [root / f"frames_number_{spec.time_steps}_split_by_{by}" for by in ("number", "time")]
        frames_root = next((p for p in candidates if p.is_dir()), None)
        if frames_root is None:
            raise DataError(
                f"{candidates[0]} does not exist: data set {name} expects the frames of model.time_steps = "
                f"{spec.time_steps} that {made_by} writes, as <split>/<class>/*.npz"
            )
        folder, samples = _samples(frames_root, split)
        if not samples:
            raise DataError(f"{folder} holds no {split} samples: expected {split}/<class>/*.npz frame files")
        classes = max(label for _, label in samples) + 1
        if classes > spec.num_classes:
            raise DataError(f"{folder} has {classes} classes, but the model has {spec.num_classes} outputs")
        _check_first(samples[0][0], spec)
        return FrameFolder(samples, tuple(spec.shape[1:]))

    return build


@hookimpl
def snnfw_register_datasets(register):
    for name, (_, description) in SETS.items():
        register(name, DatasetSpec(builder(name), description, unread=ON_DISK_UNREAD), "SpikingJelly's frames in data.root")
