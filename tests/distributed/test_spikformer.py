"""The ``spikformer`` family: sizes, shapes, analysis, firing rates, learning and dp equivalence."""

import pytest
import torch

from snnfw.model.analysis import analyze
from snnfw.plugin.manager import Plugins
from snnfw.run.loop import run_training
from snnfw.testing import tiny_config
from snnfw.testing.checks import assert_dp_matches_none

FIRING_RATE = (0.01, 0.5)
ATTENTION_NEURONS = ("qkv_lif", "attn_lif", "proj_lif")


def build(flavor):
    torch.manual_seed(0)
    return Plugins().families.get("spikformer").flavor(flavor).build()


def spikformer_config(strategy="none", microbatches=1, **sections):
    return tiny_config(strategy, microbatches, model={"family": "spikformer"}, **sections)


@pytest.mark.parametrize("flavor, parameters", [("ti", 4_400_392), ("tiny", 41_578)])
def test_flavor_parameter_counts(flavor, parameters):
    assert sum(p.numel() for p in build(flavor).parameters()) == parameters


def test_tiny_maps_frames_to_logits_per_time_step():
    with torch.no_grad():
        logits = build("tiny")(torch.rand(3, 4, 2, 32, 32).round())
    assert logits.shape == (4, 3, 10)


def test_analysis_names_the_stem_blocks_head_and_tensor_parallel_units():
    from spikingjelly.activation_based.layer.attention import SpikingSelfAttention
    from spikingjelly.activation_based.model.spikformer import SpikformerConv2dBNLIF, SpikformerMLP

    model = build("tiny")
    analysis = analyze(model, "spikformer", Plugins())
    assert analysis.blocks == ("net.patch_embed", "net.blocks.0", "net.blocks.1")
    assert analysis.stage_units == analysis.blocks + ("net.head",)
    styles = {"conv_bn_neuron": SpikformerConv2dBNLIF, "self_attention_heads": SpikingSelfAttention, "conv_mlp": SpikformerMLP}
    planned = {name for name, _ in analysis.tp_plan}
    for name, style in analysis.tp_plan:
        assert isinstance(model.get_submodule(name), styles[style]), name
    for name, module in model.named_modules():
        if isinstance(module, tuple(styles.values())):
            assert name in planned, f"{name} missing from the tensor-parallel plan"
    assert not any(name.startswith("net.head") for name in planned)


def firing_rates(trainer):
    """Each neuron module's firing rate on one training batch, in train mode."""
    from spikingjelly.activation_based import functional
    from spikingjelly.activation_based.neuron import BaseNode

    from snnfw.data import batches as datalib

    model = getattr(trainer.model, "module", trainer.model)
    rates = {}

    def record(name):
        return lambda module, inputs, output: rates.__setitem__(name, float(output.mean()))

    handles = [m.register_forward_hook(record(name)) for name, m in model.named_modules() if isinstance(m, BaseNode)]
    frames, _ = datalib.load(trainer.train_set, torch.arange(8), trainer.device)
    model.train()
    functional.reset_net(model)
    with torch.no_grad():
        model(frames)
    for handle in handles:
        handle.remove()
    return rates


def test_every_neuron_group_fires_after_training_steps():
    rates = run_training(spikformer_config(), on_finish=firing_rates)["inspect"]
    assert len(rates) == 5 + 2 * 5
    for block in range(2):
        assert {f"net.blocks.{block}.attn.{n}" for n in ATTENTION_NEURONS} <= rates.keys()
    for name, rate in rates.items():
        assert FIRING_RATE[0] <= rate <= FIRING_RATE[1], f"{name} fires at {rate:.2%}, outside {FIRING_RATE}"


def test_tiny_learns_on_synthetic_dvs():
    losses = run_training(
        spikformer_config(train={"steps": 25, "lr": 0.003}, data={"batch_size": 16, "train_samples": 256, "test_samples": 16})
    )["losses"]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.3, f"mean loss went from {first:.3f} to {last:.3f}"


def test_dp_two_ranks_matches_none_with_two_microbatches(tmp_path):
    assert_dp_matches_none(spikformer_config, tmp_path)
