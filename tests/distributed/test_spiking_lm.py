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



def test_the_dry_run_trains_a_step_of_the_language_model_on_a_fake_mesh_and_refuses_a_mixture_of_experts():
    """``snnfw plan --dry-run``'s zero batches are token ids and next tokens, trained with the family's loss; the
    fake tensors it runs on have no values to route tokens by, which it says in one line."""
    from snnfw.config import build_config
    from snnfw.errors import PlanError
    from snnfw.plugin.manager import Plugins
    from snnfw.tools.dry_run import dry_run

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
