"""``snnfw plan --dry-run``: what each rank of an N-rank job holds, without the memory or the arithmetic.

One rank at a time joins a fake process group of N ranks (torch's ``fake``
backend: collectives return at once and move nothing), builds the model on the
meta device and makes it fake (shapes, dtypes and storages, no memory, no
arithmetic), applies the strategy as training does (DDP, ZeRO, FSDP2 and HSDP
sharding, tensor-parallel styles and neuron shards, the pipeline split and
schedule) and trains one step on a batch of the model's input shape. Every
tensor of that rank has the size the real job's rank holds: the bytes of its
parameters, gradients (before the optimizer step), optimizer state and neuron
state, and the peak bytes of tensors saved for backward during the step (T,
batch, microbatches, memopt and precision included), and the bytes its
collectives carry, for rank 0 and the last rank, where uneven shards end
(under pp: the first and last stages). Beside them, what a checkpoint and an
export need on that rank: a save writes the state the rank holds (with
``checkpoint.async_save`` a copy of it stays on the host until written), and
an export gathers the whole model on rank 0, one piece at a time elsewhere.
Where the step asks a tensor for a value (a loss to
log, a norm to clip by), a fake tensor answers 1 (True): the step takes the
path of a finite step. A pipeline without ``pipeline.layout`` is balanced by
the units' FLOPs (a real run times them). Under memopt the count holds what
torch's checkpoint keeps: the blocks' inputs and, in backward, what it
recomputes.
``--device-memory`` marks what fits a device and gives the largest microbatch
that would, taking activations and neuron state as linear in it.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Iterator

import attrs
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import (
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorConverter,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from snnfw.config import Config
from snnfw.errors import PlanError
from snnfw.plugin.manager import Plugins
from snnfw.run.trainer import Trainer

UNITS = {"KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


@attrs.frozen
class Footprint:
    """Bytes one rank holds in a training step."""

    parameters: int
    gradients: int
    optimizer: int
    neurons: int  # neuron state (membrane potentials) after the step's last microbatch
    activations: int  # peak of the tensors saved for backward, alive together
    communication: int = 0  # bytes the step's collectives carry (not held: outside the total)
    traffic: tuple[tuple[str, int, int], ...] = ()  # (collective kind, bytes, calls) of the step
    save: int = 0  # bytes of the state this rank writes to a checkpoint (staged on the host with async_save)
    export: int = 0  # peak bytes an export gathers on this rank: the whole model on rank 0, one piece elsewhere

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.neurons + self.activations


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def tensor_bytes(tensors) -> int:
    """Bytes of the storages behind ``tensors`` (DTensors by their local shard), each storage once."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = _local(tensor).untyped_storage()
        seen[storage._cdata] = storage.nbytes()
    return sum(seen.values())


def _neuron_state(model: torch.nn.Module) -> Iterator[torch.Tensor]:
    for module in model.modules():
        for value in getattr(module, "_memories", {}).values():  # SpikingJelly's MemoryModule state
            if isinstance(value, torch.Tensor):
                yield value


class SavedTensors:
    """Tracks the bytes of tensors autograd saves for backward (each storage once) and their peak, with what
    torch's checkpoint (memopt) keeps: a block's inputs (saved through these hooks) and, in the backward pass, the
    tensors it recomputes, which it saves under hooks of its own until their gradient step uses them."""

    def __init__(self):
        self.live: dict[int, list[int]] = {}  # storage -> [saves alive, bytes]
        self.current = self.peak = 0

    def _pack(self, tensor: torch.Tensor):
        holder = _Saved(tensor)
        self._hold(tensor, holder)
        return holder

    def _hold(self, tensor: torch.Tensor, holder) -> None:
        """Counts ``tensor``'s storage as held until ``holder`` is gone."""
        storage = _local(tensor).untyped_storage()
        key = storage._cdata
        entry = self.live.setdefault(key, [0, storage.nbytes()])
        if entry[0] == 0:
            self.current += entry[1]
            self.peak = max(self.peak, self.current)
        entry[0] += 1
        weakref.finalize(holder, self._release, key)

    def _release(self, key: int) -> None:
        entry = self.live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self.live[key]

    @contextlib.contextmanager
    def tracking(self):
        from unittest import mock

        import torch.utils.checkpoint as checkpointing

        counter = self

        class Recomputation(checkpointing._recomputation_hook):
            def __init__(self, *args):
                super().__init__(*args)
                keep = self.pack_hook  # returns the recomputed tensor that checkpoint keeps for its gradient step
                self.pack_hook = lambda tensor: counter._kept(keep(tensor))

        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda holder: holder.tensor), \
                mock.patch.object(checkpointing, "_recomputation_hook", Recomputation):
            yield self

    def _kept(self, tensor: torch.Tensor) -> torch.Tensor:
        self._hold(tensor, tensor)
        return tensor


class _Saved:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


GATHERS = {"_allgather_base_", "allgather_", "allgather_coalesced_", "allgather_into_tensor_coalesced_"}
SCATTERS = {"_reduce_scatter_base_", "reduce_scatter_", "reduce_scatter_tensor_coalesced_", "alltoall_base_", "alltoall_"}


class Collectives(TorchDispatchMode):
    """Sums the bytes every collective of this rank carries: a gather's whole output, a reduce-scatter's or
    all-to-all's whole input, the tensor of an all-reduce, broadcast, send or receive."""

    def __init__(self):
        super().__init__()
        self.bytes = 0
        self.kinds: dict[str, list[int]] = {}  # kind -> [bytes, calls]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace, name = func.namespace, func._opname
        if namespace == "c10d" and "barrier" not in name:
            self.count(name, _nbytes(args[1] if name in SCATTERS else args[0]))
        elif namespace == "_c10d_functional" and not name.startswith("wait"):
            self.count(name, _nbytes(args[0]) * (args[1] if name.startswith("all_gather") else 1))
        return func(*args, **(kwargs or {}))

    def count(self, op: str, nbytes: int) -> None:
        self.bytes += nbytes
        kind = collective_kind(op)
        carried = self.kinds.setdefault(kind, [0, 0])
        carried[0] += nbytes
        carried[1] += 1


def collective_kind(op: str) -> str:
    """The cost model's kind (:data:`snnfw.plan.cost_model.KINDS`) of a c10d operation's name."""
    plain = op.replace("_", "")
    for kind in ("reducescatter", "allgather", "alltoall", "broadcast", "send", "recv"):
        if kind in plain:
            return {"reducescatter": "reduce_scatter", "allgather": "all_gather", "alltoall": "all_to_all",
                    "send": "send_recv", "recv": "send_recv"}.get(kind, kind)
    return "all_reduce"


def _nbytes(tree) -> int:
    from torch.utils._pytree import tree_leaves

    return sum(t.numel() * t.element_size() for t in tree_leaves(tree) if isinstance(t, torch.Tensor))


def measure_step(trainer, step: int) -> Footprint:
    """Trains ``step`` (a collective) and returns what this rank held; the same measurement for real and dry runs."""
    gradients = []

    def before_step(optimizer, args, kwargs):
        gradients.append(tensor_bytes(p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None))

    handle = trainer.optimizer.register_step_pre_hook(before_step)
    saved, collectives = SavedTensors(), Collectives()
    try:
        with saved.tracking(), collectives:
            trainer.step(step)
    finally:
        handle.remove()
    state = trainer.plugins.strategy(trainer.plan.strategy).optimizer_state(trainer.optimizer)
    return Footprint(
        parameters=tensor_bytes(trainer.model.parameters()),
        gradients=gradients[0] if gradients else 0,
        optimizer=tensor_bytes(state),
        neurons=tensor_bytes(_neuron_state(trainer.model)),
        activations=saved.peak,
        communication=collectives.bytes,
        traffic=tuple((kind, nbytes, calls) for kind, (nbytes, calls) in sorted(collectives.kinds.items())),
    )


class _Unmemoized(FakeTensorConverter):
    """Keeps no weak reference to the fake tensors it makes: torch moves a module of fake parameters (``.to``) by
    swapping each, which it refuses for a tensor that has one."""

    def set_tensor_memo(self, tensor, fake) -> None:
        pass


class FakeValues(FakeTensorMode):
    """Fake tensors for the model and everything the step computes from it, answering 1 (True) where Python asks
    one for a value; an operation on real tensors only (a device mesh's coordinates) runs for real."""

    def __init__(self):
        super().__init__(allow_non_fake_inputs=True)
        converter = self.fake_tensor_converter
        self.fake_tensor_converter = _Unmemoized(copy_data=converter.meta_converter.copy_data, export=converter.export)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:  # .item(), float(), bool()
            return {torch.bool: True}.get(args[0].dtype, 1.0 if args[0].is_floating_point() else 1)
        if func in (torch.ops.aten.equal.default, torch.ops.aten.allclose.default):
            return True
        tensors = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
        if tensors and not any(isinstance(tensor, FakeTensor) for tensor in tensors):
            with unset_fake_temporarily():
                return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


def _prepare_on_meta(config: Config, world_size: int, plugins: Plugins, data: tuple):
    """analyze -> plan with the model built on the meta device (no memory; initialisations that sample skip),
    or for real where its builder needs values (a meta tensor has none)."""
    from snnfw.plan.prepare import prepare

    try:
        with torch.device("meta"):
            return prepare(config, world_size, plugins, datasets=data)
    except (RuntimeError, NotImplementedError):  # an error of the model itself recurs when built for real
        return prepare(config, world_size, plugins, datasets=data)


def make_fake(model: torch.nn.Module, mode: FakeTensorMode, device: torch.device) -> None:
    """Replaces ``model``'s parameters and buffers (meta or real) by fake tensors of ``mode`` on ``device``, shared
    ones staying shared; the fake tensors are made, not converted: families initialise weights by sampling until
    values fit, which fake values cannot answer."""
    fakes: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for tensors in (module._parameters, module._buffers):
            for name, tensor in tensors.items():
                if tensor is not None and id(tensor) not in fakes:
                    with mode:
                        fake = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device)
                    fakes[id(tensor)] = torch.nn.Parameter(fake, tensor.requires_grad) if tensors is module._parameters else fake
                if tensor is not None:
                    tensors[name] = fakes[id(tensor)]


class _ZeroBatches(Trainer):
    """A trainer whose every microbatch is zero frames of the model's input shape, made where it is used."""

    def example(self) -> torch.Tensor:
        spec = self.spec
        return torch.zeros((self.plan.microbatch_size, spec.time_steps, *spec.shape), dtype=self.dtype or torch.float32)

    def batches(self, step: int) -> list:
        frames = self.example()
        labels = torch.zeros(len(frames), *self.spec.label_shape, dtype=torch.long)
        if self.positions:  # a sequence split's slice of the token ids and next tokens
            frames, labels = frames[..., slice(*self.positions)], labels[..., slice(*self.positions)]
        return [(frames, labels)] * self.plan.microbatches


class Zeros(torch.utils.data.Dataset):
    """``length`` samples of zero frames ``[T, C, H, W]`` with label 0 (a language model's: zero token ids)."""

    def __init__(self, length: int, spec):
        self.length, self.shape = length, (spec.time_steps, *spec.shape)
        self.tokens = (torch.zeros(self.shape, dtype=torch.long), torch.zeros(spec.label_shape, dtype=torch.long)) \
            if spec.vocab is not None else None  # made here, outside the fake mode: real labels to check

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        return self.tokens if self.tokens is not None else (torch.zeros(self.shape), 0)


def _no_communication(counted: list, bucket):  # unannotated: DDP checks a return annotation by value
    """A DDP communication hook that counts the bucket's bytes and leaves it as it is, as the fake backend would."""
    counted.append(bucket.buffer().numel() * bucket.buffer().element_size())
    done = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


def dry_run(config: Config, world_size: int, plugins: Plugins) -> tuple[object, list[tuple[int, Footprint]]]:
    """The plan of ``config`` on ``world_size`` ranks and the footprint of each representative rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from snnfw.data.batches import REGISTERED_ONLY
    from snnfw.model import source as models
    from snnfw.plan.prepare import check_data

    check_data(config, plugins, own_data=False)  # the data set as configured, which the dry run replaces by zeros
    samples = max(config.data.batch_size, config.data.train_samples or 0)
    config = attrs.evolve(config, parallel=attrs.evolve(config.parallel, device="cpu"),
                          data=attrs.evolve(config.data, builder=None),
                          explicit=config.explicit - {f"data.{key}" for key in (*REGISTERED_ONLY, "builder")})
    spec = models.source(config, plugins, None).spec
    data = (Zeros(samples, spec), Zeros(config.data.batch_size, spec))
    plan, footprints = _prepare_on_meta(config, world_size, plugins, data).plan, []
    for rank in sorted({0, world_size - 1}):  # the last rank is where uneven shards end
        if world_size > 1:
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        try:
            names, sizes = zip(*plan.mesh)
            mesh = init_device_mesh("cpu", sizes, mesh_dim_names=names) if world_size > 1 else None
            prepared = _prepare_on_meta(config, world_size, plugins, data)
            whole_model = _state_bytes(prepared.model, prepared.plan.config.train.torch_dtype)
            fake = FakeValues()
            make_fake(prepared.model, fake, torch.device("cpu"))
            with fake, _unchecked_ddp_shapes():
                trainer = _ZeroBatches(prepared.plan.config, prepared, plugins, mesh, torch.device("cpu"), data)
                trainer.running_stats.moves_nothing = True
                for name in (plan.strategy, *plan.strategies):  # a composed mesh's dimensions ready themselves too
                    config = plugins.strategy(name).for_fake_world(trainer.model, config)
                buckets: list[int] = []
                for module in trainer.model.modules():
                    if isinstance(module, DistributedDataParallel):  # DDP's reducer needs its all-reduce's result
                        module.register_comm_hook(buckets, _no_communication)
                footprint = measure_step(trainer, 0)  # DDP's all-reduces do not run: its hook counts what they carry
            held = [_local(t) for t in (*trainer.model.parameters(), *trainer.model.buffers())]
            footprints.append((rank, attrs.evolve(
                footprint, communication=footprint.communication + sum(buckets),
                traffic=_with_buckets(footprint.traffic, buckets), save=tensor_bytes(held) + footprint.optimizer,
                export=whole_model if rank == 0 else max((tensor_bytes([t]) for t in held), default=0),
            )))
        except DynamicOutputShapeException as err:
            raise PlanError(f"the dry run runs the model on tensors without values, and model {plan.analysis.family!r} "
                            f"makes a tensor whose shape depends on values ({err.func}: a dropless mixture of experts' "
                            "routing, say); plan it without --dry-run") from None
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    return plan, footprints


def _with_buckets(traffic: tuple, buckets: list[int]) -> tuple:
    """``traffic`` with DDP's bucket all-reduces, which its counting hook saw instead of the dispatch."""
    if not buckets:
        return traffic
    kinds = {kind: (nbytes, calls) for kind, nbytes, calls in traffic}
    nbytes, calls = kinds.get("all_reduce", (0, 0))
    kinds["all_reduce"] = (nbytes + sum(buckets), calls + len(buckets))
    return tuple((kind, *kinds[kind]) for kind in sorted(kinds))


def _state_bytes(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Bytes of ``model``'s whole state with its floating-point tensors in ``dtype``."""
    size = torch.empty(0, dtype=dtype).element_size()
    return sum(t.numel() * (size if t.is_floating_point() else t.element_size()) for t in model.state_dict().values())


def _unchecked_ddp_shapes():
    """DDP without its check that all ranks' parameters have equal shapes, which reads their data (fake tensors have
    none; a fake group has no other ranks to compare with)."""
    from unittest import mock

    return mock.patch("torch.nn.parallel.distributed._verify_param_shape_across_processes", lambda *args: None)


def parse_bytes(text: str) -> int:
    """``"80GB"`` -> 80e9 bytes (KB, MB, GB, TB powers of 1000; KiB, MiB, GiB, TiB powers of 1024)."""
    from snnfw.errors import ConfigError

    number = text.rstrip("BbIiKkMmGgTt ")
    unit = text[len(number):].strip().upper()
    try:
        return int(float(number) * UNITS[unit])
    except (ValueError, KeyError):
        raise ConfigError(f"--device-memory takes a size such as 80GB or 24GiB, got {text!r}") from None


def largest_microbatch(footprint: Footprint, microbatch: int, memory: int) -> int:
    """The largest microbatch that fits ``memory``, taking activations and neuron state as linear in it."""
    fixed = footprint.parameters + footprint.gradients + footprint.optimizer
    per_sample = (footprint.activations + footprint.neurons) / microbatch
    return max(int((memory - fixed) // per_sample), 0) if per_sample else 0


def size_text(n: float) -> str:
    """Bytes in GB, MB or KB (powers of 1000), or B."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def report(plan, footprints: list[tuple[int, Footprint]], memory: int | None) -> list[str]:
    """The dry run's table, one line per representative rank."""
    names, sizes = zip(*plan.mesh)
    grid = torch.arange(plan.world_size).reshape(sizes)
    mesh = " x ".join(f"{d}={n}" for d, n in plan.mesh)
    how = f"joined a fake process group of {plan.world_size} and " if plan.world_size > 1 else ""
    lines = [f"dry run of {plan.name} on {plan.world_size} rank(s), mesh {mesh}, microbatch {plan.microbatch_size} "
             f"x {plan.microbatches}: each rank below {how}trained one step here"]
    columns = ["rank", "coordinates", "parameters", "gradients", "optimizer", "neurons", "activations", "total",
               "communication", "save", "export"]
    if memory is not None:
        columns += [f"fits {size_text(memory)}", "largest microbatch"]
    rows = [columns]
    for rank, f in footprints:
        where = " ".join(f"{d}={int(i)}" for d, i in zip(names, (grid == rank).nonzero()[0]))
        row = [str(rank), where,
               *map(size_text, (f.parameters, f.gradients, f.optimizer, f.neurons, f.activations, f.total, f.communication,
                                f.save, f.export))]
        if memory is not None:
            row += ["yes" if f.total <= memory else "no", str(largest_microbatch(f, plan.microbatch_size, memory))]
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    return lines
