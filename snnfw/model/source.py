"""Where the model comes from: a registered family, a builder by import path, or a module handed to the API.

A family plugin declares in code what strategies need (FSDP2 blocks, pipeline
stage units, a tensor-parallel plan). A model given by ``model.builder`` or
through :func:`snnfw.run.session.start` declares them in the ``[model]`` section,
or leaves them to be inferred where that is safe:

- ``blocks``: the top-level children that hold parameters;
- ``stage_units``: the children of an ``nn.Sequential`` model, and for SpikingJelly's zoo ResNets, VGGs and
  PLIF-paper networks (``zoo_stage_units``) the layers their forward calls, with its flatten before the classifier;
- ``tp_plan``: every container whose children are Conv, optional BatchNorm,
  neuron and optional pooling (``conv_bn_neuron``), or Linear, neuron, optional
  dropout, Linear and an optional neuron (``linear_mlp``); within an
  ``nn.Sequential``, every run of its children in such an order
  (``"name.start:stop"``, as a slice); and every residual block of SpikingJelly's zoo ResNets
  (``residual_conv_pair``: its conv1 and conv2, where they have no groups).

With ``model.input_layout = "TN"`` the model takes SpikingJelly's
``[T, N, ...]``: snnfw's frames ``[N, T, ...]`` are transposed on the way in.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import attrs

from snnfw.config import Config
from snnfw.data import batches as datalib
from snnfw.errors import ConfigError, keys_phrase
from snnfw.model.analysis import GLUE, AnalysisPart, is_neuron, submodule, unit_glue

if TYPE_CHECKING:
    from torch import nn

OWN_MODEL_KEYS = ("input_shape", "input_layout", "blocks", "stage_units", "tp_plan")
DECLARABLE = ("blocks", "stage_units", "tp_plan")


@contextlib.contextmanager
def _importing(key: str, where: str):
    """Turns a syntax error or an exception raised while importing the user's module into one line."""
    try:
        yield
    except SyntaxError as err:
        raise ConfigError(f"{key}: {err.filename}, line {err.lineno}: {err.msg}; correct the file") from err
    except ModuleNotFoundError as err:
        if where.endswith(".py"):
            raise ConfigError(f"{key}: {where} imports {err.name!r}, which is not installed; install it") from err
        raise
    except Exception as err:
        raise ConfigError(f"{key}: importing {where} raised {type(err).__name__}: {err}; correct the module "
                          "(snnfw --debug shows the traceback)") from err


def import_object(path: str, key: str) -> Any:
    """The object that ``"module:name"`` or ``"path/to/file.py:name"`` names; ``key`` is the config key, for messages."""
    where, sep, name = path.rpartition(":")
    if not sep or not where or not name:
        raise ConfigError(f"{key} must be \"module:name\" or \"path/to/file.py:name\", got {path!r}")
    if where.endswith(".py"):
        file = Path(where)
        if not file.is_file():
            raise ConfigError(f"{key}: no file {file} (a relative path starts at the config file's folder, else at the "
                              f"working directory {Path.cwd()})")
        if str(file.resolve().parent) not in sys.path:  # the modules beside it import, as beside a script
            sys.path.insert(0, str(file.resolve().parent))
        spec = importlib.util.spec_from_file_location(f"snnfw_user_{file.stem}", file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # pickling and dataclasses look classes up by module
        with _importing(key, where):
            spec.loader.exec_module(module)
    else:
        if "" not in sys.path and str(Path.cwd()) not in sys.path:
            sys.path.insert(0, str(Path.cwd()))
        try:
            with _importing(key, where):
                module = importlib.import_module(where)
        except ModuleNotFoundError as err:
            raise ConfigError(f"{key}: cannot import {where!r} ({err}); run from the folder that holds it, or name a .py file") from None
    try:
        return getattr(module, name)
    except AttributeError:
        raise ConfigError(f"{key}: {where} has no {name!r}") from None


@attrs.frozen
class Source:
    """A model to build: its name in plans and messages, builder, input spec, and what the config declares."""

    name: str
    build: Callable[[], nn.Module]
    spec: datalib.InputSpec
    own: bool  # declared in the config rather than by a family plugin


def _refuse_set(config: Config, keys: tuple[str, ...], why: str) -> None:
    if found := [f"model.{key}" for key in keys if f"model.{key}" in config.explicit]:
        subject, pronoun = keys_phrase(found)
        raise ConfigError(f"{subject} {why}; remove {pronoun}")


def source(config: Config, plugins, given: Any = None) -> Source:
    """The model ``config`` describes, or ``given`` (a module, or a callable that builds one)."""
    model = config.model
    if given is None and model.builder is None:
        _refuse_set(config, OWN_MODEL_KEYS, f"for a model given by model.builder, and model family {model.family!r} declares its own")
        flavor = plugins.families.get(model.family).flavor(model.flavor)
        build, classes = flavor.build, flavor.num_classes
        if model.sequence_length is not None:
            if flavor.with_sequence_length is None:
                raise ConfigError(f"model.sequence_length applies to language models, and model family {model.family!r} "
                                  f"flavor {model.flavor!r} takes frames {list(flavor.input_shape)}; remove model.sequence_length")
            build = flavor.with_sequence_length(model.sequence_length)
        if model.num_classes is not None and model.num_classes != classes:
            if flavor.with_classes is None:
                raise ConfigError(
                    f"model family {model.family!r} flavor {model.flavor!r} has {classes} classes and cannot change them; "
                    "remove model.num_classes"
                )
            build, classes = flavor.with_classes(model.num_classes), model.num_classes
        spec = datalib.InputSpec(model.time_steps, flavor.shape_for(model.sequence_length), classes, flavor.vocab)
        return Source(model.family, build, spec, own=False)
    if given is not None and model.builder is not None:
        raise ConfigError("a model was handed to snnfw.start and model.builder names another; remove model.builder")
    _refuse_set(config, ("family", "flavor"), "for naming a registered family, and the model is given by model.builder or the Python API")
    _refuse_set(config, ("sequence_length",), "applies to a registered language model family (spiking_lm), and the model "
                                             "is given by model.builder or the Python API: its input_shape says its length")
    if model.input_shape is None or model.num_classes is None:
        raise ConfigError(
            "a model of your own needs model.input_shape = [C, H, W] (one time step's frame) and model.num_classes; set both"
        )
    spec = datalib.InputSpec(model.time_steps, model.input_shape, model.num_classes)
    if given is None:
        build = import_object(model.builder, "model.builder")
        if not callable(build):
            raise ConfigError(f"model.builder {model.builder!r} is no callable; name a function or class that returns the network")
        return Source(model.builder, build, spec, own=True)
    from torch import nn

    if isinstance(given, nn.Module):
        return Source(f"{type(given).__module__}:{type(given).__qualname__}", lambda: given, spec, own=True)
    return Source(f"{getattr(given, '__module__', '?')}:{getattr(given, '__qualname__', type(given).__name__)}", given, spec, own=True)


def time_major_input(model: nn.Module) -> None:
    """Makes ``model`` take snnfw's ``[N, T, ...]`` frames although it computes on ``[T, N, ...]``."""
    model.register_forward_pre_hook(lambda module, args: (args[0].transpose(0, 1).contiguous(), *args[1:]))


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _kinds(module: nn.Module) -> str:
    """The children of ``module`` as a string of letters: c conv, b batch norm, n neuron, l linear, d dropout, p pool,
    ? other."""
    from torch import nn

    letters = []
    for child in module.children():
        if isinstance(child, (nn.Conv1d, nn.Conv2d)):
            letters.append("c")
        elif isinstance(child, (nn.BatchNorm1d, nn.BatchNorm2d)):
            letters.append("b")
        elif is_neuron(child):
            letters.append("n")
        elif isinstance(child, nn.Linear):
            letters.append("l")
        elif isinstance(child, nn.Dropout) or type(child).__name__ == "Dropout":  # SpikingJelly's is its own
            letters.append("d")
        elif isinstance(child, (nn.MaxPool1d, nn.MaxPool2d, nn.AvgPool1d, nn.AvgPool2d, nn.AdaptiveAvgPool2d)):
            letters.append("p")
        else:
            letters.append("?")
    return "".join(letters)


INFERRED_STYLES = {"conv_bn_neuron": ("cbn", "cn", "cbnp", "cnp"), "linear_mlp": ("lnl", "lnln", "lndl", "lndln")}
PATTERNS = sorted(((pattern, style) for style, patterns in INFERRED_STYLES.items() for pattern in patterns),
                  key=lambda item: -len(item[0]))  # the longest run first


def _runs(name: str, kinds: str) -> list[tuple[str, str]]:
    """The runs of layers among an ``nn.Sequential``'s children that match a style, as ``"name.start:stop"``."""
    found, start = [], 0
    while start < len(kinds):
        pattern, style = next(((p, s) for p, s in PATTERNS if kinds.startswith(p, start)), ("?", None))
        if style:
            found.append((f"{name}{'.' if name else ''}{start}:{start + len(pattern)}", style))
        start += len(pattern)
    return found


def infer_tp_plan(model: nn.Module) -> tuple[tuple[str, str], ...]:
    """In forward order: the outermost containers whose children match a style's pattern or that are a zoo ResNet's
    residual block, and within an ``nn.Sequential`` that does not, the runs of its children that do."""
    from torch import nn

    found: list[tuple[str, str]] = []
    for name, module in model.named_modules():
        if any(name.startswith(f"{outer}.") for outer, _ in found):
            continue
        kinds = _kinds(module)
        style = next((style for style, patterns in INFERRED_STYLES.items() if kinds in patterns), None)
        if _is_zoo_residual_block(module):
            style = "residual_conv_pair"
        if style and name:
            found.append((name, style))
        elif isinstance(module, nn.Sequential):
            found.extend(_runs(name, kinds))
    return tuple(found)


def own_part(model: nn.Module, config: Config) -> tuple[AnalysisPart, tuple[str, ...]]:
    """What the ``[model]`` section declares, with the rest inferred; and the names of the inferred parts."""
    from torch import nn

    declared = {key: getattr(config.model, key) for key in DECLARABLE}
    for unit in declared["stage_units"] or ():
        if (glue := unit_glue(unit)[0]) is not None and glue not in GLUE:
            raise ConfigError(f"model.stage_units names {unit!r}, whose glue {glue!r} snnfw does not know; write "
                              f"\"flatten:NAME\" for {GLUE['flatten']}, or put the glue inside the module")
    for key in ("blocks", "stage_units"):
        for name in declared[key] or ():
            try:
                submodule(model, unit_glue(name)[1] if key == "stage_units" else name)
            except AttributeError:
                raise ConfigError(f"model.{key} names {name!r}, which the model has not; names: {_child_names(model)}") from None
    inferred = {
        "blocks": tuple(name for name, child in model.named_children() if _has_parameters(child)),
        "stage_units": zoo_stage_units(model) or (
            tuple(name for name, _ in model.named_children()) if isinstance(model, nn.Sequential) else ()),
        "tp_plan": infer_tp_plan(model),
    }
    part = AnalysisPart(**{key: inferred[key] if declared[key] is None else declared[key] for key in DECLARABLE})
    return part, tuple(key for key in DECLARABLE if declared[key] is None)


ZOO = "spikingjelly.activation_based.model."
ZOO_RESNETS = {(f"{ZOO}sew_resnet", "SEWResNet"), (f"{ZOO}spiking_resnet", "SpikingResNet")}
ZOO_VGGS = {(f"{ZOO}spiking_vgg", "SpikingVGG")}
ZOO_PLIF_NETS = {(f"{ZOO}parametric_lif_net", name) for name in ("MNISTNet", "CIFAR10Net", "CIFAR10DVSNet", "DVSGestureNet")}


ZOO_RESIDUAL_BLOCKS = {(f"{ZOO}{module}", block) for module in ("sew_resnet", "spiking_resnet")
                       for block in ("BasicBlock", "Bottleneck")}


def _is_zoo_residual_block(module: nn.Module) -> bool:
    """A residual block of SpikingJelly's zoo ResNets (or a subclass) whose conv1 and conv2 have no groups: its
    forward runs conv1, bn1, sn1, conv2, bn2 in turn, as ``residual_conv_pair`` needs."""
    classes = {(cls.__module__, cls.__name__) for cls in type(module).__mro__}
    return bool(classes & ZOO_RESIDUAL_BLOCKS) and module.conv1.groups == module.conv2.groups == 1


def _children(model: nn.Module, name: str) -> list[str]:
    return [f"{name}.{child}" for child, _ in model.get_submodule(name).named_children()]


def zoo_stage_units(model: nn.Module) -> tuple[str, ...]:
    """The pipeline units of a SpikingJelly zoo ResNet (``sew_resnet*``, ``spiking_resnet*``), VGG (``spiking_vgg*``) or
    PLIF-paper network (``parametric_lif_net``: the layers of its ``conv_fc``), or of a subclass: the layers its forward
    calls in order, residual blocks whole, the ``torch.flatten(x, 2)`` between the average pooling and the classifier
    as glue before the classifier (``"flatten:fc"``); () for another model."""
    classes = {(cls.__module__, cls.__name__) for cls in type(model).__mro__}
    if classes & ZOO_RESNETS:
        layers = [unit for index in range(1, 5) for unit in _children(model, f"layer{index}")]
        return ("conv1", "bn1", "sn1", "maxpool", *layers, "avgpool", "flatten:fc")
    if classes & ZOO_VGGS:
        first, *rest = _children(model, "classifier")
        return (*_children(model, "features"), "avgpool", f"flatten:{first}", *rest)
    if classes & ZOO_PLIF_NETS:
        return tuple(_children(model, "conv_fc"))
    return ()


def _child_names(model: nn.Module) -> str:
    return ", ".join(name for name, _ in model.named_modules() if name and name.count(".") < 2) or "none"
