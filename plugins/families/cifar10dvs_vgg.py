"""``cifar10dvs_vgg``: the spiking VGG of SpikingJelly's memopt examples, for DVS frames.

Eight Conv-BN-LIF blocks (SpikingJelly's ``VGGBlock``), average pooling before
blocks 3, 5 and 7 and after the last, then a linear classifier. ``full`` is the
original for 2 x 48 x 48 CIFAR10-DVS frames (9,271,498 parameters); ``tiny`` is
the same shape at small widths on 2 x 32 x 32 frames, without the conv biases
that BatchNorm makes redundant, for tests and the quickstart.
"""

from functools import partial

from snnfw import hookimpl
from snnfw.api import AnalysisPart, Flavor, ModelFamily

NAME = "cifar10dvs_vgg"


def build(*args, **kwargs):
    from snnfw_plugins.families.cifar10dvs_vgg_model import SpikingVGG

    return SpikingVGG(*args, **kwargs)


FULL_WIDTHS = (64, 128, 256, 256, 512, 512, 512, 512)
TINY_WIDTHS = (8, 16, 16, 32, 32, 32, 32, 32)

FAMILY = ModelFamily(
    name=NAME,
    flavors={
        "full": Flavor((2, 48, 48), 10, partial(build, FULL_WIDTHS, 2, 48, 10), "CIFAR10-DVS 48x48, 9.3M parameters",
                       lambda classes: partial(build, FULL_WIDTHS, 2, 48, classes)),
        "tiny": Flavor((2, 32, 32), 10, partial(build, TINY_WIDTHS, 2, 32, 10, conv_bias=False), "32x32, for tests and the quickstart",
                       lambda classes: partial(build, TINY_WIDTHS, 2, 32, classes, conv_bias=False)),
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
    if plan.analysis.family != NAME:
        return None
    from torch import nn

    from snnfw.api import TimeMajor

    *blocks, pool = model.features
    return [
        nn.Sequential(TimeMajor(), blocks[0]),
        *blocks[1:-1],
        nn.Sequential(blocks[-1], pool),
        nn.Sequential(nn.Flatten(2), model.classifier),
    ]
