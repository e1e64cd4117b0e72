"""``spikformer``: SpikingJelly's model-zoo Spikformer, for frames ``[N, T, C, H, W]``.

A convolutional patch stem (four Conv-BN-LIF stages and a Conv-BN-LIF
positional encoding), transformer blocks of spiking self-attention and a
convolutional MLP, then a linear head on the mean token. ``ti`` is the
reference Spikformer-ti for 3 x 224 x 224 images and 1000 classes (4,400,392
parameters); ``8-512`` is the paper's Spikformer-8-512 for ImageNet (29,664,808 parameters);
``cifar10`` is Spikformer-4-384 on 32 x 32 images; ``tiny`` is a two-block model on 2 x 32 x 32 frames, for tests,
with every neuron at the threshold 0.5 the zoo gives attention scores, so each
neuron group, attention included, fires at about 8% to 40% on sparse DVS events.
"""

from functools import partial

from snnfw import hookimpl
from snnfw.api import AnalysisPart, Flavor, ModelFamily

NAME = "spikformer"


def build(**kwargs):
    from snnfw_plugins.families.spikformer_model import SpikformerNet

    return SpikformerNet(**kwargs)


TI = dict(in_channels=3, img_size_h=224, img_size_w=224, patch_size=16, num_classes=1000,
          embed_dims=256, num_heads=8, mlp_ratio=4.0, depths=4)
TINY = dict(in_channels=2, img_size_h=32, img_size_w=32, patch_size=4, num_classes=10,
            embed_dims=32, num_heads=4, mlp_ratio=4.0, depths=2, v_threshold=0.5)
CIFAR10 = dict(in_channels=3, img_size_h=32, img_size_w=32, patch_size=4, num_classes=10,
               embed_dims=384, num_heads=12, mlp_ratio=4.0, depths=4)
IMAGENET_8_512 = dict(in_channels=3, img_size_h=224, img_size_w=224, patch_size=16, num_classes=1000,
                      embed_dims=512, num_heads=8, mlp_ratio=4.0, depths=8)

def _flavor(settings: dict, description: str) -> Flavor:
    shape = (settings["in_channels"], settings["img_size_h"], settings["img_size_w"])
    return Flavor(shape, settings["num_classes"], partial(build, **settings), description,
                  lambda classes: partial(build, **{**settings, "num_classes": classes}))


FAMILY = ModelFamily(
    name=NAME,
    flavors={
        "ti": _flavor(TI, "Spikformer-ti, ImageNet 224x224, 4.4M parameters"),
        "tiny": _flavor(TINY, "two blocks on 32x32 DVS frames, for tests"),
        "cifar10": _flavor(CIFAR10, "Spikformer-4-384 on 32x32 images (data sets cifar10, cifar100)"),
        "8-512": _flavor(IMAGENET_8_512, "Spikformer-8-512, ImageNet 224x224 (data set image_folder)"),
    },
)


@hookimpl
def snnfw_register_model_families(register):
    register(NAME, FAMILY, "Spikformer (SpikingJelly model zoo): spiking self-attention transformer")


@hookimpl
def snnfw_analyze(model, family):
    if family != NAME:
        return None
    stem = "net.patch_embed"
    blocks = tuple(f"net.blocks.{i}" for i in range(len(model.net.blocks)))
    convs = [f"{stem}.stages.{i}" for i in range(len(model.net.patch_embed.stages))] + [f"{stem}.positional_encoding"]
    tp_plan = [(name, "conv_bn_neuron") for name in convs]
    for block in blocks:
        tp_plan += [(f"{block}.attn", "self_attention_heads"), (f"{block}.mlp", "conv_mlp")]
    return AnalysisPart(blocks=(stem, *blocks), stage_units=(stem, *blocks, "net.head"), tp_plan=tuple(tp_plan))


@hookimpl
def snnfw_split_stages(model, plan):
    """The stem after the time-major transpose, one unit per block, the token mean with the head."""
    if plan.analysis.family != NAME:
        return None
    from torch import nn

    from snnfw.api import TimeMajor
    from snnfw_plugins.families.spikformer_model import MeanOverTokens

    net = model.net
    return [nn.Sequential(TimeMajor(), net.patch_embed), *net.blocks, nn.Sequential(MeanOverTokens(), net.head)]
