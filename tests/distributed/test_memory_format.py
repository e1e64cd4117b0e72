"""``model.memory_format``: channels-last convolutions train to the contiguous model's losses in every strategy;
``auto`` decides by measurement and leaves the run as the layout it chose would run it."""

import pytest
import torch
from torch import nn

from snnfw.config import build_config
from snnfw.errors import ConfigError, PlanError
from snnfw.plan.prepare import prepare
from snnfw.plugin.manager import Plugins
from snnfw.run.loop import run_training
from snnfw.testing import run_on_ranks, tiny_config

REL_TOL = 1e-9  # float64: rounding cannot hide a wrong layout's values
STRATEGIES = {"dp": 2, "fsdp2": 2, "tp": 2, "pp": 2}
MICROBATCHES = {"none": 2, "dp": 1, "fsdp2": 1, "tp": 2, "pp": 2}  # each replica's: the reference's 2 in all


def mlp():
    from spikingjelly.activation_based import layer, neuron

    return nn.Sequential(layer.Flatten(step_mode="m"), layer.Linear(2 * 8 * 8, 10, step_mode="m"), neuron.LIFNode(step_mode="m"))


def config(strategy="none", dtype="float64", **model):
    return tiny_config(strategy, MICROBATCHES[strategy], train={"dtype": dtype}, model=model)


def is_channels_last(tensor: torch.Tensor) -> bool:
    """Channels-last images; a multi-step ``[T, N, C, H, W]`` sequence as ``T x N`` of them."""
    images = tensor.flatten(0, 1) if tensor.dim() == 5 else tensor
    return images.is_contiguous(memory_format=torch.channels_last) and not images.is_contiguous()


def channels_last_layouts(trainer) -> list[bool]:
    """Whether, in one more training step (step 1's batches), every 2-D convolution's output, every pooling's
    input and the gradient reaching every neuron's output are channels-last: a collective that lost the layout
    (tp's channel gather, say) would leave the pooling and BatchNorm around it on their slow contiguous kernels."""
    from spikingjelly.activation_based.neuron import BaseNode

    seen = []

    def gradient_layout(m, args, out):
        out.register_hook(lambda grad: seen.append(is_channels_last(grad)))

    hooks = [(nn.Conv2d, "register_forward_hook", lambda m, args, out: seen.append(is_channels_last(out))),
             (nn.AvgPool2d, "register_forward_pre_hook", lambda m, args: seen.append(is_channels_last(args[0]))),
             (BaseNode, "register_forward_hook", gradient_layout)]
    handles = [getattr(m, register)(hook) for m in trainer.model.modules() for kind, register, hook in hooks if isinstance(m, kind)]
    trainer.step(0)
    for handle in handles:
        handle.remove()
    return seen


@pytest.fixture(scope="module")
def contiguous():
    return run_training(config(), on_finish=channels_last_layouts)


def assert_same_losses(got, want):
    for step, (loss, ref) in enumerate(zip(got, want, strict=True), start=1):
        assert abs(loss - ref) <= REL_TOL * abs(ref), f"step {step}: {loss} against contiguous {ref}"


def test_contiguous_is_the_default_and_keeps_torch_layout(contiguous):
    assert contiguous["inspect"] and not any(contiguous["inspect"])


@pytest.mark.parametrize("strategy", ["none", *STRATEGIES])
def test_channels_last_trains_to_the_contiguous_losses(strategy, contiguous, tmp_path):
    chosen = config(strategy, memory_format="channels_last")
    if strategy == "none":
        summaries = [run_training(chosen, on_finish=channels_last_layouts)]
    else:
        summaries = run_on_ranks(chosen, STRATEGIES[strategy], tmp_path, inspect=channels_last_layouts, timeout_s=240)
    for summary in summaries:
        assert_same_losses(summary["losses"], contiguous["losses"])
    layouts = [layout for summary in summaries for layout in summary["inspect"]]
    assert layouts and all(layouts), f"{strategy}: convolution outputs, pooling inputs, neuron gradients channels-last: {layouts}"


def test_auto_measures_both_layouts_and_trains_as_its_choice():
    auto = run_training(config(dtype="float32", memory_format="auto"))
    timed = [auto[f"memory_format_{layout}_ms"] for layout in ("contiguous", "channels_last")]
    assert all(ms > 0 for ms in timed)
    chosen = "channels_last" if auto["memory_format_channels_last"] else "contiguous"
    assert (timed[1] < timed[0]) == (chosen == "channels_last")
    explicit = run_training(config(dtype="float32", memory_format=chosen))
    assert auto["losses"] == explicit["losses"]  # the trials left parameters, statistics, state and RNG alone
    assert "memory_format_contiguous_ms" not in explicit


def test_a_model_without_convolutions_refuses_a_layout():
    own = {"builder": f"{__file__}:mlp", "input_shape": [2, 8, 8], "num_classes": 10, "input_layout": "TN"}
    with pytest.raises(PlanError, match="memory_format = 'channels_last' lays out the inputs of 2-D convolutions"):
        prepare(build_config({"model": {**own, "memory_format": "channels_last"}}), 1, Plugins())


def test_an_unknown_layout_is_a_config_error():
    with pytest.raises(ConfigError, match="'memory_format' must be in"):
        build_config({"model": {"memory_format": "nhwc"}})
