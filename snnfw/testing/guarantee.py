"""The float64 guarantee's check of one strategy case against ``none`` (``tests/guarantee``, and the GPU run of
``benchmark/gpu.sh --guarantee``): every step's loss and firing rate, the validations and the final model state
within 1e-9 relative, with every neuron layer firing."""

from __future__ import annotations

import functools

import attrs

from snnfw.config import Config
from snnfw.run.loop import run_training
from snnfw.testing import run_on_ranks
from snnfw.testing.checks import assert_close, assert_same_state, assert_steps_close, final_state
from snnfw.testing.equivalence import Case, case_config, reference_config

LAYER_RATE = (0.005, 0.7)  # every neuron layer fires, none saturates


def on(config: Config, eval_every: int, parallel: tuple[tuple[str, str], ...] = ()) -> Config:
    """``config`` validated every ``eval_every`` steps, with ``parallel`` keys (``device``, ``backend``) set."""
    return attrs.evolve(config, eval=attrs.evolve(config.eval, every=eval_every),
                        parallel=attrs.evolve(config.parallel, **dict(parallel)))


@functools.cache
def reference(family: str, microbatches: int, steps: int, eval_every: int, parallel: tuple = (), data: tuple = ()) -> dict:
    """``none``'s run in float64 with ``microbatches``, on ``parallel``'s device (one rank: no backend), on the
    recipe's data with ``data``'s ``(key, value)`` pairs."""
    device = tuple((key, value) for key, value in parallel if key != "backend")
    config = on(reference_config(family, microbatches, "float64", steps, data=dict(data)), eval_every, device)
    return run_training(config, on_finish=final_state)


def assert_same_validations(rank, got, want, steps: int, eval_every: int):
    due = list(range(eval_every, steps + 1, eval_every))
    assert due, f"eval_every {eval_every} is past the last of {steps} steps: no validation to compare"
    assert [e["step"] for e in got] == [e["step"] for e in want] == due
    for mine, ref in zip(got, want):
        step = mine["step"]
        assert (mine["eval_acc"], mine["eval_acc5"]) == (ref["eval_acc"], ref["eval_acc5"]), f"rank {rank} step {step}"
        assert_close(f"rank {rank} step {step} eval_loss", mine["eval_loss"], ref["eval_loss"])
        assert_close(f"rank {rank} step {step} eval_spike_rate", mine["eval_spike_rate"], ref["eval_spike_rate"])


def checked_reference(family: str, microbatches: int, steps: int, eval_every: int, parallel: tuple = (),
                      separates: float = 0.0, data: tuple = ()) -> dict:
    """:func:`reference`, asserted to be worth comparing with: every neuron layer fires, and its test accuracy
    reaches ``separates``."""
    want = reference(family, microbatches, steps, eval_every, parallel, data)
    rates = want["layer_spike_rates"]
    assert rates and all(LAYER_RATE[0] <= r <= LAYER_RATE[1] for r in rates.values()), \
        f"every neuron layer must fire at a rate in {LAYER_RATE}: layer firing rates {rates}"
    assert want["test_accuracy"] >= separates, f"the reference does not separate classes: {want['test_accuracy']}"
    return want


def check_case(family: str, case: Case, steps: int, eval_every: int, parallel: tuple = (), timeout_s: float = 300,
               separates: float = 0.0, data: dict | None = None) -> None:
    """Trains ``case`` on its ranks in float64 and asserts it matches ``none``'s run (:func:`checked_reference`);
    ``data``: keys of the recipe's ``[data]`` to replace (another data set)."""
    data = tuple(sorted((data or {}).items()))
    want = checked_reference(family, case.reference_microbatches, steps, eval_every, parallel, separates, data)
    config = on(case_config(family, case, "float64", steps, data=dict(data)), eval_every, parallel)
    summaries = run_on_ranks(config, case.ranks, inspect=final_state, timeout_s=timeout_s)
    for rank, got in enumerate(summaries):
        assert_steps_close(rank, got, want, ("losses", "spike_rates"), steps)
        assert_same_validations(rank, got["evaluations"], want["evaluations"], steps, eval_every)
        assert_same_state(rank, got["inspect"], want["inspect"])
    held = set().union(*(s["inspect"] for s in summaries))
    assert held == set(want["inspect"]), f"state not held by any rank: {sorted(set(want['inspect']) - held)}"
