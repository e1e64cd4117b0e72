"""Temporal parallelism: the time steps of each sample split across ranks compute what one process computes.

The float64 guarantee over 20 steps is in tests/guarantee (cases tsp, tsp-4, dp-x-tsp); here, that each part of
the exchange is needed: a chunk that starts from zero instead of the membrane potential the rank before ended
with, or a boundary state whose gradient is not sent back, trains another model; and what the plan refuses.
"""

import functools
import json

import pytest

from snnfw.errors import PlanError
from snnfw.plan.prepare import prepare
from snnfw.plugin.manager import Plugins
from snnfw.run.loop import run_training
from snnfw.testing import run_on_ranks, tiny_config
from snnfw.testing.checks import assert_close

STEPS = 4


def config(strategy="tsp", **sections):
    return tiny_config(strategy, 1, train={"steps": STEPS, "dtype": "float64", "lr": 3e-3}, **sections)


@functools.cache
def reference() -> list[float]:
    return run_training(config("none"))["losses"]


def chunks_start_from_rest(rank):
    """The boundary state is received (the exchange stays in step) but replaced by a neuron at rest."""
    import torch

    from snnfw_plugins.strategies import tsp_ops

    receive = tsp_ops.ReceiveState.forward
    tsp_ops.ReceiveState.forward = staticmethod(lambda ctx, like, time, tag: torch.zeros_like(receive(ctx, like, time,
                                                                                                      tag)))


def no_gradient_back(rank):
    """The boundary state's gradient is sent as zeros."""
    from snnfw_plugins.strategies import tsp_ops

    send = tsp_ops.ReceiveState.backward
    tsp_ops.ReceiveState.backward = staticmethod(lambda ctx, grad: send(ctx, grad * 0))


@pytest.mark.parametrize("ranks", [pytest.param(2, marks=pytest.mark.full_matrix), 4])
def test_tsp_matches_none(ranks):
    """At P = 2 the guarantee's tsp case checks 20 steps by default; P = 4 here, in 4."""
    want = reference()
    for rank, summary in enumerate(run_on_ranks(config(parallel={"mesh": {"time": ranks}}), ranks, timeout_s=240)):
        for step, (loss, ref) in enumerate(zip(summary["losses"], want, strict=True), start=1):
            assert_close(f"rank {rank} step {step} loss", loss, ref)


def test_tsp_needs_the_boundary_state_and_its_gradient():
    ranks, mesh, want = 2, {"parallel": {"mesh": {"time": 2}}}, reference()
    rested = run_on_ranks(config(**mesh), ranks, before=chunks_start_from_rest, timeout_s=240)[0]["losses"]
    assert abs(rested[0] - want[0]) > 1e-6 * abs(want[0]), "a chunk started at rest gave none's first loss"
    blind = run_on_ranks(config(**mesh), ranks, before=no_gradient_back, timeout_s=240)[0]["losses"]
    assert_close("step 1 loss without the state's gradient", blind[0], want[0])  # the forward is whole
    assert max(abs(got - ref) / abs(ref) for got, ref in zip(blind[1:], want[1:])) > 1e-6, \
        "without the boundary state's gradient the updates equal none's"


@pytest.mark.parametrize("sections, refused", [
    ({"parallel": {"mesh": {"time": 3}}}, "does not split into 3 equal chunks"),
    ({"model": {"time_steps": 6}}, "model.time_steps = 6 does not split into 4 equal chunks"),
    ({"parallel": {"mesh": {"tp": 4}}}, "strategy tsp splits over time, 2 ranks or more each, and its mesh {tp = 4} "
                                        "names no time"),
    ({"memopt": {"level": 1}}, "memopt recomputes forward passes"),
])
def test_what_cannot_be_split_in_time_is_refused_naming_the_key(sections, refused):
    world = 3 if sections.get("parallel", {}).get("mesh") == {"time": 3} else 4
    with pytest.raises(PlanError, match=refused):
        prepare(tiny_config("tsp", 1, **sections), world, Plugins())


def test_tsp_slices_apply_to_the_time_strategies_only():
    with pytest.raises(PlanError, match="tsp.slices applies only to a time dimension"):
        prepare(tiny_config("dp", 1, tsp={"slices": 2}), 2, Plugins())
    plan = prepare(tiny_config("tsp", 1, tsp={"slices": 3}), 2, Plugins()).plan
    assert "neurons pass their state on in 3 batch slices" in " ".join(plan.rationale)


@pytest.mark.parametrize("slices", [1, 3])
def test_tsp_matches_none_whatever_the_batch_slices(slices):
    """The wavefront's slices (3 of a batch of 8: 3, 3 and 2 samples) change no number; 1 is no wavefront."""
    want = reference()
    for rank, summary in enumerate(run_on_ranks(config(parallel={"mesh": {"time": 2}}, tsp={"slices": slices}), 2,
                                                timeout_s=240)):
        for step, (loss, ref) in enumerate(zip(summary["losses"], want, strict=True), start=1):
            assert_close(f"rank {rank} step {step} loss", loss, ref)


def test_tsp_with_the_inductor_neuron_kernels_matches_none_with_them():
    """The kernels are installed after the time split: they must become the steps tsp's chain calls, not replace
    the chain (when they did, each rank's chunk started at rest: step 1's loss was 2.3093 against 2.3069)."""
    kernels = {"model": {"neuron_backend": "inductor"}}
    want = run_training(config("none", **kernels))["losses"]
    summaries = run_on_ranks(config(parallel={"mesh": {"time": 2}}, tsp={"slices": 2}, **kernels), 2, timeout_s=360)
    for rank, summary in enumerate(summaries):
        for step, (loss, ref) in enumerate(zip(summary["losses"], want, strict=True), start=1):
            assert_close(f"rank {rank} step {step} loss", loss, ref)


def test_fsdp2_tsp_without_data_parallelism_is_refused():
    with pytest.raises(PlanError, match="strategy fsdp2_tsp splits over dp_shard and time, 2 ranks or more each, and "
                                        "its mesh has dp_shard = 1"):
        prepare(tiny_config("fsdp2_tsp", 1, parallel={"mesh": {"time": 2, "dp": 1}}), 2, Plugins())


def test_a_layer_that_mixes_time_steps_is_refused_naming_it():
    from torch import nn

    from snnfw.plan.prepare import build_model
    from snnfw_plugins.strategies.tsp import time_mixing_layer

    model = build_model(tiny_config("none", 1), Plugins())[0]
    assert time_mixing_layer(model) is None
    model.features.add_module("memory", nn.GRU(4, 4))
    assert time_mixing_layer(model) == "features.memory (GRU) mixes time steps, which a time chunk cannot see (RNNBase)"


def test_tets_per_step_loss_and_the_firing_rates_are_none_s(tmp_path):
    """TET's loss reads every time step's logits: the gathered logits give it all of them. With log.phase_times a
    step records the time spent in the time group's exchanges."""
    tet = {"train": {"steps": STEPS, "dtype": "float64", "lr": 3e-3, "loss": "tet"}}
    want = run_training(tiny_config("none", 1, **tet))
    timed = tiny_config("tsp", 1, **tet, log={"phase_times": True})
    for rank, got in enumerate(run_on_ranks(timed, 2, tmp_path, timeout_s=240)):
        for step, (loss, ref) in enumerate(zip(got["losses"], want["losses"], strict=True), start=1):
            assert_close(f"rank {rank} step {step} loss", loss, ref)
        for step, (rate, ref) in enumerate(zip(got["spike_rates"], want["spike_rates"], strict=True), start=1):
            assert_close(f"rank {rank} step {step} spike rate", rate, ref)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(0 < record["tsp_exchange_ms"] < record["forward_backward_ms"] for record in records), records


def held_share(trainer) -> float:
    """The share of the model's parameter elements this rank holds."""
    from torch.distributed.tensor import DTensor

    parameters = list(trainer.model.parameters())
    held = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in parameters)
    return held / sum(p.numel() for p in parameters)


def test_fsdp2_tsp_matches_none_and_shards_the_parameters_over_dp():
    """time = 2 x dp = 2: two replicas of one microbatch each, as none's two microbatches; HSDP shards every
    parameter over dp (about half on a rank) and replicates it over time."""
    exact = {"steps": STEPS, "dtype": "float64", "lr": 3e-3}
    want = run_training(tiny_config("none", 2, train=exact))["losses"]
    split = tiny_config("fsdp2_tsp", 1, train=exact, parallel={"mesh": {"time": 2, "dp": 2}})
    for rank, summary in enumerate(run_on_ranks(split, 4, inspect=held_share, timeout_s=240)):
        assert summary["plan"]["mesh"] == {"time": 2, "dp_shard": 2} and summary["plan"]["preset"] == "fsdp2_tsp"
        assert 0.45 < summary["inspect"] < 0.6, f"rank {rank} holds {summary['inspect']:.2f} of the parameters"
        for step, (loss, ref) in enumerate(zip(summary["losses"], want, strict=True), start=1):
            assert_close(f"rank {rank} step {step} loss", loss, ref)


def loaded_chunks(trainer):
    """What this rank's loader hands its model: the first training and test samples' frames."""
    return {"train": trainer.train_set[0][0].tolist(), "test": trainer.test_set[0][0].tolist(),
            "sliced": hasattr(getattr(trainer.train_set, "dataset", None), "time_slice")}


@pytest.mark.parametrize("raw", [False, True], ids=["generated", "raw-recordings"])
def test_each_rank_loads_only_its_time_chunk(tmp_path, raw):
    """Synthetic frames are cut after loading; raw recordings' cached frames are read a chunk at a time. Either
    way the chunks of the time group are the whole sample's, in order, and training equals none's."""
    import torch

    from snnfw.testing.raw_events import write_nmnist

    data = {}
    if raw:
        write_nmnist(tmp_path / "raw")
        data = {"data": {"name": "n_mnist", "root": str(tmp_path / "raw"), "batch_size": 8}}
    whole = run_training(config("none", **data), on_finish=loaded_chunks)
    ranks = run_on_ranks(config(**data), 2, inspect=loaded_chunks, timeout_s=180)
    for split in ("train", "test"):
        chunks = [torch.tensor(rank["inspect"][split]) for rank in ranks]
        assert [len(chunk) for chunk in chunks] == [2, 2]  # of model.time_steps = 4
        assert torch.equal(torch.cat(chunks), torch.tensor(whole["inspect"][split]))
    assert all(rank["inspect"]["sliced"] == raw for rank in ranks)
    for rank in ranks:
        for step, (got, want) in enumerate(zip(rank["losses"], whole["losses"], strict=True)):
            assert_close(f"step {step + 1}", got, want)
