"""Augmentation: a function of (seed, epoch, sample index) alone, so any process sees the same samples."""

import subprocess
import sys

import pytest
import torch

from snnfw.config import build_config
from snnfw.data.augment import Augmented, augment_options, transform
from snnfw.data.batches import InputSpec, global_batch_indices
from snnfw.errors import ConfigError
from snnfw.plan.prepare import prepare
from snnfw.plugin.manager import Plugins

SPEC = InputSpec(4, (2, 16, 16), 10)
CONFIG = build_config({"data": {"augment": ["hflip", "roll", "crop"], "roll_pixels": 3}})


def augmented():
    from snnfw_plugins.datasets.synthetic_dvs import SyntheticDVS

    return Augmented(SyntheticDVS(20, SPEC, seed=1), CONFIG.data.augment, augment_options(CONFIG.data), seed=7)


SAMPLE_IN_ANOTHER_PROCESS = """
import sys, torch
sys.path[:0] = {path!r}
from test_augment import augmented
torch.save(torch.stack([augmented()[key][0] for key in {keys!r}]), {out!r})
"""


def test_the_same_key_gives_the_same_sample_in_another_process(tmp_path):
    keys = [3, 20 + 3, 40 + 17]  # sample 3 in epochs 0 and 1, sample 17 in epoch 2
    here = torch.stack([augmented()[key][0] for key in keys])
    script = SAMPLE_IN_ANOTHER_PROCESS.format(path=[str(p) for p in sys.path], keys=keys, out=str(tmp_path / "there.pt"))
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120, cwd=tmp_path)
    assert torch.equal(here, torch.load(tmp_path / "there.pt"))
    plain = augmented().dataset
    assert not torch.equal(here[0], here[1]), "epochs transform a sample alike"
    assert not torch.equal(here[0], plain[3][0]) and here[0].sum() == pytest.approx(plain[3][0].sum(), abs=200)


def test_each_transform_does_what_it_says():
    frames = torch.arange(2 * 1 * 4 * 6, dtype=torch.float32).view(2, 1, 4, 6)
    flips = [transform(frames, ("hflip",), {}, torch.Generator().manual_seed(s)) for s in range(20)]
    assert {torch.equal(f, frames) for f in flips} == {True, False}
    assert all(torch.equal(f, frames) or torch.equal(f, frames.flip(-1)) for f in flips)
    rolled = transform(frames, ("roll",), {"roll_pixels": 2}, torch.Generator().manual_seed(0))
    assert sorted(rolled.flatten().tolist()) == sorted(frames.flatten().tolist())  # a permutation of the pixels
    cropped = transform(frames, ("crop",), {"crop_padding": 2}, torch.Generator().manual_seed(0))
    assert cropped.shape == frames.shape


def test_training_keys_name_the_epoch():
    plain = global_batch_indices(3, 8, 20, seed=5)
    keys = global_batch_indices(3, 8, 20, seed=5, keys=True)  # positions 24-31: epoch 1
    assert torch.equal(keys % 20, plain) and set((keys // 20).tolist()) == {1}


@pytest.mark.parametrize(
    "data, message",
    [({"augment": ["hflip"], "roll_pixels": 2}, "data.roll_pixels applies to the 'roll' augment"),
     ({"augment": ["erase"]}, "data.augment lists training-set transforms"),
     ({"augment": ["randaugment"]}, "'randaugment' transform static images, and data set 'synthetic_dvs' gives"),
     ({"augment": ["mixup"], "mix_switch_prob": 0.5}, "data.mix_switch_prob chooses between mixup and cutmix"),
     ({"augment": ["hflip"], "cutmix_alpha": 1.0}, "data.cutmix_alpha applies to the 'cutmix' augment"),
     ({"repeated_augment": 3}, "data.repeated_augment = 3 repeats each sample")],
)
def test_augment_keys_are_checked(data, message):
    with pytest.raises(ConfigError, match=message):
        prepare(build_config({"data": data}), 1, Plugins())
