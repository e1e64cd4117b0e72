"""``spiking_mlp``: a model family that snnfw does not ship, registered as any package would.

Frames ``[N, T, C, H, W]`` are flattened per time step, encoded by a Linear
layer and a parametric LIF neuron (learnable time constant), passed through
residual-free MLP blocks (Linear, PLIF, Linear, PLIF) and classified. The
plugin declares what snnfw's strategies need: FSDP2 blocks, a tensor-parallel
plan (torch's column- then row-parallel Linear styles), pipeline stage units,
and a shard rule for its neuron, whose learnable ``w`` must see the gradient
of every channel, not only the local ones. The modules live in ``model.py``,
imported only when a model is built, so that loading plugins stays fast.
"""

from functools import partial

from snnfw.api import AnalysisPart, Flavor, ModelFamily, hookimpl

NAME = "spiking_mlp"


def build(*args):
    from snnfw_spiking_mlp.model import SpikingMLP

    return SpikingMLP(*args)


FAMILY = ModelFamily(
    name=NAME,
    flavors={
        "tiny": Flavor((2, 16, 16), 10, partial(build, 2 * 16 * 16, 64, 128, 2, 10), "16x16 frames, 2 blocks"),
        "base": Flavor((2, 48, 48), 10, partial(build, 2 * 48 * 48, 512, 2048, 4, 10), "48x48 frames, 4 blocks"),
    },
)


@hookimpl
def snnfw_register_model_families(register):
    register(NAME, FAMILY, "spiking MLP with parametric LIF neurons (out-of-tree example)")


@hookimpl
def snnfw_analyze(model, family):
    if family != NAME:
        return None
    blocks = tuple(f"blocks.{i}" for i in range(len(model.blocks)))
    return AnalysisPart(
        blocks=("encoder", *blocks),
        stage_units=("encoder", *blocks, "head"),
        tp_plan=tuple((block, "linear_mlp") for block in blocks),
    )


@hookimpl(tryfirst=True)
def snnfw_shard_neuron(module, placement, mesh):
    """A PLIF's time constant is one scalar for all channels: sum its gradient over the shards."""
    from spikingjelly.activation_based.neuron import ParametricLIFNode

    if not isinstance(module, ParametricLIFNode):
        return None

    def sum_over_shards(module, args):
        # The w that forward uses: the parameter itself, or FSDP2's unsharded copy (under fsdp2_tp), which
        # is another tensor than the one seen here; each gets the hook once.
        w = module.w
        if not getattr(w, "_snnfw_summed_over_tp", False):
            w.register_hook(lambda grad: placement.all_reduce(grad.clone()))  # counted in tp_allreduce_calls
            w._snnfw_summed_over_tp = True

    module.register_forward_pre_hook(sum_over_shards)
    return module


@hookimpl
def snnfw_split_stages(model, plan):
    """Pipeline units: the time-major flatten with the encoder, each block, the head."""
    if plan.analysis.family != NAME:
        return None
    from torch import nn

    from snnfw.api import TimeMajor

    return [nn.Sequential(TimeMajor(), nn.Flatten(2), model.encoder), *model.blocks, model.head]
