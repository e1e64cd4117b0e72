"""Stages of a pipeline: units grouped by a measured (or given) layout, wrapped for torch's schedules."""

from __future__ import annotations

import contextlib
import copy
import statistics
import time
import warnings

import attrs
import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.pipelining import PipelineStage
from torch.utils.flop_counter import FlopCounterMode

from snnfw.api import (ROOT_HOOKS, ConfigError, PluginError, autocast, balanced_layout, finish_queued_work, is_neuron,
                       parse_layout)
from snnfw_plugins.memory_format import is_channels_last, to_channels_last
from snnfw_plugins.strategies.pp_values import UnitValues, streamed
from snnfw_plugins.strategies.spike_bits import NeuronOutputs, check_binary, pack, packed_numel, unpack

TIMED_PASSES = 3
Meta = tuple[tuple[int, ...], torch.dtype]


class Stage(nn.Sequential):
    """Consecutive pipeline units run as one stage, under ``precision()`` (``train.precision``'s autocast).

    Point-to-point sends need contiguous tensors: a channels-last output leaves contiguous, and the stage that
    receives it (``receives_channels_last``, set from what the stage before sent at build time) restores
    channels-last. Gradients cross back in each side's layout, so the pooling, BatchNorm and neurons on both
    sides keep their channels-last kernels. The output is never a view: zero-bubble schedules detach stage
    outputs in place.
    """

    def __init__(self, *units: nn.Module, precision=contextlib.nullcontext):
        super().__init__(*units)
        self.precision = precision
        self.receives_channels_last = self.sent_channels_last = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.receives_channels_last:
            x = _Relayout.apply(x, True)
        with self.precision():
            out = super().forward(x)
        self.sent_channels_last = is_channels_last(out)
        if self.sent_channels_last:
            return _Relayout.apply(out, False)
        out = out.contiguous()
        return out.clone() if out._base is not None else out


class _Relayout(torch.autograd.Function):
    """A copy of ``x`` channels-last or contiguous; its gradient goes back in the other layout, ``x``'s."""

    @staticmethod
    def forward(ctx, x, channels_last: bool):
        ctx.channels_last = channels_last
        return to_channels_last(x) if channels_last else x.contiguous()

    @staticmethod
    def backward(ctx, grad):
        return (grad.contiguous() if ctx.channels_last else to_channels_last(grad)), None


class Stopwatch:
    """Adds the seconds spent inside ``with stopwatch:`` blocks to ``total``, the device's queued work included;
    does nothing unless ``enabled`` (``log.phase_times``), since waiting for the device stalls the schedule."""

    def __init__(self, device: torch.device = torch.device("cpu"), enabled: bool = True):
        self.total, self.device, self.enabled = 0.0, device, enabled

    def __enter__(self):
        if self.enabled:
            finish_queued_work(self.device)
            self._start = time.perf_counter()

    def __exit__(self, *exc):
        if self.enabled:
            finish_queued_work(self.device)
            self.total += time.perf_counter() - self._start


class TimedStage(PipelineStage):
    """A PipelineStage whose forward, backward and weight-backward compute time goes to ``stopwatch``, and
    whose spikes cross ranks as bits: ``bits = (receives, sends)`` says which side of the stage is a neuron's
    output (``Split.spikes``). A packed activation is received into a ``uint8`` buffer and unpacked into
    torch's receive buffer before the forward; gradients go back unpacked. An activation leaves in ``sends``,
    the dtype the split found at the stage's end, which the next stage's receive buffer has (FSDP2's mixed
    precision casts a stage's output to fp32). ``sent_bytes`` counts every send."""

    def __init__(self, *args, stopwatch: Stopwatch, sends: torch.dtype, bits: tuple[bool, bool] = (False, False),
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.stopwatch, self.sends = stopwatch, sends
        self.receives_bits, self.sends_bits = bits
        self.sent_bytes = 0
        self._bits_in: dict[int, torch.Tensor] = {}  # per microbatch, the packed buffer it is received into
        self._unpack_due: set[int] = set()  # microbatches received packed and not yet unpacked
        self._sent: dict[int, torch.Tensor] = {}  # packed or cast outputs held until their sends complete

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_fwd_recv_ops(fwd_chunk_id)
        if self.receives_bits:
            (op,) = ops  # a Stage takes one tensor
            if fwd_chunk_id not in self._bits_in:
                self._bits_in[fwd_chunk_id] = torch.empty(packed_numel(op.tensor.numel()), dtype=torch.uint8,
                                                          device=op.tensor.device)
            op.tensor = self._bits_in[fwd_chunk_id]
            self._unpack_due.add(fwd_chunk_id)
        return ops

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        for op in ops:
            if self.sends_bits:
                check_binary(op.tensor, f"pipeline stage {self.stage_index}'s output")
                op.tensor = self._sent[fwd_chunk_id] = pack(op.tensor)
            elif op.tensor.dtype != self.sends:
                op.tensor = self._sent[fwd_chunk_id] = op.tensor.to(self.sends)
            self.sent_bytes += op.tensor.numel() * op.tensor.element_size()
        return ops

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_bwd_send_ops(bwd_chunk_id)
        self.sent_bytes += sum(op.tensor.numel() * op.tensor.element_size() for op in ops)
        return ops

    def clear_runtime_states(self) -> None:
        super().clear_runtime_states()
        self._sent.clear()

    def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
        if fwd_chunk_id in self._unpack_due:
            self._unpack_due.discard(fwd_chunk_id)
            (info,) = self.args_recv_info[fwd_chunk_id]
            with torch.no_grad():
                info.buffer.copy_(unpack(self._bits_in[fwd_chunk_id], info.buffer.shape, info.buffer.dtype))
        with self.stopwatch:
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, *args, **kwargs):
        with self.stopwatch:
            return super().backward_one_chunk(*args, **kwargs)

    def backward_weight_one_chunk(self, *args, **kwargs):
        with self.stopwatch:
            return super().backward_weight_one_chunk(*args, **kwargs)


@attrs.frozen
class Split:
    """Units per stage, the (shape, dtype) at every unit boundary for one microbatch, and measured unit costs.

    ``boundaries[i]`` is the input of unit ``i`` (``boundaries[-1]`` the model's
    output); ``unit_ms`` is empty when the layout was given; ``spikes[i]`` says that boundary ``i`` is a
    neuron's output, sent as bits between stages (``spike_bits``) unless ``parallel.pack_spikes`` is false.
    """

    layout: tuple[int, ...]
    boundaries: tuple[Meta, ...]
    unit_ms: tuple[float, ...] = ()
    spikes: tuple[bool, ...] = ()

    def sends_spikes(self, stage: int, config) -> tuple[bool, bool]:
        """Whether stage ``stage`` receives, and sends, spikes packed as bits."""
        if not config.parallel.pack_spikes or not self.spikes:
            return False, False
        units = self.unit_range(stage)
        return self.spikes[units.start], self.spikes[units.stop]

    def unit_range(self, stage: int) -> range:
        start = sum(self.layout[:stage])
        return range(start, start + self.layout[stage])


def _meta(tensor: torch.Tensor) -> Meta:
    return tuple(tensor.shape), tensor.dtype


def _forward_backward_seconds(unit: nn.Module, x: torch.Tensor, reset) -> float:
    """One timed forward+backward; the gradients are dropped after it, so that measuring holds one unit's
    gradients at a time (the measuring rank's peak is otherwise a whole model's gradients above training's)."""
    reset(unit)
    finish_queued_work(x.device)
    start = time.perf_counter()
    unit(x).sum().backward()
    finish_queued_work(x.device)
    seconds = time.perf_counter() - start
    unit.zero_grad(set_to_none=True)
    x.grad = None
    return seconds


def measure_units(units: list[nn.Module], example: torch.Tensor, reset, passes: int, values: UnitValues | None = None
                  ) -> tuple[tuple[Meta, ...], tuple[float, ...], tuple[bool, ...]]:
    """Runs ``example`` through ``units`` (each holding its ``values`` meanwhile, where they are on the meta
    device): the boundary metas, each unit's forward+backward milliseconds (median of ``passes`` after one
    warm-up; none when ``passes`` is 0), and which boundaries are a neuron's output (the model's input and
    output are not sent between stages: False)."""
    x, boundaries, unit_ms, spikes = example, [_meta(example)], [], [False]
    for index, unit in enumerate(units):
        x = x.detach().requires_grad_(x.is_floating_point())
        with values.held(unit) if values else contextlib.nullcontext():
            if passes:
                seconds = [_forward_backward_seconds(unit, x, reset) for _ in range(passes + 1)][1:]
                unit_ms.append(1e3 * statistics.median(seconds))
            reset(unit)
            outputs = NeuronOutputs([m for m in unit.modules() if is_neuron(m)])
            with torch.no_grad():
                x = unit(x)
            reset(unit)  # its state on the device goes with its values
        boundaries.append(_meta(x))
        spikes.append(outputs.produced(x) and index < len(units) - 1)
    return tuple(boundaries), tuple(unit_ms), tuple(spikes)


def pipeline_units(model: nn.Module, plan, hooks, example: torch.Tensor) -> list[nn.Module] | None:
    """``model``'s pipeline units (``snnfw_split_stages``), the first run after and the last before the hooks that
    in-place dimensions put on the model's own input and output (``snnfw_root_hooks``: a time split's)."""
    units = hooks.split_stages(model, plan, example)
    for before, after in vars(model).get(ROOT_HOOKS, ()) if units else ():
        first = nn.Sequential(units[0])
        first.register_forward_pre_hook(before)
        last = nn.Sequential(first if len(units) == 1 else units[-1])
        last.register_forward_hook(after)
        units = [*([first] + units[1:])[:-1], last]
    return units


def decide_split(model: nn.Module, plan, hooks, example: torch.Tensor, stages: int, units: list[nn.Module],
                 peers: tuple[int, ...] = (), values: UnitValues | None = None) -> Split:
    """The last rank runs a copy of ``model`` (its buffers, gradients and hooks stay untouched),
    balances the measured unit costs over ``stages`` unless ``pipeline.layout`` is given,
    and broadcasts the split, so every rank uses the same one. Not rank 0: it holds the first stage, which
    keeps the most microbatches' activations in flight in every schedule, so the copy and the timing would
    raise the run's peak there. In a fake process group (the dry run), which
    moves nothing, each rank decides the split itself.

    Where dimensions applied in place (tp, time) exchange inside the layers, the last rank's ``peers`` along them
    measure with it, on ``model``'s own ``units``: a copy would run its layers' exchanges with the model's state.
    A ``model`` on the meta device runs with its ``values``, one unit at a time."""
    payload: list[Split | str | None] = [None]
    alone = dist.get_backend() == "fake"
    measurer = dist.get_world_size() - 1
    if alone or dist.get_rank() in (measurer, *peers):
        with autocast(plan.config.train, plan.device_type):  # boundary dtypes as training computes them
            payload = [_measured_split(model, plan, hooks, example, stages, units if peers else None, values)]
    if not alone:
        dist.broadcast_object_list(payload, src=measurer)
    if isinstance(payload[0], str):
        raise (ConfigError if plan.analysis.own else PluginError)(payload[0])
    return payload[0]


def _measured_split(model: nn.Module, plan, hooks, example: torch.Tensor, stages: int,
                    units: list[nn.Module] | None, values: UnitValues | None) -> Split | str:
    """The split, or why the units do not compute the model: ``units`` of ``model`` itself, or (None) those of a
    copy. Fake tensors (the dry run) cannot be timed: their units are balanced by FLOPs."""
    if units is None:
        model = _replica(model)
        units = pipeline_units(model, plan, hooks, example)
        values = values and values.of(model)
    if error := composition_error(model, units, example, hooks.reset_state, values):
        return error
    given, fake = plan.config.pipeline.layout, is_fake(example)
    boundaries, unit_ms, spikes = measure_units(units, example, hooks.reset_state, 0 if given or fake else TIMED_PASSES,
                                                values)
    if given:
        return Split(parse_layout(given), boundaries, spikes=spikes)
    return Split(balanced_layout(unit_flops(units, example, hooks.reset_state) if fake else unit_ms, stages), boundaries,
                 unit_ms, spikes)


def _replica(model: nn.Module) -> nn.Module:
    """A deep copy of ``model``, its tensors cloned by an operation (a fake tensor's storage cannot be copied)."""
    memo = {}
    for module in model.modules():
        held = (*module._parameters.values(), *module._buffers.values(), *vars(module).values(),
                *getattr(module, "_memories", {}).values())  # SpikingJelly's neuron state
        for tensor in held:
            if isinstance(tensor, torch.Tensor) and id(tensor) not in memo:
                clone = tensor.detach().clone()
                memo[id(tensor)] = nn.Parameter(clone, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else clone
    with warnings.catch_warnings():  # tensors the hooks' objects hold: torch clones fake ones after asking their address
        warnings.filterwarnings("ignore", "Accessing the data pointer of FakeTensor", UserWarning)
        return copy.deepcopy(model, memo)


def unit_flops(units: list[nn.Module], example: torch.Tensor, reset) -> tuple[int, ...]:
    """Each unit's forward FLOPs on ``example``, as torch's FlopCounterMode counts them (products and convolutions)."""
    x, flops = example, []
    with torch.no_grad():
        for unit in units:
            reset(unit)
            with FlopCounterMode(display=False) as counter:
                x = unit(x)
            flops.append(counter.get_total_flops())
    return tuple(flops)


def composition_error(model: nn.Module, units: list[nn.Module], example: torch.Tensor, reset,
                      values: UnitValues | None = None) -> str | None:
    """Why running ``units`` one after another does not compute ``model(example)``, or None; a ``model`` on the
    meta device runs with its ``values``, one unit at a time.

    Both run in training mode (BatchNorm on batch statistics, so neurons fire
    even at initialisation) from the same random state (dropout masks alike).
    """
    def run():
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            reset(model)
            expected = model(example)
            torch.manual_seed(0)
            x = example
            for index, unit in enumerate(units):
                reset(unit)
                try:
                    x = unit(x)
                except Exception as err:  # whatever the unit raises on an input it was not written for
                    if any(t.is_meta for t in unit.parameters()):
                        raise  # streamed values: run again with them held whole, where the error is the unit's own
                    return expected, (err, index, unit)
        return expected, x

    expected, x = streamed(values, (model, *units), run)
    if isinstance(x, tuple):
        err, index, unit = x
        first_line = (str(err).splitlines() or [""])[0]
        return (f"the pipeline units do not run one after another on the model's input: unit {index + 1} of "
                f"{len(units)} ({type(unit).__name__}) raised {type(err).__name__} ({first_line}); "
                "list model.stage_units in the order the model's forward calls them, \"flatten:NAME\" where it "
                "flattens [T, N, ...] before NAME (torch.flatten(x, 2))")
    if x.shape != expected.shape or not torch.allclose(x, expected, rtol=1e-4, atol=1e-5):
        return (
            f"the pipeline units, run one after another, do not compute the model's output (shape {list(x.shape)} "
            f"against {list(expected.shape)}): its forward does more than call them in order; declare the units "
            "that do (model.stage_units, \"flatten:NAME\" for a flatten before NAME, other glue inside them), or write "
            "a family plugin with snnfw_split_stages"
        )
    return None


def pipeline_stage(module: Stage, index: int, split: Split, device, group, stopwatch: Stopwatch,
                   bits: tuple[bool, bool] = (False, False)) -> TimedStage:
    """A torch PipelineStage with static example input and output for one microbatch, spikes sent as ``bits``.

    Examples that require grad make torch receive activations that require
    grad, so every stage gets gradients (torch 2.13 takes it from them).
    """
    units = split.unit_range(index)

    def example(meta: Meta, requires_grad: bool) -> torch.Tensor:
        shape, dtype = meta
        return torch.empty(shape, dtype=dtype, device=device, requires_grad=requires_grad and dtype.is_floating_point)

    return TimedStage(
        module,
        index,
        len(split.layout),
        device,
        input_args=example(split.boundaries[units.start], requires_grad=index > 0),
        output_args=example(split.boundaries[units.stop], requires_grad=True),
        group=group,
        stopwatch=stopwatch,
        sends=split.boundaries[units.stop][1],
        bits=bits,
    )
