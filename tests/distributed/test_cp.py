"""``cp``: the spiking language model's sequence split across ranks trains as one process would: in float64,
every step's loss and firing rate within 1e-9 relative of none's with the same microbatches (the validations' loss,
perplexity's loss and per-position accuracy, and the final state included), alone and composed with tp, pp and time,
its mixture-of-experts balance loss included."""

import subprocess
import sys

import pytest

from snnfw.testing import run_on_ranks
from snnfw.testing.checks import assert_close
from snnfw.testing.equivalence import Case, _composed, case_config
from snnfw.testing.guarantee import check_case, checked_reference, on

STEPS, EVAL_EVERY = 2, 2
TEXT = {"name": "python_bytes", "batch_size": 16, "train_samples": 128, "test_samples": 32}
CASES = (
    _composed({"cp": 2}),
    _composed({"cp": 2, "tp": 2}),
    _composed({"pp": 2, "cp": 2}, 2),
    _composed({"time": 2, "cp": 2}),
)


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_the_spiking_lm_matches_none_in_float64_with_its_sequence_split(case: Case):
    check_case("spiking_lm", case, STEPS, EVAL_EVERY, timeout_s=300, data=TEXT)


def test_a_cp_checkpoint_resumes_on_a_tensor_parallel_mesh(tmp_path):
    """{cp = 2} trains a step and checkpoints it, {tp = 2} goes on from there: none's losses, each step within 1e-9
    relative. Predictions under cp, which would list each rank's positions alone, are refused in one line."""
    want = checked_reference("spiking_lm", 1, STEPS, EVAL_EVERY, data=tuple(sorted(TEXT.items())))["losses"]

    def config(mesh: dict, steps: int):
        case = Case("mesh", "mesh", 2, 1, 1, {"parallel": {"mesh": mesh}, "checkpoint": {"every": 1}})
        return on(case_config("spiking_lm", case, "float64", steps, data=TEXT), EVAL_EVERY)

    saved = run_on_ranks(config({"cp": 2}, 1), 2, tmp_path, timeout_s=300)
    resumed = run_on_ranks(config({"tp": 2}, STEPS), 2, tmp_path, resume=True, timeout_s=300)
    for rank, (before, after) in enumerate(zip(saved, resumed)):
        assert after["resumed_from"] == 1 and len(before["losses"]) == 1 and len(after["losses"]) == STEPS
        for step, (have, expected) in enumerate(zip(after["losses"], want), start=1):
            assert_close(f"rank {rank} step {step} loss", have, expected)
        assert_close(f"rank {rank} step 1 loss before the checkpoint", before["losses"][0], want[0])
    toml = tmp_path / "tiny.toml"
    toml.write_text('[model]\nfamily = "spiking_lm"\nflavor = "tiny"\ntime_steps = 4\n[data]\nname = "python_bytes"\n'
                    'batch_size = 16\ntrain_samples = 128\ntest_samples = 32\n[train]\ndtype = "float64"\n')
    out = tmp_path / "predictions.jsonl"
    done = subprocess.run([sys.executable, "-m", "snnfw", "predict", str(toml), "--weights", str(tmp_path), "--nproc", "2",
                           "--set", "parallel.mesh={cp = 2}", "--out", str(out), "--run-dir", str(tmp_path / "predicted")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and not out.exists(), done.stderr[-2000:]
    assert ("snnfw: error: predictions list each sample's positions whole, and this mesh splits the sequence across "
            "ranks (cp); predict under a mesh without cp") in done.stderr.splitlines(), done.stderr[-2000:]


@pytest.mark.parametrize("mesh, world, family, message", [
    ({"dp_replicate": 2, "cp": 2}, 4, "sequence_mlp", "dimension cp (cp): cp splits a language model's sequence, and "
                                                      "model family 'sequence_mlp' takes frames, not token ids"),
    ({"cp": 3}, 3, "spiking_lm", "dimension cp (cp): the sequence of 16 tokens does not split into 3 equal slices; "
                                 "use a cp size that divides it, or set model.sequence_length to a multiple of 3"),
])
def test_what_cp_cannot_split_is_refused_in_one_line_naming_the_rule(mesh, world, family, message):
    from snnfw.errors import PlanError
    from snnfw.plan.prepare import prepare
    from snnfw.plugin.manager import Plugins

    case = Case("mesh", "mesh", world, 1, 1, {"parallel": {"mesh": mesh}})
    with pytest.raises(PlanError) as refused:
        prepare(case_config(family, case, "float64", data=TEXT if family == "spiking_lm" else None), world, Plugins())
    assert message in str(refused.value) and "\n" not in str(refused.value), str(refused.value)


def test_the_dry_run_trains_a_step_of_a_pipeline_whose_stages_split_the_sequence():
    """``snnfw plan --dry-run``'s zero batches are cut to each rank's positions as the loader cuts them, so a
    pipeline's stages, shaped by the rank's slice, take them; the plan says the bytes cp adds."""
    from snnfw.config import build_config
    from snnfw.plugin.manager import Plugins
    from snnfw.tools.dry_run import dry_run

    config = build_config({
        "model": {"family": "spiking_lm", "flavor": "small", "time_steps": 4, "sequence_length": 16},
        "data": {"name": "python_bytes", "batch_size": 8, "train_samples": 64, "test_samples": 16},
        "train": {"steps": 1, "microbatches": 2},
        "parallel": {"strategy": "mesh", "mesh": {"pp": 2, "cp": 2}},
    })
    plan, footprints = dry_run(config, 4, Plugins())
    assert [rank for rank, _ in footprints] == [0, 3] and all(f.activations > 0 for _, f in footprints)
    # a stage's 2 layers' k and v (128 channels each) of 8 samples x 4 steps x 16 positions in float32 are 1 MiB,
    # of which a rank receives half forward (the all-gather) and half backward (the reduce-scatter)
    assert "each rank receives 1.0 MiB a step" in " ".join(plan.rationale), plan.rationale
