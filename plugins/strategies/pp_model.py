"""What one pipeline rank trains: its stages, the schedule that runs them, and a forward-only evaluation."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from snnfw.api import StepOutput, hits, scored
from snnfw_plugins.strategies.spike_bits import check_binary, pack, packed_numel, unpack

HEADER_LENGTH = 8  # ndim and up to 7 sizes, sent before an activation in evaluation


class ScoredLoss:
    """The training loss of one microbatch (``loss_of``), counting correct predictions on the way."""

    def __init__(self, loss_of):
        self.correct, self.loss_of = 0, loss_of

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        self.correct = self.correct + hits(logits.detach(), labels)  # on the device, read once per step
        return self.loss_of(logits, labels)


class StepTimes:
    """Per-step pipeline figures since the last ``take()``: compute time, schedule wall time, bytes sent."""

    def __init__(self):
        self.busy_s = self.schedule_s = 0.0
        self.sent_bytes = 0

    def add(self, busy_s: float, schedule_s: float, sent_bytes: int) -> None:
        self.busy_s += busy_s
        self.schedule_s += schedule_s
        self.sent_bytes += sent_bytes

    def take(self) -> dict[str, float]:
        out = {
            "pp_busy_ms": self.busy_s * 1e3,
            "pp_schedule_ms": self.schedule_s * 1e3,
            "pp_bubble": 1.0 - self.busy_s / self.schedule_s if self.schedule_s else 0.0,
            "pp_sent_mb": self.sent_bytes / 2**20,
        }
        self.busy_s = self.schedule_s = 0.0
        self.sent_bytes = 0
        return out


class PipelineModel(nn.Module):
    """This rank's pipeline stages (made of the model's own submodules) and their schedule.

    ``parameters()`` are the local stages' parameters. ``owners[s]`` is the pp
    rank holding stage ``s``. With a ``dp_group``, gradients are averaged over
    the replicas of each stage after the schedule step. ``model_names`` maps
    each of its state-dict keys to the model's own name for that tensor (``unsaved_names`` each buffer the state
    dict leaves out); ``step_times`` its figures since the step metrics last took them.
    """

    def __init__(self, stages: dict[int, nn.Module], schedule, loss: ScoredLoss, split, owners: tuple[int, ...],
                 device: torch.device, pp_group, dp_group, stopwatch, torch_stages, config):
        super().__init__()
        self.torch_stages, self.bits = torch_stages, {i: split.sends_spikes(i, config) for i in stages}
        self.stage_indices = tuple(stages)
        self.stages = nn.ModuleList(stages.values())
        self.schedule, self.loss, self.split, self.owners, self.device = schedule, loss, split, owners, device
        self.pp_group, self.dp_group, self.stopwatch = pp_group, dp_group, stopwatch
        self.holds_last = len(owners) - 1 in self.stage_indices
        self.model_names: dict[str, str] = {}
        self.unsaved_names: dict[str, str] = {}
        self.step_times = StepTimes()

    def train_step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> StepOutput:
        """One schedule step over the replica's batch (its microbatches joined); loss and samples on the
        rank holding the last stage."""
        frames, labels = torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])
        losses: list[torch.Tensor] = []
        self.loss.correct = 0
        busy, start = self.stopwatch.total, time.perf_counter()
        self.schedule.step(frames, target=labels, losses=losses)
        self.step_times.add(self.stopwatch.total - busy, time.perf_counter() - start, sum(s.sent_bytes for s in self.torch_stages))
        for stage in self.torch_stages:
            stage.sent_bytes = 0
        self._average_gradients_over_replicas()
        if not self.holds_last:
            return StepOutput(loss=0.0, correct=0, samples=0)
        with torch.no_grad():  # both stay on the device until the step logs
            loss = torch.stack(losses).mean().double()
        return StepOutput(loss=loss, correct=self.loss.correct, samples=len(labels))

    @torch.no_grad()
    def evaluate(self, frames: torch.Tensor, labels: torch.Tensor) -> StepOutput:
        """The whole batch through the stages in order, activations sent between pp ranks."""
        me, x = dist.get_rank(self.pp_group), frames
        for index, stage in zip(self.stage_indices, self.stages):
            receives_bits, sends_bits = self.bits[index]
            if index > 0 and self.owners[index - 1] != me:
                dtype = self.split.boundaries[self.split.unit_range(index).start][1]
                x = self._receive(self.owners[index - 1], dtype, receives_bits)
            x = stage(x)
            if index < len(self.owners) - 1 and self.owners[index + 1] != me:
                dtype = self.split.boundaries[self.split.unit_range(index).stop][1]  # the receiver's (FSDP2 casts)
                self._send(x.to(dtype), self.owners[index + 1], sends_bits)
        if not self.holds_last:
            return StepOutput(loss=0.0, correct=0, samples=0)
        return scored(x, labels, self.loss.loss_of)

    def _send(self, tensor: torch.Tensor, peer: int, bits: bool) -> None:
        """``tensor`` after a header of its shape; as bits (``spike_bits``) where it is spikes."""
        header = torch.zeros(HEADER_LENGTH, dtype=torch.int64)
        header[0] = tensor.dim()
        header[1 : 1 + tensor.dim()] = torch.tensor(tensor.shape)
        dist.send(header.to(tensor.device), group=self.pp_group, group_dst=peer)
        if bits:
            check_binary(tensor, "a pipeline stage's output")
            tensor = pack(tensor)
        dist.send(tensor.contiguous(), group=self.pp_group, group_dst=peer)

    def _receive(self, peer: int, dtype: torch.dtype, bits: bool) -> torch.Tensor:
        header = torch.empty(HEADER_LENGTH, dtype=torch.int64, device=self.device)
        dist.recv(header, group=self.pp_group, group_src=peer)
        shape = header[1 : 1 + int(header[0])].tolist()
        if not bits:
            tensor = torch.empty(shape, dtype=dtype, device=self.device)
            dist.recv(tensor, group=self.pp_group, group_src=peer)
            return tensor
        packed = torch.empty(packed_numel(torch.Size(shape).numel()), dtype=torch.uint8, device=self.device)
        dist.recv(packed, group=self.pp_group, group_src=peer)
        return unpack(packed, shape, dtype)

    def _average_gradients_over_replicas(self) -> None:
        if self.dp_group is None:
            return
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.dp_group)
        flat /= dist.get_world_size(self.dp_group)
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()
