"""Only the shard is built: under fsdp2 no rank ever holds the whole model, and every rank starts from none's weights.

A spiking MLP of equal hidden layers, so that a quarter of its parameters plus its largest tensor is well
under the whole; its frames are tiny, so the model's tensors dominate what a rank allocates before its first
step.
"""

import pytest
import torch
from torch import nn
from torch.nn.init import orthogonal_ as orthogonal_imported_before

from snnfw.config import build_config
from snnfw.plan.prepare import build_model
from snnfw.plugin.manager import Plugins
from snnfw.run.loop import run_training
from snnfw.testing import RankFailure, run_on_ranks
from snnfw.testing.build_memory import seen, track_until_first_step

WIDTH, LAYERS, RANKS = 256, 8, 4
OTHER_BYTES = 256 * 1024  # what a rank allocates besides the model before its first step: frames, RNG state, plans


def wide_mlp():
    from spikingjelly.activation_based import layer, neuron

    hidden = [module for _ in range(LAYERS - 1) for module in (layer.Linear(WIDTH, WIDTH, step_mode="m"),
                                                               neuron.LIFNode(step_mode="m"))]
    return nn.Sequential(layer.Flatten(step_mode="m"), layer.Linear(2 * 8 * 8, WIDTH, step_mode="m"),
                         neuron.LIFNode(step_mode="m"), *hidden, layer.Linear(WIDTH, 10, step_mode="m"))


def wide_convnet():
    """Conv-BN-LIF units of 64 channels (tp's ``conv_bn_neuron``, whose shards are plain tensors DDP can wrap) on
    8x8 frames, and a classifier."""
    from spikingjelly.activation_based import layer, neuron

    units = [module for channels in (2, 64, 64, 64) for module in (
        layer.Conv2d(channels, 64, kernel_size=3, padding=1, bias=False, step_mode="m"),
        layer.BatchNorm2d(64, step_mode="m"), neuron.LIFNode(step_mode="m"))]
    return nn.Sequential(*units, layer.AdaptiveAvgPool2d((1, 1), step_mode="m"), layer.Flatten(step_mode="m"),
                         layer.Linear(64, 10, step_mode="m"))


def mlp_a_replay_could_get_wrong():
    """:func:`wide_mlp` with one weight initialised by an initialiser that skips the meta device, by a name imported
    before the build: the recording refuses it, and rank 0 sends its build."""
    model = wide_mlp()
    orthogonal_imported_before(model[1].weight)
    return model


class ReadsItsChildsWeight(nn.Module):
    """A layer whose forward reads its child's weight, the child's own forward never running."""

    def __init__(self):
        super().__init__()
        from spikingjelly.activation_based import layer

        self.linear = layer.Linear(WIDTH, WIDTH, step_mode="m")

    def forward(self, x):
        return nn.functional.linear(x, self.linear.weight, self.linear.bias)


def mlp_reading_a_weight_outside_its_module():
    model = wide_mlp()
    model[3] = ReadsItsChildsWeight()
    return model


class Halved(nn.Module):
    """A layer scaled by a buffer the state dict leaves out (non-persistent)."""

    def __init__(self):
        super().__init__()
        from spikingjelly.activation_based import layer

        self.linear = layer.Linear(WIDTH, WIDTH, step_mode="m")
        self.register_buffer("scale", torch.full((1,), 0.5), persistent=False)

    def forward(self, x):
        return self.linear(x) * (2 * self.scale)


def mlp_with_a_non_persistent_buffer():
    model = wide_mlp()
    model[3] = Halved()
    return model


def config(strategy, builder="wide_mlp", mesh=None, microbatches=None):
    return build_config({
        "model": {"builder": f"{__file__}:{builder}", "input_shape": [2, 8, 8], "num_classes": 10, "input_layout": "TN",
                  "time_steps": 4},
        "data": {"name": "synthetic_dvs", "batch_size": 8, "train_samples": 16, "test_samples": 8},
        "train": {"steps": 3, "lr": 0.01, "seed": 3, "dtype": "float64",
                  **({"microbatches": microbatches} if microbatches else {})},
        "parallel": {"strategy": strategy, "device": "cpu", **({"mesh": mesh} if mesh else {})},
    })


def none_build(builder: str = "wide_mlp", microbatches: int = 1) -> tuple[dict, int, int, dict]:
    """none's initial parameters (float64, by name), the model's bytes and its largest tensor's, and none's run (in
    ``microbatches``: a data dimension's replicas each hold one, as BatchNorm sees it)."""
    model, _ = build_model(config("none", builder), Plugins())
    initial = {name: p.detach().to(torch.float64) for name, p in model.named_parameters()}
    sizes = [p.numel() * 8 for p in initial.values()]
    return initial, sum(sizes), max(sizes), run_training(config("none", builder, microbatches=microbatches))


def test_fsdp2_ranks_hold_a_quarter_of_the_model_and_start_from_none_weights():
    initial, whole, largest, reference = none_build()
    summaries = run_on_ranks(config("fsdp2"), RANKS, before=track_until_first_step, inspect=seen, timeout_s=120)
    peaks = [summary["inspect"]["peak"] for summary in summaries]
    for rank, peak in enumerate(peaks):
        assert peak <= whole / RANKS + largest + OTHER_BYTES, f"rank {rank} held {peak} bytes, of a {whole}-byte model"
    for rank, summary in enumerate(summaries):
        got = summary["inspect"]["initial"]
        assert got.keys() == initial.keys()
        for name, tensor in initial.items():
            assert torch.equal(got[name], tensor), f"rank {rank}: initial {name} differs from none's"
        for step, (want, loss) in enumerate(zip(reference["losses"], summary["losses"], strict=True), start=1):
            assert abs(loss - want) <= 1e-9 * abs(want), f"rank {rank}, step {step}: loss {loss}, none's {want}"


@pytest.mark.parametrize("strategy", ["fsdp2", "tp"])
def test_a_build_a_replay_could_get_wrong_is_sent_by_rank_0_and_starts_from_none_weights(strategy):
    model, _ = build_model(config("none", "mlp_a_replay_could_get_wrong"), Plugins())
    initial = {name: p.detach().to(torch.float64) for name, p in model.named_parameters()}
    reference = run_training(config("none", "mlp_a_replay_could_get_wrong"))
    summaries = run_on_ranks(config(strategy, "mlp_a_replay_could_get_wrong"), 2, before=track_until_first_step,
                             inspect=seen, timeout_s=120)
    whole = sum(p.numel() for p in initial.values()) * 8
    assert summaries[0]["inspect"]["peak"] >= whole  # rank 0 built the whole model to send it
    for rank, summary in enumerate(summaries):
        for name, tensor in initial.items():
            assert torch.equal(summary["inspect"]["initial"][name], tensor), f"rank {rank}: initial {name} differs"
        for step, (want, loss) in enumerate(zip(reference["losses"], summary["losses"], strict=True), start=1):
            assert abs(loss - want) <= 1e-9 * abs(want), f"rank {rank}, step {step}: loss {loss}, none's {want}"


@pytest.mark.parametrize("strategy, mesh", [("pp", None), ("mesh", {"dp_replicate": 2, "pp": 2})])
def test_pp_ranks_hold_their_stages_plus_one_unit_and_start_from_none_weights(strategy, mesh):
    """Every rank builds on the meta device; the last times the split one unit at a time (its values and their
    gradients), every rank runs a microbatch through the stages the same way, and materializes its own stage."""
    initial, whole, largest, reference = none_build()
    summaries = run_on_ranks(config(strategy, mesh=mesh), RANKS, before=track_until_first_step, inspect=seen,
                             timeout_s=180)
    for rank, summary in enumerate(summaries):
        peak = summary["inspect"]["peak"]
        held, stage = summary["inspect"]["initial"], summary["inspect"]["held"]
        assert held, f"rank {rank} holds no stage"
        assert peak <= stage + 2 * largest + OTHER_BYTES, f"rank {rank} held {peak} bytes, its stage {stage}, of {whole}"
        for name, tensor in held.items():
            assert torch.equal(tensor, initial[name]), f"rank {rank}: initial {name} differs from none's"
    assert set().union(*(s["inspect"]["initial"] for s in summaries)) == initial.keys()
    last = summaries[-1]
    for step, (want, loss) in enumerate(zip(reference["losses"], last["losses"], strict=True), start=1):
        assert abs(loss - want) <= 1e-9 * abs(want), f"step {step}: loss {loss}, none's {want}"



def test_a_time_split_beside_sharded_parameters_builds_only_the_shard_and_starts_from_none_weights():
    """fsdp2_tsp, {time = 2, dp_shard = 2}: time holds the parameters dp_shard shards (FSDP2's dim-0 shards,
    replicated over time); every rank builds on the meta device and holds its shard plus at most one tensor before its
    first step."""
    initial, whole, largest, reference = none_build()
    summaries = run_on_ranks(config("fsdp2_tsp"), RANKS, before=track_until_first_step, inspect=seen, timeout_s=180)
    for rank, summary in enumerate(summaries):
        peak, held = summary["inspect"]["peak"], summary["inspect"]["held"]
        assert held <= whole / 2 + largest, f"rank {rank} holds {held} bytes of a {whole}-byte model"
        assert peak <= held + largest + OTHER_BYTES, f"rank {rank} held {peak} bytes, its shard {held}, of {whole}"
        for name, tensor in summary["inspect"]["initial"].items():
            assert torch.equal(tensor, initial[name]), f"rank {rank}: initial {name} differs from none's"
        for step, (want, loss) in enumerate(zip(reference["losses"], summary["losses"]), start=1):
            assert abs(loss - want) <= 1e-9 * abs(want), f"rank {rank}, step {step}: loss {loss}, none's {want}"


def test_pp_runs_a_model_reading_a_weight_outside_its_module_with_those_modules_held_whole():
    """Streamed values leave the weight on the meta device while the parent runs; the split and the stage inputs
    run again with every value held, and the run starts from none's weights and trains as none."""
    model, _ = build_model(config("none", "mlp_reading_a_weight_outside_its_module"), Plugins())
    initial = {name: p.detach().to(torch.float64) for name, p in model.named_parameters()}
    reference = run_training(config("none", "mlp_reading_a_weight_outside_its_module"))
    summaries = run_on_ranks(config("pp", "mlp_reading_a_weight_outside_its_module"), RANKS,
                             before=track_until_first_step, inspect=seen, timeout_s=180)
    for rank, summary in enumerate(summaries):
        for name, tensor in summary["inspect"]["initial"].items():
            assert torch.equal(tensor, initial[name]), f"rank {rank}: initial {name} differs from none's"
    for step, (want, loss) in enumerate(zip(reference["losses"], summaries[-1]["losses"], strict=True), start=1):
        assert abs(loss - want) <= 1e-9 * abs(want), f"step {step}: loss {loss}, none's {want}"


def test_pp_materializes_a_buffer_the_state_dict_leaves_out_under_the_model_s_name():
    """A non-persistent buffer of a stage is named by the stage in the pipeline, by the model in the recipe: the
    stage rank materializes it and trains as none."""
    reference = run_training(config("none", "mlp_with_a_non_persistent_buffer"))
    summaries = run_on_ranks(config("pp", "mlp_with_a_non_persistent_buffer"), RANKS, timeout_s=180)
    for step, (want, loss) in enumerate(zip(reference["losses"], summaries[-1]["losses"], strict=True), start=1):
        assert abs(loss - want) <= 1e-9 * abs(want), f"step {step}: loss {loss}, none's {want}"


@pytest.mark.parametrize("mesh", [{"dp_replicate": 2, "tp": 2}, {"tp": 2, "time": 2}])
def test_ddp_over_tp_shards_builds_only_the_shard_and_starts_from_none_weights(mesh):
    """Replicas of tp's shards (DistributedDataParallel over dp_replicate, or over time): every rank builds on the
    meta device and holds its shard, plus DDP's gradient buckets (the gradients' own storage) and at most one tensor,
    before its first step."""
    initial, whole, largest, reference = none_build("wide_convnet", microbatches=mesh.get("dp_replicate", 1))
    summaries = run_on_ranks(config("mesh", "wide_convnet", mesh), RANKS, before=track_until_first_step, inspect=seen,
                             timeout_s=180)
    for rank, summary in enumerate(summaries):
        peak, held = summary["inspect"]["peak"], summary["inspect"]["held"]
        assert held <= whole / 2 + largest, f"rank {rank} holds {held} bytes of a {whole}-byte model"
        assert peak <= 2 * held + largest + OTHER_BYTES, f"rank {rank} held {peak} bytes, its shard {held}, of {whole}"
        for name, tensor in summary["inspect"]["initial"].items():
            assert torch.equal(tensor, initial[name]), f"rank {rank}: initial {name} differs from none's"
        for step, (want, loss) in enumerate(zip(reference["losses"], summary["losses"]), start=1):
            assert abs(loss - want) <= 1e-9 * abs(want), f"rank {rank}, step {step}: loss {loss}, none's {want}"


def test_ddp_over_dtensor_parameters_is_refused_in_one_line():
    """tp's linear_mlp style makes DTensor parameters, which DistributedDataParallel's buckets cannot take."""
    with pytest.raises(RankFailure, match="DistributedDataParallel over time cannot average DTensor parameters"):
        run_on_ranks(config("mesh", mesh={"tp": 2, "time": 2}), RANKS, timeout_s=180)
