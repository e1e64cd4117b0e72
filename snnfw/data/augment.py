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

On raw event recordings, tonic's event transforms run first, on the events of the sample before they become
frames (the data set integrates them again, uncached): ``drop_event`` (DropEvent, each event dropped with
probability ``data.drop_event_p``, 0.1), ``time_jitter`` (TimeJitter, timestamps shifted by a normal of
``data.time_jitter_us``, 100, standard deviation), ``spatial_jitter`` (SpatialJitter, positions shifted by a
normal of ``data.spatial_jitter_px``, 1, variance; pixel sensors only).
"""

from __future__ import annotations

from typing import Any

import torch

from snnfw.config import EVENT_AUGMENTS

OPTIONS = {"roll_pixels": "roll", "crop_padding": "crop", "drop_event_p": "drop_event", "time_jitter_us": "time_jitter",
           "spatial_jitter_px": "spatial_jitter"}  # [data] key -> the augment that reads it
DEFAULTS = {"roll_pixels": 5, "crop_padding": 4, "drop_event_p": 0.1, "time_jitter_us": 100.0, "spatial_jitter_px": 1.0}


def check_augment(data) -> None:
    """Refuses an augment option whose augment is not named in ``data.augment``."""
    from snnfw.errors import ConfigError

    for key, name in OPTIONS.items():
        if getattr(data, key) is not None and name not in data.augment:
            raise ConfigError(f"data.{key} applies to the {name!r} augment, which data.augment does not name; "
                              f"add {name!r} to data.augment or remove data.{key}")


def augment_options(data) -> dict[str, float]:
    """The options of ``data.augment``'s transforms, from the config or the defaults."""
    return {key: DEFAULTS[key] if getattr(data, key) is None else getattr(data, key) for key in OPTIONS}


def sample_seed(seed: int, epoch: int, index: int) -> int:
    return ((seed * 1_000_003 + epoch) * 1_000_000_007 + index) % 2**63


def sample_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    return torch.Generator().manual_seed(sample_seed(seed, epoch, index))


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
    """A training set whose sample ``index`` of ``epoch`` (key ``epoch * len + index``) is transformed.

    Event transforms need a data set of raw recordings: one with ``with_events(index, names, options, seed)``,
    which returns the sample integrated from its events after those transforms.
    """

    def __init__(self, dataset: Any, names: tuple[str, ...], options: dict[str, float], seed: int):
        from snnfw.errors import DataError

        self.dataset, self.options, self.seed = dataset, options, seed
        self.events = tuple(name for name in names if name in EVENT_AUGMENTS)
        self.frames = tuple(name for name in names if name not in EVENT_AUGMENTS)
        if self.events and not hasattr(dataset, "with_events"):
            raise DataError(f"data.augment's {', '.join(map(repr, self.events))} transform raw events before they "
                            "become frames, and this data set gives frames; remove them, or train on raw recordings")

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: int):
        epoch, index = divmod(int(key), len(self.dataset))
        if self.events:
            frames, label = self.dataset.with_events(index, self.events, self.options,
                                                     sample_seed(self.seed, epoch, index))
        else:
            frames, label = self.dataset[index]
        return transform(torch.as_tensor(frames), self.frames, self.options, sample_generator(self.seed, epoch, index)), label
