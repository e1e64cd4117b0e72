"""Optimizers and learning-rate schedules by name: curves, weight-decay groups, refusals, the guarantee, resuming."""

import copy
import functools
import json
import math
import types

import pytest
import torch
from spikingjelly.activation_based import neuron
from torch import nn

from snnfw import hookimpl
from snnfw.components.optim import (
    OptimizerSpec,
    build_optimizer,
    build_scheduler,
    check_train,
    optimizer_options,
    parameter_groups,
)
from snnfw.config import build_config
from snnfw.errors import ConfigError, UnknownNameError
from snnfw.plugin.manager import Plugins
from snnfw.run.loop import run_training
from snnfw.testing import RankFailure, run_on_ranks, tiny_config
from snnfw.testing.checks import assert_close, assert_same_state, assert_steps_close, final_state
from snnfw.testing.equivalence import CASES, case_config, reference_config


@pytest.fixture(scope="module")
def plugins():
    return Plugins()


def train(**keys):
    return build_config({"train": {"steps": 10, "lr": 1.0, **keys}}).train


def curve(plugins, **keys):
    """The learning rate of each optimizer step, stepping the scheduler as the runtime does."""
    config = train(**keys)
    optimizer = build_optimizer(nn.Linear(2, 2), config, plugins)
    scheduler = build_scheduler(optimizer, config, plugins)
    lrs = []
    for _ in range(config.steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


@pytest.mark.parametrize(
    "keys, expected",
    [
        ({}, [1.0] * 10),
        ({"warmup_steps": 4}, [0.2, 0.4, 0.6, 0.8] + [1.0] * 6),
        ({"lr_schedule": "cosine", "warmup_steps": 2, "min_lr": 0.2},  # 0.2 + 0.4 (1 + cos(pi (s - 2) / 8))
         [1 / 3, 2 / 3, 1.0, 0.2 + 0.4 * (1 + math.cos(math.pi / 8)), None, None, 0.6, None, None,
          0.2 + 0.4 * (1 + math.cos(7 * math.pi / 8))]),
        ({"lr_schedule": "step", "warmup_steps": 2, "step_size": 3, "gamma": 0.5},
         [1 / 3, 2 / 3, 1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.25, 0.25]),
        ({"lr_schedule": "multistep", "milestones": [3, 7]}, [1.0] * 3 + [0.1] * 4 + [0.01] * 3),
    ],
    ids=["constant", "constant-warmup", "cosine", "step", "multistep"],
)
def test_lr_curve(plugins, keys, expected):
    lrs = curve(plugins, **keys)
    for step, (got, want) in enumerate(zip(lrs, expected, strict=True)):
        if want is not None:
            assert got == pytest.approx(want, rel=1e-12), f"step {step}: lr {got}, expected {want}"


def test_cosine_ends_near_its_floor_and_descends(plugins):
    lrs = curve(plugins, lr_schedule="cosine", warmup_steps=2, min_lr=0.1)
    assert lrs[2] == 1.0 and all(a > b for a, b in zip(lrs[2:], lrs[3:]))
    assert 0.1 < lrs[-1] < 0.15


class Net(nn.Module):
    """A conv with bias, BatchNorm, a PLIF neuron (its time constant ``w`` a parameter) and a linear head."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3, bias=True)
        self.bn = nn.BatchNorm2d(2)
        self.plif = neuron.ParametricLIFNode()
        self.head = nn.Linear(2, 3)


@pytest.mark.parametrize(
    "kinds, exempt",
    [
        (["norm"], {"bn.weight", "bn.bias"}),
        (["bias"], {"conv.bias", "bn.bias", "head.bias"}),
        (["neuron"], {"plif.w"}),
        (["norm", "bias", "neuron"], {"bn.weight", "bn.bias", "conv.bias", "head.bias", "plif.w"}),
    ],
)
def test_no_decay_exempts_exactly_the_named_kinds(plugins, kinds, exempt):
    model = Net()
    names = {id(p): name for name, p in model.named_parameters()}
    optimizer = build_optimizer(model, train(optimizer="adamw", weight_decay=0.05, no_decay=kinds), plugins)
    decayed, free = optimizer.param_groups
    assert decayed["weight_decay"] == 0.05 and free["weight_decay"] == 0.0
    assert {names[id(p)] for p in free["params"]} == exempt
    assert {names[id(p)] for p in decayed["params"]} == set(dict(model.named_parameters())) - exempt


def test_without_no_decay_one_group_with_the_optimizers_defaults(plugins):
    adamw = build_optimizer(Net(), train(optimizer="adamw"), plugins)
    sgd = build_optimizer(Net(), train(optimizer="sgd", nesterov=True), plugins)
    assert len(adamw.param_groups) == 1 and adamw.defaults["weight_decay"] == 0.01
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["momentum"] == 0.9 and sgd.defaults["nesterov"]
    model = Net()
    assert [id(p) for p in parameter_groups(model, train())] == [id(p) for p in model.parameters()]


@pytest.mark.parametrize(
    "keys, message",
    [
        ({"optimizer": "adam", "momentum": 0.9}, "train.momentum does not apply to train.optimizer = 'adam'"),
        ({"optimizer": "sgd", "betas": [0.9, 0.99]}, "train.betas does not apply to train.optimizer = 'sgd'"),
        ({"optimizer": "sgd", "momentum": 0.0, "nesterov": True}, "train.nesterov needs momentum"),
        ({"optimizer": "adam", "no_decay": ["bias"]}, "train.no_decay exempts parameters from weight decay"),
        ({"lr_schedule": "cosine", "milestones": [3]}, "train.milestones does not apply to train.lr_schedule = 'cosine'"),
        ({"lr_schedule": "constant", "gamma": 0.5}, "train.gamma does not apply to train.lr_schedule = 'constant'"),
        ({"lr_schedule": "step"}, "needs train.step_size"),
        ({"lr_schedule": "multistep", "milestones": [5, 12]}, "train.milestones must be increasing steps"),
        ({"lr_schedule": "cosine", "min_lr": 2.0}, "train.min_lr (2.0) must be below train.lr"),
        ({"warmup_steps": 10}, "train.warmup_steps (10) must be less than train.steps"),
    ],
)
def test_keys_that_do_not_apply_are_refused_by_name(plugins, keys, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_train(train(**keys), plugins)


def test_unknown_names_list_the_registered_ones(plugins):
    with pytest.raises(UnknownNameError, match="registered optimizer names: adam, adamw, sgd"):
        check_train(train(optimizer="lamb"), plugins)
    with pytest.raises(UnknownNameError, match="registered lr schedule names: constant, cosine, multistep, step"):
        check_train(train(lr_schedule="onecycle"), plugins)


def placed(*meshes):
    """Stand-ins for parameters: plain tensors (None) or DTensors of the named meshes."""
    return [types.SimpleNamespace(device_mesh=mesh) if mesh else torch.zeros(1) for mesh in meshes]


@pytest.mark.parametrize(
    "optimizer, parameters, expected",
    [
        ("adam", placed(None, None), {"fused": True}),
        ("sgd", placed(None), {"fused": True}),
        ("adamw", placed("dp", "dp"), {"fused": True}),  # fsdp2: DTensor shards Adam's and AdamW's fused kernels
        ("sgd", placed("dp", "dp"), {}),  # ... and not SGD's: torch's own choice
        ("adam", placed("tp", None), {"foreach": False}),  # plain tensors beside DTensors: one at a time
        ("adam", placed(("dp", "tp"), "dp"), {"foreach": False}),  # DTensors of two meshes
    ],
    ids=["plain", "plain-sgd", "dtensors", "dtensors-sgd", "mixed", "two-meshes"],
)
def test_auto_optimizer_impl_is_the_fused_kernel_where_it_runs(plugins, optimizer, parameters, expected):
    _, kwargs = optimizer_options(train(optimizer=optimizer), plugins, parameters)
    assert {k: kwargs[k] for k in ("fused", "foreach") if k in kwargs} == expected


@pytest.mark.parametrize(
    "optimizer, impl, parameters, message",
    [
        ("adam", "fused", placed("tp", None), "cannot run over this strategy's parameters: plain tensors beside DTensors"),
        ("adam", "foreach", placed("tp", None), "plain tensors beside DTensors"),
        ("sgd", "fused", placed("dp"), "DTensor has no fused SGD kernel"),
    ],
)
def test_an_optimizer_impl_that_cannot_run_is_refused(plugins, optimizer, impl, parameters, message):
    _, kwargs = optimizer_options(train(optimizer=optimizer, optimizer_impl="for_loop"), plugins, parameters)
    assert kwargs["foreach"] is False
    with pytest.raises(ConfigError, match=message):
        optimizer_options(train(optimizer=optimizer, optimizer_impl=impl), plugins, parameters)


def test_an_optimizer_without_the_kernel_is_refused_before_the_run():
    class Plain(torch.optim.Optimizer):
        def __init__(self, params, lr):
            super().__init__(params, {"lr": lr})

    own = types.SimpleNamespace(optimizers={"plain": OptimizerSpec(lambda: Plain, ())})
    own.lr_schedules = Plugins().lr_schedules
    assert optimizer_options(train(optimizer="plain"), own, placed(None))[1] == {"lr": 1.0}  # auto: the class's way
    with pytest.raises(ConfigError, match="optimizer_impl = 'fused' needs an optimizer that takes 'fused'.*Plain"):
        check_train(train(optimizer="plain", optimizer_impl="fused"), own)


def test_the_fused_kernel_trains_as_the_loop_over_parameters():
    """auto's fused Adam against the loop over parameters, 10 float64 steps of none: the same arithmetic."""
    def state_and_kernel(trainer):
        return {"state": final_state(trainer), "fused": trainer.optimizer.defaults["fused"]}

    fused, loop = [run_training(tiny_config(train={"steps": 10, "dtype": "float64", "optimizer_impl": impl}),
                                on_finish=state_and_kernel) for impl in ("auto", "for_loop")]
    assert fused["inspect"]["fused"] and not loop["inspect"]["fused"]
    for step, (got, want) in enumerate(zip(fused["losses"], loop["losses"], strict=True), start=1):
        assert_close(f"step {step} loss", got, want)
    for name, tensor in fused["inspect"]["state"].items():
        assert_close(name, tensor, loop["inspect"]["state"][name])


# The guarantee with decoupled weight decay, exempt groups, a warmed-up cosine, gradient clipping, label smoothing
# and augmentation (256 samples, so 20 steps of 32 cover 2.5 epochs, each transformed anew):
# the pre-clip norm of the whole model equals none's on whole, sharded, sliced and staged gradients.
CLIP = 0.25  # below every step's gradient norm (0.3-0.6 in the reference): every step clips
RECIPE = {"optimizer": "adamw", "weight_decay": 0.05, "no_decay": ["norm", "bias", "neuron"],
          "lr_schedule": "cosine", "warmup_steps": 5, "min_lr": 3e-4, "clip_grad_norm": CLIP, "label_smoothing": 0.1}
AUGMENT = {"augment": ["hflip", "roll"], "roll_pixels": 3}
STEPS = 20


@functools.cache
def reference(microbatches):
    return run_training(reference_config("cifar10dvs_vgg", microbatches, "float64", STEPS, RECIPE, AUGMENT), on_finish=final_state)


def recipe_cases():
    """Sliced (tp) and staged (pp) parameters in the default run; the others with -m full_matrix."""
    for case in CASES:
        if case.name in ("dp", "zero", "fsdp2", "hsdp", "tp", "fsdp2_tp", "pp-1f1b", "pp-x-dp"):
            marks = [] if case.name in ("tp", "pp-1f1b") else [pytest.mark.full_matrix]
            yield pytest.param(case, id=case.name, marks=marks)


@pytest.mark.parametrize("case", recipe_cases())
def test_float64_adamw_cosine_clipped_matches_none(case):
    want = reference(case.reference_microbatches)
    assert all(0.02 < rate < 0.5 for rate in want["spike_rates"]), f"firing rates {want['spike_rates']}"  # neurons fire
    assert all(norm > CLIP for norm in want["grad_norms"]), f"the clip is not active: {want['grad_norms']}"
    config = case_config("cifar10dvs_vgg", case, "float64", STEPS, RECIPE, AUGMENT)
    summaries = run_on_ranks(config, case.ranks, inspect=final_state, timeout_s=600)
    for rank, got in enumerate(summaries):
        assert_steps_close(rank, got, want, ("losses", "grad_norms"), STEPS)  # the norm before clipping
        assert got["test_accuracy"] == want["test_accuracy"], f"rank {rank}: test accuracy differs from none's"
        assert_same_state(rank, got["inspect"], want["inspect"])


class Killed(BaseException):
    pass


def test_resumed_in_warmup_continues_the_curve(tmp_path):
    """Killed after step 3 of a 4-step warm-up (checkpoint at step 2): the resumed run's losses and
    learning rates (warm-up, then the cosine) equal the uninterrupted run's."""
    config = tiny_config(train={"steps": 6, "optimizer": "adamw", "lr_schedule": "cosine", "warmup_steps": 4},
                         checkpoint={"every": 2})
    whole = run_training(config, tmp_path / "whole")

    class KillAt4:
        @hookimpl
        def snnfw_step_start(self, step, rank):
            if step == 4:
                raise Killed

    with pytest.raises(Killed):
        run_training(config, tmp_path / "cut", plugins=Plugins(extra=(("kill_at_4", KillAt4()),)))
    resumed = run_training(config, tmp_path / "cut", resume=True)
    assert resumed["resumed_from"] == 2 and resumed["losses"] == whole["losses"]  # the whole run's, as one
    lrs = [[json.loads(line)["lr"] for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
           for run in ("whole", "cut")]
    assert lrs[0] == lrs[1] and lrs[0] == pytest.approx([0.002, 0.004, 0.006, 0.008, 0.01, 0.005], rel=1e-12)


def test_zero_killed_in_warmup_resumes_under_none(tmp_path, faults):
    """ZeRO's sharded state of two param groups, saved in warm-up, continues as one process on the same curve."""
    keys = {"steps": 5, "optimizer": "adamw", "weight_decay": 0.05, "no_decay": ["norm", "bias"],
            "lr_schedule": "cosine", "warmup_steps": 3}
    whole = run_training(tiny_config(microbatches=2, train=keys))
    with pytest.raises(RankFailure, match="rank 1"):
        run_on_ranks(tiny_config("zero", train=keys, checkpoint={"every": 2}), 2, tmp_path,
                     env={1: {"SNNFW_TEST_CRASH_AT_STEP": "4"}})
    resumed = run_training(tiny_config(microbatches=2, train=keys, checkpoint={"every": 2}), tmp_path, resume=True)
    assert resumed["resumed_from"] == 2
    assert resumed["losses"] == pytest.approx(whole["losses"], abs=1e-5)


def test_the_gradient_norm_and_clip_are_torchs_on_one_process():
    from snnfw.distributed.grad_norm import clip_gradients, global_grad_norm
    from snnfw.distributed.layout import Layout

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    model(torch.randn(4, 6)).square().sum().backward()
    twin = copy.deepcopy(model)
    for p, q in zip(model.parameters(), twin.parameters()):
        q.grad = p.grad.clone()
    norm = float(global_grad_norm(model, Layout((("dp", 1),))))
    assert norm == pytest.approx(torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.5).item(), rel=1e-6) and norm > 0.5
    clip_gradients(model, torch.tensor(norm, dtype=torch.float64), 0.5)
    assert all(torch.allclose(p.grad, q.grad) for p, q in zip(model.parameters(), twin.parameters()))
