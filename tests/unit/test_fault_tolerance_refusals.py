"""parallel.fault_tolerance refused in one line, before any process group, where it cannot apply."""

import importlib.util
import re

import pytest
import torch

from snnfw import cli
from snnfw.config import build_config
from snnfw.distributed import fault_tolerance
from snnfw.errors import ConfigError

FT = {"lighthouse": "http://127.0.0.1:29510", "replica_group": 0}


def config(mesh, ft=None, **sections):
    parallel = {"mesh": mesh, "fault_tolerance": FT if ft is None else ft}
    return build_config({"parallel": parallel, **sections})


@pytest.fixture
def torchft_present(monkeypatch):
    """torchft looked up as installed, so that the refusals after that check are reached without it."""
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "torchft" else find(name, *a))


@pytest.mark.usefixtures("torchft_present")
@pytest.mark.parametrize("mesh, ft, sections, message", [
    ({"dp_shard": 2}, None, {}, "parallel.mesh has no dp_replicate; set parallel.mesh = {dp_replicate = R} with R >= 2"),
    ({"dp_replicate": 2, "tp": 2}, None, {}, "also has tp (their peers cannot be lost)"),
    ({"dp_replicate": 2, "pp": 2}, None, {}, "also has pp (their peers cannot be lost)"),
    ({"dp_replicate": 2}, None, {"checkpoint": {"every": 5}}, "set checkpoint.every = 0"),
    ({"dp_replicate": 2}, None, {"checkpoint": {"save_on_signals": ["SIGTERM"]}},
     "a signal cannot save one (a group that stops rejoins from a live peer); remove checkpoint.save_on_signals"),
    ({"dp_replicate": 2}, {"lighthouse": "http://h:1", "replica_group": 2}, {}, "replica group 2 is not one of the mesh's 2"),
    ({"dp_replicate": 2}, {"replica_group": 0}, {}, "needs the lighthouse's address"),
    ({"dp_replicate": 2}, {"lighthouse": "http://h:1"}, {}, "needs this process's replica group"),
])
def test_what_fault_tolerance_cannot_run_with_is_refused(monkeypatch, mesh, ft, sections, message):
    monkeypatch.delenv(fault_tolerance.LIGHTHOUSE_ENV, raising=False)
    monkeypatch.delenv(fault_tolerance.GROUP_ENV, raising=False)
    with pytest.raises(ConfigError, match=re.escape(message)):
        fault_tolerance.groups(config(mesh, ft, **sections))


@pytest.mark.usefixtures("torchft_present")
def test_a_group_of_several_ranks_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="a replica group is one process, and this job has WORLD_SIZE = 2"):
        fault_tolerance.groups(config({"dp_replicate": 2}))


def test_without_torchft_it_is_refused_with_the_install_hint(monkeypatch):
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else find(name, *a))
    with pytest.raises(ConfigError, match=r"needs the torchft package, which is not installed; run pip install 'snnfw\[ft\]'"):
        fault_tolerance.groups(config({"dp_replicate": 2}))


@pytest.mark.usefixtures("torchft_present")
def test_the_groups_are_the_dp_replicate_size():
    assert fault_tolerance.groups(config({"dp_replicate": 3})) == 3


def test_a_model_with_batchnorm_is_refused():
    fault_tolerance.check_model(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    with pytest.raises(ConfigError, match="cannot merge BatchNorm running statistics .* 1 BatchNorm layers \\(1, ...\\)"):
        fault_tolerance.check_model(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2)))


def test_snnfw_train_points_to_launching_each_group_on_its_own(tmp_path, capsys):
    path = tmp_path / "ft.toml"
    path.write_text('[parallel]\nmesh = {dp_replicate = 2}\nfault_tolerance = {replica_group = 0}\n')
    assert cli.main(["train", str(path), "--nproc", "1"]) == 2
    assert "then each group with REPLICA_GROUP_ID=k python -m snnfw.train CONFIG" in capsys.readouterr().err


def test_scoring_weights_leaves_fault_tolerance_out():
    from snnfw.config import for_evaluation

    scored = for_evaluation(config({"dp_replicate": 2}))
    assert scored.parallel.fault_tolerance is None and "parallel.fault_tolerance" not in scored.explicit


@pytest.mark.usefixtures("torchft_present")
def test_starting_a_lighthouse_on_another_host_is_refused():
    ft = {**FT, "lighthouse": "http://elsewhere.example:29510", "start_lighthouse": True}
    with pytest.raises(ConfigError, match="start_lighthouse starts the lighthouse on this host, at the port its address "
                                          "names, and 'http://elsewhere.example:29510' is not such an address"):
        fault_tolerance.groups(config({"dp_replicate": 2}, ft))


def test_a_step_that_never_commits_ends_the_group_in_one_line_not_a_loop():
    """torchft's manager raises once should_commit failed more than max_retries times in a row (snnfw passes
    MAX_RETRIES); the group ends with a CollectiveError that says so, not a traceback or a step trained forever."""
    from snnfw.errors import CollectiveError

    class Manager:  # should_commit as torchft 0.2.0's manager ends it past max_retries
        def should_commit(self):
            raise RuntimeError(f"should_commit failed {fault_tolerance.MAX_RETRIES + 1} times consecutively, "
                               f"exceeding max_retries={fault_tolerance.MAX_RETRIES}")

    group = fault_tolerance.ReplicaGroup(config({"dp_replicate": 2}, {**FT, "replica_group": 1}))
    group.manager = Manager()
    with pytest.raises(CollectiveError, match=r"replica group 1 trained a step 11 times in a row and no quorum"):
        group.commit()


@pytest.mark.parametrize("min_replicas, fix", [(2, "start the other groups, or lower min_replicas"),
                                               (1, "check that the lighthouse still runs there")])
def test_no_quorum_in_time_says_what_to_check(min_replicas, fix):
    """With min_replicas = 1 a group alone makes a quorum: no quorum then means a lighthouse gone or a stopped
    group, not missing peers."""
    from snnfw.errors import CollectiveError

    class Manager:  # start_quorum as torchft's manager ends it past its quorum timeout
        def start_quorum(self):
            raise TimeoutError("quorum timed out")

    group = fault_tolerance.ReplicaGroup(config({"dp_replicate": 2}, {**FT, "min_replicas": min_replicas}))
    group.manager = Manager()
    with pytest.raises(CollectiveError, match=f"found no quorum of .*min_replicas = {min_replicas} .*; {fix}"):
        group.begin(1)
