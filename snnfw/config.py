"""The run configuration: TOML loaded into frozen attrs classes.

Every key lives in one section: the core's (``[model]``, ``[data]``,
``[parallel]``, ``[train]``, ``[checkpoint]``, ``[eval]``, ``[log]``) and those
plugins declare (the built-in ``[pipeline]``, ``[memopt]``, ``[compile]``, ``[tsp]``);
unknown keys are refused by name. ``--set section.key=value`` overrides any
key, with the value read as TOML (so ``--set train.lr=0.01`` is a float and
``--set model.flavor=full`` a string).

A plugin declares a section of its own with an entry point in the group
``snnfw.config``: ``my_section = "my_plugin:MySection"``, an attrs class whose
fields are the keys with their defaults and validators. It is read as the
built-in sections are and reached as ``config.my_section``. An entry point
named ``section.plugin`` (``"parallel.zero" = "my_plugin:ZeroKeys"``) adds its
class's keys to the core's ``[section]`` instead (``config.parallel.zero``).
"""

from __future__ import annotations

import difflib
import functools
import json
import math
import re
import tomllib
import typing
from pathlib import Path
from typing import Any

import attrs
from attrs import validators as v

from snnfw import entry_points
from snnfw.errors import ConfigError, PluginError, shortened, shown

_positive = [v.instance_of(int), v.gt(0)]
SEED_RANGE = 2**32  # what every generator a run seeds takes (numpy's the narrowest)
COMPOSED = "mesh"  # parallel.strategy of a composed mesh: the dimensions parallel.mesh names, any mix
MAX_TIMEOUT_S = 7 * 24 * 3600  # a week: a collective's timeout must fit torch's timedelta


def _finite(instance, attribute, value) -> None:
    if value is not None and not math.isfinite(value):
        raise ValueError(f"'{attribute.name}' must be a finite number, got {shown(value)}")


def _fractions(instance, attribute, value) -> None:
    if value is not None and not all(0 <= x < 1 for x in value):
        raise ValueError(f"'{attribute.name}' must hold numbers from 0 up to (not including) 1, got {list(value)!r}")


def _mesh(value: Any) -> tuple[tuple[str, int], ...] | None:
    """``{dp = 2, tp = 2}`` -> ``(("dp", 2), ("tp", 2))``; idempotent for attrs.evolve."""
    if value is None or isinstance(value, tuple):
        return value
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ConfigError(f"parallel.mesh must be a table of dimension sizes like {{dp = 2}}, got {shown(value)}")
    for name, size in value.items():
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ConfigError(f"parallel.mesh.{name} = {_toml(size)}: a dimension's size is its number of ranks, a "
                              "whole number 1 or more; set it like {dp = 2, tp = 2}")
    return tuple(value.items())


def _toml(value: Any) -> str:
    """``value`` as TOML writes it (``true``, ``"2"``), cut as :func:`shown` cuts it."""
    if isinstance(value, bool):
        return str(value).lower()
    return shortened(json.dumps(value)) if isinstance(value, str) else shown(value)


def _names(key: str):
    """A converter of a TOML array of module names into a tuple; refuses another value naming ``model.key``."""

    def convert(value: Any) -> tuple[str, ...] | None:
        if value is None or isinstance(value, tuple):
            return value
        if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
            raise ConfigError(f"model.{key} must be an array of module names like [\"blocks.0\", \"blocks.1\"], got {shown(value)}")
        return tuple(value)

    return convert


def _input_shape(value: Any) -> tuple[int, int, int] | None:
    if value is None or isinstance(value, tuple):
        return value
    if not isinstance(value, list) or len(value) != 3 or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in value):
        raise ConfigError(f"model.input_shape must be the frame shape [C, H, W] of one time step, like [2, 32, 32]; got {shown(value)}")
    return tuple(value)


def _tp_plan(value: Any) -> tuple[tuple[str, str], ...] | None:
    """``{"blocks.0" = "conv_bn_neuron"}`` -> ``(("blocks.0", "conv_bn_neuron"),)``; idempotent for attrs.evolve."""
    if value is None or isinstance(value, tuple):
        return value
    if not isinstance(value, dict) or not all(isinstance(style, str) for style in value.values()):
        raise ConfigError(
            f"model.tp_plan must be a table of module name to tensor-parallel style, like "
            f"{{\"blocks.0\" = \"conv_bn_neuron\"}}; got {shown(value)}"
        )
    return tuple(value.items())


INPUT_LAYOUTS = ("NT", "TN")


@attrs.frozen
class ModelConfig:
    """A registered ``family`` and ``flavor``, or a ``builder`` by import path with what it needs declared.

    ``builder`` is ``"module:function"`` (a module on the working directory)
    or ``"path/to/file.py:function"``: a callable without arguments that
    returns the network. ``input_shape`` and ``num_classes`` describe it;
    ``input_layout`` says whether it takes ``[N, T, ...]`` or SpikingJelly's
    ``[T, N, ...]``; ``blocks``, ``stage_units`` and ``tp_plan`` declare what
    a family plugin would (left unset, snnfw infers what it safely can).
    """

    family: str = attrs.field(default="cifar10dvs_vgg", validator=v.instance_of(str))
    flavor: str = attrs.field(default="tiny", validator=v.instance_of(str))
    time_steps: int = attrs.field(default=4, validator=_positive)
    sequence_length: int | None = attrs.field(default=None, validator=v.optional(_positive))  # a language model's S
    builder: str | None = attrs.field(default=None, validator=v.optional(v.instance_of(str)))
    input_shape: tuple[int, int, int] | None = attrs.field(default=None, converter=_input_shape)
    num_classes: int | None = attrs.field(default=None, validator=v.optional([v.instance_of(int), v.ge(2)]))
    input_layout: str = attrs.field(default="NT", validator=v.in_(INPUT_LAYOUTS))
    blocks: tuple[str, ...] | None = attrs.field(default=None, converter=_names("blocks"))
    stage_units: tuple[str, ...] | None = attrs.field(default=None, converter=_names("stage_units"))
    tp_plan: tuple[tuple[str, str], ...] | None = attrs.field(default=None, converter=_tp_plan)


EVENT_AUGMENTS = ("drop_event", "time_jitter", "spatial_jitter")  # tonic's, on raw events before they become frames
IMAGE_AUGMENTS = ("resized_crop", "randaugment")  # of static images, before they are repeated over the time steps
MIX_AUGMENTS = ("mixup", "cutmix")  # each sample mixed with a partner, its target too
AUGMENTS = ("hflip", "roll", "crop", *IMAGE_AUGMENTS, *MIX_AUGMENTS, *EVENT_AUGMENTS)  # snnfw.data.augment's transforms


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _augment(value: Any) -> tuple[str, ...]:
    if isinstance(value, tuple):
        return value
    if not isinstance(value, list) or any(name not in AUGMENTS for name in value) or len(set(value)) != len(value):
        raise ConfigError(f"data.augment lists training-set transforms, some of {list(AUGMENTS)} once each; got {shown(value)}")
    return tuple(value)


def _range(key: str, example: str):
    """A converter of a TOML array ``[low, high]`` into a tuple of floats; refuses another value naming ``data.key``."""

    def convert(value: Any) -> tuple[float, float] | None:
        if value is None or isinstance(value, tuple):
            return value
        if not (isinstance(value, list) and len(value) == 2 and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                                    for x in value) and 0 < value[0] <= value[1]):
            raise ConfigError(f"data.{key} must be an array [low, high] of positive numbers, low first, like {example}; "
                              f"got {shown(value)}")
        return float(value[0]), float(value[1])

    return convert


def _within(low: float, high: float):
    def check(instance, attribute, value) -> None:
        if not all(low < x <= high for x in value):
            raise ValueError(f"'{attribute.name}' must hold numbers above {low} and at most {high}, got {list(value)!r}")

    return check


BAD_RECORDINGS = ("refuse", "skip")  # what a raw recording not as its publisher ships it stops: the run, or itself
FRAMES_BY = ("count", "time")  # bins of equal event counts (SpikingJelly's split_by="number"), or of equal time


@attrs.frozen
class Frames:
    """How raw events become ``model.time_steps`` frames (tonic's ToFrame), after tonic's Denoise when
    ``denoise_us`` is set."""

    by: str = attrs.field(default="count", validator=v.in_(FRAMES_BY))
    denoise_us: int | None = attrs.field(default=None, validator=v.optional(_positive))


def _frames(value: Any) -> Frames:
    if isinstance(value, Frames):
        return value
    keys = [f.name for f in attrs.fields(Frames)]
    if not isinstance(value, dict) or not set(value) <= set(keys):
        raise ConfigError(f'data.frames must be a table like {{by = "time"}} with keys {", ".join(keys)}, got {shown(value)}')
    try:
        return Frames(**value)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"invalid data.frames: {err.args[0] if err.args else err}") from None


@attrs.frozen
class DataConfig:
    name: str = attrs.field(default="synthetic_dvs", validator=v.instance_of(str))
    batch_size: int = attrs.field(default=32, validator=_positive)
    train_samples: int = attrs.field(default=2048, validator=_positive)
    test_samples: int = attrs.field(default=512, validator=_positive)
    root: str | None = attrs.field(default=None, validator=v.optional(v.instance_of(str)))
    workers: int = attrs.field(default=0, validator=[v.instance_of(int), v.ge(0)])
    builder: str | None = attrs.field(default=None, validator=v.optional(v.instance_of(str)))  # "module:function" -> (train, test)
    augment: tuple[str, ...] = attrs.field(default=(), converter=_augment)
    roll_pixels: int | None = attrs.field(default=None, validator=v.optional(_positive))
    crop_padding: int | None = attrs.field(default=None, validator=v.optional(_positive))
    drop_event_p: float | None = attrs.field(default=None, converter=_optional_float,
                                             validator=v.optional([v.gt(0), v.lt(1)]))
    time_jitter_us: float | None = attrs.field(default=None, converter=_optional_float,
                                               validator=v.optional([v.gt(0), _finite]))
    spatial_jitter_px: float | None = attrs.field(default=None, converter=_optional_float,
                                                  validator=v.optional([v.gt(0), _finite]))
    crop_scale: tuple[float, float] | None = attrs.field(default=None, converter=_range("crop_scale", "[0.08, 1.0]"),
                                                         validator=v.optional(_within(0, 1)))
    crop_ratio: tuple[float, float] | None = attrs.field(default=None, converter=_range("crop_ratio", "[0.75, 1.333]"),
                                                         validator=v.optional(_within(0, math.inf)))
    randaugment_ops: int | None = attrs.field(default=None, validator=v.optional(_positive))
    randaugment_magnitude: int | None = attrs.field(default=None, validator=v.optional([v.instance_of(int), v.ge(0),
                                                                                         v.le(30)]))
    mixup_alpha: float | None = attrs.field(default=None, converter=_optional_float, validator=v.optional([v.gt(0), _finite]))
    cutmix_alpha: float | None = attrs.field(default=None, converter=_optional_float, validator=v.optional([v.gt(0), _finite]))
    mix_prob: float | None = attrs.field(default=None, converter=_optional_float, validator=v.optional([v.gt(0), v.le(1)]))
    mix_switch_prob: float | None = attrs.field(default=None, converter=_optional_float,
                                                validator=v.optional([v.ge(0), v.le(1)]))
    repeated_augment: int = attrs.field(default=1, validator=_positive)
    frames: Frames = attrs.field(factory=Frames, converter=_frames)  # raw event sets only
    cache: str | None = attrs.field(default=None, validator=v.optional(v.instance_of(str)))  # their frames' folder
    bad_recordings: str = attrs.field(default="refuse", validator=v.in_(BAD_RECORDINGS))  # raw event sets only


@attrs.frozen
class ParallelConfig:
    strategy: str = attrs.field(default="none", validator=v.instance_of(str))
    mesh: tuple[tuple[str, int], ...] | None = attrs.field(default=None, converter=_mesh)
    device: str = attrs.field(default="auto", validator=v.in_(("auto", "cpu", "cuda")))
    backend: str = attrs.field(default="auto", validator=v.in_(("auto", "nccl", "gloo")))
    timeout_s: float = attrs.field(default=300.0, converter=float, validator=[v.gt(0), v.le(MAX_TIMEOUT_S)])
    mixed_precision: str = attrs.field(default="none", validator=v.in_(("none", "bf16")))
    prefer: str | None = attrs.field(default=None, validator=v.optional(v.in_(("speed", "memory", "capacity"))))
    cpu_allocator: str = attrs.field(default="auto", validator=v.in_(("auto", "retain", "system")))
    tune_results: str | None = attrs.field(default=None, validator=v.optional(v.instance_of(str)))


def _numbers(key: str, kind: type, length: int | None = None, example: str = ""):
    """A converter of a TOML array into a tuple of ``kind``; refuses another value naming ``train.key``."""

    def convert(value: Any) -> tuple | None:
        if value is None or isinstance(value, tuple):
            return value
        accepted = (int, float) if kind is float else kind
        if not isinstance(value, list) or not all(isinstance(x, accepted) and not isinstance(x, bool) for x in value) or (
            length is not None and len(value) != length
        ):
            raise ConfigError(f"train.{key} must be an array like {example}, got {shown(value)}")
        return tuple(kind(x) for x in value)

    return convert


NO_DECAY_KINDS = ("norm", "bias", "neuron")


def _no_decay(value: Any) -> tuple[str, ...]:
    if isinstance(value, tuple):
        return value
    if not isinstance(value, list) or any(kind not in NO_DECAY_KINDS for kind in value):
        raise ConfigError(
            f"train.no_decay lists parameter kinds exempt from weight decay, some of {list(NO_DECAY_KINDS)}; got {shown(value)}"
        )
    return tuple(value)


@attrs.frozen
class TrainConfig:
    steps: int = attrs.field(default=20, validator=_positive)
    epochs: int | None = attrs.field(default=None, validator=v.optional(_positive))  # instead of steps
    lr: float = attrs.field(default=1e-3, converter=float, validator=[v.gt(0), _finite])
    seed: int = attrs.field(default=0, validator=[v.instance_of(int), v.ge(0), v.lt(SEED_RANGE)])
    microbatches: int | None = attrs.field(default=None, validator=v.optional(_positive))
    optimizer: str = attrs.field(default="adam", validator=v.instance_of(str))
    optimizer_impl: str = attrs.field(default="auto", validator=v.in_(("auto", "fused", "foreach", "for_loop")))
    loss: str = attrs.field(default="cross_entropy", validator=v.instance_of(str))
    label_smoothing: float | None = attrs.field(
        default=None, converter=_optional_float, validator=v.optional([v.ge(0), v.lt(1)])
    )
    tet_lambda: float | None = attrs.field(default=None, converter=_optional_float, validator=v.optional([v.ge(0), v.le(1)]))
    weight_decay: float | None = attrs.field(default=None, converter=_optional_float, validator=v.optional([v.ge(0), _finite]))
    betas: tuple[float, float] | None = attrs.field(default=None, converter=_numbers("betas", float, 2, "[0.9, 0.999]"),
                                                    validator=_fractions)
    momentum: float | None = attrs.field(default=None, converter=_optional_float, validator=v.optional([v.ge(0), v.lt(1)]))
    nesterov: bool | None = attrs.field(default=None, validator=v.optional(v.instance_of(bool)))
    no_decay: tuple[str, ...] = attrs.field(default=(), converter=_no_decay)
    lr_schedule: str = attrs.field(default="constant", validator=v.instance_of(str))
    warmup_steps: int = attrs.field(default=0, validator=[v.instance_of(int), v.ge(0)])
    warmup_epochs: int = attrs.field(default=0, validator=[v.instance_of(int), v.ge(0)])  # with epochs, instead
    min_lr: float | None = attrs.field(default=None, converter=_optional_float, validator=v.optional([v.ge(0), _finite]))
    step_size: int | None = attrs.field(default=None, validator=v.optional(_positive))
    milestones: tuple[int, ...] | None = attrs.field(default=None, converter=_numbers("milestones", int, example="[10, 15]"))
    gamma: float | None = attrs.field(default=None, converter=_optional_float, validator=v.optional([v.gt(0), _finite]))
    clip_grad_norm: float | None = attrs.field(default=None, converter=_optional_float,
                                               validator=v.optional([v.gt(0), _finite]))
    log_every: int = attrs.field(default=1, validator=_positive)
    precision: str = attrs.field(default="fp32", validator=v.in_(("fp32", "bf16", "fp16")))
    loss_scale: float | None = attrs.field(default=None, converter=_optional_float,
                                           validator=v.optional([v.gt(0), _finite]))  # fp16's first
    dtype: str = attrs.field(default="float32", validator=v.in_(("float32", "float64")))

    @property
    def torch_dtype(self):
        """The dtype of parameters, buffers and input frames: float64 for exact equivalence checks."""
        import torch

        return getattr(torch, self.dtype)


@attrs.frozen
class CheckpointConfig:
    every: int = attrs.field(default=0, validator=[v.instance_of(int), v.ge(0)])
    keep: int = attrs.field(default=2, validator=_positive)
    async_save: bool = attrs.field(default=False, validator=v.instance_of(bool))  # written while training goes on


@attrs.frozen
class EvalConfig:
    """Validation on the test split during training: every ``every`` steps, or every ``every_epochs`` epochs."""

    every: int = attrs.field(default=0, validator=[v.instance_of(int), v.ge(0)])
    every_epochs: int = attrs.field(default=0, validator=[v.instance_of(int), v.ge(0)])
    ops: bool = attrs.field(default=False, validator=v.instance_of(bool))  # SOPs and energy in every validation
    energy_ac_pj: float = attrs.field(default=0.9, converter=float, validator=[v.gt(0), _finite])  # 45 nm accumulate
    energy_mac_pj: float = attrs.field(default=4.6, converter=float, validator=[v.gt(0), _finite])  # 45 nm MAC


@attrs.frozen
class Profile:
    """``log.profile``: the steps (first, last; counted from 1) whose torch.profiler trace the chosen ranks write."""

    steps: tuple[int, int]
    ranks: tuple[int, ...] | None = None  # None: every rank


def _profile(value: Any) -> Profile | None:
    """``{steps = "10-12", ranks = "all"}`` (or ``steps = 10``, ``ranks = [0, 3]``) -> :class:`Profile`."""
    if value is None or isinstance(value, Profile):
        return value
    example = 'a table like {steps = "10-12", ranks = "all"} (ranks: "all" or a list such as [0, 3])'
    if not isinstance(value, dict) or "steps" not in value or not set(value) <= {"steps", "ranks"}:
        raise ConfigError(f"log.profile must be {example}, got {shown(value)}")
    steps, ranks = value["steps"], value.get("ranks", "all")
    match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", str(steps)) if not isinstance(steps, bool) else None
    first, last = (int(match.group(1)), int(match.group(2) or match.group(1))) if match else (0, 0)
    if not 1 <= first <= last:
        raise ConfigError(f'log.profile.steps must be a step or a range of steps counted from 1, such as "10-12", '
                          f"got {shown(steps)}")
    if ranks != "all" and not (isinstance(ranks, list) and ranks and all(
            isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks)):
        raise ConfigError(f'log.profile.ranks must be "all" or a list of ranks such as [0, 3], got {shown(ranks)}')
    return Profile((first, last), None if ranks == "all" else tuple(sorted(set(ranks))))


@attrs.frozen
class LogConfig:
    """Where metrics go besides ``metrics.jsonl``: TensorBoard scalars under ``RUN_DIR/tensorboard``; profiler
    traces of chosen steps under ``RUN_DIR/profile``."""

    tensorboard: bool = attrs.field(default=False, validator=v.instance_of(bool))
    phase_times: bool = attrs.field(default=False, validator=v.instance_of(bool))  # data_ms, forward_ms, ... per step
    profile: Profile | None = attrs.field(default=None, converter=_profile)
    memory_snapshot: int = attrs.field(default=0, validator=[v.instance_of(int), v.ge(0)])  # a step (from 1); 0: none
    wandb: str = attrs.field(default="", validator=v.in_(("", "offline", "online")))  # "": no Weights & Biases
    wandb_project: str = attrs.field(default="snnfw", validator=v.instance_of(str))
    peak_tflops: float | None = attrs.field(default=None, converter=_optional_float,  # a device's, for the MFU
                                            validator=v.optional([v.gt(0), _finite]))


EXPLICIT = "explicit"  # the top-level entry of Config.to_dict that lists the keys the user set


@attrs.frozen
class Config:
    model: ModelConfig = attrs.field(factory=lambda: section_class("model")())
    data: DataConfig = attrs.field(factory=lambda: section_class("data")())
    parallel: ParallelConfig = attrs.field(factory=lambda: section_class("parallel")())
    train: TrainConfig = attrs.field(factory=lambda: section_class("train")())
    checkpoint: CheckpointConfig = attrs.field(factory=lambda: section_class("checkpoint")())
    eval: EvalConfig = attrs.field(factory=lambda: section_class("eval")())
    log: LogConfig = attrs.field(factory=lambda: section_class("log")())
    explicit: frozenset[str] = attrs.field(default=frozenset(), converter=frozenset)  # "section.key"s the user set
    sections: tuple[tuple[str, Any], ...] = ()  # the sections plugins declare, (name, value) pairs

    def __getattr__(self, name: str) -> Any:
        """A plugin's section, ``config.my_section``."""
        if name != "sections":
            for section, value in self.sections:
                if section == name:
                    return value
        raise AttributeError(f"{type(self).__name__!r} has no section {name!r}")

    def to_dict(self) -> dict[str, Any]:
        """Every key, and under ``explicit`` those the user set: ``build_config(config.to_dict())`` equals ``config``."""
        out = attrs.asdict(self)
        if self.parallel.mesh is not None:
            out["parallel"]["mesh"] = dict(self.parallel.mesh)
        if self.model.tp_plan is not None:
            out["model"]["tp_plan"] = dict(self.model.tp_plan)
        if (profile := self.log.profile) is not None:
            first, last = profile.steps
            out["log"]["profile"] = {"steps": f"{first}-{last}", "ranks": list(profile.ranks or ()) or "all"}
        del out["sections"], out[EXPLICIT]
        for name, value in self.sections:
            out[name] = attrs.asdict(value)
        out[EXPLICIT] = sorted(self.explicit)
        return out

    def with_section(self, name: str, value: Any) -> "Config":
        """This config with section ``name`` (built-in or a plugin's) replaced by ``value``."""
        if name in _SECTION_CLASSES:
            return attrs.evolve(self, **{name: value})
        return attrs.evolve(self, sections=tuple((n, value if n == name else v) for n, v in self.sections))


_SECTION_CLASSES = {
    "model": ModelConfig, "data": DataConfig, "parallel": ParallelConfig, "train": TrainConfig,
    "checkpoint": CheckpointConfig, "eval": EvalConfig, "log": LogConfig,
}


def plugin_sections() -> dict[str, type]:
    """The config sections that installed plugins declare, by name (``section.plugin`` for keys added to a core
    section); a blocked plugin's (``SNNFW_BLOCK_PLUGINS``), and a third party's when plugins do not autoload, are
    left out as their plugins are."""
    return _declared()[0]


def _declared() -> tuple[dict[str, type], dict[str, entry_points.ImportFailure]]:
    """:func:`plugin_sections`, and the sections left out because their distribution's plugin or the section's
    own module failed to import (a section whose plugin is absent would take keys that nothing reads)."""
    blocked, autoload = entry_points.blocked(), entry_points.autoload()
    off = {ep.module for ep in entry_points.installed(entry_points.GROUP) if ep.name in blocked}
    found: dict[str, type] = {}
    left_out: dict[str, entry_points.ImportFailure] = {}
    for ep in entry_points.installed(entry_points.SECTIONS_GROUP):
        dist = ep.dist.name if ep.dist is not None else "no distribution"
        if ep.module in off or (not autoload and not entry_points.is_builtin(ep)):
            continue
        core, dot, _ = ep.name.partition(".")
        if dot and core not in _SECTION_CLASSES:
            raise ConfigError(f"{dist} adds keys to config section [{core}], which is not one of the core's "
                              f"({', '.join(_SECTION_CLASSES)}); name its entry point section.plugin")
        if (not dot and ep.name in _SECTION_CLASSES) or ep.name in found or ep.name == EXPLICIT:
            raise ConfigError(f"{dist} declares config section [{ep.name}], which another section has already; "
                              f"rename its entry point in [project.entry-points.\"{entry_points.SECTIONS_GROUP}\"]")
        try:
            cls = (not entry_points.is_builtin(ep) and entry_points.failure_of(dist)) or entry_points.load(ep)
        except PluginError:
            raise
        except Exception as err:
            raise ConfigError(f"config section [{ep.name}] of {dist} ({ep.value}) failed to import: {err!r}") from None
        if isinstance(cls, entry_points.ImportFailure):
            left_out[ep.name] = cls
            continue
        if not attrs.has(cls):
            raise ConfigError(f"config section [{ep.name}] of {dist} is {ep.value}, which is not an attrs class; "
                              "declare the keys as fields of an @attrs.frozen class")
        found[ep.name] = cls
    return dict(sorted(found.items())), left_out


def _left_out(name: str, failure: entry_points.ImportFailure) -> str:
    return f"config section [{name}] is declared by plugin {failure}; fix or uninstall it"


def section_class(name: str, declared: dict[str, type] | None = None) -> type:
    """The class of core section ``name`` with the keys plugins add to it (``declared``: :func:`plugin_sections`)."""
    declared = plugin_sections() if declared is None else declared
    return _extended(_SECTION_CLASSES[name], tuple(cls for key, cls in declared.items() if key.startswith(f"{name}.")))


@functools.cache
def _extended(core: type, additions: tuple[type, ...]) -> type:
    """``core`` subclassed with the fields of ``additions``: one class per set, so equal configs compare equal."""
    if not additions:
        return core
    namespace: dict[str, Any] = {"__module__": core.__module__, "__annotations__": {}, "_additions": additions,
                                 "__reduce__": _reduce}
    owners = {f.name: "the core" for f in attrs.fields(core)}
    for cls in additions:
        name = f"{cls.__module__}.{cls.__qualname__}"
        try:
            hints = typing.get_type_hints(cls)
        except Exception as err:
            raise ConfigError(f"the keys of {name} have annotations that do not resolve ({err}); import what they "
                              "name in its module") from None
        for f in attrs.fields(cls):
            if f.default is attrs.NOTHING:
                raise ConfigError(f"{name} adds key {f.name!r} without a default; give it one, as every key has")
            if f.name in owners:
                raise ConfigError(f"{name} adds key {f.name!r} to a section where {owners[f.name]} has it already; "
                                  "rename the key")
            owners[f.name] = name
            namespace[f.name] = attrs.field(default=f.default, validator=f.validator, converter=f.converter)
            namespace["__annotations__"][f.name] = hints[f.name]
    return attrs.frozen(type(core.__name__, (core,), namespace))


def _reduce(section) -> tuple:
    cls = type(section)
    return _rebuild, (cls.__mro__[1], cls._additions, attrs.asdict(section, recurse=False))


def _rebuild(core: type, additions: tuple[type, ...], values: dict[str, Any]) -> Any:
    """Unpickles a section with plugins' keys (its class is made at run time, so pickle cannot name it)."""
    return _extended(core, additions)(**values)


def parse_override(text: str) -> tuple[str, str, Any]:
    """``"train.lr=0.01"`` -> ``("train", "lr", 0.01)``; values are read as TOML, else as strings (but a table or
    an array that is not TOML is refused)."""
    key, sep, raw = text.partition("=")
    section, dot, name = key.strip().partition(".")
    if not sep or not dot or not name:
        raise ConfigError(f"--set expects section.key=value (for example train.steps=10), got {shown(text)}")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError as err:
        if raw.strip().startswith(("{", "[")):
            reason = re.sub(r" \(at [^)]*\)$", "", str(err))  # its position is in "v = value", not in what was typed
            raise ConfigError(f"--set {shown(text)} is not a TOML table or array: {reason}; write each key once and "
                              "close each bracket, or put TOML quotes around a string") from None
        value = raw.strip()
    return section, name, value


_KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _check_kind(cls: type, section: str, key: str, value: Any) -> None:
    """Refuses a value of the wrong TOML kind, naming ``section.key`` and the kind its annotation asks for."""
    hint = typing.get_type_hints(cls)[key]
    if value is None and type(None) in typing.get_args(hint):
        return  # an optional key given as unset (a config written back by Config.to_dict)
    kinds = [t for t in typing.get_args(hint) or (hint,) if t is not type(None)]
    if len(kinds) != 1 or kinds[0] not in _KINDS:
        return  # tables such as parallel.mesh are checked by their converter
    kind = kinds[0]
    accepted = (int, float) if kind is float else kind  # an integer is a number
    if isinstance(value, accepted) and (kind is bool or not isinstance(value, bool)):
        return
    raise ConfigError(f"{section}.{key} must be {_KINDS[kind]}, got {shown(value)} ({type(value).__name__})")


def build_config(data: dict[str, Any], overrides: list[str] = ()) -> Config:
    """Validates a parsed TOML document plus overrides into a :class:`Config`.

    The keys the document and the overrides name are the ones the user set
    (``Config.explicit``), which defaults that plans fill never replace; a
    document written by ``Config.to_dict`` lists them under ``explicit``.
    """
    data = dict(data)
    listed = data.pop(EXPLICIT, None)
    declared, left_out = _declared()
    classes = {**{name: section_class(name, declared) for name in _SECTION_CLASSES},
               **{name: cls for name, cls in declared.items() if "." not in name}}
    merged: dict[str, dict[str, Any]] = {}
    for section, table in data.items():
        if section in left_out:
            raise ConfigError(_left_out(section, left_out[section]))
        if section not in classes:
            raise ConfigError(f"unknown config section [{section}]{_nearest(section, classes, '[{}]')}; sections are "
                              f"{', '.join(classes)}")
        if not isinstance(table, dict):
            raise ConfigError(f"[{section}] must be a table of keys")
        merged[section] = dict(table)
    for text in overrides:
        section, name, value = parse_override(text)
        if section in left_out:
            raise ConfigError(_left_out(section, left_out[section]))
        if section not in classes:
            raise ConfigError(f"unknown config section in --set {shown(text)}{_nearest(section, classes, '{}')}; "
                              f"sections are {', '.join(classes)}")
        merged.setdefault(section, {})[name] = value
    explicit = {f"{section}.{key}" for section, table in merged.items() for key in table}
    if listed is not None:  # every key is present; the listed ones and the overrides were set
        explicit = set(listed) | {f"{section}.{name}" for section, name, _ in map(parse_override, overrides)}
        known = {f"{section}.{f.name}" for section, cls in classes.items() for f in attrs.fields(cls)}
        if unknown := sorted(explicit - known):
            raise ConfigError(f"{EXPLICIT} lists unknown config keys {', '.join(unknown)}; it lists section.key names")
    sections = {}
    for section, cls in classes.items():
        table = merged.get(section, {})
        known = {f.name for f in attrs.fields(cls)}
        for key in table:
            if key not in known:
                lost = "".join(f"; {_left_out(name, failure)}" for name, failure in left_out.items()
                               if name.startswith(f"{section}."))
                raise ConfigError(f"unknown config key {shortened(f'{section}.{key}')}"
                                  f"{_nearest(key, known, f'{section}.{{}}')}; keys of [{section}] are "
                                  f"{', '.join(sorted(known))}{lost}")
            _check_kind(cls, section, key, table[key])
        try:
            sections[section] = cls(**table)
        except (TypeError, ValueError) as err:
            reason = err.args[0] if err.args else err
            raise ConfigError(f"invalid value in [{section}]: {shortened(str(reason))}") from None
    every, steps = sections["checkpoint"].every, sections["train"].steps
    if every > steps and sections["train"].epochs is None:
        raise ConfigError(
            f"checkpoint.every = {every} is more than train.steps = {steps}, so no checkpoint would be written; "
            "lower checkpoint.every, or set it to 0 for none"
        )
    if sections["train"].epochs is None:
        check_log_steps(sections["log"], steps)
    if "log.wandb_project" in explicit and not sections["log"].wandb:
        raise ConfigError('log.wandb_project names the Weights & Biases project of log.wandb, which is off; set '
                          'log.wandb = "offline" or "online", or remove log.wandb_project')
    for key in ("checkpoint.keep", "checkpoint.async_save"):
        if key in explicit and sections["checkpoint"].every == 0:
            raise ConfigError(
                f"{key} applies only when checkpoints are written (checkpoint.every > 0, 0 writes none); "
                f"set checkpoint.every, or remove {key}"
            )
    if "parallel.mesh" in explicit and "parallel.strategy" not in explicit:  # the mesh alone: its dimensions composed
        sections["parallel"] = attrs.evolve(sections["parallel"], strategy=COMPOSED)
    own = tuple((name, sections.pop(name)) for name in classes if name not in _SECTION_CLASSES)
    return Config(**sections, explicit=explicit, sections=own)


def _nearest(name: str, known, form: str) -> str:
    """`` (did you mean train.steps?)``: the known name closest to a mistyped ``name``, written as ``form`` writes
    it; ``""`` where none is close."""
    close = difflib.get_close_matches(name, sorted(known), n=1)
    return f" (did you mean {form.format(close[0])}?)" if close else ""


def check_log_steps(log: LogConfig, steps: int) -> None:
    """Refuses ``log`` settings that name a step after the run's last (``steps``, resolved from epochs if so)."""
    if log.profile is not None and log.profile.steps[1] > steps:
        raise ConfigError(f"log.profile.steps ends at step {log.profile.steps[1]}, after the run's last, step "
                          f"{steps}; profile steps within the run")
    if log.memory_snapshot > steps:
        raise ConfigError(f"log.memory_snapshot = {log.memory_snapshot} is after the run's last step, step {steps}; "
                          "choose a step within the run")


def for_evaluation(config: Config) -> Config:
    """``config`` as scoring weights reads it: what only training uses (checkpoints, the microbatches of a training
    step) back at its defaults, so a training config scores under any strategy and world size."""
    return attrs.evolve(
        config, checkpoint=section_class("checkpoint")(), train=attrs.evolve(config.train, microbatches=None),
        explicit=config.explicit - {"checkpoint.every", "checkpoint.keep", "checkpoint.async_save", "train.microbatches"},
    )


def with_settings(config: Config, settings: dict[str, Any]) -> tuple[Config, list[str]]:
    """Applies ``{"section.key": value}`` to the keys the user did not set; returns what changed."""
    changed = []
    for key, value in settings.items():
        section, name = key.split(".", 1)
        current = getattr(config, section)
        if key not in config.explicit and getattr(current, name) != value:
            config = config.with_section(section, attrs.evolve(current, **{name: value}))
            changed.append(f"{key} = {value!r}")
    return config, changed


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """Reads a TOML file (or only defaults when ``path`` is None) and applies ``--set`` overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if path.is_dir():
            raise ConfigError(f"config file {path} is a folder; pass a TOML file such as examples/quickstart.toml")
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist; pass a TOML file such as examples/quickstart.toml")
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"{path} is not valid TOML: {err}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{path} is not UTF-8 text, which TOML files are; save it as UTF-8") from None
        _builders_beside(data, path.parent)
    return build_config(data, list(overrides))


def _builders_beside(data: dict[str, Any], folder: Path) -> None:
    """Makes a relative ``builder = "file.py:name"`` of a config file start at the file's folder where it names a
    file there (else it starts at the working directory, as it always did)."""
    for section in ("model", "data"):
        table = data.get(section)
        builder = table.get("builder") if isinstance(table, dict) else None
        if not isinstance(builder, str) or ":" not in builder:
            continue
        where, _, name = builder.rpartition(":")
        if where.endswith(".py") and not Path(where).is_absolute() and (folder / where).is_file():
            table["builder"] = f"{(folder / where).resolve()}:{name}"
