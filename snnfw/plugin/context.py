"""What a hook receives as ``hooks``: a narrow, typed view of the loaded plugins (:class:`HookContext`), and the
protocols for what a plugin may mark on a module or offer on a data set.

A hook calls other hooks and reads the registries through ``hooks``; everything else about the plugin manager
is internal. The protocols name the duck types the core looks for, so a plugin's type checker can hold it to them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from snnfw.components.step import RunState
    from snnfw.plugin.registry import Registry
    from snnfw.plugin.strategy import Strategy


class HookContext(Protocol):
    """What a hook may call: the run's state, the registries, the strategy objects and the hooks a strategy
    chains (the core calls the rest)."""

    @property
    def run(self) -> RunState | None:
        """The trainer's state (phases, loss scale, what plugins keep for the run); None outside a trainer."""

    @property
    def strategies(self) -> Registry: ...

    @property
    def families(self) -> Registry: ...

    @property
    def datasets(self) -> Registry: ...

    @property
    def schedules(self) -> Registry: ...

    @property
    def optimizers(self) -> Registry: ...

    @property
    def lr_schedules(self) -> Registry: ...

    @property
    def losses(self) -> Registry: ...

    def strategy(self, name: str) -> Strategy:
        """The object behind strategy ``name``."""

    def kept(self, name: str) -> Any | None:
        """What plugin ``name`` keeps for this run (``run.kept[name]``); None outside a trainer or before it keeps
        anything."""

    def initial(self, name: str) -> torch.Tensor | None:
        """The initial value of the model's tensor ``name`` (its state-dict name; on the CPU, as strategy ``none``
        starts from it; a tensor of its own, which the caller may change) where this run's ranks build the model on the meta device and replay its recorded build
        (a strategy that runs the model to apply it reads its values here: :meth:`Strategy.reads_values`); None
        otherwise."""

    def compile(self, model: torch.nn.Module, plan: Any) -> None: ...

    def reset_state(self, model: torch.nn.Module) -> None: ...

    def shard_neuron(self, module: torch.nn.Module, placement: Any, mesh: Any) -> torch.nn.Module | None: ...

    def split_stages(self, model: torch.nn.Module, plan: Any, example: Any) -> list | None: ...

    def transform_stages(self, model: torch.nn.Module, stages: list, local: tuple[int, ...], plan: Any) -> None: ...

    def schedule(self, stages: list, plan: Any, loss_fn: Any) -> Any: ...

    def time_view(self, plan: Any, mesh: Any) -> tuple[int, int] | None: ...

    def sequence_view(self, plan: Any, mesh: Any) -> tuple[int, int] | None: ...


CONTEXT_NAMES = tuple(name for name in vars(HookContext) if not name.startswith("_"))


class Context:
    """The :class:`HookContext` over a loaded :class:`~snnfw.plugin.manager.Plugins`: only its names pass."""

    __slots__ = ("_plugins",)

    def __init__(self, plugins):
        object.__setattr__(self, "_plugins", plugins)

    def __getattr__(self, name: str):
        if name in CONTEXT_NAMES:
            return getattr(self._plugins, name)
        raise AttributeError(f"a hook's context has no {name!r}; it offers {', '.join(CONTEXT_NAMES)} "
                             "(snnfw.api.HookContext)")

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError("a hook's context is read-only; keep what a plugin needs for the run in hooks.run.kept")


@runtime_checkable
class ShardedNeuron(Protocol):
    """A neuron module whose state a tensor-parallel strategy shards: ``snnfw_shard`` holds the ranks it is
    split over (its firing rate counts once in the totals)."""

    snnfw_shard: Any


@runtime_checkable
class SlicedParameters(Protocol):
    """A module whose parameters a tensor-parallel style sliced: ``snnfw_slices`` maps a parameter's name to its
    slice (the gradient norm and the synaptic operations count each piece once; they read it from the module's
    ``__dict__``, which is faster than an ``isinstance`` check on every module of every step)."""

    snnfw_slices: dict


@runtime_checkable
class TimeSliced(Protocol):
    """A data set that reads only time steps ``[start, stop)`` of a sample (time parallelism's ranks). The core
    checks for the method with ``hasattr``, so a wrapper that forwards it through ``__getattr__`` qualifies."""

    def time_slice(self, index: int, start: int, stop: int) -> tuple[torch.Tensor, int]: ...


@runtime_checkable
class EventAugmented(Protocol):
    """A data set of raw recordings that applies event transforms (``data.augment``) before integrating frames;
    checked with ``hasattr``, as :class:`TimeSliced`."""

    def with_events(self, index: int, names: tuple[str, ...], options: dict, seed: int) -> tuple[torch.Tensor, int]: ...
