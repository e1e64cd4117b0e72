"""Static images for direct encoding: resized for the model, or cropped at random (RandomResizedCrop).

Images are ``[C, H, W]`` floats in [0, 1]; resizing is bicubic with antialiasing, clamped to [0, 1], as
the Spikformer recipes' ``bicubic`` interpolation (``torch.nn.functional.interpolate``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: data-set plugins subclass DirectEncoded without loading torch
    import torch


def resized(image: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """``image`` resized to ``size`` (unchanged if it has it)."""
    import torch.nn.functional as F

    if tuple(image.shape[-2:]) == tuple(size):
        return image
    return F.interpolate(image[None], size=size, mode="bicubic", antialias=True)[0].clamp(0, 1)


def centred(image: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """The test view: the shorter side scaled to cover ``size``, then its centre (a crop fraction of 1)."""
    height, width = image.shape[-2:]
    scale = max(size[0] / height, size[1] / width)
    image = resized(image, (max(size[0], round(height * scale)), max(size[1], round(width * scale))))
    top, left = (image.shape[-2] - size[0]) // 2, (image.shape[-1] - size[1]) // 2
    return image[..., top:top + size[0], left:left + size[1]]


def _uniform(low: float, high: float, generator: torch.Generator) -> float:
    import torch

    return low + (high - low) * float(torch.rand((), generator=generator, dtype=torch.float64))


def resized_crop(image: torch.Tensor, size: tuple[int, int], scale: tuple[float, float], ratio: tuple[float, float],
                 generator: torch.Generator) -> torch.Tensor:
    """A random region of ``scale`` of the area and aspect ``ratio`` (drawn log-uniform), resized to ``size``:
    torchvision's RandomResizedCrop (ten tries, then the centre at the nearest allowed aspect)."""
    import torch

    height, width = image.shape[-2:]
    area = height * width
    for _ in range(10):
        target = area * _uniform(*scale, generator)
        aspect = math.exp(_uniform(math.log(ratio[0]), math.log(ratio[1]), generator))
        w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            top = int(torch.randint(0, height - h + 1, (), generator=generator))
            left = int(torch.randint(0, width - w + 1, (), generator=generator))
            return resized(image[..., top:top + h, left:left + w], size)
    aspect = min(max(width / height, ratio[0]), ratio[1])
    w, h = (width, round(width / aspect)) if width / height < aspect else (round(height * aspect), height)
    w, h = min(w, width), min(h, height)
    top, left = (height - h) // 2, (width - w) // 2
    return resized(image[..., top:top + h, left:left + w], size)


class DirectEncoded:
    """A data set of static images fed whole at every time step (direct encoding): item ``index`` is
    ``(frames [T, C, H, W], label)``, its test view (:func:`centred`) repeated over ``spec.time_steps``.
    Subclasses give ``raw(index) -> (image [C, h, w] float in [0, 1], label)`` as stored and ``__len__``;
    :class:`snnfw.data.augment.Augmented` crops and transforms the stored image before it is repeated."""

    def __init__(self, spec):
        self.spec = spec

    def raw(self, index: int) -> tuple[torch.Tensor, int]:
        raise NotImplementedError

    def repeated(self, image: torch.Tensor) -> torch.Tensor:
        return image.unsqueeze(0).expand(self.spec.time_steps, *image.shape).contiguous()

    def __getitem__(self, index: int):
        image, label = self.raw(index)
        return self.repeated(centred(image, tuple(self.spec.shape[1:]))), label
