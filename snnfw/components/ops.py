"""Synaptic operations and energy of the synaptic layers (``Linear``, ``Conv1d/2d/3d``), counted from the data.

Per layer over the scored samples:

- ``input_spikes``: the non-zero elements of its input;
- ``sops``: the accumulates its input spikes drive, a layer whose every input held only 0s and 1s: a spike into a
  ``Linear`` drives ``out_features``, into a conv ``out_channels / groups`` times the kernel positions that meet it
  (stride, padding and dilation applied, nothing counted past the border): the ones-kernel convolution of the
  input's non-zero mask, as SpikingJelly's ``SynOpCounter`` counts it;
- ``macs``: a layer with any other input (direct encoding's frames, pooled spikes) does its dense multiply-accumulates;
- ``ann_macs``: the dense MACs of the same layer in an ANN, one pass a sample (the run's over ``T``).

Energy: ``E_AC x sops + E_MAC x macs`` against ``E_MAC x ann_macs`` (45 nm: 0.9 and 4.6 pJ, Horowitz, ISSCC 2014).

Counts are per module as the rank runs it (its local weight and input), so the sums over ranks are the whole model's:
a tensor-parallel shard counts its slice of channels, a pipeline stage its layers, a time chunk its steps, a replica
its samples; a layer every rank of a group runs whole weighs ``1 / copies``, as :class:`SpikeCounter` does.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.nn import functional as F

from snnfw.distributed.collectives import all_reduce
from snnfw.distributed.grad_norm import SLICES

SYNAPTIC = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
FIELDS = ("input_spikes", "sops", "dense", "non_binary")
_CONVOLUTION = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def sliced_dims(module: nn.Module) -> set[int]:
    """The dims along which a tensor-parallel strategy sliced the module's weight (``snnfw_slices``, DTensor shards)."""
    noted = module.__dict__.get(SLICES, {}).get("weight")
    placements = getattr(module.weight, "placements", ())
    return ({noted.dim} if noted is not None else set()) | {p.dim for p in placements if hasattr(p, "dim")}


def spike_accumulates(module: nn.Module, spikes: torch.Tensor) -> torch.Tensor:
    """The accumulates the non-zero elements of ``spikes`` (the module's input) drive in ``module``."""
    weight = _local(module.weight)
    if isinstance(module, nn.Linear):
        return (spikes != 0).sum() * weight.shape[0]
    dims, groups = weight.dim() - 2, module.groups
    mask = (spikes != 0).to(weight.dtype).reshape(-1, *spikes.shape[-dims - 1 :])
    per_group = mask.unflatten(1, (groups, -1)).sum(2)  # [N, groups, ...]: input spikes of each group per position
    kernel = torch.ones(groups, 1, *weight.shape[2:], dtype=weight.dtype, device=weight.device)
    meets = _CONVOLUTION[dims](per_group, kernel, None, module.stride, module.padding, module.dilation, groups)
    return meets.sum().round().long() * (weight.shape[0] // groups)


def dense_macs(module: nn.Module, inputs: torch.Tensor, output: torch.Tensor) -> int:
    """The multiply-accumulates of the layer's dense forward pass on ``inputs`` (bias left out)."""
    weight = _local(module.weight)
    if isinstance(module, nn.Linear):
        return inputs.numel() * weight.shape[0]
    return output.numel() * weight[0].numel()


class OpCounter:
    """Counts what :mod:`snnfw.components.ops` defines for every synaptic layer, through forward hooks.

    Counting is off until :meth:`counting`; the counts of the forward passes since the last :meth:`take` are read
    as tensors, kept by :meth:`keep`, and summed over ranks once by :meth:`totals`.
    """

    def __init__(self, model: nn.Module, time_steps: int, energy_ac_pj: float, energy_mac_pj: float):
        self.layers = {name: m for name, m in model.named_modules() if isinstance(m, SYNAPTIC)}
        self.time_steps, self.energy_ac_pj, self.energy_mac_pj = time_steps, energy_ac_pj, energy_mac_pj
        self.on, self._weights = False, dict.fromkeys(self.layers, (1.0, 1.0))
        self._pending: dict[str, list] = {}
        self._kept = {name: [0.0] * len(FIELDS) for name in self.layers}
        self._handles = [m.register_forward_hook(partial(self._count, name)) for name, m in self.layers.items()]

    def weigh_replicated(self, copies: int) -> None:
        """Counts what ``copies`` ranks each hold whole ``1 / copies``: the input spikes of a layer whose weight the
        strategy did not slice by input (dim 1), the operations of one it did not slice at all."""
        for name, module in self.layers.items():
            dims = sliced_dims(module)
            self._weights[name] = (1.0 if 1 in dims else 1.0 / copies, 1.0 if dims else 1.0 / copies)

    def _scales(self, name: str) -> tuple[float, ...]:
        """The weights of a layer's ``FIELDS`` in the sums over ranks."""
        inputs, ops = self._weights[name]
        return inputs, ops, ops, 1.0

    def _count(self, name: str, module, inputs, output) -> None:
        if not self.on:
            return
        x, out = _local(inputs[0]).detach(), _local(output).detach()
        counts = [(x != 0).sum(), spike_accumulates(module, x), dense_macs(module, x, out), ((x != 0) & (x != 1)).any()]
        pending = self._pending.get(name)
        self._pending[name] = counts if pending is None else [a + b for a, b in zip(pending, counts)]

    def counting(self, on: bool) -> None:
        self.on = on
        self._pending.clear()
        self._kept = {name: [0.0] * len(FIELDS) for name in self.layers}

    def take(self, keep: bool) -> None:
        """Ends a forward pass's counts: added to the totals when ``keep`` (a pass that scored samples)."""
        pending, self._pending = self._pending, {}
        if keep and pending:
            names = list(pending)
            values = _read([torch.as_tensor(v, dtype=torch.float64) for name in names for v in pending[name]])
            for i, name in enumerate(names):
                row = values[i * len(FIELDS) : (i + 1) * len(FIELDS)]
                self._kept[name] = [a + float(b) for a, b in zip(self._kept[name], row)]

    def totals(self, samples: float) -> dict:
        """Every layer's counts over all ranks and the per-sample totals and energies (a collective)."""
        names = list(self.layers)
        flat = [value * scale for n in names for value, scale in zip(self._kept[n], self._scales(n))]
        summed = all_reduce(flat)
        layers = {}
        for i, name in enumerate(names):
            spikes, sops, dense, non_binary = summed[i * len(FIELDS) : (i + 1) * len(FIELDS)]
            spiking = non_binary == 0
            layers[name] = {"input_spikes": round(spikes), "sops": round(sops) if spiking else 0,
                            "macs": 0 if spiking else round(dense), "ann_macs": dense / self.time_steps,
                            "spiking": spiking}
        return {**self.per_sample(layers, samples), "layers": layers}

    def per_sample(self, layers: dict, samples: float) -> dict:
        """``eval_sops``, ``eval_macs``, ``eval_ann_macs`` a sample, the energies in µJ and the ANN's over the SNN's."""
        samples = max(samples, 1.0)
        sops, macs, ann = (sum(layer[key] for layer in layers.values()) / samples for key in ("sops", "macs", "ann_macs"))
        energy = (self.energy_ac_pj * sops + self.energy_mac_pj * macs) * 1e-6
        ann_energy = self.energy_mac_pj * ann * 1e-6
        return {"eval_sops": sops, "eval_macs": macs, "eval_ann_macs": ann, "eval_energy_uj": energy,
                "eval_ann_energy_uj": ann_energy, "eval_energy_ratio": ann_energy / energy if energy else None}


def table(result: dict) -> str:
    """The per-layer table ``snnfw eval`` prints: input spikes, SOPs, MACs and ANN MACs a sample."""
    samples = max(result.get("ops_samples", 1), 1)
    rows = [("layer", "input spikes", "SOPs", "MACs", "ANN MACs")]
    for name, layer in result["layer_ops"].items():
        rows.append((name, *(f"{layer[key] / samples:,.0f}" for key in ("input_spikes", "sops", "macs", "ann_macs"))))
    rows.append(("total", "", f"{result['eval_sops']:,.0f}", f"{result['eval_macs']:,.0f}", f"{result['eval_ann_macs']:,.0f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    return "\n".join([f"synaptic operations a sample (of {samples:,.0f}):", *lines,
                      f"energy {result['eval_energy_uj']:.3f} µJ a sample against the ANN's {result['eval_ann_energy_uj']:.3f} "
                      f"({result['eval_energy_ratio'] or 0:.2f}x less), at E_AC {result['energy_ac_pj']} pJ, "
                      f"E_MAC {result['energy_mac_pj']} pJ"])


def _read(values: list[torch.Tensor]) -> list[float]:
    """The numbers of 0-dim tensors, in order: one stack and one ``tolist()`` per device."""
    out: list = [None] * len(values)
    groups: dict[torch.device, list[int]] = {}
    for i, value in enumerate(values):
        groups.setdefault(value.device, []).append(i)
    for indices in groups.values():
        for i, number in zip(indices, torch.stack([values[i] for i in indices]).tolist()):
            out[i] = number
    return out
