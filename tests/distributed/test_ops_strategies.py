"""Synaptic operations under every strategy: the counts of sharded, pipelined and time-split runs are none's."""

import functools

import pytest

from snnfw.testing import run_on_ranks
from snnfw.testing.equivalence import CASES, case_config, reference_config

TIMEOUT_S = 240
FAMILY = "cifar10dvs_vgg"
SETTINGS = dict(dtype="float64", steps=1, data={"test_samples": 6})


def counted(trainer) -> dict:
    """Every layer's counts over the test split and the firing rate (a collective)."""
    result = trainer.evaluate(ops=True)
    return {"layers": result["layer_ops"], "sops": result["eval_sops"], "macs": result["eval_macs"],
            "rate": result["eval_spike_rate"]}


def run(config, ranks: int) -> dict:
    return run_on_ranks(config, ranks, timeout_s=TIMEOUT_S, inspect=counted)[0]["inspect"]


@functools.cache
def reference(microbatches: int) -> dict:
    """``none`` with as many microbatches as the case's replicas x microbatches (the same BatchNorm statistics)."""
    return run(reference_config(FAMILY, microbatches, **SETTINGS), 1)


@pytest.mark.parametrize("name", ["dp", "tp", "pp-1f1b", "tsp"])
def test_totals_equal_nones(name):
    case = next(case for case in CASES if case.name == name)
    want, got = reference(case.reference_microbatches), run(case_config(FAMILY, case, **SETTINGS), case.ranks)
    assert want["sops"] > 0 and want["macs"] > 0
    assert got == want
