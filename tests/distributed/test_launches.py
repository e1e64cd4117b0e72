"""benchmark/launches.py counts what a step dispatches and where it waits for the device; a step that does not log
waits for nothing."""

import json

import torch
from spikingjelly.activation_based.neuron import BaseNode

import snnfw
from snnfw.testing import run_on_ranks, tiny_config
from snnfw.tools import launches
from snnfw.tools.launches import counted, loading_left_out

SMALL = ["data.train_samples=64", "data.test_samples=16", "data.batch_size=8"]


def test_reads_to_the_host_are_counted_inside_and_outside_the_dispatcher():
    with counted() as counts:
        torch.ones(3).sum().item()
        torch.ones(3).tolist()
        torch.ones(3).nonzero()
    assert dict(counts.syncs) == {"_local_scalar_dense": 1, "tolist": 1, "nonzero": 1}
    assert counts.ops["ones"] == 3 and counts.ops["sum"] == 1


def test_the_script_prints_both_counts_and_a_step_that_does_not_log_syncs_nothing(capsys):
    assert launches.main(["examples/quickstart.toml", "--set", "parallel.strategy=none", *(f"--set={o}" for o in SMALL)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["ops_ratio"]["logging"] == result["snnfw_ops"]["logging"] / result["plain_ops"]["logging"]
    assert result["plain_ops"]["logging"] > 500 and result["plain_syncs"]["logging"] >= 1  # the plain loop's loss.item()
    assert result["snnfw_syncs"] == {"not_logging": 0, "logging": 1}


def _read_spikes(module, args, out):
    out.sum().item()


def test_a_planted_item_per_neuron_layer_adds_a_sync_and_two_ops_per_layer(tmp_path):
    config = tiny_config("none", train={"steps": 6, "log_every": 2})
    with loading_left_out(), snnfw.start(config, run_dir=tmp_path) as run:
        run.step(0)
        run.step(1)
        with counted() as clean:
            record = run.step(2)
        assert not record.complete and "loss" in record  # read when asked for, or at the next step that logs
        assert record["loss"] > 0 and record.complete
        neurons = [m for m in run.model.modules() if isinstance(m, BaseNode)]
        for neuron in neurons:
            neuron.register_forward_hook(_read_spikes)
        run.step(3)
        with counted() as planted:
            run.step(4)
    assert len(neurons) >= 3 and clean.total_syncs == 0
    assert planted.total_syncs == len(neurons) and planted.syncs["_local_scalar_dense"] == len(neurons)
    assert planted.total_ops == clean.total_ops + 2 * len(neurons)  # the sum and the read
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5] and all(r["grad_norm"] > 0 for r in records)


SYNCS: dict[int, int] = {}


def _count_each_step(rank):
    from snnfw.run.session import Session

    step = Session.step

    def counted_step(self, index):
        with loading_left_out(), counted(self.device) as counts:
            record = step(self, index)
        SYNCS[index + 1] = counts.total_syncs
        return record

    Session.step = counted_step


def _syncs(trainer):
    return dict(SYNCS)


def test_under_dp_a_step_that_does_not_log_syncs_nothing_and_one_that_logs_once():
    summaries = run_on_ranks(tiny_config("dp", train={"steps": 4, "log_every": 2}), 2, before=_count_each_step,
                             inspect=_syncs)
    for summary in summaries:
        assert {step: summary["inspect"][step] for step in (2, 3, 4)} == {2: 1, 3: 0, 4: 1}
