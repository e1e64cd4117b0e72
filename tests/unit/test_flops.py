"""A training step's model FLOPs (6 x the synaptic layers' dense MACs a sample) and the MFU: a peak from
log.peak_tflops or a GPU's data sheet, none on a CPU without the setting."""

import json

import pytest
import torch
from torch import nn

import snnfw
from snnfw.components.flops import device_peak_tflops, training_flops_per_sample
from snnfw.testing import tiny_config

T, FRAME = 3, (2, 8, 8)


class Net(nn.Module):
    """[N, T, C, H, W] -> [T, N, 10]: a 3x3 convolution (4 channels) and a linear read-out at every time step."""

    def __init__(self):
        super().__init__()
        self.conv, self.fc, self.drop = nn.Conv2d(2, 4, 3, padding=1), nn.Linear(4 * 8 * 8, 10), nn.Dropout(0.5)
        self.resets = 0

    def forward(self, x):
        n, t = x.shape[:2]
        y = self.conv(x.flatten(0, 1)).flatten(1)
        return self.fc(self.drop(y)).unflatten(0, (n, t)).transpose(0, 1)


def reset(model):
    model.resets += 1


def test_a_sample_costs_six_times_its_dense_macs_and_the_model_is_left_as_it_was():
    net = Net()
    torch.manual_seed(5)
    expected_random = torch.rand(3)
    torch.manual_seed(5)
    flops = training_flops_per_sample(net, T, FRAME, reset)
    conv = 4 * 8 * 8 * (2 * 3 * 3) * T  # output elements x kernel size, every time step
    linear = 4 * 8 * 8 * 10 * T
    assert flops == 6 * (conv + linear)
    assert net.training and net.drop.training and net.resets == 1  # modes and neuron state as they were
    assert torch.equal(torch.rand(3), expected_random), "the count drew random numbers (dropout ran in training mode)"
    on_meta = Net().to("meta")
    assert training_flops_per_sample(on_meta, T, FRAME, reset) == flops  # where a sharding strategy builds the model


class Sampling(nn.Module):
    """A model the meta device cannot run: it reads a value."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 2)

    def forward(self, x):
        return self.fc(x) * float(x.sum())


def test_a_model_the_meta_device_cannot_run_has_no_count():
    assert training_flops_per_sample(Sampling().to("meta"), 1, (2,), lambda model: None) is None


@pytest.mark.parametrize("name, precision, dtype, peak", [
    ("NVIDIA H100 80GB HBM3", "bf16", "float32", 989.5),
    ("NVIDIA H100 80GB HBM3", "fp32", "float32", 494.5),  # TF32 tensor cores
    ("NVIDIA H100 PCIe", "fp16", "float32", 756.0),
    ("NVIDIA A100-SXM4-80GB", "bf16", "float32", 312.0),
    ("NVIDIA L4", "bf16", "float32", 121.0),
    ("NVIDIA L40S", "bf16", "float32", 362.0),
    ("NVIDIA H100 NVL", "bf16", "float32", None),  # not in the table
    ("NVIDIA A100-SXM4-80GB", "fp32", "float64", None),  # float64 runs on no tensor core
])
def test_a_gpus_peak_comes_from_its_data_sheet_for_the_runs_precision(monkeypatch, name, precision, dtype, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    config = tiny_config(train={"precision": precision, "dtype": dtype})
    assert device_peak_tflops(config, torch.device("cuda", 0)) == peak


def test_log_peak_tflops_is_the_peak_on_any_device():
    assert device_peak_tflops(tiny_config(log={"peak_tflops": 2.5}), torch.device("cpu")) == 2.5
    assert device_peak_tflops(tiny_config(), torch.device("cpu")) is None


@pytest.mark.parametrize("peak", [None, 0.5])
def test_records_and_the_summary_hold_the_flops_and_the_mfu_where_a_peak_is_known(tmp_path, peak):
    config = tiny_config(train={"steps": 2}, **({"log": {"peak_tflops": peak}} if peak else {}))
    with snnfw.start(config, run_dir=tmp_path) as run:
        for step in range(2):
            run.step(step)
        macs = 6 * run.evaluate(ops=True)["eval_ann_macs"] * config.model.time_steps  # the validation's count, a sample
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [r["flops"] for r in records] == [macs * config.data.batch_size] * 2 == [summary["flops_per_step"]] * 2
    if peak is None:  # a CPU has no peak to divide by
        assert not any("mfu" in r for r in records) and summary["mfu"] is None and summary["peak_tflops"] is None
    else:
        for r in records:
            assert r["mfu"] == pytest.approx(r["flops"] / (r["step_ms"] / 1e3) / (peak * 1e12))
        assert summary["mfu"] == pytest.approx(summary["flops_per_step"] / (summary["mean_step_ms"] / 1e3) / (peak * 1e12))
