"""DCP's ``.metadata`` read through an allowlist: a checkpoint from elsewhere builds no code when it is read."""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import StorageMeta


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only DCP's metadata classes, torch sizes, dtypes and layouts, and paths."""

    MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
    NAMES = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")}

    def find_class(self, module, name):
        if module in self.MODULES or module == "torch" or (module, name) in self.NAMES:
            found = super().find_class(module, name)
            if (module, name) in self.NAMES or isinstance(found, torch.dtype) or (
                module in self.MODULES and isinstance(found, type) and found.__module__ == module
            ):
                return found
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is not allowed")


class SafeReader(FileSystemReader):
    """DCP's reader, unpickling ``.metadata`` through the allowlist."""

    def read_metadata(self, *args, **kwargs):
        with open(Path(self.path) / ".metadata", "rb") as stream:
            metadata = _MetadataUnpickler(stream).load()
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def metadata_of(path: Path):
    """DCP's ``.metadata`` of checkpoint ``path``, unpickled through the allowlist."""
    return SafeReader(path).read_metadata()
