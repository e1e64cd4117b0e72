"""A model's build, recorded on the meta device and replayed one tensor at a time: each rank computes any of the
model's initial tensors alone, equal bit for bit to those of a build on the CPU, without holding the others.

:func:`record` builds the model on the meta device (no storage) under a dispatch mode that logs every aten op
that writes a meta tensor. A tensor's value is then the replay of the ops that wrote it (and, in turn, of those
that wrote what they read), on the CPU (:meth:`Recipe.value`).

Random ops: while the build is recorded, each random op also runs on a scratch CPU tensor of its size, which
advances the CPU generator as the CPU build did (a seed the build sets included); the op keeps the state it
started from, and a replay starts it there. The generator is left where the CPU build leaves it.

``record`` refuses a build (returns None) where a replay could differ from it: a random op whose use of the
generator depends on values its arguments hold, or that is given its own generator; one of torch's initialisers
that do nothing on the meta device, called by a name imported before the recording; a build that needs values
(a meta tensor has none). The caller then builds on the CPU.

A CPU tensor the build makes (``torch.tensor(data)``, a loaded checkpoint it copies in) is kept by reference as
the value the replay reads.
"""

from __future__ import annotations

import sys
from typing import Callable

import attrs
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

aten = torch.ops.aten
# random ops whose use of the generator depends only on their output's size, dtype and layout
_SIZE_ONLY_RANDOM = frozenset((
    aten.uniform_.default, aten.normal_.default, aten.bernoulli_.float, aten.random_.default, getattr(aten.random_, "from"),
    aten.random_.to, aten.exponential_.default, aten.cauchy_.default, aten.log_normal_.default, aten.geometric_.default,
    aten.rand.default, aten.randn.default, aten.randint.default, aten.randint.low, aten.randperm.default,
    aten.rand_like.default, aten.randn_like.default, aten.randint_like.default, aten.randint_like.low_dtype,
    aten.normal.float_float,
))
# torch's initialisers that do nothing on the meta device: each recorded as one op (their use of the generator
# depends only on the values they draw, so a run from the same state on a tensor of the same size draws the same)
_INITIALISERS = ("_no_grad_trunc_normal_", "dirac_", "orthogonal_", "sparse_")


class Refused(Exception):
    """The build ran an op a replay cannot reproduce exactly."""


def _key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


@attrs.frozen
class _Slot:
    """A meta tensor as a view of a storage of the build (a tensor object may later be given other storage)."""

    key: int
    size: tuple
    stride: tuple
    offset: int
    dtype: torch.dtype

    @classmethod
    def of(cls, tensor: torch.Tensor) -> _Slot:
        return cls(_key(tensor), tuple(tensor.size()), tuple(tensor.stride()), tensor.storage_offset(), tensor.dtype)


@attrs.frozen
class _Op:
    func: Callable
    args: tuple  # meta tensors as _Slots
    kwargs: dict
    out: object  # its meta result, as _Slots
    reads: frozenset  # the storages its tensor arguments view
    writes: frozenset  # the storages it writes: fresh outputs, and arguments it mutates
    rng: torch.Tensor | None  # a random op's starting state of the CPU generator


class _Log:
    """The ops of a build, in order; every storage it saw is kept alive, so that no two share a key."""

    def __init__(self):
        self.ops: list[_Op] = []
        self._alive: list[torch.UntypedStorage] = []

    def add(self, func: Callable, args: tuple, kwargs: dict, out, reads: frozenset, writes: frozenset,
            random: bool = False) -> None:
        """Logs an op that ran on the meta device; a ``random`` one is also run on scratch CPU tensors."""
        rng = None
        if random:
            rng = torch.get_rng_state()
            func(*tree_map(_scratch, args), **tree_map(_scratch, kwargs))  # advances the generator as the CPU build
        self.ops.append(_Op(func, tree_map(self._slot, args), tree_map(self._slot, kwargs), tree_map(self._slot, out),
                            reads, writes, rng))

    def _slot(self, x):
        if isinstance(x, torch.Tensor) and x.is_meta:
            self._alive.append(x.untyped_storage())
            return _Slot.of(x)
        return x


class _Recorder(TorchDispatchMode):
    """Logs every aten op that writes a meta tensor: one that makes fresh ones, or mutates its arguments."""

    def __init__(self, log: _Log):
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        reads = frozenset(_key(t) for t in _tensors((args, kwargs)) if t.is_meta)
        mutated = {_key(value) for argument, value in zip(func._schema.arguments, _flat_arguments(func, args, kwargs))
                   if argument.alias_info is not None and argument.alias_info.is_write
                   and isinstance(value, torch.Tensor) and value.is_meta}
        fresh = {_key(t) for t in _tensors(out) if t.is_meta and _key(t) not in reads}
        if not (fresh or mutated):  # views and metadata: a replay rebuilds views from storages; CPU ops ran for real
            return out
        random = torch.Tag.nondeterministic_seeded in func.tags
        if random and (func not in _SIZE_ONLY_RANDOM or kwargs.get("generator") is not None):
            raise Refused(f"{func} draws random values a replay of its size alone cannot reproduce")
        self.log.add(func, args, kwargs, out, reads, frozenset(fresh | mutated), random)
        return out


@attrs.frozen
class _Initialiser:
    """One of torch's :data:`_INITIALISERS` as an op of the log: it writes its first argument."""

    function: Callable

    def __call__(self, *args, **kwargs):
        return self.function(*args, **kwargs)


class _Initialisers:
    """Replaces torch's :data:`_INITIALISERS` while a build is recorded: a call on a meta tensor is logged instead.
    A call that reaches an original (by a name imported before) is seen: ``missed``."""

    def __init__(self, log: _Log):
        self.log, self.missed = log, []
        self.originals = {name: getattr(torch.nn.init, name) for name in _INITIALISERS}
        self.codes = {function.__code__ for function in self.originals.values()}

    def __enter__(self):
        for name, original in self.originals.items():
            setattr(torch.nn.init, name, self._logging(original))
        self.outer = sys.getprofile()  # a profiler watching the process, given back after the build
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc):
        sys.setprofile(self.outer)
        for name, original in self.originals.items():
            setattr(torch.nn.init, name, original)

    def _logging(self, original: Callable) -> Callable:
        def initialise(tensor, *args, **kwargs):
            if not tensor.is_meta:
                return original(tensor, *args, **kwargs)
            if kwargs.get("generator") is not None:
                raise Refused(f"{original.__name__} was given its own generator")
            sys.setprofile(None)  # the original runs on a scratch tensor, to advance the generator
            try:
                written = frozenset({_key(tensor)})
                self.log.add(_Initialiser(original), (tensor, *args), kwargs, tensor, written, written, random=True)
            finally:
                sys.setprofile(self._profile)
            return tensor
        return initialise

    def _profile(self, frame, event, arg):
        if event == "call" and frame.f_code in self.codes:
            self.missed.append(frame.f_code.co_name)


class _Constants(TorchFunctionMode):
    """Logs ``torch.tensor(data)`` on the meta device, whose data reach no op the dispatch mode sees: as a copy of
    the same tensor made on the CPU."""

    def __init__(self, log: _Log):
        super().__init__()
        self.log = log

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in (torch.tensor, torch.as_tensor) and isinstance(out, torch.Tensor) and out.is_meta:
            real = func(*args, **{**kwargs, "device": "cpu"})
            self.log.add(aten.clone.default, (real,), {}, out, frozenset(), frozenset({_key(out)}))
        return out


class Recipe:
    """The recorded build of one model: :meth:`value` of any of its parameters and buffers, by name."""

    def __init__(self, ops: list[_Op], slots: dict[str, _Slot]):
        self._ops, self._slots = ops, slots

    @torch.no_grad()
    def value(self, name: str) -> torch.Tensor:
        """The initial value of the model's tensor ``name`` (on the CPU, in the dtype it was built in); the CPU
        generator is left as it was."""
        target = self._slots[name]
        storages: dict[int, torch.UntypedStorage] = {}
        resume = torch.get_rng_state()
        try:
            for op in self._needed(target.key):
                if op.rng is not None:
                    torch.set_rng_state(op.rng)
                out = op.func(*tree_map(lambda x: _real(x, storages), op.args),
                              **tree_map(lambda x: _real(x, storages), op.kwargs))
                for slot, real in zip(_slots(op.out), _tensors(out)):
                    if slot.key in op.writes and slot.key not in storages:
                        storages[slot.key] = real.untyped_storage()
        finally:
            torch.set_rng_state(resume)
        return _view(storages[target.key], target)

    def _needed(self, key: int) -> list[_Op]:
        """The ops whose writes the storage ``key`` depends on, in the order they ran."""
        wanted, needed = {key}, []
        for op in reversed(self._ops):
            if op.writes & wanted:
                needed.append(op)
                wanted |= op.reads
        return needed[::-1]


def record(build: Callable[[], torch.nn.Module]) -> tuple[torch.nn.Module, Recipe] | None:
    """``build()`` on the meta device, recorded, the CPU generator advanced as the build on the CPU advances it;
    None (the generator as it was) where a replay could differ from a build on the CPU."""
    start, log = torch.get_rng_state(), _Log()
    try:
        with torch.device("meta"), _Initialisers(log) as initialisers, _Constants(log), _Recorder(log):
            model = build()
    except Exception:  # Refused, or a build that reads values: built on the CPU instead, which raises its own errors
        model = None
    named = {} if model is None else {**dict(model.named_parameters(remove_duplicate=False)),
                                      **dict(model.named_buffers(remove_duplicate=False))}
    if model is None or initialisers.missed or not all(tensor.is_meta for tensor in named.values()):
        torch.set_rng_state(start)
        return None
    return model, Recipe(log.ops, {name: _Slot.of(tensor) for name, tensor in named.items()})


def _tensors(tree) -> list[torch.Tensor]:
    found = []
    tree_map(lambda x: found.append(x) if isinstance(x, torch.Tensor) else None, tree)
    return found


def _slots(tree) -> list[_Slot]:
    found = []
    tree_map(lambda x: found.append(x) if isinstance(x, _Slot) else None, tree)
    return found


def _flat_arguments(func, args: tuple, kwargs: dict) -> list:
    names = [argument.name for argument in func._schema.arguments]
    return list(args) + [kwargs.get(name) for name in names[len(args):]]


def _view(storage: torch.UntypedStorage, slot: _Slot) -> torch.Tensor:
    return torch.empty(0, dtype=slot.dtype, device="cpu").set_(storage, slot.offset, slot.size, slot.stride)


def _real(x, storages: dict[int, torch.UntypedStorage]):
    """A logged argument for a replay on the CPU: a meta tensor as the same view of its replayed storage."""
    if isinstance(x, _Slot):
        return _view(storages[x.key], x)
    return _cpu(x)


def _scratch(x):
    """An argument of an op that ran on the meta device, for advancing the generator: a meta tensor as an
    uninitialised CPU tensor of its size and layout."""
    if isinstance(x, torch.Tensor) and x.is_meta:
        return torch.empty_strided(tuple(x.size()), tuple(x.stride()), dtype=x.dtype, device="cpu")
    return _cpu(x)


def _cpu(x):
    return torch.device("cpu") if isinstance(x, torch.device) and x.type == "meta" else x
