"""Training-set augmentation (``data.augment``), seeded by (seed, epoch, sample index).

A sample's transform depends on nothing else, so every strategy, world size
and data-loading process sees exactly the same transformed samples. The
training sampler asks for key ``epoch * len + index`` (:func:`snnfw.data.batches.global_batch_indices`
with ``keys=True``); a plain index is epoch 0's.

- ``hflip``: mirror the frames left to right, with probability 1/2;
- ``roll``: shift them by up to ``data.roll_pixels`` (5) in each direction,
  wrapping around (``torch.roll``), as CIFAR10-DVS recipes do for event frames;
- ``crop``: pad by ``data.crop_padding`` (4) zeros and crop back at a random
  offset, as CIFAR recipes do for static images.
"""

from __future__ import annotations

from typing import Any

import torch

OPTIONS = {"roll_pixels": "roll", "crop_padding": "crop"}  # [data] key -> the augment that reads it
DEFAULTS = {"roll_pixels": 5, "crop_padding": 4}


def check_augment(data) -> None:
    """Refuses an augment option whose augment is not named in ``data.augment``."""
    from snnfw.errors import ConfigError

    for key, name in OPTIONS.items():
        if getattr(data, key) is not None and name not in data.augment:
            raise ConfigError(f"data.{key} applies to the {name!r} augment, which data.augment does not name; "
                              f"add {name!r} to data.augment or remove data.{key}")


def augment_options(data) -> dict[str, int]:
    """The options of ``data.augment``'s transforms, from the config or the defaults."""
    return {key: DEFAULTS[key] if getattr(data, key) is None else getattr(data, key) for key in OPTIONS}


def sample_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    return torch.Generator().manual_seed(((seed * 1_000_003 + epoch) * 1_000_000_007 + index) % 2**63)


def transform(frames: torch.Tensor, names: tuple[str, ...], options: dict[str, int], generator: torch.Generator) -> torch.Tensor:
    """``frames [T, C, H, W]`` through ``names`` in order, the random choices drawn from ``generator``."""
    for name in names:
        if name == "hflip":
            if torch.rand((), generator=generator) < 0.5:
                frames = frames.flip(-1)
        elif name == "roll":
            limit = options["roll_pixels"]
            dy, dx = torch.randint(-limit, limit + 1, (2,), generator=generator).tolist()
            frames = frames.roll((dy, dx), dims=(-2, -1))
        elif name == "crop":
            pad = options["crop_padding"]
            height, width = frames.shape[-2:]
            padded = torch.nn.functional.pad(frames, (pad, pad, pad, pad))
            top, left = torch.randint(0, 2 * pad + 1, (2,), generator=generator).tolist()
            frames = padded[..., top : top + height, left : left + width]
    return frames


class Augmented:
    """A training set whose sample ``index`` of ``epoch`` (key ``epoch * len + index``) is transformed."""

    def __init__(self, dataset: Any, names: tuple[str, ...], options: dict[str, int], seed: int):
        self.dataset, self.names, self.options, self.seed = dataset, names, options, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: int):
        epoch, index = divmod(int(key), len(self.dataset))
        frames, label = self.dataset[index]
        return transform(torch.as_tensor(frames), self.names, self.options, sample_generator(self.seed, epoch, index)), label
