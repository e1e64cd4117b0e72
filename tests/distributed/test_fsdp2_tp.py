"""fsdp2_tp on a 2 x 2 mesh: TP inside, FSDP2 across; same losses as none, replicas agree everywhere.

Spikformer runs with SGD here: its TP all-reduces sum partial products in
another order than one process does, and Adam turns those last-bit gradient
differences in near-zero-gradient parameters into lr-sized steps that flip a
spike by step 3 (6e-4 in the loss). With SGD the losses are bit-identical.
"""

import pytest
import torch

from snnfw.errors import PlanError
from snnfw.plan.prepare import prepare
from snnfw.plugin.manager import Plugins
from snnfw.run.loop import run_training
from snnfw.testing import full_parameters, run_on_ranks, tiny_config
from snnfw.testing.checks import assert_same_losses


def parameters_and_state(trainer):
    neurons = {n: tuple(m.v.shape) for n, m in trainer.model.named_modules() if hasattr(m, "snnfw_shard")}
    return {"params": full_parameters(trainer), "neurons": neurons}


@pytest.mark.parametrize(
    "family, optimizer, head",
    [("cifar10dvs_vgg", "adam", "classifier.0.weight"), ("spikformer", "sgd", "net.head.weight")],
)
def test_fsdp2_tp_matches_none_and_keeps_dp_replicas_identical(tmp_path, family, optimizer, head):
    sections = {"model": {"family": family}, "train": {"optimizer": optimizer}}
    reference = run_training(tiny_config("none", microbatches=2, **sections))
    summaries = run_on_ranks(tiny_config("fsdp2_tp", **sections), 4, tmp_path, inspect=parameters_and_state)
    for summary in summaries:
        assert_same_losses(reference, summary)
    # ranks (dp, tp): 0=(0,0) 1=(0,1) 2=(1,0) 3=(1,1); dp peers hold the same tp shard
    for a, b in ((0, 2), (1, 3)):
        left, right = summaries[a]["inspect"]["params"], summaries[b]["inspect"]["params"]
        for name, tensor in left.items():
            assert torch.equal(tensor, right[name]), f"dp replicas {a} and {b} differ in {name}"
    # the head lies outside the FSDP2 blocks and still changed identically on both replicas
    assert head in summaries[0]["inspect"]["params"]
    assert summaries[0]["inspect"]["neurons"], "no neuron was sharded"


def test_replicas_beside_tp_compose_and_a_dp_without_its_meaning_is_refused():
    """strategy dp's dp is dp_replicate: beside tp it composes DDP over tensor-parallel groups; tp has no data
    dimension of its own, so its dp is refused, naming the two it could mean."""
    plugins = Plugins()
    plan = prepare(tiny_config("dp", parallel={"mesh": {"dp": 2, "tp": 2}}), 4, plugins).plan
    assert dict(plan.mesh) == {"dp_replicate": 2, "tp": 2} and plan.strategies == ("dp", "tp")
    with pytest.raises(PlanError, match="strategy tp's parallel.mesh names dp, and tp has no data dimension of its own"):
        prepare(tiny_config("tp", parallel={"mesh": {"dp": 2, "tp": 2}}), 4, plugins)
    with pytest.raises(PlanError, match=r"its mesh \{dp_shard = 4\} names no tp"):
        prepare(tiny_config("fsdp2_tp", parallel={"mesh": {"dp": 4}}), 4, plugins)


@pytest.mark.parametrize("mesh, said", [(None, "2 ranks give it dp_shard = 1; launch with --nproc 4 or more"),
                                        ({"dp": 1, "tp": 2}, "its mesh has dp_shard = 1; set each to 2 or more")])
def test_fsdp2_tp_without_data_parallelism_is_refused(mesh, said):
    parallel = {"mesh": mesh} if mesh else {}
    with pytest.raises(PlanError, match=f"strategy fsdp2_tp splits over dp_shard and tp, 2 ranks or more each, and {said}"):
        prepare(tiny_config("fsdp2_tp", parallel=parallel), 2, Plugins())
