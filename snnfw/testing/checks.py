"""Assertions that tests of snnfw and its plugins share: losses and states against ``none``'s, firing neurons."""

from typing import Any, Callable

import torch

from snnfw.distributed.chunks import gather_whole
from snnfw.errors import UserError
from snnfw.run.loop import run_training
from snnfw.testing import local_parameters, run_on_ranks

SPIKE_RATE = (0.02, 0.5)


def assert_same_losses(reference, summary, tol=1e-5):
    assert len(summary["losses"]) == len(reference["losses"]) == len(summary["spike_rates"]) == 3
    for step, (ref, got) in enumerate(zip(reference["losses"], summary["losses"]), start=1):
        assert abs(ref - got) <= tol, f"step {step}: loss {got} differs from reference {ref}"
    for rate in summary["spike_rates"]:
        assert SPIKE_RATE[0] <= rate <= SPIKE_RATE[1], f"spike rate {rate} outside {SPIKE_RATE}: neurons barely fire"


def parameters_and_buffers(trainer):
    buffers = {name: b.detach().clone() for name, b in getattr(trainer.model, "module", trainer.model).named_buffers()}
    return {"parameters": local_parameters(trainer), "buffers": buffers}


def assert_dp_matches_none(make_config, tmp_path):
    """dp on 2 ranks loses what none does with 2 microbatches; the replicas end identical, BatchNorm
    running statistics equal to none's included, so the test accuracy is none's."""
    reference = run_training(make_config("none", microbatches=2), on_finish=parameters_and_buffers)
    summaries = run_on_ranks(make_config("dp"), 2, tmp_path, inspect=parameters_and_buffers)
    for summary in summaries:
        assert_same_losses(reference, summary)
        assert summary["test_accuracy"] == reference["test_accuracy"]
        buffers = summary["inspect"]["buffers"]
        assert buffers.keys() == reference["inspect"]["buffers"].keys() and any("running_mean" in n for n in buffers)
        for name, tensor in reference["inspect"]["buffers"].items():
            assert torch.allclose(buffers[name], tensor, rtol=1e-5, atol=1e-7), f"buffer {name} differs from none's"
    params = [s["inspect"]["parameters"] for s in summaries]
    assert params[0] and params[0].keys() == params[1].keys(), "the replicas hold no parameters, or different ones"
    for name, tensor in params[0].items():
        assert torch.equal(tensor, params[1][name]), f"replicas differ in {name}"


def final_state(trainer):
    """The whole model state by the model's own names (every strategy's checkpoint view), and the optimizer's step."""
    state = trainer.plugins.state_dict(trainer.model, trainer.optimizer, trainer.plan)["model"]
    return {name: tensor.clone() for name, tensor in gather_whole(state, dst=None).items()}


def assert_close(name, got, want, rel_tol=1e-9):
    """``got`` within ``rel_tol`` of ``want``, relative to the largest magnitude of ``want``."""
    scale = want.abs().max().item() if torch.is_tensor(want) else abs(want)
    diff = (got - want).abs().max().item() if torch.is_tensor(want) else abs(got - want)
    assert diff <= rel_tol * max(scale, 1e-12), f"{name}: differs from none by {diff:.3g} (scale {scale:.3g})"


def assert_steps_close(rank: int, got: dict, want: dict, series: tuple[str, ...], steps: int) -> None:
    """Rank ``rank``'s summary ``got`` has ``steps`` steps (1 or more), and each of its ``series`` (``"losses"``,
    ``"grad_norms"``, ...) is ``want``'s within :func:`assert_close` at every step, both as long."""
    assert steps >= 1, "a comparison of 0 steps compares nothing"
    for key in dict.fromkeys(("losses", *series)):
        lengths = len(got[key]), len(want[key])
        assert lengths == (steps, steps), f"rank {rank}: {lengths[0]} {key} against {lengths[1]}, expected {steps}"
    for key in series:
        for step, (value, ref) in enumerate(zip(got[key], want[key]), start=1):
            assert_close(f"rank {rank} step {step} {key}", value, ref)


def assert_same_state(rank: int, state: dict, want: dict) -> None:
    """The model state a rank returned (``final_state``) is ``want``'s within :func:`assert_close`, name by name."""
    assert state, f"rank {rank} holds no model state"
    for name, tensor in state.items():
        assert_close(f"rank {rank} {name}", tensor, want[name])


def user_outcome(action: Callable[[], Any], what: str) -> str:
    """What a user sees of ``action()``: ``"done"``, or ``"refused"`` for a user error (one line at the command
    line); any other exception, which would be a traceback there, fails with ``what`` named."""
    try:
        action()
    except UserError:
        return "refused"
    except Exception as err:
        raise AssertionError(f"{what} raised {type(err).__name__}: {err}") from err
    return "done"
