"""The spiking language model (``spiking_lm`` tiny, with its mixture-of-experts layer) on the Python sources' bytes
trains under every mesh dimension as one process would: in float64, every step's loss and firing rate within 1e-9
relative of none's with the same microbatches, the validations (loss, perplexity's loss, per-position accuracy) and
the final state included, every neuron layer firing."""

import pytest

from snnfw.testing.equivalence import Case, _composed
from snnfw.testing.guarantee import check_case

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
