"""Expert parallelism (the ``ep`` mesh dimension) on the spiking language model's tiny flavor (4 experts, top-2):
in float64 every step's loss, firing rate and gradient norm within 1e-9 relative of none's with the same
microbatches, the validations and the final state (every expert, under its own name) included, every neuron
layer firing; a checkpoint written under ep resumes onto another mesh exactly; what ep cannot split, refused."""

import pytest

from snnfw.config import build_config
from snnfw.run.loop import run_training
from snnfw.testing import run_on_ranks
from snnfw.testing.checks import assert_close
from snnfw.testing.equivalence import Case
from snnfw.testing.guarantee import check_case

STEPS, EVAL_EVERY = 4, 2
TEXT = {"name": "python_bytes", "batch_size": 16, "train_samples": 128, "test_samples": 32}
CASES = (
    Case("mesh-ep2", "mesh", 2, 2, 1, {"parallel": {"mesh": {"ep": 2}}}),
    Case("mesh-ep2-x-dp_shard2", "mesh", 4, 4, 1, {"parallel": {"mesh": {"ep": 2, "dp_shard": 2}}}),
    Case("mesh-ep2-x-dp_replicate2", "mesh", 4, 4, 1, {"parallel": {"mesh": {"ep": 2, "dp_replicate": 2}}}),
)


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_expert_parallel_matches_none_in_float64(case: Case):
    check_case("spiking_lm", case, STEPS, EVAL_EVERY, timeout_s=300, data=TEXT)


def lm_config(steps: int, mesh: dict | None = None, every: int = 0, clip: float = 0.0):
    """The tiny model on 2 replicas of one microbatch on ``mesh``, or none with their 2 microbatches."""
    parallel = {"strategy": "mesh", "mesh": mesh} if mesh else {"strategy": "none"}
    return build_config({
        "model": {"family": "spiking_lm", "flavor": "tiny", "time_steps": 4}, "data": TEXT,
        "train": {"steps": steps, "lr": 3e-3, "optimizer": "adam", "seed": 3, "dtype": "float64",
                  "microbatches": 1 if mesh else 2, "clip_grad_norm": clip},
        "parallel": parallel, "checkpoint": {"every": every},
    })


def test_an_expert_parallel_checkpoint_resumes_on_another_mesh_with_clipped_gradients(tmp_path):
    """ep = 2 (each rank 2 of the 4 experts) saved at step 3, resumed on dp_shard = 2: none's float64 losses with
    the same 2 microbatches (the balance loss is a microbatch's) each within 1e-9 relative; the gradients clipped
    at a norm below theirs, so every step also depends on the whole gradient's norm, each expert counted once."""
    clip = 0.05
    want = run_training(lm_config(6, clip=clip))
    assert min(want["grad_norms"]) > clip, want["grad_norms"]
    saved = run_on_ranks(lm_config(3, {"ep": 2}, every=3, clip=clip), 2, tmp_path, timeout_s=300)
    resumed = run_on_ranks(lm_config(6, {"dp_shard": 2}, every=3, clip=clip), 2, tmp_path, resume=True, timeout_s=300)
    for rank, summary in enumerate(saved + resumed):
        assert len(summary["losses"]) == (3 if rank < 2 else 6)
        for step, (have, expected) in enumerate(zip(summary["losses"], want["losses"]), start=1):
            assert_close(f"rank {rank % 2} step {step} loss", have, expected)
    for step, (have, expected) in enumerate(zip(saved[0]["grad_norms"], want["grad_norms"]), start=1):
        assert_close(f"step {step} gradient norm under ep", have, expected)
    assert all(summary["resumed_from"] == 3 for summary in resumed)


def plan_config(mesh: dict, flavor: str = "tiny", parallel_strategy: str = "mesh", **keys):
    parallel = {"strategy": parallel_strategy, **({"mesh": mesh} if mesh else {}), **keys}
    return build_config({
        "model": {"family": "spiking_lm", "flavor": flavor, "time_steps": 4, "sequence_length": 16}, "data": TEXT,
        "train": {"steps": 1}, "parallel": parallel,
    })


@pytest.mark.parametrize("mesh, flavor, message", [
    ({"ep": 2}, "small", "dimension ep (ep): model 'spiking_lm' has no mixture-of-experts layer"),
    ({"ep": 3}, "tiny", "the 4 experts of a layer do not split into 3 equal parts; use an ep size that divides 4"),
    ({"ep": 2, "tp": 2}, "tiny", "ep composes with dp_replicate and dp_shard only, not with tp"),
    ({"ep": 2}, "tiny", "parallel.zero partitions the parameters' updates over the replicas, whose experts differ"),
])
def test_what_ep_cannot_split_is_refused_in_one_line(mesh, flavor, message):
    from snnfw.errors import PlanError
    from snnfw.plan.prepare import prepare
    from snnfw.plugin.manager import Plugins

    world = 1
    for size in mesh.values():
        world *= size
    with pytest.raises(PlanError) as refused:
        prepare(plan_config(mesh, flavor, **({"zero": True} if "zero" in message else {})), world, Plugins())
    assert message in str(refused.value) and "\n" not in str(refused.value), str(refused.value)


def test_the_plan_places_ep_among_the_data_dimensions_and_estimates_its_all_to_alls():
    """ep splits the batch (4 replicas on ep = 2 x dp_shard = 2); its rationale gives the all-to-all bytes it adds
    to the estimate: 16 samples / 4 replicas x 16 tokens x 4 steps x top-2 = 512 rows, half of them away, each
    32 float64 values sent 4 times and its position once."""
    from snnfw.plan.prepare import prepare
    from snnfw.plugin.manager import Plugins

    config = plan_config({"ep": 2, "dp_shard": 2})
    plan = prepare(build_config({**config.to_dict(), "train": {"steps": 1, "dtype": "float64"}}), 4, Plugins()).plan
    assert plan.mesh == (("ep", 2), ("dp_shard", 2)) and plan.dp_dims == ("ep", "dp_shard") and plan.dp_size == 4
    assert "gradients: FSDP2 reduce-scatter over dp_shard, replicated over ep (HSDP)" in plan.rationale
    expected = 512 / 2 * (4 * 32 * 8 + 8)
    assert any(line.startswith("ep = 2: 2 of each layer's 4 experts per rank") and f"{expected / 2**20:.3g} MiB" in line
               for line in plan.rationale), plan.rationale


def test_auto_weighs_ep_as_a_data_dimension_that_adds_all_to_alls():
    """Under ``auto``, ep = 2 computes what dp_replicate = 2 computes (each rank half the samples, not half of
    each sample's work as tp's ranks) and sends its all-to-alls besides: it is predicted no faster."""
    import re

    from snnfw.plan.prepare import prepare
    from snnfw.plugin.manager import Plugins

    plan = prepare(plan_config({}, parallel_strategy="auto"), 2, Plugins()).plan
    predicted = {mesh: float(ms) for mesh, ms in
                 (re.search(r"\((ep=2|dp_replicate=2)\): ~([0-9.]+) ms", line).groups() for line in plan.rationale
                  if re.search(r"\((ep=2|dp_replicate=2)\): ~", line))}
    assert predicted["ep=2"] >= predicted["dp_replicate=2"], plan.rationale


def test_ep_asked_as_a_strategy_says_how_to_ask_for_the_mesh():
    from snnfw.errors import PlanError
    from snnfw.plan.prepare import prepare
    from snnfw.plugin.manager import Plugins

    with pytest.raises(PlanError, match=r"ep is a dimension of parallel.mesh, not a strategy of its own; set "
                                        r"parallel.mesh = \{ep = 2\}"):
        prepare(plan_config({}, parallel_strategy="ep"), 2, Plugins())
