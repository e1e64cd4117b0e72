"""Training-set augmentation (``data.augment``), seeded by (seed, epoch, sample index).

A sample's transform depends on nothing else, so every strategy, world size and data-loading process sees
exactly the same transformed samples. The training sampler asks for key ``epoch * len + index``
(:func:`snnfw.data.batches.global_batch_indices` with ``keys=True``; with ``data.repeated_augment = R``, copy
``c`` of a sample in epoch ``e`` has epoch ``e * R + c``, so its copies differ); a plain index is epoch 0's.

- ``hflip``: mirror the frames left to right, with probability 1/2;
- ``roll``: shift them by up to ``data.roll_pixels`` (5) in each direction,
  wrapping around (``torch.roll``), as CIFAR10-DVS recipes do for event frames;
- ``crop``: pad by ``data.crop_padding`` (4) zeros and crop back at a random
  offset, as CIFAR recipes do for static images.

On static images (a :class:`snnfw.data.images.DirectEncoded` data set) the transforms run on the image before
it is repeated over the time steps, and two more apply: ``resized_crop`` (RandomResizedCrop of the image as
stored, ``data.crop_scale`` [0.08, 1] of its area at an aspect in ``data.crop_ratio`` [3/4, 4/3], resized to the
model's input) and ``randaugment`` (:mod:`snnfw.data.randaugment`, ``data.randaugment_ops`` (2) operations at
``data.randaugment_magnitude`` (9)).

``mixup`` and ``cutmix`` (on any frames, after the other transforms, as timm's ``Mixup`` in its per-sample
mode) mix each sample with a partner: with probability ``data.mix_prob`` (1), sample ``i`` of epoch ``e`` takes
the transformed view of sample ``j`` of the same epoch, ``j`` drawn uniformly from the whole training set by a
generator seeded by (seed, e, i), so the pairing is a function of the sample alone, whatever the batch,
replica or microbatch it falls in. ``mixup`` blends the frames with a weight ``lam`` drawn from Beta(a, a), a =
``data.mixup_alpha`` (0.8); ``cutmix`` pastes the partner's box of a share ``1 - lam`` of the area, ``lam`` from
Beta(a, a), a = ``data.cutmix_alpha`` (1.0), corrected to the box as clipped; with both, cutmix is chosen with
probability ``data.mix_switch_prob`` (0.5). The label becomes the soft target ``lam * onehot(i) + (1 - lam) * onehot(j)``
(float64, summing to 1; one-hot where no mixing was drawn), which the losses take as class probabilities.

On raw event recordings, tonic's event transforms run first, on the events of the sample before they become
frames (the data set integrates them again, uncached): ``drop_event`` (DropEvent, each event dropped with
probability ``data.drop_event_p``, 0.1), ``time_jitter`` (TimeJitter, timestamps shifted by a normal of
``data.time_jitter_us``, 100, standard deviation), ``spatial_jitter`` (SpatialJitter, positions shifted by a
normal of ``data.spatial_jitter_px``, 1, variance; pixel sensors only).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from snnfw.config import EVENT_AUGMENTS, IMAGE_AUGMENTS, MIX_AUGMENTS
from snnfw.data.images import DirectEncoded, centred, resized_crop
from snnfw.data.randaugment import rand_augment

OPTIONS = {"roll_pixels": ("roll",), "crop_padding": ("crop",), "drop_event_p": ("drop_event",),
           "time_jitter_us": ("time_jitter",), "spatial_jitter_px": ("spatial_jitter",),
           "crop_scale": ("resized_crop",), "crop_ratio": ("resized_crop",), "randaugment_ops": ("randaugment",),
           "randaugment_magnitude": ("randaugment",), "mixup_alpha": ("mixup",), "cutmix_alpha": ("cutmix",),
           "mix_prob": MIX_AUGMENTS}  # [data] key -> the augments that read it (any of them)
DEFAULTS = {"roll_pixels": 5, "crop_padding": 4, "drop_event_p": 0.1, "time_jitter_us": 100.0, "spatial_jitter_px": 1.0,
            "crop_scale": (0.08, 1.0), "crop_ratio": (3 / 4, 4 / 3), "randaugment_ops": 2, "randaugment_magnitude": 9,
            "mixup_alpha": 0.8, "cutmix_alpha": 1.0, "mix_prob": 1.0, "mix_switch_prob": 0.5}


def check_augment(data) -> None:
    """Refuses an augment option whose augment is not named in ``data.augment``."""
    from snnfw.errors import ConfigError

    for key, names in OPTIONS.items():
        if getattr(data, key) is not None and not set(names) & set(data.augment):
            named = " or ".join(map(repr, names))
            raise ConfigError(f"data.{key} applies to the {named} augment, which data.augment does not name; "
                              f"add {named} to data.augment or remove data.{key}")
    if data.mix_switch_prob is not None and not set(MIX_AUGMENTS) <= set(data.augment):
        raise ConfigError("data.mix_switch_prob chooses between mixup and cutmix, and data.augment does not name both; "
                          "add both, or remove data.mix_switch_prob")
    if data.repeated_augment > 1 and not data.augment:
        raise ConfigError(f"data.repeated_augment = {data.repeated_augment} repeats each sample in differently "
                          "augmented copies, and data.augment is empty, so the copies would be equal; add augments "
                          "or remove data.repeated_augment")


def augment_options(data) -> dict[str, Any]:
    """The options of ``data.augment``'s transforms, from the config or the defaults."""
    return {key: DEFAULTS[key] if getattr(data, key) is None else getattr(data, key) for key in DEFAULTS}


def sample_seed(seed: int, epoch: int, index: int) -> int:
    return ((seed * 1_000_003 + epoch) * 1_000_000_007 + index) % 2**63


def sample_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    return torch.Generator().manual_seed(sample_seed(seed, epoch, index))


def transform(frames: torch.Tensor, names: tuple[str, ...], options: dict[str, Any], generator: torch.Generator) -> torch.Tensor:
    """``frames [T, C, H, W]`` (or an image ``[1, C, H, W]``) through ``names`` in order, the random choices drawn
    from ``generator``."""
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
        elif name == "randaugment":
            frames = rand_augment(frames, options["randaugment_ops"], options["randaugment_magnitude"], generator)
    return frames


def cutmix_box(height: int, width: int, lam: float, rng: np.random.Generator) -> tuple[int, int, int, int]:
    """timm's ``rand_bbox``: a box of sides ``sqrt(1 - lam)`` of the image's about a uniform centre, clipped."""
    ratio = np.sqrt(1 - lam)
    cut_h, cut_w = int(height * ratio), int(width * ratio)
    cy, cx = int(rng.integers(0, height)), int(rng.integers(0, width))
    return (int(np.clip(cy - cut_h // 2, 0, height)), int(np.clip(cy + cut_h // 2, 0, height)),
            int(np.clip(cx - cut_w // 2, 0, width)), int(np.clip(cx + cut_w // 2, 0, width)))


class Augmented:
    """A training set whose sample ``index`` of ``epoch`` (key ``epoch * len + index``) is transformed, and mixed
    with a partner under ``mixup`` or ``cutmix`` (the label then a soft target over ``classes``).

    Event transforms need a data set of raw recordings: one with ``with_events(index, names, options, seed)``,
    which returns the sample integrated from its events after those transforms; ``resized_crop`` and
    ``randaugment`` need a :class:`snnfw.data.images.DirectEncoded` data set of static images.
    """

    def __init__(self, dataset: Any, names: tuple[str, ...], options: dict[str, Any], seed: int, classes: int = 0):
        from snnfw.errors import DataError

        self.dataset, self.options, self.seed, self.classes = dataset, options, seed, classes
        self.events = tuple(name for name in names if name in EVENT_AUGMENTS)
        self.frames = tuple(name for name in names if name not in (*EVENT_AUGMENTS, *MIX_AUGMENTS, "resized_crop"))
        self.crop, self.mix = "resized_crop" in names, tuple(name for name in names if name in MIX_AUGMENTS)
        if self.events and not hasattr(dataset, "with_events"):  # EventAugmented; a wrapper may forward it
            raise DataError(f"data.augment's {', '.join(map(repr, self.events))} transform raw events before they "
                            "become frames, and this data set gives frames; remove them, or train on raw recordings")
        if (image_only := [name for name in names if name in IMAGE_AUGMENTS]) and not isinstance(dataset, DirectEncoded):
            raise DataError(f"data.augment's {', '.join(map(repr, image_only))} transform static images, and this data "
                            "set gives frames of another kind; remove them, or train on cifar100 or image_folder")

    def __len__(self) -> int:
        return len(self.dataset)

    def view(self, epoch: int, index: int) -> tuple[torch.Tensor, int]:
        """Sample ``index``'s transformed frames in ``epoch``, and its label."""
        generator = sample_generator(self.seed, epoch, index)
        if self.events:
            frames, label = self.dataset.with_events(index, self.events, self.options, sample_seed(self.seed, epoch, index))
        elif isinstance(self.dataset, DirectEncoded):
            image, label = self.dataset.raw(index)
            size = tuple(self.dataset.spec.shape[1:])
            image = (resized_crop(image, size, self.options["crop_scale"], self.options["crop_ratio"], generator)
                     if self.crop else centred(image, size))
            return self.dataset.repeated(transform(image[None], self.frames, self.options, generator)[0]), label
        else:
            frames, label = self.dataset[index]
        return transform(torch.as_tensor(frames), self.frames, self.options, generator), label

    def __getitem__(self, key: int):
        epoch, index = divmod(int(key), len(self.dataset))
        frames, label = self.view(epoch, index)
        if not self.mix:
            return frames, label
        target = torch.nn.functional.one_hot(torch.tensor(label), self.classes).double()
        rng = np.random.default_rng([self.seed, epoch, index])  # the mixing's own stream
        if rng.random() >= self.options["mix_prob"]:
            return frames, target
        partner = int(rng.integers(len(self.dataset)))
        other, other_label = self.view(epoch, partner)
        cut = self.mix == ("cutmix",) or (len(self.mix) == 2 and rng.random() < self.options["mix_switch_prob"])
        lam = float(rng.beta(*[self.options["cutmix_alpha" if cut else "mixup_alpha"]] * 2))
        if cut:
            height, width = frames.shape[-2:]
            top, bottom, left, right = cutmix_box(height, width, lam, rng)
            frames = frames.clone()
            frames[..., top:bottom, left:right] = other[..., top:bottom, left:right]
            lam = 1 - (bottom - top) * (right - left) / (height * width)
        else:
            frames = lam * frames + (1 - lam) * other
        return frames, lam * target + (1 - lam) * torch.nn.functional.one_hot(torch.tensor(other_label), self.classes).double()
