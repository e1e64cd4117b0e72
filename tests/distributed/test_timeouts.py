"""parallel.timeout_s times every process group's collectives at start-up, the mesh's too; from the second step
on, parallel.step_timeout_s (if set) replaces it. Ranks that hang fail a test with where they stand, and a rank
lets go of its model before its process group ends (else it can hang there)."""

import pytest
import torch

from snnfw.testing import run_on_ranks, tiny_config


def timeouts(trainer):
    from torch.distributed.distributed_c10d import _rank_not_in_group, _world

    return sorted({group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
                   for group in _world.pg_map if not _rank_not_in_group(group)})


@pytest.mark.parametrize("steps, parallel, expected", [
    (1, {"timeout_s": 99, "step_timeout_s": 7}, [99.0]),  # one step: start-up's timeout (torch gives new groups 30 min)
    (2, {"timeout_s": 99, "step_timeout_s": 7}, [7.0]),
])
def test_every_process_group_takes_the_configured_timeouts(steps, parallel, expected):
    config = tiny_config("fsdp2_tp", train={"steps": steps}, data={"test_samples": 4},
                         parallel={"mesh": {"dp": 2, "tp": 2}, **parallel})
    for summary in run_on_ranks(config, 4, inspect=timeouts):
        assert summary["inspect"] == expected  # the world and each mesh dimension's group


def _rank_1_waits_forever(rank):
    import time

    while rank == 1:
        time.sleep(0.1)


def test_ranks_past_the_helpers_timeout_fail_the_test_with_where_each_stuck_rank_stands():
    with pytest.raises(TimeoutError) as raised:
        run_on_ranks(tiny_config("dp", parallel={"timeout_s": 60}), 2, before=_rank_1_waits_forever, timeout_s=20)
    said = str(raised.value)
    assert said.startswith("ranks did not finish within 20 s; finished: []")
    assert "--- rank 1, still running ---" in said and "in _rank_1_waits_forever" in said
    assert "--- rank 0, still running ---" in said  # waiting for rank 1 at the process group's start


def _model_must_be_gone_when_the_process_group_ends(rank):
    """Fails the rank if a model it trained is alive when its process group is destroyed: DDP's reducer would then
    end the group with the GIL held, which deadlocks while gloo's thread waits for the GIL to free a finished
    collective's tensors (a rank that hangs at random after its last step)."""
    import weakref

    import torch.distributed as dist

    from snnfw.run.trainer import Trainer

    models, build, destroy = [], Trainer.__init__, dist.destroy_process_group

    def tracked(self, *args, **kwargs):
        build(self, *args, **kwargs)
        models.append(weakref.ref(self.model))

    def checked(*args, **kwargs):
        alive = [type(m()).__name__ for m in models if m() is not None]
        assert models and not alive, f"models alive when the process group ends: {alive}"
        destroy(*args, **kwargs)

    Trainer.__init__, dist.destroy_process_group = tracked, checked


@pytest.mark.parametrize("strategy", ["dp", "fsdp2"])
def test_a_rank_lets_go_of_its_model_before_its_process_group_ends(strategy):
    summaries = run_on_ranks(tiny_config(strategy, train={"steps": 2}), 2, before=_model_must_be_gone_when_the_process_group_ends)
    assert [s["steps"] for s in summaries] == [2, 2]
