"""Synaptic operations counted from the spikes: exact on hand-countable inputs, as SpikingJelly's counter counts."""

import pytest
import torch
from torch import nn

from snnfw.components.ops import OpCounter, table


def counted(model: nn.Module, x: torch.Tensor, time_steps: int = 1) -> dict:
    counter = OpCounter(model, time_steps, energy_ac_pj=0.9, energy_mac_pj=4.6)
    counter.counting(True)
    model(x)
    counter.take(keep=True)
    return counter.totals(samples=1)


def test_linear_spikes_drive_out_features_each_and_real_input_counts_dense_macs():
    model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 4))
    with torch.no_grad():
        model[0].weight.zero_(), model[0].bias.copy_(torch.tensor([1.0, 0, 1, 1, 0]))
    got = counted(model, torch.tensor([[0.5, 0.0, 2.0], [0.0, 0.0, 0.0]]))
    first, second = got["layers"]["0"], got["layers"]["1"]
    # real-valued frames into the first layer: 2 rows x 3 inputs x 5 outputs MACs, no SOPs
    assert (first["spiking"], first["sops"], first["macs"], first["input_spikes"]) == (False, 0, 30, 2)
    # the second sees 0/1 only: 3 spikes in each of 2 rows, each driving 4 accumulates
    assert (second["spiking"], second["sops"], second["macs"], second["input_spikes"]) == (True, 24, 0, 6)
    assert got["eval_ann_macs"] == 30 + 40
    assert got["eval_energy_uj"] == pytest.approx((0.9 * 24 + 4.6 * 30) * 1e-6)
    assert got["eval_energy_ratio"] == pytest.approx(4.6 * 70 / (0.9 * 24 + 4.6 * 30))


def test_conv_counts_only_the_kernel_positions_inside_the_border():
    conv = nn.Conv2d(2, 3, 3, padding=1, bias=False)
    x = torch.zeros(1, 2, 4, 4)
    x[0, 0, 0, 0] = 1  # a corner: 2 x 2 of the 3 x 3 outputs around it exist
    x[0, 1, 1, 2] = 1  # inside: all 9
    layer = counted(conv, x)["layers"][""]
    assert layer["sops"] == (4 + 9) * 3 and layer["input_spikes"] == 2
    assert layer["ann_macs"] == 3 * 16 * 2 * 9


def test_grouped_strided_conv_and_time_steps():
    conv = nn.Conv2d(4, 4, 3, stride=2, groups=2, bias=False)
    x = torch.zeros(2, 4, 5, 5)
    x[:, 0, 2, 2] = 1  # the centre: in all 4 strided windows of output 2 x 2, 2 output channels in its group
    layer = counted(conv, x, time_steps=2)["layers"][""]
    assert layer["sops"] == 2 * 4 * 2
    assert layer["ann_macs"] == 2 * 4 * 4 * 2 * 9 / 2  # the run's dense MACs over T = 2 passes


def test_same_sops_as_spikingjelly_synop_counter():
    from spikingjelly.activation_based.op_counter import DispatchCounterMode, SynOpCounter

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 6, 3, padding=1), nn.Flatten(), nn.Linear(6 * 8 * 8, 5))
    spikes = (torch.rand(3, 2, 8, 8) < 0.2).float()
    conv_out = model[0](spikes)
    sj = SynOpCounter()
    with DispatchCounterMode([sj]):
        model[0](spikes)
    ours = counted(model[0], spikes)["layers"][""]["sops"]
    assert ours == sj.get_total() > 0
    assert conv_out.shape == (3, 6, 8, 8)


def test_the_table_names_every_layer_and_the_totals():
    model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 4))
    got = counted(model, torch.tensor([[0.5, 0.0, 2.0]]))
    result = {**{k: v for k, v in got.items() if k != "layers"}, "layer_ops": got["layers"], "ops_samples": 1,
              "energy_ac_pj": 0.9, "energy_mac_pj": 4.6}
    lines = table(result).splitlines()
    assert [line.split()[0] for line in lines[2:4]] == ["0", "1"] and lines[4].startswith("total")
