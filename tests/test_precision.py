"""train.precision = "bf16": autocast in every strategy, parameters in fp32, losses as none's bf16 run.

Measured over 20 steps on the SEW network of examples/train_own_model.py
(largest relative loss difference from none's bf16 run with the same
microbatches): dp, zero, fsdp2 and HSDP 0 (bit for bit), pp 9e-8, tp 1.1e-3
and fsdp2_tp 1.5e-3 (a conv's channel slices are summed in another order in
bf16). The bound below is 5e-3.
"""

import functools

import pytest
import torch

from snnfw.config import build_config
from snnfw.equivalence import CASES, case_config, reference_config
from snnfw.errors import ConfigError
from snnfw.plugins import Plugins
from snnfw.prepare import prepare
from snnfw.runtime import run_training
from snnfw.testing import run_on_ranks

FAMILY, STEPS, REL_TOL = "own_sew", 20, 5e-3
BF16 = {"precision": "bf16"}
DEFAULT_RUN = {"tp"}  # within the suite's time budget; -m full_matrix runs the rest


def precision_seen(trainer):
    """The dtype of a convolution's output in one more training step, and the dtypes of the parameters."""
    seen = []
    conv = next((m for m in trainer.model.modules() if isinstance(m, torch.nn.Conv2d)), None)
    handle = conv.register_forward_hook(lambda m, args, out: seen.append(str(out.dtype))) if conv is not None else None
    trainer.step(0)  # a collective: every rank runs it
    if handle is not None:
        handle.remove()
    return {"activation": seen[0] if seen else None, "parameters": sorted({str(p.dtype) for p in trainer.model.parameters()})}


@functools.cache
def reference(microbatches):
    return run_training(reference_config(FAMILY, microbatches, "float32", STEPS, BF16), on_finish=precision_seen)


def cases():
    for case in CASES:
        if case.name in ("dp", "zero", "fsdp2", "hsdp", "tp", "fsdp2_tp", "pp-1f1b", "pp-zbv"):
            marks = [] if case.name in DEFAULT_RUN else [pytest.mark.full_matrix]
            yield pytest.param(case, id=case.name, marks=marks)


@pytest.mark.parametrize("case", cases())
def test_bf16_trains_like_none_in_bf16_with_fp32_parameters(case):
    want = reference(case.reference_microbatches)
    assert want["inspect"] == {"activation": "torch.bfloat16", "parameters": ["torch.float32"]}
    summaries = run_on_ranks(case_config(FAMILY, case, "float32", STEPS, BF16), case.ranks, inspect=precision_seen, timeout_s=300)
    for rank, got in enumerate(summaries):
        worst = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], want["losses"]))
        assert len(got["losses"]) == STEPS and worst <= REL_TOL, f"rank {rank}: {worst:.3g} from none's bf16 losses"
        assert got["inspect"]["parameters"] == ["torch.float32"]
    seen = {s["inspect"]["activation"] for s in summaries} - {None}  # a pipeline rank without convolutions sees none
    assert seen == {"torch.bfloat16"}


def test_fp32_runs_without_autocast_and_bf16_changes_the_losses():
    fp32 = run_training(reference_config(FAMILY, 1, "float32", 3), on_finish=precision_seen)
    assert fp32["inspect"]["activation"] == "torch.float32"
    bf16 = run_training(reference_config(FAMILY, 1, "float32", 3, BF16))
    assert fp32["losses"][0] != bf16["losses"][0]


@pytest.mark.parametrize(
    "train, message",
    [({"precision": "fp16"}, "gradient scaler"), ({"precision": "bf16", "dtype": "float64"}, "train.dtype is 'float64'")],
)
def test_precisions_that_cannot_apply_are_refused(train, message):
    with pytest.raises(ConfigError, match=message):
        prepare(build_config({"train": train}), 1, Plugins())
