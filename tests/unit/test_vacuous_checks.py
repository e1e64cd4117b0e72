"""The shared checks fail on what would make them compare nothing: zero steps, a series shorter than the steps
(an empty one), no validation due, no parameters."""

import pytest

from snnfw.testing.checks import assert_steps_close
from snnfw.testing.guarantee import assert_same_validations

RUN = {"losses": [2.3, 2.2, 2.1], "spike_rates": [0.1, 0.1, 0.1]}


def test_steps_compare_every_step_of_every_series():
    assert_steps_close(0, RUN, RUN, ("losses", "spike_rates"), 3)
    for got, want, steps in [({"losses": []}, {"losses": []}, 0),  # zero steps
                             ({**RUN, "spike_rates": []}, {**RUN, "spike_rates": []}, 3),  # a series never recorded
                             (RUN, {**RUN, "losses": []}, 3)]:  # a reference of nothing
        with pytest.raises(AssertionError):
            assert_steps_close(0, got, want, ("losses", "spike_rates"), steps)


def test_validations_must_be_due():
    evaluations = [{"step": 3, "eval_acc": 0.5, "eval_acc5": 1.0, "eval_loss": 1.0, "eval_spike_rate": 0.1}]
    assert_same_validations(0, evaluations, evaluations, 3, 3)
    with pytest.raises(AssertionError, match="no validation to compare"):
        assert_same_validations(0, [], [], 3, 5)
