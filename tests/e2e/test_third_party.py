"""An out-of-tree family, installed with pip the way a user would, trains under snnfw's strategies."""

import json
import os
import subprocess
import sys

import pytest
import torch

from snnfw.run.loop import run_training
from snnfw.testing import full_parameters, run_on_ranks, tiny_config
from snnfw.testing.checks import assert_same_losses


def mlp(strategy, **sections):
    return tiny_config(strategy, model={"family": "spiking_mlp"}, **sections)


def test_installed_plugin_is_listed(installed):
    env = {**os.environ, "PYTHONPATH": f"{installed}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, "-m", "snnfw", "plugins", "--json"], capture_output=True, text=True, env=env, timeout=60)
    rows = {row["name"]: row for row in json.loads(done.stdout)}
    assert rows["spiking_mlp"]["distribution"] == "snnfw-spiking-mlp"
    assert rows["spiking_mlp"]["registers"] == {"model family": ["spiking_mlp"]}
    assert "snnfw_shard_neuron" in rows["spiking_mlp"]["hooks"]


def w_and_shards(trainer):
    model = trainer.model
    plif = [m for m in model.modules() if hasattr(m, "w") and hasattr(m, "snnfw_shard")]
    return {"params": full_parameters(trainer), "sharded": len(plif)}


@pytest.mark.parametrize("strategy, nproc, micro", [("dp", 2, 2), ("fsdp2", 2, 2), ("tp", 2, 1), ("pp", 2, 2)])
def test_out_of_tree_family_matches_none(installed, tmp_path, strategy, nproc, micro):
    reference = run_training(mlp("none", microbatches=micro))
    own = micro if strategy == "pp" else None  # a pipeline runs its microbatches itself
    summaries = run_on_ranks(mlp(strategy, microbatches=own), nproc, tmp_path, inspect=w_and_shards)
    for summary in summaries:
        assert_same_losses(reference, summary)
    first, second = (s["inspect"] for s in summaries)
    if strategy == "pp":
        return  # ranks hold different stages
    if strategy == "tp":
        assert first["sharded"] == 2, "the PLIF neurons between the column and row layers are sharded"
        for name in ("blocks.0.lif1.w", "blocks.1.lif1.w"):
            assert torch.equal(first["params"][name], second["params"][name]), f"{name} drifted between tp ranks"
    else:
        for name, tensor in first["params"].items():
            assert torch.equal(tensor, second["params"][name]), name
