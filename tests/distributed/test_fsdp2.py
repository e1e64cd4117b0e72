"""fsdp2: FSDP2 and HSDP train to the losses of one process, each rank holding a shard of the state.

Comparisons of four replicas or microbatches with one process use SGD: a
four-way gradient sum rounds differently from one process's running sum, and
Adam turns that rounding noise in the conv biases before BatchNorm (true
gradient zero) into steps of size lr that flip spikes by step 3; ``dp``
diverges the same way. Two-way sums round identically, so Adam stays there.
"""

import functools
import warnings

import pytest
import torch

from snnfw.errors import PlanError
from snnfw.plan.prepare import prepare
from snnfw.plugin.manager import Plugins
from snnfw.run.loop import run_training
from snnfw.testing import full_parameters, local_parameters, replay_first_step, run_on_ranks, state_bytes, tiny_config
from snnfw.testing.checks import assert_same_losses

HSDP = {"dp_replicate": 2, "dp_shard": 2}
SGD = {"optimizer": "sgd"}
UNSHARDED_BYTES = 1024  # Adam keeps one unsharded scalar step per parameter


@functools.cache
def reference(microbatches, optimizer="adam"):
    return run_training(tiny_config("none", microbatches=microbatches, train={"optimizer": optimizer}))


def shards(trainer):
    """This rank's local shards, whole parameters and state bytes, parameters resharded first.

    Evaluation leaves unsharded parameters registered where
    ``reshard_after_forward`` is false.
    """
    from torch.distributed.fsdp import FSDPModule

    for module in trainer.model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    return {"local": local_parameters(trainer), "full": full_parameters(trainer), "bytes": state_bytes(trainer)}


def assert_sharded_replicas(summaries, shard_index, shards_count=2):
    """Ranks hold identical whole parameters, and each its ``Shard(0)`` chunk (``torch.chunk``) of them."""
    full = summaries[0]["inspect"]["full"]
    for rank, summary in enumerate(summaries):
        mine = summary["inspect"]
        for name, tensor in full.items():
            assert torch.equal(mine["full"][name], tensor), f"rank {rank} differs from rank 0 in {name}"
            expected = tensor.chunk(shards_count)[shard_index(rank)]
            assert mine["local"][name].shape == expected.shape, f"rank {rank}: {name} is not a Shard(0) chunk"
            assert torch.equal(mine["local"][name], expected), f"rank {rank}: {name} shard holds other values"


def view_warnings(trainer):
    """FSDP2's warnings that a unit returned a view, caught over one more forward and backward of step 0."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        replay_first_step(trainer)
    return [str(w.message) for w in caught if "returned a view tensor" in str(w.message)]


def gathers_before_first_convolution(trainer) -> int:
    """How many all-gathers one more forward of step 0 starts before it runs its first convolution."""
    from torch.utils._python_dispatch import TorchDispatchMode

    events = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "allgather" in func.name():
                events.append("gather")
            elif func is torch.ops.aten.convolution.default:
                events.append("convolution")
            return func(*args, **(kwargs or {}))

    replay_first_step(trainer, Log())
    return events.index("convolution")


def shards_and_view_warnings(trainer):
    return {**shards(trainer), "view_warnings": view_warnings(trainer),
            "gathers_before_first_convolution": gathers_before_first_convolution(trainer)}


@pytest.fixture(scope="module")
def fsdp2_two_ranks():
    return run_on_ranks(tiny_config("fsdp2"), 2, inspect=shards_and_view_warnings)


def test_fsdp2_units_return_no_views(fsdp2_two_ranks):
    """The VGG's root ends in a Linear on [T, N, F], Spikformer's blocks in a reshape: views FSDP2 warns about."""
    spikformer = run_on_ranks(tiny_config("fsdp2", model={"family": "spikformer"}), 2, inspect=view_warnings)
    for summary in fsdp2_two_ranks:
        assert summary["inspect"]["view_warnings"] == []
    for summary in spikformer:
        assert summary["inspect"] == []


def test_fsdp2_on_a_cpu_gathers_the_next_block_while_a_block_computes(fsdp2_two_ranks):
    """FSDP2 prefetches through CUDA streams only; on a CPU snnfw issues the all-gathers asynchronously, and
    before the first block's first convolution the ranks have started the gathers of the root, the first
    block and the second (without the prefetch: the root's and the first block's)."""
    for summary in fsdp2_two_ranks:
        assert summary["inspect"]["gathers_before_first_convolution"] == 3


def test_fsdp2_two_ranks_matches_none_with_two_microbatches(fsdp2_two_ranks):
    for summary in fsdp2_two_ranks:
        assert_same_losses(reference(2), summary)
        assert summary["plan"]["mesh"] == {"dp_shard": 2}
    assert_sharded_replicas(fsdp2_two_ranks, shard_index=lambda rank: rank)


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_fsdp2_accumulates_microbatches_like_none(reshard_after_forward):
    config = tiny_config("fsdp2", microbatches=2, parallel={"reshard_after_forward": reshard_after_forward}, train=SGD)
    summaries = run_on_ranks(config, 2, inspect=shards)
    for summary in summaries:
        assert_same_losses(reference(4, "sgd"), summary)
    assert_sharded_replicas(summaries, shard_index=lambda rank: rank)


def test_hsdp_four_ranks_matches_none_with_four_microbatches():
    summaries = run_on_ranks(tiny_config("fsdp2", parallel={"mesh": HSDP}, train=SGD), 4, inspect=shards)
    for summary in summaries:
        assert_same_losses(reference(4, "sgd"), summary)
        assert summary["plan"]["mesh"] == HSDP and summary["plan"]["dp_dims"] == ("dp_replicate", "dp_shard")
    assert_sharded_replicas(summaries, shard_index=lambda rank: rank % HSDP["dp_shard"])


def test_fsdp2_holds_half_of_dp_parameter_and_optimizer_memory(fsdp2_two_ranks):
    dp = [s["inspect"] for s in run_on_ranks(tiny_config("dp"), 2, inspect=state_bytes)]
    fsdp2 = [s["inspect"]["bytes"] for s in fsdp2_two_ranks]
    assert sum(f["parameters"] for f in fsdp2) == dp[0]["parameters"]
    for mine, theirs in zip(fsdp2, dp):
        dp_total = theirs["parameters"] + theirs["optimizer"]
        assert mine["parameters"] + mine["optimizer"] <= dp_total / 2 + UNSHARDED_BYTES, (mine, theirs)


def test_hsdp_mesh_is_replicate_then_shard():
    plan = prepare(tiny_config("fsdp2", parallel={"mesh": {"dp_shard": 2, "dp_replicate": 2}}), 4, Plugins()).plan
    assert plan.mesh == (("dp_replicate", 2), ("dp_shard", 2))
    assert plan.dp_dims == ("dp_replicate", "dp_shard") and plan.dp_size == 4
    assert any("fully_shard on 8 block(s) of cifar10dvs_vgg then the root" in line for line in plan.rationale)


@pytest.mark.parametrize(
    "parallel, world, message",
    [
        ({"zero": True}, 2, "dp_shard shards optimizer state already"),
        ({"mesh": {"dp": 1, "tp": 2}}, 2, "its mesh has dp_shard = 1; set each to 2 or more"),
        ({"mesh": {"tp": 2}}, 2, r"its mesh \{tp = 2\} names no dp_shard"),
        ({"mesh": HSDP}, 2, "has 4 ranks but the world has 2"),
        ({}, 1, "at least 2 ranks"),
    ],
)
def test_fsdp2_refusals(parallel, world, message):
    with pytest.raises(PlanError, match=message):
        prepare(tiny_config("fsdp2", parallel=parallel), world, Plugins())


@pytest.mark.parametrize("strategy, world", [("none", 1), ("dp", 2), ("zero", 2), ("tp", 2), ("pp", 2)])
def test_mixed_precision_is_refused_where_it_is_not_applied(strategy, world):
    with pytest.raises(PlanError) as err:
        prepare(tiny_config(strategy, microbatches=2, parallel={"mixed_precision": "bf16"}), world, Plugins())
    assert (
        f"strategy {strategy!r} cannot run: parallel.mixed_precision = 'bf16' is applied only by a dp_shard "
        "dimension (fully_shard's MixedPrecisionPolicy: strategies fsdp2, fsdp2_tp, fsdp2_tsp)" in str(err.value)
    )


def test_auto_with_mixed_precision_chooses_among_meshes_with_dp_shard_only():
    plan = prepare(tiny_config("auto", parallel={"mixed_precision": "bf16"}), 4, Plugins()).plan
    assert "fsdp2" in plan.strategies
    assert "bf16 compute (BatchNorm in fp32), fp32 gradient reduction and output" in " ".join(plan.rationale)
    refused = [line for line in plan.rationale if "cannot run: parallel.mixed_precision" in line]
    assert refused and not any("dp_shard" in line.split(": cannot run")[0] for line in refused), plan.rationale
    kept = [line for line in plan.rationale if line.startswith("candidate") and "cannot run" not in line]
    assert kept and all("dp_shard" in line.split("):")[0] for line in kept), plan.rationale


@pytest.mark.parametrize("strategy, world", [("none", 1), ("dp", 2), ("zero", 2), ("tp", 2), ("pp", 2)])
def test_reshard_after_forward_is_refused_where_fully_shard_does_not_run(strategy, world):
    with pytest.raises(PlanError) as err:
        prepare(tiny_config(strategy, microbatches=2, parallel={"reshard_after_forward": True}), world, Plugins())
    assert (
        f"strategy {strategy!r} cannot run: parallel.reshard_after_forward = true is applied only by a dp_shard "
        "dimension (fully_shard: strategies fsdp2, fsdp2_tp, fsdp2_tsp); remove it" in str(err.value)
    )


def test_reshard_after_forward_plans_with_fsdp2_and_fsdp2_tp():
    plugins = Plugins()
    parallel = {"reshard_after_forward": False}
    plan = prepare(tiny_config("fsdp2", parallel=parallel), 2, plugins).plan
    assert any("reshard_after_forward=False" in line for line in plan.rationale)
    assert prepare(tiny_config("fsdp2_tp", parallel=parallel), 4, plugins).plan.preset == "fsdp2_tp"


def test_auto_with_reshard_after_forward_chooses_among_meshes_with_dp_shard_only():
    plan = prepare(tiny_config("auto", parallel={"reshard_after_forward": False}), 4, Plugins()).plan
    assert "fsdp2" in plan.strategies
    refused = [line for line in plan.rationale if "cannot run: parallel.reshard_after_forward" in line]
    assert refused and not any("dp_shard" in line.split(": cannot run")[0] for line in refused), plan.rationale
