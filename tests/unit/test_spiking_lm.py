"""The spiking language model family, its next-token loss and the python_bytes corpus, in one process: the tiny
flavor's neurons fire, its mixture of experts computes every routed token and carries its load-balancing loss into
the training loss, the corpus gives next-byte windows, and the keys that do not apply are refused."""

import math

import pytest
import torch
import torch.nn.functional as F

from snnfw.api import is_neuron
from snnfw.components.losses import next_token
from snnfw.components.step import hits
from snnfw.config import build_config
from snnfw.errors import ConfigError, PlanError
from snnfw.plan.prepare import build_datasets, build_model, prepare
from snnfw.plugin.manager import Plugins
from snnfw_plugins.families.spiking_lm_model import MoEMLP

LENGTH, STEPS = 16, 4


def lm_config(**model):
    return build_config({
        "model": {"family": "spiking_lm", "flavor": "tiny", "time_steps": STEPS, **model},
        "data": {"name": "python_bytes", "batch_size": 8, "train_samples": 64, "test_samples": 16},
        "train": {"steps": 1, "seed": 3, "dtype": "float64"},
    })


@pytest.fixture(scope="module")
def plugins():
    return Plugins()


@pytest.fixture(scope="module")
def built(plugins):
    """The tiny model in float64 and a batch of 8 training windows."""
    config = lm_config()
    model, spec = build_model(config, plugins)
    train, _ = build_datasets(config, spec, plugins)
    ids = torch.stack([train[i][0] for i in range(8)])
    labels = torch.stack([train[i][1] for i in range(8)])
    return model.double(), ids, labels


def reset(model):
    from spikingjelly.activation_based import functional

    functional.reset_net(model)


def test_the_tiny_flavor_has_a_mixture_of_experts_and_every_neuron_layer_fires(built):
    model, ids, _ = built
    assert any(isinstance(m, MoEMLP) for m in model.modules())
    rates = {}
    hooks = [m.register_forward_hook(lambda m, a, out, name=name: rates.__setitem__(name, out.mean().item()))
             for name, m in model.named_modules() if is_neuron(m)]
    reset(model)
    model.train()
    with torch.no_grad():
        model(ids)
    for hook in hooks:
        hook.remove()
    assert len(rates) == 15 and all(0.001 < rate < 0.5 for rate in rates.values()), rates


def test_training_logits_carry_the_balance_loss_that_next_token_adds_and_evaluation_scores_the_tokens_alone(built):
    model, ids, labels = built
    moe = next(m for m in model.modules() if isinstance(m, MoEMLP))
    balance = []
    moe.register_forward_hook(lambda m, a, out: balance.append(out[1]))
    reset(model)
    model.train()
    logits = model(ids)
    assert logits.shape == (STEPS, 8, LENGTH + 1, 256)
    (aux,) = balance
    assert aux.shape == (STEPS,) and bool((aux > 0).all())
    scored = F.cross_entropy(logits[:, :, :LENGTH].mean(0).flatten(0, 1), labels.flatten())
    loss = next_token({})(logits, labels)
    assert torch.allclose(loss, scored + aux.mean(), rtol=1e-12, atol=0)
    loss.backward()
    assert moe.router.weight.grad.abs().sum() > 0
    reset(model)
    model.eval()
    with torch.no_grad():
        plain = model(ids)
    assert plain.shape == (STEPS, 8, LENGTH, 256)
    assert torch.equal(next_token({})(plain, labels), F.cross_entropy(plain.mean(0).flatten(0, 1), labels.flatten()))


def test_the_mixture_computes_every_routed_token_as_dense_experts_would_and_repeats_itself():
    torch.manual_seed(0)
    moe = MoEMLP(hidden=16, inner=32, experts=4, top_k=2, aux_weight=0.01).double()
    x = torch.randn(STEPS, 3, 5, 16, dtype=torch.float64) * 2
    out, _ = moe(x)
    reset(moe)
    again, _ = moe(x)
    assert torch.equal(out, again)
    reset(moe)
    spikes = moe.input_lif(moe.norm(x)).reshape(-1, 16)
    _, chosen, weights = moe.route(spikes)
    dense = torch.zeros_like(spikes)
    for index, expert in enumerate(moe.experts):
        hit = chosen == index
        current = expert.fc1(spikes) * hit.any(-1, keepdim=True)  # no current where the token is not routed here
        fired = expert.lif(current.view(STEPS, 15, -1)).view(-1, current.shape[-1]) * hit.any(-1, keepdim=True)
        dense += expert.fc2(fired) * (weights * hit).sum(-1, keepdim=True)
    assert torch.allclose(out.reshape(-1, 16), dense, rtol=1e-12, atol=1e-12)
    assert bool((chosen.unsqueeze(-1) == torch.arange(4)).any(1).sum(-1).eq(2).all())  # dropless: top_k each


def test_balance_loss_is_the_weight_where_the_router_is_uniform():
    moe = MoEMLP(hidden=8, inner=8, experts=4, top_k=2, aux_weight=0.01).double()
    torch.nn.init.zeros_(moe.router.weight)
    _, aux = moe(torch.randn(STEPS, 2, 3, 8, dtype=torch.float64))
    assert torch.allclose(aux, torch.full((STEPS,), 0.01, dtype=torch.float64), rtol=1e-12)


def test_python_bytes_windows_are_next_byte_pairs_of_two_disjoint_splits(plugins):
    config = lm_config()
    _, spec = build_model(config, plugins)
    train, test = build_datasets(config, spec, plugins)
    assert (len(train), len(test)) == (64, 16)
    ids, targets = train[5]
    assert ids.shape == (STEPS, LENGTH) and targets.shape == (LENGTH,) and ids.dtype == torch.long
    assert torch.equal(ids[0], ids[-1]) and torch.equal(ids[0, 1:], targets[:-1])
    again, _ = build_datasets(config, spec, plugins)
    assert torch.equal(again[5][0], ids)
    assert bytes(test[0][0][0].tolist()) != bytes(ids[0].tolist())


def test_sequence_length_sets_the_model_and_the_windows_and_next_token_is_the_default_loss(plugins):
    config = lm_config(sequence_length=8)
    prepared = prepare(config, 1, plugins)
    assert prepared.spec.shape == (8,) and prepared.spec.vocab == 256
    assert prepared.plan.config.train.loss == "next_token"
    assert any("next_token" in line for line in prepared.plan.rationale)
    assert prepared.model.embed.positions.num_embeddings == 8


@pytest.mark.parametrize("data, message", [
    ({"model": {"family": "sequence_mlp", "flavor": "tiny", "sequence_length": 8}},
     "model.sequence_length applies to language models"),
    ({"model": {"family": "sequence_mlp", "flavor": "tiny"}, "data": {"name": "python_bytes"}},
     "gives token sequences for a language model"),
    ({"model": {"family": "spiking_lm", "flavor": "tiny"}, "data": {"name": "synthetic_dvs"}},
     "reads token ids, and data set 'synthetic_dvs' gives frames"),
    ({"model": {"family": "spiking_lm", "flavor": "tiny"}, "data": {"name": "python_bytes", "augment": ["roll"]}},
     "data.augment transforms frames, and data set 'python_bytes' gives token ids"),
    ({"model": {"family": "spiking_lm", "flavor": "tiny"}, "data": {"name": "python_bytes"},
      "train": {"steps": 1, "label_smoothing": 0.1}},
     r"train.label_smoothing does not apply to train.loss = 'next_token'"),
])
def test_keys_and_data_that_do_not_apply_are_refused(plugins, data, message):
    config = build_config({"train": {"steps": 1}, **data})
    with pytest.raises(ConfigError, match=message):
        prepare(config, 1, plugins)


def test_a_language_model_sample_scores_its_share_of_right_positions():
    logits = torch.zeros(2, 2, 3, 4)
    logits[:, 0, :, 1] = 1.0  # sample 0 predicts token 1 everywhere
    logits[:, 1, :, 2] = 1.0
    labels = torch.tensor([[1, 1, 0], [2, 0, 0]])
    assert math.isclose(float(hits(logits, labels)), 2 / 3 + 1 / 3)


def test_the_1_4b_flavor_has_spikelm_s_parameter_count(plugins):
    flavor = plugins.families.get("spiking_lm").flavor("1.4b")
    with torch.device("meta"):
        model = flavor.build()
    assert sum(p.numel() for p in model.parameters()) == 1_414_569_984


def test_a_language_model_s_progress_line_shows_tokens_a_second_and_the_validation_s_bits_per_byte():
    from snnfw.components.metrics import progress_line

    record = {"step": 10, "epoch": 0.5, "loss": 2.5, "train_acc": 0.25, "spike_rate": 0.05, "step_ms": 1000.0,
              "samples_per_s": 32.0, "tokens_per_s": 2048.0, "eval_loss": 2.0, "eval_ppl": math.exp(2.0),
              "eval_acc": 0.4, "eval_bpb": 2.0 / math.log(2)}
    assert progress_line(record, 100, 16.0) == ("[snnfw] step 10/100 epoch 0.50 loss 2.5000 acc 25.0% spikes 5.0% 1000 ms "
                                               "1024 tokens/s | eval loss 2.0000 ppl 7.39 bpb 2.885")


def test_next_tokens_outside_the_vocabulary_are_refused_naming_the_item():
    from snnfw.data.batches import check_labels

    good = [(torch.zeros(STEPS, 3, dtype=torch.long), torch.tensor([1, 2, 255]))] * 8
    check_labels(good, 256, "train")
    bad = good[:7] + [(good[0][0], torch.tensor([1, 300, 2]))]
    with pytest.raises(ConfigError, match="item 7 of the train data set has label 300, outside the model's classes"):
        check_labels(bad, 256, "train")


def test_the_plain_loop_trains_a_language_model_with_snnfws_losses():
    """benchmark/spiking_lm.py times snnfw beside the plain loop: both train the same steps to the same losses, the
    gradients clipped alike (the recipe clips them)."""
    import snnfw
    from snnfw.tools.baseline import PlainLoop

    config = lm_config()
    config = build_config({**config.to_dict(), "train": {**config.to_dict()["train"], "steps": 2, "lr": 0.05,
                                                         "clip_grad_norm": 0.01}})
    plain = PlainLoop(config, torch.device("cpu"))
    plain_losses = [plain.step(step) for step in range(2)]
    with snnfw.start(config) as run:
        losses = [run.step(step)["loss"] for step in range(2)]
    assert plain_losses == pytest.approx(losses, rel=1e-9) and losses[0] != losses[1]


def test_a_model_too_large_to_measure_here_is_measured_through_copies_with_one_and_two_of_its_blocks(plugins,
                                                                                                      monkeypatch):
    """auto's measurement of a model whose step does not fit this host (the 1.4b flavor here): the small flavor's
    parameters, saved-for-backward and neuron state bytes extrapolated from its 1- and 2-layer copies equal its own."""
    from snnfw.plan import auto

    config = lm_config(flavor="small")
    prepared = prepare(config, 1, plugins)
    model, spec, blocks = prepared.model, prepared.spec, prepared.analysis.blocks
    whole = auto.measure(model, spec, plugins, config.train, 1, blocks=blocks)
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    monkeypatch.setattr(auto, "_available_memory", lambda: auto.MEASURE_COPIES * held - 1)  # its copies fit, it not
    proxied = auto.measure(model, spec, plugins, config.train, 1, blocks=blocks)
    assert proxied.parameters == whole.parameters == sum(p.numel() for p in model.parameters())
    assert proxied.activation_bytes == pytest.approx(whole.activation_bytes, rel=1e-12) and whole.activation_bytes > 0
    assert proxied.neuron_state_bytes == pytest.approx(whole.neuron_state_bytes, rel=1e-12)
    assert proxied.step_ms > 0
    tiny = prepare(lm_config(), 1, plugins)  # two layers, one of them a mixture of experts: no run to shorten
    monkeypatch.setattr(auto, "_available_memory", lambda: 1024)
    with pytest.raises(PlanError, match="nor has it a run of identical blocks to measure a smaller copy of"):
        auto.measure(tiny.model, tiny.spec, plugins, config.train, 1, blocks=tiny.analysis.blocks)
