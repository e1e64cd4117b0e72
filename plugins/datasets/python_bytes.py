"""``python_bytes``: a byte-level text corpus every machine has, the Python standard library's own ``.py`` sources.

The files of the running interpreter's standard library (``sysconfig``'s ``stdlib``), without its test suites and
``site-packages``, in sorted path order; every twentieth file is the validation split, the rest train. Each split's
bytes are cut into windows of ``model.sequence_length + 1`` bytes, one after another (each window starts where the
one before ends, less its last byte): a sample is the window's first S bytes as token ids ``[T, S]`` (repeated
over the time steps) and its last S bytes, the next tokens ``[S]``. ``data.train_samples`` and
``data.test_samples`` take that many windows of a split, spread evenly over it (at most all). Nothing is downloaded;
the corpus is the interpreter's, so another Python version reads other bytes.
"""

from __future__ import annotations

import functools

from snnfw import hookimpl
from snnfw.api import ByteTokenizer, ConfigError, DatasetSpec
from snnfw_plugins.datasets.events import RAW_ONLY

NAME = "python_bytes"
VALIDATION_EVERY = 20  # file i is a validation file where i % 20 == 0
SKIPPED = ("test", "tests", "idle_test", "site-packages")


@functools.cache
def corpus(split: str) -> bytes:
    """The bytes of ``split``'s files, joined in path order."""
    import sysconfig
    from pathlib import Path

    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(path for path in root.rglob("*.py") if not set(path.relative_to(root).parts) & set(SKIPPED))
    held_out = split == "test"
    return b"".join(path.read_bytes() for i, path in enumerate(files) if (i % VALIDATION_EVERY == 0) == held_out)


class ByteWindows:
    """``count`` windows of ``length + 1`` bytes, spread evenly over ``text``."""

    def __init__(self, text: bytes, length: int, time_steps: int, count: int):
        import torch

        self.data = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        self.length, self.time_steps = length, time_steps
        windows = (len(text) - 1) // length
        if windows < 1:
            raise ConfigError(f"data set {NAME!r} holds {len(text)} bytes, fewer than a window of {length + 1}; "
                              "lower model.sequence_length")
        self.starts = torch.linspace(0, windows - 1, min(count, windows)).round().long() * length

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int):
        start = int(self.starts[index])
        window = self.data[start : start + self.length + 1].long()
        return window[:-1].expand(self.time_steps, self.length), window[1:]


def build(config, spec, split, seed):
    if spec.vocab is None:
        raise ConfigError(f"data set {NAME!r} gives token sequences for a language model, and the model takes frames "
                          f"{list(spec.shape)}; set model.family = \"spiking_lm\"")
    if spec.vocab < 256:
        raise ConfigError(f"data set {NAME!r} holds bytes (256 token ids), more than the model's vocabulary of "
                          f"{spec.vocab}; choose a flavor with a vocabulary of at least 256")
    count = config.train_samples if split == "train" else config.test_samples
    return ByteWindows(corpus(split), spec.shape[0], spec.time_steps, count)


@hookimpl
def snnfw_register_datasets(register):
    register(NAME, DatasetSpec(build, "bytes of the Python standard library's sources", unread=("root", *RAW_ONLY),
                               tokens=True, bytes_per_token=1.0, tokenizer=lambda config: ByteTokenizer()),
             "embedded; no download")
