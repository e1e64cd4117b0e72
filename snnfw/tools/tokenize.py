"""``snnfw tokenize``: a token folder (``train.bin``, ``val.bin``, ``meta.json``; :mod:`snnfw.data.text`) from text.

Each SRC is a text file (one document) or a ``.jsonl`` file (a document a line, its ``"text"`` field). Documents
are read in the order given, each ending in a newline (one is added where it has none), and encoded with the
tokenizer: ``bytes`` (UTF-8 bytes, ids 0 to 255; no dependency), ``bpe:V`` (a byte-level BPE of at most V tokens
trained on the sources by the ``tokenizers`` library) or the path of a ``tokenizer.json`` the library saved; a BPE
tokenizer is saved in the folder, where ``snnfw generate`` finds it. The last ``val_share`` of the ids is the
validation split (``val.bin``), the rest ``train.bin``. ``meta.json`` is written last: a folder without one is not
read.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Iterator

from snnfw.data.text import (BYTES, TOKENIZER_FILE, ByteTokenizer, TokenizersBPE, TokenMeta, dtype_for,
                             import_tokenizers)
from snnfw.errors import ConfigError, DataError

BPE = "bpe:"
CHUNK = 1 << 22  # bytes copied at a time into val.bin


def documents(sources: list[Path]) -> Iterator[str]:
    """The documents of ``sources``, in order, each ending in a newline."""
    for source in sources:
        texts = _jsonl(source) if source.suffix == ".jsonl" else [_read(source)]
        for text in texts:
            yield text if text.endswith("\n") else text + "\n"


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{path} is not UTF-8 text (byte {err.start}); convert it, or leave it out") from None


def _jsonl(path: Path) -> Iterator[str]:
    for number, line in enumerate(_read(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            text = json.loads(line)["text"]
        except (ValueError, KeyError, TypeError):
            raise DataError(f"{path} line {number} is not a JSON object with a \"text\" field; fix the line, or give "
                            "the file as text under another suffix than .jsonl") from None
        if not isinstance(text, str):
            raise DataError(f"{path} line {number}: \"text\" is {type(text).__name__}, not a string; fix the line")
        yield text


def check_sources(sources: list[str]) -> list[Path]:
    paths = [Path(source) for source in sources]
    if missing := [str(path) for path in paths if not path.is_file()]:
        raise ConfigError(f"{', '.join(missing)}: no such file; name text or .jsonl files (a folder's with DIR/*.txt)")
    return paths


def tokenizer_for(name: str, sources: list[Path], out: Path):
    """The tokenizer ``--tokenizer name`` asks for, trained on ``sources`` for ``bpe:V``, and the name ``meta.json``
    records (a BPE tokenizer saved in ``out``)."""
    if name == BYTES:
        return ByteTokenizer(), BYTES
    if name.startswith(BPE):
        size = name[len(BPE):]
        if not size.isdigit() or int(size) < 257:
            raise ConfigError(f"--tokenizer {name}: bpe:V trains a BPE of V tokens over the 256 bytes, V an integer "
                              "above 256 (bpe:8192, say)")
        tokenizer = _train_bpe(int(size), sources)
    elif name.endswith(".json"):
        tokenizer = TokenizersBPE.from_file(name, f"--tokenizer {name}")
    else:
        raise ConfigError(f"--tokenizer {name!r} is none of bytes, bpe:VOCAB_SIZE or the path of a tokenizer.json")
    tokenizer.tokenizer.save(str(out / TOKENIZER_FILE))
    return tokenizer, TOKENIZER_FILE


def _train_bpe(size: int, sources: list[Path]) -> TokenizersBPE:
    tokenizers = import_tokenizers(f"--tokenizer bpe:{size}")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(documents(sources), trainer)
    return TokenizersBPE(tokenizer)


def tokenize(sources: list[str], out: str | Path, tokenizer_name: str = BYTES, val_share: float = 0.01) -> str:
    """Writes the token folder ``out`` from ``sources``; returns the line that says what was written."""
    import numpy as np

    if not 0 < val_share < 1:
        raise ConfigError(f"--val-share is the share of the ids held out for validation, between 0 and 1 (0.01, "
                          f"say); got {val_share}")
    paths, out = check_sources(sources), Path(out)
    if (out / "meta.json").exists():
        raise ConfigError(f"{out} already holds a token folder; remove it, or name another --out")
    out.mkdir(parents=True, exist_ok=True)
    tokenizer, recorded = tokenizer_for(tokenizer_name, paths, out)
    dtype = dtype_for(tokenizer.vocab_size)
    train, val = TokenMeta.split_path(out, "train"), TokenMeta.split_path(out, "test")
    text_bytes = count = docs = 0
    with train.open("wb") as ids:
        for document in documents(paths):
            encoded = np.asarray(tokenizer.encode(document), dtype=dtype)
            encoded.tofile(ids)
            text_bytes, count, docs = text_bytes + len(document.encode("utf-8")), count + len(encoded), docs + 1
    held_out = math.ceil(count * val_share)
    if count - held_out < 1:
        raise ConfigError(f"the sources hold {count} token(s), too few to split; give more text")
    _move_tail(train, val, held_out, dtype)
    meta = TokenMeta(dtype, tokenizer.vocab_size, text_bytes / count, recorded,
                     {"train": count - held_out, "val": held_out})
    meta.write(out)
    return (f"tokenized {docs:,} document(s) of {len(paths)} file(s) with {tokenizer_name}: {count:,} tokens "
            f"({count - held_out:,} train, {held_out:,} val), vocabulary {tokenizer.vocab_size:,} ({dtype}), "
            f"{meta.bytes_per_token:.3f} bytes a token -> {out}")


def _move_tail(train: Path, val: Path, held_out: int, dtype: str) -> None:
    """Moves the last ``held_out`` ids of ``train`` into ``val``."""
    import numpy as np

    width = np.dtype(dtype).itemsize
    keep = train.stat().st_size // width - held_out
    with train.open("rb") as source, val.open("wb") as target:
        source.seek(keep * width)
        shutil.copyfileobj(source, target, CHUNK)
    with train.open("r+b") as source:
        source.truncate(keep * width)
