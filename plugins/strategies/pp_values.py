"""Values for a pipeline built on the meta device: its units hold storage only while they run.

Where a pipeline's ranks build only their stages, the model reaches ``build_pipeline`` on the meta device, and the
split still runs it: the measuring rank times each unit, every rank runs one microbatch through the stages for
their inputs. :class:`UnitValues` gives a unit its initial values (``hooks.initial``) on the run's device for as
long as it runs, then sets the meta tensors back, so a rank holds one unit's values (and, while timing, its
gradients) at a time; the trainer then materializes only the rank's own stages. A model whose forward reads a
tensor outside its module's own forward (a weight tied across modules, read by its parent) leaves that tensor on
the meta device: :func:`streamed` then runs it again with all its values held at once.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, TypeVar

import torch
from torch import nn

from snnfw.api import PluginError
from snnfw_plugins.strategies.pp_state import tensor_names

T = TypeVar("T")


class UnitValues:
    """Initial values for the meta tensors of ``model``'s modules: ``initial(name)`` of each tensor's state-dict
    name, on ``device``."""

    def __init__(self, model: nn.Module, initial: Callable[[str], torch.Tensor], device: torch.device):
        self.names, self.initial, self.device = tensor_names(model), initial, device

    def of(self, model: nn.Module) -> UnitValues:
        """The same values for ``model``, a copy of this one's model (its modules named alike)."""
        return UnitValues(model, self.initial, self.device)

    @contextlib.contextmanager
    def held(self, *modules: nn.Module, recurse: bool = True) -> Iterator[None]:
        """Within the block, every meta parameter and buffer of ``modules`` (with ``recurse``, of their submodules
        too) is a tensor on the device holding its initial value (tied tensors one tensor); after it, the meta one
        again."""
        real: dict[int, torch.Tensor] = {}
        swapped = []
        for module in modules:
            for owner in module.modules() if recurse else (module,):
                for slots in (owner._parameters, owner._buffers):
                    for attribute, tensor in slots.items():
                        if tensor is None or not tensor.is_meta:
                            continue
                        if id(tensor) not in real:
                            real[id(tensor)] = self._value(owner, attribute, tensor)
                        swapped.append((slots, attribute, tensor))
                        slots[attribute] = real[id(tensor)]
        try:
            yield
        finally:
            for slots, attribute, tensor in reversed(swapped):
                slots[attribute] = tensor

    @contextlib.contextmanager
    def running(self, *modules: nn.Module) -> Iterator[None]:
        """Within the block, every module inside ``modules`` holds the values of its own tensors while its forward
        runs (autograd keeps what a backward needs), however the model calls them; a tensor read outside its
        module's forward stays on the meta device and fails the op that reads it."""
        owners = {id(m): m for module in modules for m in module.modules()
                  if any(t is not None and t.is_meta for t in (*m._parameters.values(), *m._buffers.values()))}
        entered: dict[int, list] = {}

        def before(module, args):
            context = self.held(module, recurse=False)
            context.__enter__()
            entered.setdefault(id(module), []).append(context)

        def after(module, args, output):
            entered[id(module)].pop().__exit__(None, None, None)

        handles = []
        for module in owners.values():
            handles += [module.register_forward_pre_hook(before, prepend=True), module.register_forward_hook(after)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            for contexts in entered.values():  # a forward that raised
                while contexts:
                    contexts.pop().__exit__(None, None, None)

    def _value(self, owner: nn.Module, attribute: str, tensor: torch.Tensor) -> torch.Tensor:
        name = self.names[(id(owner), attribute)]
        if (value := self.initial(name)) is None:
            raise PluginError(f"the pipeline's model is on the meta device and the run gives no initial value of "
                              f"{name!r} (hooks.initial); only a run whose ranks replay a recorded build gives them")
        value = value.to(self.device, tensor.dtype).reshape(tensor.shape)  # a tensor of its own: updated in place
        return nn.Parameter(value, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else value


def streamed(values: UnitValues | None, modules: tuple[nn.Module, ...], run: Callable[[], T]) -> T:
    """``run()`` with each module inside ``modules`` holding its ``values`` while its forward runs; where that
    fails, ``run()`` again with the values of all of them held at once (a forward that reads a tensor outside its
    own module's forward: this rank then holds those modules whole while it runs). Without ``values`` (a model
    with its own values), ``run()``."""
    if values is None:
        return run()
    try:
        with values.running(*modules):
            return run()
    except Exception:
        with values.held(*modules):
            return run()
