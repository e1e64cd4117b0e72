"""``token_memmap``: a tokenized corpus in ``data.root`` as nanoGPT and Megatron keep one, read in place.

``train.bin`` and ``val.bin`` (the test split) hold token ids one after another (``uint16`` or ``uint32``) and
``meta.json`` says which, the vocabulary, the bytes of text a token (for bits per byte) and the tokenizer;
``snnfw tokenize`` writes them. A split is read through a memory map and cut into windows of
``model.sequence_length + 1`` tokens, each starting where the one before ends less a token, as ``python_bytes``
cuts its bytes: the input is the first S ids (repeated over the T time steps), the target the last S.
``data.train_samples`` and ``data.test_samples`` take that many windows, spread evenly over the split (at most all).
"""

from __future__ import annotations

from pathlib import Path

from snnfw import hookimpl
from snnfw.api import ConfigError, DataError, DatasetSpec, TokenMeta
from snnfw_plugins.datasets.events import RAW_ONLY

NAME = "token_memmap"


class TokenWindows:
    """``count`` windows of ``length + 1`` ids of the token file ``path``, spread evenly over it."""

    def __init__(self, path: Path, dtype: str, length: int, time_steps: int, count: int):
        import numpy as np

        if not path.is_file():
            raise DataError(f"{path} is missing; build the folder with snnfw tokenize SRC... --out {path.parent}")
        size = path.stat().st_size
        width = np.dtype(dtype).itemsize
        if size % width:
            raise DataError(f"{path} holds {size} bytes, not a whole number of {dtype} ids; build the folder again "
                            "with snnfw tokenize")
        tokens = size // width
        windows = (tokens - 1) // length
        if windows < 1:
            raise ConfigError(f"{path} holds {tokens} tokens, fewer than a window of {length + 1}; lower "
                              "model.sequence_length, or tokenize more text")
        self.ids = np.memmap(path, dtype=dtype, mode="r", shape=(tokens,))
        self.length, self.time_steps = length, time_steps
        self.starts = np.linspace(0, windows - 1, min(count, windows)).round().astype(np.int64) * length

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int):
        import torch

        start = int(self.starts[index])
        window = torch.from_numpy(self.ids[start : start + self.length + 1].astype("int64"))
        return window[:-1].expand(self.time_steps, self.length), window[1:]


def build(config, spec, split, seed):
    if spec.vocab is None:
        raise ConfigError(f"data set {NAME!r} gives token sequences for a language model, and the model takes frames "
                          f"{list(spec.shape)}; set model.family = \"spiking_lm\"")
    meta = TokenMeta.read(config.root)
    if meta.vocab_size > spec.vocab:
        raise ConfigError(f"data.root {config.root} holds ids of a vocabulary of {meta.vocab_size:,}, more than the "
                          f"model's {spec.vocab:,}; choose a flavor whose vocabulary holds them (1.4b: GPT-2's "
                          f"50,257), or tokenize with a smaller one")
    count = config.train_samples if split == "train" else config.test_samples
    return TokenWindows(TokenMeta.split_path(config.root, split), meta.dtype, spec.shape[0], spec.time_steps, count)


@hookimpl
def snnfw_register_datasets(register):
    register(NAME, DatasetSpec(build, "token ids of a corpus snnfw tokenize wrote (train.bin, val.bin, meta.json)",
                               unread=RAW_ONLY, tokens=True,
                               bytes_per_token=lambda config: TokenMeta.read(config.root).bytes_per_token,
                               tokenizer=lambda config: TokenMeta.read(config.root).load_tokenizer(config.root)),
             "in data.root, written by snnfw tokenize")
