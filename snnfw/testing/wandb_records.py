"""The history an offline Weights & Biases run recorded, read back from its ``run-*.wandb`` file: LevelDB's log
format (32 KiB blocks of records with 7-byte headers, after a 7-byte ``:W&B`` header) holding wandb's protobuf
``Record`` messages."""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def offline_history(run_dir: Path) -> list[dict]:
    """Each logged row of the newest offline run under ``run_dir/wandb``, as ``{key: value}``."""
    from wandb.proto import wandb_internal_pb2

    path = max((Path(run_dir) / "wandb").glob("offline-run-*/run-*.wandb"), key=lambda p: p.stat().st_mtime)
    rows = []
    for raw in _records(path.read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def _records(data: bytes) -> list[bytes]:
    records, pending, position = [], b"", HEADER
    while position + HEADER <= len(data):
        left = BLOCK - position % BLOCK
        _, length, kind = struct.unpack("<IHB", data[position:position + HEADER]) if left >= HEADER else (0, 0, 0)
        if kind == 0:  # a block's padding
            position += left
            continue
        chunk = data[position + HEADER:position + HEADER + length]
        position += HEADER + length
        if kind == FULL:
            records.append(chunk)
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            records.append(pending + chunk)
    return records
