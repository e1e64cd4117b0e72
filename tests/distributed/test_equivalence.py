"""Strategies train to the same per-step losses as one process on the same chunks."""

import torch

from snnfw.run.loop import run_training
from snnfw.testing import tiny_config
from snnfw.testing.checks import assert_dp_matches_none, assert_same_losses


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
