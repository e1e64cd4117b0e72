"""``synthetic_dvs``: class-dependent DVS event frames, generated on the fly (no download).

Each sample is a blob of events moving across the sensor in the direction of
its class (class ``k`` moves at angle ``2 pi k / classes``), from a jittered
start, over background noise. Polarity channel 0 holds ON events at the blob's
new position, channel 1 OFF events where it left. Frames are binary, ``[T, C, H, W]``.
Everything is a deterministic function of the seed, split and sample index.
"""

import math

from snnfw import hookimpl
from snnfw.api import DatasetSpec
from snnfw_plugins.datasets.events import RAW_ONLY

NAME = "synthetic_dvs"
NOISE = 0.02


def make_frames(count: int, time_steps: int, shape: tuple[int, int, int], classes: int, generator) -> tuple:
    import torch

    channels, height, width = shape
    labels = torch.randint(classes, (count,), generator=generator)
    angle = 2 * math.pi * labels.float() / classes + 0.2 * torch.randn(count, generator=generator)
    speed = 0.6 * min(height, width) / max(time_steps, 1)
    start = torch.randn(count, 2, generator=generator) * min(height, width) / 10
    radius = max(min(height, width) / 8, 1.5)
    ys = torch.arange(height).view(1, height, 1).float() - height / 2
    xs = torch.arange(width).view(1, 1, width).float() - width / 2

    steps = torch.tensor([(t - (time_steps - 1) / 2) * speed for t in range(-1, time_steps)]).view(-1, 1, 1, 1)
    cy = start[:, 0].view(1, -1, 1, 1) + steps * torch.sin(angle).view(1, -1, 1, 1)  # the blob's centre at t = -1 .. T - 1
    cx = start[:, 1].view(1, -1, 1, 1) + steps * torch.cos(angle).view(1, -1, 1, 1)
    blobs = torch.exp(-((ys - cy) ** 2 + (xs - cx) ** 2) / (2 * radius**2))  # [T + 1, count, H, W]
    now, before = blobs[1:], blobs[:-1]
    on = (now - before).clamp(min=0) * 2.5
    off = (before - now).clamp(min=0) * 2.5
    intensity = torch.stack((on, off)[:channels], dim=1).clamp(max=1) + NOISE  # [T, C, count, H, W]
    events = torch.rand(time_steps, channels, count, height, width, generator=generator) < intensity  # drawn in t, c order
    frames = events.float().permute(2, 0, 1, 3, 4).contiguous()
    return frames, labels


CACHE_BYTES = 256 * 2**20


class SyntheticDVS:
    """Generates sample ``i`` on demand from its own seeded generator.

    Generated samples are kept (one byte per event) while the whole split fits
    in ``CACHE_BYTES``, so later epochs cost nothing; larger splits stay lazy.
    """

    def __init__(self, count: int, spec, seed: int):
        self.count, self.spec, self.seed = count, spec, seed
        sample_bytes = spec.time_steps * math.prod(spec.shape)
        self._cache = {} if count * sample_bytes <= CACHE_BYTES else None

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int):
        import torch

        if self._cache is not None and index in self._cache:
            frames, label = self._cache[index]
            return frames.float(), label
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        frames, labels = make_frames(1, self.spec.time_steps, self.spec.shape, self.spec.num_classes, generator)
        if self._cache is not None:
            self._cache[index] = (frames[0].to(torch.uint8), int(labels[0]))
        return frames[0], int(labels[0])


def build(config, spec, split, seed):
    count = config.train_samples if split == "train" else config.test_samples
    return SyntheticDVS(count, spec, seed * 2 + (split == "test") + 7919)


@hookimpl
def snnfw_register_datasets(register):
    register(NAME, DatasetSpec(build, "moving blobs of DVS events, one direction per class", unread=("root", *RAW_ONLY)), "embedded; no download")
