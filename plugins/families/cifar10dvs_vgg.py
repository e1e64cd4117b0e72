"""``cifar10dvs_vgg``: the spiking VGG of SpikingJelly's memopt examples, for DVS frames.

Eight Conv-BN-LIF blocks (SpikingJelly's ``VGGBlock``), average pooling before
blocks 3, 5 and 7 and after the last, then a linear classifier. ``full`` is the
original for 2 x 48 x 48 CIFAR10-DVS frames (9,271,498 parameters); ``tiny`` is
the same shape at small widths on 2 x 32 x 32 frames, without the conv biases
that BatchNorm makes redundant, for tests and the quickstart.
"""

from functools import partial

import torch
from torch import nn

from snnfw import hookimpl
from snnfw.analysis import AnalysisPart
from snnfw.families import Flavor, ModelFamily
from snnfw.pipeline import TimeMajor

NAME = "cifar10dvs_vgg"
POOL_BEFORE = (2, 4, 6)


class SpikingVGG(nn.Module):
    """Frames ``[N, T, C, H, W]`` -> logits ``[T, N, classes]`` in multi-step mode."""

    def __init__(self, widths, in_channels=2, image_size=48, num_classes=10, dropout=0.0, tau=1.333, conv_bias=True):
        super().__init__()
        from spikingjelly.activation_based import functional, layer, surrogate
        from spikingjelly.activation_based.examples.memopt.models import VGGBlock

        neuron_args = dict(tau=tau, decay_input=False, detach_reset=True, surrogate_function=surrogate.ATan(), step_mode="m")
        blocks, channels = [], in_channels
        for i, width in enumerate(widths):
            blocks.append(VGGBlock(channels, width, 3, 1, 1, i in POOL_BEFORE, **neuron_args))
            if not conv_bias:  # BatchNorm follows: the bias would only learn rounding noise
                blocks[-1].proj_bn[-2].register_parameter("bias", None)
            channels = width
        self.features = nn.Sequential(*blocks, layer.AvgPool2d(2))
        side = image_size // 2 ** (len(POOL_BEFORE) + 1)
        head = [nn.Dropout(dropout)] if dropout > 0 else []
        self.classifier = nn.Sequential(*head, nn.Linear(channels * side * side, num_classes))
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        functional.set_step_mode(self, "m")

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        x = self.features(frames.transpose(0, 1).contiguous())
        return self.classifier(torch.flatten(x, 2))


FULL_WIDTHS = (64, 128, 256, 256, 512, 512, 512, 512)
TINY_WIDTHS = (8, 16, 16, 32, 32, 32, 32, 32)

FAMILY = ModelFamily(
    name=NAME,
    flavors={
        "full": Flavor((2, 48, 48), 10, partial(SpikingVGG, FULL_WIDTHS, 2, 48, 10), "CIFAR10-DVS 48x48, 9.3M parameters"),
        "tiny": Flavor((2, 32, 32), 10, partial(SpikingVGG, TINY_WIDTHS, 2, 32, 10, conv_bias=False), "32x32, for tests and the quickstart"),
    },
)


@hookimpl
def snnfw_register_model_families(register):
    register(NAME, FAMILY, "spiking VGG with 8 Conv-BN-LIF blocks for DVS event frames")


@hookimpl
def snnfw_analyze(model, family):
    if family != NAME:
        return None
    blocks = tuple(f"features.{i}" for i in range(len(model.features) - 1))
    return AnalysisPart(
        blocks=blocks,
        stage_units=blocks + ("classifier",),
        tp_plan=tuple((block, "conv_bn_neuron") for block in blocks),
    )


@hookimpl
def snnfw_split_stages(model, plan):
    """One unit per block, the time-major transpose before the first, the last pooling
    after the last block, and the flatten before the classifier."""
    if plan.config.model.family != NAME:
        return None
    *blocks, pool = model.features
    return [
        nn.Sequential(TimeMajor(), blocks[0]),
        *blocks[1:-1],
        nn.Sequential(blocks[-1], pool),
        nn.Sequential(nn.Flatten(2), model.classifier),
    ]
