"""Spikes packed 8 to a byte (``spike_bits``): what tp's gathers and pp's stage boundaries send."""

import weakref

import pytest
import torch

from snnfw.errors import PlanError
from snnfw.plan.prepare import prepare
from snnfw.plugin.manager import Plugins
from snnfw.testing import tiny_config
from snnfw_plugins.strategies.spike_bits import NeuronOutputs, check_binary, pack, packed_numel, unpack


@pytest.mark.parametrize("shape", [(1,), (7,), (8,), (2, 3, 5, 9)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_spikes_come_back_as_they_were_sent_in_an_eighth_of_the_bytes(shape, dtype):
    spikes = (torch.rand(shape, generator=torch.Generator().manual_seed(0)) < 0.3).to(dtype)
    packed = pack(spikes)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_numel(spikes.numel()) == -(-spikes.numel() // 8)
    assert torch.equal(unpack(packed, shape, dtype), spikes)


def test_bits_are_packed_least_significant_first():
    assert pack(torch.tensor([1.0, 0, 0, 0, 0, 0, 0, 1, 1])).tolist() == [129, 1]


def test_a_tensor_that_is_not_zero_or_one_is_refused_with_the_way_out():
    check_binary(torch.tensor([0.0, 1.0]), "here")
    for bad in (0.5, 2.0, float("nan")):
        with pytest.raises(RuntimeError, match="here: .* not 0/1 .* parallel.pack_spikes = false"):
            check_binary(torch.tensor([0.0, bad]), "here")


def test_only_the_tensor_a_neuron_returned_counts_as_spikes():
    from spikingjelly.activation_based import neuron

    lif = neuron.LIFNode(step_mode="m")
    outputs = NeuronOutputs([lif])
    spikes = lif(torch.rand(2, 3))
    assert not outputs.produced(spikes.clone()) and not outputs.produced(spikes)  # forgotten once asked
    spikes = lif(torch.rand(2, 3))
    assert outputs.produced(spikes)
    kept = weakref.ref(lif(torch.rand(2, 3)))  # a backward's recomputed output, which nothing asks about
    assert kept() is None, "the remembered output is held alive"


@pytest.mark.parametrize("strategy, world", [("dp", 2), ("none", 1), ("fsdp2_tsp", 4)])
def test_pack_spikes_is_refused_where_no_activations_cross_ranks(strategy, world):
    with pytest.raises(PlanError, match="parallel.pack_spikes applies to the mesh dimensions that send spikes"):
        prepare(tiny_config(strategy, parallel={"pack_spikes": False}), world, Plugins())


def test_pack_spikes_applies_to_every_mesh_with_a_tensor_or_pipeline_dimension():
    plugins = Plugins()
    for parallel in ({"strategy": "fsdp2_tp"}, {"strategy": "mesh", "mesh": {"dp_replicate": 2, "tp": 2}}):
        plan = prepare(tiny_config(**{"parallel": {"pack_spikes": False, **parallel}}), 4, plugins).plan
        assert not plan.config.parallel.pack_spikes
