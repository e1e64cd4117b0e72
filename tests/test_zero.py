"""zero: DDP with the optimizer state sharded; same losses as one process, 1/N of the state per rank."""

import pytest
import torch

from snnfw.errors import PlanError
from snnfw.plugins import Plugins
from snnfw.runtime import prepare, run_training
from snnfw.testing import local_parameters, run_on_ranks

from conftest import tiny_config
from test_equivalence import assert_same_losses


def parameters_and_optimizer_state(trainer):
    state = getattr(trainer.optimizer, "optim", trainer.optimizer).state  # ZeroRedundancyOptimizer's local part
    state_numel = sum(t.numel() for s in state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
    return {"params": local_parameters(trainer), "optimizer_numel": state_numel}


@pytest.mark.parametrize("strategy, extra", [("zero", {}), ("dp", {"zero": True})])
def test_zero_matches_none_and_shards_optimizer_state(tmp_path, strategy, extra):
    reference = run_training(tiny_config("none", microbatches=2))
    summaries = run_on_ranks(tiny_config(strategy, parallel=extra), 2, tmp_path, inspect=parameters_and_optimizer_state)
    for summary in summaries:
        assert_same_losses(reference, summary)
    first, second = (s["inspect"] for s in summaries)
    for name, tensor in first["params"].items():
        assert torch.equal(tensor, second["params"][name]), f"replicas differ in {name}"
    total = sum(t.numel() for t in first["params"].values())
    shards = [s["inspect"]["optimizer_numel"] for s in summaries]
    assert sum(shards) == 2 * total  # Adam keeps two moments per parameter, each on one rank only
    assert max(shards) < 2 * total


def test_zero_is_refused_where_it_does_not_compose():
    with pytest.raises(PlanError, match="composes with dp and zero only"):
        prepare(tiny_config("none", parallel={"zero": True}), 1, Plugins())
