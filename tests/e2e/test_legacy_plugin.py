"""A family plugin written against 0.1.0's documented imports (``snnfw.analysis``, ``snnfw.families``,
``snnfw.modules``), deprecated through 0.2 and removed in 0.3.0, fails to load and is listed with what to import
instead; the same plugin importing from ``snnfw.api`` loads and registers its family (the example plugin of the same
model, examples/spiking_mlp_plugin, trains as none does in the guarantee and tests/e2e/test_third_party.py)."""

import json

from snnfw.cli import main
from snnfw.testing.distribution import install_distribution

# The example plugin (examples/spiking_mlp_plugin) as 0.1.0's docs had it import, model and family in one module.
LEGACY = """
    import math
    from functools import partial

    from torch import nn

    from snnfw import hookimpl
    from snnfw.analysis import AnalysisPart
    from snnfw.families import Flavor, ModelFamily
    from snnfw.modules import TimeMajor

    NAME = "legacy_mlp"


    def plif():
        from spikingjelly.activation_based import neuron, surrogate

        return neuron.ParametricLIFNode(init_tau=2.0, decay_input=False, detach_reset=True,
                                        surrogate_function=surrogate.ATan(), step_mode="m")


    def linear(n_in, n_out):
        from spikingjelly.activation_based import layer

        return layer.Linear(n_in, n_out, step_mode="m")


    class SpikingMLP(nn.Module):
        def __init__(self, in_features, dim, hidden, depth, classes):
            super().__init__()
            self.encoder = nn.Sequential(linear(in_features, dim), plif())
            self.blocks = nn.Sequential(*(nn.Sequential(linear(dim, hidden), plif(), linear(hidden, dim), plif())
                                          for _ in range(depth)))
            self.head = linear(dim, classes)
            for module in self.modules():
                if isinstance(module, nn.Linear):
                    nn.init.normal_(module.weight, std=3.0 / math.sqrt(module.in_features))

        def forward(self, frames):
            return self.head(self.blocks(self.encoder(frames.transpose(0, 1).flatten(2))))


    FAMILY = ModelFamily(NAME, {"tiny": Flavor((2, 16, 16), 10, partial(SpikingMLP, 2 * 16 * 16, 64, 128, 2, 10),
                                               "16x16 frames, 2 blocks")})


    @hookimpl
    def snnfw_register_model_families(register):
        register(NAME, FAMILY, "the spiking MLP written for snnfw 0.1.0")


    @hookimpl
    def snnfw_analyze(model, family):
        if family != NAME:
            return None
        blocks = tuple(f"blocks.{i}" for i in range(len(model.blocks)))
        return AnalysisPart(blocks=("encoder", *blocks), stage_units=("encoder", *blocks, "head"),
                            tp_plan=tuple((block, "linear_mlp") for block in blocks))


    @hookimpl(tryfirst=True)
    def snnfw_shard_neuron(module, placement, mesh):
        from spikingjelly.activation_based.neuron import ParametricLIFNode

        if not isinstance(module, ParametricLIFNode):
            return None

        def sum_over_shards(module, args):
            if not getattr(module.w, "_summed", False):
                module.w.register_hook(lambda grad: placement.all_reduce(grad.clone()))
                module.w._summed = True

        module.register_forward_pre_hook(sum_over_shards)
        return module


    @hookimpl
    def snnfw_split_stages(model, plan):
        if plan.analysis.family != NAME:
            return None
        return [nn.Sequential(TimeMajor(), nn.Flatten(2), model.encoder), *model.blocks, model.head]
"""
CURRENT = LEGACY.replace("""
    from snnfw.analysis import AnalysisPart
    from snnfw.families import Flavor, ModelFamily
    from snnfw.modules import TimeMajor
""", """
    from snnfw.api import AnalysisPart, Flavor, ModelFamily, TimeMajor
""")


def test_a_plugin_of_0_1_0_s_imports_is_listed_as_failed_with_what_to_import_instead(tmp_path, monkeypatch, capsys):
    install_distribution(tmp_path, monkeypatch, "snnfw_legacy_mlp", LEGACY, version="0.1.0")
    assert main(["plugins", "--json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert rows["snnfw_legacy_mlp"]["error"] == (
        "ModuleNotFoundError(\"No module named 'snnfw.analysis'\"); snnfw.analysis was removed in snnfw 0.3.0: import "
        "its public names from snnfw.api")


def test_the_plugin_importing_from_the_api_is_listed_with_its_family(tmp_path, monkeypatch, capsys):
    install_distribution(tmp_path, monkeypatch, "snnfw_legacy_mlp", CURRENT, version="0.1.1")
    assert main(["plugins", "--json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert rows["snnfw_legacy_mlp"]["registers"] == {"model family": ["legacy_mlp"]} and not rows["snnfw_legacy_mlp"]["error"]
