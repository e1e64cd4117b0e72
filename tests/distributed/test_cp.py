"""``cp``: the spiking language model's sequence split across ranks trains as one process would: in float64,
every step's loss and firing rate within 1e-9 relative of none's with the same microbatches (the validations' loss,
perplexity's loss and per-position accuracy, and the final state included), alone and composed with tp, pp and time,
its mixture-of-experts balance loss included."""

import pytest

from snnfw.testing.equivalence import Case, _composed
from snnfw.testing.guarantee import check_case

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
