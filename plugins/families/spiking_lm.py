"""``spiking_lm``: a decoder-only spiking transformer language model in SpikeLM's manner.

Each token is presented for ``model.time_steps`` steps; the model takes token ids ``[N, T, S]`` and returns
logits ``[T, N, S, vocab]``, which the ``next_token`` loss (the family's default) averages over T and scores
against the next token. ``model.sequence_length`` sets S (the positions the model embeds).

- ``tiny``: 2 layers of hidden 32 (4 heads), the second a mixture of 4 experts (top-2), bytes, S = 16; for tests.
- ``small``: 4 layers of hidden 128 (4 heads), bytes, S = 64; trains on a laptop's CPU in minutes.
- ``1.4b``: SpikingJelly's published 1.41B SpikeLM shape: 24 layers of hidden 2048 (16 heads, MLP 8192), GPT-2's
  50,257 tokens, S = 128 (1,414,569,984 parameters).
- ``moe-1.4b-8e``: the same with every second MLP a mixture of 8 experts (top-2): 4,234,199,040 parameters,
  1,817,542,656 of them active a token.
"""

from functools import partial

from snnfw import hookimpl
from snnfw.api import AnalysisPart, Flavor, ModelFamily

NAME = "spiking_lm"
BYTES = 256
GPT2_VOCAB = 50257


def build(**settings):
    from snnfw_plugins.families.spiking_lm_model import SpikingLM

    return SpikingLM(**settings)


TINY = dict(vocab=BYTES, hidden=32, layers=2, heads=4, mlp_ratio=4.0, sequence_length=16, moe_layers=(1,), experts=4,
            top_k=2)
SMALL = dict(vocab=BYTES, hidden=128, layers=4, heads=4, mlp_ratio=4.0, sequence_length=64)
SPIKELM_1_4B = dict(vocab=GPT2_VOCAB, hidden=2048, layers=24, heads=16, mlp_ratio=4.0, sequence_length=128)
MOE_1_4B_8E = dict(SPIKELM_1_4B, moe_layers=tuple(range(1, 24, 2)), experts=8, top_k=2)


def _flavor(settings: dict, description: str) -> Flavor:
    return Flavor((settings["sequence_length"],), settings["vocab"], partial(build, **settings), description,
                  vocab=settings["vocab"], loss="next_token",
                  with_sequence_length=lambda length: partial(build, **{**settings, "sequence_length": length}))


FAMILY = ModelFamily(
    name=NAME,
    flavors={
        "tiny": _flavor(TINY, "2 layers of 32, one a mixture of 4 experts, bytes, 16 tokens; for tests"),
        "small": _flavor(SMALL, "4 layers of 128, bytes, 64 tokens; a laptop's CPU"),
        "1.4b": _flavor(SPIKELM_1_4B, "SpikeLM 1.41B: 24 layers of 2048, GPT-2's vocabulary, 128 tokens"),
        "moe-1.4b-8e": _flavor(MOE_1_4B_8E, "the 1.4b shape, every second MLP a mixture of 8 experts (top-2)"),
    },
)


@hookimpl
def snnfw_register_model_families(register):
    register(NAME, FAMILY, "decoder-only spiking transformer language model (SpikeLM), optional mixture of experts")


@hookimpl
def snnfw_analyze(model, family):
    if family != NAME:
        return None
    from snnfw_plugins.families.spiking_lm_model import MoEMLP

    layers = tuple(f"layers.{i}" for i in range(len(model.layers)))
    tp_plan = []
    for name, layer in zip(layers, model.layers):
        mlp = "moe_experts" if isinstance(layer.mlp, MoEMLP) else "spiking_linear_mlp"
        tp_plan += [(f"{name}.attn", "causal_attention_heads"), (f"{name}.mlp", mlp)]
    return AnalysisPart(blocks=("embed", *layers, "head"), stage_units=("embed", *layers, "head"),
                        tp_plan=tuple(tp_plan))


@hookimpl
def snnfw_split_stages(model, plan):
    """The embedding, one unit per layer, the head: the model's forward is their composition."""
    if plan.analysis.family != NAME:
        return None
    return [model.embed, *model.layers, model.head]
