"""A model of the user's own, run once before launch on a probe batch: its input layout and its output.

The probe batch has N = 2 samples (3 where T = 2), so that a model reading the
batch as time steps returns a shape that gives it away. It runs in eval mode
without gradients, on the device and dtype of the model's parameters (the meta
device for the dry run), and the neurons are reset after it, so nothing of the
model's state changes; a real forward pass rather than fake tensors, whose
first use in a process costs over a second.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from snnfw.errors import ConfigError, said, user_line

if TYPE_CHECKING:
    from torch import nn

    from snnfw.data.batches import InputSpec

FRAMES = {"TN": "[T, N, C, H, W]", "NT": "[N, T, C, H, W]"}


def _samples(spec: InputSpec) -> int:
    """The probe batch's N: 2, or 3 where T = 2."""
    return 3 if spec.time_steps == 2 else 2


@attrs.frozen
class Outcome:
    """What the model did with the probe batch in one layout: the shape it returned, or what it raised."""

    shape: tuple[int, ...] | None = None
    returned: str = ""  # a type that is not a tensor
    raised: str = ""

    def text(self) -> str:
        if self.raised:
            return f"raised {self.raised}"
        return f"returned {list(self.shape)}" if self.shape is not None else f"returned a {self.returned}"


def _run(model: nn.Module, spec: InputSpec, layout: str) -> Outcome:
    """The model on a probe batch in ``layout``."""
    import torch

    samples = _samples(spec)
    first = next(iter(model.parameters()), None)
    device, dtype = (first.device, first.dtype) if first is not None else (torch.device("cpu"), torch.float32)
    dims = (spec.time_steps, samples) if layout == "TN" else (samples, spec.time_steps)
    frames = torch.zeros(*dims, *spec.shape, device=device, dtype=dtype)
    try:
        out = model(frames)
    except Exception as err:  # whatever the user's network raises is the finding
        if frames.is_meta:  # a meta tensor has no values: the dry run builds the model for real and probes again
            raise
        where = user_line(err)
        return Outcome(raised=f"{type(err).__name__}: {said(err)}" + (f" ({where})" if where else ""))
    if not isinstance(out, torch.Tensor):
        return Outcome(returned=type(out).__name__)
    return Outcome(shape=tuple(out.shape))


def probe(model: nn.Module, spec: InputSpec, configured: str, want: tuple[int, ...]) -> dict[str, Outcome]:
    """The model's outcome in the configured layout and, unless it returned ``want``, in the other; its state
    left as it was."""
    import torch
    from spikingjelly.activation_based import functional

    modes = {module: module.training for module in model.modules()}
    model.eval()
    try:
        with torch.no_grad():
            outcomes = {}
            for layout in (configured, "TN" if configured == "NT" else "NT"):
                outcomes[layout] = _run(model, spec, layout)
                functional.reset_net(model)
                if outcomes[layout].shape == want:
                    break
    finally:
        for module, training in modes.items():
            module.training = training
    return outcomes


def check_model(model: nn.Module, name: str, spec: InputSpec, configured: str, explicit: bool) -> tuple[str, tuple[str, ...]]:
    """The input layout ``model`` takes and the plan's lines about it; refuses a model that fits neither layout,
    returns no ``[T, N, classes]`` with ``spec.num_classes``, or whose ``model.input_layout`` was set wrong."""
    samples = _samples(spec)
    want = (spec.time_steps, samples, spec.num_classes)
    outcomes = probe(model, spec, configured, want)
    fits = [layout for layout, outcome in outcomes.items() if outcome.shape == want]
    if configured in fits:
        return configured, ()
    if fits:
        (layout,) = fits
        wrong = f"on {FRAMES[configured]} frames it {outcomes[configured].text()}"
        if explicit:
            raise ConfigError(f"model.input_layout = \"{configured}\" does not fit {name}: {wrong}, on "
                              f"{FRAMES[layout]} it returns [T, N, classes]; set model.input_layout = \"{layout}\"")
        return layout, (f"model.input_layout = \"{layout}\" (inferred: {name} returns [T, N, classes] on "
                        f"{FRAMES[layout]} frames; {wrong}; set the key to choose)",)
    texts = {layout: outcome.text() for layout, outcome in outcomes.items()}
    told = (f"in either layout it {texts[configured]}" if len(set(texts.values())) == 1 else
            "; ".join(f"on {FRAMES[layout]} it {text}" for layout, text in texts.items()))
    shapes = [o.shape for o in outcomes.values() if o.shape and len(o.shape) == 3 and o.shape[:2] in
              ((spec.time_steps, samples), (samples, spec.time_steps))]
    if shapes:
        classes = shapes[0][2]
        raise ConfigError(f"{name} returns {classes} classes a time step, and model.num_classes = {spec.num_classes}; "
                          f"set model.num_classes = {classes}, or give the network {spec.num_classes} outputs")
    probe_frames = f"a probe batch of T = {spec.time_steps}, N = {samples}, [C, H, W] = {list(spec.shape)}"
    single = [module for module in model.modules() if getattr(module, "step_mode", "m") == "s"]
    step_mode = (f"; {len(single)} of its SpikingJelly modules are in single-step mode: call "
                 "functional.set_step_mode(net, \"m\") on the network") if single else ""
    if all(o.raised for o in outcomes.values()):
        raise ConfigError(f"{name} cannot take {probe_frames} (model.input_shape): {told}; make model.input_shape "
                          f"one time step's frame as the network takes it, or correct the network{step_mode}")
    raise ConfigError(f"{name} must return logits [T, N, classes] = {list(want)}, every time step's (multi-step "
                      f"mode, not averaged over time), on {probe_frames}: {told}; return them from its forward"
                      f"{step_mode}")
