"""The guarantee with the ImageNet recipe's augmentation on: every strategy trains on the same views and mixes.

A small convolutional network of the user's own trains in float64 on generated CIFAR-100 files and image folders
with resized crops, flips, RandAugment, mixup and cutmix, repeated augmentation and label smoothing; ``dp`` (each
replica holding half of each global batch) and ``tp`` must give none's losses with as many microbatches at every
step, which they can only if each sample's view and partner are the same whatever rank, replica or microbatch
loads it.
"""

import functools
from pathlib import Path

import pytest

from snnfw.config import build_config
from snnfw.run.loop import run_training
from snnfw.testing import run_on_ranks
from snnfw.testing.checks import assert_steps_close
from snnfw.testing.layouts import write_cifar100, write_image_folder

STEPS = 3
AUGMENT = {"augment": ["resized_crop", "hflip", "randaugment", "mixup", "cutmix"], "crop_scale": [0.25, 1.0],
           "repeated_augment": 2, "batch_size": 8}


def build():
    """RGB 16x16 frames ``[T, N, 3, 16, 16]`` -> logits ``[T, N, 100]``."""
    from spikingjelly.activation_based import functional, layer, neuron
    from torch import nn

    net = nn.Sequential(layer.Conv2d(3, 8, 3, padding=1, bias=False), layer.BatchNorm2d(8), neuron.LIFNode(),
                        layer.MaxPool2d(4), layer.Flatten(), layer.Linear(8 * 4 * 4, 100))
    functional.set_step_mode(net, "m")
    return net


def config(root: Path, name: str, strategy: str, microbatches: int):
    return build_config({
        "model": {"builder": f"{__file__}:build", "input_shape": [3, 16, 16], "num_classes": 100, "input_layout": "TN",
                  "time_steps": 2},
        "data": {"name": name, "root": str(root), **AUGMENT},
        "train": {"steps": STEPS, "lr": 3e-3, "seed": 3, "dtype": "float64", "microbatches": microbatches,
                  "label_smoothing": 0.1},
        "parallel": {"strategy": strategy},
    })


@functools.cache
def layout(name: str, root: Path) -> Path:
    if name == "cifar100":
        return write_cifar100(root / name, records=24)
    return write_image_folder(root / name, classes=[f"c{i}" for i in range(6)], per_class=4)


@pytest.mark.parametrize("name", ["cifar100", "image_folder"])
@pytest.mark.parametrize("strategy, microbatches", [("dp", 2), ("tp", 1)])
def test_dp_and_tp_train_on_the_same_mixed_views_as_none(name, strategy, microbatches, tmp_path_factory):
    root = layout(name, tmp_path_factory.getbasetemp())
    want = run_training(config(root, name, "none", microbatches))
    assert len(set(want["losses"])) == STEPS
    summaries = run_on_ranks(config(root, name, strategy, 1), 2, timeout_s=240)
    for rank, got in enumerate(summaries):
        assert_steps_close(rank, got, want, ("losses",), STEPS)
