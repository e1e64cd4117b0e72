"""Strategies train to the same per-step losses as one process on the same chunks."""

import torch
from conftest import tiny_config

from snnfw.run.loop import run_training
from snnfw.testing import local_parameters, run_on_ranks

SPIKE_RATE = (0.02, 0.5)


def assert_same_losses(reference, summary, tol=1e-5):
    assert len(summary["losses"]) == len(reference["losses"]) == 3
    for step, (ref, got) in enumerate(zip(reference["losses"], summary["losses"]), start=1):
        assert abs(ref - got) <= tol, f"step {step}: loss {got} differs from reference {ref}"
    for rate in summary["spike_rates"]:
        assert SPIKE_RATE[0] <= rate <= SPIKE_RATE[1], f"spike rate {rate} outside {SPIKE_RATE}: neurons barely fire"


def parameters_and_buffers(trainer):
    buffers = {name: b.detach().clone() for name, b in getattr(trainer.model, "module", trainer.model).named_buffers()}
    return {"parameters": local_parameters(trainer), "buffers": buffers}


def assert_dp_matches_none(make_config, tmp_path):
    """dp on 2 ranks loses what none does with 2 microbatches; the replicas end identical, BatchNorm
    running statistics equal to none's included, so the test accuracy is none's."""
    reference = run_training(make_config("none", microbatches=2), on_finish=parameters_and_buffers)
    summaries = run_on_ranks(make_config("dp"), 2, tmp_path, inspect=parameters_and_buffers)
    for summary in summaries:
        assert_same_losses(reference, summary)
        assert summary["test_accuracy"] == reference["test_accuracy"]
        buffers = summary["inspect"]["buffers"]
        assert buffers.keys() == reference["inspect"]["buffers"].keys() and any("running_mean" in n for n in buffers)
        for name, tensor in reference["inspect"]["buffers"].items():
            assert torch.allclose(buffers[name], tensor, rtol=1e-5, atol=1e-7), f"buffer {name} differs from none's"
    params = [s["inspect"]["parameters"] for s in summaries]
    for name, tensor in params[0].items():
        assert torch.equal(tensor, params[1][name]), f"replicas differ in {name}"


def test_dp_two_ranks_matches_none_with_two_microbatches(tmp_path):
    assert_dp_matches_none(tiny_config, tmp_path)
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 3


def test_none_with_microbatches_equals_a_plain_pytorch_loop():
    """The data semantics: contiguous chunks, gradients accumulated as the mean, neurons reset per chunk."""
    import torch.nn.functional as F
    from spikingjelly.activation_based import functional

    from snnfw.data import batches as datalib
    from snnfw.plan.prepare import build_model
    from snnfw.plugin.manager import Plugins

    config = tiny_config("none", microbatches=2)
    summary = run_training(config)

    plugins = Plugins()
    model, spec = build_model(config, plugins)
    dataset = plugins.datasets.get("synthetic_dvs").build(config.data, spec, "train", config.train.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.train.lr)
    losses = []
    for step in range(3):
        indices = datalib.global_batch_indices(step, 8, len(dataset), config.train.seed)
        total = 0.0
        for chunk in indices.chunk(2):
            frames, labels = datalib.load(dataset, chunk, torch.device("cpu"))
            functional.reset_net(model)
            loss = F.cross_entropy(model(frames).mean(0), labels)
            (loss / 2).backward()
            total += loss.item() / 2
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    assert_same_losses({"losses": losses}, summary, tol=1e-6)
