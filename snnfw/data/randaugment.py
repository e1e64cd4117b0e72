"""RandAugment (Cubuk et al., 2020) on image tensors, as torchvision's ``RandAugment`` defines it.

``ops`` times, one of torchvision's 14 operations is drawn uniformly and applied at ``magnitude`` of 31
bins (0 to 30), a signed operation's sign drawn with probability 1/2; every draw comes from the sample's
generator. The operations and their ranges at the top bin: identity; shear x or y (0.3); translate x or y
(150/331 of the side); rotate (30 degrees); brightness, colour (saturation), contrast, sharpness (factor
1 +- 0.9); posterize (8 down to 4 bits); solarize (threshold 1 down to 0); autocontrast; equalize.
Geometric operations sample nearest pixels about the image centre and fill with 0, as torchvision does.
Images are ``[..., C, H, W]`` floats in [0, 1]; colour operations take 3 channels (1 is taken as grey).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

BINS = 31
SIGNED = {"shear_x": 0.3, "shear_y": 0.3, "translate_x": 150 / 331, "translate_y": 150 / 331, "rotate": 30.0,
          "brightness": 0.9, "color": 0.9, "contrast": 0.9, "sharpness": 0.9}
OPS = ("identity", *SIGNED, "posterize", "solarize", "autocontrast", "equalize")


def _grey(image: torch.Tensor) -> torch.Tensor:
    if image.shape[-3] == 1:
        return image
    r, g, b = image.unbind(-3)
    return (0.2989 * r + 0.587 * g + 0.114 * b).unsqueeze(-3)


def _blend(image: torch.Tensor, other: torch.Tensor, factor: float) -> torch.Tensor:
    return (factor * image + (1 - factor) * other).clamp(0, 1)


def _warp(image: torch.Tensor, matrix: list[list[float]]) -> torch.Tensor:
    """``image`` sampled at ``matrix @ (x, y, 1)`` for each output pixel ``(x, y)``, in pixels about the centre."""
    (a, b, c), (d, e, f) = matrix
    height, width = image.shape[-2:]
    theta = torch.tensor([[a, b * height / width, 2 * c / width], [d * width / height, e, 2 * f / height]],
                         dtype=image.dtype)
    flat = image.reshape(-1, *image.shape[-3:])
    grid = F.affine_grid(theta.expand(len(flat), 2, 3), list(flat.shape), align_corners=False)
    return F.grid_sample(flat, grid, mode="nearest", padding_mode="zeros", align_corners=False).view(image.shape)


def _sharpen(image: torch.Tensor, factor: float) -> torch.Tensor:
    kernel = torch.ones(3, 3, dtype=image.dtype)
    kernel[1, 1] = 5
    flat = image.reshape(-1, 1, *image.shape[-2:])
    blurred = flat.clone()
    blurred[..., 1:-1, 1:-1] = F.conv2d(flat, (kernel / 13).view(1, 1, 3, 3))  # the border stays as it was
    return _blend(image, blurred.view(image.shape), factor)


def _autocontrast(image: torch.Tensor) -> torch.Tensor:
    low = image.amin(dim=(-2, -1), keepdim=True)
    high = image.amax(dim=(-2, -1), keepdim=True)
    span = torch.where(high > low, high - low, torch.ones_like(high))
    return torch.where(high > low, (image - low) / span, image).clamp(0, 1)


def _equalize(image: torch.Tensor) -> torch.Tensor:
    """Each channel's 256 levels spread by their histogram (PIL's ImageOps.equalize)."""
    levels = (image * 255).round().long()
    flat = levels.reshape(-1, levels.shape[-2] * levels.shape[-1])
    out = torch.empty_like(flat)
    for row, channel in enumerate(flat):
        counts = torch.bincount(channel, minlength=256)
        step = (counts.sum() - counts[counts.nonzero()[-1]]) // 255
        if step == 0:
            out[row] = channel
            continue
        lookup = ((torch.cumsum(counts, 0) + step // 2) // step).clamp(0, 255)
        out[row] = torch.cat([torch.zeros(1, dtype=lookup.dtype), lookup[:-1]])[channel]
    return out.view(levels.shape).to(image.dtype) / 255


def apply(image: torch.Tensor, op: str, value: float) -> torch.Tensor:
    """Operation ``op`` at ``value`` (signed for a signed operation, bits for posterize, threshold for solarize)."""
    height, width = image.shape[-2:]
    if op == "identity":
        return image
    if op == "shear_x":
        return _warp(image, [[1, -value, 0], [0, 1, 0]])
    if op == "shear_y":
        return _warp(image, [[1, 0, 0], [-value, 1, 0]])
    if op == "translate_x":
        return _warp(image, [[1, 0, -value * width], [0, 1, 0]])
    if op == "translate_y":
        return _warp(image, [[1, 0, 0], [0, 1, -value * height]])
    if op == "rotate":
        cos, sin = math.cos(math.radians(value)), math.sin(math.radians(value))
        return _warp(image, [[cos, -sin, 0], [sin, cos, 0]])
    if op == "brightness":
        return _blend(image, torch.zeros_like(image), 1 + value)
    if op == "color":
        return _blend(image, _grey(image).expand_as(image), 1 + value)
    if op == "contrast":
        return _blend(image, _grey(image).mean(dim=(-3, -2, -1), keepdim=True).expand_as(image), 1 + value)
    if op == "sharpness":
        return _sharpen(image, 1 + value)
    if op == "posterize":
        step = 2 ** (8 - int(value))  # the low bits cleared
        return torch.floor((image * 255).round() / step) * step / 255
    if op == "solarize":
        return torch.where(image >= value, 1 - image, image)
    if op == "autocontrast":
        return _autocontrast(image)
    if op == "equalize":
        return _equalize(image)
    raise ValueError(f"unknown RandAugment operation {op!r}")


def value_at(op: str, magnitude: int) -> float:
    """``op``'s unsigned value at bin ``magnitude`` of 31."""
    if op in SIGNED:
        return SIGNED[op] * magnitude / (BINS - 1)
    if op == "posterize":
        return 8 - round(magnitude / ((BINS - 1) / 4))
    if op == "solarize":
        return 1 - magnitude / (BINS - 1)
    return 0.0


def rand_augment(image: torch.Tensor, ops: int, magnitude: int, generator: torch.Generator) -> torch.Tensor:
    """``image`` through ``ops`` operations drawn from ``generator``, each at ``magnitude``."""
    for _ in range(ops):
        op = OPS[int(torch.randint(len(OPS), (), generator=generator))]
        value = value_at(op, magnitude)
        if op in SIGNED and torch.rand((), generator=generator) < 0.5:
            value = -value
        image = apply(image, op, value)
    return image
