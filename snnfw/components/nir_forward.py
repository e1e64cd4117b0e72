"""What a network's forward computes, layer by layer, as ``snnfw export --format nir`` checks it.

:func:`run` runs the model once and records every layer's output, and refuses what the NIR graph, the chain of
the layers in registration order, would drop: an operation computed outside the layers (a residual add, a
multiplication, an activation; only moving values between dimensions is let through) and layers that do not run
once each in registration order. :func:`firing_frames` finds inputs on which every neuron layer fires, so that a
comparison of spikes cannot pass on silence.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from snnfw.errors import CheckpointError

# what a forward may do between layers: move values between dimensions, read shapes, copy
LAYOUT = frozenset({"transpose", "permute", "contiguous", "flatten", "view", "reshape", "unsqueeze", "squeeze", "clone",
                    "detach", "to", "float", "double", "size", "dim", "numel", "__get__", "__len__"})
SCALES = tuple(4 ** k for k in range(9))  # random frames this many times larger, 1 to 65536, until every layer fires
AS_STATE_DICT = "export it as a state dict (without --format nir)"


class _Outside(TorchFunctionMode):
    """Records the torch operations run outside ``leaves`` (module names), with the innermost module running each."""

    def __init__(self, running: list[str], leaves: set[str]):
        super().__init__()
        self.running, self.leaves, self.found = running, leaves, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name not in LAYOUT and not self.leaves.intersection(self.running):
            self.found.append((self.running[-1] if self.running else "", name.strip("_")))
        return func(*args, **(kwargs or {}))


def _called(name: str, model: nn.Module) -> str:
    return f"layer {name} ({type(model.get_submodule(name)).__name__})" if name else "the model's forward"


def run(model: nn.Module, frames: torch.Tensor, chain: list[str], leaves: set[str]
        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``model``'s output on ``frames`` and the output of every layer of ``chain`` (names) by name; refuses, naming
    it, an operation outside ``leaves`` (the layers NIR maps and those it leaves out) that is not a move of values
    between dimensions, and layers that do not run once each in the order of ``chain``."""
    from spikingjelly.activation_based import functional

    running, calls, outputs, handles = [], [], {}, []
    wanted = set(chain)

    def enter(name):
        def hook(module, args):
            running.append(name)
            calls.extend([name] if name in wanted else [])
        return hook

    def leave(name):
        def hook(module, args, out):
            running.pop()
            if name in wanted:
                outputs[name] = out
        return hook

    for name, module in model.named_modules():
        handles += [module.register_forward_pre_hook(enter(name)), module.register_forward_hook(leave(name))]
    outside = _Outside(running, leaves)
    functional.reset_net(model)
    try:
        with torch.no_grad(), outside:
            out = model(frames)
    finally:
        for handle in handles:
            handle.remove()
        functional.reset_net(model)
    if outside.found:
        where, op = outside.found[0]
        what = "adds a residual" if op in ("add", "iadd", "radd") else "computes"
        raise CheckpointError(f"{_called(where, model)} {what} in its forward ({op}), beside the layers NIR maps: NIR "
                              f"cannot express it as snnfw runs it and the graph would drop it; {AS_STATE_DICT}")
    _check_order(calls, chain, model)
    return out, outputs


def _check_order(calls: list[str], chain: list[str], model: nn.Module) -> None:
    """Refuses layers that the forward does not run once each in registration order (the graph's order)."""
    counts = Counter(calls)
    for name in chain:
        if counts[name] != 1:
            raise CheckpointError(f"{_called(name, model)} runs {counts[name]} times in the model's forward, and once "
                                  f"in the NIR graph, the chain of the layers; {AS_STATE_DICT}")
    if calls != chain:  # the same layers, once each: another order
        first = next(i for i, (ran, registered) in enumerate(zip(calls, chain)) if ran != registered)
        raise CheckpointError(f"{_called(calls[first], model)} runs before layer {chain[first]} in the model's forward, "
                              f"though registered after it, and the NIR graph runs the layers in registration order; "
                              f"{AS_STATE_DICT}")


def firing_frames(model: nn.Module, test_frames: torch.Tensor, chain: list[str], leaves: set[str],
                  neurons: list[str]) -> tuple[torch.Tensor, int]:
    """``test_frames`` ``[N, T, ...]`` with random frames added (uniform and normal, scaled up 4 times at a time)
    until every layer of ``neurons`` fires on one of them; the frames and the largest scale added (0: none). Refuses
    when none of :data:`SCALES` makes one of them fire: a comparison of spikes on silence proves nothing."""
    generator = torch.Generator().manual_seed(0)
    silent, batches, largest = list(neurons), [test_frames], 0

    def fire(frames: torch.Tensor) -> None:
        outputs = run(model, frames, chain, leaves)[1]
        silent[:] = [name for name in silent if not outputs[name].any()]

    if len(test_frames):
        fire(test_frames)
    for scale in SCALES:
        if not silent:
            break
        shape = (1, *test_frames.shape[1:])
        added = torch.cat([torch.rand(shape, generator=generator, dtype=test_frames.dtype),
                           torch.randn(shape, generator=generator, dtype=test_frames.dtype)]) * scale
        fire(added)
        batches.append(added)
        largest = scale
    if silent:
        raise CheckpointError(
            f"no input makes {_called(silent[0], model)} fire (the first {len(test_frames)} test samples, random "
            f"frames scaled 1 to {SCALES[-1]} times), so the NIR graph's spikes cannot be checked: a check on silence "
            f"passes whatever the graph; give weights that spike (a trained network), or {AS_STATE_DICT}")
    return torch.cat(batches), largest
