"""``sequence_mlp``: a spiking MLP for channel sequences such as the Spiking Heidelberg Digits (700 channels).

Each time step's frame is flattened into channels and passed through blocks of a 1x1 Conv1d, BatchNorm and
LIF, then a Linear head. ``shd`` is sized for SHD's frames ``[T, 1, 1, 700]`` (data set ``shd``) and 20 classes;
``tiny`` takes 2 x 8 x 8 frames, for tests.
"""

from functools import partial

from snnfw import hookimpl
from snnfw.api import AnalysisPart, Flavor, ModelFamily

NAME = "sequence_mlp"


def build(*args):
    from snnfw_plugins.families.sequence_mlp_model import SequenceMLP

    return SequenceMLP(*args)


def _flavor(shape: tuple[int, int, int], widths: tuple[int, ...], classes: int, description: str) -> Flavor:
    features = shape[0] * shape[1] * shape[2]
    return Flavor(shape, classes, partial(build, features, widths, classes), description,
                  lambda n: partial(build, features, widths, n))


FAMILY = ModelFamily(
    name=NAME,
    flavors={
        "shd": _flavor((1, 1, 700), (256, 256), 20, "SHD's 700 channels, two blocks of 256, 20 classes"),
        "tiny": _flavor((2, 8, 8), (64, 64, 64), 10, "2 x 8 x 8 frames as 128 channels, three blocks of 64, for tests"),
    },
)


@hookimpl
def snnfw_register_model_families(register):
    register(NAME, FAMILY, "spiking MLP over channel sequences (SHD)")


@hookimpl
def snnfw_analyze(model, family):
    if family != NAME:
        return None
    blocks = tuple(f"blocks.{i}" for i in range(len(model.blocks)))
    return AnalysisPart(blocks=blocks, stage_units=(*blocks, "head"),
                        tp_plan=tuple((block, "conv_bn_neuron") for block in blocks))


@hookimpl
def snnfw_split_stages(model, plan):
    """One unit per block, the time-major flatten before the first."""
    if plan.analysis.family != NAME:
        return None
    from torch import nn

    first, *rest = model.blocks
    return [nn.Sequential(model.to_channels, first), *rest, model.head]
