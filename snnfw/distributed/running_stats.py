"""BatchNorm running statistics that every strategy updates as one process would.

Left alone, each data-parallel replica updates its BatchNorm running mean and
variance from its own chunk of the batch, and the replicas drift apart (DDP
then copies rank 0's over the others). One process with ``D x M``
microbatches instead applies ``D x M`` running-average updates in the order of
the global batch. :class:`RunningStats` makes every strategy, ``none``
included, do exactly that:

- during a training forward, each BatchNorm's own kernel computes the
  microbatch's batch statistics (into copies of its running statistics,
  with momentum 1 for that one call), which are recorded; the running
  statistics themselves stay untouched;
- at the end of the step (:meth:`RunningStats.apply`), the records of all
  replicas are gathered in one collective, ordered as the global batch, and
  applied as the running-average updates one process would apply.

Forward passes outside a step (a strategy's shape probe, memopt's search,
activation recomputation in backward) leave the running statistics alone.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _in_backward() -> bool:
    """True inside an autograd backward pass (activation checkpointing recomputes forwards there).

    Inside a compiled block it is False without asking autograd, which would break the graph."""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


def _batch_norms(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]


class RunningStats:
    """Records each BatchNorm's per-microbatch statistics and applies them in global-batch order.

    Made on the unparallelized ``model``, it guards every BatchNorm at once;
    :meth:`bind` then names the model this rank trains (a pipeline rank holds
    some of the layers), this rank's replica index and the replicas' process
    group (None with one replica).
    """

    def __init__(self, model: nn.Module):
        self.norms = _batch_norms(model)
        self.replica, self.replicas, self.group = 0, 1, None
        self.recording = False
        self.moves_nothing = False  # under a fake process group (the dry run): records are gathered, not applied
        self._records: dict[nn.Module, list[torch.Tensor]] = {}  # [mean, var] of each call
        self._saved: dict[nn.Module, tuple] = {}
        for norm in self.norms:
            norm.register_forward_pre_hook(self._before)
            norm.register_forward_hook(self._after)

    def bind(self, model: nn.Module, replica: int, replicas: int, group) -> None:
        self.norms = _batch_norms(model)
        self.replica, self.replicas, self.group = replica, replicas, group

    def start(self) -> None:
        """Begins recording a training step's microbatches."""
        self._records = {norm: [] for norm in self.norms}
        self.recording = True

    def _before(self, norm: nn.Module, args) -> None:
        if not norm.training:
            return
        self._saved[norm] = (norm.running_mean, norm.running_var, norm.num_batches_tracked, norm.momentum)
        # This call updates copies (autograd may keep them for backward) with momentum 1: they become
        # the microbatch's batch statistics, and the buffers themselves are put back afterwards.
        norm.running_mean, norm.running_var = norm.running_mean.clone(), norm.running_var.clone()
        norm.num_batches_tracked = norm.num_batches_tracked.clone()
        norm.momentum = 1.0

    def _after(self, norm: nn.Module, args, output) -> None:
        if norm not in self._saved:
            return
        batch_mean, batch_var = _local(norm.running_mean), _local(norm.running_var)
        if self.recording and norm in self._records and not _in_backward():
            self._records[norm].append(torch.cat([batch_mean.detach().reshape(-1), batch_var.detach().reshape(-1)]))
        norm.running_mean, norm.running_var, norm.num_batches_tracked, norm.momentum = self._saved.pop(norm)

    @torch.no_grad()
    def apply(self) -> None:
        """Applies the step's records of every replica to the running statistics, in global-batch order."""
        self.recording = False
        if not self.norms:
            return
        counts = {len(records) for records in self._records.values()}
        if len(counts) != 1:
            raise RuntimeError(f"BatchNorm layers ran a different number of times in one step: {sorted(counts)}")
        flat = torch.cat([record for records in self._records.values() for record in records])
        per_replica = self._gather(flat)
        for norm in self.norms:
            self._update(norm, [record for records in per_replica for record in records[norm]])

    def _gather(self, flat: torch.Tensor) -> list[dict]:
        """Every replica's records by norm, in replica order (one all-gather)."""
        if self.replicas == 1:
            return [self._records]
        tagged = torch.cat([torch.tensor([float(self.replica)], dtype=flat.dtype, device=flat.device), flat])
        gathered = [torch.empty_like(tagged) for _ in range(self.replicas)]
        dist.all_gather(gathered, tagged, group=self.group)
        if self.moves_nothing:  # the dry run's records hold no values: nothing to apply
            return []
        out = [None] * self.replicas
        for tensor in gathered:
            out[int(tensor[0])] = self._unflatten(tensor[1:])
        return out

    def _unflatten(self, flat: torch.Tensor) -> dict:
        records, offset = {}, 0
        for norm, mine in self._records.items():
            records[norm] = []
            for record in mine:
                records[norm].append(flat[offset:offset + record.numel()])
                offset += record.numel()
        return records

    @staticmethod
    def _update(norm: nn.Module, records: list[torch.Tensor]) -> None:
        """The running-average updates of ``nn.BatchNorm`` for each microbatch's statistics in turn."""
        running_mean, running_var = _local(norm.running_mean), _local(norm.running_var)
        for record in records:
            mean, var = record.view(2, *running_mean.shape)
            norm.num_batches_tracked.add_(1)
            factor = 1.0 / float(norm.num_batches_tracked) if norm.momentum is None else norm.momentum
            running_mean.mul_(1 - factor).add_(mean, alpha=factor)
            running_var.mul_(1 - factor).add_(var, alpha=factor)
