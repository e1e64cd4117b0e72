"""Text as token ids: the tokenizers a language model's data use, and the token files ``snnfw tokenize`` writes.

A token folder holds ``train.bin`` and ``val.bin`` (the token ids one after another, unsigned 16-bit where the
vocabulary fits, else 32-bit, as nanoGPT and Megatron keep them) and ``meta.json`` (:class:`TokenMeta`: the dtype,
the vocabulary, the bytes of text a token and the tokenizer, ``bytes`` or the ``tokenizer.json`` beside them).
Byte-level needs nothing; BPE is the ``tokenizers`` library's, imported only where it is asked for.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

import attrs

from snnfw.errors import ConfigError, DataError

META = "meta.json"
TOKENIZER_FILE = "tokenizer.json"
SPLIT_FILES = {"train": "train.bin", "test": "val.bin"}
BYTES = "bytes"
DTYPES = ("uint16", "uint32")
INSTALL_TOKENIZERS = "pip install 'snnfw[lm]' (or pip install tokenizers)"


class Tokenizer(Protocol):
    """Text to token ids and back."""

    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids 0 to 255; decoding replaces what is not UTF-8 (a sample cut inside a character)."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class TokenizersBPE:
    """A ``tokenizers`` library tokenizer (its ``tokenizer.json``)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()

    @classmethod
    def from_file(cls, path: str | Path, why: str) -> TokenizersBPE:
        tokenizers = import_tokenizers(why)
        try:
            return cls(tokenizers.Tokenizer.from_file(str(path)))
        except Exception as err:  # not there, not JSON, not a tokenizer's
            raise DataError(f"{path} cannot be read as a tokenizers tokenizer.json ({type(err).__name__}: "
                            f"{str(err).splitlines()[0][:200] if str(err) else 'no detail'}); name the tokenizer.json "
                            "that tokenizers saved") from None

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


def import_tokenizers(why: str):
    """The ``tokenizers`` module, or one line saying ``why`` it is needed and how to install it."""
    try:
        import tokenizers
    except ImportError:
        raise ConfigError(f"{why} needs the tokenizers package, which is not installed; {INSTALL_TOKENIZERS}, or use "
                          "the byte-level tokenizer (--tokenizer bytes)") from None
    return tokenizers


def dtype_for(vocab_size: int) -> str:
    """The narrowest of :data:`DTYPES` that holds ids below ``vocab_size``."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


@attrs.frozen
class TokenMeta:
    """A token folder's ``meta.json``."""

    dtype: str
    vocab_size: int
    bytes_per_token: float
    tokenizer: str  # "bytes", or the tokenizer.json file's name in the folder
    tokens: dict  # each split's token count

    def write(self, folder: Path) -> None:
        (folder / META).write_text(json.dumps(attrs.asdict(self), indent=2) + "\n")

    @classmethod
    def read(cls, folder: str | Path | None, key: str = "data.root") -> TokenMeta:
        """The meta of the token folder ``folder`` (``key`` names where it was given), checked."""
        if folder is None:
            raise ConfigError(f"{key} is not set; set it to a folder that snnfw tokenize wrote (train.bin, val.bin, "
                              f"{META})")
        path = Path(folder) / META
        try:
            raw = json.loads(path.read_text())
            meta = cls(**{field.name: raw[field.name] for field in attrs.fields(cls)})
        except OSError:
            raise DataError(f"{key} {folder} holds no readable {META}; build the folder with snnfw tokenize SRC... "
                            f"--out {folder}") from None
        except (ValueError, KeyError, TypeError) as err:
            raise DataError(f"{path} is not the {META} snnfw tokenize writes ({type(err).__name__}: {err}); build the "
                            "folder again with snnfw tokenize") from None
        if meta.dtype not in DTYPES or not isinstance(meta.vocab_size, int) or meta.vocab_size < 2 \
                or not meta.bytes_per_token > 0:
            raise DataError(f"{path} says dtype {meta.dtype!r}, vocab_size {meta.vocab_size!r}, bytes_per_token "
                            f"{meta.bytes_per_token!r}; expected one of {', '.join(DTYPES)}, 2 or more and a positive "
                            "number: build the folder again with snnfw tokenize")
        return meta

    @staticmethod
    def split_path(folder: str | Path, split: str) -> Path:
        """The token file of ``split`` ("train" or "test") in ``folder``."""
        return Path(folder) / SPLIT_FILES[split]

    def load_tokenizer(self, folder: str | Path) -> Tokenizer:
        """The tokenizer that wrote the folder's ids."""
        if self.tokenizer == BYTES:
            return ByteTokenizer()
        return TokenizersBPE.from_file(Path(folder) / self.tokenizer, f"the tokenizer of {folder}")
