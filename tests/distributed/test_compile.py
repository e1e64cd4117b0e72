"""Compiled blocks and the inductor neuron backend train to the eager torch backend's losses.

Each strategy runs with both (the neurons' graphs then inline into their
blocks'); one run has only the neuron backend. Compiled runs use T = 1 and
the microbatch shape of the 2-rank runs, so that Inductor's on-disk cache
serves the later runs; one test sample keeps the evaluation's own (no-grad)
graphs small. Training steps must neither recompile nor break graphs; the
evaluation compiles its graphs once, which the run's totals include.
"""

import json
from importlib.util import find_spec

import pytest
import torch

from snnfw.errors import PlanError
from snnfw.plan.prepare import prepare
from snnfw.plugin.manager import Plugins
from snnfw.run.loop import run_training
from snnfw.run.trainer import Trainer
from snnfw.testing import run_on_ranks, tiny_config

NEURONS = {"time_steps": 1, "neuron_backend": "inductor"}
FEATURES = {
    "both": {"model": NEURONS, "compile": {"enable": True}},
    "neurons": {"model": NEURONS},
    "eager": {"model": {"time_steps": 1}},
}
STRATEGIES = {"none": 1, "dp": 2, "fsdp2": 2}


def config(strategy, feature):
    micro = 2 if strategy == "none" else 1
    return tiny_config(strategy, micro, train={"steps": 2}, data={"test_samples": 1}, **FEATURES[feature])


@pytest.fixture(autouse=True)
def one_compile_thread(monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")


@pytest.fixture(scope="module")
def eager():
    return run_training(config("none", "eager"))


def train_in_process(config):
    """The step records of one process, without the evaluation."""
    plugins = Plugins()
    trainer = Trainer(config, prepare(config, 1, plugins), plugins, None, torch.device("cpu"))
    return [trainer.step(step).read() for step in range(config.train.steps)]


@pytest.mark.parametrize("strategy, feature", [("none", "neurons"), *((strategy, "both") for strategy in STRATEGIES)])
def test_compiled_training_matches_eager(strategy, feature, eager, tmp_path):
    if strategy == "none":
        records = train_in_process(config(strategy, feature))
        losses = [r["loss"] for r in records]
        first, second = records
        assert first["compiles"] > 0 and first["compile_s"] > 0
        assert (second["compiles"], second["recompiles"], second["graph_breaks"]) == (0, 0, 0)
        summaries = [{"losses": losses}]
    else:
        summaries = run_on_ranks(config(strategy, feature), STRATEGIES[strategy], tmp_path)
        for summary in summaries:
            assert summary["compile_s"] > 0 and summary["compiles"] > 0
        steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        assert steps[0]["compiles"] > 0 and steps[1]["compiles"] == 0
        assert all((step["recompiles"], step["graph_breaks"]) == (0, 0) for step in steps)
    for summary in summaries:
        assert summary["losses"] == pytest.approx(eager["losses"], abs=1e-5)


@pytest.mark.full_matrix
@pytest.mark.parametrize("strategy, ranks, sections", [
    ("tp", 2, {}), ("pp", 2, {"pipeline": {"schedule": "1f1b"}}), ("fsdp2_tp", 4, {}),
])
def test_lif_kernels_train_as_spikingjelly_under_model_parallel_strategies(strategy, ranks, sections, tmp_path):
    """The LIF kernels where the strategy shards the neuron state (tp) or splits the model into stages (pp):
    the losses are those of SpikingJelly's operator, bit for bit."""
    losses = {}
    for backend in ("torch", "inductor"):
        config = tiny_config(strategy, 2 if strategy == "pp" else 1, model={"neuron_backend": backend}, **sections)
        losses[backend] = run_on_ranks(config, ranks, tmp_path / backend)[0]["losses"]
    assert losses["inductor"] == losses["torch"]


@pytest.mark.parametrize(
    "sections, reason",
    [
        ({"model": {"neuron_backend": "triton"}}, "model.neuron_backend = 'triton': it runs SpikingJelly's Triton neuron kernels, which need CUDA"),
        ({"model": {"neuron_backend": "cuda"}}, "native CUDA neuron kernels, which need CUDA"),
        ({"compile": {"enable": True, "backend": "aot_eager", "mode": "max-autotune"}}, "is an Inductor mode"),
        ({"compile": {"backend": "aot_eager"}}, "compile.backend is applied only with compile.enable = true"),
        ({"compile": {"enable": False, "mode": "default", "fullgraph": True}},
         "compile.mode, compile.fullgraph are applied only with compile.enable = true"),
        ({"model": NEURONS, "compile": {"fullgraph": False}}, "compile.fullgraph is applied only with compile.enable"),
    ],
)
def test_unavailable_choices_are_refused_when_planning(sections, reason):
    with pytest.raises(PlanError, match=reason):
        prepare(tiny_config("none", **sections), 1, Plugins())


@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_pinned_cuda_neuron_kernels_are_refused_under_autocast(backend, precision):
    """SpikingJelly's kernels take a float32 voltage, and under autocast it has the input's dtype: refused on CUDA
    when planning, not a RuntimeError at the first forward; fp32 is not refused for that."""
    from snnfw_plugins.neuron_backend import refusal

    assert f'under train.precision = "{precision}"' in refusal(backend, "cuda", precision)
    assert "precision" not in (refusal(backend, "cuda", "fp32") or "")


def test_native_cuda_neurons_are_refused_when_they_cannot_load():
    """What SpikingJelly's loader checks (built, for this torch and CUDA, its operator ABI), asked when planning."""
    from snnfw_plugins.neuron_backend import refusal

    if find_spec("spikingjelly._ops.lif._C") is not None:
        pytest.skip("SpikingJelly's native operators are built here")
    assert "native CUDA operators cannot load: Native operators for spikingjelly._ops.lif were not built" in refusal(
        "cuda", "cuda")


def test_compile_options_refused_without_enable_rule_out_auto_at_once():
    with pytest.raises(PlanError, match="strategy 'auto' cannot run: compile.backend is applied only with compile.enable"):
        prepare(tiny_config("auto", compile={"backend": "inductor"}), 2, Plugins())
