"""``cifar10``: CIFAR-10 images as rate-coded spikes, from the binary version's batches.

``data.root`` holds ``data_batch_1.bin`` to ``data_batch_5.bin`` and
``test_batch.bin`` (CIFAR-10 binary version, ``cifar-10-batches-bin``):
records of one label byte and 3072 pixel bytes, the red, green and blue
32x32 planes. An image is resized by area to the model's input size, and at
each time step a pixel spikes where a uniform draw falls below its intensity
(rate coding), drawn from a generator seeded by the run's seed and the sample
index, so every strategy sees the same spikes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from snnfw import hookimpl
from snnfw.api import DataError, DatasetSpec
from snnfw_plugins.datasets.events import RAW_ONLY, resize
from snnfw_plugins.datasets.neuromorphic import ON_DISK_UNREAD

NAME = "cifar10"
FILES = {"train": [f"data_batch_{i}.bin" for i in range(1, 6)], "test": ["test_batch.bin"]}
SHAPE = (3, 32, 32)
RECORD = 1 + 3 * 32 * 32


class RateCoded:
    """``(spikes [T, C, H, W] float, label)`` from ``uint8`` records of label and pixels."""

    def __init__(self, records: list[np.ndarray], spec, seed: int):
        self.records, self.spec, self.seed = records, spec, seed
        self.offsets = np.cumsum([0] + [len(r) for r in records])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, index: int):
        import torch

        part = int(np.searchsorted(self.offsets, index, side="right")) - 1
        record = self.records[part][index - self.offsets[part]]
        image = torch.from_numpy(record[1:].astype(np.float32) / 255).view(1, *SHAPE)
        image = resize(image, tuple(self.spec.shape[1:]))[0]
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        spikes = torch.rand(self.spec.time_steps, *image.shape, generator=generator) < image
        return spikes.float(), int(record[0])


def _records(path: Path) -> np.ndarray:
    if not path.is_file():
        raise DataError(f"{path} does not exist: data set {NAME} expects CIFAR-10's binary batches in data.root "
                        f"({', '.join(FILES['train'] + FILES['test'])})")
    size = path.stat().st_size
    if size == 0 or size % RECORD:
        raise DataError(f"{path} is not a CIFAR-10 binary batch: {size} bytes is no multiple of {RECORD}-byte records")
    return np.memmap(path, dtype=np.uint8, mode="r").reshape(-1, RECORD)


def build(config, spec, split, seed):
    if config.root is None:
        raise DataError(f"data set {NAME} reads CIFAR-10's binary batches from data.root; set it to their folder")
    if spec.shape[0] != SHAPE[0] or spec.num_classes < 10:
        raise DataError(
            f"data set {NAME} has 3-channel images of 10 classes; the model takes {spec.shape[0]} channels and "
            f"{spec.num_classes} classes (spikformer's flavor cifar10 takes them)"
        )
    records = [_records(Path(config.root) / name) for name in FILES[split]]
    return RateCoded(records, spec, seed * 2 + (split == "test"))


@hookimpl
def snnfw_register_datasets(register):
    spec = DatasetSpec(build, "CIFAR-10 images, rate-coded into spikes per time step", unread=(*ON_DISK_UNREAD, *RAW_ONLY),
                       classes=10, frame_shape=(3, 32, 32))
    register(NAME, spec, "binary batches in data.root")
