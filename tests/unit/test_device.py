"""parallel.device: auto takes CUDA only with a GPU for each rank on the node; cuda with too few GPUs is refused."""

import pytest
import torch

from snnfw.cli import main
from snnfw.errors import PlanError
from snnfw.plan.prepare import prepare
from snnfw.plugin.manager import Plugins
from snnfw.testing import run_on_ranks, tiny_config


@pytest.fixture(scope="module")
def plugins():
    return Plugins()


@pytest.fixture
def gpus(monkeypatch):
    """Pretends this host has ``n`` GPUs."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)

    def pretend(n):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    return pretend


FALLBACK = 'device cpu: 2 rank(s) on this node and 1 GPU(s); parallel.device = "auto" takes CUDA only with a GPU per rank'


@pytest.mark.parametrize(
    "n, device, local_ranks, expected, rationale",
    [
        (1, "auto", None, "cpu", FALLBACK),  # a one-GPU workstation, two ranks
        (2, "auto", None, "cuda", None),
        (0, "auto", None, "cpu", None),  # no CUDA: nothing to explain
        (1, "cpu", None, "cpu", None),
        (1, "cuda", 1, "cuda", None),  # two nodes of one rank each
    ],
)
def test_the_device_follows_the_gpus_per_rank_on_this_node(plugins, gpus, n, device, local_ranks, expected, rationale):
    gpus(n)
    plan = prepare(tiny_config("dp", parallel={"device": device}), 2, plugins, local_ranks=local_ranks).plan
    assert (plan.device_type, plan.backend) == (expected, "nccl" if expected == "cuda" else "gloo")
    assert (plan.rationale[0] == rationale) if rationale else not plan.rationale[0].startswith("device cpu")


def test_a_launched_rank_counts_the_ranks_of_its_node(plugins, gpus, monkeypatch):
    gpus(1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert prepare(tiny_config("dp", parallel={"device": "auto"}), 2, plugins).plan.device_type == "cuda"


@pytest.mark.parametrize("n", [0, 1])
def test_cuda_with_fewer_gpus_than_ranks_is_refused_with_both_counts(plugins, gpus, n):
    gpus(n)
    with pytest.raises(PlanError) as err:
        prepare(tiny_config("dp", parallel={"device": "cuda"}), 2, plugins)
    assert str(err.value).startswith(
        f'parallel.device = "cuda" needs a GPU per rank: 2 rank(s) on this node asked for one and {n} GPU(s) were found; '
    )


def test_plan_says_why_it_chose_the_cpu(gpus, capsys):
    gpus(1)
    assert main(["plan", "examples/quickstart.toml", "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "on 2 rank(s), cpu/gloo" in out and f"  - {FALLBACK}\n" in out


def test_run_on_ranks_runs_an_auto_device_config_on_the_cpu():
    config = tiny_config("none", parallel={"device": "auto"}, train={"steps": 1})
    [summary] = run_on_ranks(config, 1, timeout_s=120)
    assert summary["config"]["parallel"]["device"] == "cpu" and summary["plan"]["device_type"] == "cpu"


@pytest.mark.parametrize("strategy, world", [("dp", 2), ("tp", 2), ("fsdp2", 4)])
def test_gloo_lets_ranks_share_one_gpu(plugins, gpus, strategy, world):
    gpus(1)
    plan = prepare(tiny_config(strategy, parallel={"device": "cuda", "backend": "gloo"}), world, plugins).plan
    assert (plan.device_type, plan.backend) == ("cuda", "gloo")


@pytest.mark.parametrize("strategy, sections", [("pp", {}), ("tsp", {}), ("fsdp2_tsp", {"parallel": {"mesh": {"time": 2, "dp": 2}}})])
def test_strategies_that_send_point_to_point_refuse_cuda_under_gloo(plugins, gpus, strategy, sections):
    gpus(1)
    parallel = {"device": "cuda", "backend": "gloo", **sections.get("parallel", {})}
    with pytest.raises(PlanError, match="point to point from host memory only, not CUDA tensors"):
        prepare(tiny_config(strategy, parallel=parallel), 4 if strategy == "fsdp2_tsp" else 2, plugins)


def test_nccl_on_the_cpu_and_a_backend_without_collectives_are_refused(plugins, gpus):
    gpus(0)
    with pytest.raises(PlanError, match='parallel.backend = "nccl" runs on CUDA and this run is on the CPU'):
        prepare(tiny_config("dp", parallel={"device": "cpu", "backend": "nccl"}), 2, plugins)
    with pytest.raises(PlanError, match="parallel.backend = 'gloo' chooses the collectives of 2 or more ranks"):
        prepare(tiny_config("none", parallel={"backend": "gloo"}), 1, plugins)
