"""One data semantics for every strategy, so strategies compare step by step.

Step ``s`` trains on the ``s``-th contiguous run of ``batch_size`` samples of a
seeded per-epoch permutation. Data-parallel replica ``r`` takes the ``r``-th
contiguous chunk of that global batch, and its microbatches are contiguous
chunks of the replica's chunk. ``none`` with ``D x M`` microbatches therefore
computes on exactly the chunks that ``D`` replicas with ``M`` each compute on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import attrs

from snnfw.config import IMAGE_AUGMENTS, Config, DataConfig
from snnfw.errors import ConfigError, UserError, WorkerError, explain, keys_phrase, user_line, users_code

if TYPE_CHECKING:
    import torch
    from torch.utils.data import Dataset

    from snnfw.data.text import Tokenizer


@attrs.frozen
class InputSpec:
    """What the model expects: frames ``[T, C, H, W]`` per sample and a class count; for a language model
    (``vocab`` set), token ids ``[T, S]`` per sample, scored against the next tokens ``[S]``."""

    time_steps: int
    shape: tuple[int, ...]
    num_classes: int
    vocab: int | None = None

    @property
    def label_shape(self) -> tuple[int, ...]:
        """A sample's label: a class index ``()``, or a language model's next tokens ``(S,)``."""
        return () if self.vocab is None else self.shape


@attrs.frozen
class DatasetSpec:
    """A data-set plugin's builder: ``build(config, spec, split, seed) -> Dataset``.

    Items are ``(frames [T, C, H, W] float, label int)``, or for a language model ``(token ids [T, S], next
    token ids [S])``; ``split`` is "train" or "test".
    ``unread`` names the ``[data]`` keys the set does not read (``root`` for a generated
    set, ``train_samples`` and ``test_samples`` for one on disk), which are refused when set.
    ``classes`` and ``frame_shape`` (one time step's ``(C, H, W)`` as recorded), where the set has them, let
    the plan fit a family's classes to the set's and say how frames are resized. ``images``: a set of static
    images (:class:`snnfw.data.images.DirectEncoded`), which ``data.augment``'s image transforms need.
    A text set's ``bytes_per_token`` (a number, or a function of the ``[data]`` config giving one: a tokenized
    corpus's own) turns evaluation's loss into bits per byte; its ``tokenizer(config)`` gives the
    :class:`snnfw.data.text.Tokenizer` that ``snnfw generate`` encodes prompts and decodes samples with.
    """

    build: Callable[[DataConfig, InputSpec, str, int], Dataset]
    description: str = ""
    unread: tuple[str, ...] = ()
    classes: int | None = None
    frame_shape: tuple[int, int, int] | None = None
    images: bool = False
    tokens: bool = False  # its items are token ids for a language model
    bytes_per_token: float | Callable[[DataConfig], float] | None = None  # evaluation reports bits per byte
    tokenizer: Callable[[DataConfig], Tokenizer] | None = None  # snnfw generate's text codec

    def bytes_per_token_of(self, config: DataConfig) -> float | None:
        """The bytes of text a token of the set ``config`` configures (None: not a text set)."""
        return self.bytes_per_token(config) if callable(self.bytes_per_token) else self.bytes_per_token


def check_keys(config: Config, spec: DatasetSpec) -> None:
    """Refuses the ``[data]`` keys the user set that the configured data set does not read, and the image
    transforms of ``data.augment`` on a set of other frames, and any on a set of tokens."""
    if spec.tokens and config.data.augment:
        raise ConfigError(f"data.augment transforms frames, and data set {config.data.name!r} gives token ids; "
                          "remove data.augment")
    if not spec.images and (named := [name for name in config.data.augment if name in IMAGE_AUGMENTS]):
        raise ConfigError(f"data.augment's {', '.join(map(repr, named))} transform static images, and data set "
                          f"{config.data.name!r} gives {spec.description}; remove them, or train on cifar100 or image_folder")
    if keys := [f"data.{key}" for key in spec.unread if f"data.{key}" in config.explicit]:
        subject, pronoun = keys_phrase(keys)
        raise ConfigError(
            f"{subject} not read by data set {config.data.name!r} ({spec.description}); remove {pronoun}, "
            f"or choose a data set that reads {pronoun}"
        )


REGISTERED_ONLY = ("name", "root", "train_samples", "test_samples")  # keys of registered data sets


def check_own_data(config: Config, given: bool) -> None:
    """Refuses what cannot apply to data sets of the user's own (``data.builder``, or handed to the API)."""
    if given and config.data.builder is not None:
        raise ConfigError("data sets were handed to snnfw.start and data.builder names others; remove data.builder")
    if keys := [f"data.{key}" for key in REGISTERED_ONLY if f"data.{key}" in config.explicit]:
        subject, pronoun = keys_phrase(keys)
        where = "data sets handed to snnfw.start" if given else f"data.builder {config.data.builder!r}"
        raise ConfigError(f"{subject} meant for a registered data set, and the data come from {where}; remove {pronoun}")


def own_datasets(build: Callable, name: str) -> tuple:
    """The ``(train, test)`` map-style data sets that ``build()`` returns; ``name`` is its import path."""
    with users_code(f"data.builder {name!r}"):
        built = build() if callable(build) else None
    if not (isinstance(built, (tuple, list)) and len(built) == 2 and all(hasattr(d, "__getitem__") and hasattr(d, "__len__") for d in built)):
        raise ConfigError(f"data.builder {name!r} must be a function returning (train, test) map-style Datasets of (frames, label)")
    return tuple(built)


def check_samples(dataset: Dataset, spec: InputSpec, split: str) -> None:
    """Refuses a data set whose frames are not ``[T, C, H, W]`` as the model's config says, before training on it."""
    if not len(dataset):
        raise ConfigError(f"the {split} data set is empty")
    with users_code(f"item 0 of the {split} data set"):
        frames, label = dataset[0]
    expected = (spec.time_steps, *spec.shape)
    if tuple(getattr(frames, "shape", ())) != expected:
        raise ConfigError(
            f"the {split} data set's frames have shape {list(getattr(frames, 'shape', []))}, but the model takes "
            f"[T, C, H, W] = {list(expected)} per sample (model.time_steps and the input shape); make them agree"
        )


LABEL_SAMPLE = 8  # how many items, spread over a data set of the user's own, have their labels checked


def check_labels(dataset: Dataset, classes: int, split: str) -> None:
    """Refuses labels that are no integer class index below ``classes`` (a language model's: no tensor of token ids
    below its vocabulary), in a sample of ``dataset``'s items."""
    import operator

    import torch

    for index in sorted({round(i * (len(dataset) - 1) / (LABEL_SAMPLE - 1)) for i in range(LABEL_SAMPLE)}):
        with users_code(f"item {index} of the {split} data set"):
            label = dataset[index][1]
        tokens = isinstance(label, torch.Tensor) and label.dim() > 0 and not label.is_floating_point()
        try:
            low, high = (int(label.min()), int(label.max())) if tokens else (operator.index(label),) * 2
        except TypeError:
            raise ConfigError(f"item {index} of the {split} data set has label {label!r} ({type(label).__name__}); "
                              "labels are integer class indices: return int(label)") from None
        value = low if low < 0 else high  # the one outside the classes, if any
        if not 0 <= value < classes:
            raise ConfigError(f"item {index} of the {split} data set has label {value}, outside the model's classes 0 "
                              f"to {classes - 1}; set model.num_classes = {value + 1} or more, or correct the labels")


def global_batch_indices(step: int, batch_size: int, length: int, seed: int, keys: bool = False,
                         repeats: int = 1) -> torch.Tensor:
    """Dataset indices of the global batch of ``step`` (reshuffled every epoch); with ``keys``,
    ``epoch * length + index``, which an augmented set (:mod:`snnfw.data.augment`) reads.

    With ``repeats`` (repeated augmentation, ``data.repeated_augment``), an epoch's ``length`` positions hold
    each sample of its permutation ``repeats`` times in a row, copy ``c`` of epoch ``e`` keyed as epoch
    ``e * repeats + c``, so every copy is augmented differently (an epoch sees ``length / repeats`` samples)."""
    import torch

    positions = torch.arange(step * batch_size, (step + 1) * batch_size)
    epochs = positions // length
    out = torch.empty_like(positions)
    for epoch in epochs.unique().tolist():
        perm = torch.randperm(length, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        mask = epochs == epoch
        within = positions[mask] % length
        out[mask] = perm[within // repeats] + (epoch * repeats + within % repeats) * length
    return out if keys else out % length


def replica_chunk(indices: torch.Tensor, replica: int, replicas: int) -> torch.Tensor:
    return indices.chunk(replicas)[replica]


def microbatch_indices(step: int, plan, length: int, seed: int, replica: int, keys: bool = False,
                       repeats: int = 1) -> tuple[torch.Tensor, ...]:
    """Dataset indices (or ``keys``) of each of ``replica``'s microbatches in ``step`` of ``plan``."""
    indices = global_batch_indices(step, plan.global_batch, length, seed, keys, repeats)
    return replica_chunk(indices, replica, plan.dp_size).chunk(plan.microbatches)


class StepSampler:
    """A ``DataLoader`` batch sampler: a replica's microbatches, step after step, from ``start`` to ``stop``."""

    def __init__(self, plan, length: int, seed: int, replica: int, start: int, stop: int, keys: bool = False,
                 repeats: int = 1):
        self.plan, self.length, self.seed, self.replica, self.start, self.stop = plan, length, seed, replica, start, stop
        self.keys, self.repeats = keys, repeats

    def __iter__(self):
        for step in range(self.start, self.stop):
            for chunk in microbatch_indices(step, self.plan, self.length, self.seed, self.replica, self.keys, self.repeats):
                yield chunk.tolist()

    def __len__(self) -> int:
        return (self.stop - self.start) * self.plan.microbatches


def _placed(frames: torch.Tensor, labels: torch.Tensor, device: torch.device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Frames in ``dtype``; integer frames (token ids) keep their type."""
    dtype = dtype if frames.is_floating_point() else None
    return frames.to(device, dtype, non_blocking=True), labels.to(device, non_blocking=True)


class WorkerReads:
    """``dataset`` as a loader worker reads a microbatch of it (torch's ``__getitems__``): a user error, or an error
    in the user's own code (a :class:`~snnfw.errors.WorkerError` naming where), is returned instead of raised, and
    :func:`step_batches` raises it in the rank, which then ends on it in the one line it would without workers.
    torch would re-raise it as a new exception whose message is the worker's traceback. Any other error (snnfw's
    own) is raised as before."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitems__(self, indices: list[int]) -> list:
        try:
            read = getattr(self.dataset, "__getitems__", None)
            return read(indices) if read else [self.dataset[index] for index in indices]
        except UserError as err:
            return [err if _survives_pickling(err) else UserError(explain(err))]
        except Exception as err:
            if not (where := user_line(err)):
                raise
            import traceback

            return [WorkerError(where, type(err).__name__, str(err), "".join(traceback.format_exception(err)))]


def _survives_pickling(err: Exception) -> bool:
    """Whether ``err`` reaches the rank from its worker as itself (an exception whose ``__init__`` takes other
    arguments than its ``args`` does not)."""
    import pickle

    try:
        pickle.loads(pickle.dumps(err))
    except Exception:  # noqa: BLE001: whatever its pickling raises
        return False
    return True


def _collated(items: list):
    """A microbatch of the items a worker read, or the exception :class:`WorkerReads` returned."""
    from torch.utils.data import default_collate

    raised = next((item for item in items if isinstance(item, Exception)), None)
    return raised if raised is not None else default_collate(items)


def _read(loader) -> tuple:
    batch = next(loader)
    if isinstance(batch, Exception):
        raise batch
    return batch


def step_batches(dataset: Dataset, sampler: StepSampler, workers: int, device: torch.device, dtype=None):
    """Each step's microbatches, ``[(frames, labels), ...]`` on ``device`` with frames in ``dtype``;
    ``workers`` processes load ahead of the step (0: loaded in this process when the step asks)."""
    from torch.utils.data import DataLoader

    pin = device.type == "cuda"
    loader = iter(DataLoader(WorkerReads(dataset), batch_sampler=sampler, num_workers=workers, pin_memory=pin,
                             collate_fn=_collated) if workers else
                  DataLoader(dataset, batch_sampler=sampler, pin_memory=pin))
    for _ in range(sampler.start, sampler.stop):
        yield [_placed(*_read(loader), device, dtype) for _ in range(sampler.plan.microbatches)]


def load(dataset: Dataset, indices: torch.Tensor, device: torch.device, dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples at ``indices`` as one batch on ``device``, frames in ``dtype`` (None: as stored)."""
    from torch.utils.data import default_collate

    return _placed(*default_collate([dataset[i] for i in indices.tolist()]), device, dtype)


class TimeView:
    """Time steps ``start`` to ``stop`` of each sample of ``dataset``: read alone where the data set can
    (``time_slice(index, start, stop)``), else cut from the whole sample."""

    def __init__(self, dataset: Dataset, start: int, stop: int):
        self.dataset, self.start, self.stop = dataset, start, stop

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        if hasattr(self.dataset, "time_slice"):  # TimeSliced; a wrapper may forward it
            return self.dataset.time_slice(index, self.start, self.stop)
        frames, label = self.dataset[index]
        return frames[self.start:self.stop], label


class SequenceView:
    """Positions ``start`` to ``stop`` of each sample of ``dataset``: of its token ids ``[T, S]`` and of its next
    tokens ``[S]``."""

    def __init__(self, dataset: Dataset, start: int, stop: int):
        self.dataset, self.start, self.stop = dataset, start, stop

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        ids, next_ids = self.dataset[index]
        return ids[..., self.start:self.stop], next_ids[..., self.start:self.stop]
