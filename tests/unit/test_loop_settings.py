"""Settings of the GPU loop, planned on this CPU host: CUDA graphs (compile.mode "reduce-overhead"),
cuda.cudnn_benchmark and parallel.step_timeout_s refused where they cannot hold, with the reason."""

import pytest
import torch

from snnfw.errors import PlanError
from snnfw.plan.prepare import prepare
from snnfw.plugin.manager import Plugins
from snnfw.testing import tiny_config

GRAPHS = {"compile": {"enable": True, "mode": "reduce-overhead"}}


@pytest.fixture(scope="module")
def plugins():
    return Plugins()


@pytest.fixture
def one_gpu(monkeypatch):
    """A host with one GPU whose Inductor could generate code (triton is absent here)."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr("snnfw_plugins.compile.inductor_refusal", lambda device_type: None)


def plan(plugins, strategy, world, **sections):
    return prepare(tiny_config(strategy, **sections), world, plugins).plan


def test_cuda_graphs_are_refused_on_the_cpu(plugins):
    with pytest.raises(PlanError, match="'reduce-overhead' replays the compiled blocks as CUDA graphs, which need CUDA"):
        plan(plugins, "none", 1, **GRAPHS)


def test_cuda_graphs_hold_on_a_gpu_with_static_shapes(plugins, one_gpu):
    assert plan(plugins, "none", 1, parallel={"device": "cuda"}, data={"test_samples": 64}, **GRAPHS).device_type == "cuda"


def test_cuda_graphs_are_refused_with_a_last_evaluation_batch_of_another_size(plugins, one_gpu):
    with pytest.raises(PlanError, match=r"last evaluation batch holds 4 of 8 samples \(data.test_samples = 20\); set "):
        plan(plugins, "none", 1, parallel={"device": "cuda"}, data={"batch_size": 8, "test_samples": 20}, **GRAPHS)


@pytest.mark.parametrize("strategy, reason", [("tp", "all-reduces run inside the blocks"),
                                              ("tsp", "send and receive inside the blocks")])
def test_cuda_graphs_are_refused_where_collectives_run_inside_the_blocks(plugins, one_gpu, strategy, reason):
    with pytest.raises(PlanError, match=reason):
        plan(plugins, strategy, 2, parallel={"device": "cuda", "backend": "gloo"}, data={"test_samples": 64}, **GRAPHS)


def test_cudnn_benchmark_is_refused_on_the_cpu_and_planned_on_a_gpu(plugins, one_gpu):
    with pytest.raises(PlanError, match="cuda.cudnn_benchmark is for CUDA runs and this run is on the CPU; remove it"):
        plan(plugins, "none", 1, parallel={"device": "cpu"}, cuda={"cudnn_benchmark": True})
    assert plan(plugins, "none", 1, parallel={"device": "cuda"}, cuda={"cudnn_benchmark": True}).config.cuda.cudnn_benchmark


def test_a_step_timeout_is_refused_without_collectives(plugins):
    with pytest.raises(PlanError, match="parallel.step_timeout_s times collectives, which a run of one rank has none"):
        plan(plugins, "none", 1, parallel={"step_timeout_s": 30})
