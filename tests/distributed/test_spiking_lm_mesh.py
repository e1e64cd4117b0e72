"""The spiking language model (``spiking_lm`` tiny, with its mixture-of-experts layer) on the Python sources' bytes
trains under every mesh dimension as one process would: in float64, every step's loss and firing rate within 1e-9
relative of none's with the same microbatches, the validations (loss, perplexity's loss, per-position accuracy) and
the final state included, every neuron layer firing; a checkpoint moves between meshes; the dry run trains it."""

import pytest

from snnfw.config import build_config
from snnfw.errors import PlanError
from snnfw.plugin.manager import Plugins
from snnfw.run.loop import run_training
from snnfw.testing import run_on_ranks
from snnfw.testing.checks import assert_close
from snnfw.testing.equivalence import Case, _composed
from snnfw.testing.guarantee import check_case
from snnfw.tools.dry_run import dry_run

STEPS, EVAL_EVERY = 4, 2
TEXT = {"name": "python_bytes", "batch_size": 16, "train_samples": 128, "test_samples": 32}
CASES = (
    _composed({"dp_replicate": 2}),
    _composed({"dp_shard": 2}),
    _composed({"tp": 2}),
    _composed({"pp": 2}, 2),
    _composed({"time": 2}),
    _composed({"pp": 2, "tp": 2}, 2),
)


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_the_spiking_lm_matches_none_in_float64_under_each_dimension(case: Case):
    check_case("spiking_lm", case, STEPS, EVAL_EVERY, timeout_s=300, data=TEXT)


def test_the_dry_run_trains_a_step_of_the_language_model_on_a_fake_mesh_and_refuses_a_mixture_of_experts():
    """``snnfw plan --dry-run``'s zero batches are token ids and next tokens, trained with the family's loss; the
    fake tensors it runs on have no values to route tokens by, which it says in one line."""

    def config(flavor):
        return build_config({
            "model": {"family": "spiking_lm", "flavor": flavor, "time_steps": 4, "sequence_length": 16},
            "data": {"name": "python_bytes", "batch_size": 8, "train_samples": 64, "test_samples": 16},
            "train": {"steps": 1, "microbatches": 2},
            "parallel": {"strategy": "mesh", "mesh": {"pp": 2, "tp": 2}},
        })

    plan, footprints = dry_run(config("small"), 4, Plugins())
    assert plan.config.train.loss == "next_token" and [rank for rank, _ in footprints] == [0, 3]
    assert all(f.parameters > 0 and f.neurons > 0 and f.activations > 0 for _, f in footprints)
    with pytest.raises(PlanError, match="shape depends on values .*plan it without --dry-run"):
        dry_run(config("tiny"), 4, Plugins())


def test_a_tensor_parallel_checkpoint_resumes_on_a_pipeline(tmp_path):
    """tp = 2 (each rank its heads' and experts' slices) saved at step 3, resumed on pp = 2: none's float64 losses
    with the same 2 microbatches (the balance loss is a microbatch's), each within 1e-9 relative."""

    def config(steps, mesh=None, every=3):
        parallel = {"strategy": "mesh", "mesh": mesh} if mesh else {"strategy": "none"}
        return build_config({
            "model": {"family": "spiking_lm", "flavor": "tiny", "time_steps": 4}, "data": TEXT,
            "train": {"steps": steps, "lr": 3e-3, "optimizer": "adam", "seed": 3, "dtype": "float64", "microbatches": 2},
            "parallel": parallel, "checkpoint": {"every": every},
        })

    want = run_training(config(6, every=0))["losses"]
    saved = run_on_ranks(config(3, {"tp": 2}), 2, tmp_path, timeout_s=300)
    resumed = run_on_ranks(config(6, {"pp": 2}), 2, tmp_path, resume=True, timeout_s=300)
    for rank, summary in enumerate(saved + resumed):
        assert len(summary["losses"]) == (3 if rank < 2 else 6)
        for step, (have, expected) in enumerate(zip(summary["losses"], want), start=1):
            assert_close(f"rank {rank % 2} step {step} loss", have, expected)
    assert all(summary["resumed_from"] == 3 for summary in resumed)


@pytest.mark.parametrize("mesh", [{"cp": 2}, {"ep": 2}], ids=["cp", "ep"])
def test_snnfw_export_of_a_cp_or_ep_checkpoint_loads_into_the_family_module_as_the_ranks_held_it(tmp_path, mesh):
    """cp's ranks hold the whole model, ep's each half the experts: the export is every tensor whole, equal to the
    state the ranks ended with, and loads strictly into the family's own module."""
    import subprocess
    import sys

    import torch

    from snnfw.plan.prepare import build_model
    from snnfw.testing.checks import final_state

    config = build_config({
        "model": {"family": "spiking_lm", "flavor": "tiny", "time_steps": 4}, "data": TEXT,
        "train": {"steps": 2, "seed": 3}, "checkpoint": {"every": 2},
        "parallel": {"strategy": "mesh", "mesh": mesh, "device": "cpu"}})
    final = run_on_ranks(config, 2, tmp_path / "run", timeout_s=300, inspect=final_state)[0]["inspect"]
    out = tmp_path / "x.pt"
    done = subprocess.run([sys.executable, "-m", "snnfw", "export", str(tmp_path / "run"), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    exported = torch.load(out, weights_only=True)
    model = build_model(build_config({"model": {"family": "spiking_lm", "flavor": "tiny", "time_steps": 4},
                                      "data": TEXT}), Plugins())[0]
    model.load_state_dict(exported, strict=True)
    assert sorted(exported) == sorted(final) == sorted(model.state_dict())
    for name, tensor in final.items():
        assert torch.equal(exported[name], tensor), name
