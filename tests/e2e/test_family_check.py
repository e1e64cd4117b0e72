"""The plugin author's kit, ``snnfw.api.check_family``: the example plugin's family passes it; a family whose
neuron keeps a parameter that the tp shards share, without a rule to sum its gradient over them, fails it
naming the strategy and the step; and what a family's analysis does not allow is skipped, saying why."""

import re

import pytest

from snnfw.api import check_family
from snnfw.testing.distribution import install_distribution

# A spiking MLP whose hidden neurons scale their input by one learnable gain. Under tp each rank's neuron sees
# only its shard of the channels, so the gain's gradient is a partial sum unless a snnfw_shard_neuron rule sums
# it over the shards, as the example's rule does for PLIF's time constant: this plugin has no such rule.
GAIN_MLP = """
    import math
    from functools import partial

    import torch
    from torch import nn

    from snnfw.api import AnalysisPart, Flavor, ModelFamily, hookimpl


    def linear(n_in, n_out):
        from spikingjelly.activation_based import layer

        return layer.Linear(n_in, n_out, step_mode="m")


    def gain_lif():
        from spikingjelly.activation_based import neuron, surrogate

        class GainLIF(neuron.LIFNode):
            def __init__(self):
                super().__init__(tau=2.0, decay_input=False, detach_reset=True, surrogate_function=surrogate.ATan(),
                                 step_mode="m")
                self.gain = nn.Parameter(torch.tensor(1.0))

            def multi_step_forward(self, x_seq):
                return super().multi_step_forward(x_seq * self.gain)

        return GainLIF()


    class GainMLP(nn.Module):
        def __init__(self, in_features, dim, hidden, depth, classes):
            super().__init__()
            self.encoder = nn.Sequential(linear(in_features, dim), gain_lif())
            self.blocks = nn.Sequential(*(
                nn.Sequential(linear(dim, hidden), gain_lif(), linear(hidden, dim), gain_lif()) for _ in range(depth)))
            self.head = linear(dim, classes)
            for module in self.modules():
                if isinstance(module, nn.Linear):
                    nn.init.normal_(module.weight, std=3.0 / math.sqrt(module.in_features))

        def forward(self, frames):
            return self.head(self.blocks(self.encoder(frames.transpose(0, 1).flatten(2))))


    TINY = Flavor((2, 16, 16), 10, partial(GainMLP, 2 * 16 * 16, 64, 128, 2, 10), "16x16 frames, 2 blocks")


    @hookimpl
    def snnfw_register_model_families(register):
        register("gain_mlp", ModelFamily("gain_mlp", {"tiny": TINY}), "declares tp_plan, no stage_units")
        register("gain_mlp_bare", ModelFamily("gain_mlp_bare", {"tiny": TINY}), "declares nothing")


    @hookimpl
    def snnfw_analyze(model, family):
        if family != "gain_mlp":
            return None
        return AnalysisPart(tp_plan=(("blocks.0", "linear_mlp"), ("blocks.1", "linear_mlp")))
"""


@pytest.fixture
def gain_mlp(tmp_path, monkeypatch):
    return install_distribution(tmp_path, monkeypatch, "snnfw_gain_mlp", GAIN_MLP)


def test_the_example_family_trains_as_none_under_tp_and_pp(installed):
    report = check_family("spiking_mlp", ["tp", "pp", "fsdp2_tp"])
    assert report.checked == ("tp", "pp-gpipe")
    assert report.skipped == {"fsdp2_tp": "its layouts need 4 ranks; pass ranks=4 to check it"}


def test_a_neuron_that_ignores_its_sharding_fails_naming_strategy_and_step(gain_mlp):
    with pytest.raises(AssertionError) as nothing:  # planned only: nothing runs, and a check of nothing fails
        check_family("gain_mlp_bare", ["tp", "fsdp2_tp", "pp"], ranks=4)
    lines = str(nothing.value).splitlines()
    assert lines[0] == "model family 'gain_mlp_bare': trains as none does under nothing"
    assert [line.split(":")[0] for line in lines[1:4]] == ["  skipped tp", "  skipped fsdp2_tp", "  skipped pp-gpipe"]
    assert "declares no tp_plan" in lines[1] and "declares no tp_plan" in lines[2]
    assert "declares no stage_units" in lines[3] and lines[4].startswith("nothing was checked")
    with pytest.raises(AssertionError) as failed:
        check_family("gain_mlp", ["pp", "tp"])
    # step 1's loss is computed before any update; the partial gradient of the gain shows at step 2
    assert re.match(r"strategy tp: rank 0 step 2 losses: differs from none by", str(failed.value)), failed.value
